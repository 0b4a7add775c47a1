"""The device side of the prefill → decode hand-off (:mod:`jmtp.runtime.host.handoff` holds the
wire format): gathering one slot's state row and KV pages (:func:`gather_slot`) and importing them
into an idle slot of another engine (:func:`import_slot`), both jitted by the runner's placement.

The row's keys are :data:`ROW_FIELDS` (``sampling`` fields as ``"sampling.<name>"``); a hybrid
model's slot state travels as ``kv`` entries named :data:`LINEAR_PREFIX` ``+ name``.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jmtp.model.llama import KVCache
from jmtp.runtime.config import EngineConfig
from jmtp.runtime.device.state import EngineState

#: Prefix of the ``RequestState.kv`` entries that hold a hybrid model's slot state (not pages).
LINEAR_PREFIX = "linear_"

#: Per-slot fields of :class:`EngineState` carried in ``RequestState.row`` (``blocks`` is carried
#: as KV pages; ``draft_probs`` only when the engine samples drafts).
ROW_FIELDS = tuple(f.name for f in dataclasses.fields(EngineState) if f.name != "blocks")


def page_bucket(n: int, pages_per_seq: int) -> int:
    """Static page count of the gather / scatter for ``n`` pages: the next power of two, capped
    at ``pages_per_seq`` (so an engine compiles at most ``log2(P) + 1`` variants)."""
    b = 1
    while b < n:
        b *= 2
    return min(max(b, 1), pages_per_seq)


def _cache_arrays(cache: KVCache | None, prefix: str) -> dict:
    if cache is None:
        return {}
    out = {f"{prefix}_k": cache.k, f"{prefix}_v": cache.v}
    if cache.k_scale is not None:
        out.update({f"{prefix}_k_scale": cache.k_scale, f"{prefix}_v_scale": cache.v_scale})
    return out


def _row_arrays(state: EngineState) -> dict:
    """``{key: [B, ...] array}`` of every :data:`ROW_FIELDS` entry that is not None, sampling
    fields as ``"sampling.<name>"`` (the keys of ``RequestState.row``)."""
    out = {}
    for name in ROW_FIELDS:
        value = getattr(state, name)
        if name == "sampling":
            out.update({f"sampling.{f.name}": getattr(value, f.name)
                        for f in dataclasses.fields(value)})
        elif value is not None:
            out[name] = value
    return out


def row_keys(state: EngineState) -> set[str]:
    """The keys of ``RequestState.row`` for an engine with ``state`` (what :func:`gather_slot`
    writes and :func:`import_slot` reads)."""
    return set(_row_arrays(state))


def gather_slot(state: EngineState, cache: KVCache, mtp_cache: KVCache | None, slot: jax.Array,
                page_ids: jax.Array) -> tuple[dict, dict]:
    """The row of ``slot`` (i32[]) of every per-slot field of ``state`` and the KV pages
    ``page_ids`` (i32[Pb], block ids; padding entries may be any valid id) of both caches.

    Returns:
      ``(row, kv)``: ``row[field]`` = ``state.<field>[slot]`` (sampling fields as
      ``"sampling.<name>"``; ``draft_probs`` only if present), ``kv[name]`` =
      ``cache.<array>[:, page_ids]`` (``[L, Pb, ...]``), names as :attr:`RequestState.kv`.
    """
    row = {key: value[slot] for key, value in _row_arrays(state).items()}
    arrays = {**_cache_arrays(cache, "target"), **_cache_arrays(mtp_cache, "mtp")}
    kv = {k: jnp.take(a, page_ids, axis=1) for k, a in arrays.items()}
    if cache.linear is not None:     # a hybrid model's slot state (not pages)
        from jmtp.model.state_checkpoints import slot_state
        kv.update(slot_state(cache.linear, slot))
    return row, kv


def import_slot(ec: EngineConfig, state: EngineState, cache: KVCache,
                mtp_cache: KVCache | None, slot: jax.Array, row: dict, kv: dict,
                num_pages: jax.Array):
    """Put an exported request into the idle ``slot`` (i32[], owns no blocks): pop
    ``num_pages`` (i32[]) blocks for it from the free stack (the allocator ``ec.block_allocator``,
    all or nothing), scatter the first ``num_pages`` of the pages ``kv[name] [L, Pb, ...]`` into
    them in sequence order (both caches), and write ``row`` (every per-slot field; ``input_ids``
    padded to ``ec.seq_buffer_len``) into the slot; a hybrid model's slot state (``kv``'s
    ``linear_*`` entries) goes into its checkpoint ``linear_current``. Jit with ``ec`` static; the
    page bucket ``Pb`` is static through the shapes.

    Returns:
      ``(state, cache, mtp_cache, ok bool[])``; ``ok`` is False when the allocator could not give
      the slot its blocks (the host checks the free count first, so this means a bug); the state's
      row and the caches are then unchanged.
    """
    B = state.stop_flags.shape[0]
    N = state.blocks.free_stack.shape[0]
    need = jnp.where(jnp.arange(B) == slot, num_pages, 0).astype(jnp.int32)
    blocks, paused = state.blocks.allocate(jnp.zeros((B,), bool), need,
                                           implementation=ec.block_allocator,
                                           platform=ec.platform)
    ok = ~paused[slot]          # all or nothing: a failed import writes no page and no row
    ids = blocks.block_tables[slot]                                      # i32[P]
    pb = kv["target_k"].shape[1]
    j = jnp.arange(pb, dtype=jnp.int32)
    dst = jnp.where(ok & (j < num_pages), ids[jnp.minimum(j, ids.shape[0] - 1)], N)  # N: dropped

    def scatter(c: KVCache | None, prefix: str):
        if c is None:
            return None
        put = lambda a, name: a.at[:, dst].set(kv[f"{prefix}_{name}"].astype(a.dtype), mode="drop")
        return KVCache(put(c.k, "k"), put(c.v, "v"),
                       None if c.k_scale is None else put(c.k_scale, "k_scale"),
                       None if c.v_scale is None else put(c.v_scale, "v_scale"))

    fields = {}
    for name in ROW_FIELDS:
        value = getattr(state, name)
        if name == "sampling":
            fields[name] = dataclasses.replace(value, **{
                f.name: _set_row(getattr(value, f.name), slot, row[f"sampling.{f.name}"], ok)
                for f in dataclasses.fields(value)})
        elif value is not None:
            fields[name] = _set_row(value, slot, row[name], ok)
    state = dataclasses.replace(state, blocks=blocks, **fields)
    target = scatter(cache, "target")
    if cache.linear is not None:
        from jmtp.model.state_checkpoints import put_slot_state
        target = target._replace(linear=put_slot_state(
            cache.linear, slot, {k: v for k, v in kv.items() if k.startswith(LINEAR_PREFIX)}, ok))
    return state, target, scatter(mtp_cache, "mtp"), ok


def _set_row(value: jax.Array, slot, new, ok) -> jax.Array:
    """``value`` with row ``slot`` set to ``new`` when ``ok`` (else unchanged)."""
    return value.at[slot].set(jnp.where(ok, new.astype(value.dtype), value[slot]))
