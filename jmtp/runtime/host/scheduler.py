"""``Scheduler``: which sequence runs in which batch slot, and how much of it each step.

Pure host bookkeeping over the ``B = max_num_seqs`` slots, split into ``D`` data shards of ``Bl``
slots (slot ``b`` belongs to shard ``b // Bl``). Per step it

1. admits waiting sequences FIFO into idle slots (:meth:`Scheduler.admit_waiting`): the data
   shard with the fewest occupied slots that can take the sequence's first chunk;
2. splits each shard's token budget (:meth:`Scheduler.plan`): decode windows first (``1 +``
   drafts waiting in the slot), then prefill chunks in slot order; the busiest shard picks the
   step's ``(T, A)`` bucket for all (:func:`~jmtp.runtime.device.buckets.choose_bucket`), or with lazy
   compiles an already compiled bucket at most twice its size (:func:`reuse_bucket`);
3. after the step, marks slots paused for KV blocks and names the shards where a slot paused and
   none progressed (:meth:`Scheduler.after_step`): their newest request is preempted (LIFO,
   vLLM's recompute preemption) and the shard admits nothing until one of its requests ends.

It never touches the device; the engine calls the :class:`~jmtp.runtime.device.runner.DeviceRunner`.
"""
from __future__ import annotations

from typing import Callable, Iterable

import numpy as np

from jmtp.pallas.block_allocator import blocks_needed
from jmtp.runtime.config import EngineConfig
from jmtp.runtime.device.buckets import StepBucket, choose_bucket
from jmtp.runtime.host.inflight import drafts_bound, max_window_drafts
from jmtp.runtime.host.requests import Sequence


def reuse_bucket(bucket: StepBucket, compiled: Iterable[StepBucket],
                 max_ratio: float = 2.0) -> StepBucket:
    """``bucket``, or the smallest already compiled bucket that holds its work at most
    ``max_ratio`` times over (``T`` and ``A`` each within ``[1x, max_ratio x]``): a compile costs
    seconds, padding one step to twice its rows milliseconds (a one-prompt run's last, shorter
    windows reuse the full-window bucket instead of compiling ``T=2``). Padded rows compute
    nothing that is kept and sampling keys follow request positions, so tokens are those of the
    smaller bucket up to floating-point rounding. ``max_ratio=inf`` (``compile="fewest"``):
    any compiled bucket that holds the step."""
    compiled = set(compiled)
    if bucket in compiled:
        return bucket
    fits = [c for c in compiled
            if bucket.num_tokens <= c.num_tokens <= max_ratio * bucket.num_tokens
            and bucket.num_slots <= c.num_slots <= max_ratio * bucket.num_slots]
    return min(fits, default=bucket)


def capture_chunk(seq: Sequence, left: int, c: int, block_size: int, window: int) -> int:
    """The prefill chunk of ``seq`` (``left`` context tokens to go, ``c`` the budget gives it),
    cut for a hybrid target with prefix caching (``seq.state_entry >= 0``) so that a block
    boundary whose state the slot should capture ends the chunk. A chunk of more than
    ``window`` (K+1) rows keeps only its final state
    (:func:`~jmtp.model.state_checkpoints.boundary_captured`), so a boundary inside it is lost.
    Two boundaries are kept (:mod:`jmtp.runtime.host.prefix_states`):

    * ``seq.state_target``, the end of a KV match past every cached state (a branch point);
    * the context's last block boundary, when the chunk would run past it: the continuation
      point. A conversation's next turn repeats this context, so it resumes there rather than
      at the last chunk end that fell on a boundary. The context's tail after it takes one
      more, shorter step.

    Dense targets and engines without prefix caching get ``c`` unchanged. Returns the chunk
    (``1 <= chunk <= c`` for ``c >= 1``)."""
    if seq.state_entry < 0 or c <= 0:
        return c
    start = len(seq.context_ids) - left
    if start < seq.state_target < start + c:
        c = seq.state_target - start       # a branch point
    last = len(seq.context_ids) // block_size * block_size
    if c > window and start < last < start + c:
        c = last - start                    # the continuation point
    return c


class Scheduler:
    """Slots, admission, token budget, bucket choice and preemption of one engine.

    Args:
      engine_config: the engine's config (totals over data shards).
      shard_config: one data shard's config (:func:`jmtp.runtime.device.data_parallel.shard_config`).
      num_shards: data shards ``D``.

    Attributes: ``slots`` (``list[Sequence | None]``, ``B``), ``paused`` (``list[bool]``: the
    slot waited for KV blocks in the last step), ``order`` (occupied slots in admission order),
    ``hold`` (per shard: admit nothing after a preemption until a request ends),
    ``next_drafts`` (``i32[B]``: drafts waiting in each slot's window; with a step in flight, a
    bound on them, :func:`~jmtp.runtime.host.inflight.drafts_bound`), ``pending`` (``i32[B]``: prefill
    tokens of steps in flight), ``tickets`` (``i64[B]``: each admission's number),
    ``draft_caps`` (``i32[B]``: each occupant's draft cap, ``SamplingParams.num_speculative_
    tokens`` or K), ``num_preemptions``.
    """

    def __init__(self, engine_config: EngineConfig, shard_config: EngineConfig, num_shards: int):
        self.engine_config, self.shard_config, self.num_shards = (engine_config, shard_config,
                                                                  num_shards)
        B, Bl = engine_config.max_num_seqs, shard_config.max_num_seqs
        self.shard_slots = [range(d * Bl, (d + 1) * Bl) for d in range(num_shards)]
        self.slots: list[Sequence | None] = [None] * B
        self.paused = [False] * B
        self.order: list[int] = []
        self.hold = [False] * num_shards
        self.next_drafts = np.zeros((B,), np.int32)
        self.pending = np.zeros((B,), np.int32)
        self.tickets = np.zeros((B,), np.int64)
        self.draft_caps = np.zeros((B,), np.int32)
        self._admissions = 0
        self.most_drafts = max_window_drafts(engine_config)
        self.num_preemptions = 0

    def shard_of(self, b: int) -> int:
        return b // self.shard_config.max_num_seqs

    @property
    def num_running(self) -> int:
        return sum(s is not None for s in self.slots)

    def blocks_for_admission(self, seq: Sequence) -> int:
        """KV blocks a waiting sequence needs free to be admitted: its first prefill chunk's
        (plus the MTP's overhang) or, for an imported request, all its pages at once."""
        if seq.handoff is not None:
            return seq.handoff.num_pages
        first = min(len(seq.context_ids), self.shard_config.max_num_batched_tokens)
        return blocks_needed(first + self.engine_config.mtp_substeps, self.engine_config.block_size)

    # ------------------------------------------------------------------ admission
    def admit_waiting(self, waiting, free: list[int], admit: Callable[[int, Sequence], None]
                      ) -> None:
        """Admit ``waiting`` sequences (a deque, FIFO) into idle slots. Each goes to the data
        shard with the fewest occupied slots (ties: most ``free`` blocks, then the lowest index)
        among those with an idle slot, no paused slot and no hold, whose free blocks cover
        :meth:`blocks_for_admission` (or that run nothing else); it takes that shard's lowest
        idle slot: ``admit(b, seq)`` (which must :meth:`occupy` it; if it raises, the sequence
        stays first in line). Admission stops at the first sequence no shard can take."""
        for d, r in enumerate(self.shard_slots):
            if self.hold[d] and not any(self.slots[b] is not None for b in r):
                self.hold[d] = False
        free = list(free)
        while waiting:
            seq = waiting[0]
            need = self.blocks_for_admission(seq)
            best = None
            for d, r in enumerate(self.shard_slots):
                idle = [b for b in r if self.slots[b] is None]
                busy = len(r) - len(idle)
                if (not idle or self.hold[d] or need > free[d] and (busy or seq.handoff)
                        or any(self.slots[b] is not None and self.paused[b] for b in r)):
                    continue
                key = (busy, -free[d], d)
                if best is None or key < best[0]:
                    best = (key, d, idle[0])
            if best is None:
                return
            _, d, b = best
            admit(b, seq)
            waiting.popleft()
            free[d] -= need

    def occupy(self, b: int, seq: Sequence, next_drafts: int | None = None) -> None:
        """``seq`` now runs in slot ``b`` (an imported one with ``next_drafts`` drafts already in
        its window)."""
        seq.slot = b
        self.slots[b] = seq
        self.paused[b] = False
        self.order.append(b)
        self._admissions += 1
        self.tickets[b] = self._admissions
        self.pending[b] = 0
        cap = seq.params.num_speculative_tokens
        self.draft_caps[b] = self.engine_config.k if cap is None else min(cap, self.engine_config.k)
        self.next_drafts = np.array(self.next_drafts)   # (the step's copy is read-only)
        self.next_drafts[b] = next_drafts or 0

    def vacate(self, b: int) -> Sequence:
        """Slot ``b`` is empty again (its shard's hold ends); returns the sequence it ran."""
        seq = self.slots[b]
        self.slots[b] = None
        self.paused[b] = False
        self.order.remove(b)
        self.pending[b] = 0
        seq.slot = None
        self.hold[self.shard_of(b)] = False
        return seq

    # ------------------------------------------------------------------ one step
    def plan(self, compiled: Iterable[StepBucket] | None = None
             ) -> tuple[np.ndarray, StepBucket]:
        """Prefill chunks ``i32[B]`` and the step's bucket. Per shard the budget
        ``max_num_batched_tokens / D`` goes to decode windows first, then to prefill chunks in
        slot order (a hybrid model's chunk ends on a block boundary whose state the slot must
        capture: :func:`capture_chunk`); the busiest
        shard's rows and active slots pick the bucket. With
        ``compiled`` (lazy compiles), an already compiled bucket is reused when it fits
        (:func:`reuse_bucket`)."""
        sec, slots, ec = self.shard_config, self.slots, self.engine_config
        chunks = np.zeros((self.engine_config.max_num_seqs,), np.int32)
        rows, active = [0] * self.num_shards, [0] * self.num_shards
        for d, r in enumerate(self.shard_slots):
            decoding = [b for b in r if slots[b] is not None and not self.prefill_left(b)]
            dec_rows = sum(1 + int(self.next_drafts[b]) for b in decoding)
            budget = sec.max_num_batched_tokens - dec_rows
            for b in r:
                left = self.prefill_left(b) if slots[b] is not None else 0
                if left:
                    c = capture_chunk(slots[b], left, min(left, budget), ec.block_size,
                                      ec.window)
                    chunks[b], budget = c, budget - c
            rows[d] = dec_rows + int(chunks[r.start:r.stop].sum())
            active[d] = len(decoding) + int(np.count_nonzero(chunks[r.start:r.stop]))
        bucket = choose_bucket(sec, max(rows), max(active), bool(chunks.any()))
        if compiled is not None:
            bucket = reuse_bucket(bucket, compiled)
        return chunks, bucket

    def prefill_left(self, b: int) -> int:
        """Context tokens of slot ``b``'s occupant not prefilled yet, nor in a step in flight."""
        s = self.slots[b]
        return len(s.context_ids) - s.prefilled - int(self.pending[b])

    def proposing(self, chunks: np.ndarray) -> np.ndarray:
        """``bool[B]``: slots that propose drafts in the step: decoding ones and those whose
        prefill ends in it."""
        return np.array([s is not None and self.prefill_left(b) <= int(chunks[b])
                         for b, s in enumerate(self.slots)])

    def dispatched(self, chunks: np.ndarray, limits: np.ndarray, proposing: np.ndarray) -> None:
        """A step planned with ``chunks``, draft ``limits`` (i32[B]) and ``proposing`` (bool[B])
        went to the device: its chunks are pending and each proposing slot's next window is
        bounded by :func:`~jmtp.runtime.host.inflight.drafts_bound` until its outputs are read."""
        self.pending = self.pending + chunks
        self.next_drafts = drafts_bound(np.asarray(self.next_drafts), limits, proposing,
                                        self.most_drafts)

    def block_bound(self, chunks: np.ndarray, shard: int) -> int:
        """An upper bound on the blocks the next step's top-up can take on ``shard``: per
        occupied slot, ``blocks_needed(rows + M - 1) + 1`` for its rows (prefill chunk or verify
        window)."""
        ec, total = self.engine_config, 0
        for b in self.shard_slots[shard]:
            s = self.slots[b]
            if s is None:
                continue
            rows = int(chunks[b]) if self.prefill_left(b) else 1 + int(self.next_drafts[b])
            if rows:
                total += blocks_needed(rows + max(ec.mtp_substeps - 1, 0), ec.block_size) + 1
        return total

    def after_step(self, out, chunks: np.ndarray, valid: np.ndarray | None = None,
                   following=None) -> list[int]:
        """Note which slots the step paused for KV blocks and keep its drafts; returns the
        shards to preempt in: some slot paused and no slot progressed (no prefill chunk, no
        token).

        Args:
          out: the step's ``StepOutput``; chunks: its prefill chunks (i32[B]).
          valid: bool[B] slots whose occupant the step ran for (default: all); the others
            (admitted since, or idle) keep their state.
          following: the :class:`~jmtp.runtime.host.inflight.StepRecord` of a step dispatched after
            it and still in flight (asynchronous scheduling): the windows it leaves are bounded
            from this step's exact ones.
        """
        B = len(self.slots)
        valid = np.ones((B,), bool) if valid is None else valid
        window = np.asarray(out.num_next_drafts)
        if following is not None:
            window = drafts_bound(window, following.limits, following.proposing,
                                  self.most_drafts)
        self.next_drafts = np.where(valid, window, self.next_drafts).astype(np.int32)
        self.pending = np.where(valid, self.pending - chunks, self.pending).astype(np.int32)
        progressed = [False] * self.num_shards
        for b, seq in enumerate(self.slots):
            if not valid[b]:
                continue
            self.paused[b] = bool(seq is not None and out.paused[b])
            if seq is not None and not out.paused[b]:
                progressed[self.shard_of(b)] |= bool(chunks[b] > 0 or out.num_tokens[b] > 0)
        return [d for d, r in enumerate(self.shard_slots) if not progressed[d]
                and any(self.slots[b] is not None and self.paused[b] and valid[b] for b in r)]

    def victim(self, shard: int) -> int:
        """The slot to preempt in ``shard``: its newest admission (LIFO)."""
        return next(b for b in reversed(self.order) if self.shard_of(b) == shard)


__all__ = ["Scheduler", "capture_chunk", "reuse_bucket"]
