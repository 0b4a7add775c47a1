"""The server's Prometheus metrics (``GET /metrics``), fed by the engine thread after every step."""
from __future__ import annotations

import collections
import gc
import time
import weakref

import prometheus_client as prom

#: bounds (s) of ``jmtp_gc_pause_seconds``: a young collection of a serving process took ~0.3 ms
#: on average under load, a full one of its unfrozen start-up heap ~0.1-0.3 s (docs/serving.md)
GC_PAUSE_BUCKETS = (0.0001, 0.0005, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


def _remove_gc_hook(hook) -> None:
    if hook in gc.callbacks:
        gc.callbacks.remove(hook)


class ServerMetrics:
    """Prometheus metrics of one server (own registry; no global state).

    Exposed (``/metrics``): ``jmtp_requests_total{endpoint}`` (every generation request
    received, also those refused before their body was read), ``jmtp_requests_rejected_total
    {endpoint}`` (refused at intake with a 4xx: body size, body, fields, model),
    ``jmtp_request_success_total{finish_reason}``, ``jmtp_request_errors_total{status}`` (every
    error answer but ``/health``'s), ``jmtp_prompt_tokens_total``,
    ``jmtp_generation_tokens_total``, ``jmtp_num_requests_running``, ``jmtp_num_requests_waiting``
    (queue length), ``jmtp_kv_blocks_free``, ``jmtp_kv_blocks_total``, ``jmtp_step_seconds``
    (histogram of engine-step wall time, s), ``jmtp_request_queue_seconds`` (histogram of the
    time from a request's arrival at the engine to its admission into a batch slot, s),
    ``jmtp_num_preemptions_total`` (samples preempted for KV blocks), and speculation: ``jmtp_spec_decode_draft_tokens_total``,
    ``jmtp_spec_decode_accepted_tokens_total``, ``jmtp_spec_decode_accepted_per_position_total
    {position}`` (verify steps whose draft ``position`` (1-based) was accepted),
    ``jmtp_spec_decode_steps_total``, ``jmtp_spec_decode_step_tokens_total`` and
    ``jmtp_spec_decode_mean_acceptance_length`` (tokens per verify step since start). With
    ``speculation_policy="dynamic"`` also the policy's ``jmtp_spec_policy_plans_total``,
    ``jmtp_spec_policy_drafting_plans_total``, ``jmtp_spec_policy_holds_total`` and
    ``jmtp_spec_policy_host_seconds_total`` (see ``LLMEngine.get_stats``; absent stats leave
    them at 0). The process: ``jmtp_gc_pause_seconds{generation}`` (histogram of Python's
    garbage-collector pauses while :meth:`watch_gc` is on, s: a collection stops every Python
    thread, the engine's too), prometheus_client's ``python_gc_*`` (collections and objects per
    generation) and ``process_*`` (RSS, CPU seconds, open file descriptors; Linux ``/proc``
    only).
    """

    def __init__(self):
        r = self.registry = prom.CollectorRegistry()
        self.requests = prom.Counter("jmtp_requests", "HTTP generation requests received",
                                     ["endpoint"], registry=r)
        self.request_success = prom.Counter("jmtp_request_success", "Completions finished",
                                            ["finish_reason"], registry=r)
        self.request_errors = prom.Counter("jmtp_request_errors", "Requests answered with an error",
                                           ["status"], registry=r)
        self.rejected = prom.Counter("jmtp_requests_rejected", "Generation requests refused at "
                                     "intake (4xx before they reached the engine)", ["endpoint"],
                                     registry=r)
        self.queue_seconds = prom.Histogram(
            "jmtp_request_queue_seconds", "Time from arrival at the engine to admission into a "
            "batch slot (s)", registry=r,
            buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                     300.0))
        self.preemptions = prom.Counter("jmtp_num_preemptions", "Samples preempted (out of KV "
                                        "blocks) and re-queued", registry=r)
        self.prompt_tokens = prom.Counter("jmtp_prompt_tokens", "Prompt tokens of requests that "
                                          "produced output", registry=r)
        self.generation_tokens = prom.Counter("jmtp_generation_tokens", "Generated tokens",
                                              registry=r)
        self.num_running = prom.Gauge("jmtp_num_requests_running", "Requests in engine slots",
                                      registry=r)
        self.num_waiting = prom.Gauge("jmtp_num_requests_waiting", "Requests waiting for a slot",
                                      registry=r)
        self.kv_free = prom.Gauge("jmtp_kv_blocks_free", "Free KV-cache blocks", registry=r)
        self.kv_total = prom.Gauge("jmtp_kv_blocks_total", "KV-cache blocks", registry=r)
        self.step_seconds = prom.Histogram(
            "jmtp_step_seconds", "Engine step wall time (s)", registry=r,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0))
        self.draft_tokens = prom.Counter("jmtp_spec_decode_draft_tokens", "Draft tokens verified",
                                         registry=r)
        self.accepted_tokens = prom.Counter("jmtp_spec_decode_accepted_tokens",
                                            "Draft tokens accepted", registry=r)
        self.accepted_per_position = prom.Counter(
            "jmtp_spec_decode_accepted_per_position", "Verify steps whose draft at this 1-based "
            "position was accepted", ["position"], registry=r)
        self.decode_steps = prom.Counter("jmtp_spec_decode_steps", "Verify (decode) steps of "
                                         "requests", registry=r)
        self.decode_tokens = prom.Counter("jmtp_spec_decode_step_tokens", "Tokens committed by "
                                          "verify steps", registry=r)
        self.mean_acceptance_length = prom.Gauge(
            "jmtp_spec_decode_mean_acceptance_length", "Tokens committed per verify step since "
            "start (1 = no draft accepted)", registry=r)
        self.policy_plans = prom.Counter("jmtp_spec_policy_plans", "Steps the dynamic "
                                         "speculation policy planned", registry=r)
        self.policy_drafting = prom.Counter("jmtp_spec_policy_drafting_plans", "Planned steps "
                                            "whose limits allowed a draft", registry=r)
        self.policy_holds = prom.Counter("jmtp_spec_policy_holds", "Losing windows after which "
                                         "the policy's guard held drafting off", registry=r)
        self.policy_seconds = prom.Counter("jmtp_spec_policy_host_seconds", "Host time in the "
                                           "dynamic policy (plan and bookkeeping), s", registry=r)
        self.gc_pause = prom.Histogram("jmtp_gc_pause_seconds", "Python garbage-collector "
                                       "pauses (every Python thread stops), s", ["generation"],
                                       registry=r, buckets=GC_PAUSE_BUCKETS)
        prom.GCCollector(registry=r)
        prom.ProcessCollector(registry=r)
        self._prev: dict = {}
        self._gc_pauses: collections.deque = collections.deque(maxlen=100_000)
        self._gc_unhook: weakref.finalize | None = None

    def watch_gc(self) -> None:
        """Time each garbage collection of this process (a :data:`gc.callbacks` hook) into
        ``jmtp_gc_pause_seconds`` until :meth:`unwatch_gc` (the server's lifespan), or until
        these metrics are collected (a :class:`weakref.finalize` removes the hook). The hook only
        appends ``(generation, seconds)`` to a deque, taking no lock (a collection can start in
        a thread that holds a metric's lock); the engine thread's :meth:`on_step` and
        :meth:`render` move them into the histogram. Undrained, the deque keeps the latest
        100,000 pauses. A collection already running when the hook is added (its start unseen)
        is not timed."""
        if self._gc_unhook is not None and self._gc_unhook.alive:
            return
        pauses, started = self._gc_pauses, [None]

        def hook(phase: str, info: dict) -> None:
            if phase == "start":
                started[0] = time.perf_counter()
            elif started[0] is not None:
                pauses.append((info["generation"], time.perf_counter() - started[0]))
                started[0] = None

        gc.callbacks.append(hook)
        self._gc_unhook = weakref.finalize(self, _remove_gc_hook, hook)

    def unwatch_gc(self) -> None:
        """Stop timing collections (what was timed stays in the histogram)."""
        if self._gc_unhook is not None:
            self._gc_unhook()           # removes the hook; a no-op once it ran
        self._drain_gc_pauses()

    def _drain_gc_pauses(self) -> None:
        while self._gc_pauses:
            try:
                generation, seconds = self._gc_pauses.popleft()
            except IndexError:          # drained by the other thread meanwhile
                return
            self.gc_pause.labels(generation=str(generation)).observe(seconds)

    def _inc_from(self, counter, stats: dict, key: str, prev_key: str | None = None) -> None:
        prev_key = prev_key or key
        cur = stats.get(key)
        if cur is None:
            return
        delta = cur - self._prev.get(prev_key, 0)
        if delta > 0:
            counter.inc(delta)
        self._prev[prev_key] = cur

    def on_step(self, stats: dict, outputs: list, step_seconds: float | None) -> None:
        """:data:`~jmtp.runtime.serve.async_engine.StepObserver`: runs on the engine thread."""
        self._drain_gc_pauses()
        self.num_running.set(stats.get("num_running", 0))
        self.num_waiting.set(stats.get("num_waiting", 0))
        self.kv_free.set(stats.get("num_free_blocks", 0))
        self.kv_total.set(stats.get("num_blocks", 0))
        if step_seconds is not None:
            self.step_seconds.observe(stats.get("last_step_seconds") or step_seconds)
        for waited in stats.get("queue_seconds") or ():
            self.queue_seconds.observe(waited)
        self._inc_from(self.preemptions, stats, "num_preemptions")
        self._inc_from(self.draft_tokens, stats, "num_draft_tokens")
        self._inc_from(self.accepted_tokens, stats, "num_accepted_tokens")
        self._inc_from(self.decode_steps, stats, "num_decode_steps")
        self._inc_from(self.decode_tokens, stats, "num_decode_tokens")
        self._inc_from(self.policy_plans, stats, "spec_policy_plans")
        self._inc_from(self.policy_drafting, stats, "spec_policy_drafting_plans")
        self._inc_from(self.policy_holds, stats, "spec_policy_holds")
        self._inc_from(self.policy_seconds, stats, "spec_policy_host_seconds")
        for i, c in enumerate(stats.get("accepted_per_position") or []):
            stats_i = {"c": c}
            self._inc_from(self.accepted_per_position.labels(position=str(i + 1)), stats_i, "c",
                           f"pos{i}")
        steps = stats.get("num_decode_steps") or 0
        self.mean_acceptance_length.set(stats.get("num_decode_tokens", 0) / steps if steps else 0.0)
        for out in outputs:
            for c in out.outputs:
                self.generation_tokens.inc(len(c.delta_token_ids))
                # Counted when the whole request finished (a finished sample of an n > 1
                # request reappears in later outputs until its siblings finish).
                if out.finished:
                    self.request_success.labels(finish_reason=str(c.finish_reason)).inc()

    def render(self) -> bytes:
        self._drain_gc_pauses()
        return prom.generate_latest(self.registry)
