"""Engine and speculative-decoding configuration (static: hashable, passed to jit as static args)."""
from __future__ import annotations

import dataclasses
from typing import Callable

from jmtp.core.checks import check_one_of
from jmtp.core.platform import host_platform, platform_name
from jmtp.pallas.block_allocator import CHOICES as BLOCK_ALLOCATORS, blocks_needed
from jmtp.pallas.kv_quant import check_kv_cache_dtype

METHODS = (None, "mtp", "ngram", "suffix", "custom")
MTP_STRATEGIES = ("default", "with_ngram", "with_suffix")
#: Verification strategies of the step (:mod:`jmtp.runtime.device.verify` implements them).
VERIFY_STRATEGIES = ("auto", "greedy", "rejection", "topp", "target_match")
SPECULATION_POLICIES = ("fixed", "dynamic")
#: :class:`SpeculativeConfig` fields the device step never reads (the host's draft planning and
#: suffix trees): :meth:`EngineConfig.device_config` sets them to their defaults.
HOST_ONLY_SPEC_FIELDS = ("speculation_policy", "suffix_decoding_max_tree_depth",
                         "suffix_decoding_max_cached_requests", "suffix_decoding_corpus_tokens",
                         "suffix_decoding_max_spec_factor", "suffix_decoding_min_token_prob")


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding settings (vLLM/FastDeploy ``--speculative-config`` analog).

    Attributes:
      method: ``"mtp"`` (the model's MTP head drafts), ``"ngram"`` (prompt + history n-gram
        matching inside the jitted step, FastDeploy's ``ngram_match``; no MTP weights or cache;
        see :mod:`jmtp.runtime.device.ngram`), ``"suffix"`` (suffix decoding: the host drafts from
        suffix trees over each request's prompt and output and over earlier requests' outputs,
        :mod:`jmtp.runtime.host.suffix_decoding`; no MTP weights or cache), ``"custom"``
        (``drafter`` drafts; used by tests for oracle / null drafters) or ``None`` (no
        speculation).
      num_speculative_tokens: K, the verify window holds ``[last token, d1..dK]``.
      num_model_steps: M, MTP substeps (= drafts) per engine step, ``1 <= M <= K``. Substep ``s``
        uses MTP module ``s mod num_mtp_layers``, so one module is applied recursively. With M < K
        the window has room for K drafts but only M are proposed, unless
        ``mtp_strategy="with_ngram"`` fills the rest with n-gram matches.
      mtp_strategy: ``"default"``, ``"with_ngram"`` (FastDeploy's ``hybrid_mtp_ngram`` op:
        with M < K, the last n tokens of history + the M MTP drafts are matched against earlier
        history and the tokens following the match extend the drafts up to K) or
        ``"with_suffix"`` (per slot and window, the suffix draft, up to K tokens, where its score
        reaches M, else the M MTP drafts; the MTP head rests while a slot follows a suffix match:
        :mod:`jmtp.runtime.host.suffix_decoding`).
      max_ngram_size / min_ngram_size: n-gram sizes tried, longest first (``1 <= min <= max``).
        ``min_ngram_size=None`` = FastDeploy's default for the method: 1 for ``"ngram"``, 2 for
        the hybrid.
      speculation_policy: ``"fixed"`` (every slot drafts up to K each step) or ``"dynamic"``
        (:class:`jmtp.runtime.host.spec_policy.DynamicSpeculation`: per slot, the host picks the draft
        count 0..K that maximises expected tokens per second from the slot's measured acceptance
        (decayed counts) and the step time measured per step bucket (median of recent live
        steps, re-timed now and then while drafting); 0 where speculation cannot pay). Limits are a data input of the jitted step, so changing them never recompiles.
        Default ``"fixed"``: output and speed are then reproducible run to run, and with a good
        drafter fixed K is what FastDeploy and vLLM do; choose ``"dynamic"`` for loaded servers
        or weak drafters. With ``method="suffix"`` the drafts come from the host, and
        ``"dynamic"`` cuts them jointly over the batch each step: the tokens the suffix trees
        rate likeliest are kept while the expected tokens per second of the step (the trees'
        probabilities over the step's measured time in its bucket) grows
        (:mod:`jmtp.runtime.host.suffix_decoding`). With ``mtp_strategy="with_suffix"`` the
        policy plans the MTP drafts only, for slots not following a suffix match, and a window
        takes the suffix draft where its calibrated expected accepted tokens exceed the MTP
        drafts' (the suffix drafts are not cut).
      drafter: for ``method="custom"``: a hashable callable ``(state) -> i32[B, K]`` returning draft
        tokens (-1 = none) from the post-update :class:`~jmtp.runtime.device.state.EngineState`.
      verify_strategy: ``"auto"`` (greedy rows for temperature 0, rejection sampling otherwise;
        lossless), ``"greedy"``, ``"rejection"`` (Leviathan et al. 2023), ``"target_match"``, or
        ``"topp"`` (FastDeploy's top-p candidate rule, lossy; see :mod:`jmtp.runtime.device.verify`).
      max_candidate_len / verify_window: FastDeploy ``topp`` parameters (C and W).
      draft_sampling: sample drafts instead of taking the MTP argmax; the verifier then uses the
        exact draft distribution q (rejection sampling stays lossless). Greedy requests still draft
        greedily.
      draft_temperature / draft_top_p / draft_top_k: draft-side overrides (FastDeploy's
        ``FD_SPECULATE_SAMPLING_TOP_P/TOP_K``); None = the request's own value.
      draft_vocab_size: FR-Spec draft vocabulary (Zhao et al. 2025, arXiv 2502.14856): the MTP
        drafts are scored over the N most frequent tokens only (``params["draft_vocab"]``, ranked
        by the head's training data), which cuts the proposer's LM head from V to N rows. Output
        stays lossless (the target verifies; with ``draft_sampling`` q is exact, zero outside the N
        tokens). None = the model's default (``ModelConfig.draft_vocab_size``, set by the shipped
        head), 0 = the full vocabulary.
      suffix_decoding_max_tree_depth: the longest string the suffix trees count (a match plus
        its draft spans at most this many tokens); vLLM's name and default (24).
      suffix_decoding_max_cached_requests: how many requests' outputs the global suffix tree
        holds (running ones included; the oldest finished ones are evicted first); 0 turns the
        global tree off (each request then drafts from its own prompt and output only). vLLM's
        name and default (10000).
      suffix_decoding_corpus_tokens: the most output tokens the global tree holds (vLLM's name;
        jmtp's default 65536, not vLLM's 1M: the host trees are Python, about
        ``max_tree_depth`` nodes per token of text that repeats nothing, ~130 bytes each).
      suffix_decoding_max_spec_factor: a match of ``m`` tokens drafts at most
        ``floor(m * factor)`` tokens (and at most K); vLLM's name and default (1.0).
      suffix_decoding_min_token_prob: a draft stops before a token whose estimated probability
        (its count over the matched string's) is below this; vLLM's name and default (0.1).

    Raises:
      ValueError: unknown method or strategy, K < 1, M outside ``[1, K]``, custom method without
        drafter, a suffix knob out of range.
    """

    method: str | None = "mtp"
    num_speculative_tokens: int = 3
    num_model_steps: int | None = None
    drafter: Callable | None = None
    verify_strategy: str = "auto"
    max_candidate_len: int = 5
    verify_window: int = 2
    draft_sampling: bool = False
    draft_temperature: float | None = None
    draft_top_p: float | None = None
    draft_top_k: int | None = None
    draft_vocab_size: int | None = None
    mtp_strategy: str = "default"
    max_ngram_size: int = 5
    min_ngram_size: int | None = None
    speculation_policy: str = "fixed"
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 10000
    suffix_decoding_corpus_tokens: int = 65536
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1

    def __post_init__(self):
        check_one_of("SpeculativeConfig.verify_strategy", self.verify_strategy, VERIFY_STRATEGIES)
        if self.draft_vocab_size is not None and (
                not isinstance(self.draft_vocab_size, int) or self.draft_vocab_size < 0):
            raise ValueError(f"SpeculativeConfig.draft_vocab_size must be None or an int >= 0, got "
                             f"{self.draft_vocab_size!r}")
        check_one_of("SpeculativeConfig.method", self.method, METHODS)
        check_one_of("SpeculativeConfig.mtp_strategy", self.mtp_strategy, MTP_STRATEGIES)
        check_one_of("SpeculativeConfig.speculation_policy", self.speculation_policy,
                     SPECULATION_POLICIES)
        if not isinstance(self.max_ngram_size, int) or self.max_ngram_size < 1:
            raise ValueError(f"SpeculativeConfig.max_ngram_size must be an int >= 1, got "
                             f"{self.max_ngram_size!r}")
        mn = self.min_ngram_size
        if mn is not None and (not isinstance(mn, int) or not 1 <= mn <= self.max_ngram_size):
            raise ValueError(f"SpeculativeConfig.min_ngram_size must be an int in [1, "
                             f"max_ngram_size={self.max_ngram_size}], got {mn!r}")
        self._check_suffix()
        if self.method is None:
            return
        if self.mtp_strategy != "default" and self.method != "mtp":
            raise ValueError(f"SpeculativeConfig.mtp_strategy={self.mtp_strategy!r} needs "
                             "method='mtp'")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or k < 1:
            raise ValueError(f"SpeculativeConfig.num_speculative_tokens must be an int >= 1, got {k!r}")
        m = self.num_model_steps
        if m is not None and not (1 <= m <= k):
            raise ValueError(
                f"SpeculativeConfig.num_model_steps must lie in [1, num_speculative_tokens={k}], "
                f"got {m}")
        if self.draft_sampling and self.method != "mtp":
            raise ValueError("SpeculativeConfig.draft_sampling needs method='mtp' (the verifier "
                             "must know the distribution each draft was sampled from)")
        if self.method == "custom" and self.drafter is None:
            raise ValueError("SpeculativeConfig.drafter is required when method='custom'")

    def _check_suffix(self) -> None:
        ints = (("suffix_decoding_max_tree_depth", 2), ("suffix_decoding_max_cached_requests", 0),
                ("suffix_decoding_corpus_tokens", 1))
        for name, low in ints:
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < low:
                raise ValueError(f"SpeculativeConfig.{name} must be an int >= {low}, got {v!r}")
        f, p = self.suffix_decoding_max_spec_factor, self.suffix_decoding_min_token_prob
        if not isinstance(f, (int, float)) or isinstance(f, bool) or not f >= 0:
            raise ValueError("SpeculativeConfig.suffix_decoding_max_spec_factor must be a number "
                             f">= 0, got {f!r}")
        if not isinstance(p, (int, float)) or isinstance(p, bool) or not 0 <= p <= 1:
            raise ValueError("SpeculativeConfig.suffix_decoding_min_token_prob must lie in "
                             f"[0, 1], got {p!r}")

    @property
    def enabled(self) -> bool:
        return self.method is not None

    @property
    def uses_suffix(self) -> bool:
        """The host drafts by suffix decoding: ``method="suffix"`` or the MTP hybrid
        ``mtp_strategy="with_suffix"``."""
        return self.method == "suffix" or (self.method == "mtp"
                                           and self.mtp_strategy == "with_suffix")

    @property
    def ngram_sizes(self) -> tuple[int, int]:
        """``(min, max)`` n-gram sizes matched; ``(0, 0)`` when no n-gram matching runs (neither
        ``method="ngram"`` nor the hybrid with M < K)."""
        if self.method == "ngram":
            return (self.min_ngram_size or 1, self.max_ngram_size)
        if self.method == "mtp" and self.mtp_strategy == "with_ngram" and self.m < self.k:
            return (self.min_ngram_size or min(2, self.max_ngram_size), self.max_ngram_size)
        return (0, 0)

    @property
    def k(self) -> int:
        """Window drafts K (0 when speculation is off)."""
        return self.num_speculative_tokens if self.enabled else 0

    @property
    def m(self) -> int:
        """Drafts proposed per step M (0 when speculation is off)."""
        if not self.enabled:
            return 0
        return self.num_model_steps if self.num_model_steps is not None else self.num_speculative_tokens


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Static capacity of the engine; every state array's shape follows from it.

    Attributes:
      max_num_seqs: B, batch slots.
      max_model_len: Lmax, prompt + generated tokens per sequence.
      block_size: positions per KV block.
      num_blocks: physical KV blocks (shared ids for the target and MTP caches).
      max_num_batched_tokens: token budget of one step (largest bucket); prefill chunks fill what
        decode windows leave.
      max_stop_ids: width of the per-slot stop-token table (EOS ids + user stop ids).
      max_bad_words / max_bad_word_len: capacity for multi-token bad words per slot.
      max_logprobs: largest ``SamplingParams.logprobs`` served (0: logprobs off, nothing computed).
      max_logit_bias: ``SamplingParams.logit_bias`` entries a slot holds (its
        ``i32[B, max_logit_bias]`` ids and ``f32[B, max_logit_bias]`` biases).
      spec: the :class:`SpeculativeConfig`: the window drafts K and MTP substeps M (properties
        ``k``/``m``) and the verify and draft settings the step reads (``verify_strategy``,
        ``max_candidate_len``, ``verify_window``, ``draft_*``).
      block_allocator: the on-device KV-block allocator every allocator call of the step runs
        (:func:`jmtp.pallas.block_allocator.allocate_blocks`): ``"auto"`` (``"pallas_tpu"`` on
        TPU, ``"reference"`` elsewhere), ``"reference"`` (jnp), ``"pallas_tpu"`` (Mosaic kernel;
        TPU interpret mode off TPU; a state over its SMEM budget runs the reference instead, with
        a one-time warning) or ``"pallas_gpu"`` (Triton kernel; interpret mode off GPU).
      kv_cache_dtype: storage of the target and MTP KV caches (vLLM's option name): ``None`` (the
        model dtype), ``"int8"`` or ``"fp8_e4m3"`` (8-bit values, one f32 scale per token per KV
        head, quantised in the KV write and dequantised in attention; :mod:`jmtp.pallas.kv_quant`).
      enable_prefix_caching: vLLM's option name. The state then carries each slot's read-only
        shared prefix blocks (``num_shared``, ``shared_tables``), the step reads through them and
        no longer returns a finished slot's blocks itself: the host retires the slot, keeping
        the full blocks it caches (:mod:`jmtp.runtime.host.prefix_cache`).
      num_state_checkpoints: a hybrid model's block-boundary state checkpoints for prefix
        caching (entries of ``LinearState.saved``, :mod:`jmtp.model.state_checkpoints`), total
        over data shards: one per slot (the entry it captures into) plus the cached ones; 0
        without prefix caching or for a model without linear-attention layers.
      platform: the platform the step is compiled for (:data:`jmtp.core.platform.PLATFORMS`);
        ``None`` (default): the host's default backend, resolved at construction. It decides the
        ``"auto"`` allocator and whether Pallas kernels run in interpret mode
        (:mod:`jmtp.core.platform`); :class:`~jmtp.runtime.host.engine_args.EngineArgs` sets it from
        the engine's devices.

    Raises:
      ValueError: a size < 1, ``max_num_batched_tokens`` below ``max_num_seqs * (K+1)``,
        ``block_allocator`` not one of :data:`BLOCK_ALLOCATORS`, or ``kv_cache_dtype`` not one of
        :data:`jmtp.pallas.kv_quant.KV_CACHE_DTYPES`.
    """

    max_num_seqs: int = 8
    max_model_len: int = 2048
    block_size: int = 16
    num_blocks: int = 1024
    max_num_batched_tokens: int = 256
    max_stop_ids: int = 8
    max_bad_words: int = 4
    max_bad_word_len: int = 4
    max_logprobs: int = 0
    max_logit_bias: int = 300
    spec: SpeculativeConfig = SpeculativeConfig(method=None)
    block_allocator: str = "auto"
    kv_cache_dtype: str | None = None
    enable_prefix_caching: bool = False
    num_state_checkpoints: int = 0
    platform: str | None = None

    def __post_init__(self):
        # resolved once, here: the step's backend choices read this, never the host backend
        object.__setattr__(self, "platform", host_platform() if self.platform is None
                           else platform_name(self.platform))
        check_kv_cache_dtype(self.kv_cache_dtype, "EngineConfig.kv_cache_dtype")
        for name in ("max_num_seqs", "max_model_len", "block_size", "num_blocks",
                     "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        check_one_of("EngineConfig.block_allocator", self.block_allocator, BLOCK_ALLOCATORS)
        if self.max_num_batched_tokens < self.max_num_seqs * (self.k + 1):
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs * "
                f"(K+1) = {self.max_num_seqs * (self.k + 1)} so every decode window fits in a step")

    def device_config(self) -> "EngineConfig":
        """This config as the device step sees it: the :class:`SpeculativeConfig` fields only
        the host reads (:data:`HOST_ONLY_SPEC_FIELDS`; ``mtp_strategy="with_suffix"``, whose
        suffix drafts reach the step as data, reads as ``"default"``) at their defaults. The
        runner keys its jitted functions and :class:`~jmtp.runtime.device.spec.StepSpec` with
        it, so engines that differ only in host options share their compiled programs instead
        of tracing, lowering and compiling the same ones again. Returns ``self`` when nothing
        changes."""
        spec = self.spec
        host = {f: SpeculativeConfig.__dataclass_fields__[f].default
                for f in HOST_ONLY_SPEC_FIELDS}
        if spec.mtp_strategy == "with_suffix":
            host["mtp_strategy"] = "default"
        device = dataclasses.replace(spec, **host)
        return self if device == spec else dataclasses.replace(self, spec=device)

    @property
    def k(self) -> int:
        """Window drafts K (0 without speculation)."""
        return self.spec.k

    @property
    def mtp_substeps(self) -> int:
        """MTP substeps M the step runs (0 unless the MTP head drafts: an n-gram, suffix or
        custom drafter has none). Not :attr:`SpeculativeConfig.m`, the drafts asked of the
        drafter per step, which is K for a drafter without M."""
        return self.spec.m if self.spec.method == "mtp" else 0

    @property
    def window(self) -> int:
        """Verify window width K+1."""
        return self.k + 1

    @property
    def pages_per_seq(self) -> int:
        """Block-table width: covers max_model_len plus the speculative overhang K+M."""
        return blocks_needed(self.max_model_len + self.k + self.mtp_substeps, self.block_size)

    @property
    def seq_buffer_len(self) -> int:
        """Width of the per-slot token buffer ``input_ids``."""
        return self.max_model_len + self.k + 1

    def token_buckets(self) -> tuple[int, ...]:
        """Static token counts T a step may be compiled for: the decode buckets ``W, 2W, 4W, ...``
        below ``B*W`` and ``B*W`` itself (W = K+1: a decode-only step of ``a`` slots runs
        ``a*W`` rows rounded up to a power-of-two slot count, see :mod:`jmtp.runtime.device.buckets`), then
        the powers of two from 8 above ``B*W`` and, from 48 on, the midpoints ``1.5·2^j`` (48,
        96, 192, ...) between them (not one within 1/8 below the budget), then
        ``max_num_batched_tokens``.

        The midpoints bound a prefill chunk's padding at a third of its bucket instead of half:
        a 136-token prompt runs 192 rows, not 256 (prefill on a CPU costs about its rows).

        The smallest bucket is one decode window, not ``B*W`` rows, so one request on a
        ``max_num_seqs=8`` engine runs the rows of one request (on CPU a one-row matmul also takes
        XLA's matrix-vector path: 30 SmolLM2-sized fp32 layers in 42 ms instead of 134 ms for 8
        rows).
        """
        W, lo = self.window, self.max_num_seqs * self.window
        out, t = [lo], W
        while t < lo:
            out.append(t)
            t *= 2
        t = 8
        while t < self.max_num_batched_tokens:
            if t > lo:
                out.append(t)
            mid = t * 3 // 2   # not when the budget itself is within 1/8 above it
            if t >= 32 and lo < mid and mid * 9 // 8 <= self.max_num_batched_tokens:
                out.append(mid)
            t *= 2
        out.append(self.max_num_batched_tokens)
        return tuple(sorted(set(out)))
