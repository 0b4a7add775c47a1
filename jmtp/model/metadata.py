"""Attention metadata for one ragged batch: a pytree of device arrays (and one static hint)."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class AttentionMetadata:
    """Where each packed token lives and what it may attend to.

    Attributes:
      slot_mapping: i32[T]   cache slot of each token's K/V (``block_id * block_size + offset``);
                             -1 for padding rows.
      kv_lens: i32[S]        keys per sequence after this step's tokens are written.
      cu_q_lens: i32[S+1]    exclusive prefix sums of per-sequence query counts.
      block_tables: i32[S, P] physical block id of each logical block (-1 = absent).
      rows_per_seq: static hint (not an array): most sequences have at most this many query rows
                             (speculative verify windows), so attention may visit the rows
                             sequence by sequence (``ragged_paged_attention_xla``'s
                             ``rows_per_seq``); None = no hint. Any value is correct.
      linear_rule: static: the packed gated-delta-rule implementation of a hybrid model's
                             linear layers (:func:`jmtp.model.gated_deltanet.gated_delta_rule_packed`
                             or a Pallas kernel of the same contract); None = the jnp one.
      linear_chunk_rule: static: the chunked form of prefill chunks longer than the window
                             (:func:`jmtp.model.gated_deltanet.chunk_gated_delta_rule_varlen` or
                             a kernel of the same contract); None = the jnp one.
    """

    slot_mapping: jax.Array
    kv_lens: jax.Array
    cu_q_lens: jax.Array
    block_tables: jax.Array
    rows_per_seq: int | None = dataclasses.field(default=None, metadata=dict(static=True))
    linear_rule: object = dataclasses.field(default=None, metadata=dict(static=True))
    linear_chunk_rule: object = dataclasses.field(default=None, metadata=dict(static=True))


def packed_row_seq(cu_q_lens: jax.Array, num_tokens: int) -> tuple[jax.Array, jax.Array]:
    """The packed-row -> sequence lookup: ``(seq i32[T], local i32[T])`` for ``T = num_tokens``
    rows, with row ``t`` the ``local[t]``-th query of sequence ``seq[t]``
    (``cu_q_lens[seq] <= t < cu_q_lens[seq + 1]``). Padding rows map to the last sequence that
    starts at or before them (clipped to ``[0, S-1]``; callers mask them)."""
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = jnp.clip(jnp.searchsorted(cu_q_lens, t, side="right") - 1, 0, cu_q_lens.shape[0] - 2)
    return seq.astype(jnp.int32), t - cu_q_lens[seq]


def ragged_batch(
    q_lens: jax.Array,        # i32[S]   new tokens per sequence this step (0 = idle)
    context_lens: jax.Array,  # i32[S]   tokens already in the cache (position of the first new token)
    block_tables: jax.Array,  # i32[S, P]
    block_size: int,
    num_tokens: int,
    rows_per_seq: int | None = None,
) -> tuple[jax.Array, AttentionMetadata]:
    """Positions ``i32[T]`` and :class:`AttentionMetadata` for a packed batch of ``num_tokens`` rows.

    Sequence ``s`` owns rows ``cu[s]:cu[s]+q_lens[s]`` at positions ``context_lens[s] + j``.
    Padding rows get position 0 and slot -1. Requires ``sum(q_lens) <= num_tokens`` (the caller's
    token budget; checked on the host by the scheduler). ``rows_per_seq``: the static hint of
    :class:`AttentionMetadata`.
    """
    q_lens = q_lens.astype(jnp.int32)
    context_lens = context_lens.astype(jnp.int32)
    cu = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(q_lens, dtype=jnp.int32)])
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    seq, local = packed_row_seq(cu, num_tokens)
    valid = t < cu[-1]
    pos = context_lens[seq] + local
    blk = jnp.take_along_axis(block_tables[seq], (pos // block_size)[:, None], axis=1,
                              mode="clip")[:, 0]
    slot = jnp.where(valid & (blk >= 0), blk * block_size + pos % block_size, -1)
    meta = AttentionMetadata(
        slot_mapping=slot.astype(jnp.int32),
        kv_lens=jnp.where(q_lens > 0, context_lens + q_lens, context_lens).astype(jnp.int32),
        cu_q_lens=cu,
        block_tables=block_tables.astype(jnp.int32),
        rows_per_seq=rows_per_seq,
    )
    return jnp.where(valid, pos, 0).astype(jnp.int32), meta
