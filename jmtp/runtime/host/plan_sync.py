"""Several processes, one plan: every process runs the step process 0 planned.

On a multi-process mesh every process runs the same host loop and must hand the jitted step the
same plan (bucket, prefill chunks, draft limits), or the processes run different programs and
hang in a collective, or compute different values where they should agree. The loop is
deterministic given the step outputs, except for the dynamic speculation policy, whose plan follows
each process's own timings. :class:`PlanSync` therefore broadcasts process 0's plan of every step
through the ``jax.distributed`` coordination service's key-value store (no device collective):
the other processes take its draft limits and check that their own bucket and chunks equal
process 0's, failing with a clear error (naming the step and what differs) instead of hanging
when they do not.

One key per step (``jmtp/plan/<engine>/<step>``); process 0 deletes keys :data:`KEEP_KEYS` steps
old (the processes stay within a step or two of each other: every step ends in a collective).
"""
from __future__ import annotations

import itertools

import jax
import numpy as np

from jmtp.runtime.device.buckets import StepBucket
from jmtp.core import multihost as mh

#: Steps a plan key is kept before process 0 deletes it.
KEEP_KEYS = 64

_engines = itertools.count()   # engines built in this process (the same order everywhere)


class PlanSync:
    """Process 0's plan of each step, for every process (see the module docstring).

    Args:
      timeout_s: seconds a process waits for process 0's plan (default
        ``$JMTP_BARRIER_TIMEOUT``, as :func:`jmtp.core.multihost.barrier`).
    """

    def __init__(self, timeout_s: float | None = None):
        self.prefix = f"jmtp/plan/{next(_engines)}"
        self.timeout_s = timeout_s
        self.leader = jax.process_index() == 0

    def agree(self, index: int, bucket: StepBucket, chunks: np.ndarray, limits: np.ndarray
              ) -> np.ndarray:
        """The draft limits (i32[B]) step ``index`` runs with on every process: process 0
        publishes its plan and keeps its limits; the others wait for it and take its limits.

        Raises:
          RuntimeError: this process planned another bucket or other prefill chunks than
            process 0 (the processes diverged), or process 0's plan did not come in time.
        """
        client = mh._client()
        key = f"{self.prefix}/{index}"
        mine = np.concatenate([[bucket.num_tokens, bucket.num_slots], chunks, limits]
                              ).astype(np.int32)
        if self.leader:
            client.key_value_set_bytes(key, mine.tobytes())
            if index >= KEEP_KEYS:
                client.key_value_delete(f"{self.prefix}/{index - KEEP_KEYS}")
            return limits
        try:
            raw = client.blocking_key_value_get_bytes(key, mh._timeout_ms(self.timeout_s))
        except Exception as e:  # noqa: BLE001 -- the coordination service's error, reworded
            raise RuntimeError(f"process {jax.process_index()}: no plan of step {index} from "
                               f"process 0 ({type(e).__name__}: {e}); process 0 stopped or "
                               "is stuck") from e
        theirs = np.frombuffer(raw, np.int32)
        n = len(chunks)
        if theirs.shape != mine.shape or not np.array_equal(theirs[:2 + n], mine[:2 + n]):
            raise RuntimeError(
                f"process {jax.process_index()} diverged from process 0 at step {index}: "
                f"bucket/chunks {mine[:2].tolist()}/{mine[2:2 + n].tolist()} against "
                f"{theirs[:2].tolist()}/{theirs[2:2 + n].tolist()}; every process must run the "
                "same requests in the same order")
        return theirs[2 + n:].copy()


def plan_sync_for() -> PlanSync | None:
    """A :class:`PlanSync` on a multi-process job, else None. (Every multi-process engine gets
    one: it catches processes that diverged, and with the dynamic policy it is what keeps their
    draft limits equal.)"""
    return PlanSync() if jax.process_count() > 1 else None


__all__ = ["KEEP_KEYS", "PlanSync", "plan_sync_for"]
