"""Prefix caching in the engine: one :class:`~jmtp.runtime.prefix_cache.PrefixCache` per data
shard, and the bookkeeping that ties slots to cached blocks.

A data shard owns its blocks (shard-local ids, :mod:`jmtp.runtime.data_parallel`), so each shard
has its own cache: a request admitted into shard ``d`` reads only blocks cached by shard ``d``,
and its finished blocks are cached there. Tensor parallelism changes nothing here (a block id
names the same page on every ``model`` device, each holding its kv heads).

Per slot the host tracks the tokens the device holds (context and every emitted token), how many
positions the target cache holds (``dev_decoded``) and how many the MTP cache holds
(``mtp_valid``: the MTP does not run in a slot's last step); a retired slot caches the full
blocks valid in both (:func:`jmtp.runtime.step.retire_slot`).
"""
from __future__ import annotations

import numpy as np

from jmtp.runtime.prefix_cache import PrefixCache
from jmtp.runtime.requests import Sequence


class ShardedPrefixCache:
    """Prefix caches of every data shard and their slot bookkeeping.

    Args:
      block_size: KV block size.
      blocks_per_shard: blocks of one data shard.
      num_shards: data shards.
      with_mtp: the engine has an MTP cache (keys include the next block's first token).
    """

    def __init__(self, block_size: int, blocks_per_shard: int, num_shards: int, with_mtp: bool):
        self.block_size = block_size
        self.caches = [PrefixCache(block_size, blocks_per_shard, with_mtp)
                       for _ in range(num_shards)]

    def evictable(self) -> list[int]:
        """Per shard: cached blocks no slot reads (can be evicted for a new request)."""
        return [pc.num_evictable for pc in self.caches]

    def cached_tokens(self, ids: list[int]) -> int:
        """Prompt tokens of ``ids`` some shard holds cached (the most over shards)."""
        return max(len(pc.match(ids)[1]) for pc in self.caches) * self.block_size

    def match(self, shard: int, seq: Sequence) -> tuple[list[bytes], list[int]]:
        """Keys and shard-local ids of the longest cached prefix of ``seq``'s context."""
        return self.caches[shard].match(seq.context_ids)

    def admitted(self, shard: int, seq: Sequence, keys: list[bytes]) -> None:
        """``seq`` was inserted reading the cached blocks ``keys``: take references, count the
        hit, and start its device bookkeeping after the shared prefix."""
        self.caches[shard].acquire(keys, len(seq.context_ids))
        seq.prefix_keys = keys
        seq.prefilled = len(keys) * self.block_size
        seq.device_ids = list(seq.context_ids)
        seq.dev_decoded = seq.mtp_valid = seq.prefilled

    @staticmethod
    def stepped(seq: Sequence, tokens, chunk: int, was_decode: bool, finished: bool) -> None:
        """Slot bookkeeping after a step that emitted ``tokens`` and prefilled ``chunk``."""
        seq.device_ids += [int(x) for x in tokens]
        seq.dev_decoded += len(tokens) if was_decode else chunk
        if not finished:       # the MTP does not run in a slot's last step
            seq.mtp_valid = seq.dev_decoded

    def retire(self, runner, shard: int, b: int, seq: Sequence, cache_blocks: bool) -> None:
        """Empty slot ``b`` on the device: with ``cache_blocks`` keep its full blocks whose target
        and MTP entries are valid and whose content is not cached yet, and cache them; return
        the other owned blocks; drop the slot's references."""
        pc = self.caches[shard]
        keep = np.zeros((runner.engine_config.pages_per_seq,), bool)
        keys: list[bytes] = []
        if cache_blocks:
            full = min(seq.dev_decoded, seq.mtp_valid) // self.block_size
            keys = pc.keys(seq.device_ids, full)[len(seq.prefix_keys):]
            keep[:len(keys)] = pc.missing(keys)
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
        return dict(prefix_cache_hit_rate=h / q if q else 0.0, prefix_cache_queried_tokens=q,
                    prefix_cache_hit_tokens=h, num_cached_blocks=sum(map(len, self.caches)),
                    num_evictable_blocks=sum(self.evictable()),
                    num_evicted_blocks=sum(pc.num_evicted for pc in self.caches))


__all__ = ["ShardedPrefixCache"]
