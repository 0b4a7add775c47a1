"""Offline engine: ``LLM.generate`` drives the jitted engine step from a host loop.

Data flows one way: config → model/params → state → jitted step → host loop. The host admits
waiting requests into idle slots (continuous batching), picks each step's prefill chunks and token
bucket, calls the one compiled step, and reads back only the emitted tokens and a few flags.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jmtp.model.config import ModelConfig
from jmtp.model.llama import init_kv_cache
from jmtp.runtime.buckets import choose_bucket, step_buckets
from jmtp.runtime.config import EngineConfig, SpeculativeConfig
from jmtp.runtime.outputs import RequestOutput, SpecDecodeMetrics
from jmtp.runtime.sampling import SamplingParams, make_row
from jmtp.runtime.spec_policy import DynamicSpeculation
from jmtp.runtime.state import FINISH_REASONS, init_state, insert_request
from jmtp.runtime.step import engine_step, release_slot

log = logging.getLogger(__name__)


def default_dtype():
    """fp32 on CPU (≈5× faster than bf16 matmuls there), bf16 on TPU/GPU."""
    return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16


@dataclasses.dataclass
class _Request:
    request_id: int
    prompt: str | None
    prompt_ids: list[int]          # original prompt
    params: SamplingParams
    output_ids: list[int] = dataclasses.field(default_factory=list)
    metrics: SpecDecodeMetrics = dataclasses.field(default_factory=SpecDecodeMetrics)
    # per admission
    context_ids: list[int] = dataclasses.field(default_factory=list)  # prompt + outputs at admission
    prefilled: int = 0
    finish_reason: str | None = None
    bad_words_ids: list[list[int]] = dataclasses.field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    seed: int = 0                  # request seed when SamplingParams.seed is None


def with_draft_vocab(cfg: ModelConfig, params: dict, draft_vocab_size: int | None
                     ) -> tuple[dict, int]:
    """Attach the FR-Spec draft LM head to ``params`` (see ``SpeculativeConfig.draft_vocab_size``).

    Returns ``(params, N)``; with ``N > 0`` the new params hold ``draft_ids i32[N]`` (the N
    top-ranked ids of ``params["draft_vocab"]``) and ``draft_head f[N, H]`` (their LM-head rows),
    which the MTP proposer scores instead of the full LM head.

    Raises:
      ValueError: N > 0 without a ranking ``params["draft_vocab"]``, or N above its length.
    """
    n = cfg.draft_vocab_size if draft_vocab_size is None else draft_vocab_size
    params = {k: v for k, v in params.items() if k not in ("draft_ids", "draft_head")}
    if n == 0 or n >= cfg.vocab_size:
        return params, 0
    ranking = params.get("draft_vocab")
    if ranking is None:
        raise ValueError(f"SpeculativeConfig.draft_vocab_size={n} needs a token ranking "
                         "params['draft_vocab'] (shipped with a trained MTP head, see jmtp.train)")
    if n > len(ranking):
        raise ValueError(f"SpeculativeConfig.draft_vocab_size={n} exceeds the {len(ranking)} ranked "
                         "ids of params['draft_vocab']")
    ids = jnp.asarray(np.asarray(ranking)[:n], jnp.int32)
    head = params["embed"][ids] if "lm_head" not in params else params["lm_head"][:, ids].T
    return dict(params, draft_ids=ids, draft_head=head), n


class LLM:
    """Offline generation with MTP speculative decoding (vLLM ``LLM`` shape).

    Args:
      model: GGUF file or HF directory; ``None`` = the default SmolLM2-135M-Instruct.
      speculative_config: :class:`SpeculativeConfig`; ``None`` disables speculation.
      max_num_seqs: batch slots B.
      max_model_len: prompt + generated tokens per request.
      block_size: KV block size (positions).
      num_blocks: KV blocks; default: enough for every slot at max_model_len.
      max_num_batched_tokens: token budget per step (largest bucket).
      dtype: parameter/cache dtype (default fp32 on CPU, bf16 on accelerators).
      attention_backend: ``"reference" | "xla" | "pallas_tpu" | "pallas_gpu" | None`` (None = the
        backend's default: ``"xla"`` on CPU).
      max_logprobs: largest ``SamplingParams.logprobs`` served (0 = logprobs off: nothing extra
        is computed in the step).
      seed: seeds the per-request seeds of requests whose ``SamplingParams.seed`` is None.
      model_config / params / tokenizer: pass an already-built model instead of ``model``.
      mtp_head: with ``model``: ``"auto"`` (the checkpoint's MTP weights, else the head jmtp ships
        for it, else a fresh one), ``None`` (never the shipped head) or a head file; see
        :func:`jmtp.model.loader.load_checkpoint`.
      compile: ``"eager"``: compile the step for every token bucket (and the request
        insert/release) here, with a progress bar, so ``generate`` never compiles; ``"lazy"``:
        compile each bucket on its first use inside ``generate``. ``None``: ``$JMTP_COMPILE``,
        default ``"eager"``. See :mod:`jmtp.runtime.compile`.
      compilation_cache_dir: JAX's persistent compilation cache folder. ``"auto"``: JAX's own
        setting if the user made one, else ``$JMTP_CACHE_DIR``, ``$XDG_CACHE_HOME/jmtp/xla`` or
        ``~/.cache/jmtp/xla`` (``JMTP_CACHE_DIR=off`` disables it); a path; ``None``/``False``:
        leave JAX's configuration alone. See :func:`jmtp.runtime.compile.setup_compilation_cache`.

    Raises:
      ValueError: bad configuration (see :class:`EngineConfig`, :class:`SpeculativeConfig`) or an
        unknown model path.
    """

    def __init__(self, model: str | None = None, *, speculative_config: SpeculativeConfig | None = None,
                 max_num_seqs: int = 8, max_model_len: int = 2048, block_size: int = 16,
                 num_blocks: int | None = None, max_num_batched_tokens: int | None = None,
                 dtype=None, attention_backend: str | None = None, max_logprobs: int = 0,
                 seed: int = 0, model_config: ModelConfig | None = None, params: dict | None = None,
                 tokenizer=None, mtp_head: str | None = "auto", compile: str | None = None,
                 compilation_cache_dir: str | bool | None = "auto"):
        from jmtp.runtime import compile as jc
        compile = jc.resolve_compile_mode(compile)
        self.compilation_cache_dir = jc.setup_compilation_cache(compilation_cache_dir)
        dtype = jnp.dtype(dtype or default_dtype())
        if not jnp.issubdtype(dtype, jnp.floating):
            raise ValueError(f"dtype must be a floating dtype, got {dtype}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if params is None:
            from jmtp.model.loader import load_checkpoint, load_tokenizer
            model_config, params = load_checkpoint(model, dtype=dtype, mtp_head=mtp_head)
            if tokenizer is None:
                tokenizer = load_tokenizer(model)
        elif model_config is None:
            raise ValueError("model_config is required when params are given")
        else:
            from jmtp.model.params import check_params
            # An MTP head is optional unless method="mtp" (checked below).
            check_params(model_config if "mtp" in params else
                         model_config.replace(num_mtp_layers=0), params, "params")
        if not 0 <= max_logprobs <= model_config.vocab_size:
            raise ValueError(f"max_logprobs must lie in [0, vocab_size={model_config.vocab_size}], "
                             f"got {max_logprobs}")
        from jmtp.pallas.ragged_paged_attention import IMPLEMENTATIONS
        if attention_backend not in (None,) + IMPLEMENTATIONS:
            raise ValueError(f"attention_backend must be one of {IMPLEMENTATIONS} or None, got "
                             f"{attention_backend!r}")
        spec = speculative_config or SpeculativeConfig(method=None)
        if spec.method == "mtp" and "mtp" not in params:
            raise ValueError("speculative method 'mtp' needs MTP weights (params['mtp'])")
        self.model_config = model_config
        self.draft_vocab_size = 0
        if spec.method == "mtp":
            params, self.draft_vocab_size = with_draft_vocab(model_config, params, spec.draft_vocab_size)
        self.params = params
        self.tokenizer = tokenizer
        self.speculative_config = spec
        if max_num_batched_tokens is None:
            max_num_batched_tokens = max(256, max_num_seqs * (spec.k + 1))
        ec = EngineConfig(
            max_num_seqs=max_num_seqs, max_model_len=max_model_len, block_size=block_size,
            num_blocks=num_blocks or 1, max_num_batched_tokens=max_num_batched_tokens,
            max_stop_ids=8, max_logprobs=max_logprobs, spec=spec)
        if not num_blocks:      # default: every slot can hold a full-length sequence
            ec = dataclasses.replace(ec, num_blocks=max_num_seqs * ec.pages_per_seq)
        self.engine_config = ec
        self._seed_rng = np.random.default_rng(seed)
        self.attention_backend = attention_backend
        ec = self.engine_config
        self.state = init_state(ec, model_config.vocab_size)
        self.cache = init_kv_cache(model_config, model_config.num_layers, ec.num_blocks, block_size, dtype)
        self.mtp_cache = (init_kv_cache(model_config, max(model_config.num_mtp_layers, 1),
                                        ec.num_blocks, block_size, dtype)
                          if spec.method == "mtp" else None)
        self._step = jax.jit(engine_step, static_argnums=(0, 1, 2, 3, 4), donate_argnums=(6, 7, 8))
        self._insert = jax.jit(insert_request, donate_argnums=0)
        self._release = jax.jit(release_slot, donate_argnums=0)
        self._free_count = ec.num_blocks
        self.last_run_stats: dict = {}
        self.spec_policy = (DynamicSpeculation(max_num_seqs, spec.k, ec.token_buckets())
                            if spec.enabled and spec.speculation_policy == "dynamic" else None)
        self._next_drafts = np.zeros((max_num_seqs,), np.int32)  # drafts in each slot's window
        self.compile_seconds = self._compile_ahead() if compile == "eager" else {}

    def _compile_ahead(self) -> dict:
        """Compile every step bucket and the request insert/release; ``{label: seconds}``."""
        from jmtp.runtime.compile import compile_ahead
        ec, mc = self.engine_config, self.model_config
        buckets = step_buckets(ec)
        static = (mc, ec, self.speculative_config.drafter)
        # Host arrays go through jnp.asarray as in generate (that stages them with a small jit).
        chunks = jnp.asarray(np.zeros((ec.max_num_seqs,), np.int32))
        limits = jnp.asarray(np.zeros((ec.max_num_seqs,), np.int32))
        times = compile_ahead(self._step, [
            static + (T, self.attention_backend, self.params, self.state, self.cache,
                      self.mtp_cache, chunks) for T in buckets],
            labels=[f"T={T}" for T in buckets], desc="compile step buckets")
        row = self._sampling_row(SamplingParams(), [0], [], 0)
        times.update(compile_ahead(self._insert, [(
            self.state, jnp.int32(0), jnp.asarray(np.zeros((ec.seq_buffer_len,), np.int32)),
            jnp.int32(1), jnp.int32(1), {k: jnp.asarray(v) for k, v in row.items()})], labels=["insert"],
            progress=False))
        times.update(compile_ahead(self._release, [(self.state, jnp.int32(0))], labels=["release"],
                                   progress=False))
        return times

    # ------------------------------------------------------------------ validation
    def _validate(self, prompt_ids: list[int], sp: SamplingParams, where: str):
        ec, mc = self.engine_config, self.model_config
        if len(prompt_ids) == 0:
            raise ValueError(f"{where}: prompt is empty (a prompt needs at least one token)")
        if len(prompt_ids) >= ec.max_model_len:
            raise ValueError(
                f"{where}: prompt has {len(prompt_ids)} tokens; max_model_len={ec.max_model_len} "
                "leaves no room to generate (prompt must be shorter than max_model_len)")
        bad = [t for t in prompt_ids if not 0 <= t < mc.vocab_size]
        if bad:
            raise ValueError(f"{where}: token id {bad[0]} outside [0, vocab_size={mc.vocab_size})")
        need = -(-(min(len(prompt_ids) + sp.max_tokens, ec.max_model_len) + ec.k + ec.m)
                 // ec.block_size)
        if need > ec.num_blocks:
            raise ValueError(
                f"{where}: the request needs up to {need} KV blocks but num_blocks={ec.num_blocks}")
        if sp.logprobs is not None and max(sp.logprobs, 1) > ec.max_logprobs:
            raise ValueError(f"{where}: logprobs={sp.logprobs} exceeds max_logprobs="
                             f"{ec.max_logprobs} (set LLM(max_logprobs=...))")
        if sp.bad_words and self.tokenizer is None:
            raise ValueError(f"{where}: bad_words need a tokenizer (use bad_token_ids)")
        # Builds (and so validates) the sampling row: stop ids, bad words, capacities.
        self._sampling_row(sp, prompt_ids, self._bad_words_ids(sp), 0)

    def _bad_words_ids(self, sp: SamplingParams) -> list[list[int]]:
        out = []
        for wd in sp.bad_words:  # a word and its space-prefixed form, as vLLM does
            for variant in (wd, " " + wd.lstrip()):
                ids = list(self.tokenizer.encode(variant))
                if ids and ids not in out:
                    out.append(ids)
        return out

    def _sampling_row(self, sp, prompt_ids, bad_words_ids, seed):
        ec = self.engine_config
        return make_row(sp, prompt_ids, self.model_config.vocab_size, max_stop=ec.max_stop_ids,
                        max_bad_words=ec.max_bad_words, max_bad_word_len=ec.max_bad_word_len,
                        eos_ids=self.model_config.eos_token_ids, request_seed=seed,
                        bad_words_ids=bad_words_ids)

    # ------------------------------------------------------------------ generate
    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 *, use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for every prompt; results in input order.

        Args:
          prompts: a string, a list of strings, or a list of token-id lists.
          sampling_params: one :class:`SamplingParams` for all prompts, or one per prompt.
          use_tqdm: show a progress bar over finished requests.

        Raises:
          ValueError: empty prompt, prompt not shorter than max_model_len, token ids out of range,
            string prompts without a tokenizer — before anything runs.
        """
        if isinstance(prompts, np.ndarray):
            prompts = prompts.tolist()
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], (int, np.integer))):
            prompts = [prompts]
        if sampling_params is None:
            sampling_params = SamplingParams()
        sps = (list(sampling_params) if isinstance(sampling_params, (list, tuple))
               else [sampling_params] * len(prompts))
        for i, sp in enumerate(sps):
            if not isinstance(sp, SamplingParams):
                raise TypeError(f"sampling_params[{i}] must be a jmtp.SamplingParams, got "
                                f"{type(sp).__name__}")
        if len(sps) != len(prompts):
            raise ValueError(f"got {len(sps)} sampling_params for {len(prompts)} prompts")
        reqs = []
        for i, (p, sp) in enumerate(zip(prompts, sps)):
            if isinstance(p, str):
                if self.tokenizer is None:
                    raise ValueError(f"prompts[{i}]: string prompt but the engine has no tokenizer")
                ids, text = list(self.tokenizer.encode(p)), p
            else:
                arr = np.asarray(p)
                if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
                    raise ValueError(f"prompts[{i}]: a token-id prompt must be a flat list of "
                                     f"ints, got {arr.dtype} with shape {arr.shape}")
                ids, text = [int(t) for t in arr], None
            self._validate(ids, sp, f"prompts[{i}]")
            reqs.append(_Request(i, text, ids, sp, context_ids=list(ids),
                                 bad_words_ids=self._bad_words_ids(sp) if sp.bad_words else [],
                                 logprobs=[] if sp.logprobs is not None else None,
                                 seed=int(self._seed_rng.integers(0, 2**32))))
        return self._run(reqs, use_tqdm)

    def _run(self, reqs: list[_Request], use_tqdm: bool) -> list[RequestOutput]:
        ec, mc = self.engine_config, self.model_config
        B, W, bs = ec.max_num_seqs, ec.window, ec.block_size
        waiting = collections.deque(reqs)
        slots: list[_Request | None] = [None] * B
        order: list[int] = []           # admission order of occupied slots (for LIFO preemption)
        done: dict[int, RequestOutput] = {}
        bar = None
        if use_tqdm and len(reqs) > 1:
            from tqdm.auto import tqdm
            bar = tqdm(total=len(reqs), desc="generate", unit="req")
        t0, steps, gen_tokens = time.perf_counter(), 0, 0
        hold = False  # after a preemption, admit nothing until a running request finishes
        any_paused = False  # a slot waits for KV blocks: new requests must not take them
        while waiting or any(r is not None for r in slots):
            # Admit while a slot is idle and the free blocks cover the first prefill chunk.
            free = self._free_count
            if hold and not any(r is not None for r in slots):
                hold = False
            for b in range(B):
                if hold or any_paused or not waiting or slots[b] is not None:
                    continue
                r = waiting[0]
                first_chunk = min(len(r.context_ids), ec.max_num_batched_tokens)
                need = -(-(first_chunk + ec.m) // bs)
                if need > free and any(x is not None for x in slots):
                    break  # wait for running requests to free blocks
                waiting.popleft()
                self._admit(b, r)
                free -= need
                slots[b], _ = r, order.append(b)
            # Token budget: decode windows first, then prefill chunks in slot order.
            budget = ec.max_num_batched_tokens
            dec_rows = sum(1 + int(self._next_drafts[b]) for b, r in enumerate(slots)
                           if r is not None and r.prefilled >= len(r.context_ids))
            budget -= dec_rows
            chunks = np.zeros((B,), np.int32)
            for b, r in enumerate(slots):
                if r is not None and r.prefilled < len(r.context_ids):
                    c = min(len(r.context_ids) - r.prefilled, budget)
                    chunks[b], budget = c, budget - c
            total = dec_rows + int(chunks.sum())
            n_dec = sum(1 for r in slots if r is not None and r.prefilled >= len(r.context_ids))
            bucket = choose_bucket(ec, total, n_dec + int(np.count_nonzero(chunks)),
                                   bool(chunks.any()))
            limits = (np.full((B,), ec.k, np.int32) if self.spec_policy is None else
                      self.spec_policy.draft_limits(np.array([r is not None for r in slots])))
            t_step = time.perf_counter()
            self.state, self.cache, self.mtp_cache, out = self._step(
                mc, ec, self.speculative_config.drafter, bucket, self.attention_backend, self.params,
                self.state, self.cache, self.mtp_cache, jnp.asarray(chunks), jnp.asarray(limits))
            out = jax.device_get(out)
            self._next_drafts = np.asarray(out.num_next_drafts)
            if self.spec_policy is not None:
                self.spec_policy.observe(out.num_drafts, out.num_accepted, bucket.num_tokens,
                                         time.perf_counter() - t_step)
            steps += 1
            self._free_count = int(out.free_count)
            progressed = False
            any_paused = any(r is not None and out.paused[b] for b, r in enumerate(slots))
            for b, r in enumerate(slots):
                if r is None:
                    continue
                if out.paused[b]:
                    continue
                progressed = progressed or chunks[b] > 0 or out.num_tokens[b] > 0
                was_decode = r.prefilled >= len(r.context_ids)
                r.prefilled += int(chunks[b])
                n = int(out.num_tokens[b])
                r.output_ids += [int(x) for x in out.tokens[b, :n]]
                if r.logprobs is not None and n:
                    self._collect_logprobs(r, out, b, n)
                gen_tokens += n
                if was_decode and n:
                    mt = r.metrics
                    mt.num_decode_steps += 1
                    mt.num_decode_tokens += n
                    mt.num_draft_tokens += int(out.num_drafts[b])
                    a = int(out.num_accepted[b])
                    mt.num_accepted_tokens += a
                    for i in range(a):
                        mt.accepted_per_position[i] += 1
                if out.finished[b]:
                    r.finish_reason = FINISH_REASONS[int(out.finish_reason[b])]
                    done[r.request_id] = self._finish(r)
                    hold = False
                    slots[b] = None
                    order.remove(b)
                    if bar is not None:
                        bar.update(1)
            if not progressed and any_paused:
                self._preempt(slots, order, waiting)
                hold = True
        if bar is not None:
            bar.close()
        dt = time.perf_counter() - t0
        self.last_run_stats = dict(steps=steps, seconds=dt, generated_tokens=gen_tokens,
                                   tokens_per_second=gen_tokens / dt if dt > 0 else 0.0)
        return [done[r.request_id] for r in reqs]

    def _collect_logprobs(self, r: _Request, out, b: int, n: int):
        """vLLM shape: per emitted token, {token id: logprob} of the top-n plus the token itself."""
        k = r.params.logprobs
        for i in range(n):
            d = {int(t): float(v) for t, v in zip(out.top_logprob_ids[b, i, :k],
                                                   out.top_logprobs[b, i, :k])}
            d[int(out.tokens[b, i])] = float(out.logprobs[b, i])
            r.logprobs.append(d)

    def _admit(self, b: int, r: _Request):
        ec = self.engine_config
        ids = np.zeros((ec.seq_buffer_len,), np.int32)
        ids[: len(r.context_ids)] = r.context_ids
        row = self._sampling_row(r.params, r.prompt_ids, r.bad_words_ids, r.seed)
        if r.output_ids:  # re-admission after a preemption: restore the generated history
            row["output_counts"] += np.bincount(r.output_ids, minlength=self.model_config.vocab_size
                                                ).astype(np.int32)
            row["min_tokens"] = np.int32(max(r.params.min_tokens - len(r.output_ids), 0))
            tail = np.asarray(r.context_ids[-(ec.max_bad_word_len - 1):] if ec.max_bad_word_len > 1
                              else [], np.int32)
            row["recent_tokens"][ec.max_bad_word_len - 1 - tail.size:] = tail
        remaining = r.params.max_tokens - len(r.output_ids)
        r.prefilled = 0
        if self.spec_policy is not None:
            self.spec_policy.reset_slot(b)
        if not r.metrics.accepted_per_position:
            r.metrics.accepted_per_position = [0] * ec.k
        self.state = self._insert(self.state, jnp.int32(b), jnp.asarray(ids),
                                  jnp.int32(len(r.context_ids)), jnp.int32(remaining),
                                  {k: jnp.asarray(v) for k, v in row.items()})

    def _preempt(self, slots, order, waiting):
        """Every occupied slot is paused for KV blocks: preempt the newest (LIFO) and re-queue it
        with its generated tokens appended to the prompt (recomputed on re-admission)."""
        b = order.pop()
        r = slots[b]
        slots[b] = None
        log.info("preempting request %d (slot %d): out of KV blocks", r.request_id, b)
        self.state = self._release(self.state, jnp.int32(b))
        self._free_count = int(self.state.free_count)
        r.context_ids = r.prompt_ids + r.output_ids
        waiting.appendleft(r)

    def _finish(self, r: _Request) -> RequestOutput:
        text = self.tokenizer.decode(r.output_ids) if self.tokenizer is not None else ""
        return RequestOutput(request_id=r.request_id, prompt=r.prompt,
                             prompt_token_ids=list(r.prompt_ids), token_ids=list(r.output_ids),
                             text=text, finish_reason=r.finish_reason, metrics=r.metrics,
                             logprobs=r.logprobs)
