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

import jax
import jax.numpy as jnp
import numpy as np

from jmtp.model.llama import cache_row_width, init_kv_cache, init_model_cache
from jmtp.runtime.device import data_parallel as dpar, sharding as shd
from jmtp.runtime.device.executables import engine_function
from jmtp.runtime.device.handoff_ops import gather_slot, import_slot
from jmtp.runtime.device.state import init_state, insert_request
from jmtp.runtime.device.step import (engine_step, push_free_blocks, release_slot, retire_slot,
                                      set_slot_state_of)
from jmtp.runtime.process import multihost as mh

STEP_STATICS = (0, 1, 2, 3, 4)      # graphdef, EngineConfig, drafter, StepBucket, attention impl
STEP_DONATED = (6, 7, 8)            # state, cache, mtp_cache


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
        key = (runner.graphdef, runner.shard_config, runner.drafter, runner.attention, dev)
        self.step = jax.jit(engine_function(engine_step, key), static_argnums=STEP_STATICS,
                            donate_argnums=STEP_DONATED)
        self.insert_fn = jax.jit(engine_function(insert_request, key), donate_argnums=0)
        self.release_fn = jax.jit(_with_free(functools.partial(release_slot, ec)),
                                  donate_argnums=0)
        self.retire_fn = jax.jit(_with_free(functools.partial(retire_slot, ec)),
                                 donate_argnums=0)
        self.push_free_fn = jax.jit(_with_free(push_free_blocks), donate_argnums=0)
        self.import_fn = jax.jit(functools.partial(import_slot, ec), donate_argnums=(0, 1, 2))
        self.slot_state_fn = jax.jit(set_slot_state_of, donate_argnums=0)

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
        return jax.device_get(gather_slot(state, cache, mtp_cache, jnp.int32(b), jnp.asarray(ids)))

    def import_(self, state, cache, mtp_cache, b, row, kv, n):
        state, cache, mtp_cache, ok = self.import_fn(state, cache, mtp_cache, jnp.int32(b), row,
                                                     kv, jnp.int32(n))
        return state, cache, mtp_cache, bool(ok), self.free_list(state.free_count)


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
        self.step = jax.jit(functools.partial(dpar.data_parallel_step, mesh,
                                              param_specs=shd.data_specs(pshard)),
                            static_argnums=STEP_STATICS, donate_argnums=STEP_DONATED,
                            out_shardings=(st, tkv, mkv, rep))
        self.insert_fn = jax.jit(functools.partial(dpar.data_parallel_insert, mesh),
                                 donate_argnums=0, out_shardings=st)
        self.release_fn = jax.jit(functools.partial(dpar.data_parallel_release, mesh, sec),
                                  donate_argnums=0, out_shardings=(st, rep))
        self.retire_fn = jax.jit(functools.partial(dpar.data_parallel_retire, mesh, sec),
                                 donate_argnums=0, out_shardings=(st, rep, rep))
        self.push_free_fn = jax.jit(functools.partial(dpar.data_parallel_push_free, mesh),
                                    donate_argnums=0, out_shardings=(st, rep))
        self.import_fn = jax.jit(functools.partial(dpar.data_parallel_import, mesh, sec),
                                 donate_argnums=(0, 1, 2), out_shardings=(st, tkv, mkv, rep, rep))
        self.gather_fn = jax.jit(dpar.shard_gather, out_shardings=rep)
        self.slot_state_fn = jax.jit(functools.partial(dpar.data_parallel_set_slot_state, mesh),
                                     donate_argnums=0, out_shardings=tkv)
        self.owned_fn = jax.jit(lambda s, d, r: (s.num_owned[d, r], s.block_tables[d, r]),
                                out_shardings=rep)
        if jax.process_count() > 1:
            # the first run of each step bucket (and of each slot operation) waits until every
            # process has compiled it (jmtp.runtime.process.multihost.SyncFirstCall)
            self.step = mh.SyncFirstCall(self.step, key=lambda a: a[3], name="step")
            keys = {"import": lambda a: tuple(v.shape for v in a[6].values()),   # page bucket
                    "gather": lambda a: a[5].shape}
            for name in ("insert", "release", "retire", "push_free", "import", "gather", "owned",
                         "slot_state"):
                attr = f"{name}_fn"
                setattr(self, attr, mh.SyncFirstCall(getattr(self, attr), key=keys.get(name),
                                                     name=name))

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



__all__ = ["OneDevice", "OnMesh", "abstract_on", "STEP_STATICS", "STEP_DONATED"]
