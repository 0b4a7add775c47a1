"""``jmtp serve`` with per-request speculation caps, and on a 2-process mesh (``jmtp launch -n 2
-- serve``), through the ``openai`` client, on a tiny random Llama checkpoint (written here with
transformers, with the tiny byte-level BPE tokenizer of ``structured_fixtures``).

* One process, n-gram K=3, asynchronous scheduling on: a mix of requests with speculation off,
  capped at 1, at K and uncapped; each request's drafts per step (``usage.speculation``, from its
  metrics) stay within its cap, the greedy outputs are those of the uncapped request, a cap above
  K is a 400 naming the field.
* Two processes (one CPU device each, tensor parallel over both), started by ``jmtp launch``:
  greedy, seeded sampled and streamed answers equal the one-process server's; then SIGKILL of
  process 1 stops the job with a line naming it, within a bounded time.
* Without a launcher, a process of a ``jax.distributed`` job whose peer dies exits within the
  heartbeat timeout ``distributed.initialize`` sets (``$JMTP_HEARTBEAT_TIMEOUT``).

Every subprocess is bounded and killed in a ``finally``.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from jmtp.runtime.process import distributed as dist
from tests.runtime.serve_process import free_port

openai = pytest.importorskip("openai")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.xdist_group("serve_multiprocess")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
START_TIMEOUT = float(os.environ.get("JMTP_TEST_LAUNCH_TIMEOUT", 300))
ENGINE = ["--max-num-seqs", "4", "--max-model-len", "64", "--compile", "lazy",
          "--layer-loop", "scan",
          "--speculative-method", "ngram", "--num-speculative-tokens", "3",
          "--async-scheduling", "on", "--log-level", "warning", "--served-model-name", "tiny"]
PROMPTS = ["ab ab ab ab", "hello hello", "{\"name\": \"ab\"", "true or false or true"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny Llama (vocab 128, 4 heads, 2 kv heads) with the tiny BPE tokenizer."""
    sys.path.insert(0, os.path.join(ROOT, "tests", "runtime"))
    from structured_fixtures import VOCAB_SIZE, tiny_tokenizer
    d = tmp_path_factory.mktemp("tiny_llama")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB_SIZE, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, eos_token_id=1, bos_token_id=None,
                                   tie_word_embeddings=True, max_position_embeddings=64)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    model.save_pretrained(d)
    tiny_tokenizer().backend.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
    return d


def _env(**extra):
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    for k in dist.ENV_VARS:
        env.pop(k, None)
    env.update(extra)
    return env


def _wait_healthy(proc, base: str, log_path, timeout: float = START_TIMEOUT):
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited ({proc.returncode}):\n{log_path.read_text()[-6000:]}")
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"not healthy in {timeout:.0f} s:\n{log_path.read_text()[-6000:]}")
        time.sleep(0.5)


def _stop(proc):
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _start(args, log_path, **env):
    log = open(log_path, "w")
    return subprocess.Popen([sys.executable, "-m", "jmtp", *args], cwd=ROOT, env=_env(**env),
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _answers(base: str) -> dict:
    """Greedy, seeded sampled (n=2) and streamed completions of :data:`PROMPTS`."""
    client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=120)
    out = {}
    for i, p in enumerate(PROMPTS):
        r = client.completions.create(model="tiny", prompt=p, max_tokens=12, temperature=0,
                                      logprobs=None)
        out[f"greedy{i}"] = r.choices[0].text
        r = client.completions.create(model="tiny", prompt=p, max_tokens=10, temperature=0.8,
                                      seed=40 + i, n=2)
        out[f"sampled{i}"] = [c.text for c in r.choices]
    chunks = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=12,
                                       temperature=0, stream=True)
    out["stream"] = "".join(c.choices[0].text for c in chunks if c.choices)
    return out


def _cap_mix(base: str) -> dict:
    """Requests capped at 0, 1, K=3 and uncapped, concurrently; per cap: (texts, usage)."""
    import concurrent.futures as cf
    client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=120)
    caps = [None, 0, 1, 3]

    def one(cap):
        extra = {} if cap is None else {"num_speculative_tokens": cap}
        r = client.completions.create(model="tiny", prompt=PROMPTS, max_tokens=16, temperature=0,
                                      extra_body=extra)
        return [c.text for c in r.choices], r.usage.model_extra["speculation"]
    with cf.ThreadPoolExecutor(4) as ex:
        return dict(zip(caps, ex.map(one, caps)))


@pytest.fixture(scope="module")
def one_process(model_dir, tmp_path_factory):
    """The one-process server's answers, cap mix and a too-large cap's error."""
    log_path = tmp_path_factory.mktemp("serve1") / "log.txt"
    port = free_port()
    proc = _start(["serve", "--model", str(model_dir), "--port", str(port), *ENGINE], log_path)
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(proc, base, log_path)
        answers, mix = _answers(base), _cap_mix(base)
        bad = httpx.post(base + "/v1/completions", json={"prompt": "ab", "max_tokens": 2,
                                                         "num_speculative_tokens": 4}, timeout=60)
        return answers, mix, bad
    finally:
        _stop(proc)


def test_server_cap_mix_drafts_within_each_cap(one_process):
    _, mix, bad = one_process
    texts_none, usage_none = mix[None]
    assert usage_none["num_draft_tokens"] > 0      # n-gram matches on these prompts
    for cap in (0, 1, 3):
        texts, usage = mix[cap]
        assert texts == texts_none, cap             # greedy: the cap changes no token
        assert usage["max_drafts_per_step"] <= cap, (cap, usage)
        if cap == 0:
            assert usage["num_draft_tokens"] == 0
    assert mix[1][1]["num_draft_tokens"] <= mix[1][1]["num_decode_steps"]
    assert bad.status_code == 400
    err = bad.json()["error"]
    assert err["param"] == "num_speculative_tokens" and "3" in err["message"], err


def test_two_process_serve_answers_as_one_process(model_dir, one_process, tmp_path):
    """``jmtp launch -n 2 -- serve`` (tensor parallel over the two processes, asynchronous
    scheduling): the same answers as the one-process server; killing process 1 stops the job
    with a line naming it within the launcher's grace."""
    want, _, _ = one_process
    log_path = tmp_path / "launch.txt"
    port = free_port()
    proc = _start(["launch", "-n", "2", "--devices-per-process", "1", "--timeout",
                   str(int(START_TIMEOUT) + 300), "--", "serve", "--model", str(model_dir),
                   "--port", str(port), "--tensor-parallel-size", "2", *ENGINE], log_path)
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(proc, base, log_path)
        got = _answers(base)
        assert got == want
        workers = [int(p) for p in os.listdir("/proc") if p.isdigit()
                   and _proc_env(int(p)).get("JMTP_PROCESS_ID") == "1"
                   and _proc_env(int(p)).get("JMTP_COORDINATOR_ADDRESS")
                   and _ppid(int(p)) == proc.pid]
        assert len(workers) == 1, workers
        t0 = time.monotonic()
        os.kill(workers[0], signal.SIGKILL)
        code = proc.wait(timeout=60)
        assert time.monotonic() - t0 < 30
        text = log_path.read_text()
        assert code != 0 and "process 1 of 2 was killed by SIGKILL" in text, text[-3000:]
    finally:
        _stop(proc)


def _proc_env(pid: int) -> dict:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return dict(kv.split("=", 1) for kv in f.read().decode(errors="replace").split("\0")
                        if "=" in kv)
    except OSError:
        return {}


def _ppid(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except OSError:
        return -1


_PEER = """
import sys, time
from jmtp.runtime.process import distributed
distributed.initialize()
import jax
print("ready", jax.process_index(), flush=True)
while True:
    time.sleep(0.2)
"""


def test_a_dead_peer_stops_the_job_within_the_heartbeat_timeout(tmp_path):
    """Two processes of one job, no launcher: SIGKILL one; the other is terminated by JAX's
    coordination service within ``$JMTP_HEARTBEAT_TIMEOUT`` (5 s here) plus a margin, saying
    that another task died."""
    from jmtp.launch import process_env
    coord = f"127.0.0.1:{free_port()}"
    procs, logs = [], []
    try:
        for i in range(2):
            env = process_env(_env(JMTP_HEARTBEAT_TIMEOUT="5"), 2, i, coord, None)
            logs.append(tmp_path / f"p{i}.txt")
            procs.append(subprocess.Popen([sys.executable, "-c", _PEER], cwd=ROOT, env=env,
                                          stdout=open(logs[-1], "w"), stderr=subprocess.STDOUT,
                                          start_new_session=True))
        deadline = time.monotonic() + 120
        while not all("ready" in p.read_text() for p in logs):
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), \
                [p.read_text()[-2000:] for p in logs]
            time.sleep(0.2)
        t0 = time.monotonic()
        os.killpg(procs[1].pid, signal.SIGKILL)
        code = procs[0].wait(timeout=60)
        elapsed = time.monotonic() - t0
        assert code != 0 and elapsed < 5 + 25, elapsed
        assert "another task died" in logs[0].read_text(), logs[0].read_text()[-2000:]
    finally:
        for p in procs:
            _stop(p)
