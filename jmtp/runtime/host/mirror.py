"""Serving on several processes: process 0's engine calls, replayed on every other process.

``jmtp launch -n N -- serve ...`` starts N processes of one ``jax.distributed`` job; each builds
the same engine on the global mesh (multi-controller JAX, :mod:`jmtp.core.multihost`). Only
process 0 takes HTTP requests. Its engine thread (:class:`~jmtp.runtime.serve.async_engine.
AsyncLLMEngine`) calls a :class:`MirroredEngine`, which makes each call on the local engine and
records the ones that change it (``add_request`` that succeeded, ``abort_request``); every
``step()`` first publishes the calls since the last step, then steps. The other processes run
:func:`follow`: they take each step's calls in order, make them on their own engine and step it,
so every process runs the same jitted step on the global mesh with the same plan (which
:class:`~jmtp.runtime.host.plan_sync.PlanSync` checks, and which fixes the dynamic policy's draft
limits to process 0's). Their outputs are dropped: process 0 answers.

The calls travel through the coordination service's key-value store (``jmtp/serve/<n>``, one
pickled list per step; no device collective), so an idle server needs no traffic. A stopped
server publishes a last ``stop`` and the other processes exit 0. A process that dies is noticed
by JAX's coordination service: the others stop sending heartbeats to it, or lose it, and every
process is terminated with "Terminating process because the JAX distributed service detected
fatal errors ... another task died" within ``$JMTP_HEARTBEAT_TIMEOUT`` seconds
(:func:`jmtp.runtime.process.distributed.initialize`); under ``jmtp launch`` the launcher stops the others
at once and names the process.
"""
from __future__ import annotations

import logging
import pickle

import jax

from jmtp.runtime.host.plan_sync import KEEP_KEYS
from jmtp.core import multihost as mh

log = logging.getLogger(__name__)

PREFIX = "jmtp/serve"
#: Seconds a following process waits for the next message before asking again (idle server).
POLL_S = 30.0


class CommandChannel:
    """Numbered messages from process 0 to the others through the key-value store."""

    def __init__(self, prefix: str = PREFIX):
        self.prefix, self.next = prefix, 0

    def publish(self, calls: list) -> None:
        client = mh._client()
        client.key_value_set_bytes(f"{self.prefix}/{self.next}", pickle.dumps(calls))
        if self.next >= KEEP_KEYS:
            client.key_value_delete(f"{self.prefix}/{self.next - KEEP_KEYS}")
        self.next += 1

    def receive(self) -> list:
        """The next message (waits as long as the server idles)."""
        client, key = mh._client(), f"{self.prefix}/{self.next}"
        while True:
            try:
                raw = client.blocking_key_value_get_bytes(key, int(POLL_S * 1000))
                break
            except Exception as e:  # noqa: BLE001 -- the coordination service's status errors
                if "DEADLINE_EXCEEDED" not in str(e) and "deadline" not in str(e).lower():
                    raise RuntimeError(f"process {jax.process_index()}: lost process 0's "
                                       f"commands ({type(e).__name__}: {e})") from e
        self.next += 1
        return pickle.loads(raw)


class MirroredEngine:
    """Process 0's view of an :class:`~jmtp.runtime.host.llm_engine.LLMEngine` whose calls every
    process makes (see the module docstring). Anything else is the engine's own attribute."""

    def __init__(self, engine, channel: CommandChannel | None = None):
        self.engine = engine
        self.channel = channel or CommandChannel()
        self._calls: list = []

    def add_request(self, request_id, prompt, sampling_params=None) -> None:
        self.engine.add_request(request_id, prompt, sampling_params)   # raises: nothing recorded
        self._calls.append(("add", request_id, prompt, sampling_params))

    def abort_request(self, request_id) -> None:
        self.engine.abort_request(request_id)
        self._calls.append(("abort", request_id))

    def step(self):
        calls, self._calls = self._calls + [("step",)], []
        self.channel.publish(calls)
        return self.engine.step()

    def stop(self) -> None:
        """Tell the other processes that serving ended (they exit 0)."""
        self.channel.publish(self._calls + [("stop",)])
        self._calls = []

    def __getattr__(self, name):
        return getattr(self.engine, name)


def follow(engine, channel: CommandChannel | None = None) -> int:
    """Make process 0's engine calls on ``engine`` (this process's copy) until it stops; returns
    0. A call that fails here is logged (process 0's made it, so the processes have diverged;
    the next step's :class:`~jmtp.runtime.host.plan_sync.PlanSync` check then fails loudly)."""
    channel = channel or CommandChannel()
    log.info("process %d follows process 0's engine calls", jax.process_index())
    while True:
        for call in channel.receive():
            if call[0] == "stop":
                return 0
            if call[0] == "step":
                engine.step()
                continue
            try:
                if call[0] == "add":
                    engine.add_request(*call[1:])
                else:
                    engine.abort_request(call[1])
            except Exception:  # noqa: BLE001
                log.exception("process %d: %s failed here but not on process 0",
                              jax.process_index(), call[0])


__all__ = ["CommandChannel", "MirroredEngine", "POLL_S", "PREFIX", "follow"]
