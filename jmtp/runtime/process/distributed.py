"""Multi-process start-up: one call that joins this process to a ``jax.distributed`` job.

jmtp serves on several processes (hosts) SPMD, multi-controller style: every process runs the same
script, builds the same engine on the same *global* mesh (``jax.devices()`` of all processes) and
runs the same host loop, so every process makes the same scheduling decisions and holds the full
outputs (see :mod:`jmtp.core.multihost` for how host values enter and leave the mesh).

:func:`initialize` must run before anything else touches JAX devices. Its three values come from
its arguments, else from the environment variables :data:`ENV_COORDINATOR` (``host:port`` of
process 0's coordinator service), :data:`ENV_NUM_PROCESSES` and :data:`ENV_PROCESS_ID` (the
names ``jmtp launch`` sets). With none of them given anywhere, JAX auto-detects them (Cloud TPU
pods, Slurm, Open MPI). On CPU, cross-process collectives go through gloo
(``jax_cpu_collectives_implementation="gloo"``, set before the CPU client exists).
"""
from __future__ import annotations

import logging
import os

import jax

log = logging.getLogger(__name__)

ENV_COORDINATOR = "JMTP_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "JMTP_NUM_PROCESSES"
ENV_PROCESS_ID = "JMTP_PROCESS_ID"
ENV_VARS = (ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID)
#: Seconds after which the coordination service declares a silent process dead and stops the
#: job (JAX's ``heartbeat_timeout_seconds``, default 100).
ENV_HEARTBEAT_TIMEOUT = "JMTP_HEARTBEAT_TIMEOUT"

#: The ``jax_cpu_collectives_implementation`` value jmtp selects (jax 0.10: "gloo" | "mpi").
CPU_COLLECTIVES = "gloo"


def env_requested(environ=None) -> bool:
    """True when any of :data:`ENV_VARS` is set (non-empty): the process is one of a job."""
    environ = os.environ if environ is None else environ
    return any(environ.get(k, "").strip() for k in ENV_VARS)


def _env_int(name: str, environ) -> int | None:
    raw = environ.get(name, "").strip()
    if not raw:
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"${name} must be an integer, got {raw!r}") from None


def resolve(coordinator_address: str | None = None, num_processes: int | None = None,
            process_id: int | None = None, environ=None
            ) -> tuple[str | None, int | None, int | None]:
    """``(coordinator_address, num_processes, process_id)`` from the arguments, else
    :data:`ENV_VARS`, checked (no JAX call).

    Either all three are known, or none (JAX auto-detection, e.g. on TPU pods).

    Raises:
      ValueError: only some of the three given; ``num_processes < 1``; ``process_id`` outside
        ``[0, num_processes)``; a coordinator address that is not ``host:port`` with a port in
        [1, 65535]; an environment variable that is not an integer.
    """
    environ = os.environ if environ is None else environ
    if coordinator_address is None:
        coordinator_address = environ.get(ENV_COORDINATOR, "").strip() or None
    if num_processes is None:
        num_processes = _env_int(ENV_NUM_PROCESSES, environ)
    if process_id is None:
        process_id = _env_int(ENV_PROCESS_ID, environ)
    values = {"coordinator_address": coordinator_address, "num_processes": num_processes,
              "process_id": process_id}
    given = [k for k, v in values.items() if v is not None]
    if not given:
        return None, None, None
    if len(given) != 3:
        missing = [k for k in values if values[k] is None]
        raise ValueError(
            f"distributed.initialize: {', '.join(given)} given but {', '.join(missing)} missing "
            f"(give all three, as arguments or ${ENV_COORDINATOR} / ${ENV_NUM_PROCESSES} / "
            f"${ENV_PROCESS_ID}, or none for JAX's auto-detection)")
    for name in ("num_processes", "process_id"):
        v = values[name]
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"{name} must be an int, got {v!r}")
    if num_processes < 1:
        raise ValueError(f"num_processes must be >= 1, got {num_processes}")
    if not 0 <= process_id < num_processes:
        raise ValueError(f"process_id={process_id} must lie in [0, num_processes={num_processes})")
    host, sep, port = str(coordinator_address).rpartition(":")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"coordinator_address must be 'host:port' with a port in [1, 65535], "
                         f"got {coordinator_address!r}")
    return str(coordinator_address), num_processes, process_id


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, *, initialization_timeout: int = 300,
               heartbeat_timeout: int | None = None) -> bool:
    """Join this process to a multi-process JAX job (``jax.distributed.initialize``).

    Call it first, before any JAX computation or device query. Arguments left None are read from
    :data:`ENV_VARS`; with none of the three known anywhere, JAX auto-detects the job (TPU pods,
    Slurm, Open MPI) and fails if there is none. On CPU, gloo collectives are selected first.
    Calling it again in a process already initialized does nothing.

    Args:
      coordinator_address: ``host:port`` of the coordinator (process 0 serves it).
      num_processes: processes in the job (>= 1).
      process_id: this process's index in ``[0, num_processes)``.
      initialization_timeout: seconds to wait for every process to connect.
      heartbeat_timeout: seconds after which a process that stopped sending heartbeats (killed,
        crashed) is declared dead: JAX then terminates every process of the job with "the JAX
        distributed service detected fatal errors". None: ``$JMTP_HEARTBEAT_TIMEOUT``, else
        JAX's default (100 s).

    Returns:
      True if this call initialized the job, False if it was already initialized.

    Raises:
      ValueError: inconsistent arguments (see :func:`resolve`).
      RuntimeError: JAX's backends were already started in this process (too late to join).
    """
    from jax._src import distributed as _dist

    coordinator_address, num_processes, process_id = resolve(
        coordinator_address, num_processes, process_id)
    if _dist.global_state.client is not None:
        return False
    jax.config.update("jax_cpu_collectives_implementation", CPU_COLLECTIVES)
    kw = {}
    if coordinator_address is not None:
        kw = dict(coordinator_address=coordinator_address, num_processes=num_processes,
                  process_id=process_id)
    if heartbeat_timeout is None and os.environ.get(ENV_HEARTBEAT_TIMEOUT, "").strip():
        heartbeat_timeout = _env_int(ENV_HEARTBEAT_TIMEOUT, os.environ)
    if heartbeat_timeout is not None:
        if heartbeat_timeout < 1:
            raise ValueError(f"heartbeat_timeout must be >= 1 second, got {heartbeat_timeout}")
        kw["heartbeat_timeout_seconds"] = int(heartbeat_timeout)
    jax.distributed.initialize(initialization_timeout=initialization_timeout, **kw)
    log.info("jax.distributed: process %d of %d, %d local / %d global devices",
             jax.process_index(), jax.process_count(), jax.local_device_count(),
             jax.device_count())
    return True


def initialize_from_env() -> bool:
    """:func:`initialize` if :func:`env_requested`, else nothing; True if it initialized."""
    return initialize() if env_requested() else False


def is_main_process() -> bool:
    """True on process 0 (the one that prints results); True in a single-process run."""
    return jax.process_index() == 0


__all__ = ["ENV_COORDINATOR", "ENV_NUM_PROCESSES", "ENV_PROCESS_ID", "ENV_VARS", "CPU_COLLECTIVES",
           "env_requested", "resolve", "initialize", "initialize_from_env", "is_main_process"]
