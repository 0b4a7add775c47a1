"""The dynamic speculation policy's cost table: seconds per decode step, by step bucket and
proposing depth.

A step costs ``base(T, A) + draft(A, d)`` seconds: ``base`` is a step that proposes nothing in the
:class:`~jmtp.runtime.device.buckets.StepBucket` ``(T, A)``, ``draft`` what proposing at depth ``d`` (the
step's largest draft limit) adds in slot bucket ``A``. A (bucket, depth) pair that ran live is
priced by its own recent steps instead while they are fresh. :class:`CostTable` holds the timings
and records them; :class:`Prices` reads them at one step, memoised (the table does not change
while a plan is chosen). The rules and their reasons: ``docs/architecture.md``, "The dynamic
speculation policy".
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from jmtp.runtime.device.buckets import StepBucket

#: Live timings per bucket (and drafting samples per (A, depth)) whose median is the price (odd:
#: once three are in, one outlier cannot move it; before that, the median of one or two).
BASE_SAMPLES = 3

#: ``(num_rows, num_slots) -> StepBucket`` of a decode step, e.g. ``choose_bucket(ec, r, n, False)``.
BucketOf = Callable[[int, int], StepBucket]


class CostTable:
    """Step timings (seconds) and the bucket function.

    Args:
      k: K, the largest draft count (depths run ``0..K``).
      bucket_of: the :class:`StepBucket` of a decode step with ``rows`` rows over ``n`` slots.
      refresh_every: a pair's own live price, and the no-draft bucket's base while drafting,
        count as stale when their newest timing is more than this many steps old (0 = never).

    Attributes:
      step_seconds: bucket -> median of its last :data:`BASE_SAMPLES` live steps at depth 0.
      seed_seconds: bucket -> seconds timed on the idle engine (:meth:`seed`).
      draft_seconds: ``(A, depth)`` -> median extra seconds of proposing at that depth.
      plan_seconds: ``(bucket, depth > 0)`` -> median of its last live steps, whole step times.
    """

    def __init__(self, k: int, bucket_of: BucketOf, refresh_every: int):
        self.k = k
        self.bucket = bucket_of
        self.refresh_every = refresh_every
        self.step_seconds: dict[StepBucket, float] = {}  # bucket -> median of live steps, depth 0
        self._base_samples: dict[StepBucket, list[float]] = {}   # the last BASE_SAMPLES of each
        self._base_step: dict[StepBucket, int] = {}      # bucket -> step of its newest sample
        self.seed_seconds: dict[StepBucket, float] = {}  # bucket -> idle-engine seconds (seeds)
        self.draft_seconds: dict[tuple[int, int], float] = {}   # (A, depth) -> median extra s
        self._draft_samples: dict[tuple[int, int], list[float]] = {}   # the last BASE_SAMPLES
        # (bucket, depth > 0) -> median of its last BASE_SAMPLES live steps, whole step times
        self.plan_seconds: dict[tuple[StepBucket, int], float] = {}
        self._plan_samples: dict[tuple[StepBucket, int], list[float]] = {}
        self.plan_step: dict[tuple[StepBucket, int], int] = {}   # step of its newest sample
        self._seen: set[StepBucket] = set()              # buckets run once (compiled)
        self.bucket_ids: dict[StepBucket, int] = {}      # bucket -> id, for bucket_table
        self.bucket_rows: dict[int, np.ndarray] = {}     # n -> bucket id per row count

    def prices(self, step: int) -> Prices:
        """The table's prices at policy step ``step``, memoised: valid while the table does not
        change (for one plan, or one question)."""
        return Prices(self, step)

    def seed(self, seconds: dict[StepBucket, float]) -> None:
        """Seed the table with step times measured before serving (``seed_costs``). Seeded buckets
        count as compiled: their first live timing is kept.

        Raises:
          ValueError: a time that is not a positive finite number (nothing is seeded then).
        """
        for bucket, sec in seconds.items():
            if not np.isfinite(sec) or sec <= 0:
                raise ValueError(f"seed_costs: seconds for {bucket} must be positive and finite, "
                                 f"got {sec}")
        for bucket, sec in seconds.items():
            self.seed_seconds[bucket] = float(sec)
            self._seen.add(bucket)

    def record(self, bucket: StepBucket, seconds: float, depth: int, timed: bool, step: int
               ) -> bool:
        """Record one step's wall ``seconds`` in ``bucket`` at proposing ``depth`` (policy step
        ``step``). The first step of a bucket (its compilation) and untimed steps (``timed=False``)
        are dropped. Depth 0 updates the bucket's base; a deeper step its pair's own price and
        ``draft(A, depth)`` (seconds above the base as priced now), unless nothing of that slot
        bucket is priced yet: then the whole time becomes the bucket's base. Returns whether the
        step was recorded (only recorded steps are judged by the guard)."""
        if bucket not in self._seen or not timed:   # a bucket's first step includes its compilation
            self._seen.add(bucket)
            return False
        base = self.prices(step).priced_or_interpolated(bucket)
        if depth > 0:
            self.plan_seconds[(bucket, int(depth))] = _push_median(
                self._plan_samples, (bucket, int(depth)), seconds)
            self.plan_step[(bucket, int(depth))] = step
        if depth > 0 and base is not None:
            key = (bucket.num_slots, int(depth))
            self.draft_seconds[key] = _push_median(self._draft_samples, key,
                                                   max(seconds - base, 0.0))
        else:
            self.step_seconds[bucket] = _push_median(self._base_samples, bucket, seconds)
            self._base_step[bucket] = step
        return True

    def no_draft_stale(self, n: int, step: int) -> bool:
        """Whether the no-draft bucket over ``n`` slots (``n`` rows) needs timing again: it has
        fewer than :data:`BASE_SAMPLES` live timings or none in the last ``refresh_every`` steps
        (never with ``refresh_every=0``)."""
        if not self.refresh_every:
            return False
        none = self.bucket(n, n)
        return (len(self._base_samples.get(none, ())) < BASE_SAMPLES
                or step - self._base_step.get(none, 0) > self.refresh_every)

    def bucket_table(self, n: int, rows: int) -> np.ndarray:
        """i32[>= rows + 1]: an id per row count at ``n`` slots, equal ids for equal buckets
        (``bucket_ids``). Row counts ``0..n`` get -1: a decode step over ``n`` slots has more
        than ``n`` rows once it drafts, so the bucket function is never asked for them. Kept
        across calls (the bucket function is fixed) and grown on demand, so the first plan at a
        new ``n`` asks the bucket function once per row count, later ones not at all (about
        ``4 n (K + 1)`` bytes per ``n`` seen)."""
        table = self.bucket_rows.setdefault(n, np.full((n + 1,), -1, np.int32))
        if len(table) <= rows:
            ids = [self.bucket_ids.setdefault(self.bucket(r, n), len(self.bucket_ids))
                   for r in range(len(table), rows + 1)]
            table = self.bucket_rows[n] = np.concatenate([table, np.asarray(ids, np.int32)])
        return table


class Prices:
    """The prices of a :class:`CostTable` at policy step ``step``, each computed once (per slot
    bucket for :meth:`live_ratio`, per (bucket, depth) for :meth:`step_time`). Make a new one
    (:meth:`CostTable.prices`) after the table changes."""

    def __init__(self, table: CostTable, step: int):
        self.table, self.step = table, step
        self._ratio: dict[int, float] = {}                         # A -> live_ratio(A)
        self._price: dict[tuple[StepBucket, int], float] = {}      # (bucket, depth) -> step_time

    def live_ratio(self, num_slots: int) -> float:
        """Mean live/seed time ratio over the buckets of slot bucket ``num_slots`` that have both
        a seed and a live timing (over every slot bucket when that one has none; 1.0 when no
        bucket has both)."""
        if num_slots in self._ratio:
            return self._ratio[num_slots]
        t = self.table
        both = [b for b in t.step_seconds if b in t.seed_seconds]
        same = [b for b in both if b.num_slots == num_slots] or both
        ratio = float(np.mean([t.step_seconds[b] / t.seed_seconds[b] for b in same])
                      ) if same else 1.0
        self._ratio[num_slots] = ratio
        return ratio

    def priced(self, key: StepBucket) -> float | None:
        """The bucket's live base, else its seed scaled by :meth:`live_ratio`, else None."""
        t = self.table
        if key in t.step_seconds:
            return t.step_seconds[key]
        if key in t.seed_seconds:
            return t.seed_seconds[key] * self.live_ratio(key.num_slots)
        return None

    def priced_or_interpolated(self, key: StepBucket) -> float | None:
        """:meth:`priced`, else interpolated in T between priced buckets of the same A, or the
        nearest one past them; None while nothing of that A is priced."""
        price = self.priced(key)
        if price is not None:
            return price
        table = self.table
        known = sorted(b.num_tokens for b in set(table.step_seconds) | set(table.seed_seconds)
                       if b.num_slots == key.num_slots)
        if not known:
            return None
        t, sec = key.num_tokens, lambda t: self.priced(StepBucket(t, key.num_slots))
        lo = [b for b in known if b < t]
        hi = [b for b in known if b > t]
        if lo and hi:
            a, b = lo[-1], hi[0]
            f = (t - a) / (b - a)
            return (1 - f) * sec(a) + f * sec(b)
        return sec(lo[-1] if lo else hi[0])

    def no_draft_time(self, n: int) -> float | None:
        """Base seconds of the no-draft bucket over ``n`` slots (``n`` rows), None if unpriced."""
        return self.priced_or_interpolated(self.table.bucket(n, n))

    def draft_time(self, num_slots: int, depth: int) -> float:
        """Estimated extra seconds of proposing at ``depth`` (the step's largest draft limit) in
        slot bucket ``num_slots`` (an A of the bucket function): measured, else that of the
        deepest measured depth below it, else 0 (optimistic: an untried depth is tried once); at
        most what any deeper measured depth costs (proposing deeper does more work); 0 for
        ``depth = 0``."""
        if depth <= 0:
            return 0.0
        seconds = self.table.draft_seconds
        measured = [d for a, d in seconds if a == num_slots]
        below = [d for d in measured if d <= depth]
        own = seconds[(num_slots, max(below))] if below else 0.0
        return min([own] + [seconds[(num_slots, d)] for d in measured if d > depth])

    def live_time(self, key: StepBucket, depth: int) -> float | None:
        """The pair's own live price (``plan_seconds``) while fresh, else None."""
        t = self.table
        if (key, depth) in t.plan_seconds and (
                not t.refresh_every or self.step - t.plan_step[(key, depth)] <= t.refresh_every):
            return t.plan_seconds[(key, depth)]
        return None

    def step_time(self, rows: int, num_slots: int, depth: int = 0) -> float:
        """Estimated seconds of a decode step with ``rows`` rows over ``num_slots`` slots that
        proposes at ``depth``. ``base`` (depth 0): :meth:`priced_or_interpolated`; 1.0 before
        anything of that A is priced (every bucket then costs the same). A depth ``d > 0``: the
        median of the last live steps of that bucket and depth while fresh (:meth:`live_time`),
        else ``base + draft_time`` but no less than depth ``d - 1``'s price; either way at most
        the live price of any deeper depth of the bucket (proposing deeper does more work, and a
        rarely run depth's few timings can be high). So the price never falls with depth
        ``>= 1`` (a live drafting step may still come out below the bucket's ``base``: no clamp,
        ``base`` itself can be stale)."""
        k = self.table.k
        key, depth = self.table.bucket(rows, num_slots), min(depth, k)
        if (key, depth) in self._price:
            return self._price[(key, depth)]
        base = self.priced_or_interpolated(key)
        base = 1.0 if base is None else base
        live = [None] + [self.live_time(key, d) for d in range(1, k + 1)]
        below = [np.inf] * (k + 2)        # below[d]: the least live price at depth >= d
        for d in range(k, 0, -1):
            below[d] = min(below[d + 1], np.inf if live[d] is None else live[d])
        price = base
        for d in range(1, depth + 1):
            own = live[d] if live[d] is not None else max(
                base + self.draft_time(key.num_slots, d), price)
            price = min(own, below[d + 1])
        self._price[(key, depth)] = float(price)
        return float(price)


def _push_median(samples: dict, key, value: float) -> float:
    """Append ``value`` to ``samples[key]``, keep its last :data:`BASE_SAMPLES`, return their
    median."""
    recent = samples.setdefault(key, [])
    recent.append(float(value))
    del recent[:-BASE_SAMPLES]
    return float(np.median(recent))
