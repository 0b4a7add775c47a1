"""Acceptance and presence estimates of the dynamic speculation policy, per slot and draft position.

For draft position ``i = 1..K`` of a slot:

* acceptance ``a_i = P(draft i accepted | draft i allowed, draft i-1 accepted)``;
* presence ``p_i = P(draft i proposed | draft i allowed, draft i-1 proposed)``.

Both come from decayed counts (half-life ``halflife`` steps) of the slot's own verify steps,
shrunk towards the pooled estimate over all slots (weight ``prior_weight`` pseudo-trials); the pool
starts at ``prior_acceptance`` and at presence 1. A slot allowed ``k`` drafts is expected to commit
``1 + sum_{i<=k} prod_{j<=i} a_j`` tokens (:meth:`AcceptanceEstimates.gains`) and to verify
``sum_{i<=k} prod_{j<=i} p_j`` draft rows (:meth:`AcceptanceEstimates.expected_rows`). Why the
gain is estimated jointly rather than as ``prod p_j a'_j``: ``docs/architecture.md``, "The dynamic
speculation policy".
"""
from __future__ import annotations

import numpy as np


class AcceptanceEstimates:
    """Decayed per-slot, per-position counts (``f64[B, K]``) and their pooled sums (``f64[K]``).

    Args:
      num_slots: B.
      k: K, the largest draft count.
      prior_acceptance: initial pooled per-position acceptance ``a_i``.
      prior_weight: pseudo-trials of the pooled estimate in each slot's estimate.
      halflife: steps after which a count has half its weight.
      count_presence: count presence from the budget each verified window was proposed under, and
        an allowed draft that never came as a failed trial of its acceptance; off, every presence
        is 1 and only proposed drafts are trials.

    Attributes:
      trials, succ: f64[B, K] acceptance trials (allowed, previous accepted) and successes.
      allowed, present: f64[B, K] presence trials (allowed, previous present) and successes.
      pool_trials, pool_succ, pool_allowed, pool_present: f64[K] the same summed over the slots,
        seeded with the priors.
      decay: per-step weight of the counts, ``0.5 ** (1 / halflife)``.
    """

    def __init__(self, num_slots: int, k: int, prior_acceptance: float, prior_weight: float,
                 halflife: float, count_presence: bool):
        self.k = k
        self.prior_weight = prior_weight
        self.count_presence = count_presence
        self.decay = 0.5 ** (1.0 / halflife)
        self.trials = np.zeros((num_slots, k))         # decayed per-slot, per-position counts
        self.succ = np.zeros((num_slots, k))
        self.pool_trials = np.full((k,), prior_weight)  # pooled counts, seeded with the prior
        self.pool_succ = np.full((k,), prior_weight * prior_acceptance)
        self.present = np.zeros((num_slots, k))       # decayed presence counts (see p_i)
        self.allowed = np.zeros((num_slots, k))
        self.pool_allowed = np.full((k,), prior_weight)   # pooled, seeded with presence 1.0
        self.pool_present = np.full((k,), prior_weight)

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

    def update(self, num_drafts: np.ndarray, num_accepted: np.ndarray,
               num_allowed: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        """Count one step's verified windows: drafts verified / accepted per slot (i32[B]) and the
        budget each window was proposed under (i32[B]; None, or ``count_presence`` off: every
        allowed draft was proposed, as with the MTP head). Every count decays by :attr:`decay`.

        Returns:
          ``(allowed i64[B], accepted i64[B])``: drafts each window was allowed (at least those
          verified) and accepted.
        """
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
        return al[:, 0], na[:, 0]

    def reset_slot(self, slot: int) -> None:
        """A new request took ``slot``: forget its counts (the pooled estimates remain)."""
        self.trials[slot] = 0.0
        self.succ[slot] = 0.0
        self.allowed[slot] = 0.0
        self.present[slot] = 0.0
