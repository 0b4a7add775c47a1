"""Prefix caching for hybrid (gated-DeltaNet) targets: the host side of the block-boundary state
checkpoints (:mod:`jmtp.model.state_checkpoints` holds the device side and the capture rule).

A cached prefix of ``n`` KV blocks is usable by a hybrid target only together with its linear
layers' state after token ``n·bs - 1``. :class:`StateCache` maps a block key (the key of the
prefix's last block, :func:`jmtp.runtime.host.prefix_cache.block_keys`, whose chain covers every
token of the prefix and, with an MTP head, the next one) to one of ``S`` device entries, with
its own LRU eviction and byte accounting, beside the KV blocks' :class:`PrefixCache`.

**Which boundaries are kept** (one entry each; saving every boundary a prefill crosses would cost
one state per block, 77 MB per 16 tokens for Qwen3-Next-80B):

* the *continuation point*: the last block boundary a request passed before its final step. The
  next turn of a conversation repeats the request's prompt and output, so it matches the KV
  blocks up to about there and continues from that state (a long prefill chunk that would run
  past the context's last boundary ends on it, so that boundary is captured:
  :func:`jmtp.runtime.host.scheduler.capture_chunk`);
* the *branch point*: a request whose KV match reaches further than any cached state (another
  request cached the blocks of a shared system prompt, but its state lies past the shared part)
  recomputes from the longest boundary that has a state, and captures the state at the end of
  its KV match on the way: the scheduler ends a prefill chunk there (one extra step once per new
  branch point), and the next request that shares the prefix hits.

Each slot owns one *open* entry that the step writes its boundary states into (the last boundary
crossed overwrites the one before); when the slot retires, the entry becomes a cached one under
the key of its boundary if the KV blocks up to it are cached too, else it is freed. A branch
point is cached as soon as it is captured, and the slot takes a new open entry. A hit copies the
entry into the slot at admission: a cached entry is never read later, so every cached entry can
be evicted at any time (LRU), and no reference count is needed.

**Exactness.** A request matches ``n`` KV blocks and uses ``m <= n`` of them, the longest prefix
whose last block's key has a state; it recomputes from ``m·bs``. A state was captured from rows
whose inputs were that exact token chain (the key covers every token), so a hit never gives a
wrong state; an evicted one only costs recompute.

The vLLM and SGLang hybrid caches make other choices (states at every chunk end, or at the
prompt's end only); the ones here follow the two reuse patterns above with two entries per
request at most. ``docs/hybrid.md`` has the measurements.
"""
from __future__ import annotations

import collections
import dataclasses


@dataclasses.dataclass
class PrefixMatch:
    """What an admission reads from the prefix caches.

    Attributes:
      keys / block_ids: the cached KV blocks the request reads (hybrid: cut back to the longest
        prefix with a state).
      load_entry: the state entry it continues from (-1: none; the zero state at position 0).
      capture_at: the block boundary whose state the request must capture (its KV match's end
        when that is past ``len(keys)``; 0: none).
      kv_blocks: blocks of the KV match before any cut.
    """

    keys: list
    block_ids: list
    load_entry: int = -1
    capture_at: int = 0
    kv_blocks: int = 0


class StateCache:
    """One data shard's block-boundary state entries: key -> entry, LRU, free entries.

    Pure bookkeeping; the engine copies states on the device as it is told. ``num_entries``: the
    device entries (``LinearState.saved``); ``entry_bytes``: bytes of one (for the stats).
    Invariant: ``len(free) + num_cached + entries held by slots == num_entries``.
    """

    def __init__(self, num_entries: int, entry_bytes: int):
        if num_entries < 1:
            raise ValueError(f"StateCache needs >= 1 entry, got {num_entries}")
        self.num_entries, self.entry_bytes = num_entries, entry_bytes
        self.free: list[int] = list(range(num_entries - 1, -1, -1))
        self._cached: collections.OrderedDict[bytes, int] = collections.OrderedDict()
        self.num_evicted = 0
        self.num_inserted = 0

    def __len__(self) -> int:
        return len(self._cached)

    def __contains__(self, key: bytes) -> bool:
        return key in self._cached

    def cached_entries(self) -> list[int]:
        return list(self._cached.values())

    def get(self, key: bytes) -> int:
        """The entry holding ``key``'s state (now the most recently used), or -1."""
        e = self._cached.get(key)
        if e is None:
            return -1
        self._cached.move_to_end(key)
        return e

    def take(self) -> int:
        """An entry for a slot to capture into: a free one, else the least recently used cached
        one (evicted).

        Raises:
          RuntimeError: none free or cached (every entry held by a slot: the engine sizes the
            entries at one per slot at least, so this means a bug)."""
        if self.free:
            return self.free.pop()
        if not self._cached:
            raise RuntimeError("StateCache.take: every state entry is held by a slot")
        _, e = self._cached.popitem(last=False)
        self.num_evicted += 1
        return e

    def put(self, entry: int, key: bytes) -> None:
        """A slot hands back ``entry`` holding the state of ``key``: cached (most recently used),
        or freed if ``key`` is cached already."""
        if key in self._cached:
            self.free.append(entry)
            self._cached.move_to_end(key)
            return
        self._cached[key] = entry
        self.num_inserted += 1

    def drop(self, entry: int) -> None:
        """A slot hands back ``entry`` without a usable state."""
        self.free.append(entry)

    def evict(self, n: int) -> list[int]:
        """Drop up to ``n`` cached states, least recently used first; returns their entries."""
        out = []
        while self._cached and len(out) < n:
            out.append(self._cached.popitem(last=False)[1])
        self.free.extend(out)
        self.num_evicted += len(out)
        return out

    @property
    def cached_bytes(self) -> int:
        return len(self._cached) * self.entry_bytes


def longest_with_state(states: StateCache, keys: list) -> int:
    """Blocks of the longest prefix of ``keys`` whose last block's key has a cached state."""
    n = len(keys)
    while n and keys[n - 1] not in states:
        n -= 1
    return n


__all__ = ["PrefixMatch", "StateCache", "longest_with_state"]
