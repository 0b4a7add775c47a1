"""``DeviceRunner``: the device side of :class:`~jmtp.runtime.host.llm_engine.LLMEngine`.

The runner alone owns the model (``graphdef`` and the parameters' ``nnx.State``), the engine state,
both KV caches and every jitted function, and it alone knows whether the engine runs on one
device or on a ``("data", "model")`` mesh. It decides that once, at construction, by choosing a
placement (:class:`OneDevice` or :class:`OnMesh`); every method below takes *global* slot indices
``b`` in ``[0, max_num_seqs)`` and host (numpy) arrays, whatever the placement. On a mesh slot
``b`` is row ``b % Bl`` of data shard ``b // Bl`` (``Bl = max_num_seqs / data_parallel_size``)
and block ids are shard-local (:mod:`jmtp.runtime.device.data_parallel`).

The scheduler and the request table never touch a device array: everything they need comes back
from :meth:`DeviceRunner.run_step` as a host :class:`~jmtp.runtime.device.step.StepOutput` and from
:attr:`DeviceRunner.free_counts`. That seam is what ``tests/runtime/fake_runner.py`` replaces to
test the host logic without XLA.
"""
from __future__ import annotations

import dataclasses
import functools
import time
from typing import Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jmtp.model.config import ModelConfig
from jmtp.model.modules import LlamaForCausalLM
from jmtp.pallas.ragged_paged_attention import resolve_backend
from jmtp.runtime.config import EngineConfig
from jmtp.runtime.device import data_parallel as dpar, sharding as shd
from jmtp.runtime.device.bitmask import neutral_inputs
from jmtp.runtime.device.buckets import StepBucket, decode_buckets, slot_buckets, step_buckets
from jmtp.runtime.device.handoff_ops import LINEAR_PREFIX, page_bucket, row_keys
from jmtp.runtime.device.placement import OneDevice, OnMesh
from jmtp.runtime.device.spec import Caches, StepInputs, StepSpec


@dataclasses.dataclass
class DispatchedStep:
    """A step handed to the device (:meth:`DeviceRunner.dispatch_step`) whose outputs are not
    read yet: ``bucket``, the device ``StepOutput`` ``out``, whether it was the bucket's first
    run (``first``) and the seconds of the dispatch call (``dispatch_seconds``: tracing and
    compiling on a first run, else enqueueing)."""

    bucket: StepBucket
    out: object
    first: bool
    dispatch_seconds: float
    op: int = 0           # the runner's device-operation number (free counts bookkeeping)


class DeviceRunner:
    """Parameters, engine state, KV caches and the jitted step, insert, release, retire and
    hand-off functions of one engine, on one device or a mesh.

    Args:
      model_config: the target's :class:`ModelConfig`.
      params: the parameter dict (as loaded, transforms applied: FR-Spec head, key shift,
        unstacked layers); split here into ``graphdef`` and the ``nnx.State`` :attr:`params`.
      engine_config: the engine's :class:`EngineConfig` (sizes are totals over data shards).
      mesh: a ``jax.sharding.Mesh`` with axes ``("data", "model")`` of more than one device, or
        None for one device.
      dtype: parameter and cache dtype.
      attention_backend: the step's attention implementation (static).
      num_mtp_cache_layers: layers of the MTP KV cache (0: none).
      compile_ahead: the process's ahead-of-time compiler, called as ``compile_ahead(fn,
        arg_lists, *, labels, desc, progress, budget, on_compiled, on_executable)`` and returning
        ``{label: seconds}`` (the host passes
        :func:`jmtp.runtime.process.compile.compile_ahead`).
      map_budget: the process's memory-map budget, checked before each new step bucket's
        compile and measuring it (``check(label, remaining=1)``, ``start()``, ``stop()``; the host
        passes a :class:`jmtp.runtime.process.host_maps.MapBudget`); None: nothing is checked.
      compile_mode: one of :data:`~jmtp.runtime.process.compile.COMPILE_MODES` (read by the
        engine's ``bucket_to_run``, :mod:`jmtp.runtime.host.engine_compile`).
      device: without a mesh, the device to run on (default: JAX's default device).
      abstract: build with ``jax.ShapeDtypeStruct``s only (``params`` may be abstract too): no
        array is allocated, the devices may be compile-only (a TPU topology); the runner then
        only compiles (:meth:`compile_buckets`, :meth:`compile_slot_ops`, :mod:`jmtp.aot`),
        running raises ``RuntimeError``.

    Attributes (public, read by the engine and tests): ``graphdef``, ``params``, ``state``,
    ``cache``, ``mtp_cache``, ``mesh``, ``shard_config`` (one data shard's config as the device
    step sees it: :meth:`EngineConfig.device_config`),
    ``num_shards``, ``free_counts`` (free KV blocks per data shard, ``list[int]``),
    ``jitted_step`` (the jitted :func:`~jmtp.runtime.device.step.engine_step` or its data-parallel form;
    tests wrap it), ``first_call_seconds``, ``map_budget``.
    """

    def __init__(self, model_config: ModelConfig, params: dict, engine_config: EngineConfig, *,
                 mesh, dtype, attention_backend: str | None, num_mtp_cache_layers: int,
                 compile_ahead: Callable[..., dict], map_budget=None,
                 compile_mode: str = "eager", device=None, abstract: bool = False):
        self.model_config, self.engine_config, self.mesh = model_config, engine_config, mesh
        self.attention_backend, self.compile_mode = attention_backend, compile_mode
        self.device, self.abstract = device, abstract
        # the step's attention backend, resolved once (StepSpec.attention)
        self.attention = resolve_backend(attention_backend, engine_config.platform)
        self.num_shards = shd.mesh_sizes(mesh)[0] if mesh is not None else 1
        self.tensor_parallel_size = shd.mesh_sizes(mesh)[1] if mesh is not None else 1
        self.shard_config = dpar.shard_config(engine_config.device_config(), self.num_shards)
        # The model as an NNX module, split once: the jitted step takes the pure state (arrays
        # with their logical-axis metadata) and merges it with the static graph definition inside.
        self.graphdef, self.params = nnx.split(LlamaForCausalLM.from_params(model_config, params))
        self.placement = (OneDevice if mesh is None else OnMesh)(self, dtype,
                                                                 num_mtp_cache_layers)
        self.jitted_step = self.placement.step
        # free KV blocks per data shard: the last value read, and the newest device value not
        # read yet (op number, array): a release or a step in flight is read only when asked
        self._free = [self.shard_config.num_blocks] * self.num_shards
        self._free_pending: tuple[int, object] | None = None
        self._op = 0
        # XLA:CPU maps every compiled kernel on its own and aborts the process past the map
        # limit: each new step bucket is checked first (jmtp.runtime.process.host_maps). Both
        # are process-level services the host hands in: device code imports nothing of process/.
        self.map_budget, self._compile_ahead = map_budget, compile_ahead
        self._compiled: set[StepBucket] = set()
        # {bucket label: seconds} of each bucket's first run (tracing, then compiling or loading
        # it from the persistent cache, then the step itself): where lazy compiles go
        self.first_call_seconds: dict[str, float] = {}
        self._neutral: tuple | None = None

    # ------------------------------------------------------------------ free blocks
    @property
    def free_counts(self) -> list[int]:
        """Free KV blocks per data shard after every device call made so far (``list[int]``;
        waits for the newest one that changed them, e.g. a step in flight)."""
        if self._free_pending is not None:
            self._free = self.placement.free_list(self._free_pending[1])
            self._free_pending = None
        return list(self._free)

    def peek_free_counts(self) -> list[int]:
        """:attr:`free_counts` without waiting: the newest value already computed (may lag a
        step in flight; for monitoring only, never for decisions)."""
        pending = self._free_pending
        if pending is not None and all(
                x.is_ready() for x in jax.tree_util.tree_leaves(pending[1])):
            return self.free_counts
        return list(self._free)

    def _changed_free(self, free) -> int:
        """A device call just changed the free counts to ``free`` (a device value, read
        lazily); returns the call's operation number."""
        self._op += 1
        self._free_pending = (self._op, free)
        return self._op

    # ------------------------------------------------------------------ buckets and compiles
    @property
    def compiled_buckets(self) -> frozenset[StepBucket]:
        """The step buckets compiled so far (ahead of time or by a first run)."""
        return frozenset(self._compiled)

    @functools.cached_property
    def largest_bucket(self) -> StepBucket:
        """The largest of :func:`~jmtp.runtime.device.buckets.step_buckets`: the token budget over
        every slot (it holds any step; ``compile="largest"`` runs every step in it). Computed once
        (``shard_config`` is fixed at construction)."""
        return step_buckets(self.shard_config)[-1]

    def uncompiled_buckets(self) -> tuple[StepBucket, ...]:
        """The step buckets (:func:`~jmtp.runtime.device.buckets.step_buckets`) not compiled yet."""
        return tuple(b for b in step_buckets(self.shard_config) if b not in self._compiled)

    def check_bucket(self, bucket: StepBucket) -> None:
        """Raise :class:`~jmtp.runtime.process.host_maps.MapLimitError` if ``bucket`` is not compiled
        yet and its compile would cross the process's memory-map limit. On a multi-process mesh
        nothing is checked: each process counts its own mappings, and one process refusing a
        compile the others start would leave them waiting at its barrier."""
        if (bucket not in self._compiled and jax.process_count() == 1
                and self.map_budget is not None):
            self.map_budget.check(bucket.label)

    def step_spec(self, bucket: StepBucket) -> StepSpec:
        """The step's static :class:`~jmtp.runtime.device.spec.StepSpec` for ``bucket``."""
        return StepSpec(self.graphdef, self.shard_config, bucket, self.attention)

    def step_args(self, bucket: StepBucket, chunks: np.ndarray | None = None,
                  limits: np.ndarray | None = None,
                  guide: tuple[np.ndarray | None, np.ndarray | None] | None = None) -> tuple:
        """The jitted step's positional arguments ``(spec, model_state, state, caches, inputs)``
        for ``bucket``: the one place that builds them (the runner's own calls, compiles, AOT,
        scripts and tests). ``chunks`` / ``limits`` ``i32[B]`` default to zeros; ``guide`` as
        for :meth:`run_step` (None: no structured-output constraint)."""
        p = self.placement
        lanes = lambda x: self.lift(p.host_lanes(x))
        zeros = np.zeros((self.engine_config.max_num_seqs,), np.int32)
        neutral = self.neutral_guide()
        bitmask, override = (neutral if guide is None else
                             (n if x is None else lanes(x) for x, n in zip(guide, neutral)))
        inputs = StepInputs(lanes(zeros if chunks is None else chunks),
                            lanes(zeros if limits is None else limits), bitmask, override)
        return (self.step_spec(bucket), self.params, self.state,
                Caches(self.cache, self.mtp_cache), inputs)

    def neutral_guide(self) -> tuple:
        """The step's ``token_bitmask`` / ``draft_override`` arguments that constrain nothing,
        placed once and reused (they are not donated)."""
        if self._neutral is None:
            ec = self.engine_config
            self._neutral = tuple(self.lift(self.placement.host_lanes(x)) for x in
                                  neutral_inputs(ec.max_num_seqs, ec.window,
                                                 self.model_config.vocab_size))
        return self._neutral

    def lift(self, x):
        """A host value as a device argument: ``jnp.asarray`` (on the runner's device, if one was
        given), or for an abstract runner a ``ShapeDtypeStruct`` replicated on its devices."""
        if isinstance(x, jax.ShapeDtypeStruct):
            return x
        x = np.asarray(x)
        if self.abstract:
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=self.placement.arg_sharding)
        return self.placement.to_device(x)

    def context(self):
        """The context every trace of the runner's functions runs in: the mesh
        (:func:`jmtp.core.mesh.mesh_context`), or the runner's device as JAX's default device
        (what Pallas reads the target chip from when compiling for a compile-only device)."""
        if self.mesh is None and self.device is not None:
            return jax.default_device(self.device)
        return shd.mesh_context(self.mesh)

    def close(self) -> None:
        """Release the engine's device arrays and compiled executables: the state and KV caches
        are deleted, the parameters and every jitted function dropped (JAX's caches of them go
        with them, :mod:`jmtp.runtime.device.executables`; the parameters live on if the caller holds
        them). Idempotent; any later call that runs something raises ``RuntimeError``."""
        if self.placement is None:
            return
        for tree in (self.state, self.cache, self.mtp_cache):
            for x in jax.tree.leaves(tree):
                if isinstance(x, jax.Array) and not x.is_deleted():
                    x.delete()
        self.placement = self.jitted_step = self._neutral = None
        self.state = self.cache = self.mtp_cache = self.params = None

    @property
    def closed(self) -> bool:
        return self.placement is None

    def _check_concrete(self):
        if self.placement is None:
            raise RuntimeError("this engine is closed")
        if self.abstract:
            raise RuntimeError("this engine was built abstractly (shapes only, for ahead-of-time "
                               "compiles, jmtp.aot); it cannot run")

    def compile_buckets(self, buckets: Iterable[StepBucket] | None = None, *,
                        progress: bool = False, on_executable=None) -> dict[str, float]:
        """Compile step buckets (default: every uncompiled one) without running them;
        ``{bucket label: seconds}`` (see :meth:`LLMEngine.compile_buckets`). ``on_executable``:
        as :func:`~jmtp.runtime.process.compile.compile_ahead`."""
        todo = (list(self.uncompiled_buckets()) if buckets is None
                else [b for b in buckets if b not in self._compiled])
        if not todo:
            return {}
        with self.context():
            return self._compile_ahead(
                self.jitted_step, [self.step_args(b) for b in todo],
                labels=[b.label for b in todo], desc="compile step buckets", progress=progress,
                on_compiled=lambda i: self._compiled.add(todo[i]), on_executable=on_executable,
                budget=(self.map_budget if jax.process_count() == 1 and not self.abstract
                        else None))

    def compile_slot_ops(self, sampling_row: dict, on_executable=None) -> dict[str, float]:
        """Compile the request insert and the slot release (and, with prefix caching, the slot
        retire and the free-block push) ahead; ``{label: seconds}``. ``on_executable``: as
        :func:`~jmtp.runtime.process.compile.compile_ahead`."""
        sec, p = self.shard_config, self.placement
        a = self.lift if self.abstract else jnp.asarray
        fix = (lambda args: tuple(jax.tree.map(a, args))) if self.abstract else tuple
        slot = p.slot_args(0)
        ops = [("insert", p.insert_fn, (
            self.state, *slot, a(np.zeros((sec.seq_buffer_len,), np.int32)),
            jnp.int32(1), jnp.int32(1), {k: a(v) for k, v in sampling_row.items()},
            jnp.int32(-1), *self._prefix_args([]))),
            ("release", p.release_fn, (self.state, *slot))]
        if self.engine_config.enable_prefix_caching:
            shard = () if self.mesh is None else (jnp.int32(0),)
            ops += [("retire", p.retire_fn, (self.state, *slot,
                                              jnp.zeros((sec.pages_per_seq,), bool))),
                    ("push_free", p.push_free_fn, (self.state, *shard,
                                                    jnp.full((sec.num_blocks,), -1, jnp.int32)))]
            if sec.num_state_checkpoints:
                ops.append(("slot_state", p.slot_state_fn, (self.cache, *slot, jnp.int32(-1),
                                                            jnp.int32(-1))))
        times = {}
        with self.context():
            for label, fn, args in ops:
                args = (args[0],) + fix(args[1:])    # the state is abstract already
                times.update(self._compile_ahead(fn, [args], labels=[label], progress=False,
                                                 on_executable=on_executable))
        return times

    def time_decode_buckets(self, repeats: int) -> dict[StepBucket, float]:
        """``{bucket: seconds}``: the fastest of ``repeats`` timed runs (after one untimed) of
        every decode bucket with no request scheduled (the dynamic policy's seed costs; an idle
        step changes no cache, block table or request state)."""
        sec = self.shard_config
        zeros = np.zeros((self.engine_config.max_num_seqs,), np.int32)
        seconds = {}
        for bk in sorted({StepBucket(t, a) for a in slot_buckets(sec)
                          for t in decode_buckets(sec, a)}):
            times = []
            for i in range(repeats + 1):
                t0 = time.perf_counter()
                self.run_step(bk, zeros, zeros)
                if i:
                    times.append(time.perf_counter() - t0)
            seconds[bk] = min(times)
        return seconds

    # ------------------------------------------------------------------ device calls
    def run_step(self, bucket: StepBucket, chunks: np.ndarray, limits: np.ndarray,
                 guide: tuple[np.ndarray, np.ndarray] | None = None):
        """Run the jitted step in ``bucket`` with prefill chunks and draft limits ``i32[B]``, and
        ``guide`` = ``(token_bitmask i32[B, K+1, NW], draft_override i32[B, K])`` when a
        structured-output request runs or the host drafts (None: the placed neutral pair; a None
        element: that one of the pair), and read its outputs:
        :meth:`fetch_step` of :meth:`dispatch_step`.

        Returns:
          its :class:`~jmtp.runtime.device.step.StepOutput` on the host, fields ``[B, ...]`` and
          ``free_count`` ``i32[num_shards]``. The first run of a bucket is timed into
          :attr:`first_call_seconds` and measured for the memory-map budget (checked before by
          :meth:`check_bucket`).
        """
        return self.fetch_step(self.dispatch_step(bucket, chunks, limits, guide))

    def dispatch_step(self, bucket: StepBucket, chunks: np.ndarray, limits: np.ndarray,
                      guide: tuple[np.ndarray, np.ndarray] | None = None) -> DispatchedStep:
        """Hand the step to the device (JAX's asynchronous dispatch: returns once it is
        enqueued, after tracing and compiling a bucket's first run); arguments as
        :meth:`run_step`. The state and caches become the step's outputs at once, so every later
        device call runs after it. Read its outputs with :meth:`fetch_step`."""
        self._check_concrete()
        first = bucket not in self._compiled
        budget = self.map_budget if first else None
        if budget is not None:
            budget.start()
        t0 = time.perf_counter()
        with self.context():
            self.state, caches, out = self.jitted_step(
                *self.step_args(bucket, chunks, limits, guide))
        self.cache, self.mtp_cache = caches.target, caches.mtp
        seconds = time.perf_counter() - t0
        if first:
            if budget is not None:
                budget.stop()
            self._compiled.add(bucket)
            # the compile is known now (a clock reading first runs between this dispatch and the
            # fetch sees it); fetch_step adds the wait for the outputs
            self.first_call_seconds[bucket.label] = seconds
        return DispatchedStep(bucket, out, first, seconds, self._changed_free(out.free_count))

    def fetch_step(self, step: DispatchedStep):
        """The outputs of a dispatched step on the host (waits for it): a
        :class:`~jmtp.runtime.device.step.StepOutput` as :meth:`run_step` returns. A bucket's first run
        is timed into :attr:`first_call_seconds`: its dispatch call and this wait."""
        t0 = time.perf_counter()
        out = self.placement.fetch_step(step.out)
        if step.first:
            self.first_call_seconds[step.bucket.label] = (step.dispatch_seconds
                                                          + time.perf_counter() - t0)
        if self._free_pending is not None and self._free_pending[0] == step.op:
            self._free, self._free_pending = [int(x) for x in out.free_count], None
        return out

    def _prefix_args(self, block_ids: list[int]) -> tuple:
        """The insert call's shared-prefix arguments (none without prefix caching)."""
        if not self.engine_config.enable_prefix_caching:
            return ()
        row = np.full((self.engine_config.pages_per_seq,), -1, np.int32)
        row[:len(block_ids)] = block_ids
        n = len(block_ids)
        return jnp.asarray(row), jnp.int32(n), jnp.int32(n * self.engine_config.block_size)

    def insert(self, b: int, ids: np.ndarray, prompt_len: int, remaining: int, row: dict,
               resume_token: int, shared_ids: list[int] = ()) -> None:
        """:func:`~jmtp.runtime.device.state.insert_request` into idle slot ``b``: ``ids i32[Lbuf]``
        (prompt, padded), ``remaining`` tokens to generate, a sampling ``row``
        (:func:`~jmtp.runtime.host.sampling_rows.make_row`), ``resume_token`` (-1: a new request) and,
        with prefix caching, the shard-local ids of the cached prefix blocks it reads."""
        self._check_concrete()
        args = (jnp.asarray(ids), jnp.int32(prompt_len), jnp.int32(remaining),
                {k: jnp.asarray(v) for k, v in row.items()}, jnp.int32(resume_token))
        with self.context():
            self.state = self.placement.insert_fn(self.state, *self.placement.slot_args(b),
                                                  *args, *self._prefix_args(shared_ids))

    def release(self, b: int) -> None:
        """Return slot ``b``'s KV blocks and mark it idle (:func:`~jmtp.runtime.device.step.release_slot`)."""
        with self.context():
            self.state, free = self.placement.release(self.state, b)
        self._changed_free(free)

    def retire(self, b: int, keep: np.ndarray) -> np.ndarray:
        """Empty slot ``b`` keeping its owned blocks ``keep bool[P]`` out of the allocator
        (:func:`~jmtp.runtime.device.step.retire_slot`); returns the kept ids ``i32[P]`` (-1 padded,
        shard-local)."""
        with self.context():
            self.state, kept, free = self.placement.retire(self.state, b, keep)
        self._changed_free(free)
        return kept

    def set_slot_state(self, b: int, load_entry: int, capture_entry: int) -> None:
        """A hybrid model's slot ``b`` continues from state checkpoint ``load_entry`` (shard-local,
        -1: none) and captures its block-boundary states into ``capture_entry`` (-1: none)
        (:func:`jmtp.model.state_checkpoints.set_slot_state`; prefix caching)."""
        self._check_concrete()
        with self.context():
            self.cache = self.placement.slot_state_fn(
                self.cache, *self.placement.slot_args(b), jnp.int32(load_entry),
                jnp.int32(capture_entry))

    def push_free(self, shard: int, ids: list[int]) -> None:
        """Push shard-local block ids onto data shard ``shard``'s free stack
        (:func:`~jmtp.runtime.device.step.push_free_blocks`)."""
        buf = np.full((self.shard_config.num_blocks,), -1, np.int32)
        buf[:len(ids)] = ids
        with self.context():
            self.state, free = self.placement.push_free(self.state, shard, buf)
        self._changed_free(free)

    # ------------------------------------------------------------------ hand-off
    def row_keys(self) -> set[str]:
        """The keys of ``RequestState.row`` this engine reads and writes."""
        return row_keys(self.state)

    def export_slot(self, b: int) -> tuple[dict, dict]:
        """Slot ``b``'s state row and KV pages on the host (:func:`jmtp.runtime.device.handoff_ops.gather_slot`):
        ``(row {key: array}, kv {name: [L, pages, ...]})``, the full (unsharded) arrays."""
        owned = self.placement.owned_blocks(self.state, b)
        ids = np.zeros((page_bucket(len(owned), self.engine_config.pages_per_seq),), np.int32)
        ids[:len(owned)] = owned
        with self.context():
            row, kv = self.placement.gather(self.state, self.cache, self.mtp_cache, b, ids)
        return ({k: np.asarray(v) for k, v in row.items()},
                {k: np.asarray(v) if k.startswith(LINEAR_PREFIX) else np.asarray(v)[:, :len(owned)]
                 for k, v in kv.items()})

    def import_slot(self, b: int, row: dict, kv: dict, num_pages: int) -> bool:
        """Write an exported row and its KV pages into idle slot ``b``, its blocks allocated
        here (:func:`jmtp.runtime.device.handoff_ops.import_slot`); False if the allocator could not."""
        pb = page_bucket(num_pages, self.engine_config.pages_per_seq)
        padded = {}
        for k, a in kv.items():
            if k.startswith(LINEAR_PREFIX):       # a hybrid model's slot state: no pages
                padded[k] = jnp.asarray(a)
                continue
            pad = np.zeros((a.shape[0], pb) + a.shape[2:], a.dtype)
            pad[:, :num_pages] = a
            padded[k] = jnp.asarray(pad)
        with self.context():
            (self.state, self.cache, self.mtp_cache, ok,
             self._free) = self.placement.import_(
                self.state, self.cache, self.mtp_cache, b,
                {k: jnp.asarray(v) for k, v in row.items()}, padded, num_pages)
        self._op += 1
        self._free_pending = None       # read already (the import's answer was waited for)
        return ok

    # ------------------------------------------------------------------ memory
    def memory_per_device(self) -> dict:
        """``{"params": (per device, total), "kv_cache": (per device, total)}`` bytes (the MTP
        cache counted with the KV cache; per device = the first device of the mesh)."""
        p_total, p_local = shd.per_device_bytes(self.params)
        c_total, c_local = shd.per_device_bytes((self.cache, self.mtp_cache))
        return {"params": (p_local, p_total), "kv_cache": (c_local, c_total)}

    def param_bytes(self) -> dict[str, int]:
        """Device bytes of the parameters by kind (whole arrays; per device:
        :meth:`memory_per_device`): ``quantized_values`` (the 8-bit weights, one byte each),
        ``scales`` (their f32 scales), ``unquantized`` (every other parameter, in the model
        dtype), ``total``, and ``quantized_elements`` (:func:`jmtp.model.quant_params.param_bytes`)."""
        from jmtp.model.quant_params import param_bytes
        return param_bytes(nnx.merge(self.graphdef, self.params).to_params())

    def kv_cache_bytes(self) -> dict[str, int]:
        """Device bytes of the KV caches, values and quantisation scales apart.

        Keys: ``target_values``, ``target_scales``, ``mtp_values``, ``mtp_scales`` (0 without an
        MTP cache), ``values``, ``scales`` (sums), ``linear_state`` (a hybrid model's recurrent
        state pool, :class:`~jmtp.model.gated_deltanet.LinearState`: ``max_num_seqs · (K+1)``
        checkpoints of every linear layer's convolution and delta-rule state; 0 otherwise),
        ``prefix_states`` (with prefix caching, its block-boundary state checkpoints:
        ``EngineConfig.num_state_checkpoints`` entries of ``prefix_state_entry`` bytes) and
        ``total``. Values take
        ``2 · layers · num_blocks · block_size · Nkv · D · itemsize`` bytes (itemsize 1 for
        ``kv_cache_dtype`` ``"int8"`` / ``"fp8_e4m3"``); scales ``2 · layers · num_blocks ·
        block_size · Nkv · 4`` (0 unquantised).
        """
        tv, ts = self.cache.nbytes()
        mv, ms = self.mtp_cache.nbytes() if self.mtp_cache is not None else (0, 0)
        lin = self.cache.linear.nbytes() if self.cache.linear is not None else 0
        saved = self.cache.linear.saved if self.cache.linear is not None else None
        states = saved.conv.nbytes + saved.recurrent.nbytes if saved is not None else 0
        n = self.engine_config.num_state_checkpoints
        return dict(target_values=tv, target_scales=ts, mtp_values=mv, mtp_scales=ms,
                    values=tv + mv, scales=ts + ms, linear_state=lin - states,
                    prefix_states=states, prefix_state_entry=states // n if n else 0,
                    total=tv + mv + ts + ms + lin)


__all__ = ["DeviceRunner", "OneDevice", "OnMesh"]
