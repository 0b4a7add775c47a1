"""The dynamic speculation policy on synthetic acceptance and cost sequences (hand-worked)."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jmtp.runtime.config import EngineConfig, SpeculativeConfig
from jmtp.runtime.device.buckets import StepBucket, choose_bucket
from jmtp.runtime.host.spec_policy import PLAN_RTOL, DynamicSpeculation
from tests.engines import GROUPS, SHAPES
from tests.runtime.conftest import engine_of

pytestmark = pytest.mark.compile_lazy   # about buckets: each step in its own (conftest.py)


def rows_only(buckets):
    """A ``bucket_of`` whose cost depends on rows only: the smallest of ``buckets`` holding the
    rows (the largest beyond), every slot count sharing slot bucket 0."""
    ts = sorted(buckets)
    return lambda rows, n: StepBucket(next((t for t in ts if t >= rows), ts[-1]), 0)


def by_rows(seconds: dict) -> dict:
    """Step costs keyed by token rows only (as :func:`rows_only` keys them)."""
    return {StepBucket(t, 0): v for t, v in seconds.items()}


def policy(num_slots, k, buckets, **kw):
    kw.setdefault("probe_every", 0)
    kw.setdefault("refresh_every", 0)
    return DynamicSpeculation(num_slots, k, rows_only(buckets), **kw)


def feed(p, num_drafts, num_accepted, steps, rows=1, seconds=1.0):
    for _ in range(steps):
        p.observe(np.asarray(num_drafts), np.asarray(num_accepted), p.bucket(rows, 0), seconds)


def test_conditional_acceptance_counts():
    # One slot, K=3, no prior, no decay to speak of: 4 steps with accepted 3, 1, 0, 2 of 3 drafts.
    p = policy(1, 3, [4], prior_weight=0.0, halflife=1e9)
    for a in (3, 1, 0, 2):
        p.observe(np.array([3]), np.array([a]), p.bucket(4, 1), 1.0)
    # position 1: tried 4, accepted 3; position 2: tried 3 (those with a >= 1), accepted 2;
    # position 3: tried 2 (a >= 2), accepted 1.
    np.testing.assert_allclose(p.acceptance()[0], [3 / 4, 2 / 3, 1 / 2])
    np.testing.assert_allclose(p.gains()[0], [3 / 4, 1 / 2, 1 / 4])


def test_presence_counts_allowed_positions_that_stayed_empty():
    """One slot, K=3, no prior: four windows each allowed 3 drafts held 3, 0, 2 and 1 (an n-gram
    match of that length, or none), with 2, 0, 2 and 0 accepted. Presence: position 1 asked in
    all 4 windows, present in 3; position 2 asked where position 1 was present (3), present in 2;
    position 3 asked in 2, present in 1. Acceptance counts allowed drafts after an accepted one:
    position 1 tried 4, accepted 2; position 2 tried 2 (windows 1 and 3), accepted 2; position 3
    tried 2, accepted 0. Gains 1/2, 1/2, 0: the tokens the windows gained at each position per
    window, 2 / 4 at position 2 (windows 1 and 3 accepted a second draft) where the product of
    presence and acceptance over present drafts, 3/4 * 2/3 * 2/3 * 1, would say 1/3. Expected
    rows 3/4 + 1/2 + 1/4 = 1.5 = the drafts the windows held, 6 / 4."""
    p = policy(1, 3, [4], prior_weight=0.0, halflife=1e9)
    for nd, na in ((3, 2), (0, 0), (2, 2), (1, 0)):
        p.observe(np.array([nd]), np.array([na]), p.bucket(4, 1), 1.0, num_allowed=np.array([3]))
    np.testing.assert_allclose(p.presence()[0], [3 / 4, 2 / 3, 1 / 2])
    np.testing.assert_allclose(p.acceptance()[0], [1 / 2, 1, 0])
    np.testing.assert_allclose(p.expected_rows()[0], [3 / 4, 1 / 2, 1 / 4])
    np.testing.assert_allclose(p.gains()[0], [1 / 2, 1 / 2, 0])
    assert p.count_presence                # the default
    # count_presence=False: num_allowed is ignored, every presence is 1, and only proposed drafts
    # are trials of acceptance
    off = DynamicSpeculation(1, 3, rows_only([4]), prior_weight=0.0, halflife=1e9,
                             count_presence=False)
    for nd, na in ((3, 2), (0, 0), (2, 2), (1, 0)):
        off.observe(np.array([nd]), np.array([na]), off.bucket(4, 1), 1.0,
                    num_allowed=np.array([3]))
    np.testing.assert_allclose(off.presence()[0], [1, 1, 1])
    np.testing.assert_allclose(off.gains()[0], [2 / 3, 2 / 3, 0])
    # windows allowed fewer than K ask nothing past their budget; without num_allowed (the MTP
    # head fills its budget) every verified draft was present
    q = policy(1, 3, [4], prior_weight=0.0, halflife=1e9)
    q.observe(np.array([1]), np.array([1]), q.bucket(4, 1), 1.0, num_allowed=np.array([1]))
    q.observe(np.array([2]), np.array([1]), q.bucket(4, 1), 1.0)
    np.testing.assert_allclose(q.allowed[0], [2, 1, 0])
    np.testing.assert_allclose(q.presence()[0], [1, 1, 1])
    np.testing.assert_allclose(q.acceptance()[0, :2], [1, 0])


def test_rarely_proposed_drafts_do_not_pay_at_batch_8_but_may_at_batch_1():
    """n-gram slots whose drafts are proposed in 2 windows of 10 and accepted 9 times in 10 when
    they are (gain 0.18). Batch 8, 8 rows 1.0 s and 9-16 rows 1.3 s: x first drafts are expected
    to add 0.2 x rows, priced (1 - 0.2 x) * 1.0 + 0.2 x * 1.3 below 5 drafts, for 8 + 0.18 x
    tokens: (8 + 0.18) / 1.06 = 7.72 tok/s for one, below 8 / 1.0, and every larger plan lower
    still: no drafts (counting only the drafts that exist, gain 0.9, all 8 would draft: 15.2 / 1.3
    = 11.7 tok/s). Batch 1 with 1 row 1.0 s and 2 rows 1.26 s: a draft present in 3 windows of 10
    and accepted in 8 of 10 adds 0.24 tokens for an expected 1.078 s, (1.24) / 1.078 = 1.15 tok/s,
    so it drafts, where pricing a whole row (1.24 / 1.26 = 0.98) would not."""
    p = policy(8, 1, [8, 16], prior_weight=0.0, halflife=1e9)
    p.trials[:], p.succ[:] = 10.0, 1.8            # 10 allowed, 2 proposed, 1.8 accepted
    p.allowed[:], p.present[:] = 10.0, 2.0
    p.step_seconds = by_rows({8: 1.0, 16: 1.3})
    p.draft_seconds = {(0, 1): 0.0}
    np.testing.assert_allclose(p.gains(), 0.18)
    assert p.draft_limits(np.ones((8,), bool)).tolist() == [0] * 8
    p.allowed[:] = p.present[:] = 10.0            # every allowed draft proposed: drafting pays
    p.succ[:] = 9.0
    assert p.draft_limits(np.ones((8,), bool)).tolist() == [1] * 8
    one = policy(1, 1, [1, 2], prior_weight=0.0, halflife=1e9)
    one.trials[:], one.succ[:] = 10.0, 2.4        # 10 allowed, 3 proposed, 2.4 accepted
    one.allowed[:], one.present[:] = 10.0, 3.0
    one.step_seconds = by_rows({1: 1.0, 2: 1.26})
    one.draft_seconds = {(0, 1): 0.0}
    assert one.draft_limits(np.ones((1,), bool)).tolist() == [1]
    one.present[:], one.succ[:] = 1.0, 0.8   # gain 0.08: 1.08 / 1.026 = 1.053 tok/s still pays
    assert one.draft_limits(np.ones((1,), bool)).tolist() == [1]
    one.step_seconds = by_rows({1: 1.0, 2: 2.0})    # 1.08 / 1.1 = 0.98: no longer
    assert one.draft_limits(np.ones((1,), bool)).tolist() == [0]


def test_one_slot_is_priced_by_the_exact_expectation_over_its_rows():
    """One slot, K=3, drafts always accepted, proposed all or none: the first in 4 windows of 10,
    then always (p = 0.4, 1, 1; gains 0.4 each, expected rows 0.4 each). 1 / 2 / 3-4 rows cost
    1.0 / 2.3 / 2.4 s. Allowing 3 drafts verifies 0 (p 0.6) or 3 (p 0.4) of them: 2.2 tokens in
    0.6 * 1.0 + 0.4 * 2.4 = 1.56 s, 1.41 tok/s, the best (1: 1.4 / 1.52 = 0.92, 2: 1.8 / 1.56 =
    1.15, none: 1.0). Interpolating at the expected 2.2 rows would price it 0.8 * 2.3 + 0.2 * 2.4
    = 2.32 s (0.95 tok/s) and draft nothing."""
    p = policy(1, 3, [1, 2, 4], prior_weight=0.0, halflife=1e9)
    p.trials[:], p.succ[:] = [[10.0, 4.0, 4.0]], 4.0   # joint: accepted 4 of 10 allowed, then all
    p.allowed[:], p.present[:] = [[10.0, 4.0, 4.0]], 4.0
    p.step_seconds = by_rows({1: 1.0, 2: 2.3, 4: 2.4})
    p.draft_seconds = {(0, d): 0.0 for d in (1, 2, 3)}
    np.testing.assert_allclose(p.expected_rows(), [[0.4, 0.4, 0.4]])
    np.testing.assert_allclose(p.planner.one_slot_prices(np.array([0.4, 0.4, 0.4]),
                                                         p.costs.prices(p.num_plans)),
                               [0.0, 1.52, 1.56, 1.56])
    assert p.draft_limits(np.ones((1,), bool)).tolist() == [3]


def test_high_acceptance_and_cheap_rows_draft_k():
    p = policy(2, 3, [2, 4, 8])
    feed(p, [3, 3], [3, 3], 50, rows=8, seconds=0.10)
    feed(p, [3, 3], [3, 3], 2, rows=2, seconds=0.10)   # 2 rows cost the same as 8
    np.testing.assert_array_equal(p.draft_limits(np.array([True, True])), [3, 3])
    # inactive slots never draft
    np.testing.assert_array_equal(p.draft_limits(np.array([False, True])), [0, 3])


def test_zero_acceptance_drafts_nothing():
    p = policy(2, 3, [2, 4, 8])
    feed(p, [3, 3], [0, 0], 300, rows=8, seconds=0.20)
    feed(p, [0, 0], [0, 0], 2, rows=2, seconds=0.10)
    np.testing.assert_array_equal(p.draft_limits(np.array([True, True])), [0, 0])


def test_hand_worked_optimum_one_slot():
    # a_i = 1/2: gains 1/2, 1/4, 1/8. Step time 1.0 + 0.1 per row beyond the first.
    # tokens/s for 0..3 drafts: 1/1.0, 1.5/1.1 = 1.364, 1.75/1.2 = 1.458, 1.875/1.3 = 1.442 -> 2.
    p = policy(1, 3, [1, 2, 3, 4], prior_weight=0.0, halflife=1e9)
    p.trials[0] = [8, 4, 2]
    p.succ[0] = [4, 2, 1]
    p.step_seconds = by_rows({1: 1.0, 2: 1.1, 3: 1.2, 4: 1.3})
    assert p.draft_limits(np.array([True]))[0] == 2
    # rows get twice as expensive: 1/1, 1.5/1.2 = 1.25, 1.75/1.4 = 1.25, 1.875/1.6 -> 1 draft
    p.step_seconds = by_rows({1: 1.0, 2: 1.2, 3: 1.4, 4: 1.6})
    assert p.draft_limits(np.array([True]))[0] == 1


def test_hand_worked_optimum_over_a_base_of_other_drafts():
    """The MTP hybrid plans slot 0's drafts in a step over 2 slots (slot 1 follows a suffix
    match): a_i = 1/2 (gains 1/2, 1/4, 1/8), step time 1.0 s at 2 rows + 0.1 s per row.
    Alone (no base): 2/1.0, 2.5/1.1 = 2.27, 2.75/1.2 = 2.29, 2.875/1.3 = 2.21 -> 2 drafts. Over
    slot 1's 4 suffix rows worth 3 tokens: 5/1.4 = 3.57, 5.5/1.5 = 3.67, 5.75/1.6 = 3.59,
    5.875/1.7 = 3.46 -> 1 draft."""
    p = policy(2, 3, list(range(2, 10)), prior_weight=0.0, halflife=1e9)
    p.trials[0] = [8, 4, 2]
    p.succ[0] = [4, 2, 1]
    p.step_seconds = by_rows({t: 1.0 + 0.1 * (t - 2) for t in range(2, 10)})
    active = np.array([True, False])
    np.testing.assert_array_equal(p.draft_limits(active, num_slots=2), [2, 0])
    np.testing.assert_array_equal(p.draft_limits(active, num_slots=2, base=(3.0, 4.0)), [1, 0])


def test_depth_caps_fill_the_bucket_with_first_drafts():
    """Slot 0 accepts 9 in 10 drafts (gains 0.9, 0.81), slot 1 3 in 10 (gains 0.3, 0.09). Rows 2 /
    4 / 6 cost 1.0 / 1.2 / 1.4 s; proposing at depth 2 costs 0.5 s more than at depth 1. Ranked in
    one list (0.9, 0.81, 0.3, 0.09), the prefixes give 2 / 1.0 = 2.0, 2.9 / 1.2 = 2.42, 3.71 / 1.7
    = 2.18, 4.01 / 1.9 = 2.11 and 4.1 / 1.9 = 2.16 tok/s: slot 1's first draft comes only after
    slot 0's second. With the depth capped at 1, both first drafts share the 4-row bucket: 3.2 /
    1.2 = 2.67 tok/s, the best plan."""
    p = policy(2, 2, [2, 4, 6], prior_weight=0.0, halflife=1e9)
    p.trials[:] = [[10, 9], [10, 3]]
    p.succ[:] = [[9, 8.1], [3, 0.9]]
    p.step_seconds = by_rows({2: 1.0, 4: 1.2, 6: 1.4})
    p.draft_seconds = {(0, 1): 0.0, (0, 2): 0.5}
    np.testing.assert_allclose(p.gains(), [[0.9, 0.81], [0.3, 0.09]])
    assert p.draft_limits(np.array([True, True])).tolist() == [1, 1]
    # depth 2 free: [2, 0] gives 3.71 / 1.2 = 3.09 tok/s, more than [1, 1] (2.67), [2, 1] (4.01 /
    # 1.4 = 2.86) and [2, 2] (4.1 / 1.4 = 2.93)
    p.draft_seconds = {(0, 1): 0.0, (0, 2): 0.0}
    assert p.draft_limits(np.array([True, True])).tolist() == [2, 0]


def assert_plan_is_optimal(p: DynamicSpeculation, n: int, k: int, got: np.ndarray | None = None,
                           probe: np.ndarray | None = None) -> None:
    """The limits ``got`` (default: ``p.draft_limits`` over ``n`` active slots) reach the best
    expected tokens per second over every limit vector in ``{0..K}^n`` whose drafts have a
    positive gain, priced by the policy's own ``step_time``, up to the policy's tie margin
    ``PLAN_RTOL`` (plus float rounding). Slots in ``probe`` must get at least one draft, whatever
    its gain (a probe's forced first draft)."""
    g, r = p.gains(), p.expected_rows()
    probe = np.zeros((n,), bool) if probe is None else probe

    def rate(lim):
        tok = n + sum(g[b, :lim[b]].sum() for b in range(n))
        depth = max(lim)
        if n == 1:      # one slot: the exact expectation over the R drafts that come
            reach = [1.0] + list(r[0, :lim[0]]) + [0.0]          # P(R >= i)
            return tok / sum((reach[i] - reach[i + 1]) * p.step_time(1 + i, 1, depth)
                             for i in range(lim[0] + 1))
        rows = n + sum(r[b, :lim[b]].sum() for b in range(n))   # expected rows, interpolated
        lo = int(np.floor(rows + 1e-9))
        f = rows - lo if rows - lo > 1e-9 else 0.0
        price = (1 - f) * p.step_time(lo, n, depth) + (
            f * p.step_time(lo + 1, n, depth) if f else 0.0)
        return tok / price

    # a zero-gain draft is never planned: it could pay only by reaching a cheaper bucket, i.e.
    # with prices falling as rows grow, which the random live prices here allow
    best = max(rate(lim) for lim in itertools.product(range(k + 1), repeat=n)
               if all(lim[b] >= probe[b] and (lim[b] <= probe[b] or g[b, lim[b] - 1] > 0)
                      for b in range(n)))
    got = p.draft_limits(np.ones((n,), bool)) if got is None else got
    assert (got[probe] >= 1).all(), got.tolist()
    assert rate(got) * (1 + PLAN_RTOL) >= best * (1 - 1e-12), (got.tolist(), rate(got), best)


def random_policy(n: int, k: int, data) -> DynamicSpeculation:
    """A policy over ``n`` slots with random per-slot acceptances, row costs increasing with the
    bucket, random draft costs per depth and random live prices of some (bucket, depth) pairs."""
    p = policy(n, k, [1, 2, 3, 4, 6, 8, 12, 16], prior_weight=0.0, halflife=1e9)
    acc = st.floats(0.0, 1.0, allow_nan=False)
    p.trials[:] = 10.0
    p.succ[:] = np.array(data.draw(st.lists(st.lists(acc, min_size=k, max_size=k),
                                            min_size=n, max_size=n))) * 10.0
    steps = data.draw(st.lists(st.floats(0.0, 1.0), min_size=8, max_size=8))
    p.step_seconds = by_rows(dict(zip([1, 2, 3, 4, 6, 8, 12, 16], 1.0 + np.cumsum(steps))))
    extra = data.draw(st.lists(st.floats(0.0, 1.0), min_size=k, max_size=k))
    p.draft_seconds = {(0, d + 1): float(extra[d]) for d in range(k)}
    for t in data.draw(st.lists(st.sampled_from([1, 2, 3, 4, 6, 8, 12, 16]), max_size=4)):
        d = data.draw(st.integers(1, k))
        p.plan_seconds[(p.bucket(t, n), d)] = data.draw(st.floats(0.5, 4.0))
        p.costs.plan_step[(p.bucket(t, n), d)] = 0
    return p


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(1, 3), k=st.integers(1, 3), data=st.data())
def test_plan_is_the_brute_force_optimum(n, k, data):
    """On a random policy (:func:`random_policy`) ``step_time`` never falls with depth, and the
    chosen limits are optimal (:func:`assert_plan_is_optimal`)."""
    p = random_policy(n, k, data)
    for t in (1, 2, 3, 4, 6, 8, 12, 16):    # the price of proposing never falls with depth
        prices = [p.step_time(t, n, d) for d in range(1, k + 1)]
        assert prices == sorted(prices), (t, prices)
    assert_plan_is_optimal(p, n, k)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(1, 3), k=st.integers(1, 3), data=st.data())
def test_plan_around_forced_probes_is_the_brute_force_optimum(n, k, data):
    """The re-plan around probes: with the first drafts of some slots forced,
    ``DraftPlanner.best_plan`` keeps them and is optimal over the limit vectors that give each
    forced slot a draft."""
    p = random_policy(n, k, data)
    probe = np.array(data.draw(st.lists(st.booleans(), min_size=n, max_size=n)))
    g = p.gains()
    # candidates by falling gain (ties: position, slot), forced = the probes' first drafts
    cand = sorted((-g[b, i], i, b) for b in range(n) for i in range(k))
    first = [c for c in cand if c[1] == 0 and probe[c[2]]]
    rest = [c for c in cand if not (c[1] == 0 and probe[c[2]])]

    def arrays(cs):
        return (np.array([-c[0] for c in cs], float), np.array([c[1] for c in cs], np.int64),
                np.array([c[2] for c in cs], np.int64), np.ones((len(cs),)))

    (_, pos, slot, _), _ = p.planner.best_plan(arrays(rest), n, p.costs.prices(p.num_plans),
                                               forced=arrays(first))
    got = np.zeros((n,), int)
    np.maximum.at(got, slot, pos + 1)
    assert_plan_is_optimal(p, n, k, got=got, probe=probe)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(1, 4), data=st.data())
def test_plan_with_proposals_that_may_not_come_is_the_brute_force_optimum(n, data):
    """K=1 with a presence ``p`` shared by every slot (an n-gram proposer matching in a fraction
    of the steps): x drafts add ``p x`` expected rows, priced between the row counts around it;
    the plan is optimal over every limit vector (:func:`assert_plan_is_optimal` prices the same
    way)."""
    p = random_policy(n, 1, data)
    p.allowed[:] = 10.0
    p.present[:] = 10.0 * data.draw(st.floats(0.05, 1.0))
    assert_plan_is_optimal(p, n, 1)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(k=st.integers(1, 3), data=st.data())
def test_one_slot_plan_with_random_presence_is_the_brute_force_optimum(k, data):
    """Batch 1, a random presence per position: the plan (priced by the exact expectation over
    the slot's rows) is optimal over every limit."""
    p = random_policy(1, k, data)
    p.allowed[:] = 10.0
    p.present[:] = 10.0 * np.array(data.draw(st.lists(st.floats(0.05, 1.0), min_size=k,
                                                      max_size=k)))
    assert_plan_is_optimal(p, 1, k)


def test_a_rarely_proposed_draft_is_ranked_by_its_gain_per_row_too():
    """Two slots, K=1. Slot 0's draft is always proposed and accepted half the time (gain 0.5, one
    row); slot 1's is proposed in 1 step of 5 and then always accepted (gain 0.2, 0.2 rows). 2 / 3
    / 4 rows cost 1.0 / 1.4 / 1.45 s. No draft: 2 / 1.0 = 2.0 tok/s; slot 0's: 2.5 / 1.4 = 1.79;
    both: 2.7 / (0.8 * 1.4 + 0.2 * 1.45) = 1.91; slot 1's alone: 2.2 / (0.8 * 1.0 + 0.2 * 1.4) =
    2.04, the best, which no prefix of the gain ranking (slot 0 first) contains."""
    p = policy(2, 1, [2, 3, 4], prior_weight=0.0, halflife=1e9)
    p.trials[:], p.succ[:] = 10.0, [[5.0], [2.0]]
    p.allowed[:], p.present[:] = 10.0, [[10.0], [2.0]]
    p.step_seconds = by_rows({2: 1.0, 3: 1.4, 4: 1.45})
    p.draft_seconds = {(0, 1): 0.0}
    np.testing.assert_allclose(p.gains(), [[0.5], [0.2]])
    assert p.draft_limits(np.ones((2,), bool)).tolist() == [0, 1]
    assert_plan_is_optimal(p, 2, 1)


@settings(max_examples=100, deadline=None)
@given(n=st.integers(1, 4), k=st.integers(2, 4), data=st.data())
def test_each_ranking_lists_a_slots_drafts_in_order(n, k, data):
    """With joint acceptance a draft's gain per expected row may rise with position (an n-gram
    draft after an accepted one is likelier to come than after any proposed one: ``a_2 = 0.9``
    with ``p_2 = 0.5``). Each ranking must still list a slot's drafts position by position, so
    that a plan's prefix is a limit per slot; every draft appears once."""
    p = policy(n, k, [1, 16], prior_weight=0.0, halflife=1e9)
    frac = st.lists(st.floats(0.05, 1.0), min_size=n * k, max_size=n * k)
    p.trials[:], p.allowed[:] = 10.0, 10.0
    p.succ[:] = 10.0 * np.array(data.draw(frac)).reshape(n, k)
    p.present[:] = 10.0 * np.array(data.draw(st.lists(st.floats(0.05, 0.95), min_size=n * k,
                                                      max_size=n * k))).reshape(n, k)
    rankings = p.planner.rankings(np.ones((n,), bool))
    assert len(rankings) == 2
    for gain, pos, slot, rows in rankings:
        assert sorted(zip(slot.tolist(), pos.tolist())) == [(b, i) for b in range(n)
                                                            for i in range(k)]
        for b in range(n):
            assert pos[slot == b].tolist() == list(range(k)), (b, pos[slot == b])
        np.testing.assert_allclose(gain, p.gains()[slot, pos])
        np.testing.assert_allclose(rows, p.expected_rows()[slot, pos])
    # the first ranks by gain, the second by each slot's running minimum of gain per row
    ratio = np.minimum.accumulate(p.gains() / p.expected_rows(), axis=1)
    for (gain, pos, slot, _), key in zip(rankings, (p.gains(), ratio)):
        assert (np.diff(key[slot, pos]) <= 1e-12).all(), key[slot, pos]


def test_a_near_tie_may_keep_the_plan_without_drafts():
    """A draw that once failed CI (the brute-force check compared with a margin tighter than the
    policy's): one slot accepting 1e-9 of its drafts, one row and two rows both priced
    1.5 s. A draft adds 1e-9 expected tokens, within ``PLAN_RTOL``: either plan is optimal."""
    p = policy(1, 1, [1, 2, 3, 4, 6, 8, 12, 16], prior_weight=0.0, halflife=1e9)
    p.trials[:] = 10.0
    p.succ[:] = 1e-8
    p.step_seconds = by_rows(dict(zip([1, 2, 3, 4, 6, 8, 12, 16], 1.0 + np.cumsum(
        [0.5, 0, 0, 0, 0, 0, 0, 0]))))
    p.draft_seconds = {(0, 1): 0.0}
    assert_plan_is_optimal(p, 1, 1)
    # a gain above the margin is taken
    p.succ[:] = 1e-6
    assert p.draft_limits(np.ones((1,), bool)).tolist() == [1]


def test_bucket_table_matches_the_bucket_function_across_slot_counts():
    """The plan's cached row -> bucket table (kept across calls, one per number of active slots)
    gives each row count the bucket the bucket function gives, whatever order the slot counts
    and row counts come in."""
    calls = []

    def bucket_of(rows, n):
        return StepBucket(1 << max(rows - 1, 0).bit_length(), n)

    def counted(rows, n):
        calls.append((rows, n))
        return bucket_of(rows, n)

    p = DynamicSpeculation(8, 3, counted)
    for n, rows in [(3, 5), (8, 20), (3, 12), (1, 4), (8, 32), (3, 2)]:
        table = p.costs.bucket_table(n, rows)
        ids = {v: k for k, v in p.costs.bucket_ids.items()}
        assert len(table) >= rows + 1 and (table[:n + 1] == -1).all()
        for r in range(n + 1, len(table)):
            assert ids[int(table[r])] == bucket_of(r, n), (n, r)
    # never asked for rows <= n (no drafting step has them), each other (rows, n) once
    assert all(r > slots for r, slots in calls)
    assert len(calls) == len(set(calls)) == sum(len(p.costs.bucket_rows[m]) - m - 1
                                               for m in (1, 3, 8))


def test_a_depth_is_never_priced_above_a_deeper_one():
    # 4 rows: depth 1 timed live at 1.8 s (a few slow steps), depth 2 at 1.1 s, depth 3 never
    # (estimated: base 1.0 + draft 0.1, depth 2's draft). Depth 1 is priced 1.1 s, depth 2's live
    # price.
    p = policy(2, 3, [2, 4, 8])
    key = p.bucket(4, 2)
    p.step_seconds = by_rows({2: 1.0, 4: 1.0, 8: 2.0})
    p.plan_seconds = {(key, 1): 1.8, (key, 2): 1.1}
    p.costs.plan_step = {(key, 1): 0, (key, 2): 0}
    p.draft_seconds = {(0, 1): 0.5, (0, 2): 0.1}
    assert p.step_time(4, 2, 1) == pytest.approx(1.1)
    assert p.step_time(4, 2, 2) == pytest.approx(1.1)
    assert p.step_time(4, 2, 3) == pytest.approx(1.1)
    assert p.step_time(4, 2, 0) == pytest.approx(1.0)
    # only live prices of deeper depths cap a live price: with depth 2 at 1.5 s live, the
    # estimate of depth 3 (1.1 s) moves neither depth 2 (1.5) nor depth 1 (1.5, not 1.1)
    p.plan_seconds[(key, 2)] = 1.5
    assert p.step_time(4, 2, 2) == pytest.approx(1.5)
    assert p.step_time(4, 2, 1) == pytest.approx(1.5)
    # without live pairs: base + draft, depth 1's draft (0.5 s) capped by depth 2's (0.1 s);
    # depth 3 unmeasured takes depth 2's
    p.plan_seconds = {}
    assert p.draft_time(0, 1) == pytest.approx(0.1) and p.draft_time(0, 3) == pytest.approx(0.1)
    assert p.step_time(8, 2, 1) == pytest.approx(2.1)
    # with the caps, both slots' first drafts (gain 0.5 each) now pay at depth 1:
    # (2 + 1) / 1.1 = 2.73 tok/s against 2 / 1.0 without drafts
    p.plan_seconds = {(key, 1): 1.8, (key, 2): 1.1}
    p.trials[:], p.succ[:], p.prior_weight = 10.0, [[5, 0, 0], [5, 0, 0]], 0.0
    assert p.draft_limits(np.array([True, True])).tolist() == [1, 1]


def test_batch_load_makes_rows_expensive():
    # Same acceptance (1/2 per position) for 8 slots. Batch 1: a row costs 10 % of a 1-row step
    # -> drafts pay. Batch 8: the step is compute bound, every row costs the same 0.1 s:
    # 8 / 0.8 = 10 tok/s plain; one draft each: 12 / 1.6 = 7.5 -> no drafts.
    buckets = list(range(1, 33))
    p = policy(8, 3, buckets, prior_weight=0.0, halflife=1e9)
    p.trials[:] = [8, 4, 2]
    p.succ[:] = [4, 2, 1]
    p.step_seconds = by_rows({t: 1.0 + 0.1 * (t - 1) for t in buckets})
    one = np.zeros(8, bool)
    one[3] = True
    assert p.draft_limits(one)[3] == 2
    p.step_seconds = by_rows({t: 0.1 * t for t in buckets})
    np.testing.assert_array_equal(p.draft_limits(np.ones(8, bool)), np.zeros(8))
    # In between (0.4 s fixed + 0.04 s per row): plain 8 / 0.72 = 11.1 tok/s; one draft per slot
    # (gain 1/2 each) 12 / 1.04 = 11.5; second drafts (gain 1/4) 14 / 1.36 = 10.3 (and every
    # partial count in between is worse than 11.5) -> exactly one draft per slot.
    p.step_seconds = by_rows({t: 0.4 + 0.04 * t for t in buckets})
    np.testing.assert_array_equal(p.draft_limits(np.ones(8, bool)), np.ones(8))


def test_cost_learning_and_interpolation():
    p = policy(1, 3, [1, 4, 8, 16])
    assert p.step_time(3, 1) == 1.0                     # nothing measured: all equal
    one_row = p.bucket(1, 1)
    p.observe(np.array([0]), np.array([0]), one_row, 9.0)   # first step of a bucket: compilation
    assert p.step_seconds == {}
    p.observe(np.array([0]), np.array([0]), one_row, 0.10)
    p.observe(np.array([0]), np.array([0]), one_row, 0.20)
    assert p.step_seconds[StepBucket(1, 0)] == pytest.approx(0.15)   # median of 0.10, 0.20
    p.observe(np.array([0]), np.array([0]), one_row, 0.90)           # one slow step: no effect
    assert p.step_seconds[StepBucket(1, 0)] == pytest.approx(0.20)
    for seconds in (0.11, 0.12):                                     # only the last 3 count
        p.observe(np.array([0]), np.array([0]), one_row, seconds)
    assert p.step_seconds[StepBucket(1, 0)] == pytest.approx(0.12)
    p.step_seconds = by_rows({1: 0.1, 16: 0.4})
    assert p.step_time(3, 1) == pytest.approx(0.1 + (4 - 1) / 15 * 0.3)   # bucket 4, interpolated
    assert p.bucket(9, 1) == StepBucket(16, 0) and p.bucket(100, 1) == StepBucket(16, 0)
    p.step_seconds = by_rows({1: 0.1})
    assert p.step_time(8, 1) == 0.1                     # past the measured: optimistic


def _probe_run(p, steps, accept):
    """Drive one slot for ``steps`` steps; each step verifies the previous step's drafts, of which
    ``accept(drafts)`` are accepted (acceptance only: ``timed=False``). Returns the limits."""
    got, prev = [], 0
    for _ in range(steps):
        limit = int(p.draft_limits(np.array([True]))[0])
        p.observe(np.array([prev]), np.array([accept(prev)]), StepBucket(1, 0), 1.0, timed=False)
        got.append(limit)
        prev = limit
    return got


def test_probe_after_a_zero_streak_with_backoff():
    """A slot whose drafts never pay probes after 3 zero steps; each rejected probe doubles the
    gap (6, 12, 24 = 8 x probe_every, then it stays); a slot the plan drafts for again resets
    its gap to probe_every."""
    p = policy(1, 2, [1, 2, 3], probe_every=3, prior_weight=0.0, halflife=1e9)
    p.trials[0] = [10, 0]
    p.step_seconds = by_rows({1: 1.0, 2: 2.0, 3: 3.0})
    got = _probe_run(p, 100, accept=lambda drafts: 0)
    assert set(got) == {0, 1}
    # probe at 3; then each probe follows 6, 12, 24, 24 zero steps
    assert [i for i, g in enumerate(got) if g] == [3, 10, 23, 48, 73, 98]
    assert p.probe_gap[0] == 24
    # the slot's drafts start to pay: the plan drafts for it and its gap is back at 3
    p.succ[0], p.trials[0] = [10, 10], [10, 10]
    p.step_seconds = by_rows({1: 1.0, 2: 1.2, 3: 1.4})
    assert p.draft_limits(np.array([True]))[0] > 0
    assert p.probe_gap[0] == 3


def test_probe_whose_budget_was_capped_or_whose_draft_was_accepted_keeps_its_gap():
    """The gap doubles only when the probe's window was allowed a draft and its first draft was
    not accepted: a probe whose budget the ``max_tokens`` cap took (allowed 0, nothing verified)
    or whose draft was accepted leaves it; a probe allowed a draft the n-gram matcher left empty
    (allowed 1, nothing verified) doubles it like a rejected one."""
    for accept in ("capped", 1, "no match"):
        p = policy(1, 2, [1, 2, 3], probe_every=3, prior_weight=0.0, halflife=1e9)
        p.trials[0] = [1e6, 0]          # acceptance ~0 at position 1 even after a success
        p.step_seconds = by_rows({1: 1.0, 2: 2.0, 3: 3.0})
        if isinstance(accept, str):     # the probe's draft never materialises: 0 verified
            got = []
            for _ in range(12):
                got.append(int(p.draft_limits(np.array([True]))[0]))
                allowed = min(got[-2], 1) if len(got) > 1 and accept == "no match" else 0
                p.observe(np.array([0]), np.array([0]), StepBucket(1, 0), 1.0, timed=False,
                          num_allowed=np.array([allowed]))
        else:
            got = _probe_run(p, 12, accept=lambda drafts: min(drafts, 1))
        if accept == "no match":   # the empty probe at 3, verified at 4: gap 6, probe at 10
            assert [i for i, g in enumerate(got) if g] == [3, 10] and p.probe_gap[0] == 12
        else:
            assert [i for i, g in enumerate(got) if g] == [3, 7, 11] and p.probe_gap[0] == 3


def test_reset_slot_resets_probing():
    p = policy(2, 1, [2], probe_every=3)
    p.probe_gap[0], p.zero_streak[0], p.planner.probe_pending[0] = 24, 5, True
    p.reset_slot(0)
    assert p.probe_gap[0] == 3 and p.zero_streak[0] == 0 and not p.planner.probe_pending[0]


def test_drafts_that_pay_in_a_probe_widened_bucket_ride_along():
    """Two slots, K=1, acceptance pinned at 1/2, 2 rows cost 10 ms and 3-4 rows 16 ms.
    Without a probe: none 2 / 10 ms = 200 tok/s, one draft 2.5 / 16 = 156, two 3 / 16 = 188 ->
    none. Slot 0's probe forces the 16 ms bucket; there slot 1's draft is worth taking
    (187.5 > 156), so it rides along: [1, 1], not [1, 0]. The rider's gap resets (the plan
    drafted for it unforced); the probed slot's gap waits for its verification."""
    p = policy(2, 1, [2, 4], probe_every=4, prior_acceptance=0.5, prior_weight=1e6)
    p.step_seconds = by_rows({2: 0.010, 4: 0.016})
    both = np.array([True, True])
    assert p.draft_limits(both).tolist() == [0, 0]
    p.zero_streak[:], p.probe_gap[:] = [4, 1], [4, 32]
    assert p.draft_limits(both).tolist() == [1, 1]
    assert p.probe_gap.tolist() == [4, 4] and p.zero_streak.tolist() == [0, 0]
    p.observe(np.array([1, 1]), np.array([0, 0]), StepBucket(4, 0), 1.0, timed=False)
    assert p.probe_gap.tolist() == [8, 4]           # only the probe's rejection doubles a gap
    # Riders only fill what pays: three slots, 3 rows 10 ms, 4 rows 16 ms, 5-6 rows 40 ms.
    # Slot 0's probe: 3.5 / 16 ms = 219 tok/s; one rider needs the 40 ms bucket: 4 / 40 = 100,
    # two riders 4.5 / 40 = 112 -> no riders.
    p = policy(3, 1, [3, 4, 6], probe_every=4, prior_acceptance=0.5, prior_weight=1e6)
    p.step_seconds = by_rows({3: 0.010, 4: 0.016, 6: 0.040})
    p.zero_streak[:] = [4, 0, 0]
    assert p.draft_limits(np.ones(3, bool)).tolist() == [1, 0, 0]


def test_a_probe_can_displace_a_draft_that_no_longer_pays():
    """The re-plan around a probe is the best plan that holds it, which may drop another slot's
    draft. Two slots, K=1, acceptance 0.1 (slot 0) and 0.9 (slot 1); 2 / 3 / 4 rows cost
    10 / 11 / 30 ms. Without a probe: none 200 tok/s, slot 1 drafting 2.9 / 11 = 264, both
    3.0 / 30 = 100 -> [0, 1]. Slot 0 probing: alone 2.1 / 11 = 191, with slot 1 100 -> [1, 0]."""
    p = policy(2, 1, [2, 3, 4], probe_every=4, prior_weight=0.0, halflife=1e9)
    p.trials[:], p.succ[:] = [[10], [10]], [[1], [9]]
    p.step_seconds = by_rows({2: 0.010, 3: 0.011, 4: 0.030})
    both = np.array([True, True])
    assert p.draft_limits(both).tolist() == [0, 1]
    p.zero_streak[0] = 4
    assert p.draft_limits(both).tolist() == [1, 0]


def test_a_probing_slot_gets_the_drafts_that_pay_with_its_proposing_priced():
    """One slot, K=2, gains 1/2 and 1/4; 1-3 rows cost 10 ms and proposing (depth 1 or 2) 8 ms.
    Without a probe: none 100 tok/s, one draft 1.5 / 18 ms = 83, two 1.75 / 18 = 97 -> none.
    Probing, the first draft is forced and its proposing paid, so the second one pays: [2] (a
    plan that forgot the forced draft's depth would price one draft at 1.5 / 10 ms and stop at
    [1])."""
    p = policy(1, 2, [1, 2, 3], probe_every=2, prior_acceptance=0.5, prior_weight=1e6)
    p.step_seconds = by_rows({1: 0.010, 2: 0.010, 3: 0.010})
    p.draft_seconds = {(0, 1): 0.008, (0, 2): 0.008}
    assert p.draft_limits(np.array([True])).tolist() == [0]
    p.zero_streak[0] = 2
    assert p.draft_limits(np.array([True])).tolist() == [2]


def test_reset_slot_falls_back_to_the_pool():
    p = policy(2, 1, [2], prior_weight=2.0, prior_acceptance=0.5, halflife=1e9)
    feed(p, [1, 1], [1, 0], 10, rows=2)
    # pooled: (2*0.5 + 10) / (2 + 20) = 0.5; slot 0: (10 + 2*0.5)/(10 + 2) = 11/12
    assert p.acceptance()[0, 0] == pytest.approx(11 / 12)
    p.reset_slot(0)
    assert p.acceptance()[0, 0] == pytest.approx(0.5)


def test_bad_arguments():
    with pytest.raises(ValueError, match="k >= 1"):
        policy(2, 0, [4])
    with pytest.raises(ValueError, match="prior_acceptance"):
        policy(2, 2, [4], prior_acceptance=1.5)
    with pytest.raises(ValueError, match="guard_retry=0"):
        policy(2, 2, [4], guard_retry=0)
    with pytest.raises(ValueError, match="guard_samples=-1"):
        policy(2, 2, [4], guard_samples=-1)


def test_costs_keyed_by_step_bucket():
    """With the engine's buckets, a step's cost belongs to its (T, A): prefill steps and steps over
    other slot counts never price a decode step (they used to share a key by T alone)."""
    ec = EngineConfig(max_num_seqs=8, max_model_len=64, block_size=4, num_blocks=32,
                      max_num_batched_tokens=32, spec=SpeculativeConfig("mtp", 3))
    p = DynamicSpeculation(8, 3, lambda rows, n: choose_bucket(ec, rows, n, False),
                           prior_weight=0.0, halflife=1e9, probe_every=0, refresh_every=0)
    assert p.bucket(3, 1) == StepBucket(4, 1)
    prefill = choose_bucket(ec, 4, 8, True)             # a 4-row prefill chunk over all 8 slots
    assert prefill.num_slots == 8
    for seconds in (9.0, 5.0):                          # (the first timing is compilation)
        p.observe(np.zeros(8), np.zeros(8), prefill, seconds, timed=False)
    assert p.step_time(4, 1) == 1.0                     # nothing measured at A=1: all equal
    for bucket, seconds in ((StepBucket(1, 1), 0.10), (StepBucket(4, 1), 0.16)):
        p.observe(np.zeros(8), np.zeros(8), bucket, 9.0)
        p.observe(np.zeros(8), np.zeros(8), bucket, seconds)
    assert p.step_time(1, 1) == 0.10 and p.step_time(4, 1) == 0.16
    assert p.step_time(2, 1) == pytest.approx(0.12)    # T=2 interpolated between 1 and 4 at A=1
    # One active slot with a_i = 1/2: 0..3 drafts give 1/0.10 = 10, 1.5/0.12 = 12.5,
    # 1.75/0.16 = 10.9, 1.875/0.16 = 11.7 tok/s -> 1 draft (the prefill step's 5 s plays no part).
    p.trials[:] = [8, 4, 2]
    p.succ[:] = [4, 2, 1]
    one = np.zeros(8, bool)
    one[0] = True
    assert p.draft_limits(one)[0] == 1


def test_seed_costs_prices_buckets_before_any_step():
    """Seeded costs are used as measured ones: with 2 rows costing 3x one row and acceptance 0.5,
    one draft would give 1.5 tokens for 3x the time, so the policy drafts nothing on its very
    first step (unseeded, every bucket costs the same and it drafts K)."""
    p = policy(1, 1, [1, 2], prior_acceptance=0.5)
    assert p.draft_limits(np.array([True])).tolist() == [1]
    p.seed_costs(by_rows({1: 0.01, 2: 0.03}))
    assert p.draft_limits(np.array([True])).tolist() == [0]
    p.observe(np.array([0]), np.array([0]), StepBucket(1, 0), 0.02)   # seeded: first timing kept
    assert p.step_seconds == {StepBucket(1, 0): 0.02}
    assert p.seed_seconds == by_rows({1: 0.01, 2: 0.03})
    with pytest.raises(ValueError, match="positive"):
        p.seed_costs(by_rows({1: 0.02, 2: 0.0}))
    assert p.seed_seconds == by_rows({1: 0.01, 2: 0.03})                 # nothing half-seeded


def test_seeded_buckets_scale_by_the_live_to_seed_ratio():
    """Idle seeds understate live steps (no keys to read, no drafts to verify): a seeded bucket
    without live timings is priced at seed x the mean live/seed ratio of the same slot bucket's
    live buckets (the seeds give the relative cost, live steps the level). Hand-worked with a
    pinned acceptance of 1/2 (gains 1/2, 1/4, 1/8) and seeds 10 / 12 / 15.5 ms for 1 / 2 / 4
    rows."""
    p = policy(1, 3, [1, 2, 4], prior_acceptance=0.5, prior_weight=1e6)
    p.seed_costs({StepBucket(1, 0): 0.010, StepBucket(2, 0): 0.012, StepBucket(4, 0): 0.0155,
                  StepBucket(1, 1): 0.5})
    # Seeds alone: 0 drafts 1 tok / 10 ms = 100 tok/s; 1 draft 1.5 / 12 ms = 125; 3 drafts
    # 1.875 / 15.5 ms = 121 -> 1 draft.
    assert p.step_time(2, 0) == pytest.approx(0.012)
    assert p.draft_limits(np.array([True])).tolist() == [1]
    # Live: 1 row 30 ms (3x its seed), 2 rows 48 ms (4x): ratio 3.5 prices 4 rows at 54.25 ms.
    p.observe(np.array([0]), np.array([0]), StepBucket(1, 0), 0.030)
    p.observe(np.array([1]), np.array([0]), StepBucket(2, 0), 0.048)
    assert p.live_ratio(0) == pytest.approx(3.5)
    assert p.live_ratio(1) == pytest.approx(3.5)              # no live step at A=1: every A
    assert p.step_time(1, 0) == pytest.approx(0.030)          # live timings win over seeds
    assert p.step_time(2, 0) == pytest.approx(0.048)
    assert p.step_time(4, 0) == pytest.approx(0.0155 * 3.5)   # seeded only: scaled
    # 0 drafts 33.3 tok/s; 1: 1.5 / 48 ms = 31.3; 2: 1.75 / 54.25 = 32.3; 3: 1.875 / 54.25 ms =
    # 34.6 -> 3 drafts.
    assert p.draft_limits(np.array([True])).tolist() == [3]
    p.observe(np.array([0]), np.array([0]), StepBucket(4, 0), 0.2)   # 4 rows live: 200 ms
    assert p.draft_limits(np.array([True])).tolist() == [0]


@GROUPS["mtp2"]   # the policy is host code: its step programs are the canonical mtp2 shape's
def test_engine_calibration_times_every_decode_bucket_and_idle_steps_change_nothing():
    """``LLMEngine.calibrate_speculation`` runs every decode bucket on the idle engine: the
    policy's cost table then holds exactly those buckets, the engine state and both KV caches are
    bit-identical afterwards (the idle step is a no-op), and the engine still decodes greedily
    like the non-paged reference."""
    import jax

    from jmtp import LLMEngine
    from jmtp.runtime.device.buckets import decode_buckets, slot_buckets
    from jmtp.runtime.host.llm import SamplingParams
    from tests.runtime.conftest import reference_greedy, tiny_model

    cfg, params = tiny_model(0)
    spec = SpeculativeConfig("mtp", num_speculative_tokens=2, speculation_policy="dynamic")
    # tests/engines.py's mtp2 (K = M = 2, 2 slots) under the dynamic policy
    eng = LLMEngine(model_config=cfg, params=params,
                    **{**SHAPES["mtp2"], "speculative_config": spec}, compile="lazy")
    assert eng.spec_policy.step_seconds == {}                 # lazy: not calibrated yet
    before = jax.device_get((eng.runner.state, eng.runner.cache, eng.runner.mtp_cache))
    seconds = eng.calibrate_speculation(repeats=1)
    ec = eng.engine_config
    expected = {StepBucket(t, a) for a in slot_buckets(ec) for t in decode_buckets(ec, a)}
    assert set(seconds) == expected == {StepBucket(t, a) for a, t in
                                        [(1, 1), (1, 2), (1, 3), (2, 2), (2, 4), (2, 6)]}
    assert eng.spec_policy.seed_seconds == seconds and eng.spec_policy.step_seconds == {}
    after = jax.device_get((eng.runner.state, eng.runner.cache, eng.runner.mtp_cache))
    for x, y in zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True):
        np.testing.assert_array_equal(x, y)
    prompt = [5, 9, 2, 7]
    eng.add_request("a", prompt, SamplingParams(max_tokens=8, ignore_eos=True))
    with pytest.raises(RuntimeError, match="idle"):
        eng.calibrate_speculation()
    out = None
    while eng.has_unfinished_requests():
        for o in eng.step():
            out = o
    assert out.outputs[0].token_ids == reference_greedy(cfg, params, prompt, 8, stop_ids=())


def test_engine_asks_for_limits_of_proposing_slots_only_and_mtp_fills_them():
    """The engine passes the policy the slots that propose in the step: decoding ones and the one
    whose (chunked) prefill ends in it, not one still prefilling after it. An MTP slot proposes
    its limit, also in the step that ends its prefill (far from ``max_tokens``)."""
    from jmtp import LLMEngine
    from jmtp.runtime.host.llm import SamplingParams
    from tests.runtime.conftest import reference_greedy, tiny_model

    cfg, params = tiny_model(0)
    spec = SpeculativeConfig("mtp", num_speculative_tokens=2, speculation_policy="dynamic")
    # (the synchronous loop: each step's windows are read back before the next is planned)
    eng = LLMEngine(model_config=cfg, params=params, speculative_config=spec, max_num_seqs=2,
                    max_model_len=64, block_size=4, max_num_batched_tokens=6, compile="lazy",
                    async_scheduling=False)
    pol = eng.spec_policy
    pol.pool_trials[:], pol.pool_succ[:] = 1e6, 1e6          # acceptance ~1: always draft 2
    pol.refresh_every = 0                                      # (no no-draft timing steps)
    seen, real = [], pol.draft_limits
    pol.draft_limits = lambda active: seen.append((np.asarray(active).copy(), real(active))) or seen[-1][1]
    committed, observe = [], pol.observe
    pol.observe = lambda *a, **kw: committed.append(kw["num_tokens"].copy()) or observe(*a, **kw)
    prompt = list(range(3, 17))                                # 14 tokens: chunks 6, 6, 2
    eng.add_request("a", prompt, SamplingParams(max_tokens=12, ignore_eos=True))
    out, drafts = None, []
    while eng.has_unfinished_requests():
        for o in eng.step():
            out = o
        drafts.append(int(engine_of(eng).scheduler.next_drafts[0]))
    assert [bool(a[0]) for a, _ in seen[:4]] == [False, False, True, True]
    assert [int(l[0]) for _, l in seen[:4]] == [0, 0, 2, 2]
    assert drafts[2:4] == [2, 2]                 # the prefill-ending step proposed its limit
    assert out.outputs[0].token_ids == reference_greedy(cfg, params, prompt, 12, stop_ids=())
    # the guard on the realised rate is fed each step's committed tokens: 12 in all, slot 0 only
    assert sum(int(c[0]) for c in committed) == 12 and sum(int(c[1]) for c in committed) == 0
    # get_stats reports the policy's counters, here counted from the calls themselves
    stats = eng.get_stats()
    assert stats["spec_policy_plans"] == sum(bool(a.any()) for a, _ in seen)
    assert stats["spec_policy_drafting_plans"] == sum(bool(lim.any()) for _, lim in seen) > 0
    assert stats["spec_policy_holds"] == 0      # fewer judged steps than one guard window
    assert len(seen) < pol.guard_samples
    assert 0 < stats["spec_policy_host_seconds"] < 60


def test_drafting_depth_is_priced_on_top_of_the_bucket():
    """A step's cost is base(bucket) + draft(A, depth): proposing (MTP substeps, draft LM heads,
    the n-gram matcher) is skipped when no slot drafts, so a step with drafts costs more than its
    bucket's no-draft time. Hand-worked, acceptance pinned at 1/2 (gains 1/2, 1/4), seeds 10 /
    11 / 12 ms for 1 / 2 / 4 rows."""
    p = policy(1, 2, [1, 2, 4], prior_acceptance=0.5, prior_weight=1e6)
    p.seed_costs(by_rows({1: 0.010, 2: 0.011, 4: 0.012}))
    # Nothing known about drafting: 0 drafts 100 tok/s, 1: 1.5 / 11 ms = 136, 2: 1.75 / 12 = 146.
    assert p.draft_limits(np.array([True])).tolist() == [2]
    p.observe(np.array([0]), np.array([0]), StepBucket(1, 0), 0.010)             # base(1) live
    p.observe(np.array([1]), np.array([0]), StepBucket(2, 0), 0.020, depth=1)    # 9 ms above base
    assert p.draft_seconds == {(0, 1): pytest.approx(0.009)}
    assert p.step_time(2, 0, depth=1) == pytest.approx(0.020)
    assert p.step_time(4, 0, depth=2) == pytest.approx(0.012 + 0.009)   # deepest measured below
    assert p.step_time(2, 0) == pytest.approx(0.011)                     # the depth-0 base
    # 1 draft 1.5 / 20 ms = 75 tok/s, 2 drafts 1.75 / 21 ms = 83 < 100 at 0 drafts.
    assert p.draft_limits(np.array([True])).tolist() == [0]
    # Depth 2 turns out cheap (a step at 14 ms over a 12 ms base): 1.75 / 14 ms = 125 -> 2 drafts.
    p.observe(np.array([2]), np.array([1]), StepBucket(4, 0), 0.014, depth=2)
    assert p.draft_seconds[(0, 2)] == pytest.approx(0.002)
    assert p.draft_limits(np.array([True])).tolist() == [2]
    # A step with a prefill chunk is not timed: its bucket may be a decode bucket.
    before = (dict(p.step_seconds), dict(p.draft_seconds))
    p.observe(np.array([1]), np.array([1]), StepBucket(2, 0), 0.5, depth=2, timed=False)
    assert (p.step_seconds, p.draft_seconds) == before
    # A step faster than its base (noise) prices its depth at 0, not below; the price is the
    # median of the depth's last three samples (2 ms and 0 ms so far).
    p.observe(np.array([2]), np.array([1]), StepBucket(4, 0), 0.005, depth=2)
    assert p.draft_seconds[(0, 2)] == pytest.approx(0.001)
    # One slow step (50 ms over the base) cannot set the price: median(2, 0, 38 ms) = 2 ms.
    p.observe(np.array([2]), np.array([1]), StepBucket(4, 0), 0.050, depth=2)
    assert p.draft_seconds[(0, 2)] == pytest.approx(0.002)


def test_a_bucket_and_depth_that_ran_is_priced_by_its_own_steps():
    """``base + draft`` is a split of a drafting step's time that goes stale when the base moves:
    here the draft sample (4-row steps at depth 2 took 30 ms) was taken against a seeded base of
    12 ms (18 ms of drafting); the bucket's base then turns out to be 25 ms live. The split now
    says 25 + 18 = 43 ms; the pair's own live steps say 30 ms. One slot, gains 1/2, 1/4
    (pinned): 1.75 / 30 ms = 58 tok/s beats 1 / 20 ms = 50 at 1 row (and 1.5 / 32 ms = 46 for one
    draft: 2 rows seeded at 21 ms x the live/seed ratio 1.54); 1.75 / 43 ms = 41 would not."""
    p = policy(1, 2, [1, 2, 4], prior_acceptance=0.5, prior_weight=1e6)
    p.seed_costs(by_rows({1: 0.020, 2: 0.021, 4: 0.012}))
    for _ in range(3):
        p.observe(np.array([0]), np.array([0]), StepBucket(1, 0), 0.020)
    p.observe(np.array([2]), np.array([1]), StepBucket(4, 0), 0.030, depth=2)
    assert p.draft_seconds[(0, 2)] == pytest.approx(0.018)
    p.observe(np.array([2]), np.array([0]), StepBucket(4, 0), 0.025)             # base, live
    assert p.step_seconds[StepBucket(4, 0)] == pytest.approx(0.025)
    assert p.step_time(4, 0, depth=2) == pytest.approx(0.030)                    # its own steps
    # never ran: the split, its seed scaled by the live/seed ratio (20/20 and 25/12 ms: mean)
    assert p.step_time(2, 0, depth=2) == pytest.approx(0.021 * (1 + 25 / 12) / 2 + 0.018)
    assert p.draft_limits(np.array([True])).tolist() == [2]
    # A pair's own price expires after refresh_every steps without a new sample: the split again.
    p.refresh_every = 5
    p.num_plans += 6
    assert p.step_time(4, 0, depth=2) == pytest.approx(0.025 + 0.018)


def test_untried_shallower_depth_is_priced_optimistically():
    """The policy measures depth K first (nothing is known, so it drafts K); a shallower depth
    is then priced at the deepest measured depth below it, here none (0 s), so it gets tried
    once rather than inheriting depth K's cost. Gains 1/2, 1/4, 1/8 (pinned), base 10 ms for
    1-4 rows (seeded and live alike)."""
    p = policy(1, 3, [1, 2, 4], prior_acceptance=0.5, prior_weight=1e6)
    p.seed_costs(by_rows({1: 0.010, 2: 0.010, 4: 0.010}))
    p.observe(np.array([0]), np.array([0]), StepBucket(1, 0), 0.010)
    p.observe(np.array([3]), np.array([0]), StepBucket(4, 0), 0.022, depth=3)     # 12 ms to draft 3
    assert p.step_time(4, 0, depth=3) == pytest.approx(0.022)
    assert p.step_time(2, 0, depth=1) == pytest.approx(0.010)                     # untried: base
    # Untried depths 1 and 2 cost the base only: 1.5 / 10 ms = 150, 1.75 / 10 ms = 175 tok/s,
    # against 100 at none and 1.875 / 22 ms = 85 at depth 3 -> 2 drafts.
    assert p.draft_limits(np.array([True])).tolist() == [2]
    p.observe(np.array([2]), np.array([0]), StepBucket(4, 0), 0.020, depth=2)     # 10 ms to draft 2
    # depth 1 is still untried (no measured depth below it): 150 tok/s -> 1 draft
    assert p.draft_limits(np.array([True])).tolist() == [1]
    p.observe(np.array([1]), np.array([0]), StepBucket(2, 0), 0.020, depth=1)     # 10 ms as well
    assert p.step_time(2, 0, depth=1) == pytest.approx(0.020)
    # now 1: 75, 2: 87.5, 3: 85 tok/s, all below 100 at none
    assert p.draft_limits(np.array([True])).tolist() == [0]


def test_draft_time_needs_a_priced_base():
    """With nothing of a slot bucket priced (no seeds, lazy compile), a proposing step's whole
    time becomes its bucket's base instead of a draft cost measured against a placeholder."""
    p = policy(1, 2, [1, 2, 4])
    p.observe(np.array([0]), np.array([0]), StepBucket(4, 0), 9.0, depth=2)       # compile: dropped
    p.observe(np.array([2]), np.array([1]), StepBucket(4, 0), 0.03, depth=2)
    assert p.step_seconds == {StepBucket(4, 0): 0.03} and p.draft_seconds == {}
    p.observe(np.array([2]), np.array([1]), StepBucket(4, 0), 0.04, depth=2)      # now priced
    assert p.draft_seconds == {(0, 2): pytest.approx(0.01)}


def test_a_slow_no_draft_price_is_refreshed_not_kept():
    """The trap a probe found at 8 slots. Idle seeds price 1 and 2 rows alike (10 / 10.5 ms) where
    live steps cost 10 / 15 ms; one slow first live timing of the no-draft bucket (50 ms) scales
    every seeded price by 5 (the live/seed ratio), so 2 rows look 52.5 ms and drafting looks
    better than it is. Hand-worked with a pinned acceptance of 0.3: truly 0 drafts give 1 / 10 ms
    = 100 tok/s and 1 draft 1.3 / 15 ms = 87 tok/s (do not draft); as priced 1 / 50 ms = 20
    against 1.3 / 52.5 ms = 25 (draft). Drafting steps then price the drafting at max(15 - 52.5,
    0) = 0, and without re-timing the no-draft bucket the policy drafts for ever."""
    one, two = StepBucket(1, 0), StepBucket(2, 0)

    def run(refresh_every):
        p = policy(1, 1, [1, 2], prior_acceptance=0.3, prior_weight=1e6,
                   refresh_every=refresh_every)
        p.seed_costs({one: 0.010, two: 0.0105})
        p.observe(np.array([0]), np.array([0]), one, 0.050)   # the slow first live timing
        got, verify = [], 0
        for _ in range(20):
            limit = int(p.draft_limits(np.array([True]))[0])
            # this step verifies the previous step's draft (2 rows) and proposes `limit`
            p.observe(np.array([verify]), np.array([0]), two if verify else one,
                      0.015 if verify else 0.010, depth=limit)
            got.append(limit)
            verify = limit
        return got

    assert run(0) == [1] * 20                     # trapped
    got = run(8)
    # two steps re-time the no-draft bucket (its 3 timings now 50 / 10 / 10 ms: median 10, so
    # 2 rows are priced 10.5 ms, and drafting 0: 1.3 / 10.5 ms = 124 tok/s); the first drafting
    # step verifies nothing (1 row, 10 ms), the second verifies 2 rows while drafting and takes
    # 15 ms: that (bucket, depth) pair is now priced by its own live time, 1.3 / 15 ms = 87 <
    # 100, and drafting stops
    assert got == [0, 0] + [1] * 2 + [0] * 16


def test_refresh_while_drafting_pays_costs_two_steps_in_refresh_every():
    """Where drafting pays, the policy re-times the no-draft bucket every ``refresh_every`` steps
    (two steps without drafts) and drafts otherwise."""
    p = policy(1, 3, [1, 2, 4], prior_acceptance=0.9, prior_weight=1e6, refresh_every=8)
    one = StepBucket(1, 0)
    p.seed_costs({one: 0.010, StepBucket(2, 0): 0.011, StepBucket(4, 0): 0.012})
    for _ in range(3):
        p.observe(np.array([0]), np.array([0]), one, 0.010)
    got = []
    for _ in range(24):
        got.append(int(p.draft_limits(np.array([True]))[0]))
        if got[-1] == 0:
            p.observe(np.array([0]), np.array([0]), one, 0.010)
    # steps counted 1, 2, ... by draft_limits; the seeds' live timings count as step 0, a
    # refresh's second step (the no-draft one) as its own: more than 8 steps old at 9, then 19
    assert [i + 1 for i, d in enumerate(got) if d == 0] == [9, 10, 19, 20]
    assert all(d == 3 for d in got if d)



class FakeEngine:
    """Drives a policy as the engine does: each step proposes the policy's limits and verifies the
    drafts the step before proposed, ``accepted[b]`` of them accepted (at most what was proposed),
    and takes the seconds of its row bucket in ``cost`` (or ``seconds``). Paused slots commit
    nothing and verify nothing."""

    def __init__(self, p, cost):
        self.p, self.cost = p, cost
        self.waiting = np.zeros((p.num_slots,), np.int64)

    def step(self, accepted, active=None, paused=(), seconds=None):
        p = self.p
        active = np.ones((p.num_slots,), bool) if active is None else np.asarray(active)
        limits = p.draft_limits(active)
        live = active.copy()
        live[list(paused)] = False
        nd = np.where(live, self.waiting, 0)
        na = np.minimum(np.asarray(accepted), nd)
        bucket = p.bucket(int(active.sum() + nd.sum()), 0)
        sec = self.cost[bucket.num_tokens] if seconds is None else seconds
        p.observe(nd, na, bucket, sec, depth=int(limits.max()),
                  num_tokens=np.where(live, 1 + na, 0))
        self.waiting = np.where(live, limits, self.waiting)
        return limits.tolist()


def guarded(**kw):
    """Two slots, K=1, a pinned acceptance of 0.9; idle seeds price 2 rows (no drafts) at 1.0 s
    and 4 rows (one draft each) at 1.2 s, so the plan drafts (2 + 1.8) / 1.2 = 3.17 tok/s against
    2 / 1.0 = 2 without drafts."""
    p = policy(2, 1, [2, 4], prior_acceptance=0.9, prior_weight=1e6, **kw)
    p.seed_costs(by_rows({2: 1.0, 4: 1.2}))
    return p, FakeEngine(p, {2: 1.0, 4: 1.2})


def test_guard_holds_drafting_off_when_its_realised_rate_loses():
    """The estimates promise 3.17 tok/s; every draft is rejected, so a step verifying one draft
    per slot delivers 2 tokens in 1.2 s = 1.67 tok/s, below plain's 2 / 1.0 s. Step 1 proposes
    but verifies nothing (not judged); steps 2-5 are judged: the window of 4 loses and drafting
    is held off for 3 steps (6-8: step 6 verifies step 5's drafts, not judged), then step 9
    proposes again, 10-13 lose again and the hold doubles to 6 (14-19). Windows where the drafts
    are accepted (4 tokens in 1.2 s) keep up and reset the hold to 3."""
    p, eng = guarded(guard_samples=4, guard_retry=3)
    got = [eng.step([0, 0]) for _ in range(19)]
    assert got == [[1, 1]] * 5 + [[0, 0]] * 3 + [[1, 1]] * 5 + [[0, 0]] * 6
    assert p.guard_until == {2: 20} and p.guard_gap == {2: 12}
    # the counters bench_spec reports: 19 plans, 10 of them drafting, 2 losing windows
    assert (p.num_plans, p.num_drafting_plans, p.num_holds) == (19, 10, 2)
    got = [eng.step([1, 1]) for _ in range(5)]          # steps 20-24: 21-24 judged, keep up
    assert got == [[1, 1]] * 5 and p.guard_gap == {2: 3}
    got = [eng.step([0, 0]) for _ in range(8)]          # 25-28 lose: hold 3 (29-31)
    assert got == [[1, 1]] * 4 + [[0, 0]] * 3 + [[1, 1]]
    # the hold is capped at guard_retry * MAX_PROBE_BACKOFF = 24 steps
    for _ in range(200):
        eng.step([0, 0])
    assert p.guard_gap == {2: 24}


def test_guard_compares_with_the_slots_that_commit_keeps_ties_and_drops_a_slow_step():
    # one slot paused for KV blocks throughout: plain decoding would commit 1 token per 1.0 s;
    # slot 0's drafts pay (2 tokens per 1.2 s = 1.67 tok/s), so nothing trips (against n = 2
    # tokens per step it would)
    p, eng = guarded(guard_samples=4, guard_retry=3)
    assert [eng.step([1, 0], paused=[1]) for _ in range(30)] == [[1, 1]] * 30
    assert p.guard_until == {}
    # a window exactly as fast as plain decoding (3 tokens per 1.5 s = 2 tok/s) keeps up
    p, eng = guarded(guard_samples=4, guard_retry=3)
    assert [eng.step([1, 0], seconds=1.5) for _ in range(30)] == [[1, 1]] * 30
    assert p.guard_until == {}
    # one slow step is left out: drafts that pay (4 tokens per 1.2 s) and one 10 s step in each
    # window (16 tokens in 13.6 s = 1.18 tok/s with it, 3.33 without) do not trip the guard
    p, eng = guarded(guard_samples=4, guard_retry=3)
    eng.step([1, 1])
    got = [eng.step([1, 1], seconds=10.0 if i % 4 == 3 else 1.2) for i in range(40)]
    assert got == [[1, 1]] * 40 and p.guard_until == {}


def test_guard_judges_the_plans_drafts_only_and_windows_per_active_slots():
    # The plan drafts nothing (pinned acceptance 0); probes draft (at steps 3, 8, 17, ...: the
    # gap doubles) and lose (2 tokens in 1.2 s), but probes are not the plan's drafting: nothing
    # is judged.
    p = policy(2, 1, [2, 4], prior_acceptance=0.0, prior_weight=1e6, probe_every=2)
    p.seed_costs(by_rows({2: 1.0, 4: 1.2}))
    eng = FakeEngine(p, {2: 1.0, 4: 1.2})
    got = [eng.step([0, 0]) for _ in range(60)]
    assert any(any(x) for x in got) and p.guard_until == {} and p.guard.window == []
    # A change of active slots starts a new window: 3 losing judged steps at 2 slots (2-4), one
    # at 1 slot (5, verifying step 4's drafts), then 3 more at 2 slots (6-8) do not fill a
    # window of 4; the fourth (9) does.
    p, eng = guarded(guard_samples=4, guard_retry=3)
    for _ in range(4):                                   # step 1 unjudged, 2-4 judged
        eng.step([0, 0])
    eng.step([0, 0], active=[True, False])
    for _ in range(3):
        eng.step([0, 0])
    assert p.guard_until == {}
    eng.step([0, 0])
    assert p.guard_until == {2: p.num_plans + 4}
    # a hold counts steps at any number of active slots: a lone slot still drafts meanwhile
    assert [eng.step([0, 0], active=[True, False]) for _ in range(3)] == [[1, 0]] * 3
    assert eng.step([0, 0]) == [1, 1]
    # without num_tokens (or with guard_samples=0) the guard learns nothing
    q, eng = guarded(guard_samples=0)
    assert [eng.step([0, 0]) for _ in range(20)] == [[1, 1]] * 20
    r, _ = guarded(guard_samples=4)
    for _ in range(20):
        r.draft_limits(np.array([True, True]))
        r.observe(np.array([1, 1]), np.array([0, 0]), r.bucket(4, 2), 1.2, depth=1)
    assert r.guard_until == {} and r.draft_limits(np.array([True, True])).tolist() == [1, 1]


def test_a_trip_ends_a_refresh_in_progress():
    # refresh_every=1 starts a refresh (two steps without drafts) whenever drafting follows a
    # stale no-draft timing; the trip that holds drafting off cancels the refresh's second step,
    # so drafting resumes right after the hold
    p, eng = guarded(guard_samples=1, guard_retry=2, refresh_every=1)
    got = [eng.step([0, 0]) for _ in range(12)]
    drafting = [i + 1 for i, x in enumerate(got) if x == [1, 1]]
    # steps 1-4 refresh twice (the no-draft bucket needs three live timings), 5 drafts, 6 starts
    # a refresh (the newest timing is 2 steps old) and verifies step 5's drafts (judged: it
    # loses), so 7-8 are held off (timed without drafts), and 9 drafts; left to run, the
    # refresh's second step would take 9 and drafting would resume at 10
    assert drafting[:2] == [5, 9], got


def test_guard_does_not_judge_a_probe_the_replan_kept_alone():
    """Slot 0 accepts 9 in 10 drafts, slot 1 none; 2 rows cost 1.0 s, 3 rows 1.1 s, 4 rows 2.0 s.
    Step 1 drafts for slot 0 ((2 + 0.9) / 1.1 = 2.64 tok/s > 2). In step 2 slot 1 is due a probe:
    forced, it takes 3 rows, and slot 0's draft would cost the 4-row bucket (2.9 / 2.0 = 1.45 <
    2 / 1.1 = 1.82), so the re-plan drops it: [0, 1]. Step 2 verifies slot 0's draft (3 tokens in
    1.1 s, judged: keeps up); step 3 verifies only the probe (2 tokens in 1.1 s), which is not
    the plan's drafting: with a window of 1 it would trip the guard if judged."""
    p = policy(2, 1, [2, 3, 4], prior_weight=0.0, halflife=1e9, probe_every=1, guard_samples=1)
    p.trials[:], p.succ[:] = 100.0, [[90.0], [0.0]]
    p.seed_costs(by_rows({2: 1.0, 3: 1.1, 4: 2.0}))
    eng = FakeEngine(p, {2: 1.0, 3: 1.1, 4: 2.0})
    assert eng.step([1, 0]) == [1, 0]
    assert eng.step([1, 0]) == [0, 1]
    eng.step([1, 0])
    assert p.guard_until == {} and p.guard_gap == {2: 16}
