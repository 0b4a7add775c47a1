"""Recurrent-state checkpoints of a hybrid model at KV-block boundaries: what exact prefix caching
needs beside the cached KV blocks (:mod:`jmtp.runtime.host.prefix_states` holds the host side).

A cached prefix of ``n`` full KV blocks is reusable by a hybrid (gated-DeltaNet) target only
with the convolution and delta-rule state of every linear layer *after token ``n·bs - 1``*: the
linear layers have no KV cache to read the prefix from. The state pool
(:class:`~jmtp.model.gated_deltanet.LinearState`) holds each slot's state at its last ``W = K+1``
rows only, so the state at a block boundary has to be copied out when a step passes it. This
module holds those copies on the device:

* :class:`StateCheckpoints` (``LinearState.saved``): ``S`` entries of every linear layer's
  convolution and delta-rule state, and per slot the entry it *captures* into (``entry``, -1 =
  none). The host (:class:`jmtp.runtime.host.prefix_states.StateCache`) decides which entry holds
  which boundary; entries are allocated once with the engine.
* :func:`capture_boundary_states` (in the jitted step, after verification): each slot whose
  committed rows of this step crossed a block boundary copies its state *at the last boundary
  crossed* from the row checkpoint that holds it into its entry. The state after row ``i`` of a
  slot with ``q`` rows sits in checkpoint ``W - q + i`` for a verify window or a short chunk
  (``q <= W``); a longer prefill chunk keeps only its final state (checkpoint ``W - 1``), so it
  captures a boundary only when it ends on one (the scheduler ends a chunk on the boundary it
  must capture). Only committed rows count (a verify window's first ``n`` rows), and a slot
  that finishes in the step captures nothing (its last step runs no MTP, so the KV blocks the
  host caches end at or before the boundary captured one step earlier). The copies run in a
  loop over the capturing slots only (usually none): a step costs one state copy per slot that
  crossed a boundary, not per slot.
* :func:`set_slot_state` (host call at admission): a request whose cached prefix has a state
  loads it into checkpoint ``W - 1`` of its slot and continues from it; the slot gets its
  capture entry.
* :func:`slot_state` / :func:`put_slot_state`: the slot's state at its current checkpoint, for
  the prefill → decode hand-off (:mod:`jmtp.runtime.host.handoff`).

Which boundaries are kept is the host's policy (:mod:`jmtp.runtime.host.prefix_states`): the last
boundary a request passed before its final step (a conversation's next turn continues there)
and, for a request whose KV match reaches past every cached state, the end of that match (the
branch point of a shared prefix).
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jmtp.model.config import ModelConfig


class StateCheckpoints(NamedTuple):
    """Block-boundary state checkpoints of a hybrid model's linear layers (one data shard).

    Attributes:
      conv: ``f[Ll, S, Kc-1, conv_dim]`` the convolution state of each entry.
      recurrent: ``f32[Ll, S, Hv, Dk, Dv]`` the delta-rule state of each entry.
      entry: ``i32[B]`` the entry each slot captures its block-boundary states into (-1: none).
    """

    conv: jax.Array
    recurrent: jax.Array
    entry: jax.Array


def init_state_checkpoints(cfg: ModelConfig, num_slots: int, num_entries: int,
                           dtype=jnp.float32) -> StateCheckpoints:
    """``num_entries`` zero entries (convolution state in ``dtype``, delta-rule state fp32), no
    slot capturing."""
    lc, n = cfg.linear, len(cfg.linear_layers)
    return StateCheckpoints(
        conv=jnp.zeros((n, num_entries, lc.conv_kernel_dim - 1, lc.conv_dim), dtype),
        recurrent=jnp.zeros((n, num_entries, lc.num_value_heads, lc.key_head_dim,
                             lc.value_head_dim), jnp.float32),
        entry=jnp.full((num_slots,), -1, jnp.int32))


def boundary_captured(p0, q, valid_rows, prefilling, finished, block_size: int, window: int):
    """Where each slot's block-boundary state can be captured after a step (works on numpy and
    jax arrays, so the host runs the same rule as the device).

    Args:
      p0: ``i32[B]`` the slot's first position this step (``seq_lens_decoder`` before it).
      q: ``i32[B]`` rows the slot ran (0: idle or paused).
      valid_rows: ``i32[B]`` rows whose inputs are the sequence's own tokens: the chunk for a
        prefill, the committed tokens ``n`` for a verify window (its last accepted token and
        ``n - 1`` accepted drafts).
      prefilling: ``bool[B]``; finished: ``bool[B]`` the slot finished in the step.

    Returns:
      ``(boundary i32[B], ckpt i32[B], ok bool[B])``: the last block boundary ``b`` with
      ``p0 < b <= p0 + valid_rows`` (the state after position ``b - 1``), the row checkpoint that
      holds it, and whether it is captured (a boundary was crossed, the state is in a checkpoint,
      the slot did not finish).
    """
    np_ = jnp if isinstance(p0, jax.Array) else np
    boundary = (p0 + valid_rows) // block_size * block_size
    row = boundary - 1 - p0
    long = prefilling & (q > window)
    ckpt = np_.where(long, window - 1, np_.clip(window - q + row, 0, window - 1))
    ok = ((q > 0) & (valid_rows > 0) & ~finished & (boundary > p0)
          & (~long | (boundary == p0 + q)))
    return boundary, ckpt, ok


def capture_boundary_states(lin, p0, q, valid_rows, prefilling, finished, block_size: int):
    """Copy each slot's state at the last block boundary its committed rows crossed into its
    entry (:func:`boundary_captured`; module docstring). ``lin``: the
    :class:`~jmtp.model.gated_deltanet.LinearState` after the step's forward (its ``saved`` not
    None). Returns ``lin`` with ``saved`` updated."""
    saved = lin.saved
    window = lin.recurrent.shape[2]
    _, ckpt, ok = boundary_captured(p0, q, valid_rows, prefilling, finished, block_size, window)
    ok = ok & (saved.entry >= 0)
    b_slots = ok.shape[0]
    slots = jnp.nonzero(ok, size=b_slots, fill_value=0)[0]
    ll = lin.conv.shape[0]

    def copy(i, arrays):
        conv, rec = arrays
        b = slots[i]
        e, c = saved.entry[b], ckpt[b]
        cs = jax.lax.dynamic_slice(lin.conv, (0, b, c, 0, 0), (ll, 1, 1) + lin.conv.shape[3:])
        rs = jax.lax.dynamic_slice(lin.recurrent, (0, b, c, 0, 0, 0),
                                   (ll, 1, 1) + lin.recurrent.shape[3:])
        conv = jax.lax.dynamic_update_slice(conv, cs[:, 0].astype(conv.dtype), (0, e, 0, 0))
        rec = jax.lax.dynamic_update_slice(rec, rs[:, 0], (0, e, 0, 0, 0))
        return conv, rec

    conv, rec = jax.lax.fori_loop(0, jnp.sum(ok).astype(jnp.int32), copy,
                                  (saved.conv, saved.recurrent))
    return lin._replace(saved=saved._replace(conv=conv, recurrent=rec))


def set_slot_state(lin, slot, load_entry, capture_entry):
    """At admission: with ``load_entry >= 0`` (i32[]) the slot continues from that entry's state
    (copied into its checkpoint ``W - 1``, ``current = W - 1``); the slot captures into
    ``capture_entry`` (i32[], -1: none) from now on. Returns the updated ``LinearState``."""
    saved = lin.saved
    w = lin.recurrent.shape[2]
    ll = lin.conv.shape[0]
    e = jnp.maximum(load_entry, 0)
    load = load_entry >= 0
    cs = jax.lax.dynamic_slice(saved.conv, (0, e, 0, 0), (ll, 1) + saved.conv.shape[2:])
    rs = jax.lax.dynamic_slice(saved.recurrent, (0, e, 0, 0, 0),
                               (ll, 1) + saved.recurrent.shape[2:])
    old_c = jax.lax.dynamic_slice(lin.conv, (0, slot, w - 1, 0, 0), (ll, 1, 1) + lin.conv.shape[3:])
    old_r = jax.lax.dynamic_slice(lin.recurrent, (0, slot, w - 1, 0, 0, 0),
                                  (ll, 1, 1) + lin.recurrent.shape[3:])
    conv = jax.lax.dynamic_update_slice(
        lin.conv, jnp.where(load, cs[:, :, None].astype(lin.conv.dtype), old_c), (0, slot, w - 1, 0, 0))
    rec = jax.lax.dynamic_update_slice(
        lin.recurrent, jnp.where(load, rs[:, :, None], old_r), (0, slot, w - 1, 0, 0, 0))
    current = lin.current.at[slot].set(jnp.where(load, w - 1, lin.current[slot]))
    return lin._replace(conv=conv, recurrent=rec, current=current,
                        saved=saved._replace(entry=saved.entry.at[slot].set(capture_entry)))


def slot_state(lin, slot) -> dict:
    """The slot's state at its current checkpoint (the hand-off's export):
    ``{"linear_conv": f[Ll, Kc-1, C], "linear_recurrent": f32[Ll, Hv, Dk, Dv],
    "linear_current": i32[]}``."""
    c = lin.current[slot]
    return {"linear_conv": lin.conv[:, slot, c], "linear_recurrent": lin.recurrent[:, slot, c],
            "linear_current": c}


def put_slot_state(lin, slot, state: dict, ok):
    """Write an exported :func:`slot_state` into ``slot`` (at the same checkpoint index) when
    ``ok`` (bool[]); else ``lin`` unchanged."""
    c = jnp.clip(state["linear_current"].astype(jnp.int32), 0, lin.recurrent.shape[2] - 1)
    conv_row = jnp.where(ok, state["linear_conv"].astype(lin.conv.dtype), lin.conv[:, slot, c])
    rec_row = jnp.where(ok, state["linear_recurrent"].astype(jnp.float32),
                        lin.recurrent[:, slot, c])
    return lin._replace(conv=lin.conv.at[:, slot, c].set(conv_row),
                        recurrent=lin.recurrent.at[:, slot, c].set(rec_row),
                        current=lin.current.at[slot].set(jnp.where(ok, c, lin.current[slot])))


__all__ = ["StateCheckpoints", "init_state_checkpoints", "boundary_captured",
           "capture_boundary_states", "set_slot_state", "slot_state", "put_slot_state"]
