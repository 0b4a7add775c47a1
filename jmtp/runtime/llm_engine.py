"""``LLMEngine``: the serving loop, one step at a time (vLLM ``LLMEngine`` shape).

Data flows one way: config → model/params → state → jitted step → host bookkeeping → outputs.
Requests come in through :meth:`LLMEngine.add_request` (validated at once), each :meth:`step`
admits waiting sequences into idle slots (continuous batching), picks the prefill chunks and the
token bucket, calls the one compiled engine step, reads back the emitted tokens and a few flags,
detokenizes incrementally, checks stop strings and returns a :class:`RequestOutput` for every
request that produced tokens or finished. :meth:`abort_request` frees a request's KV blocks at once.

Not thread-safe: call it from one thread at a time (any thread; nothing here installs signal
handlers or progress bars).
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import time
from typing import Iterable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jmtp.core.errors import InvalidRequestError
from jmtp.model.config import ModelConfig
from jmtp.model.kv_shift import with_k_shift
from jmtp.model.llama import init_kv_cache, unstack_layers
from jmtp.model.modules import LlamaForCausalLM
from jmtp.runtime.buckets import (StepBucket, choose_bucket, decode_buckets, slot_buckets,
                                  step_buckets)
from jmtp.runtime.config import EngineConfig, SpeculativeConfig
from jmtp.runtime.detokenizer import IncrementalDetokenizer
from jmtp.runtime.host_maps import MapBudget
from jmtp.runtime.outputs import CompletionOutput, RequestOutput, SpecDecodeMetrics
from jmtp.runtime.sampling import SamplingParams, make_row
from jmtp.runtime.spec_policy import DynamicSpeculation
from jmtp.runtime.state import FINISH_REASONS, init_state, insert_request
from jmtp.runtime import data_parallel as dpar
from jmtp.runtime import multihost as mh
from jmtp.runtime import sharding as shd
from jmtp.pallas.block_allocator import blocks_needed
from jmtp.runtime.prefix_cache import PrefixCache
from jmtp.runtime.step import engine_step, push_free_blocks, release_slot, retire_slot
from jmtp.runtime.handoff import (HANDOFF_VERSION, RequestState, compat_diff, engine_fingerprint,
                                  fingerprint_hash, gather_slot, import_slot, page_bucket,
                                  row_keys)

log = logging.getLogger(__name__)

#: ``LLMEngine(layer_loop=...)`` values.
LAYER_LOOPS = ("auto", "scan", "unrolled")


def resolve_layer_loop(layer_loop: str, one_device: bool, backend: str | None = None) -> str:
    """The layer loop ``layer_loop="auto"`` stands for: ``"unrolled"`` on XLA:CPU with one device
    (there the scan copies every layer's weights out of the stack each step: the engine step is
    ~5-25 % slower under it, measured in docs/measurements.md), else ``"scan"`` (a mesh
    needs the stacked layers; on TPU/GPU the scan compiles faster). Other values are returned as
    they are.

    Args:
      layer_loop: one of :data:`LAYER_LOOPS`.
      one_device: the engine runs on one device (no mesh, or a mesh of one device).
      backend: the platform (default ``jax.default_backend()``).
    """
    if layer_loop != "auto":
        return layer_loop
    backend = backend or jax.default_backend()
    return "unrolled" if backend == "cpu" and one_device else "scan"


def default_dtype():
    """fp32 on CPU (≈5× faster than bf16 matmuls there), bf16 on TPU/GPU."""
    return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16


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


def sample_seed(seed: int, index: int) -> int:
    """Seed of sample ``index`` of a request seeded with ``seed``: ``seed`` itself for sample 0,
    else a ``numpy.random.SeedSequence((seed, index))`` draw (distinct, reproducible streams)."""
    if index == 0:
        return int(seed)
    return int(np.random.SeedSequence((int(seed), int(index))).generate_state(1)[0])


@dataclasses.dataclass
class _Seq:
    """One sample of a request: what one batch slot runs."""

    group: "_Group"
    index: int
    params: SamplingParams         # the request's params with this sample's seed
    detok: IncrementalDetokenizer | None
    output_ids: list[int] = dataclasses.field(default_factory=list)
    metrics: SpecDecodeMetrics = dataclasses.field(default_factory=SpecDecodeMetrics)
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    text: str = ""                 # visible text (stop-string cut applied once finished)
    checked: int = 0               # detokenized characters already searched for stop strings
    # per admission
    slot: int | None = None
    context_ids: list[int] = dataclasses.field(default_factory=list)
    prefilled: int = 0
    resuming: bool = False         # the finishing prefill re-emits output_ids[-1]
    # prefix caching (per admission): the cached blocks the slot reads, the tokens the device
    # holds (context + every emitted token), and how many positions the target / MTP caches
    # hold correctly
    prefix_keys: list[bytes] = dataclasses.field(default_factory=list)
    device_ids: list[int] = dataclasses.field(default_factory=list)
    dev_decoded: int = 0
    mtp_valid: int = 0
    handoff: "RequestState | None" = None   # imported state to admit (jmtp.runtime.handoff)
    # reported so far
    sent_tokens: int = 0
    sent_text: int = 0

    @property
    def prompt_ids(self) -> list[int]:
        return self.group.prompt_ids


@dataclasses.dataclass
class _Group:
    """One request: its ``n`` samples."""

    request_id: str
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    bad_words_ids: list[list[int]]
    seqs: list[_Seq] = dataclasses.field(default_factory=list)
    export: bool = False           # hand off after the prefill (LLMEngine.prefill_request)

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.seqs)


class LLMEngine:
    """Serving engine with MTP speculative decoding (vLLM ``LLMEngine`` shape).

    :class:`jmtp.LLM` builds one from the same arguments and exposes it as ``llm.llm_engine``.

    The model is a :class:`~jmtp.model.modules.LlamaForCausalLM` (filled from the loaded parameter
    dict), split once here: ``graphdef`` (static) and ``params``, its ``nnx.State`` (every
    ``nnx.Param`` / FR-Spec ``Buffer`` with its logical axes, indexed by module path:
    ``params["embed"]``, ``params["mtp"]["eh_proj"]``, ``params["draft_head"]["token_ids"]`` …,
    Variables that behave as their arrays). The jitted step takes ``graphdef`` (static) and
    ``params`` and merges them inside (:func:`~jmtp.runtime.step.engine_step`).

    Args:
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
      max_logprobs: largest ``SamplingParams.logprobs`` served (0 = logprobs off).
      seed: seeds the per-request seeds of requests whose ``SamplingParams.seed`` is None.
      model_config / params / tokenizer: pass an already-built model instead of ``model``.
      mtp_head: with ``model``: ``"auto"``, ``None`` or a head file
        (:func:`jmtp.model.loader.load_checkpoint`).
      compile: ``"eager"``: compile the step for every bucket of
        :func:`~jmtp.runtime.buckets.step_buckets` (and the request insert/release) here, with a
        progress bar, so no step compiles later; ``"lazy"``: compile each bucket on its first use.
        ``None``: ``$JMTP_COMPILE``, default ``"eager"``. See :mod:`jmtp.runtime.compile`.
      compilation_cache_dir: JAX's persistent compilation cache folder. ``"auto"``: JAX's own
        setting if the user made one, else ``$JMTP_CACHE_DIR``, ``$XDG_CACHE_HOME/jmtp/xla`` or
        ``~/.cache/jmtp/xla`` (``JMTP_CACHE_DIR=off`` disables it); a path; ``None``/``False``:
        leave JAX's configuration alone. See :func:`jmtp.runtime.compile.setup_compilation_cache`.
      tensor_parallel_size: devices of the ``model`` mesh axis (vLLM name): attention heads, MLP
        and vocabulary split over them (GSPMD; attention under ``shard_map``), see
        :mod:`jmtp.runtime.sharding`. Must divide ``num_heads`` and ``num_kv_heads``.
      data_parallel_size: devices of the ``data`` mesh axis (vLLM name): the ``max_num_seqs``
        slots, ``num_blocks`` KV blocks and ``max_num_batched_tokens`` step budget (all totals)
        split into that many shards, each with its own block pool and allocator; a request runs
        on one shard (the least loaded when it is admitted), see
        :mod:`jmtp.runtime.data_parallel`. Must divide the three sizes.
      mesh: a ``jax.sharding.Mesh`` with axes ``("data", "model")`` to use instead of one built
        from the two sizes (:func:`jmtp.runtime.sharding.make_mesh`).
      enable_prefix_caching: reuse the target and MTP KV of full blocks of earlier requests'
        prompts and outputs (vLLM's option name; :mod:`jmtp.runtime.prefix_cache`). One device
        only for now (no mesh, or a mesh of one device).
      layer_loop: how the step runs the target's decoder layers: ``"scan"`` (one ``lax.scan``
        over the stacked layers, compiles fastest), ``"unrolled"`` (a Python loop over per-layer
        weights, :func:`jmtp.model.llama.unstack_layers`; one device only for now) or ``"auto"``
        (default: :func:`resolve_layer_loop`, unrolled on XLA:CPU with one device, else scan).
        On XLA:CPU the scan copies each layer's weights out of the stack before its matmuls
        (in a profile of a SmolLM2 decode step those copies took longer than the matmuls),
        which ``"unrolled"`` avoids, at the price of a compile about twice as long (SmolLM2,
        batch 1: 95 s against 52 s cold; the persistent compilation cache keeps it to the first
        start). Unrolled layers are copies of the stacked ones: a caller that passes ``params``
        and keeps them holds the layer weights twice. The chosen loop is :attr:`layer_loop`.

    Start-up times: ``compile_seconds`` ``{label: seconds}`` of the compiles done ahead
    (``compile="eager"``; empty when lazy); ``first_call_seconds`` ``{bucket label: seconds}`` of
    each step bucket's first run in :meth:`step` (tracing, compiling or loading it from the
    persistent cache, and that first step's own run: with ``compile="lazy"``, where the compiles
    go).

    Raises:
      TypeError: an unknown keyword.
      ValueError: bad configuration (see :class:`EngineConfig`, :class:`SpeculativeConfig`) or an
        unknown model path.
      MapLimitError: (a ``RuntimeError``) with ``compile="eager"``, the step buckets left to
        compile after the first would not fit in the process's memory-map limit: XLA:CPU maps
        every compiled kernel on its own and aborts the process past ``vm.max_map_count``
        (:mod:`jmtp.runtime.host_maps`).
    """

    def __init__(self, model: str | None = None, *, speculative_config: SpeculativeConfig | None = None,
                 max_num_seqs: int = 8, max_model_len: int = 2048, block_size: int = 16,
                 num_blocks: int | None = None, max_num_batched_tokens: int | None = None,
                 dtype=None, attention_backend: str | None = None, max_logprobs: int = 0,
                 seed: int = 0, model_config: ModelConfig | None = None, params: dict | None = None,
                 tokenizer=None, mtp_head: str | None = "auto", compile: str | None = None,
                 compilation_cache_dir: str | bool | None = "auto", block_allocator: str = "auto",
                 kv_cache_dtype: str | None = None, moe_backend: str | None = None,
                 tensor_parallel_size: int = 1, data_parallel_size: int = 1, mesh=None,
                 enable_prefix_caching: bool = False, layer_loop: str = "auto"):
        from jmtp.core.checks import check_one_of
        from jmtp.pallas.kv_quant import check_kv_cache_dtype
        from jmtp.runtime import compile as jc
        check_kv_cache_dtype(kv_cache_dtype)   # before anything is loaded
        check_one_of("layer_loop", layer_loop, LAYER_LOOPS)
        one_device = (mesh.size == 1 if mesh is not None
                      else (tensor_parallel_size, data_parallel_size) == (1, 1))
        layer_loop = self.layer_loop = resolve_layer_loop(layer_loop, one_device)
        if layer_loop == "unrolled" and not one_device:
            raise ValueError("layer_loop='unrolled' with a device mesh is not supported yet: use "
                             "layer_loop='scan'")
        if enable_prefix_caching and not one_device:
            raise ValueError("enable_prefix_caching=True with a device mesh of more than one "
                             "device (mesh, tensor_parallel_size or data_parallel_size > 1) is "
                             "not supported yet: use one device")
        compile = self.compile_mode = jc.resolve_compile_mode(compile)
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
        from jmtp.model.config import MOE_IMPLEMENTATIONS
        if moe_backend not in (None,) + MOE_IMPLEMENTATIONS:
            raise ValueError(f"moe_backend must be one of {MOE_IMPLEMENTATIONS} or None, got "
                             f"{moe_backend!r}")
        if moe_backend is not None and model_config.moe is not None:
            model_config = model_config.replace(
                moe=model_config.moe.replace(implementation=moe_backend))
        spec = speculative_config or SpeculativeConfig(method=None)
        if spec.method == "mtp" and "mtp" not in params:
            raise ValueError("speculative method 'mtp' needs MTP weights (params['mtp'])")
        self.mesh = self._make_mesh(model_config, tensor_parallel_size, data_parallel_size, mesh)
        self.model_config = model_config
        self.draft_vocab_size = 0
        if spec.method == "mtp":
            params, self.draft_vocab_size = with_draft_vocab(model_config, params, spec.draft_vocab_size)
        # An int8 cache stores keys minus a calibrated per-layer mean (jmtp.model.kv_shift).
        params = with_k_shift(model_config, params, kv_cache_dtype)
        if layer_loop == "unrolled":
            params = unstack_layers(params)
        # The model as an NNX module, split once: the jitted step takes the pure state (arrays with
        # their logical-axis metadata) and merges it with the static graph definition inside.
        model = LlamaForCausalLM.from_params(model_config, params)
        self.graphdef, self.params = nnx.split(model)
        self.tokenizer = tokenizer
        self.speculative_config = spec
        if max_num_batched_tokens is None:   # (a multiple of data_parallel_size: split per shard)
            dp = shd.mesh_sizes(self.mesh)[0] if self.mesh is not None else 1
            max_num_batched_tokens = -(-max(256, max_num_seqs * (spec.k + 1)) // dp) * dp
        ec = EngineConfig(
            max_num_seqs=max_num_seqs, max_model_len=max_model_len, block_size=block_size,
            num_blocks=num_blocks or 1, max_num_batched_tokens=max_num_batched_tokens,
            max_stop_ids=8, max_logprobs=max_logprobs, spec=spec, block_allocator=block_allocator,
            kv_cache_dtype=kv_cache_dtype, enable_prefix_caching=bool(enable_prefix_caching))
        if not num_blocks:      # default: every slot can hold a full-length sequence
            ec = dataclasses.replace(ec, num_blocks=max_num_seqs * ec.pages_per_seq)
        self.engine_config = ec
        self._dp = shd.mesh_sizes(self.mesh)[0] if self.mesh is not None else 1
        self._shard_ec = dpar.shard_config(ec, self._dp)   # one data shard's config (== ec for 1)
        self._seed_rng = np.random.default_rng(seed)
        self.attention_backend = attention_backend
        num_mtp_cache_layers = max(model_config.num_mtp_layers, 1) if spec.method == "mtp" else 0
        if spec.method == "mtp" and model_config.num_mtp_layers > 1 and spec.k > 1:
            # Known limitation (docs/architecture.md, the MTP's shadow state): MTP module j >= 1
            # writes its own cache only at draft positions, so its attention also reads entries
            # it never wrote.
            log.warning("num_mtp_layers=%d: MTP modules after the first attend over a partly "
                        "written MTP cache; drafts 2..K may depend on earlier requests (greedy "
                        "output stays lossless; acceptance and seeded sampled output may vary)",
                        model_config.num_mtp_layers)
        if self.mesh is None:
            self.state = init_state(ec, model_config.vocab_size)
            self.cache = init_kv_cache(model_config, model_config.num_layers, ec.num_blocks,
                                       block_size, dtype, ec.kv_cache_dtype)
            self.mtp_cache = (init_kv_cache(model_config, num_mtp_cache_layers, ec.num_blocks,
                                            block_size, dtype, ec.kv_cache_dtype)
                              if num_mtp_cache_layers else None)
            self._step = jax.jit(engine_step, static_argnums=(0, 1, 2, 3, 4),
                                 donate_argnums=(6, 7, 8))
            self._insert = jax.jit(insert_request, donate_argnums=0)
            self._release = jax.jit(functools.partial(release_slot, ec), donate_argnums=0)
            self._retire = jax.jit(functools.partial(retire_slot, ec), donate_argnums=0)
            self._push_free = jax.jit(push_free_blocks, donate_argnums=0)
            self._import = jax.jit(functools.partial(import_slot, ec), donate_argnums=(0, 1, 2))
        else:
            self._place_on_mesh(num_mtp_cache_layers, dtype)
        self._free_counts = [self._shard_ec.num_blocks] * self._dp   # free KV blocks per shard
        self.prefix_cache = (PrefixCache(block_size, ec.num_blocks, self.mtp_cache is not None)
                             if ec.enable_prefix_caching else None)
        # host-side scheduler state
        self._groups: dict[str, _Group] = {}
        self._waiting: collections.deque[_Seq] = collections.deque()
        self._slots: list[_Seq | None] = [None] * ec.max_num_seqs
        self._paused = [False] * ec.max_num_seqs
        self._order: list[int] = []     # admission order of occupied slots (LIFO preemption)
        # per data shard: after a preemption, admit nothing into it until one of its requests ends
        self._hold = [False] * self._dp
        # cumulative counters (get_stats)
        self._totals = SpecDecodeMetrics(accepted_per_position=[0] * ec.k)
        self._num_steps = 0
        self._num_preemptions = 0
        self._policy_seconds = 0.0     # host time in the dynamic policy (plan + observe)
        self._num_generated = 0
        self._last_step_seconds = 0.0
        # prefill -> decode hand-off (jmtp.runtime.handoff)
        self._exported: dict[str, RequestState] = {}   # handed-off requests, by id
        self._ready: list[_Group] = []      # imported requests that had already finished
        self._compat: dict | None = None    # engine_fingerprint, computed on first use
        # speculation: drafts waiting in each slot's window, and the dynamic draft-limit policy
        self._next_drafts = np.zeros((ec.max_num_seqs,), np.int32)
        self.spec_policy = None
        if spec.enabled and spec.speculation_policy == "dynamic":
            sec, dp = self._shard_ec, self._dp   # rows spread over the data shards
            self.spec_policy = DynamicSpeculation(
                ec.max_num_seqs, spec.k, lambda rows, n: choose_bucket(
                    sec, min(-(-rows // dp), sec.max_num_batched_tokens),
                    min(-(-n // dp), sec.max_num_seqs), has_prefill=False))
        if self.mesh is not None:
            log.info("mesh %s: %s", dict(self.mesh.shape), self.memory_per_device())
        # XLA:CPU maps every compiled kernel on its own and aborts the process past the map
        # limit: each new step bucket is checked first (jmtp.runtime.host_maps).
        self._map_budget = MapBudget("step bucket")
        self._compiled_buckets: set[StepBucket] = set()
        # {bucket label: seconds} of each bucket's first run in step() (tracing, then compiling
        # or loading it from the persistent cache, then the step itself): where lazy compiles go
        self.first_call_seconds: dict[str, float] = {}
        if compile == "eager":
            with shd.mesh_context(self.mesh):
                self.compile_seconds = self._compile_ahead()
            if self.spec_policy is not None:
                self.calibrate_speculation()
        else:
            self.compile_seconds = {}

    # ------------------------------------------------------------------ sharding
    @staticmethod
    def _make_mesh(cfg: ModelConfig, tp: int, dp: int, mesh):
        """The engine's mesh, or None for a single device (checks sizes against the model)."""
        if mesh is None:
            if (tp, dp) == (1, 1):
                return None
            mesh = shd.make_mesh(tp, dp)
        else:
            shd.check_mesh(mesh)
            sizes = shd.mesh_sizes(mesh)
            if (dp, tp) not in ((1, 1), sizes):
                raise ValueError(f"mesh has (data, model) = {sizes} but data_parallel_size={dp}, "
                                 f"tensor_parallel_size={tp} were given")
        shd.check_tensor_parallel(cfg, shd.mesh_sizes(mesh)[1])
        return mesh if mesh.size > 1 else None

    def _place_on_mesh(self, num_mtp_cache_layers: int, dtype) -> None:
        """Build the engine state and caches on ``self.mesh`` and jit the step, insert and release.

        The state and caches are stacked per data shard (:mod:`jmtp.runtime.data_parallel`):
        leading axis over ``data``, kv heads over ``model``; the parameters are sharded by their
        logical axes and replicated over ``data`` (:mod:`jmtp.runtime.sharding`). Every jitted
        function's output shardings equal its input ones (donation in place, no recompiles);
        what the host reads (``StepOutput``, free block counts) comes back replicated."""
        mesh, mc, ec, sec, dp = (self.mesh, self.model_config, self.engine_config,
                                 self._shard_ec, self._dp)
        rep = shd.replicated(mesh)
        st = shd.state_sharding(mesh)
        kv = shd.kv_cache_shardings(mesh, mc.kv_cache_heads, ec.kv_cache_dtype is not None,
                                    stacked=True)
        self.params = mh.put(self.params, shd.param_shardings(self.params, mesh),
                             what="parameters")
        self.state = jax.jit(lambda: dpar.stack_shards(init_state(sec, mc.vocab_size), dp),
                             out_shardings=st)()
        make = lambda n: jax.jit(lambda: dpar.stack_shards(
            init_kv_cache(mc, n, sec.num_blocks, sec.block_size, dtype, ec.kv_cache_dtype), dp),
            out_shardings=kv)()
        self.cache = make(mc.num_layers)
        self.mtp_cache = make(num_mtp_cache_layers) if num_mtp_cache_layers else None
        self._step = jax.jit(functools.partial(dpar.data_parallel_step, mesh),
                             static_argnums=(0, 1, 2, 3, 4), donate_argnums=(6, 7, 8),
                             out_shardings=(st, kv, kv if self.mtp_cache is not None else None, rep))
        self._insert = jax.jit(functools.partial(dpar.data_parallel_insert, mesh),
                               donate_argnums=0, out_shardings=st)
        self._release = jax.jit(functools.partial(dpar.data_parallel_release, mesh, sec),
                                donate_argnums=0, out_shardings=(st, rep))
        self._sync_first_calls()

    def _sync_first_calls(self) -> None:
        """Several processes: the first run of each step bucket (and of insert / release) waits
        until every process has compiled it (:class:`jmtp.runtime.multihost.SyncFirstCall`)."""
        if jax.process_count() > 1:
            self._step = mh.SyncFirstCall(self._step, key=lambda a: a[3], name="step")
            self._insert = mh.SyncFirstCall(self._insert, name="insert")
            self._release = mh.SyncFirstCall(self._release, name="release")

    def _pop_ready(self) -> list[RequestOutput]:
        """The outputs of imported requests that had already finished; forgets them."""
        ready = [self._make_output(g) for g in self._ready]
        self._ready = []
        return ready

    @property
    def compiled_buckets(self) -> frozenset[StepBucket]:
        """The step buckets compiled so far (ahead of time or by a first run)."""
        return frozenset(self._compiled_buckets)

    def uncompiled_buckets(self) -> tuple[StepBucket, ...]:
        """The step buckets (:func:`~jmtp.runtime.buckets.step_buckets`) not compiled yet."""
        return tuple(b for b in step_buckets(self._shard_ec) if b not in self._compiled_buckets)

    def bucket_to_run(self, bucket: StepBucket) -> StepBucket:
        """The bucket a step whose work :func:`~jmtp.runtime.buckets.choose_bucket` sized as
        ``bucket`` runs in: ``bucket``, or with lazy compiles an already compiled bucket that
        holds its work at most twice over (``T`` and ``A`` each within ``[1x, 2x]``): a compile
        costs seconds, padding one step to twice its rows milliseconds (e.g. a one-prompt run's
        last, shorter windows reuse the full-window bucket instead of compiling ``T=2``).
        Padded rows compute nothing that is kept and sampling keys follow request positions,
        so tokens are those of the smaller bucket up to floating-point rounding (as already
        when the load decides the bucket). Not with the dynamic speculation policy, which
        prices and times each bucket it plans for."""
        if (self.compile_mode != "lazy" or self.spec_policy is not None
                or bucket in self._compiled_buckets):
            return bucket
        fits = [c for c in self._compiled_buckets
                if bucket.num_tokens <= c.num_tokens <= 2 * bucket.num_tokens
                and bucket.num_slots <= c.num_slots <= 2 * bucket.num_slots]
        return min(fits, default=bucket)

    def _check_bucket(self, bucket) -> None:
        """Raise :class:`MapLimitError` if ``bucket`` is not compiled yet and its compile would
        cross the process's memory-map limit (:mod:`jmtp.runtime.host_maps`). On a
        multi-process mesh nothing is checked: each process counts its own mappings, and one
        process refusing a compile the others start would leave them waiting at its barrier."""
        if bucket not in self._compiled_buckets and jax.process_count() == 1:
            self._map_budget.check(bucket.label)

    # The three device calls of the host loop, for one device or a mesh (global slot b is row
    # b % Bl of data shard b // Bl; host arrays are [B] here, [D, Bl] on the mesh).
    def _run_step(self, bucket, chunks: np.ndarray, limits: np.ndarray):
        """Run the jitted step; returns its ``StepOutput`` on the host with ``[B, ...]`` fields
        and ``free_count`` per data shard. The first run of a bucket is measured for the
        memory-map budget (checked before, by :meth:`_check_bucket`)."""
        if bucket in self._compiled_buckets:
            return self._call_step(bucket, chunks, limits)
        self._map_budget.start()
        t0 = time.perf_counter()
        out = self._call_step(bucket, chunks, limits)
        self.first_call_seconds[bucket.label] = time.perf_counter() - t0
        self._map_budget.stop()
        self._compiled_buckets.add(bucket)
        return out

    def _call_step(self, bucket, chunks: np.ndarray, limits: np.ndarray):
        if self.mesh is None:
            self.state, self.cache, self.mtp_cache, out = self._step(
                self.graphdef, self.engine_config, self.speculative_config.drafter, bucket,
                self.attention_backend, self.params, self.state, self.cache, self.mtp_cache,
                jnp.asarray(chunks), jnp.asarray(limits))
            out = jax.device_get(out)
            return dataclasses.replace(out, free_count=np.reshape(out.free_count, (1,)))
        D, Bl = self._dp, self._shard_ec.max_num_seqs
        with shd.mesh_context(self.mesh):
            self.state, self.cache, self.mtp_cache, out = self._step(
                self.graphdef, self._shard_ec, self.speculative_config.drafter, bucket,
                self.attention_backend, self.params, self.state, self.cache, self.mtp_cache,
                chunks.reshape(D, Bl), limits.reshape(D, Bl))
        out = mh.fetch(out)      # replicated: the same on every process
        flat = {f.name: (None if (v := getattr(out, f.name)) is None or f.name == "free_count"
                         else np.reshape(v, (D * Bl,) + v.shape[2:]))
                for f in dataclasses.fields(out)}
        return dataclasses.replace(out, **{k: v for k, v in flat.items() if v is not None})

    def _insert_call(self, b: int, ids, prompt_len: int, remaining: int, row: dict,
                     resume_token: int, shared_ids: list[int] = ()) -> None:
        args = (jnp.asarray(ids), jnp.int32(prompt_len), jnp.int32(remaining),
                {k: jnp.asarray(v) for k, v in row.items()}, jnp.int32(resume_token))
        if self.prefix_cache is not None:
            args += self._prefix_insert_args(shared_ids)
        if self.mesh is None:
            self.state = self._insert(self.state, jnp.int32(b), *args)
            return
        Bl = self._shard_ec.max_num_seqs
        with shd.mesh_context(self.mesh):
            self.state = self._insert(self.state, jnp.int32(b // Bl), jnp.int32(b % Bl), *args)

    def _release_call(self, b: int) -> None:
        """Return slot ``b``'s KV blocks and mark it idle on the device; refresh the free
        counts."""
        if self.mesh is None:
            self.state = self._release(self.state, jnp.int32(b))
            self._free_counts = [int(self.state.free_count)]
            return
        Bl = self._shard_ec.max_num_seqs
        with shd.mesh_context(self.mesh):
            self.state, free = self._release(self.state, jnp.int32(b // Bl), jnp.int32(b % Bl))
        self._free_counts = [int(x) for x in mh.fetch(free)]

    @property
    def _free_count(self) -> int:
        """Free KV blocks over every data shard (as the last step / release left them)."""
        return sum(self._free_counts)

    def memory_per_device(self) -> dict:
        """Bytes on one device (the first of the mesh) and in total: ``{"params": (per device,
        total), "kv_cache": (per device, total)}`` (the MTP cache counted with the KV cache)."""
        p_total, p_local = shd.per_device_bytes(self.params)
        c_total, c_local = shd.per_device_bytes((self.cache, self.mtp_cache))
        return {"params": (p_local, p_total), "kv_cache": (c_local, c_total)}

    def calibrate_speculation(self, repeats: int = 3) -> dict[StepBucket, float]:
        """Time every decode step bucket on the idle engine and seed the dynamic speculation
        policy's cost table with the times (:meth:`DynamicSpeculation.seed_costs`).

        Called by the constructor when ``speculation_policy="dynamic"`` and ``compile="eager"``
        (with ``compile="lazy"`` call it yourself, or the policy learns costs from live steps,
        which costs the first requests speed). A step with no request scheduled changes no KV
        cache, block table or request state (it resets only the per-step outputs of idle slots;
        ``tests/runtime/test_spec_policy.py`` checks a fresh engine bit for bit), so the timed
        steps run on the real engine state. Idle steps read no keys and take the no-draft
        branches (one-row verification, no MTP substeps past the first), so the seeds understate
        live steps: the policy scales them by the live/seed ratio it measures, replaces them by
        the median of each bucket's last live timings once it runs and prices proposing apart
        (:class:`~jmtp.runtime.spec_policy.DynamicSpeculation`).

        Args:
          repeats: timed runs per bucket after one untimed run; the fastest is kept.

        Returns:
          ``{StepBucket: seconds}`` as seeded.

        Raises:
          ValueError: no dynamic policy, or ``repeats < 1``.
          RuntimeError: requests are in the engine.
        """
        if self.spec_policy is None:
            raise ValueError("calibrate_speculation needs SpeculativeConfig(speculation_policy="
                             "'dynamic')")
        if repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {repeats}")
        if self.has_unfinished_requests() or any(s is not None for s in self._slots):
            raise RuntimeError("calibrate_speculation runs on an idle engine only")
        sec, B = self._shard_ec, self.engine_config.max_num_seqs
        zeros = np.zeros((B,), np.int32)
        buckets = sorted({StepBucket(t, a) for a in slot_buckets(sec)
                          for t in decode_buckets(sec, a)})
        seconds = {}
        for bk in buckets:
            times = []
            for i in range(repeats + 1):
                t0 = time.perf_counter()
                self._run_step(bk, zeros, zeros)
                if i:
                    times.append(time.perf_counter() - t0)
            seconds[bk] = min(times)
        self.spec_policy.seed_costs(seconds)
        return seconds

    def compile_buckets(self, buckets: Iterable[StepBucket] | None = None, *,
                        progress: bool = False) -> dict[str, float]:
        """Compile step buckets ahead of their first use (nothing runs; requests are untouched).

        A lazy engine uses this to warm up in idle time: ``jmtp chat`` compiles the rest while
        the user types, so no later turn waits on a compile.

        Args:
          buckets: the :class:`StepBucket` s to compile (default: every one of
            :func:`~jmtp.runtime.buckets.step_buckets`); ones already compiled are skipped.
          progress: show a tqdm bar.

        Returns:
          ``{bucket label: seconds}`` of the compiles done (a persistent-cache hit is quick).

        Raises:
          MapLimitError: the compiles would cross the process's memory-map limit (checked
            before each, as in eager construction).
        """
        from jmtp.runtime.compile import compile_ahead
        todo = (list(self.uncompiled_buckets()) if buckets is None
                else [b for b in buckets if b not in self._compiled_buckets])
        if not todo:
            return {}
        with shd.mesh_context(self.mesh):
            return compile_ahead(self._step, [self._step_args(b) for b in todo],
                                 labels=[b.label for b in todo], desc="compile step buckets",
                                 progress=progress, on_compiled=lambda i: self._compiled_buckets
                                 .add(todo[i]), budget=(self._map_budget if
                                                        jax.process_count() == 1 else None))

    def _step_args(self, bucket: StepBucket) -> tuple:
        """The jitted step's arguments for ``bucket`` as :meth:`_call_step` passes them (host
        arrays through ``jnp.asarray`` on one device, numpy ``[D, Bl]`` on a mesh)."""
        sec, D = self._shard_ec, self._dp
        zeros = (jnp.asarray(np.zeros((sec.max_num_seqs,), np.int32)) if self.mesh is None else
                 np.zeros((D, sec.max_num_seqs), np.int32))
        return (self.graphdef, sec, self.speculative_config.drafter, bucket,
                self.attention_backend, self.params, self.state, self.cache, self.mtp_cache,
                zeros, zeros)

    def _compile_ahead(self) -> dict:
        """Compile every step bucket and the request insert/release; ``{label: seconds}``."""
        from jmtp.runtime.compile import compile_ahead
        sec = self._shard_ec
        times = self.compile_buckets(progress=True)
        row = self._sampling_row(SamplingParams(), [0], [], 0)
        slot = (jnp.int32(0),) if self.mesh is None else (jnp.int32(0), jnp.int32(0))
        times.update(compile_ahead(self._insert, [(
            self.state, *slot, jnp.asarray(np.zeros((sec.seq_buffer_len,), np.int32)),
            jnp.int32(1), jnp.int32(1), {k: jnp.asarray(v) for k, v in row.items()},
            jnp.int32(-1), *self._prefix_insert_args([]))], labels=["insert"], progress=False))
        times.update(compile_ahead(self._release, [(self.state, *slot)], labels=["release"],
                                   progress=False))
        if self.prefix_cache is not None:
            times.update(compile_ahead(self._retire, [(
                self.state, jnp.int32(0), jnp.zeros((sec.pages_per_seq,), bool))],
                labels=["retire"], progress=False))
            times.update(compile_ahead(self._push_free, [(
                self.state, jnp.full((sec.num_blocks,), -1, jnp.int32))], labels=["push_free"],
                progress=False))
        return times

    # ------------------------------------------------------------------ prefix caching
    def _prefix_insert_args(self, block_ids: list[int]) -> tuple:
        """The insert call's shared-prefix arguments (none without prefix caching)."""
        if self.prefix_cache is None:
            return ()
        ec = self.engine_config
        row = np.full((ec.pages_per_seq,), -1, np.int32)
        row[:len(block_ids)] = block_ids
        n = len(block_ids)
        return jnp.asarray(row), jnp.int32(n), jnp.int32(n * ec.block_size)

    def _ensure_free(self, need: int) -> None:
        """Evict unreferenced cached blocks (LRU) until ``need`` blocks are free on the device
        or nothing is left to evict; evicted blocks go back to the device free stack."""
        pc = self.prefix_cache
        short = need - self._free_counts[0]
        if pc is None or short <= 0 or not pc.num_evictable:
            return
        ids = pc.evict(short)
        buf = np.full((self.engine_config.num_blocks,), -1, np.int32)
        buf[:len(ids)] = ids
        self.state = self._push_free(self.state, jnp.asarray(buf))
        self._free_counts = [self._free_counts[0] + len(ids)]

    def _step_block_bound(self, chunks: np.ndarray) -> int:
        """An upper bound on the blocks the next step's top-up can take: per occupied slot,
        ``blocks_needed(rows + M - 1) + 1`` for its rows (prefill chunk or verify window)."""
        ec, bs = self.engine_config, self.engine_config.block_size
        total = 0
        for b, s in enumerate(self._slots):
            if s is None:
                continue
            rows = int(chunks[b]) if s.prefilled < len(s.context_ids) else 1 + int(
                self._next_drafts[b])
            if rows:
                total += blocks_needed(rows + max(ec.m - 1, 0), bs) + 1
        return total

    def _retire_call(self, seq: _Seq, b: int, cache_blocks: bool) -> None:
        """Empty slot ``b`` on the device (prefix caching): with ``cache_blocks``, keep its full
        blocks whose target and MTP entries are valid and whose content is not cached yet, and
        cache them; return the other owned blocks; drop the slot's references."""
        pc, bs = self.prefix_cache, self.engine_config.block_size
        ns = len(seq.prefix_keys)
        keep = np.zeros((self.engine_config.pages_per_seq,), bool)
        keys: list[bytes] = []
        if cache_blocks:
            valid = min(seq.dev_decoded, seq.mtp_valid)
            full = valid // bs
            keys = pc.keys(seq.device_ids, full)[ns:]
            keep[:len(keys)] = pc.missing(keys)
        self.state, kept = self._retire(self.state, jnp.int32(b), jnp.asarray(keep))
        if keep.any():     # kept ids in table order; -1 past the blocks the slot owned
            pairs = [(k, int(i)) for k, i in zip([k for k, m in zip(keys, keep) if m],
                                                 np.asarray(kept)) if i >= 0]
            pc.insert([k for k, _ in pairs], [i for _, i in pairs])
        pc.release(seq.prefix_keys)
        seq.prefix_keys = []
        self._free_counts = [int(self.state.free_count)]

    # ------------------------------------------------------------------ requests
    def add_request(self, request_id: str, prompt: str | list[int],
                    sampling_params: SamplingParams | None = None) -> None:
        """Queue a request; it joins the running batch at the next :meth:`step`.

        Args:
          request_id: unique among unfinished requests (str).
          prompt: a string (needs a tokenizer) or a flat list of token ids.
          sampling_params: :class:`SamplingParams` (default: greedy, 16 tokens).

        Raises (before anything is queued):
          TypeError: ``request_id`` not a str, ``sampling_params`` not a SamplingParams.
          ValueError: duplicate ``request_id``; empty prompt, prompt not shorter than
            ``max_model_len``, token ids out of range, more KV blocks needed than exist,
            ``logprobs`` above ``max_logprobs``, string prompt / stop strings / bad words without
            a tokenizer — each naming the field.
        """
        self._add(request_id, prompt, sampling_params, f"request {request_id!r}")

    def _add(self, request_id, prompt, sp, where: str) -> None:
        if not isinstance(request_id, str):
            raise TypeError(f"{where}: request_id must be a str, got {type(request_id).__name__}")
        if request_id in self._groups:
            raise InvalidRequestError(f"{where}: request_id {request_id!r} is already in use by "
                                      "an unfinished request", "request_id")
        if sp is None:
            sp = SamplingParams()
        if not isinstance(sp, SamplingParams):
            raise TypeError(f"{where}: sampling_params must be a jmtp.SamplingParams, got "
                            f"{type(sp).__name__}")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError(f"{where}: string prompt but the engine has no "
                                          "tokenizer", "prompt")
            ids, text = list(self.tokenizer.encode(prompt)), prompt
        else:
            try:
                arr = np.asarray(prompt)
            except ValueError:          # ragged nested lists
                arr = np.asarray([None], dtype=object)
            if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
                raise InvalidRequestError(f"{where}: a token-id prompt must be a flat list of "
                                          f"ints, got {arr.dtype} with shape {arr.shape}",
                                          "prompt")
            ids, text = [int(t) for t in arr], None
        if sp.stop and self.tokenizer is None:
            raise InvalidRequestError(f"{where}: stop strings need a tokenizer (use "
                                      "stop_token_ids)", "stop")
        self._validate(ids, sp, where)
        bad_words = self._bad_words_ids(sp) if sp.bad_words else []
        group = _Group(request_id, text, ids, sp, bad_words)
        for i in range(sp.n):
            seed = (sample_seed(sp.seed, i) if sp.seed is not None
                    else int(self._seed_rng.integers(0, 2**32)))
            group.seqs.append(_Seq(
                group, i, dataclasses.replace(sp, seed=seed),
                IncrementalDetokenizer(self.tokenizer) if self.tokenizer is not None else None,
                context_ids=list(ids), logprobs=[] if sp.logprobs is not None else None))
        self._groups[request_id] = group
        self._waiting.extend(group.seqs)

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        """Drop one or several requests (unknown or finished ids are ignored). Their KV blocks
        are freed at once, whether they wait, prefill or decode; no further output is returned."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            self._exported.pop(rid, None)     # a handed-off state nobody collected
            group = self._groups.get(rid)
            if group is None:
                continue
            for seq in group.seqs:
                if seq.slot is not None:
                    self._free_slot(seq.slot, release=True)
            self._waiting = collections.deque(s for s in self._waiting if s.group is not group)
            self._ready = [g for g in self._ready if g is not group]   # finished imports
            del self._groups[rid]      # last: a failing release leaves the request abortable

    # ------------------------------------------------------------------ hand-off
    def prefill_request(self, request_id: str, prompt: str | list[int],
                        sampling_params: SamplingParams | None = None) -> RequestState:
        """Run a request's prefill here and hand it off: the step that finishes the prefill
        samples the first token and proposes the first drafts, then the request's state is
        exported (:class:`~jmtp.runtime.handoff.RequestState`: its ``EngineState`` row, its
        target and MTP KV pages, tokens, sampling state) and its slot and blocks are freed here.
        :meth:`import_request` on another engine (same model, head and speculative config)
        continues it. A request that finishes during the prefill (EOS, ``max_tokens=1``, a stop
        string) comes back finished, without KV pages.

        Arguments as :meth:`add_request`.

        Raises:
          ValueError: as :meth:`add_request`; ``sampling_params.n > 1``; a device mesh or a
            custom drafter (not supported by the hand-off).
          RuntimeError: the engine has other unfinished requests (this call runs steps).
        """
        self._check_handoff("prefill_request")
        if self.has_unfinished_requests():
            raise RuntimeError(f"prefill_request: the engine has "
                               f"{self.get_num_unfinished_requests()} unfinished requests; finish "
                               "or abort them first")
        self.add_prefill_request(request_id, prompt, sampling_params)
        try:
            while request_id not in self._exported:
                self.step()
        except BaseException:
            self.abort_request(request_id)
            raise
        return self._exported.pop(request_id)

    def add_prefill_request(self, request_id: str, prompt: str | list[int],
                            sampling_params: SamplingParams | None = None) -> None:
        """Queue a request to be handed off after its prefill (batched with the others by the
        following :meth:`step` calls, which return no output for it); collect the states with
        :meth:`pop_exported`. :meth:`prefill_request` is the one-request, blocking form.

        Raises:
          ValueError: as :meth:`prefill_request`.
        """
        self._check_handoff("add_prefill_request")
        sp = sampling_params or SamplingParams()
        if isinstance(sp, SamplingParams) and sp.n != 1:
            raise ValueError(f"request {request_id!r}: the hand-off supports n=1 only, got "
                             f"SamplingParams.n={sp.n}")
        self._add(request_id, prompt, sampling_params, f"request {request_id!r}")
        self._groups[request_id].export = True

    def pop_exported(self, request_id: str) -> RequestState | None:
        """The state of a request handed off by :meth:`add_prefill_request` (None while it still
        prefills; each state is returned once)."""
        return self._exported.pop(request_id, None)

    def import_request(self, state: RequestState, request_id: str | None = None) -> None:
        """Continue a request exported by another engine's :meth:`prefill_request`.

        It joins the running batch at the next :meth:`step`: it takes an idle slot once the free
        KV blocks cover its pages (FIFO with the other waiting requests), its pages are copied
        into blocks of this engine and its row is written (one jitted call,
        :func:`jmtp.runtime.handoff.import_slot`); that step verifies the imported drafts. Its
        outputs carry all its tokens (the first one included) and its speculation counters.
        A state that finished on the exporter is returned, finished, by the next :meth:`step`.
        ``request_id`` names it here (default: the exporter's ``state.request_id``; ids of
        different exporters may collide).

        Raises:
          TypeError: ``state`` not a :class:`~jmtp.runtime.handoff.RequestState`.
          ValueError: another layout version; another model, weights, speculative config or KV
            layout (the fingerprint; the message names the differences); a ``max_model_len``
            that would stop the request elsewhere; the request does not fit this engine
            (``num_blocks``, ``max_logprobs``, no tokenizer for stop strings / bad words); a
            ``request_id`` in use; a device mesh.
        """
        if not isinstance(state, RequestState):
            raise TypeError(f"import_request: state must be a jmtp RequestState, got "
                            f"{type(state).__name__}")
        self._check_handoff("import_request")
        rid = state.request_id if request_id is None else request_id
        where = f"import_request({rid!r})"
        if state.version != HANDOFF_VERSION:
            raise ValueError(f"{where}: RequestState.version={state.version}, this engine reads "
                             f"version {HANDOFF_VERSION}")
        compat = self._handoff_compat()
        if state.fingerprint != fingerprint_hash(compat):
            diff = compat_diff(state.compat, compat) or ["fingerprint"]
            raise ValueError(f"{where}: the request was exported by an incompatible engine; "
                             f"differs in: {'; '.join(diff)}")
        ec, sp = self.engine_config, state.sampling_params
        if rid in self._groups:
            raise ValueError(f"{where}: request_id {rid!r} is already in use by an "
                             "unfinished request")
        prompt_ids = list(state.prompt_token_ids)
        end = len(prompt_ids) + sp.max_tokens
        if min(end, ec.max_model_len) != min(end, state.max_model_len):
            raise ValueError(f"{where}: max_model_len={ec.max_model_len} would stop the request "
                             f"at another length than the exporter's max_model_len="
                             f"{state.max_model_len} (prompt {len(prompt_ids)} + max_tokens "
                             f"{sp.max_tokens} tokens)")
        if (sp.stop or sp.bad_words) and self.tokenizer is None:
            raise ValueError(f"{where}: stop strings / bad words need a tokenizer")
        self._validate(prompt_ids, sp, where)
        if not state.finished:
            missing = sorted(row_keys(self.state) - set(state.row))
            if missing:
                raise ValueError(f"{where}: RequestState.row lacks {', '.join(missing)} (written "
                                 "by another jmtp layout)")
            if state.num_pages > ec.pages_per_seq:
                raise ValueError(f"{where}: {state.num_pages} KV pages exceed pages_per_seq="
                                 f"{ec.pages_per_seq}")
            if state.row["input_ids"].shape[0] > ec.seq_buffer_len:
                raise ValueError(f"{where}: {state.row['input_ids'].shape[0]} tokens exceed the "
                                 f"token buffer ({ec.seq_buffer_len})")
        group = _Group(rid, state.prompt, prompt_ids, sp,
                       [list(w) for w in state.bad_words_ids])
        seq = _Seq(group, 0, sp,
                   IncrementalDetokenizer(self.tokenizer) if self.tokenizer is not None else None,
                   output_ids=list(state.output_token_ids),
                   metrics=dataclasses.replace(
                       state.metrics,
                       accepted_per_position=list(state.metrics.accepted_per_position)),
                   logprobs=None if state.logprobs is None else list(state.logprobs),
                   context_ids=prompt_ids + list(state.output_token_ids[:-1]))
        if seq.detok is not None:
            seq.detok.push(seq.output_ids)
            seq.checked = len(seq.detok.text)
        group.seqs.append(seq)
        self._groups[rid] = group
        if state.finished:
            seq.finish_reason, seq.stop_reason, seq.text = (state.finish_reason,
                                                            state.stop_reason, state.text)
            self._ready.append(group)
            return
        seq.handoff = state
        self._waiting.append(seq)

    def _check_handoff(self, where: str) -> None:
        if self.mesh is not None:
            raise ValueError(f"{where}: the prefill/decode hand-off needs a single-device engine "
                             "(tensor_parallel_size = data_parallel_size = 1) for now")
        if self.speculative_config.method == "custom":
            raise ValueError(f"{where}: the hand-off does not support a custom drafter")
        if self.prefix_cache is not None:
            raise ValueError(f"{where}: the hand-off does not support enable_prefix_caching=True "
                             "yet (a slot's shared prefix blocks are not exported)")

    def _handoff_compat(self) -> dict:
        if self._compat is None:
            self._compat = engine_fingerprint(
                self.model_config, self.engine_config, self.draft_vocab_size,
                str(self.cache.k.dtype), self.params)
        return self._compat

    def _export(self, b: int, seq: _Seq) -> RequestState:
        """The :class:`RequestState` of ``seq`` (slot ``b``, or already freed when it finished),
        then free its slot and blocks."""
        g, ec = seq.group, self.engine_config
        compat = self._handoff_compat()
        row, kv = {}, {}
        if seq.finish_reason is None:
            owned = int(self.state.num_owned[b])
            table = np.asarray(self.state.block_tables[b])
            pb = page_bucket(owned, ec.pages_per_seq)
            ids = np.zeros((pb,), np.int32)
            ids[:owned] = table[:owned]
            row, kv = jax.device_get(gather_slot(self.state, self.cache, self.mtp_cache,
                                                 jnp.int32(b), jnp.asarray(ids)))
            row = {k: np.asarray(v) for k, v in row.items()}
            row["input_ids"] = row["input_ids"][:int(row["prompt_lens"]) + int(row["step_idx"])]
            kv = {k: np.asarray(v)[:, :owned] for k, v in kv.items()}
            self._free_slot(b, release=True)
            text = ""
        else:
            text = self._completion(seq).text
        return RequestState(
            version=HANDOFF_VERSION, fingerprint=fingerprint_hash(compat), compat=compat,
            request_id=g.request_id, prompt=g.prompt, prompt_token_ids=list(g.prompt_ids),
            sampling_params=seq.params, bad_words_ids=[list(w) for w in g.bad_words_ids],
            output_token_ids=list(seq.output_ids),
            logprobs=None if seq.logprobs is None else list(seq.logprobs),
            metrics=dataclasses.replace(
                seq.metrics, accepted_per_position=list(seq.metrics.accepted_per_position)),
            finish_reason=seq.finish_reason, stop_reason=seq.stop_reason, text=text,
            max_model_len=ec.max_model_len, row=row, kv=kv)

    def _admit_import(self, b: int, seq: _Seq) -> None:
        """Admit an imported request into idle slot ``b`` (see :meth:`import_request`)."""
        ec, st = self.engine_config, seq.handoff
        n = st.num_pages
        pb = page_bucket(n, ec.pages_per_seq)
        row = dict(st.row)
        ids = np.zeros((ec.seq_buffer_len,), np.int32)
        ids[:row["input_ids"].shape[0]] = row["input_ids"]
        row["input_ids"] = ids
        kv = {}
        for k, a in st.kv.items():
            pad = np.zeros((a.shape[0], pb) + a.shape[2:], a.dtype)
            pad[:, :n] = a
            kv[k] = jnp.asarray(pad)
        self.state, self.cache, self.mtp_cache, ok = self._import(
            self.state, self.cache, self.mtp_cache, jnp.int32(b),
            {k: jnp.asarray(v) for k, v in row.items()}, kv, jnp.int32(n))
        if not bool(ok):
            raise RuntimeError(f"import of request {seq.group.request_id!r}: the allocator could "
                               f"not give slot {b} its {n} KV blocks")
        self._free_counts = [int(self.state.free_count)]
        seq.handoff = None                 # a later preemption recomputes as usual
        seq.prefilled = len(seq.context_ids)
        seq.resuming = False
        if self.spec_policy is not None:
            self.spec_policy.reset_slot(b)
        if not seq.metrics.accepted_per_position:
            seq.metrics.accepted_per_position = [0] * ec.k
        self._next_drafts = np.array(self._next_drafts)   # (the step's copy is read-only)
        self._next_drafts[b] = int(np.sum(row["draft_tokens"][1:] >= 0))
        seq.slot = b
        self._slots[b] = seq
        self._paused[b] = False
        self._order.append(b)

    def has_unfinished_requests(self) -> bool:
        return bool(self._groups)

    def get_num_unfinished_requests(self) -> int:
        return len(self._groups)

    def kv_cache_bytes(self) -> dict[str, int]:
        """Device bytes of the KV caches, values and quantisation scales apart.

        Keys: ``target_values``, ``target_scales``, ``mtp_values``, ``mtp_scales`` (0 without an
        MTP cache), ``values``, ``scales`` (sums) and ``total``. Values take
        ``2 · layers · num_blocks · block_size · Nkv · D · itemsize`` bytes (itemsize 1 for
        ``kv_cache_dtype`` ``"int8"`` / ``"fp8_e4m3"``, so ¼ of f32 and ½ of bf16); scales
        ``2 · layers · num_blocks · block_size · Nkv · 4`` (0 unquantised).
        """
        tv, ts = self.cache.nbytes()
        mv, ms = self.mtp_cache.nbytes() if self.mtp_cache is not None else (0, 0)
        return dict(target_values=tv, target_scales=ts, mtp_values=mv, mtp_scales=ms,
                    values=tv + mv, scales=ts + ms, total=tv + mv + ts + ms)

    def get_stats(self) -> dict:
        """Counters for monitoring (plain Python values).

        Keys: ``num_unfinished_requests``; ``num_waiting`` / ``num_running`` (samples queued / in
        a slot); ``num_free_blocks`` / ``num_blocks`` (KV blocks); ``num_steps``,
        ``last_step_seconds`` (wall time of the last :meth:`step`, s), ``num_preemptions``,
        ``num_generated_tokens``; cumulative speculation counters over every sample ever run:
        ``num_draft_tokens``, ``num_accepted_tokens``, ``accepted_per_position`` (K counts),
        ``num_decode_steps``, ``num_decode_tokens`` (see :class:`SpecDecodeMetrics`). With
        prefix caching also ``prefix_cache_hit_rate`` (cached prompt tokens / prompt tokens over
        every admission), ``prefix_cache_queried_tokens``, ``prefix_cache_hit_tokens``,
        ``num_cached_blocks`` (held by the cache, not free), ``num_evictable_blocks`` (cached,
        read by no slot) and ``num_evicted_blocks``. With ``speculation_policy="dynamic"`` also
        the policy's counters (:class:`~jmtp.runtime.spec_policy.DynamicSpeculation`):
        ``spec_policy_plans`` (steps planned with a proposing slot), ``spec_policy_drafting_plans``
        (those whose limits allowed a draft, probes included), ``spec_policy_holds`` (losing
        windows of the guard, each holding drafting off) and ``spec_policy_host_seconds`` (host
        wall time in the policy's plan and bookkeeping, s; it adds to every step).
        """
        t = self._totals
        return dict(
            num_unfinished_requests=len(self._groups), num_waiting=len(self._waiting),
            num_running=sum(s is not None for s in self._slots),
            num_free_blocks=sum(self._free_counts), num_blocks=self.engine_config.num_blocks,
            num_steps=self._num_steps, last_step_seconds=self._last_step_seconds,
            num_preemptions=self._num_preemptions, num_generated_tokens=self._num_generated,
            num_draft_tokens=t.num_draft_tokens, num_accepted_tokens=t.num_accepted_tokens,
            accepted_per_position=list(t.accepted_per_position),
            num_decode_steps=t.num_decode_steps, num_decode_tokens=t.num_decode_tokens,
            **self._prefix_stats(), **self._policy_stats())

    def _policy_stats(self) -> dict:
        pol = self.spec_policy
        if pol is None:
            return {}
        return dict(spec_policy_plans=pol.num_plans,
                    spec_policy_drafting_plans=pol.num_drafting_plans,
                    spec_policy_holds=pol.num_holds, spec_policy_host_seconds=self._policy_seconds)

    def _prefix_stats(self) -> dict:
        pc = self.prefix_cache
        if pc is None:
            return {}
        return dict(prefix_cache_hit_rate=pc.hit_rate, prefix_cache_queried_tokens=pc.num_queried_tokens,
                    prefix_cache_hit_tokens=pc.num_hit_tokens, num_cached_blocks=len(pc),
                    num_evictable_blocks=pc.num_evictable, num_evicted_blocks=pc.num_evicted)

    # ------------------------------------------------------------------ validation
    def _validate(self, prompt_ids: list[int], sp: SamplingParams, where: str):
        ec, mc = self.engine_config, self.model_config
        if len(prompt_ids) == 0:
            raise InvalidRequestError(f"{where}: prompt is empty (a prompt needs at least one "
                                      "token)", "prompt")
        if len(prompt_ids) >= ec.max_model_len:
            raise InvalidRequestError(
                f"{where}: prompt has {len(prompt_ids)} tokens; max_model_len={ec.max_model_len} "
                "leaves no room to generate (prompt must be shorter than max_model_len)", "prompt")
        bad = [t for t in prompt_ids if not 0 <= t < mc.vocab_size]
        if bad:
            raise InvalidRequestError(f"{where}: token id {bad[0]} outside [0, vocab_size="
                                      f"{mc.vocab_size})", "prompt")
        need = blocks_needed(min(len(prompt_ids) + sp.max_tokens, ec.max_model_len) + ec.k + ec.m,
                             ec.block_size)
        if need > ec.num_blocks:
            raise InvalidRequestError(
                f"{where}: the request needs up to {need} KV blocks but num_blocks={ec.num_blocks}",
                "max_tokens")
        if sp.logprobs is not None and max(sp.logprobs, 1) > ec.max_logprobs:
            raise InvalidRequestError(f"{where}: logprobs={sp.logprobs} exceeds max_logprobs="
                                      f"{ec.max_logprobs} (set LLM(max_logprobs=...))", "logprobs")
        if sp.bad_words and self.tokenizer is None:
            raise InvalidRequestError(f"{where}: bad_words need a tokenizer (use bad_token_ids)",
                                      "bad_words")
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

    # ------------------------------------------------------------------ the step
    def step(self) -> list[RequestOutput]:
        """Run one engine step.

        Admits waiting samples into idle slots, runs the jitted step once, and returns one
        :class:`RequestOutput` per request that produced new tokens or finished in this step
        (``finished=True`` on its last one; finished requests are forgotten). Returns ``[]`` when
        nothing is unfinished. A request queued by :meth:`add_prefill_request` returns no output:
        the step that finishes its prefill exports it (:meth:`pop_exported`) and frees its slot.
        A request queued by :meth:`import_request` is admitted like any waiting one and returns
        outputs with all its tokens.

        Raises:
          MapLimitError: (a ``RuntimeError``) the step needs a bucket that is not compiled yet
            (``compile="lazy"``), and compiling it would cross the process's memory-map limit
            (:mod:`jmtp.runtime.host_maps`). Raised before anything runs or is planned: waiting
            requests admitted in this call stay in their slots, nothing else changed. Abort
            requests to go on with the compiled buckets.
        """
        t0 = time.perf_counter()
        ec, sec, D = self.engine_config, self._shard_ec, self._dp
        B, Bl, bs = ec.max_num_seqs, sec.max_num_seqs, ec.block_size
        slots = self._slots
        shard_slots = [range(d * Bl, (d + 1) * Bl) for d in range(D)]
        occupied = [any(slots[b] is not None for b in r) for r in shard_slots]
        for d in range(D):
            if self._hold[d] and not occupied[d]:
                self._hold[d] = False
        self._admit_waiting(shard_slots)
        if not any(s is not None for s in slots):
            return self._pop_ready()
        # Token budget per data shard: decode windows first, then prefill chunks in slot order.
        chunks = np.zeros((B,), np.int32)
        rows, active = [0] * D, [0] * D
        for d, r in enumerate(shard_slots):
            decoding = [b for b in r if slots[b] is not None
                        and slots[b].prefilled >= len(slots[b].context_ids)]
            dec_rows = sum(1 + int(self._next_drafts[b]) for b in decoding)   # windows drafted
            budget = sec.max_num_batched_tokens - dec_rows
            for b in r:
                s = slots[b]
                if s is not None and s.prefilled < len(s.context_ids):
                    c = min(len(s.context_ids) - s.prefilled, budget)
                    chunks[b], budget = c, budget - c
            rows[d] = dec_rows + int(chunks[r.start:r.stop].sum())
            active[d] = len(decoding) + int(np.count_nonzero(chunks[r.start:r.stop]))
        # One (T, A) bucket for every shard: the busiest one's.
        bucket = self.bucket_to_run(choose_bucket(sec, max(rows), max(active), bool(chunks.any())))
        self._check_bucket(bucket)   # before the policy and the prefix cache change anything
        ready = self._pop_ready()
        # Slots that propose in this step: decoding ones and those whose prefill ends in it.
        proposing = np.array([s is not None and s.prefilled + int(chunks[b]) >= len(s.context_ids)
                              for b, s in enumerate(slots)])
        t_plan = time.perf_counter()
        limits = (np.full((B,), ec.k, np.int32) if self.spec_policy is None else
                  self.spec_policy.draft_limits(proposing))
        plan_seconds = time.perf_counter() - t_plan
        if self.prefix_cache is not None:
            self._ensure_free(self._step_block_bound(chunks))
        t_step = time.perf_counter()
        out = self._run_step(bucket, chunks, limits)
        self._next_drafts = np.asarray(out.num_next_drafts)
        if self.spec_policy is not None:
            # the proposing depth prices the drafting; a step with a prefill chunk is not timed
            # (its token bucket can coincide with a decode bucket); the committed tokens feed
            # the policy's guard on the realised rate
            t_obs = time.perf_counter()
            self.spec_policy.observe(out.num_drafts, out.num_accepted, bucket,
                                     t_obs - t_step, depth=int(limits.max()),
                                     timed=not chunks.any(), num_tokens=out.num_tokens,
                                     num_allowed=out.num_allowed)
            self._policy_seconds += plan_seconds + time.perf_counter() - t_obs
        self._num_steps += 1
        self._free_counts = [int(x) for x in out.free_count]
        touched: dict[str, _Group] = {}
        exports: list[tuple[int, _Seq]] = []
        progressed = [False] * D
        for b, seq in enumerate(slots):
            self._paused[b] = bool(seq is not None and out.paused[b])
            if seq is None or out.paused[b]:
                continue
            progressed[b // Bl] |= bool(chunks[b] > 0 or out.num_tokens[b] > 0)
            was_decode = seq.prefilled >= len(seq.context_ids)
            seq.prefilled += int(chunks[b])
            n = int(out.num_tokens[b])
            if self.prefix_cache is not None:
                seq.device_ids += [int(x) for x in out.tokens[b, :n]]
                seq.dev_decoded += n if was_decode else int(chunks[b])
                if not out.finished[b]:     # the MTP does not run in a slot's last step
                    seq.mtp_valid = seq.dev_decoded
            first = 0
            if seq.resuming and n:      # the re-emitted last token of a resumed request
                first, seq.resuming = 1, False
            tokens = [int(x) for x in out.tokens[b, first:n]]
            kept, stop_str = self._append(seq, tokens)
            if seq.logprobs is not None and kept:
                self._collect_logprobs(seq, out, b, first, kept)
            self._num_generated += kept
            if was_decode and n:
                self._count_metrics(seq, out, b, kept)
            if stop_str is not None:
                seq.finish_reason, seq.stop_reason = "stop", stop_str
                self._free_slot(b, release=not out.finished[b], cache_blocks=True)
            elif out.finished[b]:
                seq.finish_reason = FINISH_REASONS[int(out.finish_reason[b])]
                last = seq.output_ids[-1] if seq.output_ids else None
                if seq.finish_reason == "stop" and last in seq.params.stop_token_ids:
                    seq.stop_reason = last
                self._free_slot(b, release=False, cache_blocks=True)
            if seq.group.export and (seq.finish_reason is not None or (
                    not was_decode and n and seq.prefilled >= len(seq.context_ids))):
                exports.append((b, seq))      # prefill done: hand off (no output here)
            elif kept or seq.finish_reason is not None:
                touched[seq.group.request_id] = seq.group
        for b, seq in exports:
            self._exported[seq.group.request_id] = self._export(b, seq)
            self._groups.pop(seq.group.request_id, None)
        for d, r in enumerate(shard_slots):
            # a shard whose every occupied slot waits for KV blocks frees its newest request
            if not progressed[d] and any(slots[b] is not None and self._paused[b] for b in r):
                self._preempt(d)
                self._hold[d] = True
        outputs = ready + [self._make_output(g) for g in touched.values()]
        self._last_step_seconds = time.perf_counter() - t0
        return outputs

    def _admit_waiting(self, shard_slots: list[range]) -> None:
        """Admit waiting samples in FIFO order into idle slots. Each goes to the data shard with
        the fewest occupied slots (ties: most free KV blocks, then the lowest index) among those
        with an idle slot, no paused slot and no hold after a preemption, whose free blocks
        cover its first prefill chunk (or that run nothing else); it takes that shard's lowest
        idle slot. Admission stops at the first sample no shard can take (FIFO)."""
        ec, slots = self.engine_config, self._slots
        free = list(self._free_counts)
        if self.prefix_cache is not None:   # unreferenced cached blocks can be evicted for it
            free[0] += self.prefix_cache.num_evictable
        while self._waiting:
            seq = self._waiting[0]
            first_chunk = min(len(seq.context_ids), self._shard_ec.max_num_batched_tokens)
            need = blocks_needed(first_chunk + ec.m, ec.block_size)
            if seq.handoff is not None:     # an import takes its pages at once, all or nothing
                need = seq.handoff.num_pages
            best = None
            for d, r in enumerate(shard_slots):
                idle = [b for b in r if slots[b] is None]
                busy = len(r) - len(idle)
                if (not idle or self._hold[d] or need > free[d] and (busy or seq.handoff)
                        or any(slots[b] is not None and self._paused[b] for b in r)):
                    continue
                key = (busy, -free[d], d)
                if best is None or key < best[0]:
                    best = (key, d, idle[0])
            if best is None:
                return
            _, d, b = best
            self._admit(b, seq)          # may raise: then the sample is still first in line
            self._waiting.popleft()
            free[d] -= need

    def _append(self, seq: _Seq, tokens: list[int]) -> tuple[int, str | None]:
        """Add ``tokens`` to ``seq``, detokenizing one token at a time so a stop string that
        completes inside a multi-token step is caught at its token. Returns ``(tokens kept,
        matched stop string or None)``; tokens after the one completing a stop string are dropped."""
        stops = seq.params.stop
        if seq.detok is None:
            seq.output_ids += tokens
            return len(tokens), None
        for i, t in enumerate(tokens):
            seq.output_ids.append(t)
            seq.detok.push([t])
            if not stops:
                continue
            text = seq.detok.text
            longest = max(len(s) for s in stops)
            start = max(0, seq.checked - longest + 1)
            hits = [(j, s) for s in stops if (j := text.find(s, start)) >= 0]
            seq.checked = len(text)
            if hits:
                j, s = min(hits)
                end = j + len(s) if seq.params.include_stop_str_in_output else j
                seq.text = text[:end]
                return i + 1, s
        return len(tokens), None

    def _collect_logprobs(self, seq: _Seq, out, b: int, first: int, kept: int):
        """vLLM shape: per emitted token, {token id: logprob} of the top-n plus the token itself."""
        k = seq.params.logprobs
        for i in range(first, first + kept):
            d = {int(t): float(v) for t, v in zip(out.top_logprob_ids[b, i, :k],
                                                   out.top_logprobs[b, i, :k])}
            d[int(out.tokens[b, i])] = float(out.logprobs[b, i])
            seq.logprobs.append(d)

    def _count_metrics(self, seq: _Seq, out, b: int, kept: int):
        mt, tot = seq.metrics, self._totals
        a = min(int(out.num_accepted[b]), kept)   # drafts cut by a stop string do not count
        d = int(out.num_drafts[b])
        for m in (mt, tot):
            m.num_decode_steps += 1
            m.num_decode_tokens += kept
            m.num_draft_tokens += d
            m.num_accepted_tokens += a
            for i in range(a):
                m.accepted_per_position[i] += 1

    def _admit(self, b: int, seq: _Seq):
        ec, g = self.engine_config, seq.group
        if seq.handoff is not None:
            return self._admit_import(b, seq)
        resume = bool(seq.output_ids)   # re-admission after a preemption
        hist = seq.output_ids[:-1] if resume else []
        seq.context_ids = g.prompt_ids + hist
        ids = np.zeros((ec.seq_buffer_len,), np.int32)
        ids[: len(seq.context_ids)] = seq.context_ids
        row = self._sampling_row(seq.params, g.prompt_ids, g.bad_words_ids, None)
        if hist:  # restore the generated history the resumed sampling state depends on
            row["output_counts"] += np.bincount(hist, minlength=self.model_config.vocab_size
                                                ).astype(np.int32)
            row["min_tokens"] = np.int32(max(seq.params.min_tokens - len(hist), 0))
            tail = np.asarray(seq.context_ids[-(ec.max_bad_word_len - 1):]
                              if ec.max_bad_word_len > 1 else [], np.int32)
            row["recent_tokens"][ec.max_bad_word_len - 1 - tail.size:] = tail
        row["rng_offset"] = np.int32(len(hist))
        remaining = seq.params.max_tokens - len(hist)
        keys, shared_ids = ((self.prefix_cache.match(seq.context_ids))
                            if self.prefix_cache is not None else ([], []))
        # The device insert first: if it raises, no host bookkeeping has changed (the sample
        # stays waiting, the slot stays idle, no cached block is referenced) and the error is
        # the caller's to see.
        self._insert_call(b, ids, len(seq.context_ids), remaining, row,
                          seq.output_ids[-1] if resume else -1, shared_ids)
        seq.prefilled = 0
        if self.prefix_cache is not None:
            self.prefix_cache.acquire(keys, len(seq.context_ids))
            seq.prefix_keys = keys
            seq.prefilled = len(shared_ids) * ec.block_size
            seq.device_ids = list(seq.context_ids)
            seq.dev_decoded = seq.mtp_valid = seq.prefilled
        seq.resuming = resume
        seq.slot = b
        if self.spec_policy is not None:
            self.spec_policy.reset_slot(b)
        if not seq.metrics.accepted_per_position:
            seq.metrics.accepted_per_position = [0] * ec.k
        self._slots[b] = seq
        self._paused[b] = False
        self._order.append(b)

    def _free_slot(self, b: int, release: bool, cache_blocks: bool = False):
        """Empty slot ``b``; ``release`` returns its KV blocks (the step already released those
        of slots it finished). With prefix caching the host always empties the slot
        (:meth:`_retire_call`), caching its valid full blocks if ``cache_blocks`` (a request that
        finished; not a preempted or aborted one). The device call runs first, so that a failing
        call leaves the host's view of the slot unchanged."""
        seq = self._slots[b]
        if self.prefix_cache is not None:
            self._retire_call(seq, b, cache_blocks)
        elif release:
            self._release_call(b)
        self._slots[b] = None
        self._paused[b] = False
        self._order.remove(b)
        seq.slot = None
        self._hold[b // self._shard_ec.max_num_seqs] = False

    def _preempt(self, shard: int = 0):
        """Every occupied slot of data shard ``shard`` is paused for KV blocks: preempt its newest
        request (LIFO) and re-queue it first; on re-admission its prompt and generated tokens are
        recomputed and it resumes exactly where it stopped (same window start, same random
        stream; see :func:`insert_request`), possibly on another shard."""
        Bl = self._shard_ec.max_num_seqs
        b = next(b for b in reversed(self._order) if b // Bl == shard)
        seq = self._slots[b]
        log.info("preempting request %r sample %d (slot %d): out of KV blocks",
                 seq.group.request_id, seq.index, b)
        self._free_slot(b, release=True)
        self._num_preemptions += 1
        self._waiting.appendleft(seq)

    # ------------------------------------------------------------------ outputs
    def _make_output(self, g: _Group) -> RequestOutput:
        outs = []
        metrics = SpecDecodeMetrics(accepted_per_position=[0] * self.engine_config.k)
        for seq in g.seqs:
            metrics.merge(seq.metrics)
            outs.append(self._completion(seq))
        finished = g.finished
        if finished:
            self._groups.pop(g.request_id, None)
        return RequestOutput(request_id=g.request_id, prompt=g.prompt,
                             prompt_token_ids=list(g.prompt_ids), outputs=outs, finished=finished,
                             metrics=metrics)

    def _completion(self, seq: _Seq) -> CompletionOutput:
        if seq.detok is not None and not isinstance(seq.stop_reason, str):
            # (a matched stop string already set the final, cut text in _append)
            if seq.finish_reason is not None:
                seq.detok.flush()          # characters that never completed, as decode gives them
                seq.text = seq.detok.text
            else:
                text = seq.detok.text
                if seq.params.stop and not seq.params.include_stop_str_in_output:
                    # hold back what could be the start of a stop string
                    text = text[:max(len(text) - max(len(s) for s in seq.params.stop) + 1,
                                     seq.sent_text)]
                seq.text = text
        delta_ids = seq.output_ids[seq.sent_tokens:]
        delta_text = seq.text[seq.sent_text:]
        seq.sent_tokens, seq.sent_text = len(seq.output_ids), len(seq.text)
        return CompletionOutput(
            index=seq.index, text=seq.text, token_ids=list(seq.output_ids), delta_text=delta_text,
            delta_token_ids=list(delta_ids), finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
            logprobs=list(seq.logprobs) if seq.logprobs is not None else None)
