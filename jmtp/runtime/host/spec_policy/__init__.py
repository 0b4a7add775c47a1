"""Dynamic speculation: per-slot draft limits that maximise expected tokens per second.

:class:`DynamicSpeculation` composes four parts, one module each:

* :mod:`~jmtp.runtime.host.spec_policy.estimates`: per-slot, per-position acceptance ``a_i`` and
  presence ``p_i`` from decayed counts of the verify steps (``f64[B, K]``);
* :mod:`~jmtp.runtime.host.spec_policy.costs`: seconds per decode step by step bucket and proposing
  depth, seeded on the idle engine and learnt from live steps (medians of the last
  :data:`BASE_SAMPLES`);
* :mod:`~jmtp.runtime.host.spec_policy.planner`: the draft limits (``i32[B]``) maximising
  ``(n + sum of gains) / price`` over the ranked draft candidates, with probing and the re-timing
  of the no-draft bucket;
* :mod:`~jmtp.runtime.host.spec_policy.guard`: the guard on the realised rate, holding drafting off
  where it delivers fewer tokens per second than plain decoding.

The model, each rule and the reasons for it are in ``docs/architecture.md``, "The dynamic
speculation policy". This package re-exports the public names, so
``from jmtp.runtime.host.spec_policy import DynamicSpeculation`` keeps working.
"""
from jmtp.runtime.host.spec_policy.costs import BASE_SAMPLES, BucketOf, CostTable, Prices
from jmtp.runtime.host.spec_policy.estimates import AcceptanceEstimates
from jmtp.runtime.host.spec_policy.guard import RateGuard
from jmtp.runtime.host.spec_policy.planner import (MAX_PROBE_BACKOFF, PLAN_RTOL, ROWS_EPS,
                                                   Candidates, DraftPlanner)
from jmtp.runtime.host.spec_policy.policy import DynamicSpeculation

__all__ = [
    "BASE_SAMPLES", "MAX_PROBE_BACKOFF", "PLAN_RTOL", "ROWS_EPS", "AcceptanceEstimates",
    "BucketOf", "Candidates", "CostTable", "DraftPlanner", "DynamicSpeculation", "Prices",
    "RateGuard",
]
