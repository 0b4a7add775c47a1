"""A test double of :class:`jmtp.runtime.device.runner.DeviceRunner`: the device simulated in numpy.

``LLMEngine.from_runner(FakeRunner(...))`` runs the whole host side (request table, scheduler,
prefix caching, hand-off bookkeeping, outputs) with no XLA compile. The fake keeps the device's
contract as ``jmtp.runtime.device.step`` states it, with a model that is a known function:

* the target's greedy next token after a sequence is :func:`next_token` of it (a hash), so the
  reference output of any request is :func:`reference` (plain decoding);
* speculation is lossless by construction: a slot's window holds ``d`` drafts (up to its draft
  limit); the first ``accept(...)`` of them equal the target's tokens and are accepted, then the
  target's own token is emitted (the bonus or the correction): emitted tokens never depend on K;
  ``num_accepted`` counts the accepted drafts that were committed (``min(accepted, kept)`` when
  a stop cuts the window);
* KV blocks are real ids per data shard: a step first tops every scheduled slot up to
  ``blocks_needed(seq_lens_decoder + rows + max(M - 1, 0))`` blocks
  (:func:`jmtp.runtime.device.target_stages.allocate_blocks`), in slot order, all or nothing, pausing a
  slot (no work) that its shard cannot cover while later slots may still be served; at the end
  of the step finished slots push their blocks back in table order (so a block freed in a step
  is never handed out in that same step), unless prefix caching is on (then the host retires
  them);
* a slot finishes on a stop id (the request's ``stop_token_ids`` and EOS unless ``ignore_eos``;
  not before ``min_tokens``), when ``max_tokens`` are emitted or when its sequence reaches
  ``max_model_len`` tokens (:func:`jmtp.runtime.device.target_stages.truncate_at_stop`), tokens after it
  cut; the next window's drafts are capped as the device caps them (``min(K, draft limit,
  max_tokens - emitted - 1, max_model_len - len(sequence) - 1)``, 0 once finished);
* each data shard's rows must fit the bucket's ``T`` and its slots with work its ``A``;
* a ``draft_override`` (the step's ``guide`` without token masks: suffix decoding) makes a
  window's drafts real tokens, forced up to a cut: the leading ones equal to the target's are
  accepted (the override must respect the caps above).
"""
from __future__ import annotations

import dataclasses
import hashlib
import types

import numpy as np

from jmtp.model.config import ModelConfig
from jmtp.pallas.block_allocator import blocks_needed
from jmtp.runtime.config import EngineConfig, SpeculativeConfig
from jmtp.runtime.device.bitmask import KEEP_DRAFT, NO_DRAFT
from jmtp.runtime.device.buckets import StepBucket, step_buckets
from jmtp.runtime.device.data_parallel import shard_config
from jmtp.runtime.device.state import FINISH_LENGTH, FINISH_STOP
from jmtp.runtime.device.step import StepOutput

FAKE_MODEL = ModelConfig(vocab_size=64, hidden_size=8, intermediate_size=16, num_layers=1,
                         num_heads=1, num_kv_heads=1, head_dim=8, eos_token_ids=(1,),
                         num_mtp_layers=1)


def next_token(tokens, vocab_size: int = 64) -> int:
    """The fake target's greedy token after ``tokens`` (never 0; EOS 1 now and then)."""
    h = hashlib.sha256(np.asarray(tokens[-4:], np.int64).tobytes() + bytes([len(tokens) % 7]))
    return 1 + int.from_bytes(h.digest()[:4], "little") % (vocab_size - 1)


def reference(prompt, max_tokens: int, stop_ids=(1,), min_tokens: int = 0,
              vocab_size: int = 64, max_model_len: int | None = None) -> list[int]:
    """Plain greedy decoding of the fake target: the independent oracle (a sequence stops at
    ``max_model_len`` tokens when given)."""
    seq, out = list(prompt), []
    while len(out) < max_tokens and (max_model_len is None or len(seq) < max_model_len):
        t = next_token(seq, vocab_size)
        seq.append(t)
        out.append(t)
        if t in stop_ids and len(out) > min_tokens:
            break
    return out


def default_accept(slot: int, step: int, drafts: int) -> int:
    """Accepted drafts of a window: varies with slot and step (0..drafts)."""
    return (slot * 3 + step) % (drafts + 1)


@dataclasses.dataclass
class _Slot:
    seq: list[int]             # context + emitted tokens on the device
    prompt_len: int            # context length to prefill
    computed: int              # positions in the KV cache (seq_lens_decoder)
    remaining: int             # tokens still allowed
    emitted: int = 0
    stop_ids: tuple = ()
    min_tokens: int = 0
    resume: int = -1
    owned: list = dataclasses.field(default_factory=list)
    shared: int = 0            # read-only cached prefix blocks
    drafts: int = 0            # drafts waiting in the next window
    done: bool = False         # finished (kept until the host retires it: prefix caching)


class FakeRunner:
    """The runner interface over a numpy simulation (see the module docstring).

    Args:
      max_num_seqs, block_size, num_blocks, max_model_len, max_num_batched_tokens: as for
        ``LLMEngine``.
      k: drafts per step (0: no speculation).
      data_parallel_size: data shards.
      enable_prefix_caching, max_logprobs: as for ``LLMEngine``.
      accept: ``accept(slot, step, drafts) -> accepted`` (default :func:`default_accept`).
    """

    mesh = None
    attention_backend = None
    graphdef = None

    def __init__(self, *, max_num_seqs: int = 4, block_size: int = 4, num_blocks: int | None = None,
                 max_model_len: int = 64, max_num_batched_tokens: int | None = None, k: int = 2,
                 data_parallel_size: int = 1, enable_prefix_caching: bool = False,
                 max_logprobs: int = 0, accept=default_accept, speculation_policy: str = "fixed",
                 model_config: ModelConfig = FAKE_MODEL, spec: SpeculativeConfig | None = None):
        if spec is None:
            spec = (SpeculativeConfig("mtp", k, speculation_policy=speculation_policy) if k
                    else SpeculativeConfig(method=None))
        k = spec.k
        ec = EngineConfig(max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                          block_size=block_size, num_blocks=num_blocks or 1,
                          max_num_batched_tokens=max_num_batched_tokens or max(
                              8, max_num_seqs * (k + 1)) * data_parallel_size,
                          max_stop_ids=8, max_logprobs=max_logprobs, spec=spec,
                          enable_prefix_caching=enable_prefix_caching)
        if not num_blocks:
            ec = dataclasses.replace(ec, num_blocks=max_num_seqs * ec.pages_per_seq)
        self.model_config, self.engine_config = model_config, ec
        self.num_shards = data_parallel_size
        self.shard_config = shard_config(ec.device_config(), data_parallel_size)   # as the runner
        self.drafter = None
        self.params, self.state, self.cache = {}, None, None
        self.mtp_cache = object() if k else None     # an MTP cache exists (prefix keys use it)
        self.accept = accept
        nb = self.shard_config.num_blocks
        self.free = [list(range(nb - 1, -1, -1)) for _ in range(data_parallel_size)]
        self.pinned = [set() for _ in range(data_parallel_size)]
        self.slots: list[_Slot | None] = [None] * max_num_seqs
        self.steps = 0
        self.first_call_seconds: dict[str, float] = {}
        self._compiled: set[StepBucket] = set()
        self.buckets_run: list[StepBucket] = []
        self.calls: list[str] = []

    # ------------------------------------------------------------------ bookkeeping
    @property
    def free_counts(self) -> list[int]:
        return [len(f) for f in self.free]

    def shard(self, b: int) -> int:
        return b // self.shard_config.max_num_seqs

    @property
    def compiled_buckets(self) -> frozenset:
        return frozenset(self._compiled)

    def uncompiled_buckets(self):
        return tuple(b for b in step_buckets(self.shard_config) if b not in self._compiled)

    def check_bucket(self, bucket) -> None:
        pass

    def compile_buckets(self, buckets=None, *, progress=False) -> dict:
        todo = self.uncompiled_buckets() if buckets is None else buckets
        self._compiled.update(todo)
        return {b.label: 0.0 for b in todo}

    def time_decode_buckets(self, repeats: int) -> dict:
        return {b: 1e-3 * b.num_tokens for b in step_buckets(self.shard_config)}

    def check_invariants(self) -> None:
        """Every block id of each shard exactly once among free, owned and pinned."""
        for d in range(self.num_shards):
            owned = [i for b, s in enumerate(self.slots) if s is not None and self.shard(b) == d
                     for i in s.owned]
            ids = sorted(self.free[d] + owned + sorted(self.pinned[d]))
            assert ids == list(range(self.shard_config.num_blocks)), (d, ids)

    # ------------------------------------------------------------------ device calls
    def insert(self, b, ids, prompt_len, remaining, row, resume_token, shared_ids=()):
        self.calls.append("insert")
        assert self.slots[b] is None, f"insert into busy slot {b}"
        stops = tuple(int(t) for t in row["stop_token_ids"] if t >= 0)
        self.slots[b] = _Slot(seq=[int(t) for t in ids[:prompt_len]], prompt_len=int(prompt_len),
                              computed=len(shared_ids) * self.engine_config.block_size,
                              remaining=int(remaining), stop_ids=stops,
                              min_tokens=int(row["min_tokens"]), resume=int(resume_token),
                              shared=len(shared_ids))

    def release(self, b: int) -> None:
        self.calls.append("release")
        s = self.slots[b]
        if s is None:       # released by the step that finished it (a step the host ran ahead)
            return
        self.free[self.shard(b)] += s.owned      # table order: the last block ends on top
        self.slots[b] = None

    def retire(self, b: int, keep) -> np.ndarray:
        self.calls.append("retire")
        s, d = self.slots[b], self.shard(b)
        kept = np.full((self.engine_config.pages_per_seq,), -1, np.int32)
        j = 0
        for i, blk in enumerate(s.owned):
            if i < len(keep) and keep[i]:
                self.pinned[d].add(blk)
                kept[j] = blk
                j += 1
            else:
                self.free[d].append(blk)
        self.slots[b] = None
        return kept

    def push_free(self, shard: int, ids) -> None:
        self.calls.append("push_free")
        for i in ids:
            self.pinned[shard].remove(int(i))
            self.free[shard].append(int(i))

    def peek_free_counts(self) -> list[int]:
        return self.free_counts

    def dispatch_step(self, bucket, chunks, limits, guide=None):
        """The step runs at once (the simulation keeps the device's order of calls); its
        outputs are the handle (``.out``, ``.first``)."""
        first = bucket not in self._compiled
        out = self.run_step(bucket, chunks, limits, guide)
        return types.SimpleNamespace(out=out, first=first, bucket=bucket)

    @staticmethod
    def fetch_step(handle) -> StepOutput:
        return handle.out

    def _forced_windows(self, guide) -> dict[int, list[int]]:
        """The windows a ``draft_override`` replaces: ``{slot: drafts}`` (forced tokens, then a
        cut; every token under the caps of the module docstring)."""
        masks, override = guide
        if masks is not None:
            raise NotImplementedError("the numpy double applies no structured-output masks")
        ec, out = self.engine_config, {}
        for b, s in enumerate(self.slots):
            row = [int(v) for v in override[b]]
            if s is None or all(v == KEEP_DRAFT for v in row):
                continue
            n = next((w for w, v in enumerate(row) if v < 0), len(row))
            assert all(v == NO_DRAFT for v in row[n:]), ("forced tokens, then a cut", row)
            assert s.computed >= s.prompt_len and not s.done, "a window of a decoding slot"
            assert n <= min(ec.k, s.remaining - s.emitted - 1,
                            ec.max_model_len - len(s.seq) - 1), ("drafts past a cap", b, n)
            out[b] = row[:n]
        return out

    def run_step(self, bucket, chunks, limits, guide=None) -> StepOutput:
        forced = self._forced_windows(guide) if guide is not None else {}
        for b, drafts in forced.items():
            self.slots[b].drafts = len(drafts)
        self._compiled.add(bucket)
        self.buckets_run.append(bucket)
        ec, bs = self.engine_config, self.engine_config.block_size
        B, K = ec.max_num_seqs, ec.k
        tokens = np.full((B, K + 1), -1, np.int32)
        out = {n: np.zeros((B,), np.int32) for n in ("num_tokens", "num_drafts", "num_accepted",
                                                     "finish_reason", "num_next_drafts",
                                                     "num_allowed")}
        finished, paused = np.zeros((B,), bool), np.zeros((B,), bool)
        # the schedule: a prefill chunk (clipped to the prompt left) or the verify window
        rows = np.zeros((B,), np.int64)
        for b, s in enumerate(self.slots):
            if s is None or s.done:
                continue
            rows[b] = (1 + s.drafts if s.computed >= s.prompt_len
                       else min(int(chunks[b]), s.prompt_len - s.computed))
        for d in range(self.num_shards):
            r = slice(d * self.shard_config.max_num_seqs, (d + 1) * self.shard_config.max_num_seqs)
            assert rows[r].sum() <= bucket.num_tokens and np.count_nonzero(rows[r]) <= (
                bucket.num_slots), ("a shard's work exceeds the step's bucket", d, bucket,
                                    rows.tolist())
        # the top-up: slots in order, all or nothing, before anything is released
        for b, s in enumerate(self.slots):
            if not rows[b]:
                continue
            need = (blocks_needed(s.computed + int(rows[b]) + max(ec.mtp_substeps - 1, 0), bs) - s.shared
                    - len(s.owned))
            d = self.shard(b)
            if need > len(self.free[d]):
                paused[b] = True
                continue
            s.owned += [self.free[d].pop() for _ in range(max(need, 0))]
        for b, s in enumerate(self.slots):
            if not rows[b] or paused[b]:
                continue
            decoding = s.computed >= s.prompt_len
            if not decoding:
                s.computed += int(rows[b])
                if s.computed < s.prompt_len:
                    continue
                new = [s.resume] if s.resume >= 0 else [next_token(s.seq)]
                s.resume = -1
            else:
                if b in forced:     # real drafts: the leading ones the target agrees with
                    a, ctx = 0, list(s.seq)
                    for d in forced[b]:
                        if d != next_token(ctx):
                            break
                        a, ctx = a + 1, ctx + [d]
                else:
                    a = min(self.accept(b, self.steps, s.drafts), s.drafts)
                out["num_drafts"][b], out["num_allowed"][b] = s.drafts, s.drafts
                new = []
                for _ in range(a + 1):
                    new.append(next_token(s.seq + new))
                s.computed += a + 1
            keep = []
            for t in new:   # stop ids, the length limit and max_model_len cut the window
                keep.append(t)
                s.emitted += 1
                stop = t in s.stop_ids and s.emitted > s.min_tokens
                if (stop or s.emitted >= s.remaining
                        or len(s.seq) + len(keep) >= ec.max_model_len):
                    finished[b] = True
                    out["finish_reason"][b] = FINISH_STOP if stop else FINISH_LENGTH
                    break
            if decoding:   # accepted drafts that were committed (a cut may drop the bonus)
                out["num_accepted"][b] = min(a, len(keep))
                s.computed -= len(new) - len(keep)     # positions past the cut are not kept
            s.seq += keep
            tokens[b, :len(keep)] = keep
            out["num_tokens"][b] = len(keep)
            allowed = min(K, int(limits[b]), s.remaining - s.emitted - 1,
                          ec.max_model_len - len(s.seq) - 1)
            if ec.spec.method == "suffix":    # the device proposes nothing: the host drafts
                allowed = 0
            s.drafts = max(allowed, 0) if not finished[b] else 0
            s.done = bool(finished[b])
        for b, s in enumerate(self.slots):   # the release of finished slots ends the step
            if s is not None and s.done and not ec.enable_prefix_caching:
                self.free[self.shard(b)] += s.owned
                self.slots[b] = None
        for b, s in enumerate(self.slots):   # paused and waiting slots keep their windows
            if s is not None:
                out["num_next_drafts"][b] = s.drafts
        self.steps += 1
        lp = None
        if ec.max_logprobs:
            n = ec.max_logprobs
            lp = dict(logprobs=-np.abs(tokens).astype(np.float32) / 64,
                      top_logprob_ids=np.repeat(np.arange(n, dtype=np.int32)[None, None],
                                                B, 0).repeat(K + 1, 1),
                      top_logprobs=np.full((B, K + 1, n), -1.0, np.float32))
        return StepOutput(tokens=tokens, finished=finished, paused=paused,
                          free_count=np.asarray(self.free_counts, np.int32), **out, **(lp or {}))

    def memory_per_device(self) -> dict:
        return {"params": (0, 0), "kv_cache": (0, 0)}

    def kv_cache_bytes(self) -> dict:
        return dict(target_values=0, target_scales=0, mtp_values=0, mtp_scales=0, values=0,
                    scales=0, total=0)


__all__ = ["FakeRunner", "FAKE_MODEL", "next_token", "reference", "default_accept"]
