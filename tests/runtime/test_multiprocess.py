"""Multi-process serving: 2 processes × 2 CPU devices on localhost (``jax.distributed``, gloo).

``jmtp launch`` starts ``tests/runtime/multiprocess_worker.py`` twice; both processes build the same
tiny model (8 kv heads) on the global ``(data, model)`` mesh and serve the same requests, greedy and
seeded sampled (temperature 0.8), plain and MTP K=3, on a full batch and on one with a padding
slot. Every process's tokens must equal the one-process, one-device engine's (run here, in this
pytest process, while the workers run), and the greedy ones the independent full-forward reference.
A second launch checks that the launcher stops the job and names the process when one exits
non-zero. The rest (argument checks, device order, environment) runs without JAX devices.

Every subprocess is bounded (the launcher's ``--timeout``, a wait timeout here) and killed in a
``finally`` (the workers also die with the launcher, ``PR_SET_PDEATHSIG``).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import types

import pytest

from jmtp.launch import process_env
from jmtp.runtime.process import distributed as dist
from tests.runtime import multiprocess_worker as worker
from tests.runtime.conftest import reference_greedy

pytestmark = pytest.mark.xdist_group("multiprocess")  # one worker runs the module-scoped fixture once

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NUM_PROCESSES, DEVICES_PER_PROCESS = 2, 2
# (data, model) meshes over the 4 global devices: tensor parallel across both processes, and
# data parallel across the processes (each process one data shard) with TP 2 inside each.
MESHES = [(1, 4), (2, 2)]
# seconds: far above a quiet 2-core run, bounds a hung job ($JMTP_TEST_LAUNCH_TIMEOUT for a
# starved machine)
LAUNCH_TIMEOUT = int(os.environ.get("JMTP_TEST_LAUNCH_TIMEOUT", 300))


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    for k in dist.ENV_VARS:
        env.pop(k, None)
    return env


def _launch(args, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "jmtp", "launch", *args], cwd=ROOT, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, **kw)


def _finish(proc: subprocess.Popen, timeout: float) -> tuple[int, str]:
    """Wait for the launcher; on timeout (or any error) SIGTERM it (it stops its workers), then
    SIGKILL its group."""
    try:
        out, _ = proc.communicate(timeout=timeout)
        return proc.returncode, out
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


@pytest.fixture(scope="module", params=MESHES, ids=lambda m: f"mesh{m[0]}x{m[1]}")
def job(request, tmp_path_factory):
    """``(results per process, one-device results, launcher output, seconds)``: the launched job
    and, computed meanwhile in this process, the one-device run of the same cases."""
    dp, tp = request.param
    out_dir = tmp_path_factory.mktemp("multiproc")
    t0 = time.perf_counter()
    proc = _launch(["-n", str(NUM_PROCESSES), "--devices-per-process", str(DEVICES_PER_PROCESS),
                    "--timeout", str(LAUNCH_TIMEOUT), "--exec", "--", sys.executable, "-m",
                    "tests.runtime.multiprocess_worker", "--mesh", f"{dp},{tp}",
                    "--out", str(out_dir)])
    try:
        one = {f"k={k}": worker.run_engine(1, 1, k) for k in worker.KS}
    finally:
        code, text = _finish(proc, LAUNCH_TIMEOUT + 30)
    assert code == 0, text[-6000:]
    procs = []
    for i in range(NUM_PROCESSES):
        with open(out_dir / f"p{i}.json") as f:
            procs.append(json.load(f))
    return procs, one, text, time.perf_counter() - t0


@pytest.fixture(scope="module")
def reference():
    from tests.runtime.sharding_worker import model
    cfg, params = model()
    return {tuple(p): reference_greedy(cfg, params, p, worker.MAX_TOKENS) for p in worker.PROMPTS}


def test_every_process_equals_one_device(job, reference):
    procs, one, text, seconds = job
    print(f"multi-process job + one-device run: {seconds:.1f} s")
    for k in worker.KS:
        key = f"k={k}"
        for name, (prompts, _) in worker.cases().items():
            want = one[key][name]
            if name.startswith("greedy"):
                assert want == [reference[tuple(p)] for p in prompts], (key, name)
            else:
                assert want != [reference[tuple(p)] for p in prompts], (key, name)  # sampled
            for p in procs:
                assert p[key][name] == want, (p["process_index"], key, name)


def test_async_scheduling_equals_the_synchronous_loop_on_every_process(job):
    """With asynchronous scheduling on (plain and MTP; the worker sets it, as the default is off
    on CPU) on the 2-process mesh, the synchronous loop gives every process the same greedy and
    seeded sampled tokens."""
    procs, *_ = job
    for p in procs:
        for k in worker.KS:
            res = p[f"k={k}"]
            assert res["_async_on"] is True
            for name in worker.cases():
                assert res["_sync"][name] == res[name], (p["process_index"], k, name)


def test_mesh_spans_both_processes_and_model_axis_is_process_major(job):
    procs, *_ = job
    assert sorted(p["process_index"] for p in procs) == list(range(NUM_PROCESSES))
    for p in procs:
        assert p["process_count"] == NUM_PROCESSES
        assert len(p["local_devices"]) == DEVICES_PER_PROCESS
        assert len(p["global_devices"]) == NUM_PROCESSES * DEVICES_PER_PROCESS
        for k in worker.KS:
            eng = p[f"k={k}"]["_engine"]
            dp, tp = eng["mesh_shape"]
            owners = [[proc for _, proc in row] for row in eng["mesh"]]
            # process-major: each process owns a contiguous block of DP·TP/P mesh positions
            flat = [o for row in owners for o in row]
            per = dp * tp // NUM_PROCESSES
            assert flat == [i // per for i in range(dp * tp)]
            assert eng["params_span_processes"] == (dp * tp > DEVICES_PER_PROCESS)
            assert eng["free_blocks"] == eng["num_blocks"]       # every block returned
            kv_local, kv_total = eng["memory"]["kv_cache"]
            assert kv_local * tp * dp == kv_total    # kv heads over model, blocks over data


def test_launcher_stops_the_job_when_a_process_fails(tmp_path):
    """Process 1 exits 3 while process 0 sleeps: the launcher exits 3 at once, names process 1
    and its code, and process 0 is gone."""
    pid_file = tmp_path / "p0.pid"
    child = ("import os, sys, time\n"
             "if os.environ['JMTP_PROCESS_ID'] == '1':\n"
             "    time.sleep(0.5); print('p1 failing', flush=True); sys.exit(3)\n"
             f"open({str(pid_file)!r}, 'w').write(str(os.getpid()))\n"
             "time.sleep(120)\n")
    t0 = time.perf_counter()
    proc = _launch(["-n", "2", "--grace", "1", "--timeout", "100", "--exec", "--",
                    sys.executable, "-c", child])
    code, text = _finish(proc, 110)
    seconds = time.perf_counter() - t0
    assert code == 3, text
    assert "jmtp launch: process 1 of 2 exited with code 3; stopped the other processes" in text
    assert "[p1] p1 failing" in text
    assert seconds < 60, seconds
    pid = int(pid_file.read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


# ---------------------------------------------------------------- no devices needed
@pytest.mark.parametrize("kw, env, match", [
    (dict(num_processes=2, process_id=0), {}, "coordinator_address missing"),
    ({}, {dist.ENV_NUM_PROCESSES: "2", dist.ENV_PROCESS_ID: "1"}, "coordinator_address missing"),
    (dict(coordinator_address="127.0.0.1:1234", num_processes=2, process_id=2), {},
     r"process_id=2 must lie in \[0, num_processes=2\)"),
    (dict(coordinator_address="127.0.0.1:1234", num_processes=2, process_id=-1), {},
     r"process_id=-1 must lie in"),
    (dict(coordinator_address="127.0.0.1:1234", num_processes=0, process_id=0), {},
     "num_processes must be >= 1"),
    (dict(coordinator_address="127.0.0.1", num_processes=2, process_id=0), {}, "host:port"),
    (dict(coordinator_address="127.0.0.1:70000", num_processes=2, process_id=0), {}, "host:port"),
    ({}, {dist.ENV_COORDINATOR: "h:1", dist.ENV_NUM_PROCESSES: "two",
          dist.ENV_PROCESS_ID: "0"}, r"\$JMTP_NUM_PROCESSES must be an integer"),
])
def test_distributed_arguments_are_checked(kw, env, match):
    with pytest.raises(ValueError, match=match):
        dist.resolve(**kw, environ=env)


def test_distributed_arguments_resolve():
    env = {dist.ENV_COORDINATOR: "10.0.0.1:8476", dist.ENV_NUM_PROCESSES: "4",
           dist.ENV_PROCESS_ID: "3"}
    assert dist.resolve(environ=env) == ("10.0.0.1:8476", 4, 3)
    assert dist.resolve(process_id=1, environ=env) == ("10.0.0.1:8476", 4, 1)   # argument wins
    assert dist.resolve(environ={}) == (None, None, None)       # JAX auto-detection (TPU pods)
    assert dist.env_requested(env) and not dist.env_requested({dist.ENV_PROCESS_ID: " "})


def test_process_env_sets_the_job_and_replaces_the_device_count():
    base = {"XLA_FLAGS": "--xla_backend_optimization_level=0 "
                         "--xla_force_host_platform_device_count=8", "KEEP": "1"}
    env = process_env(base, 3, 2, "127.0.0.1:5000", 2)
    assert env["KEEP"] == "1"
    assert (env[dist.ENV_COORDINATOR], env[dist.ENV_NUM_PROCESSES], env[dist.ENV_PROCESS_ID]) == (
        "127.0.0.1:5000", "3", "2")
    assert env["XLA_FLAGS"].split() == ["--xla_backend_optimization_level=0",
                                        "--xla_force_host_platform_device_count=2"]
    assert process_env({}, 1, 0, "h:1", None).get("XLA_FLAGS") is None


def test_mesh_devices_are_balanced_and_process_major(monkeypatch):
    """2 processes × 4 devices listed interleaved: a 4-device mesh takes 2 of each, process 0's
    first; a model axis of 2 then stays inside a process; 3 devices cannot be split evenly."""
    from jmtp.runtime.device import sharding as shd
    devs = [types.SimpleNamespace(id=i + 100 * p, process_index=p, platform="cpu")
            for i in range(4) for p in (1, 0)]
    monkeypatch.setattr(shd.jax, "devices", lambda: devs)
    monkeypatch.setattr(shd.jax, "process_count", lambda: 2)
    assert [(d.process_index, d.id) for d in shd.mesh_devices(4)] == [
        (0, 0), (0, 1), (1, 100), (1, 101)]
    assert [(d.process_index, d.id) for d in shd.mesh_devices(8)] == [
        (0, 0), (0, 1), (0, 2), (0, 3), (1, 100), (1, 101), (1, 102), (1, 103)]
    with pytest.raises(ValueError, match="multiple of the process count 2"):
        shd.mesh_devices(3)
