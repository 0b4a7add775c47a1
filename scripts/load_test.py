"""Load test of ``jmtp serve`` through the official ``openai`` client (loopback only, bounded).

N chat requests from C concurrent clients (asyncio tasks sharing one ``AsyncOpenAI`` client), each
streamed, so time to first token (TTFT) is measured. Prints throughput, p50/p99 latency and TTFT,
and checks that

* every request completed (a finish reason, no error, nothing lost);
* the server's free KV-block count (``jmtp_kv_blocks_free`` from ``/metrics``) returns to its value
  before the load;
* with ``--check-offline``: each greedy output equals offline ``LLM.generate`` on the same
  chat-templated prompt (same engine options, run in this process after the server is stopped).

Exits 1 on any failure. Without ``--base-url`` it starts ``jmtp serve`` itself on a free port of
127.0.0.1 (killed at the end, whatever happens).

    .venv/bin/python scripts/load_test.py --num-requests 200 --concurrency 32 --max-tokens 32 \\
        --max-num-seqs 16 --check-offline
"""
from __future__ import annotations

import argparse
import asyncio
import shlex
import socket
import subprocess
import sys
import time

import httpx

TOPICS = ["the sea", "a red fox", "compilers", "bread", "the moon", "rain in Paris", "a library",
          "chess", "autumn leaves", "a lighthouse", "coffee", "mountains", "a robot", "the desert",
          "trains", "gardening", "a violin", "snow", "bees", "the printing press", "volcanoes",
          "a lost key", "friendship", "clocks", "the Internet", "a cat", "rivers", "jazz",
          "penguins", "a bridge", "stars", "tea", "maps", "a thunderstorm", "honey", "glaciers",
          "a marathon", "origami", "whales", "a market"]
STYLES = ["Write one sentence about {}.", "Give two facts about {}.", "Describe {} in a few words.",
          "Write a haiku about {}.", "What is interesting about {}?"]


def make_prompts(n: int) -> list[str]:
    """``n`` chat prompts: the 200 combinations of topic × style, cycled."""
    all_ = [s.format(t) for s in STYLES for t in TOPICS]
    return [all_[i % len(all_)] for i in range(n)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_metrics(base: str) -> dict[str, float]:
    """Samples of ``/metrics`` (parsed with prometheus_client's parser): an unlabelled one under
    its name, a labelled one as ``name{key=value,...}``."""
    from prometheus_client.parser import text_string_to_metric_families
    text = httpx.get(base.removesuffix("/v1") + "/metrics", timeout=10).text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out


def gc_pauses(before: dict, after: dict) -> str:
    """The server's garbage-collector pauses between two reads (``jmtp_gc_pause_seconds``)."""
    def delta(sample: str, gen: int) -> float:
        key = f"jmtp_gc_pause_seconds_{sample}{{generation={gen}}}"
        return after.get(key, 0) - before.get(key, 0)

    return ", ".join(f"gen {g}: {delta('count', g):.0f} in {delta('sum', g):.3f} s"
                     for g in range(3))


def engine_args(a) -> list[str]:
    args = ["--max-num-seqs", str(a.max_num_seqs), "--max-model-len", str(a.max_model_len)]
    if a.no_spec:
        args.append("--no-spec")
    else:
        args += ["--num-speculative-tokens", str(a.num_speculative_tokens)]
    if a.model:
        args += ["--model", a.model]
    return args


def start_server(a) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "jmtp", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--log-level", "warning"] + engine_args(a)
    print("starting:", shlex.join(cmd), flush=True)
    proc = subprocess.Popen(cmd)
    base = f"http://127.0.0.1:{port}/v1"
    deadline = time.monotonic() + a.startup_timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with code {proc.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"server not healthy after {a.startup_timeout}s")


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    if not xs:
        return float("nan")
    i = min(len(xs) - 1, max(0, int(round(q / 100 * (len(xs) - 1)))))
    return xs[i]


async def run_load(base: str, model: str, prompts: list[str], a) -> list[dict]:
    from openai import AsyncOpenAI
    client = AsyncOpenAI(base_url=base, api_key="none", timeout=a.request_timeout, max_retries=0)
    results: list[dict | None] = [None] * len(prompts)
    todo: asyncio.Queue = asyncio.Queue()
    for i in range(len(prompts)):
        todo.put_nowait(i)

    async def one(i: int) -> dict:
        t0 = time.perf_counter()
        ttft, text, finish, usage = None, [], None, None
        stream = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompts[i]}],
            max_tokens=a.max_tokens, temperature=0.0, stream=True,
            stream_options={"include_usage": True})
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for c in chunk.choices:
                if c.delta.content:
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                    text.append(c.delta.content)
                if c.finish_reason is not None:
                    finish = c.finish_reason
        return dict(text="".join(text), finish=finish, ttft=ttft,
                    latency=time.perf_counter() - t0,
                    tokens=usage.completion_tokens if usage else None)

    async def worker():
        while True:
            try:
                i = todo.get_nowait()
            except asyncio.QueueEmpty:
                return
            try:
                results[i] = await one(i)
            except Exception as e:  # noqa: BLE001 -- recorded as a failure
                results[i] = dict(error=f"{type(e).__name__}: {e}")
            done = sum(r is not None for r in results)
            if done % 25 == 0 or done == len(prompts):
                print(f"  {done}/{len(prompts)} requests answered", flush=True)

    await asyncio.wait_for(asyncio.gather(*(worker() for _ in range(a.concurrency))),
                           timeout=a.total_timeout)
    await client.close()
    return results


def offline_outputs(prompts: list[str], a) -> dict[str, str]:
    from jmtp import LLM, SamplingParams, SpeculativeConfig
    spec = None if a.no_spec else SpeculativeConfig("mtp", a.num_speculative_tokens)
    llm = LLM(a.model, speculative_config=spec, max_num_seqs=a.max_num_seqs,
              max_model_len=a.max_model_len)
    uniq = sorted(set(prompts))
    templ = [llm.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in uniq]
    outs = llm.generate(templ, SamplingParams(max_tokens=a.max_tokens, temperature=0.0),
                        use_tqdm=False)
    return {p: o.outputs[0].text if hasattr(o, "outputs") else o.text for p, o in zip(uniq, outs)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default=None,
                   help="a running server's /v1 URL (default: start `jmtp serve` on a free port)")
    p.add_argument("--num-requests", type=int, default=200)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--check-offline", action="store_true",
                   help="greedy outputs must equal offline LLM.generate")
    p.add_argument("--request-timeout", type=float, default=600.0, help="per request (s)")
    p.add_argument("--total-timeout", type=float, default=1800.0, help="whole load (s)")
    p.add_argument("--startup-timeout", type=float, default=300.0)
    # engine options of the started server (and of the offline check)
    p.add_argument("--model", default=None)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--num-speculative-tokens", type=int, default=3)
    p.add_argument("--no-spec", action="store_true")
    a = p.parse_args(argv)
    if a.num_requests < 1 or a.concurrency < 1:
        p.error("--num-requests and --concurrency must be >= 1")

    proc = None
    failures: list[str] = []
    try:
        if a.base_url:
            base = a.base_url.rstrip("/")
        else:
            proc, base = start_server(a)
        model = httpx.get(base + "/models", timeout=10).json()["data"][0]["id"]
        prompts = make_prompts(a.num_requests)
        before = read_metrics(base)
        t0 = time.perf_counter()
        results = asyncio.run(run_load(base, model, prompts, a))
        wall = time.perf_counter() - t0
        # The engine frees blocks in its step after the last output: wait until it is idle.
        deadline = time.monotonic() + 30
        after = read_metrics(base)
        while after.get("jmtp_num_requests_running", 0) and time.monotonic() < deadline:
            time.sleep(0.2)
            after = read_metrics(base)
    finally:
        if proc is not None:
            proc.kill()
            proc.wait(timeout=30)

    ok = [r for r in results if r and "error" not in r and r["finish"] is not None]
    errors = [r["error"] for r in results if r and "error" in r]
    lost = sum(r is None for r in results)
    if len(ok) != len(prompts):
        failures.append(f"{len(prompts) - len(ok)} of {len(prompts)} requests did not complete "
                        f"({len(errors)} errors, {lost} lost)" + (f"; first: {errors[0]}"
                                                                  if errors else ""))
    toks = sum(r["tokens"] or 0 for r in ok)
    lat = [r["latency"] for r in ok]
    ttft = [r["ttft"] for r in ok if r["ttft"] is not None]
    print(f"requests: {len(ok)}/{len(prompts)} completed, concurrency {a.concurrency}, "
          f"max_tokens {a.max_tokens}, {'no spec' if a.no_spec else f'MTP k={a.num_speculative_tokens}'}"
          f", max_num_seqs {a.max_num_seqs}")
    print(f"wall {wall:.1f} s: {len(ok) / wall:.2f} req/s, {toks / wall:.1f} generated tok/s "
          f"({toks} tokens)")
    print(f"latency  p50 {pct(lat, 50):.2f} s  p99 {pct(lat, 99):.2f} s")
    print(f"TTFT     p50 {pct(ttft, 50):.2f} s  p99 {pct(ttft, 99):.2f} s")
    print(f"server GC pauses during the load: {gc_pauses(before, after)}")
    fb, fa = before.get("jmtp_kv_blocks_free"), after.get("jmtp_kv_blocks_free")
    print(f"KV blocks free: before {fb:.0f}, after {fa:.0f} (of "
          f"{after.get('jmtp_kv_blocks_total', float('nan')):.0f})")
    if fb != fa:
        failures.append(f"free KV blocks {fa} after the load != {fb} before")
    spec_steps = after.get("jmtp_spec_decode_steps_total", 0) - before.get(
        "jmtp_spec_decode_steps_total", 0)
    if spec_steps:
        acc = (after.get("jmtp_spec_decode_step_tokens_total", 0)
               - before.get("jmtp_spec_decode_step_tokens_total", 0)) / spec_steps
        print(f"mean acceptance length {acc:.2f} tokens per verify step")

    if a.check_offline and ok:
        ref = offline_outputs(prompts, a)
        bad = [i for i, r in enumerate(results) if r and "error" not in r
               and r["text"] != ref[prompts[i]]]
        print(f"offline check: {len(ok) - len(bad)}/{len(ok)} outputs equal offline LLM.generate")
        if bad:
            i = bad[0]
            failures.append(f"{len(bad)} outputs differ from offline generate; first: prompt "
                            f"{prompts[i]!r}: server {results[i]['text']!r} vs offline "
                            f"{ref[prompts[i]]!r}")
    for f in failures:
        print("FAIL:", f)
    print("OK" if not failures else "FAILED")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
