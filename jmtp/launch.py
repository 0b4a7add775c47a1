"""``jmtp launch``: start N jmtp processes on this host as one ``jax.distributed`` job.

``jmtp launch -n 2 --devices-per-process 2 -- generate --tensor-parallel-size 4 --prompt Hi``
starts ``python -m jmtp generate ...`` twice, each with :data:`~jmtp.runtime.process.distributed.ENV_VARS`
set (coordinator ``127.0.0.1:PORT``, served by process 0; ``JMTP_NUM_PROCESSES=N``;
``JMTP_PROCESS_ID=i``), and with ``--devices-per-process M`` also
``XLA_FLAGS=--xla_force_host_platform_device_count=M`` (M CPU devices per process; the flag
touches only the host platform). ``--exec`` runs any command instead of a jmtp subcommand (a
script that calls :func:`jmtp.runtime.process.distributed.initialize` itself).

Every line a process writes (stdout and stderr, merged) is printed with a ``[pI]`` prefix
(``--output 0``: process 0's only). The launcher waits for all of them. When one exits with a
non-zero code (or is killed by a signal), the others are stopped at once (SIGTERM, then SIGKILL
after ``--grace`` seconds: JAX's distributed runtime catches SIGTERM, and a process blocked in a
collective never notices its peer is gone) and the launcher exits with that code after a line
naming the process. Ctrl-C (SIGINT) or SIGTERM to the launcher, or ``--timeout``, stop every
process the same way. Each process runs in its own session (its whole process group is killed)
and, on Linux, dies with the launcher (``PR_SET_PDEATHSIG``) even if the launcher is SIGKILLed.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Sequence

from jmtp.runtime.process import distributed as dist

#: Exit code of the launcher when ``--timeout`` expires (as coreutils ``timeout``).
EXIT_TIMEOUT = 124
#: Exit code after Ctrl-C / SIGTERM (128 + SIGINT).
EXIT_INTERRUPTED = 130


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (bound once and released; a small race remains)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def process_env(base: dict, num_processes: int, process_id: int, coordinator: str,
                devices_per_process: int | None) -> dict:
    """The environment of process ``process_id``: ``base`` plus the jmtp job variables and, with
    ``devices_per_process``, the XLA host-device-count flag (replacing one already in
    ``XLA_FLAGS``)."""
    env = dict(base)
    env[dist.ENV_COORDINATOR] = coordinator
    env[dist.ENV_NUM_PROCESSES] = str(num_processes)
    env[dist.ENV_PROCESS_ID] = str(process_id)
    if devices_per_process is not None:
        flags = [f for f in env.get("XLA_FLAGS", "").split()
                 if not f.startswith("--xla_force_host_platform_device_count")]
        flags.append(f"--xla_force_host_platform_device_count={devices_per_process}")
        env["XLA_FLAGS"] = " ".join(flags)
    env.setdefault("PYTHONUNBUFFERED", "1")     # lines arrive as they are printed
    return env


def _die_with_parent():          # runs in the child between fork and exec
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)            # PR_SET_PDEATHSIG
    except OSError:
        pass


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class _Interrupted(Exception):
    pass


def launch(command: Sequence[str], num_processes: int, *, devices_per_process: int | None = None,
           port: int | None = None, output: str = "all", timeout: float | None = None,
           grace: float = 5.0, stream=None) -> int:
    """Run ``command`` as ``num_processes`` processes of one job on 127.0.0.1; return the exit
    code for the launcher (0 when all succeed; the failing process's code, ``128+signal`` for a
    signal, :data:`EXIT_TIMEOUT`, :data:`EXIT_INTERRUPTED`).

    Args:
      command: argv of every process (the same for all).
      num_processes: N >= 1.
      devices_per_process: CPU devices per process (``XLA_FLAGS``); None: leave it.
      port: coordinator port (None or 0: a free one).
      output: ``"all"`` (every process, ``[pI]`` prefixes) or ``"0"`` (process 0 only).
      timeout: seconds before every process is stopped (None: no limit).
      grace: seconds between SIGTERM and SIGKILL when stopping processes.
      stream: where output and launcher messages go (default ``sys.stdout``).

    Raises:
      ValueError: ``num_processes < 1``, ``devices_per_process < 1``, a port outside
        [0, 65535], an empty command, ``output`` not "all" / "0", ``timeout <= 0``.
    """
    if num_processes < 1:
        raise ValueError(f"num_processes (-n) must be >= 1, got {num_processes}")
    if devices_per_process is not None and devices_per_process < 1:
        raise ValueError(f"devices_per_process must be >= 1, got {devices_per_process}")
    if port is not None and not 0 <= port <= 65535:
        raise ValueError(f"port must lie in [0, 65535], got {port}")
    if not command:
        raise ValueError("no command to launch (put the jmtp subcommand after --)")
    if output not in ("all", "0"):
        raise ValueError(f"output must be 'all' or '0', got {output!r}")
    if timeout is not None and timeout <= 0:
        raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
    stream = sys.stdout if stream is None else stream
    coordinator = f"127.0.0.1:{port or free_port()}"
    lock = threading.Lock()

    def say(line: str):
        with lock:
            stream.write(line)
            stream.flush()

    def pump(i: int, pipe):
        for raw in iter(pipe.readline, b""):
            if output == "all" or i == 0:
                say(f"[p{i}] " + raw.decode("utf-8", "replace").rstrip("\n") + "\n")
        pipe.close()

    procs: list[subprocess.Popen] = []
    pumps: list[threading.Thread] = []
    old_term = None
    if threading.current_thread() is threading.main_thread():
        def on_term(signum, frame):
            raise _Interrupted()
        old_term = signal.signal(signal.SIGTERM, on_term)
    code = 0
    try:
        for i in range(num_processes):
            p = subprocess.Popen(
                list(command), env=process_env(os.environ, num_processes, i, coordinator,
                                               devices_per_process),
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None)
            procs.append(p)
            t = threading.Thread(target=pump, args=(i, p.stdout), daemon=True)
            t.start()
            pumps.append(t)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            codes = [p.poll() for p in procs]
            failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                i, c = failed[0]
                _stop(procs, grace)
                for t in pumps:
                    t.join(timeout=2)
                say(f"jmtp launch: process {i} of {num_processes} {_describe(c)}; stopped the "
                    "other processes\n")
                code = c if c > 0 else 128 - c
                break
            if all(c == 0 for c in codes):
                for t in pumps:
                    t.join(timeout=5)
                break
            if deadline is not None and time.monotonic() > deadline:
                running = [i for i, c in enumerate(codes) if c is None]
                _stop(procs, grace)
                say(f"jmtp launch: timed out after {timeout:g} s; stopped processes {running}\n")
                code = EXIT_TIMEOUT
                break
            time.sleep(0.05)
    except (KeyboardInterrupt, _Interrupted):
        _stop(procs, grace)
        say("jmtp launch: interrupted; stopped every process\n")
        code = EXIT_INTERRUPTED
    finally:
        _stop(procs, grace)         # no-op when all have exited
        if old_term is not None:
            signal.signal(signal.SIGTERM, old_term)
    return code


def _stop(procs: Sequence[subprocess.Popen], grace: float) -> None:
    """SIGTERM every running process's group, SIGKILL what is left after ``grace`` seconds."""
    def signal_all(sig):
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass
    signal_all(signal.SIGTERM)
    end = time.monotonic() + grace
    while any(p.poll() is None for p in procs) and time.monotonic() < end:
        time.sleep(0.05)
    signal_all(signal.SIGKILL)
    for p in procs:
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass


def add_launch_args(p: argparse.ArgumentParser) -> None:
    """The options of ``jmtp launch``."""
    p.add_argument("-n", "--num-processes", type=int, required=True,
                   help="processes to start on this host (one jax.distributed job)")
    p.add_argument("--devices-per-process", type=int, default=None,
                   help="CPU devices per process (sets XLA_FLAGS=--xla_force_host_platform_"
                        "device_count=M); default: leave XLA_FLAGS alone")
    p.add_argument("--port", type=int, default=0,
                   help="coordinator port on 127.0.0.1 (default 0: a free port)")
    p.add_argument("--output", choices=["all", "0"], default="all",
                   help="print every process's output with a [pI] prefix (all) or process 0's")
    p.add_argument("--timeout", type=float, default=None,
                   help="seconds before every process is stopped (exit code 124)")
    p.add_argument("--grace", type=float, default=5.0,
                   help="seconds between SIGTERM and SIGKILL when stopping processes")
    p.add_argument("--exec", dest="exec_command", action="store_true",
                   help="the words after -- are a whole command (e.g. python my_script.py), "
                        "not a jmtp subcommand")
    p.add_argument("command", nargs=argparse.REMAINDER,
                   help="-- then the jmtp subcommand and its options (e.g. -- generate "
                        "--tensor-parallel-size 4 --prompt Hi)")


def run_launch(args) -> int:
    """``jmtp launch`` from parsed :func:`add_launch_args` options."""
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise ValueError("jmtp launch: give the command after --, e.g. jmtp launch -n 2 -- "
                         "generate --prompt Hi")
    if not args.exec_command:
        if command[0] == "launch":
            raise ValueError("jmtp launch: the launched subcommand cannot be launch itself")
        command = [sys.executable, "-m", "jmtp", *command]
    return launch(command, args.num_processes, devices_per_process=args.devices_per_process,
                  port=args.port, output=args.output, timeout=args.timeout, grace=args.grace)


__all__ = ["launch", "free_port", "process_env", "add_launch_args", "run_launch",
           "EXIT_TIMEOUT", "EXIT_INTERRUPTED"]
