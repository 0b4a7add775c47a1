""":class:`DynamicSpeculation`: the per-slot draft-limit policy, composed of its four parts
(acceptance estimates, cost table, planner, guard on the realised rate)."""
from __future__ import annotations

import numpy as np

from jmtp.runtime.device.buckets import StepBucket
from jmtp.runtime.host.spec_policy.costs import BucketOf, CostTable
from jmtp.runtime.host.spec_policy.estimates import AcceptanceEstimates
from jmtp.runtime.host.spec_policy.guard import RateGuard
from jmtp.runtime.host.spec_policy.planner import DraftPlanner


def _part(part: str, name: str) -> property:
    """The attribute ``name`` of the part ``part``, read and written through."""
    return property(lambda self: getattr(getattr(self, part), name),
                    lambda self, value: setattr(getattr(self, part), name, value),
                    doc=f"``self.{part}.{name}``.")


class DynamicSpeculation:
    """Per-slot draft limits that maximise expected tokens per second.

    The host calls :meth:`draft_limits` before each engine step (the limits cap the drafts
    proposed in that step, i.e. verified in the next one) and :meth:`observe` after it. The limits
    are an ``i32[B]`` data input of the jitted step, so they never recompile. The model and the
    reasons for each rule: ``docs/architecture.md``, "The dynamic speculation policy".

    Args:
      num_slots: B.
      k: K, the largest draft count.
      bucket_of: the :class:`StepBucket` a decode step with ``rows`` rows over ``n`` slots runs in
        (the engine passes ``choose_bucket(ec, rows, n, has_prefill=False)``).
      prior_acceptance: initial pooled per-position acceptance ``a_i`` (before any measurement).
      prior_weight: pseudo-trials of the pooled estimate in each slot's estimate.
      halflife: steps after which a count has half its weight.
      probe_every: a slot at 0 drafts this many steps in a row gets a probe draft (0 = never
        probe); the gap doubles after each rejected probe.
      refresh_every: while drafting, re-time the no-draft bucket when its newest live timing is
        older than this many steps; a (bucket, depth) pair's own live price expires as old
        (0 = never).
      guard_samples: judged steps per window whose realised tokens per second are compared with
        plain decoding's (0 = no guard).
      guard_retry: steps drafting is held off after a first losing window (doubles after each
        further losing window, up to ``guard_retry * MAX_PROBE_BACKOFF``).
      count_presence: estimate each position's presence from ``observe``'s ``num_allowed`` and
        count an allowed draft that never came as a failed trial of its acceptance (the A/Bs
        behind the default are in ``docs/measurements.md``); off, ``num_allowed`` is ignored,
        every presence is 1 and only proposed drafts are trials. No effect on an MTP engine
        with ``K <= M`` (it proposes every allowed draft).

    Raises:
      ValueError: ``num_slots < 1``, ``k < 1``, or a parameter outside its range.

    Attributes:
      estimates: :class:`~jmtp.runtime.host.spec_policy.estimates.AcceptanceEstimates` (``trials``,
        ``succ``, ``allowed``, ``present``, ``pool_*``, ``prior_weight``, ``decay``,
        ``count_presence``: read and written through this object too).
      costs: :class:`~jmtp.runtime.host.spec_policy.costs.CostTable` (``bucket``, ``step_seconds``,
        ``seed_seconds``, ``draft_seconds``, ``plan_seconds``, ``refresh_every``).
      planner: :class:`~jmtp.runtime.host.spec_policy.planner.DraftPlanner` (``probe_every``,
        ``probe_gap``, ``zero_streak``).
      guard: :class:`~jmtp.runtime.host.spec_policy.guard.RateGuard` (``guard_samples``,
        ``guard_retry``, ``guard_until``, ``guard_gap``, ``num_holds``).

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
        self.estimates = AcceptanceEstimates(num_slots, k, prior_acceptance, prior_weight,
                                             halflife, count_presence)
        self.costs = CostTable(k, bucket_of, refresh_every)
        self.planner = DraftPlanner(num_slots, k, probe_every, self.estimates, self.costs)
        self.guard = RateGuard(guard_samples, guard_retry)
        self.num_plans = 0              # draft_limits calls with active slots (the plan clock)
        self.num_drafting_plans = 0     # counters (see the class docstring)

    # The parts' attributes, read and written through (tests and benchmarks set them).
    prior_weight = _part("estimates", "prior_weight")
    decay = _part("estimates", "decay")
    count_presence = _part("estimates", "count_presence")
    trials = _part("estimates", "trials")
    succ = _part("estimates", "succ")
    allowed = _part("estimates", "allowed")
    present = _part("estimates", "present")
    pool_trials = _part("estimates", "pool_trials")
    pool_succ = _part("estimates", "pool_succ")
    pool_allowed = _part("estimates", "pool_allowed")
    pool_present = _part("estimates", "pool_present")
    bucket = _part("costs", "bucket")
    refresh_every = _part("costs", "refresh_every")
    step_seconds = _part("costs", "step_seconds")
    seed_seconds = _part("costs", "seed_seconds")
    draft_seconds = _part("costs", "draft_seconds")
    plan_seconds = _part("costs", "plan_seconds")
    probe_every = _part("planner", "probe_every")
    probe_gap = _part("planner", "probe_gap")
    zero_streak = _part("planner", "zero_streak")
    guard_samples = _part("guard", "guard_samples")
    guard_retry = _part("guard", "guard_retry")
    guard_until = _part("guard", "guard_until")
    guard_gap = _part("guard", "guard_gap")
    num_holds = _part("guard", "num_holds")

    # ------------------------------------------------------------------ estimates and prices
    def acceptance(self) -> np.ndarray:
        """f64[B, K]: per-slot conditional acceptance ``a_i`` (see ``estimates``)."""
        return self.estimates.acceptance()

    def presence(self) -> np.ndarray:
        """f64[B, K]: per-slot presence ``p_i`` (see ``estimates``)."""
        return self.estimates.presence()

    def expected_rows(self) -> np.ndarray:
        """f64[B, K]: expected verify rows of each slot's i-th allowed draft."""
        return self.estimates.expected_rows()

    def gains(self) -> np.ndarray:
        """f64[B, K]: expected extra tokens from each slot's i-th allowed draft."""
        return self.estimates.gains()

    def live_ratio(self, num_slots: int) -> float:
        """Mean live/seed time ratio of slot bucket ``num_slots`` (see ``costs``)."""
        return self.costs.prices(self.num_plans).live_ratio(num_slots)

    def draft_time(self, num_slots: int, depth: int) -> float:
        """Estimated extra seconds of proposing at ``depth`` in slot bucket ``num_slots``."""
        return self.costs.prices(self.num_plans).draft_time(num_slots, depth)

    def step_time(self, rows: int, num_slots: int, depth: int = 0) -> float:
        """Estimated seconds of a decode step with ``rows`` rows over ``num_slots`` slots that
        proposes at ``depth`` (:meth:`~jmtp.runtime.host.spec_policy.costs.Prices.step_time`)."""
        return self.costs.prices(self.num_plans).step_time(rows, num_slots, depth)

    def seed_costs(self, seconds: dict[StepBucket, float]) -> None:
        """Seed the cost table with step times measured before serving
        (``LLMEngine.calibrate_speculation`` times every decode bucket on the idle engine), so
        the policy never spends live steps learning what a bucket costs. Seeds are kept apart
        from the live timings: a seeded bucket without live timings is priced at its seed times
        :meth:`live_ratio`. Seeded buckets count as compiled: their first live timing is kept.

        Raises:
          ValueError: a time that is not a positive finite number.
        """
        self.costs.seed(seconds)

    # ------------------------------------------------------------------ decisions
    def draft_limits(self, active: np.ndarray, caps: np.ndarray | None = None, *,
                     num_slots: int | None = None, base: tuple[float, float] = (0.0, 0.0)
                     ) -> np.ndarray:
        """i32[B] drafts each slot may propose this step (0 for inactive slots).

        Args:
          active: bool[B] slots that propose in this step: decoding, or finishing their prefill
            in it (a slot still prefilling after this step proposes nothing).
          caps: i32[B] or None: each slot's own cap (``SamplingParams.num_speculative_tokens``;
            None: K for every slot); the plan never exceeds it and never probes a slot capped
            at 0.
          num_slots: slots the step runs, ``active`` among them (None: those in ``active``);
            the MTP hybrid with suffix decoding plans its MTP drafts for the slots not
            following a suffix match, in a step over all of them.
          base: ``(tokens, rows)`` the step gets beyond one per slot from other drafts (the
            hybrid's suffix drafts: their expected accepted tokens and their rows);
            :meth:`DraftPlanner.limits`.
        """
        active = np.asarray(active, bool)
        if not active.any():
            self.guard.idle()
            return np.zeros((self.num_slots,), np.int32)
        n = int(active.sum()) if num_slots is None else num_slots
        self.num_plans += 1
        if self.guard.begin(self.num_plans, n):
            return np.zeros((self.num_slots,), np.int32)       # held off: plain decoding
        # One memoised price view for the whole plan: the tables do not change while it is chosen.
        limits, self.guard.planned = self.planner.limits(active, n, self.costs.prices(self.num_plans),
                                                         caps, base)
        if caps is not None:
            limits = np.minimum(limits, caps).astype(np.int32)
        self.num_drafting_plans += bool(limits.any())
        return limits

    def plan_rate(self, active: np.ndarray, caps: np.ndarray | None = None, *,
                  num_slots: int | None = None, base: tuple[float, float] = (0.0, 0.0)) -> float:
        """Expected tokens per second (a float) of the best plan :meth:`draft_limits` would
        weigh for the same arguments (``active`` bool[B], ``caps`` i32[B] or None, ``num_slots``
        and ``base = (tokens, rows)`` as there; a step of at least one slot), without probes,
        the no-draft refresh, the guard or any other change of state. The MTP hybrid compares
        plans with it (:meth:`SuffixDecoding.plan_mtp
        <jmtp.runtime.host.suffix_decoding.SuffixDecoding.plan_mtp>`)."""
        active = np.asarray(active, bool)
        n = int(active.sum()) if num_slots is None else num_slots
        prices = self.costs.prices(self.num_plans + 1)    # the view the next plan will use
        _, rate = self.planner.plan(self.planner.rankings(active, caps), max(n, 1), prices,
                                    base=base)
        return rate

    def probe_due(self, active: np.ndarray, caps: np.ndarray | None = None) -> np.ndarray:
        """bool[B]: the ``active`` slots whose probe is due in the next plan
        (:meth:`DraftPlanner.probe_due`)."""
        return self.planner.probe_due(active, caps)

    def plan_context(self) -> tuple[bool, int, int]:
        """What :meth:`observe` needs of the last plan when it comes after later plans
        (asynchronous scheduling plans step N+1 before it observes step N): ``(judged, n,
        clock)``; pass it back as ``observe(..., plan=...)``."""
        return self.guard.judged, self.guard._n, self.num_plans

    def observe(self, num_drafts: np.ndarray, num_accepted: np.ndarray,
                bucket: StepBucket, seconds: float, depth: int = 0, timed: bool = True,
                num_tokens: np.ndarray | None = None, num_allowed: np.ndarray | None = None,
                plan: tuple[bool, int, int] | None = None) -> None:
        """Record one step: per-slot drafts verified / accepted (``StepOutput.num_drafts`` /
        ``num_accepted``, i32[B]) and the budget each verified window was proposed under
        (``num_allowed``, i32[B], ``StepOutput.num_allowed``; None: every allowed draft was
        proposed, as with the MTP head), the :class:`StepBucket` the step ran in, its wall
        ``seconds`` and its proposing ``depth`` (the largest draft limit it was given; 0: it
        proposed nothing). A depth-0 step updates its bucket's base, a deeper one
        ``draft(A, depth)`` (seconds above the bucket's base) and the pair's own price, each the
        median of its last ``BASE_SAMPLES`` samples (while nothing of that slot bucket is priced
        yet, the whole time becomes the bucket's base). The first timing of each bucket is
        discarded (it includes the bucket's compilation). ``timed=False`` (the engine passes it
        for steps with a prefill chunk, whose token buckets can coincide with decode buckets)
        records acceptance only. ``num_tokens`` (i32[B], ``StepOutput.num_tokens``: the tokens
        each slot committed) feeds the guard on the realised rate when the step is judged (it
        verifies drafts the plan proposed in the step before, and it is timed; None: the guard
        learns nothing from this step). ``plan``: the step's :meth:`plan_context` when later
        plans came first (asynchronous scheduling); default: the last plan is this step's."""
        allowed, accepted = self.estimates.update(num_drafts, num_accepted, num_allowed)
        self.planner.probe_verified(allowed, accepted)
        clock = self.num_plans if plan is None else plan[2]
        if not self.costs.record(bucket, seconds, depth, timed, clock):
            return
        if self.guard.observe(num_tokens, seconds, clock, self.costs.prices(clock),
                              None if plan is None else plan[:2]):
            self.planner.refresh_left = 0      # the hold runs the no-draft bucket anyway

    def reset_slot(self, slot: int) -> None:
        """A new request took ``slot``: forget its acceptance and presence (the pooled estimates
        remain) and start its probing afresh."""
        self.estimates.reset_slot(slot)
        self.planner.reset_slot(slot)
