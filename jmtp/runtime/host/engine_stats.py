"""The engine's monitoring counters (a mixin of :class:`~jmtp.runtime.host.llm_engine.LLMEngine`):
:meth:`StatsAPI.get_stats` gathers the request table's, the scheduler's, the runner's free-block
counts, prefix caching's, suffix decoding's, the step timeline's and the dynamic policy's
counters into one dict of plain Python values."""
from __future__ import annotations


class StatsAPI:
    """Mixed into ``LLMEngine``; reads its ``requests``, ``scheduler``, ``runner``,
    ``prefix_caches``, ``suffix``, ``timeline``, ``spec_policy`` and step counters."""

    def get_stats(self) -> dict:
        """Counters for monitoring (plain Python values).

        Keys: ``num_unfinished_requests``; ``num_waiting`` / ``num_running`` (samples queued / in
        a slot); ``num_free_blocks`` / ``num_blocks`` (KV blocks); ``num_steps``,
        ``last_step_seconds`` (wall time of the last :meth:`step`, s), ``num_preemptions``,
        ``num_generated_tokens``; cumulative speculation counters over every sample ever run:
        ``num_draft_tokens``, ``num_accepted_tokens``, ``accepted_per_position`` (K counts),
        ``num_decode_steps``, ``num_decode_tokens`` (see :class:`SpecDecodeMetrics`). With
        prefix caching also ``prefix_cache_hit_rate`` (cached prompt tokens / prompt tokens over
        every admission), ``prefix_cache_queried_tokens``, ``prefix_cache_hit_tokens``,
        ``num_cached_blocks`` (held by the caches, not free), ``num_evictable_blocks`` (cached,
        read by no slot) and ``num_evicted_blocks``, summed over data shards. With
        ``speculation_policy="dynamic"`` also ``spec_policy_plans``,
        ``spec_policy_drafting_plans``, ``spec_policy_holds`` and ``spec_policy_host_seconds``
        (host time in the policy, s; :class:`DynamicSpeculation`). Structured outputs:
        ``structured_host_seconds`` (host time building bitmasks and repairing drafts, s),
        ``structured_constrained_steps`` (steps with a constrained sample) and
        ``structured_forced_drafts`` (drafts the grammar forced: jump-forward). Suffix decoding:
        ``suffix_*`` (:meth:`~jmtp.runtime.host.suffix_decoding.SuffixDecoding.stats`). With a step in
        flight (``async_scheduling``) ``num_free_blocks`` is the newest count computed (it may
        lag that step). Once :attr:`timeline` records, also its :meth:`StepTimeline.stats
        <jmtp.runtime.host.timeline.StepTimeline.stats>` (``device_idle_share`` and the host and
        device seconds behind it).
        """
        so = self.requests.structured
        stats = dict(
            **self.requests.stats(), structured_host_seconds=so.host_seconds,
            structured_constrained_steps=so.num_constrained_steps,
            structured_forced_drafts=so.num_forced_drafts, num_running=self.scheduler.num_running,
            num_free_blocks=sum(self.runner.free_counts if self._inflight is None
                                else self.runner.peek_free_counts()),
            num_blocks=self.engine_config.num_blocks,
            num_steps=self.num_steps, last_step_seconds=self.last_step_seconds,
            num_preemptions=self.scheduler.num_preemptions)
        for part in (self.prefix_caches, self.suffix):
            stats.update(part.stats() if part is not None else {})
        stats.update(self.timeline.stats() if self.timeline.enabled or self.timeline.steps else {})
        if (pol := self.spec_policy) is not None:
            stats.update(spec_policy_plans=pol.num_plans, spec_policy_holds=pol.num_holds,
                         spec_policy_drafting_plans=pol.num_drafting_plans,
                         spec_policy_host_seconds=self.policy_seconds)
        return stats


__all__ = ["StatsAPI"]
