"""Asynchronous scheduling: what the host keeps of a dispatched step until it reads its outputs.

With ``LLM(async_scheduling=True)`` :meth:`LLMEngine.step <jmtp.runtime.host.llm_engine.LLMEngine.step>`
hands step N+1 to the device (JAX's asynchronous dispatch) *before* it reads step N's outputs,
then does step N's host work (detokenising, stop strings, logprobs, metrics, outputs, the dynamic
policy's observation) while step N+1 runs. Step N+1 is planned without step N's outputs, from a
view of the device that is never optimistic where that could be wrong:

* **Windows.** A decoding slot's next window holds at most ``max(min(limit, K), window before)``
  drafts (``limit``: the draft limit it was given; the window before stays when the slot is
  paused for KV blocks), so the step's token bucket is chosen for that bound
  (:func:`drafts_bound`); the device verifies what the window really holds. With the MTP head the
  bound is exact (it fills its budget); an n-gram window may hold fewer, and the step then pads
  rows the synchronous loop would not run.
* **Prefill progress.** Chunks in flight count as done (``Scheduler.pending``); a slot paused
  for blocks is corrected when its outputs are read (the device clips a chunk to what is left).
* **Free blocks.** Admission and the prefix cache's eviction count the free blocks of the last
  step read back, plus the blocks pushed back since, minus what each step in flight can take
  and what hand-off imports took since that step (:func:`free_lower_bound`): a lower bound
  (releases in between only add).
* **Occupants.** Each admission gets a ticket (``Scheduler.tickets``); outputs of a slot whose
  request finished (stop string), was aborted or preempted after the step was dispatched are
  dropped (:meth:`StepRecord.valid`): the request learns of its end one step late, and the tokens
  the extra step made for it never reach an output.

A step that needs the previous step's committed tokens on the host runs synchronously: a running
structured-output request (its grammar bitmask follows the committed tokens) and a request handed
off after its prefill (its state is exported right after that step). The engine first reads the
step in flight, then runs as without asynchronous scheduling.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from jmtp.runtime.config import EngineConfig
from jmtp.runtime.device.buckets import StepBucket


@dataclasses.dataclass
class StepRecord:
    """One dispatched step, kept until its outputs are taken.

    Attributes:
      index: the engine's dispatch number of the step.
      bucket, chunks (i32[B]), limits (i32[B]), proposing (bool[B]): what it was planned with.
      seqs, tickets: the slots' occupants and their admission tickets (i64[B]) at dispatch.
      bounds: per data shard, the most KV blocks it can take (``Scheduler.block_bound``).
      pushed: per data shard, evicted prefix-cache blocks pushed back just before it.
      taken: per data shard, KV blocks that imported requests took since the step before it
        (hand-off imports allocate at admission; None: none).
      overlapped: dispatched before the previous step's outputs were read.
      continued: the engine was busy since the previous dispatch (a device gap before it is
        idle time of a busy engine, not a pause between requests).
      handle: the runner's dispatched step, or ``out`` its outputs when read at once.
      policy: the dynamic policy's plan context (``DynamicSpeculation.plan_context``) or None.
      plan_seconds: host seconds of the policy's plan.
      t_round, t_dispatch0, t_dispatch1: ``time.perf_counter`` at the start of the ``step()``
        call that dispatched it, and around the dispatch call.
    """

    index: int
    bucket: StepBucket
    chunks: np.ndarray
    limits: np.ndarray
    proposing: np.ndarray
    seqs: list
    tickets: np.ndarray
    bounds: list[int]
    pushed: list[int]
    overlapped: bool
    continued: bool
    handle: object = None
    out: object = None
    first: bool = False
    watched: bool = False     # its device end is stamped (jmtp.runtime.host.timeline)
    policy: object = None
    plan_seconds: float = 0.0
    t_round: float = 0.0
    t_dispatch0: float = 0.0
    t_dispatch1: float = 0.0
    taken: list[int] | None = None

    def valid(self, slots: list, tickets: np.ndarray) -> np.ndarray:
        """``bool[B]``: slots whose occupant now is the one the step ran for (same admission)."""
        return np.array([s is not None and slots[b] is s and tickets[b] == self.tickets[b]
                         for b, s in enumerate(self.seqs)], bool)


def max_window_drafts(ec: EngineConfig) -> int:
    """The most drafts one step proposes for a slot: M for the MTP head alone (its M substeps),
    K otherwise (n-gram, hybrid, custom drafter)."""
    spec = ec.spec
    if spec.enabled and spec.method == "mtp" and spec.ngram_sizes == (0, 0):
        return ec.mtp_substeps
    return ec.k


def drafts_bound(window: np.ndarray, limits: np.ndarray, proposing: np.ndarray, most: int
                 ) -> np.ndarray:
    """``i32[B]``: a bound on the drafts of each slot's next window after a step that gave it
    draft limits ``limits`` (i32[B]) where ``proposing`` (bool[B]), ``window`` (i32[B]) bounding
    its window before and ``most`` drafts at most per step (:func:`max_window_drafts`):
    ``max(min(limit, most), window)`` for proposing slots (a slot paused for KV blocks keeps its
    window), ``window`` otherwise."""
    grown = np.maximum(np.minimum(limits, most), window)
    return np.where(proposing, grown, window).astype(np.int32)


def free_lower_bound(last_free: list[int], inflight: list[StepRecord], pushed: list[int],
                     taken: list[int] | None = None) -> list[int]:
    """Per data shard, a lower bound on the free KV blocks once every step in flight has run:
    ``last_free`` (free blocks after the last step read back), plus the blocks pushed back before
    each step in flight and ``pushed`` (pushed since the last dispatch), minus what each step in
    flight can take and the blocks imported requests took before each step in flight
    (``StepRecord.taken``) and since the last dispatch (``taken``): an import allocates at
    admission, after the step read back, so that step's free count does not show it. Releases
    since then are not counted (they only add)."""
    out = list(last_free)
    for rec in inflight:
        out = [f + p - b - t for f, p, b, t in zip(out, rec.pushed, rec.bounds,
                                                  rec.taken or [0] * len(out))]
    return [max(f + p - t, 0) for f, p, t in zip(out, pushed, taken or [0] * len(out))]


def needs_sync(slots: list) -> bool:
    """A running sample needs the previous step's tokens on the host before the next step is
    planned: a structured-output constraint (its bitmask follows them), a hand-off export, or a
    hybrid model's branch-point state to cache (``Sequence.state_target``: the host switches the
    slot's capture entry before a later step can capture over it;
    :mod:`jmtp.runtime.host.prefix_states`)."""
    return any(s is not None and (s.grammar is not None or s.group.export or s.state_target)
               for s in slots)


def default_async_scheduling(ec: EngineConfig) -> bool:
    """``async_scheduling=None``: on for an accelerator (``ec.platform`` "gpu" or "tpu") unless the
    windows are hard to bound ahead of the outputs (an n-gram proposer, alone or extending MTP
    drafts: its windows are often shorter than their budget, so a step planned for the budget
    runs rows the synchronous loop would not), or suffix decoding drafts (the host drafts from
    each step's tokens: the engine reads every step before the next). Off on CPU: XLA:CPU's
    "device" is the host's own cores and the step uses all of them, so the overlapped host work
    slows the step it overlaps; measured on a 2-core VM: 0.92-1.04x the synchronous loop, even
    for a tiny model at batch 64 whose host work is a third of a step
    (``docs/async_scheduling.md``, ``scripts/bench_async.py``)."""
    spec = ec.spec
    if ec.platform == "cpu":
        return False
    return not spec.enabled or (spec.method == "mtp" and spec.ngram_sizes == (0, 0)
                                and not spec.uses_suffix)


__all__ = ["StepRecord", "default_async_scheduling", "drafts_bound", "free_lower_bound",
           "max_window_drafts", "needs_sync"]
