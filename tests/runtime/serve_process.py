"""``jmtp serve`` in a subprocess on 127.0.0.1 for the server tests (test_server.py and
test_server_hardening.py on tiny models, test_server_e2e.py on SmolLM2), and its ``/metrics``
read back."""
from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_server(args: list[str], log_path, timeout: float = 300.0):
    """Start ``jmtp serve`` with ``args`` on a free port, wait for ``/health``, yield the base
    URL; the process is killed on exit. Its output goes to ``log_path``.

    Raises:
      RuntimeError: the server exited or was not healthy within ``timeout`` s (with its log).
    """
    port = free_port()
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "jmtp", "serve", "--host", "127.0.0.1",
                                 "--port", str(port), "--log-level", "warning"] + list(args),
                                stdout=log, stderr=subprocess.STDOUT)
        base = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + timeout
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"server exited ({proc.returncode}):\n"
                                       f"{log_path.read_text()}")
                try:
                    if httpx.get(base + "/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"server not healthy in {timeout:.0f} s:\n"
                                       f"{log_path.read_text()}")
                time.sleep(0.5)
            yield base
        finally:
            proc.kill()
            proc.wait(timeout=30)


def metrics(base: str) -> dict:
    """``{(name, labels tuple): value}`` of every sample the server at ``base`` exports
    (prometheus_client's text parser)."""
    from prometheus_client.parser import text_string_to_metric_families
    out = {}
    for fam in text_string_to_metric_families(httpx.get(base + "/metrics").text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out
