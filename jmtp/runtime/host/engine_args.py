"""``EngineArgs``: the engine's arguments, checked and resolved once, and the device runner
they build (vLLM's ``EngineArgs`` / ``LLMEngine.from_engine_args``).

Data flows one way: arguments → model config and parameters (loaded, or given) → parameter
transforms (FR-Spec draft head, int8 key shift, unrolled layers) → :class:`EngineConfig` →
:class:`~jmtp.runtime.device.runner.DeviceRunner` (state, caches, jitted functions on one device or a
mesh). :class:`~jmtp.runtime.host.llm_engine.LLMEngine` takes the same keywords.
"""
from __future__ import annotations

import dataclasses
import logging

import jax
import jax.numpy as jnp
import numpy as np

from jmtp.core.checks import check_one_of
from jmtp.core.platform import host_platform, platform_of
from jmtp.model.config import ALL2ALL_BACKENDS, MOE_IMPLEMENTATIONS, ModelConfig
from jmtp.model.expert_parallel import check_expert_parallel, resolve_all2all_backend
from jmtp.model.kv_shift import with_k_shift
from jmtp.model.llama import param_dtype, unstack_layers
from jmtp.model.moe import resolve_implementation as resolve_moe
from jmtp.model.params import replicate_kv_heads
from jmtp.model.quant import QUANT_METHODS, dequantize, take_rows
from jmtp.pallas.kv_quant import check_kv_cache_dtype
from jmtp.pallas.ragged_paged_attention import IMPLEMENTATIONS
from jmtp.runtime.config import EngineConfig, SpeculativeConfig
from jmtp.runtime.device import sharding as shd
from jmtp.runtime.device.runner import DeviceRunner
from jmtp.runtime.process import compile as jc
from jmtp.runtime.process.host_maps import MapBudget
from jmtp.runtime.process.settings import prepare_process

log = logging.getLogger(__name__)

#: ``LLMEngine(layer_loop=...)`` values.
LAYER_LOOPS = ("auto", "scan", "unrolled")


def resolve_layer_loop(layer_loop: str, one_device: bool, platform: str | None = None) -> str:
    """The layer loop ``layer_loop="auto"`` stands for: ``"unrolled"`` on XLA:CPU with one device
    (there the scan copies every layer's weights out of the stack each step, which makes the
    engine step slower: figures in ``docs/performance.md``), else ``"scan"`` (a mesh needs the
    stacked layers; on TPU/GPU the scan compiles faster). Other values are returned as they are.

    Args:
      layer_loop: one of :data:`LAYER_LOOPS`.
      one_device: the engine runs on one device (no mesh, or a mesh of one device).
      platform: the platform compiled for (default: the host's, :mod:`jmtp.core.platform`).
    """
    if layer_loop != "auto":
        return layer_loop
    platform = platform or host_platform()
    return "unrolled" if platform == "cpu" and one_device else "scan"


def fit_layer_loop(num_layers: int, ec: EngineConfig, platform: str) -> str:
    """``"unrolled"``, or ``"scan"`` (logged) when the unrolled engine's step buckets would not fit
    in what is left of the process's memory-map budget (:func:`jmtp.runtime.process.host_maps.engine_maps`:
    an unrolled step maps each layer's kernels apart, the scan's once; if the scan's do not fit
    either, the budget refuses the compile that would cross the limit, with a ``MapLimitError``).
    XLA:CPU only; where nothing can be counted, ``"unrolled"``."""
    from jmtp.runtime.device.buckets import step_buckets
    from jmtp.runtime.process.host_maps import engine_maps, free_maps
    free = free_maps() if platform == "cpu" else None
    if free is None:
        return "unrolled"
    n = len(step_buckets(ec))
    unrolled, scan = engine_maps(n, num_layers, True), engine_maps(n, num_layers, False)
    if unrolled <= free:
        return "unrolled"
    log.warning("layer_loop='auto': the %d step buckets of an unrolled %d-layer step need ~%d "
                "memory mappings but only %d are left of vm.max_map_count; running the layers "
                "as a scan (~%d; slower steps on CPU). Close engines you no longer use "
                "(LLM.close) or raise the limit to keep the unrolled loop.", n, num_layers,
                unrolled, free, scan)
    return "scan"


def default_dtype(platform: str | None = None):
    """fp32 on CPU (much faster than bf16 matmuls there), bf16 on TPU/GPU. ``platform``: the
    platform compiled for (default: the host's)."""
    return jnp.float32 if (platform or host_platform()) == "cpu" else jnp.bfloat16


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
    if "lm_head" not in params:     # the tied table's rows (an int8 table's values and scales)
        head = take_rows(params["embed"], ids)
    else:
        head = dequantize(params["lm_head"], param_dtype(params))[:, ids].T
    return dict(params, draft_ids=ids, draft_head=head), n


@dataclasses.dataclass
class EngineArgs:
    """Every argument of :class:`~jmtp.runtime.host.llm_engine.LLMEngine` (and :class:`jmtp.LLM`).

    Fields:
      model: GGUF file or HF directory; ``None`` = the default SmolLM2-135M-Instruct.
      speculative_config: :class:`SpeculativeConfig`; ``None`` disables speculation.
      max_num_seqs: batch slots B (each sample of a request takes one).
      max_model_len: prompt + generated tokens per request.
      block_size: KV block size (positions).
      num_blocks: KV blocks; default: enough for every slot at max_model_len.
      max_num_batched_tokens: token budget per step (largest bucket).
      dtype: parameter/cache dtype (default fp32 on CPU, bf16 on accelerators).
      attention_backend: ``"reference" | "xla" | "pallas_tpu" | "pallas_gpu" | None``.
      moe_backend: routed-experts implementation of a MoE model (``MoEConfig.implementation``):
        ``"ragged"`` (sort by expert, ``jax.lax.ragged_dot``), ``"dense"`` (reference: every
        expert on every token), ``"auto"`` (ragged on TPU, dense elsewhere) or ``None`` (the
        model config's, default ``"auto"``). Ignored for a dense model.
      block_allocator: ``EngineConfig.block_allocator``: ``"auto"`` (default), ``"reference"``,
        ``"pallas_tpu"`` or ``"pallas_gpu"``.
      kv_cache_dtype: ``EngineConfig.kv_cache_dtype``: ``None`` (default: ``dtype``), ``"int8"``
        or ``"fp8_e4m3"`` for the target and the MTP cache (:mod:`jmtp.pallas.kv_quant`; bytes:
        :meth:`kv_cache_bytes`).
      quantization: 8-bit weights (vLLM's name; :mod:`jmtp.model.quant`): None (default) keeps
        the checkpoint's (a block-scaled FP8 checkpoint, auto-detected from its
        ``quantization_config``, stays 8-bit on the device), ``"int8"`` (weight-only, one scale
        per output channel, any checkpoint) or ``"fp8"`` (block-scaled ``float8_e4m3fn``, the
        checkpoint's blocks or 128x128): the decoder-block linears of the target and of the MTP
        layer; embeddings, LM head, norms and routers stay in ``dtype``. Bytes:
        :meth:`~jmtp.runtime.device.runner.DeviceRunner.param_bytes`.
      max_logprobs: largest ``SamplingParams.logprobs`` served (0 = logprobs off).
      seed: seeds the per-request seeds of requests whose ``SamplingParams.seed`` is None.
      model_config / params / tokenizer: pass an already-built model instead of ``model``.
      mtp_head: with ``model``: ``"auto"``, ``None`` or a head file
        (:func:`jmtp.model.checkpoints.loader.load_checkpoint`).
      compile: ``"eager"``: compile the step for every bucket of
        :func:`~jmtp.runtime.device.buckets.step_buckets` (and the request insert/release) here, with a
        progress bar, so no step compiles later; ``"lazy"``: compile each bucket on its first use
        (a step may run in a compiled bucket up to twice its size instead); ``"fewest"``: as
        lazy, a step runs in any compiled bucket that holds it (fewer compiles, more padded
        rows); ``"largest"``: every step runs in the largest bucket (the token budget over every
        slot), compiled on the first step: one step program per engine, every step padded to
        the budget (tests and quick runs on small models; the dynamic speculation policy, which
        prices each bucket it plans, still runs each step in its own).
        ``None``: ``$JMTP_COMPILE``, default ``"eager"``. See :mod:`jmtp.runtime.process.compile`.
      compilation_cache_dir: JAX's persistent compilation cache folder. ``"auto"``: JAX's own
        setting if the user made one, else ``$JMTP_CACHE_DIR``, ``$XDG_CACHE_HOME/jmtp/xla`` or
        ``~/.cache/jmtp/xla`` (``JMTP_CACHE_DIR=off`` disables it); a path; ``None``/``False``:
        leave JAX's configuration alone. See :func:`jmtp.runtime.process.compile.setup_compilation_cache`.
      tensor_parallel_size: devices of the ``model`` mesh axis (vLLM name): attention heads, MLP
        and vocabulary split over them (GSPMD; attention under ``shard_map``), see
        :mod:`jmtp.runtime.device.sharding`. Must divide ``num_heads`` and ``num_kv_heads``.
      data_parallel_size: devices of the ``data`` mesh axis (vLLM name): the ``max_num_seqs``
        slots, ``num_blocks`` KV blocks and ``max_num_batched_tokens`` step budget (all totals)
        split into that many shards, each with its own block pool and allocator; a request runs
        on one shard (the least loaded when it is admitted), see
        :mod:`jmtp.runtime.device.data_parallel`. Must divide the three sizes.
      mesh: a ``jax.sharding.Mesh`` with axes ``("data", "model")`` to use instead of one built
        from the two sizes (:func:`jmtp.runtime.device.sharding.make_mesh`).
      enable_expert_parallel: (vLLM name) split a MoE model's routed experts over every device of
        the mesh (``data × model``; each holds ``num_experts / (DP·TP)`` whole experts, which
        that number must divide) and dispatch each token to the devices owning its experts
        and back (:mod:`jmtp.model.expert_parallel`); attention stays split by request over
        ``data`` and by heads over ``model``, the shared experts over ``model``, the router
        replicated. Off (default): the experts are replicated over ``data`` and each one's
        width split over ``model``. No effect on one device or for a dense model (logged).
      all2all_backend: (vLLM name) the token dispatch under expert parallelism:
        ``"allgather_reducescatter"``, ``"ragged_all_to_all"`` or ``"auto"`` (default: by
        platform and mesh, :func:`jmtp.model.expert_parallel.resolve_all2all_backend`).
      enable_prefix_caching: reuse the target and MTP KV of full blocks of earlier requests'
        prompts and outputs (vLLM's option name; :mod:`jmtp.runtime.host.prefix_cache`); on a mesh
        each data shard caches its own blocks (:mod:`jmtp.runtime.host.prefix_slots`). A hybrid
        (gated-DeltaNet) model also keeps the linear layers' state at block boundaries
        (:mod:`jmtp.runtime.host.prefix_states`).
      max_cached_states: with prefix caching on a hybrid model: block-boundary state checkpoints
        kept beside the cached KV blocks (total over data shards, which it must divide; each
        takes ``LLMEngine.kv_cache_bytes()["prefix_state_entry"]`` bytes on the device, on top of
        one per slot). ``None``: ``max_num_seqs``. Ignored otherwise.
      devices: the devices the engine runs on (default ``jax.devices()``): the mesh is built
        from them, one device runs ``devices[0]``; their platform is the engine's
        (``EngineConfig.platform``: attention, allocator and MoE choices, kernel interpret mode,
        default dtype and layer loop). Compile-only TPU topology devices work with ``abstract``.
      abstract: build the engine from shapes only, no weights and no arrays
        (``model_config`` required; ``params`` may be given as ``jax.ShapeDtypeStruct``s, else
        their shapes come from the config): it compiles (:mod:`jmtp.aot`) but cannot run.
      layer_loop: how the step runs the target's decoder layers: ``"scan"`` (one ``lax.scan``
        over the stacked layers, compiles fastest), ``"unrolled"`` (a Python loop over per-layer
        weights, :func:`jmtp.model.llama.unstack_layers`; one device only: the parameter
        shardings are stated for the stacked layers) or ``"auto"``
        (default: :func:`resolve_layer_loop`, unrolled on XLA:CPU with one device, else scan;
        the scan instead, logged, when the unrolled step buckets would not fit in what is left of
        the process's memory-map budget, :func:`fit_layer_loop`).
        On XLA:CPU the scan copies each layer's weights out of the stack before its matmuls
        (in a profile of a SmolLM2 decode step those copies took longer than the matmuls),
        which ``"unrolled"`` avoids, at the price of a compile about twice as long (figures in
        ``docs/performance.md``; the persistent compilation cache keeps it to the first start). Unrolled layers are copies of the stacked ones: a caller that passes ``params``
        and keeps them holds the layer weights twice. The chosen loop is :attr:`layer_loop`.
      batch_invariant: compute every row of a step in an order independent of the other rows
        (``ModelConfig.batch_invariant``, :mod:`jmtp.model.invariant`): the target's logits of a
        token are bit-identical in a verify window and in a one-row decode step, alone or among
        any batch mates, in any bucket and prefill chunk, so greedy speculative output equals
        plain greedy output bit for bit (also in bf16 and with 8-bit KV caches) and a request's
        tokens never depend on its batch mates (sampled ones too, with the fixed speculation
        policy: the dynamic one picks draft counts by timing). Slower steps (figures in
        ``docs/performance.md``); attention runs the ``"xla"`` implementation. Dense attention
        models on one device only (MLA, MoE and hybrid targets and meshes raise ``ValueError``).
      async_scheduling: dispatch each engine step before the previous step's outputs are read
        back, so the host's work on them (detokenising, stop strings, logprobs, outputs, the
        dynamic policy, admissions) overlaps the next step on the device (vLLM's option name;
        :mod:`jmtp.runtime.host.inflight`); outputs are the same either way. ``None`` (default): on
        for GPU and TPU unless an n-gram or suffix proposer runs, off on CPU, where the host and
        XLA's device share the cores (:func:`~jmtp.runtime.host.inflight.default_async_scheduling`);
        ``LLMEngine.async_scheduling`` can be changed between steps.

    Raises (from :meth:`build`):
      ValueError: bad configuration (see :class:`EngineConfig`, :class:`SpeculativeConfig`) or an
        unknown model path.
    """

    model: str | None = None
    speculative_config: SpeculativeConfig | None = None
    max_num_seqs: int = 8
    max_model_len: int = 2048
    block_size: int = 16
    num_blocks: int | None = None
    max_num_batched_tokens: int | None = None
    dtype: object = None
    attention_backend: str | None = None
    max_logprobs: int = 0
    seed: int = 0
    model_config: ModelConfig | None = None
    params: dict | None = None
    tokenizer: object = None
    mtp_head: str | None = "auto"
    compile: str | None = None
    compilation_cache_dir: str | bool | None = "auto"
    block_allocator: str = "auto"
    kv_cache_dtype: str | None = None
    quantization: str | None = None
    moe_backend: str | None = None
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    mesh: object = None
    enable_expert_parallel: bool = False
    all2all_backend: str = "auto"
    enable_prefix_caching: bool = False
    max_cached_states: int | None = None
    layer_loop: str = "auto"
    devices: object = None
    abstract: bool = False
    batch_invariant: bool = False
    async_scheduling: bool | None = None

    def build(self) -> "BuiltEngine":
        """Check the arguments, load the model if needed and build the runner."""
        a = self
        # process-wide settings first: the malloc tuning works best before a JAX backend starts
        cache_dir = prepare_process(a.compilation_cache_dir)
        check_kv_cache_dtype(a.kv_cache_dtype)   # before anything is loaded
        if a.quantization not in (None,) + QUANT_METHODS:
            raise ValueError(f"quantization must be one of {QUANT_METHODS} or None, got "
                             f"{a.quantization!r}")
        check_one_of("layer_loop", a.layer_loop, LAYER_LOOPS)
        devices = (list(a.mesh.devices.flat) if a.mesh is not None
                   else list(a.devices) if a.devices is not None else None)
        platform = platform_of(devices) if devices else host_platform()
        one_device = (a.mesh.size == 1 if a.mesh is not None
                      else (a.tensor_parallel_size, a.data_parallel_size) == (1, 1))
        layer_loop = resolve_layer_loop(a.layer_loop, one_device, platform)
        if layer_loop == "unrolled" and not one_device:
            raise ValueError("layer_loop='unrolled' with a device mesh is not supported: the "
                             "parameter shardings are stated for the stacked layers; use "
                             "layer_loop='scan'")
        compile_mode = jc.resolve_compile_mode(a.compile)
        dtype = jnp.dtype(a.dtype or default_dtype(platform))
        if not jnp.issubdtype(dtype, jnp.floating):
            raise ValueError(f"dtype must be a floating dtype, got {dtype}")
        if a.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {a.block_size}")
        model_config, params, tokenizer = a.model_config, a.params, a.tokenizer
        spec = a.speculative_config or SpeculativeConfig(method=None)
        if a.abstract:
            if model_config is None:
                raise ValueError("abstract=True needs model_config (the engine is built from "
                                 "shapes; jmtp.model.checkpoints.loader.load_config reads one from a model file)")
            if a.quantization is not None:
                from jmtp.model.quant_params import config_quantization
                model_config = config_quantization(model_config, a.quantization)
            params = params if params is not None else abstract_params(
                model_config, dtype, spec.method == "mtp", a.kv_cache_dtype)
        elif params is None:
            from jmtp.model.checkpoints.loader import load_checkpoint, load_tokenizer
            model_config, params = load_checkpoint(a.model, dtype=dtype, mtp_head=a.mtp_head,
                                                   quantization=a.quantization)
            if tokenizer is None:
                tokenizer = load_tokenizer(a.model)
        elif model_config is None:
            raise ValueError("model_config is required when params are given")
        else:
            from jmtp.model.params import check_params
            from jmtp.model.quant_params import with_quantization
            # An MTP head is optional unless method="mtp" (checked below).
            check_params(model_config if "mtp" in params else
                         model_config.replace(num_mtp_layers=0), params, "params")
            model_config, params = with_quantization(model_config, params, a.quantization)
        if not 0 <= a.max_logprobs <= model_config.vocab_size:
            raise ValueError(f"max_logprobs must lie in [0, vocab_size={model_config.vocab_size}], "
                             f"got {a.max_logprobs}")
        if a.attention_backend not in (None,) + IMPLEMENTATIONS:
            raise ValueError(f"attention_backend must be one of {IMPLEMENTATIONS} or None, got "
                             f"{a.attention_backend!r}")
        if a.moe_backend not in (None,) + MOE_IMPLEMENTATIONS:
            raise ValueError(f"moe_backend must be one of {MOE_IMPLEMENTATIONS} or None, got "
                             f"{a.moe_backend!r}")
        if model_config.moe is not None:   # "auto" resolved once, for the engine's platform
            model_config = model_config.replace(moe=model_config.moe.replace(
                implementation=resolve_moe(a.moe_backend or model_config.moe.implementation,
                                           platform)))
        check_one_of("all2all_backend", a.all2all_backend, ALL2ALL_BACKENDS)
        if spec.method == "mtp" and "mtp" not in params:
            raise ValueError("speculative method 'mtp' needs MTP weights (params['mtp'])")
        num_states = _state_checkpoints(a, model_config)
        if a.batch_invariant:
            model_config = _batch_invariant(a, model_config, one_device)
        mesh = _make_mesh(model_config, a.tensor_parallel_size, a.data_parallel_size, a.mesh,
                          devices)
        draft_vocab_size = 0
        if spec.method == "mtp":
            params, draft_vocab_size = with_draft_vocab(model_config, params,
                                                        spec.draft_vocab_size)
        # An int8 cache stores keys minus a calibrated per-layer mean (jmtp.model.kv_shift).
        params = with_k_shift(model_config, params, a.kv_cache_dtype)
        tp = shd.mesh_sizes(mesh)[1] if mesh is not None else 1
        if (not model_config.is_mla and tp > model_config.num_kv_heads
                and tp % model_config.num_kv_heads == 0):
            factor = tp // model_config.num_kv_heads
            log.info("tensor_parallel_size=%d > num_kv_heads=%d: each kv head replicated %dx",
                     tp, model_config.num_kv_heads, factor)
            model_config, params = replicate_kv_heads(model_config, params, factor)
        if mesh is not None:
            shd.check_tensor_parallel(model_config, tp)
        if a.enable_expert_parallel:
            model_config = _with_expert_parallel(model_config, mesh, platform, a.all2all_backend)
        dp = shd.mesh_sizes(mesh)[0] if mesh is not None else 1
        tokens = a.max_num_batched_tokens
        if tokens is None:   # (a multiple of data_parallel_size: split per shard)
            tokens = -(-max(256, a.max_num_seqs * (spec.k + 1)) // dp) * dp
        ec = EngineConfig(
            max_num_seqs=a.max_num_seqs, max_model_len=a.max_model_len, block_size=a.block_size,
            num_blocks=a.num_blocks or 1, max_num_batched_tokens=tokens, max_stop_ids=8,
            max_logprobs=a.max_logprobs, spec=spec, block_allocator=a.block_allocator,
            kv_cache_dtype=a.kv_cache_dtype, enable_prefix_caching=bool(a.enable_prefix_caching),
            num_state_checkpoints=num_states, platform=platform)
        if not a.num_blocks:      # default: every slot can hold a full-length sequence
            ec = dataclasses.replace(ec, num_blocks=a.max_num_seqs * ec.pages_per_seq)
        if a.layer_loop == "auto" and layer_loop == "unrolled" and not model_config.is_hybrid:
            layer_loop = fit_layer_loop(model_config.num_layers, ec, platform)
        if layer_loop == "unrolled":
            params = unstack_layers(params)
        if model_config.is_hybrid:   # per-layer dicts: the layers always run as an unrolled loop
            layer_loop = "unrolled"
        num_mtp_cache_layers = max(model_config.num_mtp_layers, 1) if spec.method == "mtp" else 0
        if spec.method == "mtp" and model_config.num_mtp_layers > 1 and spec.k > 1:
            # Known limitation (docs/architecture.md, the MTP's shadow state): MTP module j >= 1
            # writes its own cache only at draft positions, so its attention also reads entries
            # it never wrote.
            log.warning("num_mtp_layers=%d: MTP modules after the first attend over a partly "
                        "written MTP cache; drafts 2..K may depend on earlier requests (greedy "
                        "output stays lossless; acceptance and seeded sampled output may vary)",
                        model_config.num_mtp_layers)
        runner = DeviceRunner(model_config, params, ec, mesh=mesh, dtype=dtype,
                              attention_backend="xla" if a.batch_invariant else attention_fallback(
                                  a.attention_backend, platform, a.kv_cache_dtype, a.block_size),
                              num_mtp_cache_layers=num_mtp_cache_layers,
                              compile_ahead=jc.compile_ahead, map_budget=MapBudget("step bucket"),
                              compile_mode=compile_mode, abstract=bool(a.abstract),
                              device=devices[0] if devices and mesh is None else None)
        if mesh is not None and not a.abstract:
            log.info("mesh %s: %s", dict(mesh.shape), runner.memory_per_device())
        return BuiltEngine(runner, tokenizer, draft_vocab_size, layer_loop, compile_mode,
                           cache_dir, a.async_scheduling)


@dataclasses.dataclass
class BuiltEngine:
    """What :meth:`EngineArgs.build` gives the engine."""

    runner: DeviceRunner
    tokenizer: object
    draft_vocab_size: int
    layer_loop: str
    compile_mode: str
    compilation_cache_dir: str | None
    async_scheduling: bool | None = None


def attention_fallback(attention_backend: str | None, platform: str,
                       kv_cache_dtype: str | None, block_size: int) -> str | None:
    """``attention_backend``, or ``"xla"`` (with a logged reason) where the compiled Pallas TPU
    kernel cannot serve the configuration: a quantised cache with ``block_size`` not a multiple
    of :data:`~jmtp.pallas.ragged_paged_attention_tpu.QUANTIZED_BLOCK_MULTIPLE`."""
    from jmtp.pallas.ragged_paged_attention import default_implementation
    from jmtp.pallas.ragged_paged_attention_tpu import QUANTIZED_BLOCK_MULTIPLE
    impl = attention_backend or default_implementation(platform)
    if (impl == "pallas_tpu" and platform == "tpu" and kv_cache_dtype is not None
            and block_size % QUANTIZED_BLOCK_MULTIPLE):
        log.warning("kv_cache_dtype=%r with block_size=%d: the Pallas TPU attention kernel needs "
                    "block_size a multiple of %d with a quantised cache (lane-aligned scale "
                    "DMAs); attention runs the 'xla' implementation instead", kv_cache_dtype,
                    block_size, QUANTIZED_BLOCK_MULTIPLE)
        return "xla"
    return attention_backend


def abstract_params(cfg: ModelConfig, dtype, with_mtp: bool, kv_cache_dtype: str | None) -> dict:
    """The parameter dict of ``cfg`` as ``jax.ShapeDtypeStruct``s (nothing allocated): the
    target, the MTP head when ``with_mtp`` (``cfg.num_mtp_layers`` modules, at least one) and the
    int8 cache's key shift; the weights ``cfg.quantization`` covers as 8-bit
    :class:`~jmtp.model.quant.QuantizedWeight` s (values and f32 scales)."""
    from jmtp.model.quant_params import abstract_quantized
    from jmtp.model.schema import abstract_params as float_params
    c = (cfg.replace(num_mtp_layers=max(cfg.num_mtp_layers, 1)) if with_mtp
         else cfg.replace(num_mtp_layers=0))
    params = abstract_quantized(c, float_params(c, dtype))
    if kv_cache_dtype == "int8" and not cfg.is_mla:
        params["k_shift"] = jax.ShapeDtypeStruct(
            (cfg.num_kv_layers, cfg.num_kv_heads, cfg.head_dim), jnp.float32)
    return params


def _batch_invariant(a, cfg: ModelConfig, one_device: bool) -> ModelConfig:
    """``cfg`` with ``batch_invariant`` set, after refusing what the mode does not cover.

    Raises:
      ValueError: an MLA, MoE or hybrid target (their attention / experts / recurrent kernels
        are not tiled), a device mesh (not verified there yet), or an ``attention_backend``
        other than ``"xla"`` (the Pallas kernels choose their tiles by the batch)."""
    what = ("MLA attention" if cfg.is_mla else "a MoE target" if cfg.moe is not None else
            "a hybrid linear-attention target" if cfg.is_hybrid else
            "a device mesh" if not one_device else None)
    if what is not None:
        raise ValueError(f"batch_invariant=True is not supported with {what} (dense attention "
                         "models on one device only)")
    if a.attention_backend not in (None, "xla"):
        raise ValueError(f"batch_invariant=True runs attention_backend='xla' (its query tiles and "
                         f"key chunks are fixed); got attention_backend={a.attention_backend!r}")
    return cfg.replace(batch_invariant=True)


def _state_checkpoints(a, cfg: ModelConfig) -> int:
    """``EngineConfig.num_state_checkpoints``: with prefix caching on a hybrid model one per slot
    plus ``max_cached_states`` (default ``max_num_seqs``); else 0.

    Raises:
      ValueError: ``max_cached_states`` negative or not divisible by ``data_parallel_size``."""
    if not (a.enable_prefix_caching and cfg.is_hybrid):
        return 0
    n = a.max_num_seqs if a.max_cached_states is None else a.max_cached_states
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"max_cached_states must be an int >= 0, got {a.max_cached_states!r}")
    dp = a.mesh.shape.get("data", 1) if a.mesh is not None else a.data_parallel_size
    if n % dp:
        raise ValueError(f"max_cached_states={n} must be a multiple of data_parallel_size={dp} "
                         "(each data shard keeps its own)")
    return a.max_num_seqs + n


def _with_expert_parallel(cfg: ModelConfig, mesh, platform: str, backend: str) -> ModelConfig:
    """``cfg`` with expert parallelism on (``MoEConfig.expert_parallel``, the dispatch
    resolved for the platform and mesh); unchanged, with a log line, for a dense model or one
    device.

    Raises:
      ValueError: ``num_experts`` not a multiple of the mesh's devices."""
    if cfg.moe is None:
        log.warning("enable_expert_parallel: the model has no MoE layers; ignored")
        return cfg
    if mesh is None:
        log.info("enable_expert_parallel: one device holds every expert; nothing to split")
        return cfg
    dp, tp = shd.mesh_sizes(mesh)
    check_expert_parallel(cfg.moe, dp, tp)
    backend = resolve_all2all_backend(backend, platform, dp, tp, cfg.moe.num_experts_per_tok)
    log.info("expert parallelism: %d experts over %d devices (%d each), dispatch %s",
             cfg.moe.num_experts, dp * tp, cfg.moe.num_experts // (dp * tp), backend)
    return cfg.replace(moe=cfg.moe.replace(expert_parallel=True, all2all_backend=backend))


def _make_mesh(cfg: ModelConfig, tp: int, dp: int, mesh, devices=None):
    """The engine's mesh, or None for a single device (checks sizes against the model)."""
    if mesh is None:
        if (tp, dp) == (1, 1):
            return None
        mesh = shd.make_mesh(tp, dp, devices)
    else:
        shd.check_mesh(mesh)
        sizes = shd.mesh_sizes(mesh)
        if (dp, tp) not in ((1, 1), sizes):
            raise ValueError(f"mesh has (data, model) = {sizes} but data_parallel_size={dp}, "
                             f"tensor_parallel_size={tp} were given")
    # (tensor parallelism is checked by the caller, after any kv-head replication)
    return mesh if mesh.size > 1 else None


__all__ = ["EngineArgs", "BuiltEngine", "LAYER_LOOPS", "resolve_layer_loop", "fit_layer_loop",
           "default_dtype", "with_draft_vocab", "abstract_params", "attention_fallback"]
