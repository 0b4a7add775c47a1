"""20 JSON schemas through the official ``openai`` client against ``jmtp serve``.

For each engine (speculation on: SmolLM2 with its MTP head, K=3; off: ``--no-spec``) the script
starts ``jmtp serve`` on 127.0.0.1, sends every schema of ``scripts/data/structured_schemas.json``
(nested objects, arrays with ``minItems``, enums, number ranges (non-integers with a binary
fraction ``multipleOf``, which bounds their digits: a sampled number can otherwise run to
``max_tokens``), required and optional fields,
strings with ``pattern``) on several prompts as ``response_format={"type": "json_schema", ...}``,
greedy and sampled (temperature 0.8, a seed per request), and checks that every output parses and
validates with ``jsonschema``; then that each greedy output is the same with speculation on and
off. It prints one line per engine and mode and writes the outputs as JSON.

    python scripts/structured_schemas.py [--prompts 3] [--modes greedy,sampled] [--out F]

Exit status 1 when any output fails to parse or validate, or greedy outputs differ.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import contextlib
import json
import os
import pathlib
import socket
import subprocess
import sys
import time
import zlib

import jsonschema

SCHEMAS = pathlib.Path(__file__).with_name("data") / "structured_schemas.json"
VARIANTS = ["", " Keep it short.", " Use realistic values."]


def load_schemas() -> list[dict]:
    return json.loads(SCHEMAS.read_text())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve(extra: list[str], timeout: float = 900.0):
    """``jmtp serve`` on a free 127.0.0.1 port; yields the base URL; stopped on exit."""
    port = free_port()
    cmd = [sys.executable, "-m", "jmtp.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--max-num-seqs", "8", "--max-model-len", "1024", "--log-level", "warning", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ))
    url = f"http://127.0.0.1:{port}"
    try:
        import httpx
        t0 = time.monotonic()
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"jmtp serve exited: {proc.stderr.read()[-2000:]}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() - t0 > timeout:
                raise TimeoutError("jmtp serve did not start")
            time.sleep(1)
        yield url + "/v1"
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def run_requests(base_url: str, schemas: list[dict], prompts: int, mode: str,
                 max_tokens: int = 256) -> list[dict]:
    """Every (schema, prompt) once in ``mode`` (greedy | sampled), 8 at a time; returns records
    with the text, finish reason and validation result."""
    from openai import OpenAI
    client = OpenAI(base_url=base_url, api_key="none", timeout=600)
    jobs = [(s, v) for s in schemas for v in VARIANTS[:prompts]]
    model = client.models.list().data[0].id

    def one(job):
        schema, variant = job
        extra = dict(temperature=0.0) if mode == "greedy" else dict(
            temperature=0.8, seed=zlib.crc32((schema["name"] + variant).encode()))
        r = client.chat.completions.create(
            model=model, max_tokens=max_tokens,
            messages=[{"role": "user", "content": schema["prompt"] + variant}],
            response_format={"type": "json_schema", "json_schema": {
                "name": schema["name"], "schema": schema["schema"], "strict": True}}, **extra)
        text = r.choices[0].message.content or ""
        rec = dict(schema=schema["name"], variant=variant, mode=mode, text=text,
                   finish_reason=r.choices[0].finish_reason, tokens=r.usage.completion_tokens)
        try:
            jsonschema.validate(json.loads(text), schema["schema"])
            rec["valid"] = True
        except (json.JSONDecodeError, jsonschema.ValidationError) as e:
            rec["valid"], rec["error"] = False, str(e)[:200]
        return rec

    with cf.ThreadPoolExecutor(8) as pool:
        return list(pool.map(one, jobs))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=3, help="prompt variants per schema (1-3)")
    ap.add_argument("--modes", default="greedy,sampled")
    ap.add_argument("--schemas", type=int, default=20, help="use the first N schemas")
    ap.add_argument("--out", default=None, help="write every output as JSON here")
    args = ap.parse_args(argv)
    schemas = load_schemas()[:args.schemas]
    modes = args.modes.split(",")
    engines = {"spec": ["--num-speculative-tokens", "3"], "no-spec": ["--no-spec"]}
    results, ok = {}, True
    for name, extra in engines.items():
        t0 = time.perf_counter()
        with serve(extra) as url:
            started = time.perf_counter() - t0
            for mode in modes:
                t1 = time.perf_counter()
                recs = run_requests(url, schemas, args.prompts, mode)
                secs = time.perf_counter() - t1
                results[(name, mode)] = recs
                valid = sum(r["valid"] for r in recs)
                toks = sum(r["tokens"] for r in recs)
                ok &= valid == len(recs)
                print(f"{name:8s} {mode:8s} valid {valid}/{len(recs)}  finish "
                      f"{sorted({r['finish_reason'] for r in recs})}  {toks} tokens in "
                      f"{secs:.1f} s ({toks / secs:.1f} tok/s; server start {started:.0f} s)",
                      flush=True)
                for r in recs:
                    if not r["valid"]:
                        print(f"   INVALID {r['schema']}{r['variant']!r}: {r.get('error')} "
                              f"text={r['text'][:120]!r}")
    if "greedy" in modes:
        a, b = results[("spec", "greedy")], results[("no-spec", "greedy")]
        same = sum(x["text"] == y["text"] for x, y in zip(a, b))
        ok &= same == len(a)
        print(f"greedy identical with speculation on and off: {same}/{len(a)}")
        for x, y in zip(a, b):
            if x["text"] != y["text"]:
                print(f"   DIFF {x['schema']}{x['variant']!r}:\n     {x['text']!r}\n     "
                      f"{y['text']!r}")
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(
            {f"{k[0]}/{k[1]}": v for k, v in results.items()}, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
