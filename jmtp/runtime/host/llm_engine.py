"""``LLMEngine``: the serving loop, one step at a time (vLLM ``LLMEngine`` shape).

Thin wiring of these parts (data flows one way):

* :class:`~jmtp.runtime.host.engine_args.EngineArgs` checks the arguments, loads the model and builds
  the :class:`~jmtp.runtime.device.runner.DeviceRunner` (parameters, state, caches, jitted functions,
  one device or a mesh);
* the :class:`~jmtp.runtime.host.requests.RequestTable` validates requests and turns emitted tokens
  into outputs (detokenizing, stop strings, logprobs, metrics);
* the :class:`~jmtp.runtime.host.scheduler.Scheduler` admits sequences into slots, splits the token
  budget, picks the bucket and chooses what to preempt;
* beside them: prefix caching (:mod:`jmtp.runtime.host.prefix_slots`), the hand-off
  (:mod:`jmtp.runtime.host.handoff_engine`) and the dynamic speculation policy
  (:mod:`jmtp.runtime.host.spec_policy`).
Not thread-safe: call it from one thread at a time (any thread).
"""
from __future__ import annotations

import gc
import logging
import time
from typing import Iterable

import jax
import numpy as np

from jmtp.core.errors import RequestFailedError
from jmtp.runtime.device.buckets import choose_bucket
from jmtp.runtime.host.engine_args import BuiltEngine, EngineArgs
from jmtp.runtime.host.engine_compile import CompileAPI
from jmtp.runtime.host.engine_stats import StatsAPI
from jmtp.runtime.host.handoff_engine import HandOff, HandOffAPI
from jmtp.runtime.host.inflight import (StepRecord, default_async_scheduling, free_lower_bound,
                                        needs_sync)
from jmtp.runtime.host.outputs import RequestOutput
from jmtp.runtime.host.plan_sync import plan_sync_for
from jmtp.runtime.host.prefix_slots import ShardedPrefixCache
from jmtp.runtime.host.requests import RequestTable, Sequence
from jmtp.runtime.host.sampling_params import SamplingParams
from jmtp.runtime.host.scheduler import Scheduler
from jmtp.runtime.host.spec_policy import DynamicSpeculation
from jmtp.runtime.host.suffix_decoding import SuffixDecoding, merge_overrides
from jmtp.runtime.host.timeline import StepTimeline, StepTimes
from jmtp.runtime.process.host_maps import MapLimitError

log = logging.getLogger(__name__)


def _runner_attr(name: str, doc: str) -> property:
    return property(lambda self: getattr(self.runner, name),
                    lambda self, value: setattr(self.runner, name, value), doc=doc)


class LLMEngine(CompileAPI, HandOffAPI, StatsAPI):
    """Serving engine with MTP speculative decoding (vLLM ``LLMEngine`` shape).

    :class:`jmtp.LLM` builds one from the same arguments and exposes it as ``llm.llm_engine``.
    Requests come in through :meth:`add_request` (validated at once); each :meth:`step` admits
    waiting sequences into idle slots (continuous batching), runs the one compiled engine step
    and returns a :class:`RequestOutput` for every request that produced tokens or finished.

    Args:
      model, **engine_args: the fields of :class:`~jmtp.runtime.host.engine_args.EngineArgs`
        (``speculative_config``, ``max_num_seqs``, ``max_model_len``, ``block_size``,
        ``num_blocks``, ``tensor_parallel_size``, ``data_parallel_size``,
        ``enable_prefix_caching``, ``compile``, ...), documented there.

    Parts (public, for tests and tools): ``runner`` (:class:`~jmtp.runtime.device.runner.DeviceRunner`),
    ``scheduler`` (:class:`~jmtp.runtime.host.scheduler.Scheduler`), ``requests``
    (:class:`~jmtp.runtime.host.requests.RequestTable`), ``prefix_caches``
    (:class:`~jmtp.runtime.host.prefix_slots.ShardedPrefixCache` or None), ``handoff``,
    ``spec_policy`` (:class:`DynamicSpeculation` or None), ``suffix``
    (:class:`~jmtp.runtime.host.suffix_decoding.SuffixDecoding` or None), ``timeline``
    (:class:`~jmtp.runtime.host.timeline.StepTimeline`, off until enabled), ``plan_sync``
    (:class:`~jmtp.runtime.host.plan_sync.PlanSync` on a multi-process job, else None).

    ``async_scheduling`` (settable between steps): dispatch each step before reading the previous
    one's outputs (:mod:`jmtp.runtime.host.inflight`; the ``async_scheduling`` argument of
    :class:`~jmtp.runtime.host.engine_args.EngineArgs`).

    Start-up times: ``compile_seconds`` ``{label: seconds}`` of the compiles done ahead
    (``compile="eager"``); ``first_call_seconds`` ``{bucket label: seconds}`` of each bucket's
    first run in :meth:`step` (tracing, then compiling or loading it: where lazy compiles go).

    Raises:
      TypeError: an unknown keyword. ValueError: bad configuration or model path (see
        ``EngineArgs``). MapLimitError: (a ``RuntimeError``) with ``compile="eager"``, the
        compiles would cross the process's memory-map limit (:mod:`jmtp.runtime.process.host_maps`).
    """

    def __init__(self, model: str | None = None, **engine_args):
        args = EngineArgs(model=model, **engine_args)
        self._setup(args.build(), args.seed)
        self.compile_seconds: dict[str, float] = {}
        if self.compile_mode == "eager":
            self.compile_seconds = self.runner.compile_buckets(progress=True)
            self.compile_seconds.update(self.runner.compile_slot_ops(
                self.requests.sampling_row(SamplingParams(), [0], [], 0)))
            if self.spec_policy is not None or getattr(self.suffix, "costs", None) is not None:
                self.calibrate_speculation()

    @classmethod
    def from_runner(cls, runner, tokenizer=None, *, seed: int = 0, compile_mode: str = "lazy",
                    draft_vocab_size: int = 0, async_scheduling: bool | None = False
                    ) -> "LLMEngine":
        """An engine over an already built runner (or a test double of one with the same
        interface, ``tests/runtime/fake_runner.py``); nothing is compiled ahead."""
        self = cls.__new__(cls)
        self._setup(BuiltEngine(runner, tokenizer, draft_vocab_size, "scan", compile_mode, None,
                                async_scheduling), seed)
        self.compile_seconds = {}
        return self

    def _setup(self, built: BuiltEngine, seed: int) -> None:
        run = self.runner = built.runner
        self.tokenizer, self.draft_vocab_size = built.tokenizer, built.draft_vocab_size
        self.layer_loop, self.compile_mode = built.layer_loop, built.compile_mode
        self.compilation_cache_dir = built.compilation_cache_dir
        ec, sec, dp = run.engine_config, run.shard_config, run.num_shards
        self.requests = RequestTable(run.model_config, ec, built.tokenizer, seed,
                                     prompt_logprobs=getattr(run, "mesh", None) is None)
        self.scheduler = Scheduler(ec, sec, dp)
        states = sec.num_state_checkpoints    # a hybrid model's state entries per shard
        self.prefix_caches = (ShardedPrefixCache(
            ec.block_size, sec.num_blocks, dp, run.mtp_cache is not None, states,
            run.kv_cache_bytes()["prefix_state_entry"] if states else 0, ec.window)
            if ec.enable_prefix_caching else None)
        self.handoff = HandOff(run, self.requests, built.draft_vocab_size)
        def bucket_of(rows, n):   # a decode step's bucket, rows spread over the data shards
            return choose_bucket(sec, min(-(-rows // dp), sec.max_num_batched_tokens),
                                 min(-(-n // dp), sec.max_num_seqs), has_prefill=False)
        self.spec_policy = (DynamicSpeculation(ec.max_num_seqs, ec.k, bucket_of)
                            if ec.spec.enabled and ec.spec.speculation_policy == "dynamic"
                            and ec.spec.method != "suffix" else None)   # (suffix: its own cut)
        self.suffix = (SuffixDecoding(ec.spec, ec.max_num_seqs, bucket_of, self.spec_policy)
                       if ec.spec.uses_suffix else None)
        self.num_steps = 0
        self.closed = False
        self._pending_drafts = None   # i32[B, K] drafts of the pending windows (last StepOutput)
        self.last_step_seconds = 0.0
        self.policy_seconds = 0.0     # host time in the dynamic policy (plan + observe)
        self.async_scheduling = (default_async_scheduling(ec) if built.async_scheduling is None
                                 else bool(built.async_scheduling))
        self.timeline = StepTimeline()
        self.plan_sync = plan_sync_for()
        self._inflight: StepRecord | None = None      # a step dispatched, not read back yet
        self._num_dispatched = 0
        self._busy = False            # requests ran since the last dispatch
        self._last_free = list(run.free_counts)      # free blocks after the last step read back
        self._taken = [0] * dp           # per shard: blocks imports took since the last dispatch
        self._preempted_at = [-1] * dp   # per shard: dispatch number when it last preempted

    # ------------------------------------------------------------------ configuration
    # vLLM's ``LLMEngine.model_config``, the engine's configuration and ``first_call_seconds``
    # (docs/startup.md), read through; device state is the runner's: ``engine.runner.params``,
    # ``.graphdef``, ``.state``, ``.cache``, ``.mtp_cache``, ``.mesh``, ``.attention_backend``;
    # the speculative config is ``engine_config.spec``.
    model_config = _runner_attr("model_config", "The target's ModelConfig.")
    engine_config = _runner_attr("engine_config", "The EngineConfig (totals over data shards).")
    first_call_seconds = _runner_attr("first_call_seconds",
                                      "{bucket label: seconds} of each bucket's first run.")

    def close(self) -> None:
        """Drop every request and release the engine's device arrays and compiled executables
        (:meth:`DeviceRunner.close <jmtp.runtime.device.runner.DeviceRunner.close>`, which frees the
        memory mappings XLA:CPU holds for them), so a process can build engines one after
        another. Idempotent; :meth:`add_request` and :meth:`step` raise ``RuntimeError`` after."""
        if self.closed:
            return
        self.closed = True
        rec, self._inflight = self._inflight, None
        if rec is not None and rec.handle is not None:   # a step still on the device: finish it
            jax.block_until_ready(getattr(rec.handle, "out", rec.handle))
        for b, seq in enumerate(self.scheduler.slots):
            if seq is not None:
                self.scheduler.vacate(b)
        for group in list(self.requests.groups.values()):
            self.requests.forget(group)
        self.handoff.exported.clear()
        close = getattr(self.runner, "close", None)
        if close is not None:
            close()
        gc.collect()    # reference cycles (jitted closures, tracebacks) would hold executables

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("this engine is closed (LLM.close / LLMEngine.close)")

    # ------------------------------------------------------------------ requests
    def add_request(self, request_id: str, prompt: str | list[int],
                    sampling_params: SamplingParams | None = None) -> None:
        """Queue a request; it joins the running batch at the next :meth:`step`.

        Args:
          request_id: unique among unfinished requests (str).
          prompt: a string (needs a tokenizer) or a flat list of token ids.
          sampling_params: :class:`SamplingParams` (default: greedy, 16 tokens).

        Raises (before anything is queued):
          TypeError: ``request_id`` not a str, ``sampling_params`` not a SamplingParams.
          InvalidRequestError: (a ``ValueError`` with ``.field``) duplicate ``request_id``; empty
            prompt, prompt not shorter than ``max_model_len``, token ids out of range, more KV
            blocks needed than exist, ``logprobs`` above ``max_logprobs``, string prompt / stop
            strings / bad words without a tokenizer.
        """
        self._check_open()
        self.requests.add(request_id, prompt, sampling_params, f"request {request_id!r}")

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        """Drop one or several requests (unknown or finished ids are ignored). Their KV blocks
        are freed at once, whether they wait, prefill or decode; no further output is returned."""
        for rid in [request_id] if isinstance(request_id, str) else list(request_id):
            self.handoff.exported.pop(rid, None)     # a handed-off state nobody collected
            group = self.requests.groups.get(rid)
            if group is None:
                continue
            for seq in group.seqs:
                if seq.slot is not None:
                    self._free_slot(seq.slot, release=True)
            self.requests.forget(group)   # last: a failing release leaves it abortable
        if not self.has_unfinished_requests():
            self._drain()     # a step in flight ran only for requests that have ended
            self._busy = False

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests.groups)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests.groups)

    # ------------------------------------------------------------------ the step
    def step(self) -> list[RequestOutput]:
        """Run one engine step.

        Admits waiting samples into idle slots, runs the jitted step once, and returns one
        :class:`RequestOutput` per request that produced new tokens or finished in this step
        (``finished=True`` on its last one; finished requests are forgotten). Returns ``[]`` when
        nothing is unfinished. A request queued by :meth:`add_prefill_request` returns no output:
        the step that finishes its prefill exports it (:meth:`pop_exported`).

        With :attr:`async_scheduling` the step dispatched here runs on the device while this
        call reads and returns the outputs of the step dispatched by the previous call (the
        first call returns none); the outputs are the same as without it
        (:mod:`jmtp.runtime.host.inflight`).

        Raises:
          MapLimitError: (a ``RuntimeError``) the step needs a bucket that is not compiled yet
            (``compile="lazy"``) and compiling it would cross the process's memory-map limit.
            Raised before anything runs or is planned; abort requests to go on.
          RequestFailedError: (a ``RuntimeError``) admitting the waiting request
            ``request_id`` into a slot raised (its ``__cause__``). Nothing ran and nothing
            changed for it on the host: it stays first in line. Abort it to go on with the
            others (``AsyncLLMEngine`` does, failing that request alone), or step again to
            retry.
        """
        self._check_open()
        t0 = time.perf_counter()
        sch, req, run = self.scheduler, self.requests, self.runner
        outputs = [] if self.async_scheduling else self._drain()   # (turned off meanwhile)
        self._admit_waiting()
        sync = self.suffix is not None      # (suffix drafts follow every step's tokens)
        if self._inflight is not None and (not sch.num_running or sync or needs_sync(sch.slots)):
            outputs += self._drain()     # the next step needs this one's tokens on the host
            self._admit_waiting()
        if not sch.num_running:
            return outputs + req.pop_ready()
        guide, ended = (None, []) if self._inflight is not None else self._structured_inputs()
        if not sch.num_running:
            return outputs + req.pop_ready() + ended
        chunks, bucket = sch.plan()
        bucket = self.bucket_to_run(bucket)
        run.check_bucket(bucket)   # before the policy and the prefix cache change anything
        ready = req.pop_ready()
        proposing = sch.proposing(chunks)
        limits, plan_seconds = self._draft_limits(proposing)
        if self.suffix is not None:    # the MTP head rests where a slot follows a suffix match
            limits = self.suffix.mtp_limits(limits)
        if self.plan_sync is not None:     # several processes: process 0's plan for all
            limits = self.plan_sync.agree(self._num_dispatched, bucket, chunks, limits)
        overlap = self.async_scheduling and guide is None and not needs_sync(sch.slots)
        rec = self._dispatch(bucket, chunks, limits, proposing, guide, overlap, t0)
        rec.plan_seconds = plan_seconds
        if overlap:
            prev, self._inflight = self._inflight, rec
            outputs += self._finish(prev) if prev is not None else []
            if not self.has_unfinished_requests():
                outputs += self._drain()    # it ran only for requests that have ended
        else:
            outputs += self._finish(rec)
        self.last_step_seconds = time.perf_counter() - t0
        return ended + ready + outputs

    def _admit_waiting(self) -> None:
        """Admit waiting requests into free slots; a failure names its request
        (:class:`RequestFailedError`, which stays first in line)."""
        req = self.requests
        try:
            self.scheduler.admit_waiting(req.waiting, self._free_for_admission(), self._admit)
        except MapLimitError:
            raise
        except Exception as e:  # noqa: BLE001 -- one sequence's admission: name its request
            rid = req.waiting[0].group.request_id
            raise RequestFailedError(f"request {rid!r} failed at admission: "
                                     f"{type(e).__name__}: {e}", rid) from e

    def _free_for_admission(self) -> list[int]:
        """Free KV blocks per data shard for admission: exact with nothing in flight, else a
        lower bound (:func:`~jmtp.runtime.host.inflight.free_lower_bound`); with prefix caching plus
        the evictable cached blocks."""
        free = self._free_estimate()
        pcs = self.prefix_caches
        if pcs is not None:   # unreferenced cached blocks can be evicted for a new request
            free = [f + e for f, e in zip(free, pcs.evictable())]
        return free

    def _free_estimate(self, pushed: list[int] | None = None) -> list[int]:
        if self._inflight is None:
            return self.runner.free_counts
        return free_lower_bound(self._last_free, [self._inflight],
                                pushed or [0] * self.runner.num_shards, self._taken)

    def _dispatch(self, bucket, chunks, limits, proposing, guide, overlap: bool, t0: float
                  ) -> StepRecord:
        """Evict for the step's blocks (prefix caching) and hand it to the device; read it back at
        once unless ``overlap`` or the timeline records (then :meth:`_finish` reads it)."""
        sch, run, pcs = self.scheduler, self.runner, self.prefix_caches
        D = run.num_shards
        bounds, pushed = [sch.block_bound(chunks, d) for d in range(D)], [0] * D
        if pcs is not None:
            for d in range(D):
                pushed[d] = pcs.ensure_free(run, d, bounds[d], self._free_estimate(pushed)[d])
        rec = StepRecord(self._num_dispatched, bucket, chunks, limits, proposing, list(sch.slots),
                         sch.tickets.copy(), bounds, pushed, overlap, self._busy, t_round=t0,
                         policy=(self.spec_policy.plan_context()
                                 if self.spec_policy is not None else None), taken=self._taken)
        self._taken = [0] * D
        self._num_dispatched += 1
        self._busy = True
        rec.t_dispatch0 = time.perf_counter()
        if overlap or self.timeline.enabled:
            rec.handle = run.dispatch_step(bucket, chunks, limits, guide)
            rec.first = rec.handle.first
            if self.timeline.enabled or self.spec_policy is not None:
                self.timeline.watch(rec.index, rec.handle.out.num_tokens)
                rec.watched = True
        else:
            rec.out = (run.run_step(bucket, chunks, limits) if guide is None else
                       run.run_step(bucket, chunks, limits, guide))
        rec.t_dispatch1 = time.perf_counter()
        sch.dispatched(chunks, limits, proposing)
        return rec

    def _drain(self) -> list[RequestOutput]:
        """Read and take the step in flight, if any."""
        rec, self._inflight = self._inflight, None
        return self._finish(rec) if rec is not None else []

    def _finish(self, rec: StepRecord) -> list[RequestOutput]:
        """Read a dispatched step's outputs and take them: the policy's observation, the
        scheduler's bookkeeping, each slot's tokens (slots that changed occupant since are
        skipped), preemption. Returns the outputs of the requests with news."""
        sch, req, pol = self.scheduler, self.requests, self.spec_policy
        t_fetch0 = time.perf_counter()
        out = rec.out if rec.out is not None else self.runner.fetch_step(rec.handle)
        t_fetch1 = time.perf_counter()
        self._last_free = [int(x) for x in out.free_count]
        self._pending_drafts = out.draft_tokens
        times = StepTimes(rec.index, rec.bucket.label, "async" if rec.overlapped else "sync",
                          rec.first, rec.continued, rec.t_round, rec.t_dispatch0,
                          rec.t_dispatch1, t_fetch0, t_fetch1)
        if rec.out is None:
            end = self.timeline.device_end(rec.index, t_fetch1) if rec.watched else t_fetch1
            times.device_start, times.gap = self.timeline.device_interval(times, end)
            times.device_end = end
        seconds = times.device_end - times.device_start if rec.out is None else (
            t_fetch1 - rec.t_dispatch0)
        if pol is not None:
            # the proposing depth prices the drafting; a step with a prefill chunk is not timed;
            # the committed tokens feed the policy's guard on the realised rate
            t_obs = time.perf_counter()
            seen = (self.suffix.mtp_outcomes(out) if self.suffix is not None else dict(
                num_drafts=out.num_drafts, num_accepted=out.num_accepted,
                num_allowed=out.num_allowed, num_tokens=out.num_tokens))
            pol.observe(bucket=rec.bucket, seconds=seconds, depth=int(rec.limits.max()),
                        timed=not rec.chunks.any(), plan=rec.policy, **seen)
            self.policy_seconds += rec.plan_seconds + time.perf_counter() - t_obs
        if self.suffix is not None:
            self.suffix.observe(rec.bucket, seconds, not rec.chunks.any(), out.num_accepted)
        self.num_steps += 1
        valid = rec.valid(sch.slots, sch.tickets)
        following = self._inflight if self._inflight is not rec else None
        starved = sch.after_step(out, rec.chunks, valid, following)
        touched = self._take_tokens(out, rec.chunks, valid)
        for d in starved:   # every occupied slot of the shard waits for KV blocks
            if self._preempted_at[d] >= rec.index:
                continue    # dispatched before the last preemption there: its pauses are old
            self._preempt(d)
            sch.hold[d] = True
            self._preempted_at[d] = self._num_dispatched - 1
        outputs = [req.make_output(g) for g in touched]
        if not self.has_unfinished_requests():
            self._busy = False
        times.t_done = time.perf_counter()
        self.timeline.record(times)
        return outputs

    def _structured_inputs(self):
        """The step's draft-override inputs: suffix drafts (:meth:`SuffixDecoding.prepare`) and
        structured outputs (:meth:`StructuredOutputs.prepare`) merged (None when neither changes
        anything), and the outputs of samples it finished: a grammar that allows no token ends
        its sample with ``finish_reason="abort"`` and the reason in ``stop_reason``."""
        sch, req = self.scheduler, self.requests
        sch.next_drafts = np.array(sch.next_drafts)        # prepare repairs the windows
        drafted = None
        if self.suffix is not None:     # suffix drafts first: the grammar checks them
            drafted, self._pending_drafts = self.suffix.prepare(
                sch.slots, sch.next_drafts, self._pending_drafts, self.engine_config.max_model_len)
        guide, dead = req.structured.prepare(sch.slots, sch.next_drafts, self._pending_drafts,
                                             self.engine_config.max_model_len)
        ended = {}
        for b in dead:
            seq = sch.slots[b]
            seq.finish_reason = "abort"
            seq.stop_reason = f"structured output: {seq.grammar.error}"
            log.warning("request %r sample %d: %s", seq.group.request_id, seq.index,
                        seq.stop_reason)
            self._free_slot(b, release=True)
            ended[seq.group.request_id] = seq.group
        if dead and guide is not None and not any(
                s is not None and s.grammar is not None for s in sch.slots):
            guide = None
        return merge_overrides(guide, drafted), [req.make_output(g) for g in ended.values()]

    def _draft_limits(self, proposing: np.ndarray) -> tuple[np.ndarray, float]:
        """Per-slot draft limits ``i32[B]`` for the step (each slot's cap: its request's
        ``num_speculative_tokens`` or K; under the dynamic policy its plan within the caps) and
        the seconds the plan took."""
        caps = self.scheduler.draft_caps
        if self.spec_policy is None:
            return caps.copy(), 0.0
        t = time.perf_counter()
        if self.suffix is not None:     # the hybrid: MTP drafts beside the suffix drafts
            limits = self.suffix.plan_mtp(proposing, caps)
        elif (caps[proposing] < self.engine_config.k).any():
            limits = self.spec_policy.draft_limits(proposing, caps)
        else:                 # no proposing request lowered its cap
            limits = self.spec_policy.draft_limits(proposing)
        return limits, time.perf_counter() - t

    def _take_tokens(self, out, chunks: np.ndarray, valid: np.ndarray) -> list:
        """Take each slot's step results into its sequence (the ``valid`` slots: same occupant
        as when the step was dispatched): tokens, stop strings, finishing (the slot freed),
        hand-off exports. Returns the groups with news."""
        touched, exports, req, pcs = {}, [], self.requests, self.prefix_caches
        for b, seq in enumerate(self.scheduler.slots):
            if seq is None or not valid[b] or out.paused[b]:
                continue
            was_decode = not seq.prefilling
            req.record_prompt_logprobs(seq, out, b, seq.prefilled, int(chunks[b]))
            seq.prefilled += int(chunks[b])
            n = int(out.num_tokens[b])
            if pcs is not None:
                pcs.stepped(self.runner, self.scheduler.shard_of(b), b, seq, out.tokens[b, :n],
                            int(chunks[b]), was_decode, bool(out.finished[b]),
                            int(out.num_drafts[b]))
            first = 0
            if seq.resuming and n:      # the re-emitted last token of a resumed request
                first, seq.resuming = 1, False
            broken = None
            if seq.grammar is not None and n > first:
                # only tokens the grammar accepts are emitted: one outside the constraint (a
                # step fault) ends the sample there with "abort", whatever the step decided
                ok = req.structured.commit(seq.grammar, out.tokens[b, first:n])
                if first + ok < n:
                    n, broken = first + ok, f"structured output: {seq.grammar.error}"
                    log.error("request %r sample %d: %s", seq.group.request_id, seq.index,
                              broken)
            kept = req.record(seq, out, b, first, n, was_decode, broken)
            if self.suffix is not None and kept:
                self.suffix.record(seq, out.tokens[b, first:first + kept])
            if seq.finish_reason is not None:   # the step released the slots it finished
                self._free_slot(b, release=not out.finished[b], cache_blocks=True)
            if seq.group.export and (seq.finish_reason is not None
                                     or (not was_decode and n and not seq.prefilling)):
                exports.append(seq)      # prefill done: hand off (no output here)
            elif kept or seq.finish_reason is not None:
                touched[seq.group.request_id] = seq.group
        for seq in exports:
            self.handoff.exported[seq.group.request_id] = self.handoff.export(seq)
            if seq.slot is not None:
                self._free_slot(seq.slot, release=True)
            req.groups.pop(seq.group.request_id, None)
        return list(touched.values())

    def _admit(self, b: int, seq: Sequence) -> None:
        """Put ``seq`` into idle slot ``b`` (device first: if it raises, nothing on the host
        changed and the sequence stays waiting)."""
        sch, drafts = self.scheduler, None
        if seq.handoff is not None:
            pages = seq.handoff.num_pages
            drafts = self.handoff.admit(b, seq)
            self._taken[sch.shard_of(b)] += pages      # (free_lower_bound)
        else:
            ids, row, remaining, resume_token = self.requests.admission_row(seq)
            d, pcs = sch.shard_of(b), self.prefix_caches
            # (prompt logprobs need every prompt row computed: no cached prefix, as vLLM)
            m = pcs.match(d, seq, seq.params.prompt_logprobs is None) if pcs is not None else None
            self.runner.insert(b, ids, len(seq.context_ids), remaining, row, resume_token,
                               m.block_ids if m is not None else [])
            seq.prefilled = 0
            if pcs is not None:
                pcs.admitted(self.runner, d, b, seq, m)
            seq.resuming = resume_token >= 0
        if self.spec_policy is not None:
            self.spec_policy.reset_slot(b)
        if self.suffix is not None:
            self.suffix.admit(seq)
        if not seq.metrics.accepted_per_position:
            seq.metrics.accepted_per_position = [0] * self.engine_config.k
        sch.occupy(b, seq, drafts)

    def _free_slot(self, b: int, release: bool, cache_blocks: bool = False) -> None:
        """Empty slot ``b``: ``release`` its KV blocks, or with prefix caching retire it (caching
        its valid full blocks if ``cache_blocks``). Device call first: if it fails, the host's
        view of the slot is unchanged."""
        seq = self.scheduler.slots[b]
        if self.prefix_caches is not None:
            self.prefix_caches.retire(self.runner, self.scheduler.shard_of(b), b, seq,
                                      cache_blocks)
        elif release:
            self.runner.release(b)
        if self.suffix is not None:
            self.suffix.release(seq)
        self.scheduler.vacate(b)

    def _preempt(self, shard: int) -> None:
        """Preempt the newest request of data shard ``shard`` and re-queue it first; on
        re-admission its prompt and generated tokens are recomputed and it resumes exactly where
        it stopped (same window start, same random stream; see ``insert_request``)."""
        b = self.scheduler.victim(shard)
        seq = self.scheduler.slots[b]
        log.info("preempting request %r sample %d (slot %d): out of KV blocks",
                 seq.group.request_id, seq.index, b)
        self._free_slot(b, release=True)
        self.scheduler.num_preemptions += 1
        self.requests.waiting.appendleft(seq)


__all__ = ["LLMEngine"]
