"""Responses of the frozen target to the training prompts (self-distillation answers).

* :func:`generate_tokens` — a small batched generator over :func:`jmtp.model.forward` (paged cache,
  ragged prefill + decode), greedy or sampled; it can also return the target's post-norm hidden
  states of every token, captured on the way.
* :func:`engine_generate` — the same through jmtp's own engine (``jmtp.runtime.host.llm.LLM``, no
  speculation), when :func:`engine_available`.

Both take and return token ids (prompts already chat-templated, see
:func:`jmtp.train.prompts.encode_chat`), so any tokenizer can be plugged in.
"""
from __future__ import annotations

import functools
from typing import Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jmtp.model.config import ModelConfig
from jmtp.model.llama import compute_logits, forward, init_kv_cache
from jmtp.model.metadata import ragged_batch


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
    if cfg.is_hybrid:
        raise ValueError("generate_tokens does not run hybrid linear-attention targets (its "
                         "one-sequence prefills have no recurrent state slots); generate with the "
                         "engine instead (jmtp.train.generation.engine_generate, train_mtp.py "
                         "--generator engine)")
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
    """As :func:`generate_tokens`, through jmtp's own engine (``jmtp.runtime.host.llm.LLM``, no
    speculation). Request ``i`` is seeded with ``seed * 1_000_003 + i``.

    Raises:
      ImportError: if the engine is not available.
    """
    from jmtp.runtime.host.llm import LLM
    from jmtp.runtime.host.sampling_params import SamplingParams

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
    """Whether ``jmtp.runtime.host.llm.LLM`` can be imported."""
    try:
        from jmtp.runtime.host.llm import LLM  # noqa: F401
        from jmtp.runtime.host.sampling_params import SamplingParams  # noqa: F401
    except ImportError:
        return False
    return True
