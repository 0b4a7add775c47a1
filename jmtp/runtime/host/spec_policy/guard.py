"""The dynamic speculation policy's guard on the realised rate: hold drafting off where it
delivers fewer tokens per second than plain decoding would.

A step is *judged* when it verifies drafts the plan itself proposed in the step before (not only
probes, and not while drafting is held off) and is timed. Judged steps gather in a window of
``guard_samples`` steps at one number of active slots ``n`` (a change of ``n`` starts a new
window). A full window is judged once and cleared: when its tokens per second (its slowest step
left out when ``guard_samples > 1``) fall below ``c / base(bucket(n, n))``, ``c`` the mean number
of slots that committed a token in those steps, drafting at ``n`` is held off for the guard gap
(``guard_retry``, doubling per further losing window up to ``guard_retry * MAX_PROBE_BACKOFF``;
a window that keeps up resets it). Reasons: ``docs/architecture.md``, "The dynamic speculation
policy".
"""
from __future__ import annotations

import numpy as np

from jmtp.runtime.host.spec_policy.costs import Prices
from jmtp.runtime.host.spec_policy.planner import MAX_PROBE_BACKOFF


class RateGuard:
    """Judged windows and holds, per number of active slots.

    Args:
      guard_samples: judged steps per window (0 = no guard).
      guard_retry: steps drafting is held off after a first losing window.

    Attributes:
      guard_until: n -> first policy step at which drafting may resume at that n.
      guard_gap: n -> the hold after its next losing window.
      num_holds: losing windows so far (each starts a hold).
      planned: the last step's plan proposed drafts (not only probes); set by the policy.
      judged: the current step verifies drafts the plan proposed and is not held off.
    """

    def __init__(self, guard_samples: int, guard_retry: int):
        self.guard_samples, self.guard_retry = guard_samples, guard_retry
        self.guard_until: dict[int, int] = {}  # n -> first step drafting may resume at that n
        self.guard_gap: dict[int, int] = {}    # n -> hold after its next losing window
        self.num_holds = 0
        self.planned = False       # the last step's plan proposed drafts (not only probes)
        self.judged = False        # this step verifies drafts the plan proposed, not held off
        self._n = 0                                      # active slots of the last plan
        self.window: list[tuple[float, float, int]] = []   # (tokens, seconds, slots committing)
        self.window_n = 0                               # the n of the window's steps

    def begin(self, step: int, n: int) -> bool:
        """A plan at policy step ``step`` over ``n >= 1`` active slots; returns whether drafting
        is held off in it (plain decoding)."""
        self._n = n
        held = step < self.guard_until.get(n, 0)
        self.judged, self.planned = self.planned and not held, False
        return held

    def idle(self) -> None:
        """A step without active slots: nothing to judge next."""
        self.judged = self.planned = False

    def observe(self, num_tokens: np.ndarray | None, seconds: float, step: int, prices: Prices,
                plan: tuple[bool, int] | None = None) -> bool:
        """Add a recorded step (``num_tokens`` i32[B] committed per slot, wall ``seconds``) to the
        window if it is judged; a full window is compared with plain decoding (the no-draft base
        from ``prices``) and cleared. Returns whether a hold started at ``step``. ``plan``:
        ``(judged, n)`` of the step's own plan when later plans came before this observation
        (asynchronous scheduling); default: the last plan's."""
        judged, n = plan if plan is not None else (self.judged, self._n)
        if num_tokens is None or not judged or not self.guard_samples:
            return False
        num_tokens = np.asarray(num_tokens)
        if n != self.window_n:
            self.window, self.window_n = [], n
        self.window.append((float(num_tokens.sum()), seconds, int(np.count_nonzero(num_tokens))))
        del self.window[:-self.guard_samples]         # (while the no-draft bucket is unpriced)
        off = prices.no_draft_time(n)
        if len(self.window) < self.guard_samples or off is None:
            return False
        # the slowest step is left out: one slow step (a page-fault storm, another process)
        # must not trip the guard, as it cannot set a price (the base is a median)
        kept = sorted(self.window, key=lambda judged: judged[1])[:-1] or self.window
        tok, sec, committing = (sum(col) for col in zip(*kept))
        self.window = []
        gap = self.guard_gap.get(n, self.guard_retry)
        if tok / sec < committing / len(kept) / off:
            self.guard_until[n] = step + 1 + gap
            self.guard_gap[n] = min(gap * 2, self.guard_retry * MAX_PROBE_BACKOFF)
            self.num_holds += 1
            return True
        self.guard_gap[n] = self.guard_retry
        return False
