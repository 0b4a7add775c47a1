"""Prefix caching with MTP: the host-side map from content hashes to cached KV blocks.

Design (``LLM(enable_prefix_caching=True)``; on a mesh each data shard has its own cache,
:mod:`jmtp.runtime.host.prefix_slots`):

* **What a cached block is.** A full KV block ``i`` of a sequence (positions
  ``[i*bs, (i+1)*bs)``) holds the *target* KV of those positions and, at the same block id, the
  *MTP* KV of those positions. Target entry ``p`` depends on tokens ``[0, p]``; MTP entry ``p``
  pairs token ``p+1`` with the target hidden state ``p`` (the shifted MTP cache, see
  :mod:`jmtp.runtime.device.step`), so it depends on tokens ``[0, p+1]`` (module 0's cache; with
  several MTP modules the later ones' caches are only partly written, see the known limitation
  in ``docs/architecture.md``). A block is therefore keyed by
  a hash chain over token ids, block by block (``key_i = sha256(key_{i-1} ‖ tokens of block i)``)
  and, when the engine has an MTP cache, **also the first token of block i+1**. A new request
  reuses block ``i`` only if its tokens ``[0, (i+1)*bs]`` match, so every MTP entry it reads was
  computed from its own tokens; the MTP entry of the last shared position is reused only when the
  token after it matches too. Otherwise the block is not matched and the position is recomputed
  (it starts the request's own first block), never reused wrong: this is the MTP boundary rule.
  The hidden state of the last shared position is never needed: the MTP's first new position is
  the first recomputed one, whose hidden state the target produces in the same step.
* **Sharing.** A request admitted with ``n`` matched blocks gets them at the front of its
  sequence, read-only (``EngineState.num_shared`` / ``shared_tables``); its prefill starts at
  ``seq_lens_decoder = n*bs`` (``n*bs < prompt length``: at least one prompt position is
  computed, which gives the first token's logits). The on-device allocator never sees shared
  blocks: the slot's owned blocks (``block_tables[b, :num_owned]``) hold pages ``n, n+1, ...``,
  the step reads through :func:`jmtp.runtime.device.state.effective_block_tables`, and it writes only
  positions ``>= seq_lens_decoder``, so a shared block is never written.
* **Retaining.** With caching on the step does not release finished slots; the host retires each
  finished slot with :func:`jmtp.runtime.device.slots.retire_slot`, which keeps (pins) the owned full
  blocks whose target and MTP entries are all valid and whose key is not cached yet, and returns
  the rest to the free stack. Valid: the target holds positions ``[0, seq_lens_decoder)``; the
  MTP the same, except that it does not run in the step where a slot finishes, so it holds the
  positions decoded before that step (the host tracks both, :class:`PrefixCache` is told the
  valid length).
* **Reference counts and LRU.** Each cached block has a reference count (slots reading it). At
  zero it joins an LRU list; eviction pops the least recently used and gives the block back to
  the device free stack (:func:`jmtp.runtime.device.slots.push_free_blocks`). The host evicts before a
  step so that the free stack covers what the step can ask for, so cached blocks never cause a
  pause or preemption that an engine without the cache would not have. A block with references
  is never evicted, hence never reused for other content while shared.
* **Invariant** (checked by the tests): ``free_count + sum(num_owned) + num_cached_blocks ==
  num_blocks``, every id exactly once among the free stack, the owned tables and the cache.

Source: the hash chain over full blocks with reference counts and an LRU of free cached blocks is
vLLM's automatic prefix caching (``vllm/v1/core/kv_cache_utils.py`` ``hash_block_tokens``,
``BlockPool``; facts only). The MTP next-token rule is jmtp's.
"""
from __future__ import annotations

import collections
import dataclasses
import hashlib

import numpy as np

_ROOT = b"jmtp-prefix-v1"


def block_keys(tokens, block_size: int, num_blocks: int, with_next_token: bool) -> list[bytes]:
    """Keys of the first ``num_blocks`` full blocks of ``tokens`` (a hash chain).

    ``key_i = sha256(key_{i-1} ‖ tokens[i*bs:(i+1)*bs] ‖ [tokens[(i+1)*bs]])`` (the bracketed
    next token only ``with_next_token``, i.e. with an MTP cache). Block ``i`` needs
    ``(i+1)*bs`` tokens, plus one with the next token; fewer blocks are returned if ``tokens`` is
    shorter.

    Raises:
      ValueError: ``block_size < 1`` or ``num_blocks < 0``.
    """
    if block_size < 1 or num_blocks < 0:
        raise ValueError(f"block_size must be >= 1 and num_blocks >= 0, got {block_size}, "
                         f"{num_blocks}")
    arr = np.asarray(tokens, np.int64)
    extra = 1 if with_next_token else 0
    n = min(num_blocks, max(len(arr) - extra, 0) // block_size)
    keys, parent = [], _ROOT
    for i in range(n):
        end = (i + 1) * block_size + extra
        h = hashlib.sha256(parent)
        h.update(arr[i * block_size:end].tobytes())
        parent = h.digest()
        keys.append(parent)
    return keys


@dataclasses.dataclass
class CachedBlock:
    block_id: int
    ref_count: int = 0


class PrefixCache:
    """Host-side prefix cache: content key -> cached block id, reference counts, LRU.

    Pure bookkeeping (no device calls): the engine moves blocks on the device as the methods
    tell it. ``num_blocks`` is the engine's block count (ids must lie in ``[0, num_blocks)``).
    """

    def __init__(self, block_size: int, num_blocks: int, with_next_token: bool):
        if block_size < 1 or num_blocks < 1:
            raise ValueError(f"block_size and num_blocks must be >= 1, got {block_size}, "
                             f"{num_blocks}")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.with_next_token = with_next_token
        self._blocks: dict[bytes, CachedBlock] = {}
        self._ids: dict[int, bytes] = {}
        self._lru: collections.OrderedDict[bytes, None] = collections.OrderedDict()  # refs == 0
        # stats
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0
        self.num_evicted = 0

    # -------------------------------------------------------------- queries
    def __len__(self) -> int:
        return len(self._blocks)

    @property
    def num_evictable(self) -> int:
        """Cached blocks no slot reads (ref count 0)."""
        return len(self._lru)

    def cached_ids(self) -> list[int]:
        return list(self._ids)

    def ref_count(self, block_id: int) -> int:
        return self._blocks[self._ids[block_id]].ref_count

    def keys(self, tokens, num_blocks: int) -> list[bytes]:
        return block_keys(tokens, self.block_size, num_blocks, self.with_next_token)

    def match(self, tokens) -> tuple[list[bytes], list[int]]:
        """Longest cached prefix usable by a request whose context is ``tokens``: keys and block
        ids of blocks ``0..n-1`` with ``n*bs < len(tokens)`` (one position is always computed).
        Nothing is acquired."""
        max_blocks = (len(tokens) - 1) // self.block_size
        keys, ids = [], []
        for k in self.keys(tokens, max_blocks):
            blk = self._blocks.get(k)
            if blk is None:
                break
            keys.append(k)
            ids.append(blk.block_id)
        return keys, ids

    # -------------------------------------------------------------- references
    def acquire(self, keys: list[bytes], num_prompt_tokens: int | None = None) -> None:
        """A slot starts reading these cached blocks (counts a hit of ``len(keys) * bs`` out of
        ``num_prompt_tokens`` prompt tokens when given)."""
        for k in keys:
            blk = self._blocks[k]
            blk.ref_count += 1
            self._lru.pop(k, None)
        if num_prompt_tokens is not None:
            self.num_queried_tokens += num_prompt_tokens
            self.num_hit_tokens += len(keys) * self.block_size

    def release(self, keys: list[bytes]) -> None:
        """A slot stops reading these blocks; blocks left unreferenced become the most recently
        used evictable ones, deepest block first (so among them the deepest is evicted first and
        a parent outlives its children: an evicted parent would make them unreachable).

        Raises:
          ValueError: a key not cached or released more often than acquired.
        """
        for k in reversed(keys):
            blk = self._blocks.get(k)
            if blk is None or blk.ref_count <= 0:
                raise ValueError("PrefixCache.release: block not held")
            blk.ref_count -= 1
            if blk.ref_count == 0:
                self._lru[k] = None

    # -------------------------------------------------------------- content
    def missing(self, keys: list[bytes]) -> list[bool]:
        """For each key: not cached yet (worth retaining)."""
        return [k not in self._blocks for k in keys]

    def insert(self, keys: list[bytes], block_ids: list[int]) -> None:
        """Cache newly retained blocks (ref count 0, most recently used; deepest first, as
        :meth:`release` orders them).

        Raises:
          ValueError: a key already cached, an id already cached or outside ``[0, num_blocks)``.
        """
        if len(keys) != len(block_ids):
            raise ValueError("PrefixCache.insert: keys and block_ids differ in length")
        for k, b in reversed(list(zip(keys, block_ids))):
            b = int(b)
            if k in self._blocks:
                raise ValueError("PrefixCache.insert: key already cached")
            if b in self._ids or not 0 <= b < self.num_blocks:
                raise ValueError(f"PrefixCache.insert: block id {b} already cached or outside "
                                 f"[0, {self.num_blocks})")
            self._blocks[k] = CachedBlock(b)
            self._ids[b] = k
            self._lru[k] = None

    def evict(self, n: int) -> list[int]:
        """Drop up to ``n`` unreferenced blocks, least recently used first; returns their ids
        (the engine gives them back to the device free stack)."""
        out = []
        while self._lru and len(out) < n:
            k, _ = self._lru.popitem(last=False)
            blk = self._blocks.pop(k)
            del self._ids[blk.block_id]
            out.append(blk.block_id)
        self.num_evicted += len(out)
        return out

    @property
    def hit_rate(self) -> float:
        """Cached prompt tokens / prompt tokens over every admission (0.0 before any)."""
        return self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0
