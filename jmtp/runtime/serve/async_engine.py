"""Async front of :class:`~jmtp.runtime.host.llm.LLMEngine`: one background thread runs the step loop.

The engine is not thread-safe, so exactly one thread (the *engine thread*) ever calls it. Callers on
an asyncio event loop talk to that thread through queues:

* commands (add a request, abort a request, stop) go into a thread-safe command queue and wake the
  engine thread (a :class:`threading.Event`; the thread sleeps on it when no request is unfinished,
  so an idle server does not spin);
* every :class:`~jmtp.runtime.host.outputs.RequestOutput` a step returns is handed to the request's own
  :class:`asyncio.Queue` with ``loop.call_soon_threadsafe``.

Between two steps the engine thread drains the command queue, so requests that arrive while others
run join the running batch at the next step (continuous batching; admission is the engine's job).

A request that fails (``add_request`` raises, e.g. a prompt longer than ``max_model_len``) gets the
exception on its own stream and the loop goes on; so does a request whose admission into a batch
slot fails inside ``step()`` (the engine raises :class:`~jmtp.core.errors.RequestFailedError`
naming it; this thread aborts it): the other requests go on untouched. If
``step()`` raises anything else, the error cannot be pinned on one request: every in-flight request
gets it and is aborted, and the loop goes on serving new requests; if even the abort fails the
engine is marked dead (``is_dead``) and every later request fails at once with
:class:`EngineDeadError`.

Liveness (for ``/health``): :attr:`AsyncLLMEngine.busy_seconds` is how long the engine thread has
been inside its current pass (a step and the commands around it); 0 while it sleeps idle.

This is the shape of vLLM's ``AsyncLLMEngine`` (``generate`` / ``abort``), built on a thread rather
than an asyncio background task because one engine step is a long, blocking XLA call.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import queue
import threading
import time
from typing import AsyncIterator, Callable

from jmtp.core.errors import RequestFailedError

log = logging.getLogger(__name__)

#: Signature of the per-step observer: ``(stats, outputs, step_seconds)``, called on the engine
#: thread after every step, before the step's outputs reach the streams (``outputs`` empty and
#: ``step_seconds`` None after a command-only pass). ``stats["queue_seconds"]`` lists the queue
#: times (s, from ``add_request`` to the step that admitted the request into a batch slot) of the
#: requests first admitted in that pass. Keep it cheap: it delays every stream.
StepObserver = Callable[[dict, list, "float | None"], None]


class EngineDeadError(RuntimeError):
    """The engine thread stopped (shut down, or the engine failed beyond recovery)."""


@dataclasses.dataclass
class _Stream:
    request_id: str
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue           # RequestOutput | BaseException | None (end)
    added: asyncio.Future          # resolved once the engine accepted (or rejected) the request
    arrival: float = 0.0           # time.perf_counter() when add_request was called


_STOP = object()


class AsyncLLMEngine:
    """Serve an :class:`LLMEngine` to asyncio callers (vLLM ``AsyncLLMEngine`` API).

    Args:
      engine: the ``LLMEngine`` (e.g. ``LLM(...).llm_engine``). From :meth:`start` on, only the
        engine thread may call it.
      on_step: optional :data:`StepObserver` (e.g. the server's Prometheus metrics), called on the
        engine thread; an exception it raises is logged and ignored.
      start: start the engine thread now (else call :meth:`start`).

    Attributes:
      stats: the latest ``engine.get_stats()`` snapshot (a new dict after every step or command
        pass; safe to read from any thread). Adds ``num_requests_in_flight`` (streams open here)
        and ``queue_seconds`` (see :data:`StepObserver`).
        It is taken before the step's outputs (or an abort's end of stream, or a failed step's
        error) are handed to the streams, so a caller that has its final output reads stats
        that already count that request as finished and its KV blocks as freed.
    """

    def __init__(self, engine, *, on_step: StepObserver | None = None, start: bool = True):
        self.engine = engine
        self.on_step = on_step
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}    # owned by the engine thread after registration
        self._pending_ids: set[str] = set()       # ids handed to the thread, guarded by _ids_lock
        self._ids_lock = threading.Lock()
        self._dead: BaseException | None = None
        self._stopping = False
        self._busy_since: float | None = None     # monotonic start of the thread's current pass
        self._queued: dict[str, float] = {}       # engine thread: added, not yet in a slot
        self._compile_lock = threading.Lock()
        self.stats: dict = dict(engine.get_stats(), num_requests_in_flight=0, queue_seconds=[])
        self._thread = threading.Thread(target=self._run, name="jmtp-engine", daemon=True)
        if start:
            self.start()

    @classmethod
    def from_llm(cls, llm, **kwargs) -> "AsyncLLMEngine":
        """Build from an :class:`~jmtp.LLM` (its ``llm_engine``)."""
        return cls(llm.llm_engine, **kwargs)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Start the engine thread (idempotent)."""
        if not self._thread.is_alive() and not self._stopping:
            self._thread.start()

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive()

    @property
    def is_dead(self) -> bool:
        """True once the engine thread can no longer serve (shut down or failed)."""
        return self._dead is not None or self._stopping

    @property
    def busy_seconds(self) -> float:
        """Seconds the engine thread has spent in its current pass (one step and the commands
        around it); 0 while it sleeps with nothing to do. A value that keeps growing past any
        step's time means the thread is stuck."""
        since = self._busy_since
        return 0.0 if since is None else max(time.monotonic() - since, 0.0)

    def compile_constraint(self, params) -> None:
        """Compile a structured-output constraint (a ``StructuredOutputsParams``) on the calling
        thread, e.g. a worker thread of the server, so the grammar compile stalls neither an event
        loop nor the engine thread: the engine's own check when the request is added then finds
        it in the compiler's cache.

        Raises:
          InvalidRequestError: the grammar engine rejects the constraint
            (``.field = "structured_outputs.<kind>"``).
        """
        with self._compile_lock:        # one compile at a time; the cache is shared
            self.engine.requests.structured.compiler.compile(params)

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Stop the engine thread: in-flight requests are aborted and their streams end with
        :class:`EngineDeadError`; later calls to :meth:`add_request` raise it. Blocks until the
        thread has finished its current step (at most ``timeout`` seconds)."""
        self._stopping = True
        self._commands.put((_STOP,))
        self._wake.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    # ------------------------------------------------------------------ asyncio API
    async def add_request(self, request_id: str, prompt, sampling_params) -> AsyncIterator:
        """Submit a request and wait until the engine accepted it.

        Args:
          request_id: unique among in-flight requests.
          prompt: a string or a list of token ids.
          sampling_params: a :class:`~jmtp.SamplingParams`.

        Returns:
          An async iterator of the request's :class:`RequestOutput` s (incremental; the last one has
          ``finished=True``). Leaving it early (``break``, cancellation, ``aclose``) aborts the
          request, so its KV blocks are freed.

        Raises:
          ValueError: ``request_id`` is already in flight, or the engine rejected the request
            (``LLMEngine.add_request``'s ValueError / TypeError, naming the field).
          EngineDeadError: the engine thread is not serving.
        """
        if self.is_dead:
            raise EngineDeadError(f"engine is not running: {self._dead or 'shut down'}")
        with self._ids_lock:
            if request_id in self._pending_ids:
                raise ValueError(f"request_id {request_id!r} is already in flight")
            self._pending_ids.add(request_id)
        loop = asyncio.get_running_loop()
        stream = _Stream(request_id, loop, asyncio.Queue(), loop.create_future(),
                         time.perf_counter())
        self._commands.put(("add", stream, prompt, sampling_params))
        self._wake.set()
        try:
            while not stream.added.done():
                # Normally resolved by the engine thread within one step; the timeout only
                # catches a thread that ended after the is_dead check above.
                await asyncio.wait({stream.added}, timeout=1.0)
                if not stream.added.done() and not self._thread.is_alive():
                    raise EngineDeadError(f"engine stopped: {self._dead or 'shut down'}")
            stream.added.result()   # raises the engine's ValueError / TypeError
        except BaseException:
            # Rejected, or the caller was cancelled while waiting: make sure nothing runs.
            self._abort_nowait(request_id)
            raise
        return self._iterate(stream)

    async def generate(self, request_id: str, prompt, sampling_params) -> AsyncIterator:
        """``add_request`` + iterate: yields the request's :class:`RequestOutput` s (vLLM's
        ``AsyncLLMEngine.generate``). Errors of ``add_request`` are raised on the first iteration."""
        stream = await self.add_request(request_id, prompt, sampling_params)
        async with contextlib.aclosing(stream):     # leaving early aborts at once, not at GC
            async for out in stream:
                yield out

    async def abort(self, request_id: str) -> None:
        """Abort a request (no-op when it is unknown or already finished); its stream ends."""
        self._abort_nowait(request_id)

    async def _iterate(self, stream: _Stream):
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if item is None:
                    finished = True
                    return
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                if item.finished:
                    finished = True
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self._abort_nowait(stream.request_id)

    def _abort_nowait(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))
        self._wake.set()

    # ------------------------------------------------------------------ engine thread
    @staticmethod
    def _deliver(stream: _Stream, item) -> None:
        try:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)
        except RuntimeError:    # the caller's event loop is closed: nobody is listening
            pass

    @staticmethod
    def _resolve(stream: _Stream, exc: BaseException | None) -> None:
        def set_result():
            if not stream.added.done():
                if exc is None:
                    stream.added.set_result(None)
                else:
                    stream.added.set_exception(exc)
        try:
            stream.loop.call_soon_threadsafe(set_result)
        except RuntimeError:
            pass

    def _forget(self, request_id: str) -> _Stream | None:
        self._queued.pop(request_id, None)
        stream = self._streams.pop(request_id, None)
        with self._ids_lock:
            self._pending_ids.discard(request_id)
        return stream

    def _handle_commands(self) -> bool:
        """Drain the command queue; returns False when asked to stop."""
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return True
            if cmd[0] is _STOP:
                return False
            if cmd[0] == "add":
                _, stream, prompt, sp = cmd
                try:
                    self.engine.add_request(stream.request_id, prompt, sp)
                except Exception as e:  # noqa: BLE001 -- the request's error, not the loop's
                    self._forget(stream.request_id)
                    self._resolve(stream, e)
                    continue
                self._streams[stream.request_id] = stream
                self._queued[stream.request_id] = stream.arrival
                self._resolve(stream, None)
            elif cmd[0] == "abort":
                stream = self._forget(cmd[1])
                if stream is None:
                    continue        # unknown, already finished, or rejected
                try:
                    self.engine.abort_request(cmd[1])
                    self._snapshot()    # the stream's end is seen after its blocks are freed
                    self._notify([], None)
                finally:                # the stream ends whatever the engine does
                    self._deliver(stream, None)

    def _snapshot(self, queue_seconds: list | None = None) -> dict:
        self.stats = dict(self.engine.get_stats(), num_requests_in_flight=len(self._streams),
                          queue_seconds=queue_seconds or [])
        return self.stats

    def _admitted_since(self, t_step: float) -> list[float]:
        """Queue times of the waiting requests that the step begun at ``t_step`` admitted (a
        sample in a slot or with output, or already finished); they leave :attr:`_queued`."""
        waited = []
        groups = self.engine.requests.groups
        for rid, t_added in list(self._queued.items()):
            group = groups.get(rid)
            if group is None or any(s.slot is not None or s.output_ids for s in group.seqs):
                waited.append(max(t_step - t_added, 0.0))
                del self._queued[rid]
        return waited

    def _fail_one(self, exc: RequestFailedError) -> None:
        """``step()`` failed one request: abort it and end its stream with the error; every
        other request goes on."""
        stream = self._forget(exc.request_id)
        try:
            self.engine.abort_request(exc.request_id)
        except Exception as e:  # noqa: BLE001 -- it would fail every step from now on
            log.exception("engine unusable: cannot abort a failed request")
            self._dead = e
        try:
            self._snapshot()
            self._notify([], None)
        finally:
            if stream is not None:
                self._deliver(stream, exc)

    def _notify(self, outputs: list, step_seconds: float | None) -> None:
        if self.on_step is None:
            return
        try:
            self.on_step(self.stats, outputs, step_seconds)
        except Exception:  # noqa: BLE001 -- a metrics bug must not stop serving
            log.exception("on_step observer failed")

    def _fail_all(self, exc: BaseException) -> None:
        """``step()`` raised: fail and abort every in-flight request."""
        ids = list(self._streams)
        streams = [self._forget(rid) for rid in ids]
        try:
            if ids:
                self.engine.abort_request(ids)
            if self.engine.has_unfinished_requests():
                raise RuntimeError("requests remain after aborting all of them")
        except Exception as e:  # noqa: BLE001
            log.exception("engine unusable after a failed step")
            self._dead = e
        try:
            self._snapshot()
            self._notify([], None)
        finally:                # every failed stream hears of it, whatever get_stats does
            for stream in streams:
                self._deliver(stream, exc)

    def _run(self) -> None:
        try:
            while self._dead is None:
                self._wake.clear()
                self._busy_since = time.monotonic()
                if not self._handle_commands():
                    break
                if not self.engine.has_unfinished_requests():
                    self._snapshot()
                    self._notify([], None)
                    # Sleep until a command arrives (set() after clear() above is never lost).
                    self._busy_since = None
                    self._wake.wait()
                    continue
                t0 = time.perf_counter()
                try:
                    outputs = self.engine.step()
                except RequestFailedError as e:
                    log.warning("%s", e)
                    self._fail_one(e)
                    continue
                except Exception as e:  # noqa: BLE001
                    log.exception("engine step failed; failing the %d in-flight requests",
                                  len(self._streams))
                    self._fail_all(e)
                    continue
                dt = time.perf_counter() - t0
                deliveries = []
                for out in outputs:
                    stream = self._streams.get(out.request_id)
                    if stream is None:
                        continue        # aborted in the meantime
                    if out.finished:
                        self._forget(out.request_id)
                    deliveries.append((stream, out))
                # Snapshot and observer first: a caller that got its final output reads stats
                # (and server metrics) that include this step, its blocks freed.
                try:
                    self._snapshot(self._admitted_since(t0))
                    self._notify(outputs, dt)
                finally:        # forgotten streams must get their items even if stats fail
                    for stream, out in deliveries:
                        self._deliver(stream, out)
        except BaseException as e:  # noqa: BLE001 -- report, then end every stream below
            log.exception("engine thread crashed")
            self._dead = e
        finally:
            self._stopping = True
            self._busy_since = None
            err = EngineDeadError(f"engine stopped: {self._dead or 'shut down'}")
            for rid in list(self._streams):
                stream = self._forget(rid)
                try:
                    self.engine.abort_request(rid)
                except Exception:  # noqa: BLE001
                    pass
                self._deliver(stream, err)
            # Requests still queued as commands never reached the engine.
            while True:
                try:
                    cmd = self._commands.get_nowait()
                except queue.Empty:
                    break
                if cmd[0] == "add":
                    self._forget(cmd[1].request_id)
                    self._resolve(cmd[1], err)
