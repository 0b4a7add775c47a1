"""Where a :class:`~jmtp.runtime.device.runner.DeviceRunner` runs: one device (:class:`OneDevice`) or a
``("data", "model")`` mesh (:class:`OnMesh`). A placement builds the state and caches and jits the
step and the slot operations for its layout; the runner calls it with global slot indices.

Every slot operation that changes the free KV blocks also returns the new free counts as a device
value (``free``), which the runner reads only when the host asks (:meth:`free_list`): a release
dispatched while a step is in flight (asynchronous scheduling) does not wait for that step.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jmtp.model.llama import cache_row_width, init_kv_cache, init_model_cache
from jmtp.runtime.device import data_parallel as dpar, sharding as shd
from jmtp.runtime.device.executables import engine_function
from jmtp.runtime.device.handoff_ops import gather_slot, import_slot
from jmtp.runtime.device.spec import Caches
from jmtp.runtime.device.state import init_state, insert_request
from jmtp.runtime.device.step import (engine_step, push_free_blocks, release_slot, retire_slot,
                                      set_slot_state_of)
from jmtp.core import multihost as mh


@dataclasses.dataclass(frozen=True)
class DeviceOp:
    """One device operation of the runner, declared once; :class:`OneDevice` and :class:`OnMesh`
    jit every entry of :data:`DEVICE_OPS` from it.

    Attributes:
      single: the single-shard function (:mod:`~jmtp.runtime.device.step`,
        :mod:`~jmtp.runtime.device.state`, :mod:`~jmtp.runtime.device.slots`,
        :mod:`~jmtp.runtime.device.handoff_ops`): what runs on one device, and on each data shard.
      sharded: its own data-parallel form (:mod:`~jmtp.runtime.device.data_parallel`), called
        with the mesh first (unless ``mesh_arg`` is False); None (the slot operations that touch
        one shard): :func:`~jmtp.runtime.device.data_parallel.one_shard_op` of ``single``, with
        ``stacked``, ``pick`` and ``idle``.
      donate: the donated arguments: positions, or names (the step).
      static: static argument names (the step's ``spec``).
      config: the shard's :class:`~jmtp.runtime.config.EngineConfig` is bound as the first
        argument (after the mesh).
      free: the operation changes the free KV blocks: its new count (per shard on a mesh) is
        returned as one more output, read by the host only when it asks (the state itself is
        donated to the next call).
      outputs: each output's placement on a mesh: ``state`` (stacked state), ``target`` /
        ``mtp`` (stacked caches), ``caches`` (both), ``rep`` (replicated: the host reads it).
      first_call_key: on a multi-process mesh, the compiled shape of a call's positional
        arguments (:class:`~jmtp.core.multihost.SyncFirstCall`); None: one shape.
      mesh_arg: ``sharded`` takes the mesh as its first argument.
      param_specs: ``sharded`` takes the parameters' ``data`` placement (the step).
      stacked: leading arguments (and results) stacked per data shard: the state, or the state
        and both caches.
      pick: how the shards other than the slot's keep their arrays (``"where"`` / ``"cond"``,
        :func:`~jmtp.runtime.device.data_parallel.one_shard_op`).
      idle: with ``"cond"``, their results: ``idle(shard_config, *stacked arguments)``.
    """

    single: Callable
    sharded: Callable | None = None
    donate: tuple = (0,)
    static: tuple[str, ...] = ()
    config: bool = False
    free: bool = False
    outputs: tuple[str, ...] = ("state",)
    first_call_key: Callable | None = None
    mesh_arg: bool = True
    param_specs: bool = False
    stacked: int = 1
    pick: str = "where"
    idle: Callable | None = None


#: The runner's device operations (``OneDevice`` / ``OnMesh`` attribute ``<name>_fn``; the step
#: also as ``step``). Arguments after the bound mesh / config, as the single-shard function takes
#: them, except that a mesh call names a slot by ``(shard, row)`` (``slot_args``).
DEVICE_OPS: dict[str, DeviceOp] = {
    "step": DeviceOp(engine_step, dpar.data_parallel_step, donate=("state", "caches"),
                     static=("spec",), outputs=("state", "caches", "rep"),
                     first_call_key=lambda a: a[0].bucket, param_specs=True),
    "insert": DeviceOp(insert_request),
    "release": DeviceOp(release_slot, config=True, free=True, outputs=("state", "rep")),
    "retire": DeviceOp(retire_slot, config=True, free=True, outputs=("state", "rep", "rep"),
                       pick="cond", idle=lambda ec, st: (st, jnp.full((ec.pages_per_seq,), -1,
                                                                     jnp.int32))),
    "push_free": DeviceOp(push_free_blocks, free=True, outputs=("state", "rep"), pick="cond",
                          idle=lambda ec, st: st),
    "import": DeviceOp(import_slot, donate=(0, 1, 2), config=True, free=True,
                       outputs=("state", "target", "mtp", "rep", "rep"),
                       first_call_key=lambda a: tuple(v.shape for v in a[6].values()),
                       stacked=3, pick="cond", idle=lambda ec, *ops: (*ops, jnp.bool_(True))),
    "gather": DeviceOp(gather_slot, dpar.shard_gather, donate=(), outputs=("rep",),
                       first_call_key=lambda a: a[5].shape, mesh_arg=False),
    "slot_state": DeviceOp(set_slot_state_of, dpar.data_parallel_set_slot_state,
                           outputs=("target",)),
}


def _jit(fn, op: DeviceOp, **kw):
    donate = ({"donate_argnames": op.donate} if op.donate and isinstance(op.donate[0], str)
              else {"donate_argnums": op.donate})
    return jax.jit(fn, static_argnames=op.static or None, **donate, **kw)


class OneDevice:
    """Placement on one device: the plain single-shard functions, jitted (state and caches
    donated)."""

    num_shards = 1

    def __init__(self, runner, dtype, num_mtp_cache_layers: int):
        mc, ec = runner.model_config, runner.engine_config
        dev = runner.device
        self.arg_sharding = None if dev is None else jax.sharding.SingleDeviceSharding(dev)
        width = cache_row_width(mc, 1, ec.platform)
        make = lambda: (
            init_state(ec, mc.vocab_size),
            init_model_cache(mc, ec.num_blocks, ec.block_size, dtype, num_slots=ec.max_num_seqs,
                             window=ec.window, kv_cache_dtype=ec.kv_cache_dtype, row_width=width,
                             num_saved_states=ec.num_state_checkpoints),
            init_kv_cache(mc, num_mtp_cache_layers, ec.num_blocks, ec.block_size, dtype,
                          ec.kv_cache_dtype, width) if num_mtp_cache_layers else None)
        if runner.abstract:     # shapes only, on the (possibly compile-only) device
            trees = abstract_on(jax.eval_shape(make), self.arg_sharding)
            runner.params = abstract_on(runner.params, self.arg_sharding)
        else:
            trees = make() if dev is None else jax.device_put(make(), dev)
            if dev is not None:
                runner.params = jax.device_put(runner.params, dev)
        runner.state, runner.cache, runner.mtp_cache = trees
        # function objects per engine configuration: its executables go when its engines do
        key = (runner.graphdef, runner.shard_config, runner.attention, dev)
        for name, op in DEVICE_OPS.items():
            fn = (functools.partial(op.single, runner.shard_config) if op.config
                  else engine_function(op.single, key))
            setattr(self, f"{name}_fn", _jit(_with_free(fn) if op.free else fn, op))
        self.step = self.step_fn

    @staticmethod
    def host_lanes(x: np.ndarray):
        return x

    def to_device(self, x: np.ndarray):
        return jnp.asarray(x) if self.arg_sharding is None else jax.device_put(x, self.arg_sharding)

    @staticmethod
    def slot_args(b: int) -> tuple:
        return (jnp.int32(b),)

    @staticmethod
    def fetch_step(out):
        out = jax.device_get(out)
        return dataclasses.replace(out, free_count=np.reshape(out.free_count, (1,)))

    @staticmethod
    def free_list(free) -> list[int]:
        """The free counts ``i32[]`` an operation returned, on the host (waits for it)."""
        return [int(free)]

    def release(self, state, b):
        return self.release_fn(state, jnp.int32(b))

    def retire(self, state, b, keep):
        state, kept, free = self.retire_fn(state, jnp.int32(b), jnp.asarray(keep))
        return state, np.asarray(kept), free

    def push_free(self, state, shard, ids):
        return self.push_free_fn(state, jnp.asarray(ids))

    def owned_blocks(self, state, b) -> np.ndarray:
        return np.asarray(state.block_tables[b])[:int(state.num_owned[b])]

    def gather(self, state, cache, mtp_cache, b, ids):
        return jax.device_get(self.gather_fn(state, cache, mtp_cache, jnp.int32(b),
                                             jnp.asarray(ids)))

    def import_(self, state, cache, mtp_cache, b, row, kv, n):
        state, cache, mtp_cache, ok, free = self.import_fn(state, cache, mtp_cache,
                                                           jnp.int32(b), row, kv, jnp.int32(n))
        return state, cache, mtp_cache, bool(ok), self.free_list(free)


class OnMesh:
    """Placement on a ``("data", "model")`` mesh: state and caches stacked per data shard
    (leading axis over ``data``, kv heads over ``model``), parameters sharded by their logical
    axes and replicated over ``data``, except the routed experts under expert parallelism, split
    over ``data × model`` (:mod:`jmtp.runtime.device.sharding`). Every jitted function's
    output shardings equal its input ones (donation in place, no recompiles); what the host reads
    (``StepOutput``, free block counts, exported pages) comes back replicated."""

    def __init__(self, runner, dtype, num_mtp_cache_layers: int):
        mesh, mc, ec = runner.mesh, runner.model_config, runner.engine_config
        sec, dp = runner.shard_config, runner.num_shards
        self.num_shards, self.Bl = dp, sec.max_num_seqs
        rep = self.rep = shd.replicated(mesh)
        st = shd.state_sharding(mesh)
        quant = ec.kv_cache_dtype is not None
        kv = shd.kv_cache_shardings(mesh, mc.kv_cache_heads, quant, stacked=True)
        # the target's cache; a hybrid model's also holds the recurrent state pool
        tkv = shd.kv_cache_shardings(mesh, mc.kv_cache_heads, quant, stacked=True,
                                     linear_heads=mc.linear.num_value_heads if mc.is_hybrid
                                     else None, linear_saved=ec.num_state_checkpoints > 0)
        self.arg_sharding = rep
        moe = mc.moe
        pshard = shd.param_shardings(runner.params, mesh,
                                     expert_parallel=moe is not None and moe.expert_parallel)
        init_st = jax.jit(lambda: dpar.stack_shards(init_state(sec, mc.vocab_size), dp),
                          out_shardings=st)
        width = cache_row_width(mc, shd.mesh_sizes(mesh)[1], ec.platform)
        init_target = jax.jit(lambda: dpar.stack_shards(init_model_cache(
            mc, sec.num_blocks, sec.block_size, dtype, num_slots=sec.max_num_seqs,
            window=ec.window, kv_cache_dtype=ec.kv_cache_dtype, row_width=width,
            num_saved_states=sec.num_state_checkpoints), dp),
            out_shardings=tkv)
        init_kv = lambda n: jax.jit(lambda: dpar.stack_shards(
            init_kv_cache(mc, n, sec.num_blocks, sec.block_size, dtype, ec.kv_cache_dtype, width),
            dp), out_shardings=kv)
        if runner.abstract:     # shapes and shardings only (compile-only devices: jmtp.aot)
            runner.params = abstract_on(runner.params, pshard)
            runner.state = abstract_on(init_st.eval_shape(), st)
            runner.cache = abstract_on(init_target.eval_shape(), tkv)
            make = lambda n: abstract_on(init_kv(n).eval_shape(), kv)
        else:
            runner.params = mh.put(runner.params, pshard, what="parameters")
            runner.state = init_st()
            runner.cache = init_target()
            make = lambda n: init_kv(n)()
        runner.mtp_cache = make(num_mtp_cache_layers) if num_mtp_cache_layers else None
        mkv = kv if runner.mtp_cache is not None else None
        placed = {"state": st, "target": tkv, "mtp": mkv, "caches": Caches(tkv, mkv), "rep": rep}
        sync = jax.process_count() > 1
        for name, op in DEVICE_OPS.items():
            if op.sharded is None:      # a slot operation on one shard, derived from the table
                sharded = _named(f"data_parallel_{name}", functools.partial(
                    dpar.one_shard_op, mesh, op.single, config=sec if op.config else None,
                    stacked=op.stacked, pick=op.pick, idle=op.idle, free=op.free))
            else:
                bound = ((mesh,) if op.mesh_arg else ()) + ((sec,) if op.config else ())
                extra = {"param_specs": shd.data_specs(pshard)} if op.param_specs else {}
                sharded = functools.partial(op.sharded, *bound, **extra)
            outs = tuple(placed[k] for k in op.outputs)
            fn = _jit(sharded, op, out_shardings=outs if len(outs) > 1 else outs[0])
            if sync:
                # the first run of each step bucket (and of each slot operation) waits until
                # every process has compiled it (jmtp.core.multihost.SyncFirstCall)
                fn = mh.SyncFirstCall(fn, key=op.first_call_key, name=name)
            setattr(self, f"{name}_fn", fn)
        self.step = self.step_fn
        self.owned_fn = jax.jit(lambda s, d, r: (s.num_owned[d, r], s.block_tables[d, r]),
                                out_shardings=rep)
        if sync:
            self.owned_fn = mh.SyncFirstCall(self.owned_fn, name="owned")

    def host_lanes(self, x: np.ndarray):
        return x.reshape((self.num_shards, self.Bl) + x.shape[1:])

    @staticmethod
    def to_device(x: np.ndarray):
        return x     # numpy: jit places it (the same on every process)

    def slot_args(self, b: int) -> tuple:
        return jnp.int32(b // self.Bl), jnp.int32(b % self.Bl)

    def fetch_step(self, out):
        out = mh.fetch(out)      # replicated: the same on every process
        n = self.num_shards * self.Bl
        flat = {f.name: np.reshape(v, (n,) + v.shape[2:]) for f in dataclasses.fields(out)
                if (v := getattr(out, f.name)) is not None and f.name != "free_count"}
        return dataclasses.replace(out, **flat)

    @staticmethod
    def free_list(free) -> list[int]:
        """The free counts ``i32[D]`` an operation returned, on the host (waits for it)."""
        return [int(x) for x in mh.fetch(free)]

    def release(self, state, b):
        return self.release_fn(state, *self.slot_args(b))

    def retire(self, state, b, keep):
        state, kept, free = self.retire_fn(state, *self.slot_args(b), jnp.asarray(keep))
        return state, np.asarray(mh.fetch(kept))[b // self.Bl], free

    def push_free(self, state, shard, ids):
        return self.push_free_fn(state, jnp.int32(shard), jnp.asarray(ids))

    def owned_blocks(self, state, b) -> np.ndarray:
        owned, table = mh.fetch(self.owned_fn(state, *self.slot_args(b)))
        return np.asarray(table)[:int(owned)]

    def gather(self, state, cache, mtp_cache, b, ids):
        return mh.fetch(self.gather_fn(state, cache, mtp_cache, *self.slot_args(b),
                                       jnp.asarray(ids)))

    def import_(self, state, cache, mtp_cache, b, row, kv, n):
        state, cache, mtp_cache, ok, free = self.import_fn(state, cache, mtp_cache,
                                                           *self.slot_args(b), row, kv,
                                                           jnp.int32(n))
        return (state, cache, mtp_cache, bool(mh.fetch(ok)[b // self.Bl]),
                self.free_list(free))


def _named(name: str, fn):
    """``fn`` under ``name`` (the jitted program's name: ``jit_<name>`` in dumps and profiles)."""
    def named(*args):
        return fn(*args)
    named.__name__ = named.__qualname__ = name
    return named


def _with_free(fn):
    """``fn`` (a slot operation returning the state, or a tuple led by it) that also returns the
    new state's free block count as a separate output (read by the host later; the state itself
    is donated to the next call)."""
    def wrapped(*args):
        out = fn(*args)
        state = out[0] if isinstance(out, tuple) else out
        return (*out, state.free_count) if isinstance(out, tuple) else (out, state.free_count)
    return wrapped


def abstract_on(tree, shardings):
    """``tree``'s arrays (or ``ShapeDtypeStruct``s) as ``jax.ShapeDtypeStruct``s placed by
    ``shardings`` (one sharding for every leaf, a tree of them matching ``tree``, or None)."""
    def one(x, s):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
    if shardings is None or isinstance(shardings, jax.sharding.Sharding):
        return jax.tree.map(lambda x: one(x, shardings), tree)
    return jax.tree.map(one, tree, shardings)



__all__ = ["DEVICE_OPS", "DeviceOp", "OneDevice", "OnMesh", "abstract_on"]
