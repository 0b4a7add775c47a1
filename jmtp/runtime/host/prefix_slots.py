"""Prefix caching in the engine: one :class:`~jmtp.runtime.host.prefix_cache.PrefixCache` per data
shard, and the bookkeeping that ties slots to cached blocks.

A data shard owns its blocks (shard-local ids, :mod:`jmtp.runtime.device.data_parallel`), so each shard
has its own cache: a request admitted into shard ``d`` reads only blocks cached by shard ``d``,
and its finished blocks are cached there. Tensor parallelism changes nothing here (a block id
names the same page on every ``model`` device, each holding its kv heads).

Per slot the host tracks the tokens the device holds (context and every emitted token), how many
positions the target cache holds (``dev_decoded``) and how many the MTP cache holds
(``mtp_valid``: the MTP does not run in a slot's last step); a retired slot caches the full
blocks valid in both (:func:`jmtp.runtime.device.step.retire_slot`).

A hybrid (gated-DeltaNet) target also needs its linear layers' state at the end of a cached
prefix: each shard then has a :class:`~jmtp.runtime.host.prefix_states.StateCache` too, a match is
cut back to the longest prefix with a state, and each slot captures block-boundary states into
an entry of its own (:mod:`jmtp.runtime.host.prefix_states` has the policy).
"""
from __future__ import annotations

import numpy as np

from jmtp.model.state_checkpoints import boundary_captured
from jmtp.runtime.host.prefix_cache import PrefixCache
from jmtp.runtime.host.prefix_states import PrefixMatch, StateCache, longest_with_state
from jmtp.runtime.host.requests import Sequence


class ShardedPrefixCache:
    """Prefix caches of every data shard and their slot bookkeeping.

    Args:
      block_size: KV block size.
      blocks_per_shard: blocks of one data shard.
      num_shards: data shards.
      with_mtp: the engine has an MTP cache (keys include the next block's first token).
      states_per_shard: a hybrid model's state entries per shard (0: not hybrid).
      state_bytes: bytes of one state entry.
      window: the state pool's checkpoints per slot (K+1).
    """

    def __init__(self, block_size: int, blocks_per_shard: int, num_shards: int, with_mtp: bool,
                 states_per_shard: int = 0, state_bytes: int = 0, window: int = 1):
        self.block_size, self.window = block_size, window
        self.caches = [PrefixCache(block_size, blocks_per_shard, with_mtp)
                       for _ in range(num_shards)]
        self.states = ([StateCache(states_per_shard, state_bytes) for _ in range(num_shards)]
                       if states_per_shard else None)
        self.num_state_fallbacks = 0          # admissions whose KV match was cut back
        self.state_fallback_tokens = 0

    def evictable(self) -> list[int]:
        """Per shard: cached blocks no slot reads (can be evicted for a new request)."""
        return [pc.num_evictable for pc in self.caches]

    def cached_tokens(self, ids: list[int]) -> int:
        """Prompt tokens of ``ids`` some shard holds cached (the most over shards)."""
        best = 0
        for d, pc in enumerate(self.caches):
            keys = pc.match(ids)[0]
            best = max(best, len(keys) if self.states is None
                       else longest_with_state(self.states[d], keys))
        return best * self.block_size

    def match(self, shard: int, seq: Sequence, use_cache: bool = True) -> PrefixMatch:
        """The longest cached prefix of ``seq``'s context (keys and shard-local block ids); for a
        hybrid model cut back to the longest one with a state (:class:`PrefixMatch`). Without
        ``use_cache`` none (the request computes every row)."""
        keys, ids = self.caches[shard].match(seq.context_ids) if use_cache else ([], [])
        if self.states is None:
            return PrefixMatch(keys, ids, kv_blocks=len(keys))
        st = self.states[shard]
        n = longest_with_state(st, keys)
        return PrefixMatch(keys[:n], ids[:n], st.get(keys[n - 1]) if n else -1,
                           len(keys) * self.block_size if len(keys) > n else 0, len(keys))

    def admitted(self, runner, shard: int, b: int, seq: Sequence, m: PrefixMatch) -> None:
        """``seq`` was inserted into slot ``b`` reading the cached blocks ``m.keys``: take
        references, count the hit, and start its device bookkeeping after the shared prefix; a
        hybrid model's slot also loads the prefix's state and takes an entry to capture into."""
        keys = m.keys
        self.caches[shard].acquire(keys, len(seq.context_ids))
        seq.prefix_keys = keys
        seq.prefilled = len(keys) * self.block_size
        seq.device_ids = list(seq.context_ids)
        seq.dev_decoded = seq.mtp_valid = seq.prefilled
        if self.states is not None:
            entry = self.states[shard].take()
            runner.set_slot_state(b, m.load_entry, entry)
            seq.state_entry, seq.state_pos, seq.state_target = entry, 0, m.capture_at
            if m.kv_blocks > len(keys):
                self.num_state_fallbacks += 1
                self.state_fallback_tokens += (m.kv_blocks - len(keys)) * self.block_size

    def stepped(self, runner, shard: int, b: int, seq: Sequence, tokens, chunk: int,
                was_decode: bool, finished: bool, num_drafts: int = 0) -> None:
        """Slot bookkeeping after a step that emitted ``tokens`` and prefilled ``chunk`` (a
        verify window of ``num_drafts`` drafts when ``was_decode``); a hybrid model's slot
        tracks the boundary its capture entry holds (the device's rule,
        :func:`~jmtp.model.state_checkpoints.boundary_captured`) and caches a branch point
        once captured."""
        p0 = seq.dev_decoded
        seq.device_ids += [int(x) for x in tokens]
        seq.dev_decoded += len(tokens) if was_decode else chunk
        if not finished:       # the MTP does not run in a slot's last step
            seq.mtp_valid = seq.dev_decoded
        if self.states is None or seq.state_entry < 0:
            return
        q = 1 + num_drafts if was_decode else chunk
        bound, _, ok = boundary_captured(p0, q, seq.dev_decoded - p0, not was_decode, finished,
                                         self.block_size, self.window)
        if ok:
            seq.state_pos = int(bound)
        if seq.state_target and seq.state_pos == seq.state_target:
            # a branch point: cache it now and capture the rest into a new entry
            st = self.states[shard]
            key = self.caches[shard].keys(seq.device_ids, seq.state_pos // self.block_size)[-1]
            st.put(seq.state_entry, key)
            seq.state_entry, seq.state_pos, seq.state_target = st.take(), 0, 0
            runner.set_slot_state(b, -1, seq.state_entry)

    def retire(self, runner, shard: int, b: int, seq: Sequence, cache_blocks: bool) -> None:
        """Empty slot ``b`` on the device: with ``cache_blocks`` keep its full blocks whose target
        and MTP entries are valid and whose content is not cached yet, and cache them; return
        the other owned blocks; drop the slot's references."""
        pc = self.caches[shard]
        keep = np.zeros((runner.engine_config.pages_per_seq,), bool)
        keys: list[bytes] = []
        state_key = None
        if cache_blocks:
            full = min(seq.dev_decoded, seq.mtp_valid) // self.block_size
            all_keys = pc.keys(seq.device_ids, full)
            keys = all_keys[len(seq.prefix_keys):]
            keep[:len(keys)] = pc.missing(keys)
            n = seq.state_pos // self.block_size
            if 0 < n <= len(all_keys):     # the continuation point, its KV blocks cached too
                state_key = all_keys[n - 1]
        if self.states is not None and seq.state_entry >= 0:
            st = self.states[shard]
            st.put(seq.state_entry, state_key) if state_key is not None else st.drop(
                seq.state_entry)
            seq.state_entry, seq.state_pos, seq.state_target = -1, 0, 0
        kept = runner.retire(b, keep)
        if keep.any():     # kept ids in table order; -1 past the blocks the slot owned
            pairs = [(k, int(i)) for k, i in zip([k for k, m in zip(keys, keep) if m], kept)
                     if i >= 0]
            pc.insert([k for k, _ in pairs], [i for _, i in pairs])
        pc.release(seq.prefix_keys)
        seq.prefix_keys = []

    def ensure_free(self, runner, shard: int, need: int, free: int | None = None) -> int:
        """Evict unreferenced cached blocks of ``shard`` (LRU) until ``need`` blocks are free on
        the device or nothing is left to evict; evicted blocks go back to its free stack.
        ``free``: the shard's free blocks as the caller counts them (default: the runner's
        exact count; with a step in flight, a lower bound). Returns the blocks pushed back."""
        pc = self.caches[shard]
        short = need - (runner.free_counts[shard] if free is None else free)
        if short > 0 and pc.num_evictable:
            ids = pc.evict(short)
            runner.push_free(shard, ids)
            return len(ids)
        return 0

    def stats(self) -> dict:
        """``get_stats`` keys over every shard (see :meth:`LLMEngine.get_stats`)."""
        q = sum(pc.num_queried_tokens for pc in self.caches)
        h = sum(pc.num_hit_tokens for pc in self.caches)
        out = dict(prefix_cache_hit_rate=h / q if q else 0.0, prefix_cache_queried_tokens=q,
                   prefix_cache_hit_tokens=h, num_cached_blocks=sum(map(len, self.caches)),
                   num_evictable_blocks=sum(self.evictable()),
                   num_evicted_blocks=sum(pc.num_evicted for pc in self.caches))
        if self.states is not None:
            sts = self.states
            out.update(num_cached_states=sum(map(len, sts)),
                       num_evicted_states=sum(s.num_evicted for s in sts),
                       prefix_state_cache_bytes=sum(s.cached_bytes for s in sts),
                       prefix_state_cache_capacity_bytes=sum(s.num_entries * s.entry_bytes
                                                             for s in sts),
                       num_state_fallbacks=self.num_state_fallbacks,
                       state_fallback_tokens=self.state_fallback_tokens)
        return out


__all__ = ["ShardedPrefixCache"]
