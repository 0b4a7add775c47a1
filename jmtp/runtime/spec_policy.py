"""Dynamic speculation: per-slot draft limits that maximise expected tokens per second.

The host calls :meth:`DynamicSpeculation.draft_limits` before each engine step (the limits cap the
drafts proposed in that step, i.e. verified in the next one) and :meth:`DynamicSpeculation.observe`
after it. The limits are an ``i32[B]`` data input of the jitted step, so they never recompile.

Model (in the spirit of "SpecDec++" (Huang et al. 2024) and vLLM's / TensorRT-LLM's dynamic
speculation-length heuristics, reduced to what the host measures anyway):

* **Acceptance**, per slot and draft position ``i`` (1-based): ``a_i = P(draft i accepted | draft
  i allowed, draft i-1 accepted)``, estimated from decayed counts (half-life ``halflife`` steps)
  of the slot's own verify steps, shrunk towards the pooled estimate over all slots (weight
  ``prior_weight`` trials), which itself starts at ``prior_acceptance``. Without
  ``count_presence`` only drafts that exist are trials of ``a_i``; with it, a draft allowed but
  never proposed is a trial that failed.
* **Presence** (``count_presence=True``, the default; off, every ``p_i = 1``: see the argument),
  per slot and position: ``p_i = P(draft i proposed | allowed, draft i-1 proposed)``, estimated
  the same way (pooled prior 1.0) from the budget each verified window was proposed under
  (``StepOutput.num_allowed``). The MTP head fills its budget up to its M substeps (``p_i = 1``;
  past M, with ``K > M`` and no n-gram extension, ``p_i`` goes to 0); an n-gram proposer leaves
  positions empty where it finds no match, or a shorter one. A slot allowed ``k`` drafts is
  expected to commit ``E(k) = 1 + sum_{i<=k} prod_{j<=i} a_j`` tokens and to verify ``sum_{i<=k}
  prod_{j<=i} p_j`` draft rows; the gain of its ``k``-th draft, ``prod_{j<=k} a_j``, never grows
  with ``k``. (This takes a proposer's first ``i`` drafts not to depend on its budget except by
  being cut off at it, which holds for the MTP head, the n-gram matcher and the hybrid. The gain
  is estimated jointly, not as ``prod p_j a'_j`` with ``a'_j`` counted over proposed drafts
  only: an n-gram draft that follows an accepted one is far likelier to exist than one that
  follows any proposed draft, and the product undercounted long matches. Before presence was
  counted, a slot whose n-gram rarely matched looked as good as its rare matches: on general
  prompts the plan allowed drafts that never came.)
* **Cost**: seconds per step, ``base(T, A) + draft(A, d)``. ``base`` depends on the step bucket
  (the engine's :func:`~jmtp.runtime.buckets.choose_bucket`: token rows ``T`` verified, compacted
  slots ``A``); ``draft`` on the proposing depth ``d``, the largest draft limit of the step (MTP
  substeps past the first and the draft LM heads, the n-gram matcher: skipped at run time when
  ``d = 0``; MTP substep 0 always runs, it fills the MTP cache).
  ``base`` is the median of the last :data:`BASE_SAMPLES` live steps of that bucket that proposed
  nothing (a median, so that one slow step -- a page fault storm in the first steps over fresh KV
  pages, another process -- cannot set the price); buckets can be seeded
  before serving (:meth:`DynamicSpeculation.seed_costs`, timed on the idle engine), and since an
  idle step does less than a live one (no keys to read) a seeded bucket without such live steps
  is priced at its seed times the live/seed ratio of the same ``A``'s measured buckets (of every
  ``A``'s while that one has none); a bucket
  neither seeded nor measured is interpolated in ``T`` between priced buckets of the same ``A``,
  or priced as the nearest one past them. ``draft(A, d)`` is the median of (live time - ``base``)
  over the last :data:`BASE_SAMPLES` steps that proposed at depth ``d`` (a median for the same
  reason: one slow step once priced depth 1 at 45 ms over a 34 ms base at 8 slots, where it
  costs ~0, and an EMA kept it there for tens of steps; the median drops such a step once two
  more samples are in); it also absorbs what verifying drafts adds to a wide
  bucket (a step verifies the drafts the previous one proposed). A depth not yet measured is
  priced as the deepest measured depth below it of that ``A``, or 0 (optimistic: the policy
  tries it once and learns its price), though never below the price of the depth under it in
  the same bucket (see below). Steps with a prefill chunk are not timed (their token
  buckets can coincide with decode buckets).
* **Choice**: with ``n`` active slots, every draft of every slot is a candidate with its gain and
  its expected rows (``prod_{j<=i} p_j``). For each depth cap ``d = 1..K`` the policy ranks the
  candidates at positions ``<= d`` by gain and tries the ``x`` best (a prefix per slot, since
  gains fall with position) for every ``x``; it takes the plan maximising ``(n + sum of gains) /
  price(n + r, d')``, ``r`` the expected draft rows of the ``x`` drafts (``x`` when every draft
  is proposed), ``d'`` the largest draft position in it, and ``price`` the step's price
  ``base(bucket(rows)) + draft(A, d')`` interpolated linearly between the whole row counts
  around ``n + r`` (exact for one slot allowed one draft: it runs ``n`` or ``n + 1`` rows; with
  more drafts an approximation of the price averaged over the rows that come: it ignores their
  spread, e.g. n-gram drafts that come all or none, which makes it optimistic just below a
  bucket boundary and pessimistic above one). With one active slot (batch 1) the price is the
  exact expectation over the slot's rows instead (``P(R >= i) = prod_{j<=i} p_j``). When some
  presence is below 1 the prefixes of a second ranking, by gain per expected row (its running
  minimum over positions, so that it falls with position), are tried too (a rarely proposed
  draft adds a fraction of a row, so it can pay more than its gain ranks it); neither ranking is
  optimal for every mix of presences. Slots whose drafts cannot pay get 0. (The caps matter: in
  one ranking of every position, a good slot's second draft can outrank another slot's first,
  and the first then only comes with the second's depth. At 8 slots the plan stopped at ~5
  first drafts in a 16-row bucket where 8 cost the same.) A (bucket,
  depth) pair that has run live is priced by its own live steps (median of the last
  :data:`BASE_SAMPLES` whole step times) rather than ``base + draft``: the split into the two
  is only an estimate (a drafting step's ``draft`` sample is its time minus the bucket's base
  *as priced then*, and that base moves as live timings replace seeds), and the pairs a busy
  engine cycles through are few. A pair's own price expires when its newest step is more than
  ``refresh_every`` steps old (the split prices it again), so one slow step cannot keep a pair
  out for ever. Proposing deeper does more work, so prices never fall with depth (from 1): a depth is
  never priced above the live price of a deeper one of the same bucket (nor ``draft(A, d)``
  above a deeper measured depth's), and an estimated depth never below the depth under it. At
  8 slots a 16-row step at depth 1, rarely run, was once priced at 143-183 ms from a few slow
  timings while depth 2 ran at 101-110 ms, which kept the plan from the cheaper depth.
* **Probing**: a slot held at 0 drafts for its probe gap of consecutive steps gets at least one
  draft, so a change in its acceptance (e.g. the text turns to copying) is noticed. The gap
  starts at ``probe_every``. It doubles (up to ``probe_every * MAX_PROBE_BACKOFF``) when the
  probe's verified window was allowed a draft and its first draft was not accepted (rejected,
  or, with ``count_presence``, never proposed: no n-gram match), so slots whose drafts keep
  failing cost fewer and fewer probe steps; a probe whose budget the ``max_tokens`` cap took
  leaves it as it was. It falls back to ``probe_every`` when the plan drafts for the slot
  without being made to (and when a new request takes the slot). The probes' first drafts are forced into the plan, which is then
  chosen again around them: drafts of other slots that pay in the wider token bucket a probe
  opens ride along (at 8 slots, one probe turns 8 rows into a 16-row bucket, where the other
  slots' first drafts cost only their proposing), drafts that do not pay there any more are
  dropped, and a probing slot may get more drafts where they pay.
* **Refreshing the no-draft price**: a policy that keeps drafting never runs the no-draft bucket
  (``n`` rows over ``n`` slots), so a wrong price of it would stand for ever: one slow early step
  once priced it 3.6x too high at 8 slots, which made drafting look free, and the policy drafted
  at a loss from then on. When the chosen plan drafts and that bucket has fewer than
  :data:`BASE_SAMPLES` live timings, or none in the last ``refresh_every`` steps, the policy
  drafts nothing for two steps: the first verifies the drafts already proposed, the second runs
  the no-draft bucket and times it.

* **Guard on the realised rate**: the estimates above can stay optimistic (acceptance and
  presence lag by their half-life; the plan's rows are expected values). So the
  policy also measures what its drafting delivers. A step is *judged* when it verifies drafts
  that the plan itself proposed in the step before (not drafts proposed only as probes, and not
  while drafting is held off); it is timed like the cost samples above (no prefill chunk, not a
  bucket's first run). Its committed tokens and seconds join a window of ``guard_samples`` judged
  steps at the same number of active slots ``n`` (a change of ``n`` starts a new window). A full
  window is judged once and cleared: when its tokens per second (its slowest step left out when
  ``guard_samples > 1``, as one slow step must not trip it) fall below what plain decoding gives
  in the no-draft bucket, ``c / base(bucket(n, n))`` with ``c`` the mean number of slots that
  committed a token in those steps (slots paused for KV blocks commit none in either case),
  drafting at ``n`` is held off for the guard gap of steps, counted at any ``n`` (every slot
  gets limit 0 and no probe: plain decoding, after the first held step verifies the drafts
  proposed before the hold). The gap starts at ``guard_retry`` and doubles (up to ``guard_retry *
  MAX_PROBE_BACKOFF``) each time a window loses again; a window that keeps up resets it. So
  drafting that loses costs about one window per gap. The no-draft price is the refreshed base
  above; with ``refresh_every=0`` it can go stale, and so can the guard's judgement.

Expected-throughput maximisation is greedy per step (no look-ahead), and acceptance is treated as
independent of batch composition.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from jmtp.runtime.buckets import StepBucket

#: Live timings per bucket (and drafting samples per (A, depth)) whose median is the price (odd:
#: once three are in, one outlier cannot move it; before that, the median of one or two).
BASE_SAMPLES = 3

#: A slot's probe gap grows to at most ``probe_every`` times this (see "Probing" above).
MAX_PROBE_BACKOFF = 8

#: Plans whose expected tokens per second lie within this relative margin of the best are near-ties;
#: of those the plan takes the one with the fewest drafts. The chosen plan's rate is therefore
#: within a factor ``1 + PLAN_RTOL`` of the optimum, not always equal to it.
PLAN_RTOL = 1e-9

#: Expected row counts within this of an integer count as that integer (sums of presences).
ROWS_EPS = 1e-9

#: ``(num_rows, num_slots) -> StepBucket`` of a decode step, e.g. ``choose_bucket(ec, r, n, False)``.
BucketOf = Callable[[int, int], StepBucket]

#: Draft candidates of a plan: ``(gain f64[m], position i64[m], slot i64[m], rows f64[m])``, the
#: last the draft's expected verify rows (its presence ``prod_{j<=i} p_j``; the input of
#: ``_best_plan`` sorted by falling gain; its output lists the forced drafts first).
Candidates = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]


class DynamicSpeculation:
    """Per-slot draft-limit policy (see the module docstring).

    Args:
      num_slots: B.
      k: K, the largest draft count.
      bucket_of: the :class:`StepBucket` a decode step with ``rows`` rows over ``n`` slots runs in
        (the engine passes ``choose_bucket(ec, rows, n, has_prefill=False)``).
      prior_acceptance: initial pooled per-position acceptance ``a_i`` (before any measurement).
      prior_weight: pseudo-trials of the pooled estimate in each slot's estimate.
      halflife: steps after which a count has half its weight.
      probe_every: a slot at 0 drafts this many steps in a row gets a probe draft (0 = never
        probe); the gap doubles after each rejected probe (see "Probing").
      refresh_every: while drafting, re-time the no-draft bucket when its newest live timing is
        older than this many steps (0 = never; see the module docstring).
      guard_samples: judged steps per window whose realised tokens per second are compared with
        plain decoding's (0 = no guard; see "Guard on the realised rate").
      count_presence: estimate each position's presence from ``observe``'s ``num_allowed``
        and count an allowed draft that never came as a failed trial of its acceptance (see
        "Presence"). On by default since the gain is estimated jointly: in interleaved A/Bs of
        dynamic n-gram K=7 it was faster at batch 1 on general and copy-heavy prompts and tied
        within noise at batch 8 (figures in ``docs/measurements.md``); off,
        ``num_allowed`` is ignored, every presence is 1 and only proposed drafts are trials.
        No effect on an MTP engine with ``K <= M`` (it proposes every allowed draft).
      guard_retry: steps drafting is held off after a first losing window (doubles after each
        further losing window, up to ``guard_retry * MAX_PROBE_BACKOFF``).

    Raises:
      ValueError: ``num_slots < 1``, ``k < 1``, or a parameter outside its range.

    Counters (``LLMEngine.get_stats`` reports them as ``spec_policy_*``): :attr:`num_plans`
    (``draft_limits`` calls with an active slot), ``num_drafting_plans`` (those whose limits
    allowed a draft, probes included) and ``num_holds`` (losing windows of the guard, each
    starting a hold).
    """

    def __init__(self, num_slots: int, k: int, bucket_of: BucketOf, *,
                 prior_acceptance: float = 0.5, prior_weight: float = 4.0, halflife: float = 32.0,
                 probe_every: int = 16, refresh_every: int = 64, guard_samples: int = 16,
                 guard_retry: int = 16, count_presence: bool = True):
        if num_slots < 1 or k < 1:
            raise ValueError(f"DynamicSpeculation: need num_slots >= 1 and k >= 1, got "
                             f"num_slots={num_slots}, k={k}")
        if not 0.0 <= prior_acceptance <= 1.0 or prior_weight < 0 or halflife <= 0:
            raise ValueError("DynamicSpeculation: prior_acceptance must lie in [0, 1], "
                             "prior_weight >= 0, halflife > 0")
        if probe_every < 0 or refresh_every < 0 or guard_samples < 0 or guard_retry < 1:
            raise ValueError(f"DynamicSpeculation: need probe_every >= 0, refresh_every >= 0, "
                             f"guard_samples >= 0 and guard_retry >= 1, got probe_every="
                             f"{probe_every}, refresh_every={refresh_every}, guard_samples="
                             f"{guard_samples}, guard_retry={guard_retry}")
        self.num_slots, self.k = num_slots, k
        self.bucket = bucket_of
        self.prior_weight, self.probe_every = prior_weight, probe_every
        self.refresh_every = refresh_every
        self.decay = 0.5 ** (1.0 / halflife)
        self.trials = np.zeros((num_slots, k))         # decayed per-slot, per-position counts
        self.succ = np.zeros((num_slots, k))
        self.pool_trials = np.full((k,), prior_weight)  # pooled counts, seeded with the prior
        self.pool_succ = np.full((k,), prior_weight * prior_acceptance)
        self.present = np.zeros((num_slots, k))       # decayed presence counts (see p_i)
        self.allowed = np.zeros((num_slots, k))
        self.pool_allowed = np.full((k,), prior_weight)   # pooled, seeded with presence 1.0
        self.pool_present = np.full((k,), prior_weight)
        self.step_seconds: dict[StepBucket, float] = {}  # bucket -> median of live steps, depth 0
        self._base_samples: dict[StepBucket, list[float]] = {}   # the last BASE_SAMPLES of each
        self._base_step: dict[StepBucket, int] = {}      # bucket -> step of its newest sample
        self._step = 0                                   # draft_limits calls with active slots
        self._refresh_left = 0                           # no-draft steps still to run
        self.seed_seconds: dict[StepBucket, float] = {}  # bucket -> idle-engine seconds (seeds)
        self.draft_seconds: dict[tuple[int, int], float] = {}   # (A, depth) -> median extra s
        self._draft_samples: dict[tuple[int, int], list[float]] = {}   # the last BASE_SAMPLES
        # (bucket, depth > 0) -> median of its last BASE_SAMPLES live steps, whole step times
        self.plan_seconds: dict[tuple[StepBucket, int], float] = {}
        self._plan_samples: dict[tuple[StepBucket, int], list[float]] = {}
        self._plan_step: dict[tuple[StepBucket, int], int] = {}   # step of its newest sample
        self._ratio_memo: dict[int, float] | None = None  # A -> live_ratio(A) within draft_limits
        self._price_memo: dict | None = None   # (bucket, depth) -> step_time within draft_limits
        self.zero_streak = np.zeros((num_slots,), np.int64)
        self.probe_gap = np.full((num_slots,), probe_every, np.int64)   # per-slot probe gap
        self._probe_pending = np.zeros((num_slots,), bool)   # probed, first draft not yet verified
        self._seen: set[StepBucket] = set()              # buckets run once (compiled)
        # guard on the realised rate, per number of active slots n
        self.guard_samples, self.guard_retry = guard_samples, guard_retry
        self.count_presence = count_presence
        self._n = 0                                      # active slots of the last plan
        self._planned = False      # the last step's plan proposed drafts (not only probes)
        self._judged = False       # this step verifies drafts the plan proposed, not held off
        self._window: list[tuple[float, float, int]] = []   # (tokens, seconds, slots committing)
        self._window_n = 0                               # the n of the window's steps
        self.guard_until: dict[int, int] = {}  # n -> first step drafting may resume at that n
        self.guard_gap: dict[int, int] = {}    # n -> hold after its next losing window
        self._bucket_ids: dict[StepBucket, int] = {}      # bucket -> id, for _bucket_table
        self._bucket_rows: dict[int, np.ndarray] = {}     # n -> bucket id per row count
        self.num_drafting_plans = 0     # counters (see the class docstring)
        self.num_holds = 0

    @property
    def num_plans(self) -> int:
        """:meth:`draft_limits` calls with an active slot so far."""
        return self._step

    # ------------------------------------------------------------------ estimates
    def acceptance(self) -> np.ndarray:
        """f64[B, K]: per-slot conditional acceptance ``a_i`` of draft position i = 1..K: the
        probability that draft i is accepted when it is allowed and draft i - 1 was accepted
        (with ``count_presence`` a draft allowed but never proposed counts as not accepted;
        without it only proposed drafts are trials)."""
        pool = self.pool_succ / np.maximum(self.pool_trials, 1e-9)
        w = self.prior_weight
        return (self.succ + w * pool[None]) / np.maximum(self.trials + w, 1e-9)

    def presence(self) -> np.ndarray:
        """f64[B, K]: per-slot probability ``p_i`` that draft position i = 1..K, allowed, is
        proposed when position i - 1 was (1.0 for the MTP head up to its M substeps; positions
        past M of a plain MTP engine are never proposed, and the estimate learns 0 there)."""
        pool = np.where(self.pool_allowed > 0,
                        self.pool_present / np.maximum(self.pool_allowed, 1e-300), 1.0)
        w, n = self.prior_weight, self.allowed + self.prior_weight
        return np.where(n > 0, (self.present + w * pool[None]) / np.maximum(n, 1e-300), pool[None])

    def expected_rows(self) -> np.ndarray:
        """f64[B, K]: expected verify rows of each slot's i-th allowed draft,
        ``prod_{j<=i} p_j``."""
        return np.cumprod(self.presence(), axis=1)

    def gains(self) -> np.ndarray:
        """f64[B, K]: expected extra tokens from each slot's i-th allowed draft,
        ``prod_{j<=i} a_j``."""
        return np.cumprod(self.acceptance(), axis=1)

    def live_ratio(self, num_slots: int) -> float:
        """Mean live/seed time ratio over the buckets of slot bucket ``num_slots`` that have both
        a seed and a live timing (over every slot bucket when that one has none; 1.0 when no
        bucket has both)."""
        memo = self._ratio_memo
        if memo is not None and num_slots in memo:
            return memo[num_slots]
        both = [b for b in self.step_seconds if b in self.seed_seconds]
        same = [b for b in both if b.num_slots == num_slots] or both
        ratio = float(np.mean([self.step_seconds[b] / self.seed_seconds[b] for b in same])
                      ) if same else 1.0
        if memo is not None:
            memo[num_slots] = ratio
        return ratio

    def _priced(self, key: StepBucket) -> float | None:
        if key in self.step_seconds:
            return self.step_seconds[key]
        if key in self.seed_seconds:
            return self.seed_seconds[key] * self.live_ratio(key.num_slots)
        return None

    def draft_time(self, num_slots: int, depth: int) -> float:
        """Estimated extra seconds of proposing at ``depth`` (the step's largest draft limit) in
        slot bucket ``num_slots`` (an A of :meth:`bucket`): measured, else that of the deepest
        measured depth below it, else 0 (optimistic: an untried depth is tried once); at most
        what any deeper measured depth costs (proposing deeper does more work); 0 for
        ``depth = 0``."""
        if depth <= 0:
            return 0.0
        measured = [d for a, d in self.draft_seconds if a == num_slots]
        below = [d for d in measured if d <= depth]
        own = self.draft_seconds[(num_slots, max(below))] if below else 0.0
        return min([own] + [self.draft_seconds[(num_slots, d)] for d in measured if d > depth])

    def step_time(self, rows: int, num_slots: int, depth: int = 0) -> float:
        """Estimated seconds of a decode step with ``rows`` rows over ``num_slots`` slots that
        proposes at ``depth``. ``base`` (depth 0): the live median of the bucket, else its seed
        scaled by :meth:`live_ratio`, else interpolated in T among priced buckets of the same A,
        or the nearest past them; 1.0 before anything of that A is priced (every bucket then
        costs the same). A depth ``d > 0``: the median of the last live steps of that bucket
        and depth while fresh (:attr:`plan_seconds`), else ``base + draft_time`` but no less
        than depth ``d - 1``'s price; either way at most the live price of any deeper depth of
        the bucket (proposing deeper does more work, and a rarely run depth's few timings can be
        high). So the price never falls with depth ``>= 1`` (a live drafting step may still
        come out below the bucket's ``base``: no clamp, ``base`` itself can be stale)."""
        key, depth = self.bucket(rows, num_slots), min(depth, self.k)
        memo = self._price_memo
        if memo is not None and (key, depth) in memo:
            return memo[(key, depth)]
        base = self._base_time(key)
        live = [None] + [self._live_time(key, d) for d in range(1, self.k + 1)]
        below = [np.inf] * (self.k + 2)        # below[d]: the least live price at depth >= d
        for d in range(self.k, 0, -1):
            below[d] = min(below[d + 1], np.inf if live[d] is None else live[d])
        price = base
        for d in range(1, depth + 1):
            own = live[d] if live[d] is not None else max(
                base + self.draft_time(key.num_slots, d), price)
            price = min(own, below[d + 1])
        if memo is not None:
            memo[(key, depth)] = float(price)
        return float(price)

    def _live_time(self, key: StepBucket, depth: int) -> float | None:
        """The pair's own live price (:attr:`plan_seconds`) while fresh, else None."""
        if (key, depth) in self.plan_seconds and (
                not self.refresh_every
                or self._step - self._plan_step[(key, depth)] <= self.refresh_every):
            return self.plan_seconds[(key, depth)]
        return None

    def _base_time(self, key: StepBucket) -> float:
        price = self._priced_or_interpolated(key)
        return 1.0 if price is None else price

    def _priced_or_interpolated(self, key: StepBucket) -> float | None:
        price = self._priced(key)
        if price is not None:
            return price
        known = sorted(b.num_tokens for b in set(self.step_seconds) | set(self.seed_seconds)
                       if b.num_slots == key.num_slots)
        if not known:
            return None
        t, sec = key.num_tokens, lambda t: self._priced(StepBucket(t, key.num_slots))
        lo = [b for b in known if b < t]
        hi = [b for b in known if b > t]
        if lo and hi:
            a, b = lo[-1], hi[0]
            f = (t - a) / (b - a)
            return (1 - f) * sec(a) + f * sec(b)
        return sec(lo[-1] if lo else hi[0])

    def seed_costs(self, seconds: dict[StepBucket, float]) -> None:
        """Seed the cost table with step times measured before serving
        (``LLMEngine.calibrate_speculation`` times every decode bucket on the idle engine), so
        the policy never spends live steps learning what a bucket costs. Seeds are kept apart
        from the live timings: a seeded bucket without live timings is priced at its seed times
        :meth:`live_ratio`. Seeded buckets count as compiled: their first live timing is kept.

        Raises:
          ValueError: a time that is not a positive finite number.
        """
        for bucket, sec in seconds.items():
            if not np.isfinite(sec) or sec <= 0:
                raise ValueError(f"seed_costs: seconds for {bucket} must be positive and finite, "
                                 f"got {sec}")
        for bucket, sec in seconds.items():
            self.seed_seconds[bucket] = float(sec)
            self._seen.add(bucket)

    # ------------------------------------------------------------------ decisions
    def draft_limits(self, active: np.ndarray) -> np.ndarray:
        """i32[B] drafts each slot may propose this step (0 for inactive slots).

        Args:
          active: bool[B] slots that propose in this step: decoding, or finishing their prefill
            in it (a slot still prefilling after this step proposes nothing).
        """
        active = np.asarray(active, bool)
        n = int(active.sum())
        limits = np.zeros((self.num_slots,), np.int32)
        if n == 0:
            self._judged = self._planned = False
            return limits
        self._step += 1
        self._n = n
        held = self._step < self.guard_until.get(n, 0)   # the guard holds drafting off
        self._judged, self._planned = self._planned and not held, False
        if held:
            return limits                                  # plain decoding
        self._ratio_memo, self._price_memo = {}, {}   # the tables do not change within one call
        try:
            limits = self._draft_limits(active, n, limits)
        finally:
            self._ratio_memo = self._price_memo = None
        self.num_drafting_plans += bool(limits.any())
        return limits

    def _bucket_table(self, n: int, rows: int) -> np.ndarray:
        """i32[>= rows + 1]: an id per row count at ``n`` slots, equal ids for equal buckets
        (:attr:`_bucket_ids`). Row counts ``0..n`` get -1: a decode step over ``n`` slots has more
        than ``n`` rows once it drafts, so the bucket function is never asked for them. Kept
        across calls (the bucket function is fixed) and grown on demand, so the first plan at a
        new ``n`` asks the bucket function once per row count, later ones not at all (about
        ``4 n (K + 1)`` bytes per ``n`` seen)."""
        table = self._bucket_rows.setdefault(n, np.full((n + 1,), -1, np.int32))
        if len(table) <= rows:
            ids = [self._bucket_ids.setdefault(self.bucket(r, n), len(self._bucket_ids))
                   for r in range(len(table), rows + 1)]
            table = self._bucket_rows[n] = np.concatenate([table, np.asarray(ids, np.int32)])
        return table

    def _best_plan(self, cand: Candidates, n: int, forced: Candidates | None = None
                   ) -> tuple[Candidates, float]:
        """The drafts maximising expected tokens per second of a step over ``n`` slots: the
        ``forced`` ones (probes' first drafts), then a selection of ``cand``. Candidates are
        ``(gain, position, slot, rows)`` arrays (``f64``, ``i64``, ``i64``, ``f64``; ``position``
        counts from 0; ``rows`` the expected verify rows, 1.0 for a draft that is always
        proposed) sorted by falling gain. For each depth cap ``d = 1..K`` every prefix of the
        candidates at positions ``< d`` (a prefix per slot, as gains fall with position) is
        priced by :meth:`step_time` at its depth and its expected rows ``n + r``; a fractional
        ``r`` is priced by linear interpolation between the row counts around it (exact for one
        slot allowed one draft: the step runs ``n`` or ``n + 1`` rows), and with one active slot
        by the exact expectation over its rows (:meth:`_one_slot_prices`). The best over all caps is
        kept, ``forced`` alone when no draft pays. Near-ties (rates within a factor ``1 +
        PLAN_RTOL`` of the best) keep the plan with the fewest drafts.

        As :meth:`step_time` never falls with depth, this finds the best plan over every choice
        of per-slot limits whose drafts have a positive gain when every draft is proposed
        (``rows`` all 1; why the caps: see "Choice" in the module docstring); with presence
        below 1 it searches the prefixes of the given ranking (:meth:`_plan` tries two).
        Returns the plan and its expected tokens per second. Vectorised over the prefixes:
        a price is looked up once per run of consecutive prefixes that share a (bucket, depth),
        and repeats of a pair in another cap's ranking hit the per-call memo, so a plan over 256
        slots costs a fraction of a millisecond of host time (``scripts/bench_policy.py``)."""
        none = np.zeros((0,), np.int64)
        fg, fpos, fslot, frows = forced if forced is not None else (
            np.zeros((0,)), none, none, np.zeros((0,)))
        tok0 = n + float(fg.sum())
        depth0 = int(fpos.max()) + 1 if len(fpos) else 0
        rows0 = float(frows.sum())                   # expected draft rows of the forced drafts
        lo0, f0 = (x.item() for x in _split_rows(np.array([rows0])))
        price0 = (1 - f0) * self.step_time(n + lo0, n, depth0) + (
            f0 * self.step_time(n + lo0 + 1, n, depth0) if f0 else 0.0)
        rate0 = tok0 / price0
        gain, pos, slot, w = (c[cand[0] > 0] for c in cand)   # a draft of no gain never pays
        if not len(gain):
            return (fg, fpos, fslot, frows), rate0
        # rows never exceed the drafts' count (presence <= 1): the table's largest row count
        table = self._bucket_table(n, n + len(fpos) + len(gain))
        # row c - 1 of each [K, m] array: the candidates a depth cap c keeps (pos < c); a prefix
        # of that ranking ends at each kept column
        keep = pos[None] < np.arange(1, self.k + 1)[:, None]
        count = np.cumsum(keep, axis=1)
        tok = tok0 + np.cumsum(np.where(keep, gain[None], 0.0), axis=1)
        rows = rows0 + np.cumsum(np.where(keep, w[None], 0.0), axis=1)
        depth = np.maximum(depth0, np.maximum.accumulate(np.where(keep, pos[None] + 1, 0), axis=1))
        cap = np.broadcast_to(np.arange(1, self.k + 1)[:, None], keep.shape)
        count, tok, rows, depth, cap = count[keep], tok[keep], rows[keep], depth[keep], cap[keep]
        lo, frac = _split_rows(rows)
        lo = n + lo                                   # rows n + r, r in [lo, lo + 1)
        if n == 1 and min(w.min(), frows.min(initial=1.0)) < 1 - ROWS_EPS:
            price = self._one_slot_prices(np.concatenate([frows, w]))[len(fpos) + count]
        else:
            price = self._run_prices(table, lo, depth, n)
            if frac.any():
                hi = np.where(frac > 0, lo + 1, lo)
                price = (1 - frac) * price + frac * self._run_prices(table, hi, depth, n)
        rate = tok / price
        best = max(rate0, float(rate.max()))
        if rate0 * (1 + PLAN_RTOL) >= best:
            return (fg, fpos, fslot, frows), rate0
        near = np.nonzero(rate * (1 + PLAN_RTOL) >= best)[0]
        pick = near[np.lexsort((-rate[near], count[near]))[0]]   # fewest drafts, then fastest
        sel = np.nonzero(pos < cap[pick])[0][:count[pick]]
        return (np.concatenate([fg, gain[sel]]), np.concatenate([fpos, pos[sel]]),
                np.concatenate([fslot, slot[sel]]), np.concatenate([frows, w[sel]])
                ), float(rate[pick])

    def _rankings(self, active: np.ndarray) -> list[Candidates]:
        """The candidates of the active slots ranked by falling gain (ties: position, slot) and,
        when some draft may not be proposed (presence below 1), also by falling gain per
        expected row (its running minimum over the slot's positions): a rarely proposed draft
        adds only a fraction of a row, so it may pay more than its gain ranks it. Both keys
        fall with position, so each ranking lists a slot's drafts in order."""
        slots = np.nonzero(active)[0]
        g, r = self.gains()[slots], self.expected_rows()[slots]      # f64[n, K]
        gain, rows = g.reshape(-1), r.reshape(-1)
        pos = np.tile(np.arange(self.k), len(slots))
        slot = np.repeat(slots, self.k)
        keys = [gain]
        if (rows < 1 - ROWS_EPS).any():
            per_row = np.divide(g, r, out=np.zeros_like(g), where=r > 0)
            # gain per row need not fall with position (a draft that comes after an accepted
            # one is likelier to come): its running minimum keeps each slot's drafts in order
            keys.append(np.minimum.accumulate(per_row, axis=1).reshape(-1))
        orders = [np.lexsort((slot, pos, -key)) for key in keys]
        return [(gain[o], pos[o], slot[o], rows[o]) for o in orders]

    def _plan(self, rankings: list[Candidates], n: int, probe: np.ndarray | None = None
              ) -> Candidates:
        """The best of :meth:`_best_plan` over ``rankings`` (near-ties: the fewest drafts), with
        the first drafts of the slots in ``probe`` (bool[B]) forced."""
        best = None
        for cand in rankings:
            forced = None
            if probe is not None:
                is_first = (cand[1] == 0) & probe[cand[2]]
                forced = tuple(c[is_first] for c in cand)
                cand = tuple(c[~is_first] for c in cand)
            plan, rate = self._best_plan(cand, n, forced=forced)
            if best is None or rate > best[1] * (1 + PLAN_RTOL) or (
                    rate * (1 + PLAN_RTOL) >= best[1] and len(plan[0]) < len(best[0][0])):
                best = plan, rate
        return best[0]

    def _one_slot_prices(self, rows: np.ndarray) -> np.ndarray:
        """f64[K + 1]: the expected price of one active slot allowed ``L = 0..K`` drafts, exact:
        ``rows`` are its drafts' presences ``e_i = P(R >= i)`` (any order; they fall with the
        position), so it verifies ``R = i`` drafts with ``P = e_i - e_{i+1}`` and proposes at
        depth ``L``. (Interpolating at the expected rows prices an n-gram slot's drafts, which
        come all or none, as if a part of them always came: at batch 1 that overpriced deep
        limits and the plan drafted shallower than it pays.) Entries past ``len(rows)`` are 0."""
        e = np.concatenate([[1.0], np.sort(rows)[::-1]])
        out = np.zeros((self.k + 1,))
        for limit in range(1, len(e)):
            prob = e[:limit + 1] - np.append(e[1:limit + 1], 0.0)
            out[limit] = sum(prob[i] * self.step_time(1 + i, 1, limit)
                             for i in range(limit + 1) if prob[i] > 0)
        return out

    def _run_prices(self, table: np.ndarray, rows: np.ndarray, depth: np.ndarray, n: int
                    ) -> np.ndarray:
        """f64[m]: :meth:`step_time` of each ``(rows[i], n, depth[i])``, looked up once per run of
        consecutive entries sharing a (bucket, depth) (``table``: :meth:`_bucket_table`)."""
        pair = table[rows].astype(np.int64) * (self.k + 1) + depth
        new_run = np.empty(pair.shape, bool)
        new_run[0], new_run[1:] = True, pair[1:] != pair[:-1]
        price = [self.step_time(int(rows[i]), n, int(depth[i])) for i in np.flatnonzero(new_run)]
        return np.asarray(price)[np.cumsum(new_run) - 1]

    def _draft_limits(self, active: np.ndarray, n: int, limits: np.ndarray) -> np.ndarray:
        rankings = self._rankings(active)
        _, plan_pos, plan_slot, _ = self._plan(rankings, n)
        self._planned = bool(len(plan_pos))
        if self._planned and self.refresh_every and not self._refresh_left:
            none = self.bucket(n, n)
            if (len(self._base_samples.get(none, ())) < BASE_SAMPLES
                    or self._step - self._base_step.get(none, 0) > self.refresh_every):
                self._refresh_left = 2
        if self._refresh_left:
            self._refresh_left -= 1
            self._planned = False
            return limits
        np.maximum.at(limits, plan_slot, (plan_pos + 1).astype(limits.dtype))
        if self.probe_every:
            probe = active & (limits == 0) & (self.zero_streak >= self.probe_gap)
            if probe.any():
                # The probes' first drafts are forced; the plan is chosen again around them.
                limits[:] = 0
                _, plan_pos, plan_slot, _ = self._plan(rankings, n, probe)
                np.maximum.at(limits, plan_slot, (plan_pos + 1).astype(limits.dtype))
            planned = (limits > 0) & ~probe            # the plan drafts for them unforced
            self._planned = bool(planned.any())        # (the re-plan may drop every draft)
            self.probe_gap[planned] = self.probe_every
            self._probe_pending[planned] = False
            self._probe_pending[probe] = True
            self.zero_streak = np.where(active & (limits == 0), self.zero_streak + 1, 0)
        return limits

    def observe(self, num_drafts: np.ndarray, num_accepted: np.ndarray,
                bucket: StepBucket, seconds: float, depth: int = 0, timed: bool = True,
                num_tokens: np.ndarray | None = None, num_allowed: np.ndarray | None = None
                ) -> None:
        """Record one step: per-slot drafts verified / accepted (``StepOutput.num_drafts`` /
        ``num_accepted``, i32[B]) and the budget each verified window was proposed under
        (``num_allowed``, i32[B], ``StepOutput.num_allowed``; None: every allowed draft was
        proposed, as with the MTP head), the :class:`StepBucket` the step ran in, its wall
        ``seconds`` and its proposing ``depth`` (the largest draft limit it was given; 0: it
        proposed nothing). A depth-0 step updates its bucket's base, a deeper one ``draft(A, depth)``
        (seconds above the bucket's base), each the median of its last :data:`BASE_SAMPLES`
        samples (while nothing of that slot bucket
        is priced yet, the whole time becomes the bucket's base). The first timing of each
        bucket is discarded (it includes the bucket's compilation). ``timed=False`` (the engine
        passes it for steps with a prefill chunk, whose token buckets can coincide with decode
        buckets) records acceptance only. ``num_tokens`` (i32[B], ``StepOutput.num_tokens``: the
        tokens each slot committed) feeds the guard on the realised rate when the step is judged
        (it verifies drafts the plan proposed in the step before, and it is timed: see the module
        docstring; None: the guard learns nothing from this step)."""
        if not self.count_presence:
            num_allowed = None
        nd = np.asarray(num_drafts, np.int64)[:, None]
        na = np.asarray(num_accepted, np.int64)[:, None]
        al = nd if num_allowed is None else np.maximum(np.asarray(num_allowed, np.int64)[:, None],
                                                       nd)
        i = np.arange(1, self.k + 1)[None]
        tried = (al >= i) & (na >= i - 1)     # acceptance trials: allowed, previous accepted
        ok = na >= i
        asked = (al >= i) & (nd >= i - 1)             # presence trials: allowed, previous present
        present = nd >= i
        d = self.decay
        self.trials = self.trials * d + tried
        self.succ = self.succ * d + (tried & ok)
        self.allowed = self.allowed * d + asked
        self.present = self.present * d + (asked & present)
        # Pooled estimates: decayed sums over every slot, seeded with the priors.
        self.pool_trials = self.pool_trials * d + tried.sum(0)
        self.pool_succ = self.pool_succ * d + (tried & ok).sum(0)
        self.pool_allowed = self.pool_allowed * d + asked.sum(0)
        self.pool_present = self.pool_present * d + (asked & present).sum(0)
        # A probe's window verified with a draft allowed: its first draft not accepted (rejected,
        # or never proposed) -> the slot's probe gap doubles.
        verified = self._probe_pending & (al[:, 0] >= 1)
        rejected = verified & (na[:, 0] == 0)
        self.probe_gap[rejected] = np.minimum(self.probe_gap[rejected] * 2,
                                              self.probe_every * MAX_PROBE_BACKOFF)
        self._probe_pending[verified] = False
        if bucket not in self._seen or not timed:   # a bucket's first step includes its compilation
            self._seen.add(bucket)
            return
        base = self._priced_or_interpolated(bucket)
        if depth > 0:
            self.plan_seconds[(bucket, int(depth))] = _push_median(
                self._plan_samples, (bucket, int(depth)), seconds)
            self._plan_step[(bucket, int(depth))] = self._step
        if depth > 0 and base is not None:
            key = (bucket.num_slots, int(depth))
            self.draft_seconds[key] = _push_median(self._draft_samples, key,
                                                   max(seconds - base, 0.0))
        else:
            self.step_seconds[bucket] = _push_median(self._base_samples, bucket, seconds)
            self._base_step[bucket] = self._step
        if num_tokens is not None and self._judged and self.guard_samples:
            self._judge(np.asarray(num_tokens), seconds)

    def _judge(self, num_tokens: np.ndarray, seconds: float) -> None:
        """Guard on the realised rate: add one judged step at the plan's ``n``; a full window is
        compared with plain decoding once and cleared (see the module docstring)."""
        n = self._n
        if n != self._window_n:
            self._window, self._window_n = [], n
        self._window.append((float(num_tokens.sum()), seconds, int(np.count_nonzero(num_tokens))))
        del self._window[:-self.guard_samples]         # (while the no-draft bucket is unpriced)
        off = self._priced_or_interpolated(self.bucket(n, n))
        if len(self._window) < self.guard_samples or off is None:
            return
        # the slowest step is left out: one slow step (a page-fault storm, another process)
        # must not trip the guard, as it cannot set a price (the base is a median)
        kept = sorted(self._window, key=lambda step: step[1])[:-1] or self._window
        tok, sec, committing = (sum(col) for col in zip(*kept))
        self._window = []
        gap = self.guard_gap.get(n, self.guard_retry)
        if tok / sec < committing / len(kept) / off:
            self.guard_until[n] = self._step + 1 + gap
            self.guard_gap[n] = min(gap * 2, self.guard_retry * MAX_PROBE_BACKOFF)
            self.num_holds += 1
            self._refresh_left = 0          # the hold runs the no-draft bucket anyway
        else:
            self.guard_gap[n] = self.guard_retry

    def reset_slot(self, slot: int) -> None:
        """A new request took ``slot``: forget its acceptance and presence (the pooled estimates
        remain)."""
        self.trials[slot] = 0.0
        self.succ[slot] = 0.0
        self.allowed[slot] = 0.0
        self.present[slot] = 0.0
        self.zero_streak[slot] = 0
        self.probe_gap[slot] = self.probe_every
        self._probe_pending[slot] = False


def _split_rows(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(i64[m], f64[m])``: expected row counts ``rows`` (f64[m], >= 0) split into whole rows
    and the fraction past them, an interpolation weight in ``[0, 1)``; a count within
    :data:`ROWS_EPS` of an integer is that integer (fraction 0)."""
    lo = np.floor(rows + ROWS_EPS).astype(np.int64)
    frac = np.maximum(rows - lo, 0.0)
    frac[frac <= ROWS_EPS] = 0.0
    return lo, frac


def _push_median(samples: dict, key, value: float) -> float:
    """Append ``value`` to ``samples[key]``, keep its last :data:`BASE_SAMPLES`, return their
    median."""
    recent = samples.setdefault(key, [])
    recent.append(float(value))
    del recent[:-BASE_SAMPLES]
    return float(np.median(recent))
