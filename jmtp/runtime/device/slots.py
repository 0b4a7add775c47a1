"""Slot operations on the engine state's KV blocks: the end-of-step release of finished slots and
the host's slot calls (preemption, retiring a slot for prefix caching, giving pinned blocks back).
The release is FastDeploy's release half of ``speculate_step_paddle``; ownership follows the
on-device allocator's contract (:mod:`jmtp.pallas.block_allocator`, the implementation
``EngineConfig.block_allocator``).

With prefix caching (:mod:`jmtp.runtime.host.prefix_cache`) the step leaves the final release to the
host: :func:`retire_slot` keeps the full blocks the host caches (pinned: neither free nor owned)
and :func:`push_free_blocks` returns the ones it evicts.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jmtp.runtime.config import EngineConfig
from jmtp.runtime.device.state import EngineState


def release_finished(ec: EngineConfig, state: EngineState, finished: jax.Array) -> EngineState:
    """Return the KV blocks of the slots in ``finished bool[B]`` to the free stack, with the
    allocator ``ec.block_allocator``."""
    B = finished.shape[0]
    blocks, _ = state.blocks.allocate(finished, jnp.zeros((B,), jnp.int32),
                                      implementation=ec.block_allocator,
                                      platform=ec.platform)
    return dataclasses.replace(state, blocks=blocks)


def release_slot(ec: EngineConfig, state: EngineState, slot: jax.Array) -> EngineState:
    """Preempt ``slot`` (i32[]): return its KV blocks (allocator ``ec.block_allocator``) and mark
    it idle (the host re-queues the request). With prefix caching its shared prefix pages are
    dropped from the slot too (the host drops its references)."""
    B = state.stop_flags.shape[0]
    state = release_finished(ec, state, jnp.arange(B) == slot)
    state = _clear_shared(state, slot)
    return dataclasses.replace(state, stop_flags=state.stop_flags.at[slot].set(True))


def _clear_shared(state: EngineState, slot: jax.Array) -> EngineState:
    if state.num_shared is None:
        return state
    return dataclasses.replace(state, num_shared=state.num_shared.at[slot].set(0),
                               shared_tables=state.shared_tables.at[slot].set(-1))


def retire_slot(ec: EngineConfig, state: EngineState, slot: jax.Array, keep: jax.Array
                ) -> tuple[EngineState, jax.Array]:
    """Empty ``slot`` (i32[]) for prefix caching: its owned blocks ``j`` with ``keep[j]``
    (``bool[P]``, indices into the slot's owned blocks ``block_tables[slot, :num_owned]``) leave
    the allocator, pinned for the host's prefix cache; the others go back to the free stack
    (allocator ``ec.block_allocator``, the same release as :func:`release_slot`). The slot's
    shared prefix pages are dropped and it is marked idle.

    Returns:
      ``(state, kept i32[P])``: the kept block ids in table order, -1 padded (entries of ``keep``
      at or past ``num_owned`` are ignored).

    Afterwards ``free_count + sum(num_owned) + (pinned blocks) == num_blocks``; pinned blocks come
    back with :func:`push_free_blocks`.
    """
    tables, owned = state.blocks.block_tables, state.blocks.num_owned
    P = tables.shape[1]
    row = tables[slot]
    j = jnp.arange(P, dtype=jnp.int32)
    # 0: owned, released; 1: owned, kept; 2: not owned. Stable sorts keep table order.
    key = jnp.where(j < owned[slot], keep.astype(jnp.int32), 2)
    release_row = row[jnp.argsort(key, stable=True)]
    n_release = jnp.sum(key == 0).astype(jnp.int32)
    n_kept = jnp.sum(key == 1)
    kept = jnp.where(j < n_kept, row[jnp.argsort(key != 1, stable=True)], -1)
    blocks = dataclasses.replace(
        state.blocks, block_tables=tables.at[slot].set(jnp.where(j < n_release, release_row, -1)),
        num_owned=owned.at[slot].set(n_release))
    state = release_slot(ec, dataclasses.replace(state, blocks=blocks), slot)
    return state, kept.astype(jnp.int32)


def push_free_blocks(state: EngineState, ids: jax.Array) -> EngineState:
    """Give pinned blocks back to the allocator: push the ids ``>= 0`` of ``ids i32[n]`` (in
    order) onto the free stack. For blocks the host's prefix cache evicts; the caller
    guarantees they are neither free nor owned (the allocator's invariants then hold again)."""
    fs, fc = state.blocks.free_stack, state.blocks.free_count
    valid = ids >= 0
    dst = jnp.where(valid, fc + jnp.cumsum(valid) - 1, fs.shape[0])
    fs = fs.at[dst].set(ids, mode="drop")
    blocks = dataclasses.replace(state.blocks, free_stack=fs,
                                 free_count=(fc + jnp.sum(valid)).astype(jnp.int32))
    return dataclasses.replace(state, blocks=blocks)


def set_slot_state_of(cache, slot: jax.Array, load_entry: jax.Array, capture_entry: jax.Array):
    """:func:`jmtp.model.state_checkpoints.set_slot_state` on the target cache's state pool (a
    hybrid model with prefix caching): the slot continues from state checkpoint ``load_entry``
    (i32[], -1: none) and captures into ``capture_entry`` (i32[], -1: none)."""
    from jmtp.model.state_checkpoints import set_slot_state
    return cache._replace(linear=set_slot_state(cache.linear, slot, load_entry, capture_entry))
