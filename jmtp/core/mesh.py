"""Mesh vocabulary: mesh and logical axis names, the logical → mesh table, and the helpers that
read the mesh a step is traced under.

The mesh has two axes, :data:`DATA` (request slots, data parallel) and :data:`MODEL` (tensor
parallel). Model code names only *logical* axes (the names below, carried by every ``nnx.Param``
as its ``out_sharding`` metadata; :mod:`jmtp.model.axes` lists each parameter's);
:data:`LOGICAL_TO_MESH` is the one table that maps them to mesh axes. Placement of parameters,
caches and state on a mesh is :mod:`jmtp.runtime.device.sharding`'s job; this module only names things
and reads the current mesh, so kernels and model code can use it without importing the engine.
"""
from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

# ---------------------------------------------------------------- mesh axes
DATA = "data"
MODEL = "model"
MESH_AXES = (DATA, MODEL)

# ---------------------------------------------------------------- logical axes
LAYERS = "layers"
EMBED = "embed"
EMBED2 = "embed2"
VOCAB = "vocab"
Q_HEADS = "q_heads"
KV_HEADS = "kv_heads"
HEAD_DIM = "head_dim"
MLP = "mlp"
EXPERTS = "experts"
EXPERT_MLP = "expert_mlp"
# KV cache only (not parameters)
BLOCKS = "kv_blocks"
BLOCK_SIZE = "kv_block_size"
#: Every logical axis of a parameter or KV cache.
ALL = (LAYERS, EMBED, EMBED2, VOCAB, Q_HEADS, KV_HEADS, HEAD_DIM, MLP, EXPERTS, EXPERT_MLP,
       BLOCKS, BLOCK_SIZE)
# Logical axis of the engine state's per-slot arrays (not a parameter axis).
SLOTS = "slots"
# Leading axis of the stacked (per data shard) engine state and KV caches.
DATA_SHARD = "data_shard"

# The one table: logical axis name -> mesh axis (None = replicated; a tuple = those axes
# together, the first major).
LOGICAL_TO_MESH: dict[str, str | tuple[str, ...] | None] = {
    Q_HEADS: MODEL, KV_HEADS: MODEL, MLP: MODEL, VOCAB: MODEL,
    LAYERS: None, EMBED: None, EMBED2: None, HEAD_DIM: None,
    BLOCKS: None, BLOCK_SIZE: None, EXPERTS: None, EXPERT_MLP: MODEL,
    SLOTS: DATA, DATA_SHARD: DATA,
}
#: Its rows under expert parallelism (``LLM(enable_expert_parallel=True)``,
#: :mod:`jmtp.model.expert_parallel`): the routed experts split over every device of the mesh,
#: data-major (data shard ``d`` owns a contiguous block of ``E / DP`` experts, split further over
#: ``model``), each expert whole (its width ``expert_mlp`` no longer split). Attention, the dense
#: MLP, the shared experts and the vocabulary keep the rows above (the router is unnamed:
#: replicated).
EXPERT_PARALLEL_RULES: dict[str, str | tuple[str, ...] | None] = {
    EXPERTS: (DATA, MODEL), EXPERT_MLP: None,
}


def mesh_rules(expert_parallel: bool = False) -> dict[str, str | tuple[str, ...] | None]:
    """The logical -> mesh table in force: :data:`LOGICAL_TO_MESH`, with
    :data:`EXPERT_PARALLEL_RULES` over it when ``expert_parallel``."""
    return {**LOGICAL_TO_MESH, **EXPERT_PARALLEL_RULES} if expert_parallel else LOGICAL_TO_MESH


def attention_specs(cache_ndim: int = 4, shared_kv: bool = False) -> tuple[P, P, P]:
    """``(query/output spec f[T, Nq, D], cache spec, scale spec f32[num_blocks, Nkv,
    block_size])`` of ragged paged attention under ``shard_map``: heads over ``model``. The cache
    spec is for a split ``f[num_blocks, block_size, Nkv, D]`` cache (``cache_ndim=4``) or a merged
    ``f[num_blocks, block_size, Nkv·D]`` one (3: kv heads are major in the last axis, so each
    device's slice holds whole heads). ``shared_kv``: one kv head shared by every query head
    (MQA, and MLA's latent cache): the query heads split, the cache and scales replicated."""
    heads = LOGICAL_TO_MESH[KV_HEADS]
    if shared_kv:
        return P(None, heads, None), P(), P()
    cache = P(None, None, heads, None) if cache_ndim == 4 else P(None, None, heads)
    return P(None, heads, None), cache, P(None, heads, None)


@contextlib.contextmanager
def mesh_context(mesh: Mesh | None):
    """``jax.set_mesh(mesh)`` while tracing / running the engine step (no-op for None)."""
    if mesh is None:
        yield
        return
    with jax.set_mesh(mesh):
        yield


def auto_axes() -> set[str]:
    """The axes of the mesh set by :func:`mesh_context` that are not manual yet (inside the data
    parallel ``shard_map``, ``data`` is manual): what a nested ``shard_map`` makes manual. (All
    axes manual: the Pallas kernels' interpret mode runs host callbacks, which a partly automatic
    ``shard_map`` does not support.)"""
    mesh = jax.sharding.get_abstract_mesh()
    return {n for n, t in zip(mesh.axis_names, mesh.axis_types)
            if t != jax.sharding.AxisType.Manual}


def uniform_any(x: jax.Array) -> jax.Array:
    """``jnp.any(x)`` (bool[]), the same on every data shard: the predicate of a run-time
    ``lax.cond`` in the engine step. Inside the data-parallel ``shard_map`` each shard sees only
    its own slots; a branch taken by some shards and not others would run the collectives GSPMD
    puts inside it (tensor parallelism) on some devices only, a deadlock. So there the shards'
    predicates are OR-ed (``psum`` over ``data``); anywhere else this is ``jnp.any``."""
    p = jnp.any(x)
    mesh = jax.sharding.get_abstract_mesh()
    if (not mesh.empty and DATA in mesh.axis_names and mesh.shape[DATA] > 1
            and DATA not in auto_axes()):
        p = jax.lax.psum(p.astype(jnp.int32), DATA) > 0
    return p


def model_axis_size() -> int:
    """Size of the ``model`` axis of the mesh set by :func:`mesh_context` (1 without one)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or MODEL not in mesh.axis_names:
        return 1
    return int(mesh.shape[MODEL])


def manual_replicated(fn, num_outputs: int):
    """``fn`` made safe for a Pallas kernel on a mesh: under a ``shard_map`` that makes every
    still-automatic axis of the current mesh (:func:`auto_axes`) manual, every input and each of
    its ``num_outputs`` outputs replicated over them (each device runs the kernel on the whole
    arrays). Mosaic kernels cannot be partitioned automatically, and interpret mode's host
    callbacks need manual axes too. Without a mesh, or with every axis manual already, ``fn``
    itself is returned."""
    axes = auto_axes()
    if not axes:
        return fn
    rep = P()

    def run(*args):
        return jax.shard_map(fn, in_specs=(rep,) * len(args), out_specs=(rep,) * num_outputs,
                             axis_names=axes, check_vma=False)(*args)
    return run
