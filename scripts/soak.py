#!/usr/bin/env python
"""Soak test of ``jmtp serve``: minutes in the test suite, hours when asked.

Starts ``jmtp serve`` (a subprocess on 127.0.0.1) with a KV pool small enough that requests are
preempted all the time, and drives it for ``--duration`` seconds with ``--concurrency`` clients
sending a random mix: greedy completions (some with stop strings, ``min_tokens``, ``logit_bias``),
streamed chats (sampled, seeded; a share abandoned mid-stream), n=2 seeded samples, structured
outputs (a JSON schema, a choice), and non-streamed requests whose client disconnects before the
answer. The server runs ``--batch-invariant``, so a request's tokens do not depend on its batch
mates, preemptions or chunking: every finished greedy or seeded request must equal its solo run.

It fails (exit 1, the reasons printed) unless:

* every request finished or was abandoned by its client (no error status, no request that hung
  past ``--request-timeout``), and the server answered the whole time;
* every finished greedy and seeded request equals the same request run alone afterwards;
* after the load, the server is idle with every KV block free, and its RSS and open file
  descriptors are back to the baseline taken after the warm-up (within ``--rss-slack-mb`` and
  ``--fd-slack``);
* the engine was preempted at least once (the pool really was too small).

Then a fault phase (in process, on a small engine of its own): an engine step that raises fails
the requests in flight (an error answer, never a hang) and the engine serves the next requests;
an engine that cannot recover answers 503 at once, ``/health`` turns 503, and the server shuts
down cleanly.

The default model is a tiny random Llama with SmolLM2's tokenizer (written to a temporary HF
folder: steps cost little, so the minutes go to the serving logic); ``--model smollm2`` serves the
real one with few slots.

    python scripts/soak.py --duration 180                  # what the test suite runs
    nice python scripts/soak.py --duration 1800 --report /tmp/soak.json    # docs/serving.md
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time

#: Prompts of the greedy / seeded pool (a request's solo run is keyed by its body).
PROMPTS = ["The three primary colors are", "Write a short poem about the sea.",
           "def fibonacci(n):", "List five fruits:", "Translate 'good morning' to French.",
           "Once upon a time,", "The capital of Japan is", "1, 2, 3, 4,"]
CHOICES = ["yes", "no", "maybe"]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"]}


# ---------------------------------------------------------------------------------- the model
def tiny_model_dir(path: str, seed: int = 0) -> str:
    """A random 2-layer Llama (vocabulary and tokenizer of SmolLM2, chat template included) as a
    transformers checkpoint folder jmtp loads with ``--model``."""
    import numpy as np
    from safetensors.numpy import save_file

    from jmtp.model import load_tokenizer

    tok = load_tokenizer(None)
    V, H, I, L, NQ, NKV, D = tok.vocab_size, 64, 128, 2, 4, 2, 16
    rng = np.random.default_rng(seed)
    r = lambda *s: (0.5 * rng.standard_normal(s)).astype(np.float32)   # noqa: E731
    t = {"model.embed_tokens.weight": r(V, H), "model.norm.weight": 1 + 0.1 * r(H)}
    for i in range(L):
        p = f"model.layers.{i}."
        t.update({p + "input_layernorm.weight": 1 + 0.1 * r(H),
                  p + "post_attention_layernorm.weight": 1 + 0.1 * r(H),
                  p + "self_attn.q_proj.weight": r(NQ * D, H),
                  p + "self_attn.k_proj.weight": r(NKV * D, H),
                  p + "self_attn.v_proj.weight": r(NKV * D, H),
                  p + "self_attn.o_proj.weight": r(H, NQ * D),
                  p + "mlp.gate_proj.weight": r(I, H), p + "mlp.up_proj.weight": r(I, H),
                  p + "mlp.down_proj.weight": r(H, I)})
    os.makedirs(path, exist_ok=True)
    save_file(t, os.path.join(path, "model.safetensors"))
    eos = tok.eos_token_ids[0]
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"architectures": ["LlamaForCausalLM"], "vocab_size": V, "hidden_size": H,
                   "intermediate_size": I, "num_hidden_layers": L, "num_attention_heads": NQ,
                   "num_key_value_heads": NKV, "head_dim": D, "rms_norm_eps": 1e-5,
                   "tie_word_embeddings": True, "eos_token_id": eos}, f)
    tok.backend.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"chat_template": tok.chat_template,
                   "eos_token": tok.backend.id_to_token(eos)}, f)
    return path


# ---------------------------------------------------------------------------------- the server
def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def proc_resources(pid: int) -> tuple[int, int]:
    """``(RSS bytes, open file descriptors)`` of process ``pid`` (Linux /proc)."""
    with open(f"/proc/{pid}/status") as f:
        rss = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
    return rss, len(os.listdir(f"/proc/{pid}/fd"))


def metrics(http, base: str) -> dict:
    from prometheus_client.parser import text_string_to_metric_families
    out = {}
    for fam in text_string_to_metric_families(http.get(base + "/metrics", timeout=30).text):
        for s in fam.samples:
            if not s.labels:
                out[s.name] = s.value
    return out


def wait_idle(http, base: str, timeout: float) -> dict:
    """The server's metrics once nothing runs or waits and every KV block is free (or at the
    deadline)."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(http, base)
        if (m.get("jmtp_num_requests_running") == 0 and m.get("jmtp_num_requests_waiting") == 0
                and m.get("jmtp_kv_blocks_free") == m.get("jmtp_kv_blocks_total")):
            return m
        if time.monotonic() > deadline:
            return m
        time.sleep(0.2)


# ---------------------------------------------------------------------------------- requests
def make_request(rng: random.Random) -> tuple[str, str, dict]:
    """``(kind, endpoint, body)`` of one random request. Kinds ending in ``!`` have a solo
    reference (greedy, or seeded sampling)."""
    prompt = rng.choice(PROMPTS)
    kind = rng.choices(["greedy!", "greedy_stop!", "biased!", "stream_chat!", "stream_abort",
                        "n2_seeded!", "json_schema", "choice", "disconnect"],
                       [4, 2, 1, 2, 2, 1, 1, 1, 1])[0]
    body: dict = {"model": "soak", "max_tokens": rng.choice([8, 24, 48]), "temperature": 0}
    if kind in ("greedy!", "greedy_stop!", "biased!", "disconnect", "n2_seeded!", "choice"):
        endpoint, body["prompt"] = "/v1/completions", prompt
    else:
        endpoint = "/v1/chat/completions"
        body["messages"] = [{"role": "user", "content": prompt}]
    if kind == "greedy_stop!":
        body.update(stop=[rng.choice(["e", "the", "\n", ","])], min_tokens=rng.choice([0, 3]))
    elif kind == "biased!":
        body.update(logit_bias={str(rng.randrange(100, 40000)): -100, "30": 2.5})
    elif kind in ("stream_chat!", "stream_abort"):
        body.update(stream=True, temperature=0.8, seed=rng.randrange(2**40))
    elif kind == "n2_seeded!":
        body.update(n=2, temperature=1.0, seed=rng.randrange(-2**40, 2**40))
    elif kind == "json_schema":
        body.update(response_format={"type": "json_schema",
                                     "json_schema": {"name": "p", "schema": SCHEMA}})
    elif kind == "choice":
        body.update(structured_outputs={"choice": CHOICES})
    return kind, endpoint, body


def send(http, base: str, kind: str, endpoint: str, body: dict, timeout: float,
         rng: random.Random) -> tuple[str, object]:
    """Run one request: ``("finished", comparable result)``, ``("aborted", None)`` when this
    client abandoned it, or ``("error", description)``."""
    import httpx
    try:
        if body.get("stream"):
            text, finish = [], None
            stop_after = rng.randrange(1, 6) if kind == "stream_abort" else None
            with http.stream("POST", base + endpoint, json=body, timeout=timeout) as r:
                if r.status_code != 200:
                    return "error", f"{kind}: HTTP {r.status_code} {r.read()[:200]!r}"
                chunks = 0
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    obj = json.loads(line[6:])
                    if "error" in obj:
                        return "error", f"{kind}: stream error {obj['error']}"
                    for c in obj.get("choices", []):
                        text.append((c.get("delta") or {}).get("content") or c.get("text") or "")
                        finish = c.get("finish_reason") or finish
                    chunks += 1
                    if stop_after is not None and chunks >= stop_after:
                        return "aborted", None         # the client goes away mid-stream
            if finish is None:
                return "error", f"{kind}: stream ended without a finish_reason"
            return "finished", ("".join(text), finish)
        t = 0.05 + 0.3 * rng.random() if kind == "disconnect" else timeout
        try:
            r = http.post(base + endpoint, json=body, timeout=t)
        except httpx.TimeoutException:
            if kind == "disconnect":
                return "aborted", None                  # the client gave up: it disconnected
            raise
        if r.status_code != 200:
            return "error", f"{kind}: HTTP {r.status_code} {r.text[:300]}"
        out = r.json()
        choices = sorted(out["choices"], key=lambda c: c["index"])
        if any(c["finish_reason"] is None for c in choices):
            return "error", f"{kind}: a choice without finish_reason"
        if kind == "json_schema":
            obj = json.loads(choices[0]["message"]["content"]) \
                if choices[0]["finish_reason"] == "stop" else None
            if obj is not None and set(obj) != {"name", "age"}:
                return "error", f"{kind}: output does not match the schema: {obj}"
        if kind == "choice" and choices[0]["finish_reason"] == "stop" \
                and choices[0]["text"] not in CHOICES:
            return "error", f"{kind}: {choices[0]['text']!r} is not a choice"
        return "finished", tuple((c.get("text") if "text" in c else c["message"]["content"],
                                  c["finish_reason"]) for c in choices)
    except httpx.TimeoutException:
        return "error", f"{kind}: no answer in {timeout:.0f} s (hung?)"
    except httpx.HTTPError as e:
        return "error", f"{kind}: {type(e).__name__}: {e}"


def load(base: str, duration: float, concurrency: int, seed: int, timeout: float) -> dict:
    """Drive the server for ``duration`` s; returns the counts, errors and the results of the
    requests with a solo reference."""
    import httpx
    stop_at = time.monotonic() + duration
    lock = threading.Lock()
    counts: collections.Counter = collections.Counter()
    errors: list[str] = []
    results: dict[str, list] = collections.defaultdict(list)

    def worker(i: int):
        rng = random.Random(seed * 1000 + i)
        with httpx.Client() as http:
            while time.monotonic() < stop_at:
                kind, endpoint, body = make_request(rng)
                status, res = send(http, base, kind, endpoint, body, timeout, rng)
                with lock:
                    counts[status] += 1
                    counts[f"{kind} {status}"] += 1
                    if status == "error":
                        errors.append(res)
                    elif status == "finished" and kind.endswith("!"):
                        results[json.dumps([endpoint, body], sort_keys=True)].append(res)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return dict(counts=counts, errors=errors, results=results)


def solo_check(base: str, results: dict, timeout: float, limit: int) -> list[str]:
    """Run each distinct greedy / seeded request alone; every result under load must equal it."""
    import httpx
    bad = []
    with httpx.Client() as http:
        for key in list(results)[:limit]:
            endpoint, body = json.loads(key)
            status, ref = send(http, base, "solo", endpoint, body, timeout, random.Random(0))
            if status != "finished":
                bad.append(f"solo run failed: {ref}")
                continue
            for got in results[key]:
                if got != ref:
                    bad.append(f"{endpoint} {body}: under load {got!r} != alone {ref!r}")
    return bad


# ---------------------------------------------------------------------------------- the fault phase
def fault_check(model_dir: str, port: int) -> tuple[list[str], list]:
    """An engine step that raises fails the requests in flight (error answers, no hang) and the
    engine goes on; an engine that cannot recover answers 503 at once, ``/health`` says 503, and
    the server shuts down cleanly. In process, on a small engine whose ``step`` is wrapped."""
    import httpx
    import uvicorn

    import jmtp
    from jmtp.runtime.serve.async_engine import AsyncLLMEngine
    from jmtp.runtime.serve.server.app import build_app
    from jmtp.runtime.serve.server.metrics import ServerMetrics

    bad = []
    llm = jmtp.LLM(model_dir, max_num_seqs=2, max_model_len=128, compile="lazy",
                   layer_loop="scan", speculative_config=None)
    eng = llm.llm_engine
    real_step, real_abort = eng.step, eng.abort_request
    mode = {"fail": 0, "dead": False}

    def step():
        if mode["fail"] > 0:
            mode["fail"] -= 1
            raise RuntimeError("injected step failure")
        return real_step()

    def abort(ids):
        if mode["dead"]:
            raise RuntimeError("injected: the engine cannot recover")
        return real_abort(ids)

    eng.step, eng.abort_request = step, abort
    metrics_ = ServerMetrics()
    engine = AsyncLLMEngine.from_llm(llm, on_step=metrics_.on_step, start=False)
    app = build_app(engine, llm.tokenizer, model_name="soak", max_model_len=128, metrics=metrics_)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    th = threading.Thread(target=server.run, daemon=True)
    th.start()
    base = f"http://127.0.0.1:{port}"
    body = {"model": "soak", "prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0}
    seen = []

    def post():
        """``(status, response)``; a connection the server closed counts as status 599."""
        try:
            # a fresh connection each time: after a failed request uvicorn closes its connection
            with httpx.Client(timeout=120) as one:
                r = one.post(base + "/v1/completions", json=body)
            seen.append(r.status_code)
            return r.status_code, r
        except (httpx.ReadError, httpx.RemoteProtocolError) as e:
            seen.append(f"closed ({type(e).__name__})")
            return 599, None

    with httpx.Client(timeout=120) as http:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if http.get(base + "/health").status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        code, ok = post()
        if code != 200:
            bad.append(f"fault phase: a plain request failed first: {code}")
        mode["fail"] = 1                        # one step raises: its request fails
        t0 = time.monotonic()
        code, _ = post()
        if code < 500 or time.monotonic() - t0 > 60:
            bad.append(f"fault phase: a failed step gave {code} after "
                       f"{time.monotonic() - t0:.1f} s")
        code, r = post()                        # the loop went on: served as before
        if code != 200 or r.json()["choices"][0]["text"] != ok.json()["choices"][0]["text"]:
            bad.append(f"fault phase: the engine did not recover ({code})")
        mode["fail"], mode["dead"] = 1, True    # the step fails and the abort too: dead
        code, _ = post()
        t0 = time.monotonic()
        code2, _ = post()
        if code < 500 or code2 != 503 or time.monotonic() - t0 > 5:
            bad.append(f"fault phase: a dead engine answered {code}, then {code2} after "
                       f"{time.monotonic() - t0:.1f} s (want 503 at once)")
        if http.get(base + "/health").status_code != 503:
            bad.append("fault phase: /health is not 503 for a dead engine")
    server.should_exit = True
    th.join(30)
    if th.is_alive():
        bad.append("fault phase: the server did not shut down within 30 s")
    llm.close()
    return bad, seen


# ---------------------------------------------------------------------------------- main
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=180.0, help="seconds of load")
    ap.add_argument("--concurrency", type=int, default=6)
    ap.add_argument("--model", default="tiny", help="tiny (random, SmolLM2's tokenizer), "
                    "smollm2, or a model path")
    ap.add_argument("--port", type=int, default=18490)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-num-seqs", type=int, default=2)
    ap.add_argument("--num-blocks", type=int, default=8,
                    help="KV blocks of 16 positions: few, so requests are preempted")
    ap.add_argument("--speculative-method", default="ngram", choices=["ngram", "mtp"],
                    help="ngram: speculation without a drafter to compile (the tiny model's "
                         "random MTP head would draft nothing useful either)")
    ap.add_argument("--warmup", type=float, default=20.0, help="seconds of load before the "
                    "baseline is taken")
    ap.add_argument("--request-timeout", type=float, default=300.0)
    ap.add_argument("--rss-slack-mb", type=float, default=64.0)
    ap.add_argument("--fd-slack", type=int, default=4)
    ap.add_argument("--solo-limit", type=int, default=40, help="distinct requests re-run alone")
    ap.add_argument("--no-fault-phase", action="store_true")
    ap.add_argument("--report", default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)
    import httpx

    workdir = tempfile.mkdtemp(prefix="jmtp-soak-")
    model = {"tiny": lambda: tiny_model_dir(os.path.join(workdir, "tiny")),
             "smollm2": lambda: None}.get(args.model, lambda: args.model)()
    cmd = [sys.executable, "-m", "jmtp", "serve", "--host", "127.0.0.1", "--port",
           str(args.port), "--served-model-name", "soak", "--log-level", "warning",
           "--max-num-seqs", str(args.max_num_seqs), "--max-model-len", "256",
           "--num-blocks", str(args.num_blocks), "--num-speculative-tokens", "2",
           "--speculative-method", args.speculative_method, "--max-num-batched-tokens", "32",
           "--batch-invariant", "--layer-loop", "scan",
           "--compile", "eager"]       # every bucket compiled before the baseline is taken
    if model is not None:
        cmd += ["--model", model]
    if args.model == "tiny" and args.speculative_method == "mtp":
        cmd += ["--mtp-head", "none"]          # a fresh head for the random model
    log_path = os.path.join(workdir, "server.log")
    failures: list[str] = []
    report: dict = dict(args=vars(args), command=" ".join(cmd))
    t_start = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                env=dict(os.environ, JMTP_CACHE_DIR="off"))
    base = f"http://127.0.0.1:{args.port}"
    try:
        with httpx.Client() as http:
            deadline = time.monotonic() + 1800
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"server exited: {open(log_path).read()[-3000:]}")
                try:
                    if http.get(base + "/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError("server not healthy in 1800 s")
                time.sleep(0.5)
            # warm-up: the same mix for a while (first runs of every code path), then the
            # baseline
            warm = load(base, args.warmup, args.concurrency, args.seed + 99, args.request_timeout)
            failures += [f"warm-up: {e}" for e in warm["errors"][:20]]
            idle = wait_idle(http, base, 120)
            rss0, fd0 = proc_resources(proc.pid)
            report["baseline"] = dict(rss_mb=rss0 / 2**20, fds=fd0,
                                      free_blocks=idle.get("jmtp_kv_blocks_free"))
            pre0 = idle.get("jmtp_num_preemptions_total", 0)
            t0 = time.monotonic()
            res = load(base, args.duration, args.concurrency, args.seed, args.request_timeout)
            report["load_seconds"] = time.monotonic() - t0
            report["counts"] = dict(res["counts"])
            failures += res["errors"][:50]
            if proc.poll() is not None:
                failures.append(f"the server exited during the load ({proc.returncode})")
            end = wait_idle(http, base, 300)
            if (end.get("jmtp_num_requests_running") != 0 or
                    end.get("jmtp_num_requests_waiting") != 0 or
                    end.get("jmtp_kv_blocks_free") != end.get("jmtp_kv_blocks_total")):
                failures.append(f"not idle after the load: running "
                                f"{end.get('jmtp_num_requests_running')}, waiting "
                                f"{end.get('jmtp_num_requests_waiting')}, free blocks "
                                f"{end.get('jmtp_kv_blocks_free')} of "
                                f"{end.get('jmtp_kv_blocks_total')}")
            failures += solo_check(base, res["results"], args.request_timeout, args.solo_limit)
            report["solo_checked"] = dict(distinct=min(len(res["results"]), args.solo_limit),
                                          results=sum(len(v) for v in res["results"].values()))
            preempted = end.get("jmtp_num_preemptions_total", 0) - pre0
            report["preemptions"] = preempted
            if "jmtp_num_preemptions_total" in end and preempted < 1:
                failures.append("no preemption during the load: the KV pool was not small enough")
            wait_idle(http, base, 60)
            rss1, fd1 = proc_resources(proc.pid)
            report["end"] = dict(rss_mb=rss1 / 2**20, fds=fd1,
                                 free_blocks=end.get("jmtp_kv_blocks_free"))
            if rss1 - rss0 > args.rss_slack_mb * 2**20:
                failures.append(f"RSS grew {(rss1 - rss0) / 2**20:.1f} MB over the load "
                                f"(slack {args.rss_slack_mb} MB)")
            if fd1 - fd0 > args.fd_slack:
                failures.append(f"open fds grew {fd0} -> {fd1}")
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)
    print(json.dumps({k: v for k, v in report.items() if k != "args"}, default=str), flush=True)
    if not args.no_fault_phase:
        try:
            bad, seen = fault_check(model, free_port())
            failures += bad
            report["fault_phase_answers"] = seen
        except Exception as e:  # noqa: BLE001 -- a crash of the phase is a failure to report
            failures.append(f"fault phase crashed: {type(e).__name__}: {e}")
    shutil.rmtree(workdir, ignore_errors=True)
    report["seconds"] = time.monotonic() - t_start
    report["failures"] = failures
    print(json.dumps({k: v for k, v in report.items() if k != "args"}, indent=1, default=str))
    if args.report:
        with open(args.report, "w") as f:
            json.dump(report, f, indent=1, default=str)
    print("SOAK " + ("OK" if not failures else f"FAILED ({len(failures)})"))
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
