"""The soak test in the suite: ``scripts/soak.py`` (45 s of load after a 20 s warm-up) against a
live ``jmtp serve`` (tiny random model with SmolLM2's tokenizer, batch-invariant, a KV pool that
preempts all the time): every request finished or was abandoned by its client, greedy and seeded
outputs equal their solo runs, RSS / file descriptors / free KV blocks back to the baseline, and
the fault phase (a failing engine step, then a dead engine: error answers and 503s, never a hang,
a clean shutdown). The test also checks from the report that the load preempted, that clients
abandoned streams and disconnected, and that enough results met their solo runs. Marked ``soak``
(CI runs it; ``-m "not soak"`` leaves it out). The 30-minute run is documented in
docs/serving.md."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("httpx")
pytest.importorskip("fastapi")

pytestmark = [pytest.mark.soak, pytest.mark.xdist_group("soak")]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_soak_three_minutes(smollm2_dir, tmp_path):
    from tests.runtime.serve_process import free_port
    report = tmp_path / "soak.json"
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "scripts", "soak.py"), "--duration", "45",
         "--concurrency", "4", "--port", str(free_port()), "--report", str(report)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    tail = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, tail
    assert "SOAK OK" in proc.stdout, tail
    # The load was long enough to exercise what the soak is for (45 s; at 30 s on a loaded
    # 2-core machine: 89 requests, 20 abandoned by their clients, 2 preemptions).
    rep = json.loads(report.read_text())
    counts = rep["counts"]
    assert rep["preemptions"] >= 1, rep
    assert counts.get("stream_abort aborted", 0) >= 1, rep      # clients gone mid-stream
    assert counts.get("disconnect aborted", 0) >= 1, rep        # clients gone before the answer
    assert counts.get("finished", 0) >= 20 and rep["solo_checked"]["results"] >= 20, rep
    assert rep["fault_phase_answers"][-1] == 503, rep
