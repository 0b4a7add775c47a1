"""Static step buckets: the (token rows T, slot rows A) pairs an engine step is compiled for.

A step's cost should follow the work actually scheduled, not the engine's capacity. Two static sizes
bound that work:

* ``T`` (token bucket): rows of the packed ragged batch run through the target (and MTP substep 0);
  see :meth:`jmtp.runtime.config.EngineConfig.token_buckets`;
* ``A`` (slot bucket): slots whose window logits are computed and verified and for which the MTP
  substeps run. The step compacts its scheduled slots into ``A`` rows (:func:`active_slots`),
  computes, and scatters the results back to the full-width ``[B, ...]`` state.

The host picks the pair with :func:`choose_bucket` from what it scheduled. Every pair it can ever
pick is listed by :func:`step_buckets` (what an ahead-of-time compile iterates over):

* decode-only steps of ``a`` slots: ``A`` = the smallest slot bucket ``>= a`` (powers of two,
  capped at ``B``), ``T`` = the smallest of ``A, 2A, 4A, ... (< A*(K+1)), A*(K+1)`` holding the rows
  actually scheduled, i.e. each slot's ``1 + drafts in its window`` (:func:`decode_buckets`): when
  slots draft nothing (no n-gram match, or the dynamic policy chose 0) the step runs one row per
  slot, as plain decoding does;
* steps with a prefill chunk: ``A = B`` and ``T`` = any token bucket (prefill steps are few, so
  this keeps the count near ``|token buckets| + log2(B)·log2(2(K+1))``).
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jmtp.runtime.config import EngineConfig


@dataclasses.dataclass(frozen=True, order=True)
class StepBucket:
    """One compiled step shape (hashable; a static jit argument).

    Attributes:
      num_tokens: T, rows of the packed ragged batch.
      num_slots: A, compacted slot rows for logits, verification and the MTP substeps
        (``1 <= A <= max_num_seqs``).
    """

    num_tokens: int
    num_slots: int

    @property
    def label(self) -> str:
        """``"T=<num_tokens>,A=<num_slots>"``, the name reports and errors give the bucket."""
        return f"T={self.num_tokens},A={self.num_slots}"


def slot_buckets(ec: EngineConfig) -> tuple[int, ...]:
    """Slot-row counts A: powers of two below ``max_num_seqs``, then ``max_num_seqs`` itself."""
    out, a = [], 1
    while a < ec.max_num_seqs:
        out.append(a)
        a *= 2
    return tuple(out) + (ec.max_num_seqs,)


def decode_buckets(ec: EngineConfig, num_slots: int) -> tuple[int, ...]:
    """Token rows T of a decode-only step over ``num_slots`` (= A) slot rows: ``A·m`` for the powers
    of two ``m < K+1``, then ``A·(K+1)`` (every slot verifying a full window)."""
    out, m = [], 1
    while m < ec.window:
        out.append(num_slots * m)
        m *= 2
    return tuple(out) + (num_slots * ec.window,)


def _token_bucket(ec: EngineConfig, rows: int) -> int:
    for t in ec.token_buckets():
        if t >= rows:
            return t
    raise ValueError(f"{rows} scheduled rows exceed max_num_batched_tokens="
                     f"{ec.max_num_batched_tokens}")


def choose_bucket(ec: EngineConfig, num_rows: int, num_slots: int, has_prefill: bool) -> StepBucket:
    """The bucket of a step that schedules ``num_rows`` token rows over ``num_slots`` slots.

    Args:
      num_rows: rows the host scheduled (each decoding slot's ``1 + drafts``, plus prefill chunks),
        ``0 <= num_rows <= max_num_batched_tokens``.
      num_slots: slots with work this step (decoding or prefilling), ``0 <= num_slots <= B``.
      has_prefill: some slot processes a prefill chunk.

    Returns:
      a :class:`StepBucket` that is one of :func:`step_buckets`.

    Raises:
      ValueError: ``num_rows`` above ``max_num_batched_tokens`` or ``num_slots`` outside ``[0, B]``.
    """
    B = ec.max_num_seqs
    if not 0 <= num_slots <= B:
        raise ValueError(f"num_slots={num_slots} must lie in [0, max_num_seqs={B}]")
    if not 0 <= num_rows <= ec.max_num_batched_tokens:
        raise ValueError(f"num_rows={num_rows} must lie in [0, max_num_batched_tokens="
                         f"{ec.max_num_batched_tokens}]")
    if has_prefill:
        return StepBucket(_token_bucket(ec, num_rows), B)
    a = next(x for x in slot_buckets(ec) if x >= num_slots)
    if num_rows > a * ec.window:
        raise ValueError(f"num_rows={num_rows} exceed num_slots={num_slots} decode windows of "
                         f"K+1={ec.window} rows")
    return StepBucket(next(t for t in decode_buckets(ec, a) if t >= num_rows), a)


def step_buckets(ec: EngineConfig) -> tuple[StepBucket, ...]:
    """Every bucket :func:`choose_bucket` can return for ``ec``, sorted (no duplicates)."""
    out = {StepBucket(t, ec.max_num_seqs) for t in ec.token_buckets()}
    for a in slot_buckets(ec):
        out.update(StepBucket(t, a) for t in decode_buckets(ec, a))
    return tuple(sorted(out))


def active_slots(active: jnp.ndarray, num_slots: int) -> tuple[jnp.ndarray, jnp.ndarray]:
    """Device-side compaction of the active slots into ``num_slots`` rows.

    Args:
      active: bool[B] slots with work this step.
      num_slots: static A (the host guarantees ``sum(active) <= A``).

    Returns:
      ``(slots i32[A], valid bool[A])``: the active slot ids in ascending order, then padding rows
      (``valid`` False) holding ``B`` (out of range: scatters with ``mode="drop"`` skip them; clip
      before gathering).
    """
    B = active.shape[0]
    order = jnp.argsort(~active, stable=True).astype(jnp.int32)[:num_slots]  # active first
    count = jnp.sum(active.astype(jnp.int32))
    valid = jnp.arange(num_slots) < count
    return jnp.where(valid, order, B), valid
