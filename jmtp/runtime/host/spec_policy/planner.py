"""The dynamic speculation policy's planner: per-slot draft limits that maximise expected tokens
per second for one step, with probing and the no-draft refresh.

Every draft of every active slot is a candidate with its gain (expected extra tokens) and its
expected verify rows (:mod:`~jmtp.runtime.host.spec_policy.estimates`). For each depth cap ``d = 1..K``
the candidates at positions ``<= d`` are ranked and every prefix is priced by the cost table
(:mod:`~jmtp.runtime.host.spec_policy.costs`); the plan maximising ``(n + sum of gains) / price`` wins.
A slot held at 0 drafts for its probe gap gets a forced first draft (probing), and while drafting
the no-draft bucket is re-timed when its price goes stale. The rules and the reasons for each:
``docs/architecture.md``, "The dynamic speculation policy".
"""
from __future__ import annotations

import numpy as np

from jmtp.runtime.host.spec_policy.costs import CostTable, Prices
from jmtp.runtime.host.spec_policy.estimates import AcceptanceEstimates

#: A slot's probe gap grows to at most ``probe_every`` times this (and the guard's hold to
#: ``guard_retry`` times this).
MAX_PROBE_BACKOFF = 8

#: Plans whose expected tokens per second lie within this relative margin of the best are near-ties;
#: of those the plan takes the one with the fewest drafts. The chosen plan's rate is therefore
#: within a factor ``1 + PLAN_RTOL`` of the optimum, not always equal to it.
PLAN_RTOL = 1e-9

#: Expected row counts within this of an integer count as that integer (sums of presences).
ROWS_EPS = 1e-9

#: Draft candidates of a plan: ``(gain f64[m], position i64[m], slot i64[m], rows f64[m])``, the
#: last the draft's expected verify rows (its presence ``prod_{j<=i} p_j``; the input of
#: :meth:`DraftPlanner.best_plan` sorted by falling gain; its output lists the forced drafts
#: first).
Candidates = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]


class DraftPlanner:
    """Chooses the draft limits of each step from the estimates and the cost table it shares with
    the policy.

    Args:
      num_slots: B.
      k: K, the largest draft count.
      probe_every: a slot at 0 drafts this many steps in a row gets a probe draft (0 = never).
      estimates, costs: the policy's acceptance estimates and cost table.

    Attributes:
      zero_streak: i64[B] consecutive planned steps each slot was held at 0 drafts.
      probe_gap: i64[B] the zero streak after which each slot is probed (doubles after a probe
        whose first draft was not accepted, up to ``probe_every * MAX_PROBE_BACKOFF``).
      probe_pending: bool[B] probed, its first draft not yet verified.
      refresh_left: no-draft steps still to run to re-time the no-draft bucket.
    """

    def __init__(self, num_slots: int, k: int, probe_every: int, estimates: AcceptanceEstimates,
                 costs: CostTable):
        self.num_slots, self.k, self.probe_every = num_slots, k, probe_every
        self.estimates, self.costs = estimates, costs
        self.zero_streak = np.zeros((num_slots,), np.int64)
        self.probe_gap = np.full((num_slots,), probe_every, np.int64)   # per-slot probe gap
        self.probe_pending = np.zeros((num_slots,), bool)   # probed, first draft not yet verified
        self.refresh_left = 0                               # no-draft steps still to run

    def limits(self, active: np.ndarray, n: int, prices: Prices, caps: np.ndarray | None = None,
               base: tuple[float, float] = (0.0, 0.0)) -> tuple[np.ndarray, bool]:
        """The draft limits of one step over ``n`` slots, those in ``active`` (bool[B]) drafting,
        priced by ``prices`` (of this step), each at most its ``caps`` (i32[B], the requests' own
        caps; None: K): a draft past its slot's cap is no candidate and a slot capped at 0 is
        never probed. ``base``: ``(tokens, rows)`` the step gets beyond one per slot from
        elsewhere (the suffix drafts of the MTP hybrid: their expected accepted tokens and their
        rows), which every plan's drafts come on top of.

        Returns:
          ``(limits i32[B], planned)``: ``planned`` when the plan drafts for some slot unforced
          (not only probes).
        """
        limits = np.zeros((self.num_slots,), np.int32)
        rankings = self.rankings(active, caps)
        (_, plan_pos, plan_slot, _), _ = self.plan(rankings, n, prices, base=base)
        planned = bool(len(plan_pos))
        if planned and not self.refresh_left and self.costs.no_draft_stale(n, prices.step):
            self.refresh_left = 2       # verify the drafts already proposed, then time no-draft
        if self.refresh_left:
            self.refresh_left -= 1
            return limits, False
        np.maximum.at(limits, plan_slot, (plan_pos + 1).astype(limits.dtype))
        if self.probe_every:
            probe = self.probe_due(active, caps) & (limits == 0)
            if probe.any():
                # The probes' first drafts are forced; the plan is chosen again around them.
                limits[:] = 0
                (_, plan_pos, plan_slot, _), _ = self.plan(rankings, n, prices, probe, base)
                np.maximum.at(limits, plan_slot, (plan_pos + 1).astype(limits.dtype))
            unforced = (limits > 0) & ~probe           # the plan drafts for them unforced
            planned = bool(unforced.any())             # (the re-plan may drop every draft)
            self.probe_gap[unforced] = self.probe_every
            self.probe_pending[unforced] = False
            self.probe_pending[probe] = True
            self.zero_streak = np.where(active & (limits == 0), self.zero_streak + 1, 0)
        return limits, planned

    def probe_due(self, active: np.ndarray, caps: np.ndarray | None = None) -> np.ndarray:
        """bool[B]: the ``active`` (bool[B]) slots held at 0 drafts for their probe gap, cap
        ``caps`` (i32[B], None: K) above 0: the plan forces their first draft where it gives
        them none itself (:meth:`limits`). All False when probing is off."""
        due = np.asarray(active, bool) & (self.zero_streak >= self.probe_gap)
        if not self.probe_every:
            due[:] = False
        return due if caps is None else due & (np.asarray(caps) > 0)

    def probe_verified(self, allowed: np.ndarray, accepted: np.ndarray) -> None:
        """A step verified windows ``allowed`` (i64[B]) drafts, ``accepted`` of them accepted: a
        probe's window allowed a draft whose first draft was not accepted (rejected, or never
        proposed) doubles the slot's probe gap; a probe whose budget the ``max_tokens`` cap took
        (allowed 0) leaves it pending."""
        verified = self.probe_pending & (allowed >= 1)
        rejected = verified & (accepted == 0)
        self.probe_gap[rejected] = np.minimum(self.probe_gap[rejected] * 2,
                                              self.probe_every * MAX_PROBE_BACKOFF)
        self.probe_pending[verified] = False

    def reset_slot(self, slot: int) -> None:
        """A new request took ``slot``: its probing starts afresh."""
        self.zero_streak[slot] = 0
        self.probe_gap[slot] = self.probe_every
        self.probe_pending[slot] = False

    def rankings(self, active: np.ndarray, caps: np.ndarray | None = None
                 ) -> list[Candidates]:
        """The candidates of the active slots ranked by falling gain (ties: position, slot) and,
        when some draft may not be proposed (presence below 1), also by falling gain per
        expected row (its running minimum over the slot's positions): a rarely proposed draft
        adds only a fraction of a row, so it may pay more than its gain ranks it. Both keys
        fall with position, so each ranking lists a slot's drafts in order. Drafts past a
        slot's cap (``caps`` i32[B]) get gain 0, which no plan takes."""
        slots = np.nonzero(active)[0]
        g, r = self.estimates.gains()[slots], self.estimates.expected_rows()[slots]  # f64[n, K]
        if caps is not None:
            g = np.where(np.arange(self.k)[None] < caps[slots][:, None], g, 0.0)
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

    def plan(self, rankings: list[Candidates], n: int, prices: Prices,
             probe: np.ndarray | None = None, base: tuple[float, float] = (0.0, 0.0)
             ) -> tuple[Candidates, float]:
        """The best of :meth:`best_plan` over ``rankings`` (near-ties: the fewest drafts), with
        the first drafts of the slots in ``probe`` (bool[B]) forced, over ``base`` (see
        :meth:`limits`), and its expected tokens per second."""
        best = None
        for cand in rankings:
            forced = None
            if probe is not None:
                is_first = (cand[1] == 0) & probe[cand[2]]
                forced = tuple(c[is_first] for c in cand)
                cand = tuple(c[~is_first] for c in cand)
            plan, rate = self.best_plan(cand, n, prices, forced=forced, base=base)
            if best is None or rate > best[1] * (1 + PLAN_RTOL) or (
                    rate * (1 + PLAN_RTOL) >= best[1] and len(plan[0]) < len(best[0][0])):
                best = plan, rate
        return best

    def best_plan(self, cand: Candidates, n: int, prices: Prices,
                  forced: Candidates | None = None, base: tuple[float, float] = (0.0, 0.0)
                  ) -> tuple[Candidates, float]:
        """The drafts maximising expected tokens per second of a step over ``n`` slots: the
        ``forced`` ones (probes' first drafts), then a selection of ``cand``. Candidates are
        ``(gain, position, slot, rows)`` arrays (``f64``, ``i64``, ``i64``, ``f64``; ``position``
        counts from 0; ``rows`` the expected verify rows, 1.0 for a draft that is always
        proposed) sorted by falling gain. For each depth cap ``d = 1..K`` every prefix of the
        candidates at positions ``< d`` (a prefix per slot, as gains fall with position) is
        priced by ``prices.step_time`` at its depth and its expected rows ``n + r``; a fractional
        ``r`` is priced by linear interpolation between the row counts around it (exact for one
        slot allowed one draft: the step runs ``n`` or ``n + 1`` rows), and with one active slot
        by the exact expectation over its rows (:meth:`one_slot_prices`). The best over all caps
        is kept, ``forced`` alone when no draft pays. Near-ties (rates within a factor ``1 +
        PLAN_RTOL`` of the best) keep the plan with the fewest drafts. ``base = (tokens,
        rows)``: expected tokens and whole rows every plan gets beyond ``n`` (:meth:`limits`).

        As the price never falls with depth, this finds the best plan over every choice of
        per-slot limits whose drafts have a positive gain when every draft is proposed (``rows``
        all 1; why the caps: "Choice" in ``docs/architecture.md``); with presence below 1 it
        searches the prefixes of the given ranking (:meth:`plan` tries two). Returns the plan and
        its expected tokens per second. Vectorised over the prefixes: a price is looked up once
        per run of consecutive prefixes that share a (bucket, depth), and repeats of a pair in
        another cap's ranking hit the memo of ``prices``, so a plan over 256 slots costs a
        fraction of a millisecond of host time (``scripts/bench_policy.py``)."""
        none = np.zeros((0,), np.int64)
        fg, fpos, fslot, frows = forced if forced is not None else (
            np.zeros((0,)), none, none, np.zeros((0,)))
        tok0 = n + float(base[0]) + float(fg.sum())
        depth0 = int(fpos.max()) + 1 if len(fpos) else 0
        rows0 = float(base[1]) + float(frows.sum())  # rows beyond n: the base's, the forced's
        lo0, f0 = (x.item() for x in split_rows(np.array([rows0])))
        price0 = (1 - f0) * prices.step_time(n + lo0, n, depth0) + (
            f0 * prices.step_time(n + lo0 + 1, n, depth0) if f0 else 0.0)
        rate0 = tok0 / price0
        gain, pos, slot, w = (c[cand[0] > 0] for c in cand)   # a draft of no gain never pays
        if not len(gain):
            return (fg, fpos, fslot, frows), rate0
        # rows never exceed the drafts' count (presence <= 1): the table's largest row count
        table = self.costs.bucket_table(n, n + int(np.ceil(base[1])) + len(fpos) + len(gain))
        # row c - 1 of each [K, m] array: the candidates a depth cap c keeps (pos < c); a prefix
        # of that ranking ends at each kept column
        keep = pos[None] < np.arange(1, self.k + 1)[:, None]
        count = np.cumsum(keep, axis=1)
        tok = tok0 + np.cumsum(np.where(keep, gain[None], 0.0), axis=1)
        rows = rows0 + np.cumsum(np.where(keep, w[None], 0.0), axis=1)
        depth = np.maximum(depth0, np.maximum.accumulate(np.where(keep, pos[None] + 1, 0), axis=1))
        cap = np.broadcast_to(np.arange(1, self.k + 1)[:, None], keep.shape)
        count, tok, rows, depth, cap = count[keep], tok[keep], rows[keep], depth[keep], cap[keep]
        lo, frac = split_rows(rows)
        lo = n + lo                                   # rows n + r, r in [lo, lo + 1)
        if n == 1 and not base[1] and min(w.min(), frows.min(initial=1.0)) < 1 - ROWS_EPS:
            price = self.one_slot_prices(np.concatenate([frows, w]), prices)[len(fpos) + count]
        else:
            price = self.run_prices(table, lo, depth, n, prices)
            if frac.any():
                hi = np.where(frac > 0, lo + 1, lo)
                price = (1 - frac) * price + frac * self.run_prices(table, hi, depth, n, prices)
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

    def one_slot_prices(self, rows: np.ndarray, prices: Prices) -> np.ndarray:
        """f64[K + 1]: the expected price of one active slot allowed ``L = 0..K`` drafts, exact:
        ``rows`` are its drafts' presences ``e_i = P(R >= i)`` (any order; they fall with the
        position), so it verifies ``R = i`` drafts with ``P = e_i - e_{i+1}`` and proposes at
        depth ``L``. (Interpolating at the expected rows would price an n-gram slot's drafts,
        which come all or none, as if a part of them always came, and overprice deep limits at
        batch 1.) Entries past ``len(rows)`` are 0."""
        e = np.concatenate([[1.0], np.sort(rows)[::-1]])
        out = np.zeros((self.k + 1,))
        for limit in range(1, len(e)):
            prob = e[:limit + 1] - np.append(e[1:limit + 1], 0.0)
            out[limit] = sum(prob[i] * prices.step_time(1 + i, 1, limit)
                             for i in range(limit + 1) if prob[i] > 0)
        return out

    def run_prices(self, table: np.ndarray, rows: np.ndarray, depth: np.ndarray, n: int,
                   prices: Prices) -> np.ndarray:
        """:func:`run_prices` at this planner's K."""
        return run_prices(table, rows, depth, n, prices, self.k)


def run_prices(table: np.ndarray, rows: np.ndarray, depth: np.ndarray, n: int, prices: Prices,
               k: int) -> np.ndarray:
    """f64[m]: ``prices.step_time`` of each ``(rows[i], n, depth[i])`` (i64[m] each, depths in
    ``0..k``), looked up once per run of consecutive entries sharing a (bucket, depth)
    (``table``: :meth:`CostTable.bucket_table` at ``n``), so the bucket function is not asked
    once per row count."""
    pair = table[rows].astype(np.int64) * (k + 1) + depth
    new_run = np.empty(pair.shape, bool)
    new_run[0], new_run[1:] = True, pair[1:] != pair[:-1]
    price = [prices.step_time(int(rows[i]), n, int(depth[i])) for i in np.flatnonzero(new_run)]
    return np.asarray(price)[np.cumsum(new_run) - 1]


def split_rows(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(i64[m], f64[m])``: expected row counts ``rows`` (f64[m], >= 0) split into whole rows
    and the fraction past them, an interpolation weight in ``[0, 1)``; a count within
    :data:`ROWS_EPS` of an integer is that integer (fraction 0)."""
    lo = np.floor(rows + ROWS_EPS).astype(np.int64)
    frac = np.maximum(rows - lo, 0.0)
    frac[frac <= ROWS_EPS] = 0.0
    return lo, frac
