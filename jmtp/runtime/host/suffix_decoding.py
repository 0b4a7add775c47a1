"""Suffix decoding in the engine: suffix trees on the host, drafts into the step as data.

Two configurations (vLLM's and FastDeploy's method name and knobs, :class:`SpeculativeConfig`):

* ``SpeculativeConfig("suffix", K, suffix_decoding_...)``: every draft comes from the host. The
  device proposes nothing (the ``"suffix"`` proposer is empty, no MTP weights or cache); before
  each step the host drafts each decoding slot's next window from suffix trees and hands the
  drafts to the jitted step in its ``draft_override i32[B, K]`` input (forced tokens, then a cut:
  :func:`~jmtp.runtime.device.bitmask.override_drafts`), the input structured outputs use.
* ``SpeculativeConfig("mtp", K, M, mtp_strategy="with_suffix")``: per slot and window, the suffix
  draft (up to K tokens) where its score reaches M, the M MTP drafts otherwise
  (ArcticInference's hybrid rule: the suffix match's expected accepted tokens against the
  model's draft length). While a slot follows a suffix match the MTP head proposes nothing for
  it (its draft limit is 0, so the step skips MTP substeps 1.. when no slot needs them); the
  window after that gets the suffix draft whatever its score, and the MTP drafts again after it.
  With ``speculation_policy="dynamic"`` the head drafts only where it pays: the MTP drafts' limits
  are planned by :class:`~jmtp.runtime.host.spec_policy.DynamicSpeculation` (fed the MTP windows'
  outcomes alone) for the slots not following a match, in a step priced with the suffix drafts'
  rows and expected tokens as its base; a window takes the suffix draft where its calibrated
  expected accepted tokens exceed the pending MTP drafts' (:meth:`SuffixDecoding.prepare`), and
  the head rests where the match beats what M MTP drafts would bring.

The trees (:class:`SuffixCache`, the ArcticInference / vLLM design): one per running sample over
its prompt and output (the *local* tree), and one *global* tree over the outputs of the requests
seen, running ones included (so requests in flight at the same time draft from each other too),
bounded by ``suffix_decoding_max_cached_requests`` and ``suffix_decoding_corpus_tokens``: when
either is exceeded, finished outputs are evicted, the one extended longest ago first (for a
finished request: when it finished), so memory stays bounded and recent traffic stays. Each
draft is the better of the two trees' (:meth:`~jmtp.runtime.host.suffix_tree.SuffixTree.speculate`:
length adapted to the match length and the continuation's frequency; empty where nothing
repeats, so such a slot verifies one row, as in plain decoding).

Exactness: a suffix draft is a function of the sample's committed tokens and of other requests'
outputs, never of this step's random draws, and is verified with a one-hot q (the override's
forced tokens): greedy output equals plain decoding, and rejection sampling keeps sampled output
exact in distribution (:mod:`jmtp.runtime.device.verify`). A seeded sampled request's tokens depend on
the drafts, hence on what the engine served before it (the global tree);
``verify_strategy="target_match"`` makes them those of plain decoding with the same seed.

Cost: the host work runs every step for every decoding slot, in Python: matching and drafting
(tens of microseconds per slot), appending the step's tokens to two trees (about
``max_tree_depth`` dict operations per token and tree), building a local tree at admission
(the same per prompt token) and evicting (the same per evicted token). ``LLMEngine.get_stats``
reports the time (``suffix_host_seconds``) and the trees' size (``suffix_*``); design and
figures: ``docs/suffix_decoding.md``.
"""
from __future__ import annotations

import collections
import time

import numpy as np

from jmtp.runtime.device.bitmask import KEEP_DRAFT, NO_DRAFT
from jmtp.runtime.host.spec_policy.costs import CostTable
from jmtp.runtime.host.spec_policy.planner import PLAN_RTOL, run_prices
from jmtp.runtime.host.suffix_tree import EMPTY_DRAFT, SuffixDraft, SuffixTree

__all__ = ["SuffixCache", "SuffixDecoding", "merge_overrides"]

#: Equal probability bins over which the dynamic policy calibrates the trees' draft probabilities.
CALIBRATION_BINS = 10
#: Pseudo-trials of a bin at the trees' own probability before its measured share takes over.
CALIBRATION_PRIOR = 8.0


class SuffixCache:
    """The local trees of running samples and the bounded global tree of outputs.

    Args:
      max_tree_depth: ``D`` of every tree.
      max_cached_requests: outputs the global tree holds at most (running ones count, and are
        never evicted); 0: no global tree.
      corpus_tokens: output tokens the global tree holds at most (evicting finished outputs).

    Keys are any hashable naming a running sample (the engine uses ``(request_id, index)``).

    Raises:
      KeyError: :meth:`extend`, :meth:`speculate` or :meth:`stop` of a key not started.
      ValueError: :meth:`start` of a key already running.
    """

    def __init__(self, max_tree_depth: int, max_cached_requests: int, corpus_tokens: int):
        self.max_tree_depth = max_tree_depth
        self.max_cached_requests, self.corpus_tokens = max_cached_requests, corpus_tokens
        self.local: dict = {}
        self.global_tree = SuffixTree(max_tree_depth) if max_cached_requests > 0 else None
        self._running: dict = {}      # key -> its output's id in the global tree
        self._finished: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._next_id = 0
        self.num_evicted = 0

    def start(self, key, context_ids, output_ids=()) -> None:
        """A sample starts running: its local tree over ``context_ids`` (prompt and any output
        already generated), and its ``output_ids`` so far into the global tree."""
        if key in self.local:
            raise ValueError(f"suffix cache: {key!r} is already running")
        tree = SuffixTree(self.max_tree_depth)
        tree.extend(0, context_ids)
        self.local[key] = tree
        if self.global_tree is not None:
            sid, self._next_id = self._next_id, self._next_id + 1
            self._running[key] = sid
            self.global_tree.extend(sid, output_ids)
            self._evict()

    def extend(self, key, tokens) -> None:
        """Append a running sample's new output tokens to both of its trees."""
        self.local[key].extend(0, tokens)
        sid = self._running.get(key)
        if sid is not None:
            self.global_tree.extend(sid, tokens)
            if self.global_tree.num_tokens > self.corpus_tokens:
                self._evict()

    def stop(self, key) -> None:
        """A sample leaves its slot (finished, aborted, preempted or handed off): its local tree
        goes, its output stays in the global tree until evicted."""
        del self.local[key]
        sid = self._running.pop(key, None)
        if sid is not None:
            if self.global_tree.sequence(sid):
                self._finished[sid] = None
            else:
                self.global_tree.remove(sid)
            self._evict()

    def _evict(self) -> None:
        g = self.global_tree
        while self._finished and (
                len(self._running) + len(self._finished) > self.max_cached_requests
                or g.num_tokens > self.corpus_tokens):
            sid, _ = self._finished.popitem(last=False)
            g.remove(sid)
            self.num_evicted += 1

    def clear(self) -> None:
        """Evict every finished output (the running samples' trees stay)."""
        while self._finished:
            self.global_tree.remove(self._finished.popitem(last=False)[0])
            self.num_evicted += 1

    def speculate(self, key, context, max_spec_tokens: int, max_spec_factor: float,
                  min_token_prob: float) -> SuffixDraft:
        """The better draft of the sample's local tree and the global tree (the local one on
        ties) after ``context``, the sample's prompt and output (only its last
        ``max_tree_depth - 1`` tokens are read)."""
        local = self.local[key]
        best = local.speculate(nodes=local.active_nodes(0), max_spec_tokens=max_spec_tokens,
                               max_spec_factor=max_spec_factor, min_token_prob=min_token_prob)
        g = self.global_tree
        if g is not None:
            sid = self._running.get(key)
            known, own = None, 0
            if sid is not None and sid in g:    # the context ends with this output
                known, own = g.active_nodes(sid), len(g.sequence(sid))
            other = g.speculate(nodes=g.match_nodes(context, known, own),
                                max_spec_tokens=max_spec_tokens, max_spec_factor=max_spec_factor,
                                min_token_prob=min_token_prob)
            if other.score > best.score:
                best = other
        return best

    def stats(self) -> dict:
        """Sizes: running samples, cached outputs, tokens and nodes, host bytes (estimated:
        :meth:`SuffixTree.nbytes`), evictions."""
        g = self.global_tree
        trees = list(self.local.values()) + ([g] if g is not None else [])
        return dict(
            suffix_running_requests=len(self.local),
            suffix_cached_requests=(len(self._running) + len(self._finished)
                                    if g is not None else 0),
            suffix_cached_tokens=g.num_tokens if g is not None else 0,
            suffix_global_tree_nodes=g.num_nodes if g is not None else 0,
            suffix_tree_nodes=sum(t.num_nodes for t in trees),
            suffix_tree_bytes=sum(t.nbytes() for t in trees),
            suffix_evicted_requests=self.num_evicted)


def _context_tail(seq, n: int) -> list[int]:
    """The last ``n`` tokens of ``seq``'s prompt and output."""
    out = seq.output_ids
    if len(out) >= n:
        return out[-n:]
    return seq.prompt_ids[max(0, len(seq.prompt_ids) - (n - len(out))):] + out


def merge_overrides(structured, suffix):
    """One ``(token_bitmask | None, draft_override)`` guide from the structured-output guide
    (or None) and the suffix override (or None): where the grammar keeps the pending draft
    (:data:`KEEP_DRAFT`), the suffix override applies (the grammar's rows were built over the
    suffix drafts already)."""
    if suffix is None:
        return structured
    if structured is None:
        return None, suffix
    masks, override = structured
    return masks, np.where(override == KEEP_DRAFT, suffix, override).astype(np.int32)


class SuffixDecoding:
    """The engine's suffix proposer (host side; see the module docstring).

    Args:
      spec: the engine's :class:`~jmtp.runtime.config.SpeculativeConfig` (``uses_suffix``).
      num_slots: ``max_num_seqs``.
      bucket_of: ``(rows, n) -> StepBucket`` of a decode step (the engine's
        ``choose_bucket``); needed by ``method="suffix"`` with ``speculation_policy="dynamic"``.
      mtp_policy: the MTP hybrid under ``speculation_policy="dynamic"``: the engine's
        :class:`~jmtp.runtime.host.spec_policy.DynamicSpeculation`, which plans the MTP drafts
        (:meth:`plan_mtp`, :meth:`mtp_outcomes`); the suffix drafts are not cut then.

    Attributes: ``cache`` (:class:`SuffixCache`), ``mtp_off`` (``bool[B]``: slots whose MTP
    drafts are held off in the coming step), ``costs`` (the step-time
    :class:`~jmtp.runtime.host.spec_policy.costs.CostTable` of the dynamic policy, else None),
    counters for ``get_stats``: ``host_seconds``, ``num_windows`` (windows drafted from the
    trees), ``num_drafts`` (their tokens), ``num_mtp_windows`` (hybrid: windows left to the MTP
    head), ``num_cut`` (draft tokens the dynamic policy cut), ``num_mtp_rested`` (dynamic
    hybrid: slot-steps :meth:`plan_mtp` rested the head for, its suffix draft worth more).

    Raises:
      ValueError: the dynamic policy without ``bucket_of`` (``method="suffix"``) or without
        ``mtp_policy`` (the MTP hybrid).
    """

    def __init__(self, spec, num_slots: int, bucket_of=None, mtp_policy=None):
        self.spec, self.k = spec, spec.k
        self.mtp_drafts = spec.m if spec.method == "mtp" else 0
        self.cache = SuffixCache(spec.suffix_decoding_max_tree_depth,
                                 spec.suffix_decoding_max_cached_requests,
                                 spec.suffix_decoding_corpus_tokens)
        self.mtp_off = np.zeros((num_slots,), bool)
        self.from_trees = np.zeros((num_slots,), bool)   # the coming window is the trees'
        self.dynamic = spec.speculation_policy == "dynamic"
        self.costs = self.mtp_policy = None
        self._base = (0.0, 0.0)     # the coming step's suffix drafts: expected tokens, rows
        # hybrid: slot -> (expected tokens, rows, taken) of a suffix draft the head still runs
        # beside (plan_mtp weighs the two)
        self._alternatives: dict[int, tuple[float, int, bool]] = {}
        if self.dynamic and self.mtp_drafts:
            if mtp_policy is None:
                raise ValueError("SuffixDecoding: the dynamic MTP hybrid needs mtp_policy")
            self.mtp_policy = mtp_policy
        elif self.dynamic:
            if bucket_of is None:
                raise ValueError("SuffixDecoding: the dynamic policy needs bucket_of")
            self.costs = CostTable(self.k, bucket_of, refresh_every=0)
        self.num_observed = 0
        # the dynamic policy's calibration of the trees' probabilities: per probability bin,
        # draft tokens verified and accepted (a tree's counts can under- or over-rate a match)
        self.calib_trials = np.zeros((CALIBRATION_BINS,))
        self.calib_accepted = np.zeros((CALIBRATION_BINS,))
        self._verifying: dict[int, tuple[float, ...]] = {}   # slot -> probs of its drafts
        self.host_seconds = 0.0
        self.num_windows = self.num_drafts = self.num_mtp_windows = self.num_cut = 0
        self.num_mtp_rested = 0

    @staticmethod
    def key(seq) -> tuple:
        return seq.group.request_id, seq.index

    def admit(self, seq) -> None:
        """``seq`` entered a slot: its trees start from its prompt and output so far."""
        t0 = time.perf_counter()
        self.cache.start(self.key(seq), list(seq.prompt_ids) + list(seq.output_ids),
                         list(seq.output_ids))
        self.host_seconds += time.perf_counter() - t0

    def record(self, seq, tokens) -> None:
        """``seq`` committed ``tokens`` (those it kept)."""
        t0 = time.perf_counter()
        self.cache.extend(self.key(seq), [int(t) for t in tokens])
        self.host_seconds += time.perf_counter() - t0

    def release(self, seq) -> None:
        """``seq`` left its slot."""
        t0 = time.perf_counter()
        self.cache.stop(self.key(seq))
        self.host_seconds += time.perf_counter() - t0

    def draft(self, seq, limit: int) -> SuffixDraft:
        """``seq``'s suffix draft of at most ``limit`` tokens."""
        if limit <= 0:
            return EMPTY_DRAFT
        s = self.spec
        return self.cache.speculate(self.key(seq),
                                    _context_tail(seq, s.suffix_decoding_max_tree_depth - 1),
                                    limit, s.suffix_decoding_max_spec_factor,
                                    s.suffix_decoding_min_token_prob)

    def prepare(self, slots, next_drafts: np.ndarray, pending: np.ndarray | None,
                max_model_len: int):
        """The suffix drafts of the coming step's windows.

        Args:
          slots: the scheduler's ``list[Sequence | None]`` (``B``).
          next_drafts: i32[B] drafts in each slot's pending window: rewritten in place for the
            windows that take suffix drafts.
          pending: i32[B, K] the pending drafts (the last ``StepOutput.draft_tokens``; None
            before the first step).
          max_model_len: the engine's limit (no window passes it, nor ``max_tokens``).

        Returns:
          ``(override, pending)``: ``draft_override i32[B, K]`` (:data:`KEEP_DRAFT` where the
          proposer's drafts stay; None when nothing changes) and the pending drafts as the step
          will see them (``pending`` itself when nothing changes). Sets :attr:`mtp_off`.
        """
        t0 = time.perf_counter()
        B, K, M = len(slots), self.k, self.mtp_drafts
        override, off = None, np.zeros((B,), bool)
        drafts = {}
        for b, seq in enumerate(slots):
            if seq is None or seq.prefilling or not seq.output_ids:
                continue
            out = seq.output_ids
            limit = min(K, seq.params.max_tokens - len(out) - 1,
                        max_model_len - len(seq.prompt_ids) - len(out) - 1)
            drafts[b] = self.draft(seq, limit)
        if self.costs is not None and not any(s is not None and s.prefilling for s in slots):
            drafts = self.cut(drafts)
        gains = self.mtp_policy.gains() if self.mtp_policy is not None else None
        self._verifying, self.from_trees = {}, np.zeros((B,), bool)
        self._alternatives = {}
        base_tokens = base_rows = 0.0
        for b, d in drafts.items():
            worth = 0.0
            if gains is not None:   # dynamic hybrid: expected accepted tokens, trees vs MTP
                worth = score = float(self.calibrated(d.probs).sum())
                taken = score > gains[b, :next_drafts[b]].sum()
                off[b] = taken and score >= gains[b, :M].sum()
                if d.probs and not off[b]:   # plan_mtp weighs the head against it (as the base)
                    self._alternatives[b] = (worth, len(d.token_ids), taken)
                if not taken:
                    self.num_mtp_windows += int(next_drafts[b] > 0)
                    continue        # the MTP drafts stay (or neither drafts)
            elif M and d.score < M and not self.mtp_off[b]:
                self.num_mtp_windows += int(next_drafts[b] > 0)
                continue            # the MTP drafts stay
            else:
                off[b] = bool(M) and d.score >= M
            n = len(d.token_ids)
            if not n and (M or not next_drafts[b]):
                continue            # nothing to change (an MTP-held slot has no drafts)
            if override is None:
                override = np.full((B, K), KEEP_DRAFT, np.int32)
                pending = (np.full((B, K), -1, np.int32) if pending is None
                           else np.array(pending, np.int32))
            override[b, :n] = d.token_ids
            override[b, n:] = NO_DRAFT
            pending[b, :n] = d.token_ids
            pending[b, n:] = -1
            next_drafts[b] = n
            self.from_trees[b] = True
            if d.probs:
                self._verifying[b] = d.probs
                base_tokens, base_rows = base_tokens + worth, base_rows + n
            self.num_windows += bool(n)
            self.num_drafts += n
        self.mtp_off, self._base = off, (base_tokens, base_rows)
        self.host_seconds += time.perf_counter() - t0
        return override, pending

    def plan_mtp(self, proposing: np.ndarray, caps: np.ndarray) -> np.ndarray:
        """The dynamic hybrid's MTP draft limits ``i32[B]`` for the coming step: planned by the
        MTP policy for the ``proposing`` (bool[B]) slots not following a suffix match, each at
        most ``min(caps, M)`` (``caps`` i32[B]: the requests' own caps), in a step over every
        proposing slot whose suffix drafts (as :meth:`prepare` chose them) are the plan's base.

        A slot whose window had a suffix draft too weak to rest the head on its own (its
        alternative) drafts with the head only where that pays against the alternative, not
        against drafting nothing. Starting from the best plan with the head drafting for all
        of them (each later window then the head's), one slot at a time (the one whose
        alternative is worth most against the head's M drafts first) is moved to its suffix
        drafts (each later window worth what this one's suffix draft is: its expected accepted
        tokens and rows in the base, no MTP substeps for it) where that raises the best plan's
        expected tokens per second; the head rests for the slots moved (:attr:`mtp_off`; their
        cap is 0 in the plan, so they count as held at 0 drafts towards their probe). Slots
        capped at 0 and slots whose probe is due are not weighed (a probe keeps the head's
        estimates fresh where the trees draft most of the time)."""
        proposing = np.asarray(proposing, bool)
        active = proposing & ~self.mtp_off
        caps = np.minimum(caps, self.mtp_drafts).astype(np.int32)
        n, policy, alt = int(np.sum(proposing)), self.mtp_policy, self._alternatives
        due = policy.probe_due(active, caps)
        weigh = [b for b in alt if active[b] and caps[b] > 0 and not due[b]]
        tokens, rows = self._base
        if weigh:
            # the head's plan for every weighed slot: their taken suffix drafts leave the base
            tokens -= sum(alt[b][0] for b in weigh if alt[b][2])
            rows -= sum(alt[b][1] for b in weigh if alt[b][2])
            best = policy.plan_rate(active, caps, num_slots=n, base=(tokens, rows))
            gains = policy.gains()
            for b in sorted(weigh, key=lambda b: gains[b, :caps[b]].sum() - alt[b][0]):
                trial = caps.copy()
                trial[b] = 0
                rate = policy.plan_rate(active, trial, num_slots=n,
                                        base=(tokens + alt[b][0], rows + alt[b][1]))
                if rate > best * (1 + PLAN_RTOL):
                    best, caps = rate, trial
                    tokens, rows = tokens + alt[b][0], rows + alt[b][1]
                    self.mtp_off[b] = True
                    self.num_mtp_rested += 1
        return policy.draft_limits(active, caps, num_slots=n, base=(tokens, rows))

    def mtp_outcomes(self, out) -> dict:
        """``DynamicSpeculation.observe``'s per-slot arguments from the step's ``StepOutput``
        (``num_drafts``, ``num_accepted``, ``num_allowed``, i32[B]) with the windows drafted
        from the trees zeroed, so the MTP policy counts the MTP head's windows alone; no
        ``num_tokens``: the guard on the realised rate, which cannot tell the two drafters'
        tokens apart, learns nothing."""
        mtp = ~self.from_trees
        return dict(num_drafts=np.where(mtp, out.num_drafts, 0),
                    num_accepted=np.where(mtp, out.num_accepted, 0),
                    num_allowed=(None if out.num_allowed is None
                                 else np.where(mtp, out.num_allowed, 0)))

    def cut(self, drafts: dict[int, SuffixDraft]) -> dict[int, SuffixDraft]:
        """The dynamic policy: ``drafts`` (slot -> draft of a decode step over those ``n``
        slots) cut jointly to the plan with the most expected tokens per second.

        Every draft token is a candidate worth its probability (the tree's estimate that it and
        the draft tokens before it are accepted, :meth:`calibrated` by what was accepted so
        far; non-increasing along a draft). Ranked by
        falling probability (ties: earlier position, lower slot), every prefix of the ranking
        keeps a prefix of each draft; a prefix of ``r`` tokens is worth ``n + sum of their
        probabilities`` tokens for a step of ``n + r`` rows, priced by the cost table
        (:meth:`~jmtp.runtime.host.spec_policy.costs.Prices.step_time` at depth 0: the bucket's
        measured time; every bucket the same before anything is timed, so nothing is cut then).
        The best rate wins; near-ties (within :data:`PLAN_RTOL`) the fewest tokens."""
        n = len(drafts)
        prob = [self.calibrated(d.probs) for d in drafts.values()]
        if not n or not sum(len(p) for p in prob):
            return drafts
        slots = list(drafts)
        gain = np.concatenate(prob)
        pos = np.concatenate([np.arange(len(p)) for p in prob])
        slot = np.concatenate([np.full(len(p), i) for i, p in enumerate(prob)])
        order = np.lexsort((slot, pos, -gain))
        prices = self.costs.prices(self.num_observed)
        tokens = n + np.concatenate([[0.0], np.cumsum(gain[order])])
        rows = n + np.arange(len(gain) + 1)
        rate = tokens / run_prices(self.costs.bucket_table(n, rows[-1]), rows,
                                   np.zeros_like(rows), n, prices, self.k)
        keep = int(np.nonzero(rate * (1 + PLAN_RTOL) >= rate.max())[0][0])
        counts = np.bincount(slot[order[:keep]], minlength=n)
        out = {}
        for i, b in enumerate(slots):
            d, c = drafts[b], int(counts[i])
            self.num_cut += len(d.token_ids) - c
            out[b] = d if c == len(d.token_ids) else SuffixDraft(
                d.token_ids[:c], d.probs[:c], float(sum(d.probs[:c])), d.match_len if c else 0)
        return out

    def calibrated(self, probs) -> np.ndarray:
        """f64[n]: the probabilities ``probs`` (a draft's, from the trees) as measured: each is
        replaced by the accepted share of the verified draft tokens rated in its bin
        (:data:`CALIBRATION_BINS` equal bins of [0, 1]), with :data:`CALIBRATION_PRIOR`
        pseudo-trials at the tree's own value; kept non-increasing along the draft."""
        p = np.asarray(probs, np.float64)
        if not len(p):
            return p
        i = np.minimum((p * CALIBRATION_BINS).astype(np.int64), CALIBRATION_BINS - 1)
        est = ((self.calib_accepted[i] + CALIBRATION_PRIOR * p)
               / (self.calib_trials[i] + CALIBRATION_PRIOR))
        return np.minimum.accumulate(est)

    def observe(self, bucket, seconds: float, timed: bool, accepted: np.ndarray | None = None
                ) -> None:
        """A step ran ``seconds`` in ``bucket`` (``timed=False``: a step with a prefill chunk,
        not a decode step's price) and accepted ``accepted`` (i32[B]) of the drafts
        :meth:`prepare` gave it: the dynamic policy's cost table and calibration keep them."""
        if not self.dynamic:
            return
        if self.costs is not None:
            self.costs.record(bucket, seconds, 0, timed, self.num_observed)
        self.num_observed += 1
        if accepted is None:
            return
        if self._verifying:
            p = np.concatenate([np.asarray(v, np.float64) for v in self._verifying.values()])
            pos = np.concatenate([np.arange(len(v)) for v in self._verifying.values()])
            took = np.repeat(np.asarray(accepted)[list(self._verifying)],
                             [len(v) for v in self._verifying.values()])
            i = np.minimum((p * CALIBRATION_BINS).astype(np.int64), CALIBRATION_BINS - 1)
            np.add.at(self.calib_trials, i, 1.0)
            np.add.at(self.calib_accepted, i, pos < took)
        self._verifying = {}

    def mtp_limits(self, limits: np.ndarray) -> np.ndarray:
        """The step's draft limits with the MTP held off where a slot follows a suffix match."""
        return np.where(self.mtp_off, 0, limits).astype(np.int32) if self.mtp_off.any() else limits

    def stats(self) -> dict:
        """``suffix_*`` counters for ``LLMEngine.get_stats``."""
        return dict(suffix_host_seconds=self.host_seconds, suffix_windows=self.num_windows,
                    suffix_draft_tokens=self.num_drafts, suffix_mtp_windows=self.num_mtp_windows,
                    suffix_cut_tokens=self.num_cut, suffix_mtp_rested=self.num_mtp_rested,
                    **self.cache.stats())
