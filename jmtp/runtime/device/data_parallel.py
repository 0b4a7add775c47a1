"""Data parallelism over request slots: each data shard is a small engine of its own.

With ``data_parallel_size = D`` the engine's ``max_num_seqs = B`` slots, ``num_blocks = N`` KV
blocks and per-step token budget are split into D shards of ``B/D`` slots, ``N/D`` blocks and
``max_num_batched_tokens/D`` tokens (:func:`shard_config`). Every
array of the engine state and of both KV caches is held *stacked*: a leading axis of size D (the
logical axis :data:`jmtp.runtime.device.sharding.DATA_SHARD`, mapped to the mesh's ``data`` axis) in
front of the single-shard layout, so shard ``d`` lives on the devices of data row ``d`` only:

=======================  ==============================================================
state field              stacked shape (``Bl = B/D``, ``Nl = N/D``)
=======================  ==============================================================
per-slot arrays          ``[D, Bl, ...]`` (global slot ``b`` is shard ``b // Bl``, row ``b % Bl``)
``blocks.free_stack``    ``[D, Nl]``: shard-local block ids ``0..Nl-1``
``blocks.free_count``    ``[D]``
KV caches                ``f[D, L, Nl, block_size, Nkv, head_dim]``
=======================  ==============================================================

The engine step, the request insert and the slot release run under one ``jax.shard_map`` that
is manual over ``data`` only (``axis_names={"data"}``): inside it each shard runs the ordinary
single-shard functions (:func:`jmtp.runtime.device.step.engine_step`,
:func:`jmtp.runtime.device.state.insert_request`, :func:`jmtp.runtime.device.step.release_slot`) on its own
slots, blocks and caches with ``EngineConfig`` :func:`shard_config`, while the ``model`` axis stays
automatic (GSPMD tensor parallelism, attention under its own ``shard_map`` over kv heads). The
parameters enter replicated over ``data``, except the routed experts under expert parallelism:
each shard sees its ``E/D`` experts. Otherwise no array crosses data shards, except the MoE
layers' token rows under expert parallelism (:mod:`jmtp.model.expert_parallel`; a run-time
branch around a model forward must then be taken alike by every shard:
:func:`jmtp.core.mesh.uniform_any`) and the small per-step results the host reads
(:class:`~jmtp.runtime.device.step.StepOutput`, gathered to every device so every process of a
multi-process run can read them). A request never spans shards: its slot, block table and blocks
belong to one shard, and its per-slot sampling parameters, seeds and random stream move with its
row, so a padding row can never lend a real row its temperature.

Every shard runs the same static ``(T, A)`` bucket in a step (one graph): the host picks it for
the busiest shard (:meth:`jmtp.runtime.host.llm_engine.LLMEngine.step`).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from jmtp.runtime.config import EngineConfig
from jmtp.runtime.device.handoff_ops import gather_slot, import_slot
from jmtp.runtime.device.sharding import DATA
from jmtp.runtime.device.spec import Caches, StepInputs, StepSpec
from jmtp.runtime.device.state import insert_request
from jmtp.runtime.device.step import (engine_step, push_free_blocks, release_slot, retire_slot,
                                      set_slot_state_of)


def shard_config(ec: EngineConfig, data_parallel_size: int) -> EngineConfig:
    """The :class:`EngineConfig` of one data shard: ``max_num_seqs``, ``num_blocks`` and the
    per-step token budget ``max_num_batched_tokens`` (and a hybrid model's prefix-caching state
    checkpoints ``num_state_checkpoints``) divided by D; everything else (K, block
    size, max_model_len, allocator) unchanged. (The engine's sizes are totals over the shards, as
    the ``slots`` axis is one axis sharded over ``data``.)

    Raises:
      ValueError: ``data_parallel_size`` < 1, or it does not divide ``max_num_seqs``,
        ``num_blocks`` or ``max_num_batched_tokens`` (the names and values are in the message), or
        a shard would get fewer blocks than one ``max_model_len`` sequence needs.
    """
    d = int(data_parallel_size)
    if d < 1:
        raise ValueError(f"data_parallel_size must be >= 1, got {data_parallel_size}")
    if d == 1:
        return ec
    for name in ("max_num_seqs", "num_blocks", "max_num_batched_tokens", "num_state_checkpoints"):
        v = getattr(ec, name)
        if v % d:
            raise ValueError(f"data_parallel_size={d} must divide {name}={v} (each data shard "
                             f"owns {name}/data_parallel_size of them)")
    local = dataclasses.replace(ec, max_num_seqs=ec.max_num_seqs // d,
                                num_blocks=ec.num_blocks // d,
                                max_num_batched_tokens=ec.max_num_batched_tokens // d,
                                num_state_checkpoints=ec.num_state_checkpoints // d)
    if local.num_blocks < local.pages_per_seq:
        raise ValueError(
            f"num_blocks={ec.num_blocks} over data_parallel_size={d} leaves {local.num_blocks} "
            f"blocks per shard, fewer than one max_model_len={ec.max_model_len} sequence needs "
            f"({local.pages_per_seq}); raise num_blocks or lower data_parallel_size")
    return local


def stack_shards(tree, data_parallel_size: int):
    """``tree`` (single-shard arrays) repeated along a new leading axis of size D."""
    return jax.tree_util.tree_map(
        lambda x: jnp.broadcast_to(x[None], (data_parallel_size,) + x.shape), tree)


def _squeeze(tree):
    return jax.tree_util.tree_map(lambda x: x[0], tree)


def _expand(tree):
    return jax.tree_util.tree_map(lambda x: x[None], tree)


def _on_shard(mesh: Mesh, body, in_specs, out_specs):
    """``shard_map`` manual over ``data`` only (``model`` stays automatic)."""
    return jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                         axis_names={DATA}, check_vma=False)


def data_parallel_step(mesh: Mesh, spec: StepSpec, model_state, state, caches: Caches,
                       inputs: StepInputs, *, param_specs=None):
    """:func:`~jmtp.runtime.device.step.engine_step` on every data shard at once.

    Args:
      mesh: the engine's mesh (bound before jitting).
      spec: as for ``engine_step``, static; ``spec.engine`` is the *shard's* config
        (:func:`shard_config`).
      model_state: as for ``engine_step``, replicated over ``data``, except under expert
        parallelism the routed experts, split over ``data`` too.
      state, caches: stacked (module docstring).
      inputs: :class:`~jmtp.runtime.device.spec.StepInputs` stacked per shard: ``prefill_chunk``,
        ``draft_limit`` i32[D, B/D]; ``token_bitmask`` i32[D, B/D, K+1, NW]; ``draft_override``
        i32[D, B/D, K].
      param_specs: the ``data`` part of each leaf of ``model_state``'s placement, in leaf order
        (:func:`jmtp.runtime.device.sharding.data_specs`); None: every parameter replicated over
        ``data``.

    Returns:
      ``(state, caches, StepOutput)``, all stacked: ``StepOutput`` fields are ``[D, B/D, ...]``
      and ``free_count`` is ``i32[D]``.
    """
    leaves, treedef = jax.tree_util.tree_flatten(model_state)
    specs = tuple(param_specs) if param_specs is not None else (P(),) * len(leaves)
    if len(specs) != len(leaves):
        raise ValueError(f"param_specs has {len(specs)} entries for {len(leaves)} parameters")

    def body(leaves, state, caches, inputs):
        state, caches, out = engine_step(
            spec, jax.tree_util.tree_unflatten(treedef, leaves), _squeeze(state),
            _squeeze(caches), _squeeze(inputs))
        # prompt logprobs are per packed row of a shard: not served on a mesh (refused at intake)
        out = dataclasses.replace(out, prompt_logprobs=None, prompt_top_ids=None,
                                  prompt_top_logprobs=None, prompt_row_start=None)
        return _expand((state, caches, out))

    d = P(DATA)
    return _on_shard(mesh, body, (list(specs), d, d, d), d)(list(leaves), state, caches, inputs)


def data_parallel_insert(mesh: Mesh, state, shard, slot, prompt, prompt_len, max_dec_len,
                         sampling_row, resume_token, *shared):
    """:func:`~jmtp.runtime.device.state.insert_request` into row ``slot`` (i32[]) of data shard
    ``shard`` (i32[]); the other shards keep their state unchanged. Other arguments as for
    ``insert_request`` (replicated; ``shared``: the prefix-caching arguments, shard-local block
    ids)."""
    def body(state, shard, slot, prompt, prompt_len, max_dec_len, sampling_row, resume_token,
             *shared):
        local = _squeeze(state)
        new = insert_request(local, slot, prompt, prompt_len, max_dec_len, sampling_row,
                             resume_token, *shared)
        mine = jax.lax.axis_index(DATA) == shard
        return _expand(jax.tree_util.tree_map(lambda n, o: jnp.where(mine, n, o), new, local))

    r = P()
    return _on_shard(mesh, body, (P(DATA),) + (r,) * (7 + len(shared)), P(DATA))(
        state, shard, slot, prompt, prompt_len, max_dec_len, sampling_row, resume_token, *shared)


def data_parallel_release(mesh: Mesh, ec: EngineConfig, state, shard, slot):
    """:func:`~jmtp.runtime.device.step.release_slot` of row ``slot`` of data shard ``shard`` (preemption
    or a stop string found on the host). Returns ``(state, free_count i32[D])``."""
    def body(state, shard, slot):
        local = _squeeze(state)
        new = release_slot(ec, local, slot)
        mine = jax.lax.axis_index(DATA) == shard
        new = jax.tree_util.tree_map(lambda n, o: jnp.where(mine, n, o), new, local)
        return _expand(new), new.free_count[None]

    return _on_shard(mesh, body, (P(DATA), P(), P()), (P(DATA), P(DATA)))(state, shard, slot)


def _on_one(shard, fn, operands):
    """``fn(*operands)`` on data shard ``shard`` only; the other shards return ``operands``
    unchanged (``fn`` must return a tuple whose first entries have the operands' structure)."""
    mine = jax.lax.axis_index(DATA) == shard
    return jax.lax.cond(mine, lambda ops: fn(*ops), lambda ops: ops, operands)


def data_parallel_retire(mesh: Mesh, ec: EngineConfig, state, shard, slot, keep):
    """:func:`~jmtp.runtime.device.step.retire_slot` of row ``slot`` of data shard ``shard`` (prefix
    caching). Returns ``(state, kept i32[D, P], free_count i32[D])``; only row ``shard`` of
    ``kept`` is meaningful (-1 elsewhere)."""
    P_ = ec.pages_per_seq

    def body(state, shard, slot, keep):
        local = _squeeze(state)
        idle = lambda st, _: (st, jnp.full((P_,), -1, jnp.int32))
        new, kept = jax.lax.cond(jax.lax.axis_index(DATA) == shard,
                                 lambda st, k: retire_slot(ec, st, slot, k), idle, local, keep)
        return _expand(new), kept[None], new.free_count[None]

    return _on_shard(mesh, body, (P(DATA), P(), P(), P()), (P(DATA),) * 3)(
        state, shard, slot, keep)


def data_parallel_push_free(mesh: Mesh, state, shard, ids):
    """:func:`~jmtp.runtime.device.step.push_free_blocks` of shard-local ``ids`` on data shard
    ``shard``. Returns ``(state, free_count i32[D])``."""
    def body(state, shard, ids):
        local = _squeeze(state)
        new = jax.lax.cond(jax.lax.axis_index(DATA) == shard,
                           lambda st: push_free_blocks(st, ids), lambda st: st, local)
        return _expand(new), new.free_count[None]

    return _on_shard(mesh, body, (P(DATA), P(), P()), (P(DATA), P(DATA)))(state, shard, ids)


def data_parallel_import(mesh: Mesh, ec: EngineConfig, state, cache, mtp_cache, shard, slot,
                         row, kv, num_pages):
    """:func:`~jmtp.runtime.device.handoff_ops.import_slot` into row ``slot`` of data shard ``shard``
    (``ec``: the shard's config; ``row`` and ``kv`` replicated, full kv heads). Returns
    ``(state, cache, mtp_cache, ok bool[D], free_count i32[D])``; only ``ok[shard]`` is
    meaningful (True elsewhere)."""
    def body(state, cache, mtp_cache, shard, slot, row, kv, num_pages):
        ops = (_squeeze(state), _squeeze(cache), _squeeze(mtp_cache))

        def run(st, c, m):
            return import_slot(ec, st, c, m, slot, row, kv, num_pages)

        new, c, m, ok = jax.lax.cond(jax.lax.axis_index(DATA) == shard,
                                     lambda o: run(*o), lambda o: (*o, jnp.bool_(True)), ops)
        return _expand(new), _expand(c), _expand(m), ok[None], new.free_count[None]

    d = P(DATA)
    return _on_shard(mesh, body, (d, d, d, P(), P(), P(), P(), P()), (d,) * 5)(
        state, cache, mtp_cache, shard, slot, row, kv, num_pages)


def data_parallel_set_slot_state(mesh: Mesh, cache, shard, slot, load_entry, capture_entry):
    """:func:`~jmtp.runtime.device.slots.set_slot_state_of` on row ``slot`` of data shard ``shard``
    (entries shard-local); the other shards' caches unchanged."""
    def body(cache, shard, slot, load_entry, capture_entry):
        local = _squeeze(cache)
        # no cond over the cache (a conditional's result is a new buffer): the other shards
        # load nothing and keep their capture entry
        mine = jax.lax.axis_index(DATA) == shard
        keep = local.linear.saved.entry[slot]
        new = set_slot_state_of(local, slot, jnp.where(mine, load_entry, -1),
                                jnp.where(mine, capture_entry, keep))
        return _expand(new)

    r = P()
    return _on_shard(mesh, body, (P(DATA), r, r, r, r), P(DATA))(cache, shard, slot, load_entry,
                                                                 capture_entry)


def shard_gather(state, cache, mtp_cache, shard, slot, page_ids):
    """:func:`~jmtp.runtime.device.handoff_ops.gather_slot` of row ``slot`` of data shard ``shard`` of the
    stacked state and caches (jit it with replicated output shardings: the host reads it)."""
    pick = lambda t: jax.tree_util.tree_map(lambda x: x[shard], t)
    return gather_slot(pick(state), pick(cache), pick(mtp_cache), slot, page_ids)


__all__ = ["shard_config", "stack_shards", "data_parallel_step", "data_parallel_insert",
           "data_parallel_release", "data_parallel_retire", "data_parallel_push_free",
           "data_parallel_import", "data_parallel_set_slot_state", "shard_gather"]
