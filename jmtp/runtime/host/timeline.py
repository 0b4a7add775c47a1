"""Per-step host and device intervals of an engine: where the device waits for the host.

:class:`StepTimeline` (``LLMEngine.timeline``) records, once enabled, for every engine step the
host's intervals (planning and admission, the dispatch call, the wait for the outputs, the work on
them) and the device's (from when the step could start until its outputs were ready), so the
*bubble* -- the device idle between two consecutive steps of a busy engine -- can be read from
:meth:`StepTimeline.stats` (also in ``LLMEngine.get_stats``) or seen in a Chrome / Perfetto trace
(:meth:`StepTimeline.write_chrome_trace`; open it in ``ui.perfetto.dev`` or
``chrome://tracing``).

How the device interval is measured: a watcher thread waits on each step's outputs
(``block_until_ready``) and stamps the time it returns; the step's device start is the later of
its dispatch call's return and the previous step's end. The stamp needs Python's global
interpreter lock, so while the host thread runs Python it lags by up to the interpreter's switch
interval (5 ms by default): device ends can read late (idle a little short, steps a little long).
Gaps before a bucket's first run (its compile) and after an idle engine are not counted as idle.
"""
from __future__ import annotations

import dataclasses
import json
import queue
import threading
import time
import weakref

import jax


@dataclasses.dataclass
class StepTimes:
    """One step's intervals (``time.perf_counter`` seconds).

    Attributes:
      index: the engine's dispatch number. label: its bucket. mode: ``"async"`` (dispatched
      before the previous step's outputs were read) or ``"sync"``.
      first: the bucket's first run (the dispatch compiled it). continued: the engine was busy
      since the previous dispatch.
      t_round: start of the ``step()`` call that dispatched it; t_dispatch0 / t_dispatch1: around
      the dispatch call; t_fetch0 / t_fetch1: around the wait for its outputs; t_done: its outputs
      taken; device_start / device_end: its device interval.
    """

    index: int
    label: str
    mode: str
    first: bool
    continued: bool
    t_round: float
    t_dispatch0: float
    t_dispatch1: float
    t_fetch0: float = 0.0
    t_fetch1: float = 0.0
    t_done: float = 0.0
    device_start: float = 0.0
    device_end: float = 0.0
    gap: float | None = None     # device idle before it (None: not counted)


def _watch(items: queue.SimpleQueue, ends: dict, cv: threading.Condition) -> None:
    """The watcher thread (holds no reference to the engine): stamp each step's device end."""
    while True:
        item = items.get()
        if item is None:
            return
        key, tree = item
        try:
            jax.block_until_ready(tree)
        except Exception:  # noqa: BLE001 -- a failed step: the host sees the error itself
            pass
        t = time.perf_counter()
        with cv:
            ends[key] = t
            cv.notify_all()


class _Watcher:
    def __init__(self):
        self.items: queue.SimpleQueue = queue.SimpleQueue()
        self.ends: dict[int, float] = {}
        self.cv = threading.Condition()
        threading.Thread(target=_watch, args=(self.items, self.ends, self.cv), daemon=True,
                         name="jmtp-step-watcher").start()

    def end(self, key: int, timeout: float) -> float | None:
        with self.cv:
            self.cv.wait_for(lambda: key in self.ends, timeout)
            return self.ends.pop(key, None)


class StepTimeline:
    """Step intervals of one engine (see the module docstring). Off until :meth:`enable`; the
    engine also uses its device times for the dynamic policy under asynchronous scheduling.

    Attributes: ``enabled``, ``steps`` (the recorded :class:`StepTimes`, oldest first, at most
    ``max_steps``).
    """

    def __init__(self, max_steps: int = 100_000):
        self.enabled = False
        self.max_steps = max_steps
        self.steps: list[StepTimes] = []
        self._watcher: _Watcher | None = None
        self._last_end: float | None = None

    def enable(self) -> None:
        """Start recording (the steps recorded so far are kept)."""
        self.enabled = True

    def disable(self) -> None:
        self.enabled = False

    def clear(self) -> None:
        self.steps = []

    # ------------------------------------------------------------------ the engine's side
    def watch(self, index: int, outputs) -> None:
        """Stamp the device end of step ``index`` when ``outputs`` (its device arrays) are
        ready."""
        if self._watcher is None:
            self._watcher = _Watcher()
            weakref.finalize(self, self._watcher.items.put, None)
        self._watcher.items.put((index, outputs))

    def device_end(self, index: int, fallback: float, timeout: float = 1.0) -> float:
        """The stamped device end of step ``index`` (``fallback``, e.g. when its outputs were
        read, if it was not watched or the stamp is late)."""
        if self._watcher is None:
            return fallback
        end = self._watcher.end(index, timeout)
        return fallback if end is None else min(end, fallback)

    def device_interval(self, times: StepTimes, end: float) -> tuple[float, float | None]:
        """``(start, gap)`` of a step that ended at ``end``: it starts at the later of its
        dispatch call's return and the previous step's end; ``gap`` is the device idle before it
        (None when not counted: the first step of a busy period, a compile in the dispatch)."""
        prev, self._last_end = self._last_end, end
        if prev is None or not times.continued:
            return times.t_dispatch1, None
        start = max(times.t_dispatch1, prev)
        return start, (None if times.first else start - prev)

    def record(self, times: StepTimes) -> None:
        if self.enabled:
            self.steps.append(times)
            del self.steps[:-self.max_steps]

    # ------------------------------------------------------------------ reading it
    def stats(self) -> dict:
        """Totals over the recorded steps: ``timeline_steps``; ``device_busy_seconds`` (sum of
        the device intervals), ``device_idle_seconds`` (sum of the counted gaps between
        consecutive steps), ``device_idle_share`` (idle / busy: the bubble as a share of step
        time; 0.0 without steps); host seconds ``host_plan_seconds`` (admission and planning,
        up to the dispatch), ``host_dispatch_seconds``, ``host_wait_seconds`` (waiting for
        outputs) and ``host_output_seconds`` (taking them: detokenising, stop strings,
        logprobs, metrics, outputs, preemption)."""
        s = self.steps
        busy = sum(t.device_end - t.device_start for t in s)
        idle = sum(t.gap for t in s if t.gap is not None)
        return dict(timeline_steps=len(s), device_busy_seconds=busy, device_idle_seconds=idle,
                    device_idle_share=idle / busy if busy > 0 else 0.0,
                    host_plan_seconds=sum(t.t_dispatch0 - t.t_round for t in s),
                    host_dispatch_seconds=sum(t.t_dispatch1 - t.t_dispatch0 for t in s),
                    host_wait_seconds=sum(t.t_fetch1 - t.t_fetch0 for t in s),
                    host_output_seconds=sum(t.t_done - t.t_fetch1 for t in s))

    def chrome_trace(self) -> dict:
        """The recorded steps as Chrome trace events (``{"traceEvents": [...]}``, times in µs
        from the first step): a ``host`` track (``plan``, ``dispatch``, ``wait``, ``outputs``
        of each step) and a ``device`` track (each step, named by its bucket, ``idle`` gaps)."""
        if not self.steps:
            return {"traceEvents": []}
        t0 = min(t.t_round for t in self.steps)
        us = lambda t: round((t - t0) * 1e6, 1)     # noqa: E731
        ev = [{"ph": "M", "pid": 0, "tid": tid, "name": "thread_name", "args": {"name": name}}
              for tid, name in ((1, "host"), (2, "device"))]

        def span(tid, name, a, b, **args):
            if b > a:
                ev.append({"ph": "X", "pid": 0, "tid": tid, "name": name, "ts": us(a),
                           "dur": round((b - a) * 1e6, 1), "args": args})

        for t in self.steps:
            span(1, "plan", t.t_round, t.t_dispatch0, step=t.index)
            span(1, "dispatch", t.t_dispatch0, t.t_dispatch1, step=t.index, compile=t.first)
            span(1, "wait", t.t_fetch0, t.t_fetch1, step=t.index)
            span(1, "outputs", t.t_fetch1, t.t_done, step=t.index)
            span(2, t.label, t.device_start, t.device_end, step=t.index, mode=t.mode)
            if t.gap:
                span(2, "idle", t.device_start - t.gap, t.device_start, step=t.index)
        return {"traceEvents": ev, "displayTimeUnit": "ms"}

    def write_chrome_trace(self, path) -> None:
        """Write :meth:`chrome_trace` as JSON to ``path``."""
        with open(path, "w") as f:
            json.dump(self.chrome_trace(), f)


__all__ = ["StepTimeline", "StepTimes"]
