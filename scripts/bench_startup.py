#!/usr/bin/env python
"""Time to a first answer, from a shell, for one prompt on one machine (jmtp issue 36).

Every row is one fresh process that imports its framework, loads SmolLM2-135M-Instruct from the
same GGUF, applies the chat template, decodes ``--max-tokens`` tokens greedily and exits; "wall s"
is measured from outside (``time.perf_counter`` around ``subprocess.run``), so it includes the
interpreter's start and exit. Rows:

* ``jmtp cold``: ``jmtp generate --chat ... --stats-json FILE`` with empty caches: fresh folders in
  ``JMTP_CACHE_DIR`` (XLA compilation cache) and ``JMTP_WEIGHTS_CACHE_DIR`` (converted weights), so
  it converts the GGUF and compiles everything; the first run after an install or upgrade.
* ``jmtp warm``: the same command again with the same, now filled, caches: every later run.
* ``HF one-shot``: transformers (fp32, the GGUF dequantized by its ``gguf_file=`` loader, torch's
  default threads), timed inside as import / load / generate.
* ``llama.cpp one-shot``: llama-cpp-python on the GGUF's own Q4_1 weights (when installed).

The split of jmtp's rows comes from its ``--stats-json`` (import, load, compile or cache load,
generate, TTFT, decode tok/s; its import counts from the process's start), the peers' split is
timed inside their script; "other" is the rest of the outside wall (interpreter start, exit).
"Cold" means empty jmtp caches, not a cold OS page cache: the GGUF is read once before timing.
With ``--rounds R`` every row runs R times (the cold row with fresh caches each round) and the run
with the median wall is reported. Then the issue's targets, all from this one run:
jmtp cold / HF <= 1.5, jmtp warm / HF <= 0.3, cold <= 30 s, warm <= 6 s.

    python scripts/bench_startup.py                       # ~1-2 min on 2 CPU cores
    python scripts/bench_startup.py --rounds 3 --json runs/startup.json --plot docs/startup.png
    python scripts/bench_startup.py --extra-args "--layer-loop unrolled" --skip hf,llamacpp
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MARK = "@@startup "   # the children's result line: MARK + JSON
PARTS = ("import_s", "load_s", "compile_s", "generate_s", "other_s")

HF_CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import torch, transformers
t1 = time.perf_counter()
d, name, prompt, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
transformers.logging.set_verbosity_error()
tok = transformers.AutoTokenizer.from_pretrained(d, gguf_file=name)
model = transformers.AutoModelForCausalLM.from_pretrained(d, gguf_file=name,
                                                          dtype=torch.float32).eval()
t2 = time.perf_counter()
text = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                               add_generation_prompt=True)
enc = tok(text, return_tensors="pt", add_special_tokens=False)
with torch.inference_mode():
    out = model.generate(**enc, do_sample=False, max_new_tokens=n,
                         pad_token_id=model.generation_config.eos_token_id)
new = out[0, enc["input_ids"].shape[1]:]
answer = tok.decode(new, skip_special_tokens=True)
t3 = time.perf_counter()
print(%r + json.dumps({"import_s": t1 - t0, "load_s": t2 - t1, "generate_s": t3 - t2,
                       "tokens": int(new.shape[0]), "text": answer}), flush=True)
""" % MARK

LLAMACPP_CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import llama_cpp
t1 = time.perf_counter()
path, prompt, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
llm = llama_cpp.Llama(model_path=path, verbose=False)
t2 = time.perf_counter()
r = llm.create_chat_completion(messages=[{"role": "user", "content": prompt}], max_tokens=n,
                               temperature=0.0, top_k=1)
t3 = time.perf_counter()
print(%r + json.dumps({"import_s": t1 - t0, "load_s": t2 - t1, "generate_s": t3 - t2,
                       "tokens": r["usage"]["completion_tokens"],
                       "text": r["choices"][0]["message"]["content"]}), flush=True)
""" % MARK


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompt", default="What is the capital of France?")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=1, help="runs per row; the median is reported")
    ap.add_argument("--skip", default="", help="comma list of hf, llamacpp, jmtp")
    ap.add_argument("--plot", default="docs/startup.png", help="bar chart ('' for none)")
    ap.add_argument("--json", default=None, help="write every run's results here")
    ap.add_argument("--extra-args", default="", help="appended to the jmtp command (shlex split)")
    args = ap.parse_args(argv)
    args.skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    if args.skip - {"hf", "llamacpp", "jmtp"}:
        ap.error(f"--skip: unknown {sorted(args.skip - {'hf', 'llamacpp', 'jmtp'})}")
    if args.rounds < 1 or args.max_tokens < 1:
        ap.error("--rounds and --max-tokens must be >= 1")
    return args


def timed(cmd: list[str], env=None) -> tuple[float, subprocess.CompletedProcess]:
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    return time.perf_counter() - t0, p


def failed(p: subprocess.CompletedProcess) -> dict:
    tail = (p.stderr or p.stdout or "").strip().splitlines()[-3:]
    return {"error": f"exit {p.returncode}: " + " | ".join(tail)}


def run_child(code: str, argv: list[str]) -> dict:
    wall, p = timed([sys.executable, "-c", code, *argv])
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith(MARK)]
    if p.returncode or not lines:
        return {"wall_s": wall, **failed(p)}
    return {"wall_s": wall, **json.loads(lines[-1][len(MARK):])}


def run_jmtp(args, jmtp: str, xla_dir: str, weights_dir: str) -> dict:
    fd, stats = tempfile.mkstemp(suffix=".json", prefix="jmtp-stats-")
    os.close(fd)
    env = dict(os.environ, JMTP_CACHE_DIR=xla_dir, JMTP_WEIGHTS_CACHE_DIR=weights_dir)
    cmd = [jmtp, "generate", "--chat", "--prompt", args.prompt, "--max-tokens",
           str(args.max_tokens), "--stats-json", stats, *shlex.split(args.extra_args)]
    try:
        wall, p = timed(cmd, env)
        if p.returncode:
            return {"wall_s": wall, **failed(p)}
        with open(stats, encoding="utf-8") as f:
            return {"wall_s": wall, **json.load(f)}
    finally:
        os.unlink(stats)


def median_run(runs: list[dict]) -> dict:
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return runs[-1]
    ok.sort(key=lambda r: r["wall_s"])
    med = dict(ok[(len(ok) - 1) // 2])
    med["other_s"] = med["wall_s"] - sum(med.get(k) or 0.0 for k in PARTS[:-1])
    med["all_walls_s"] = [r["wall_s"] for r in runs if "error" not in r]
    return med


def fmt(x, spec=".2f"):
    return "" if x is None else format(x, spec)


def table(rows: dict[str, dict]) -> str:
    out = ["| system | wall s | import s | load s | compile s | generate s | other s | TTFT s | "
           "decode tok/s | tokens |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        if "skipped" in r or "error" in r:
            out.append(f"| {name} | {r.get('skipped') or r['error']} | | | | | | | | |")
            continue
        tps = r.get("decode_tok_s")
        out.append(f"| {name} | {r['wall_s']:.2f} | " + " | ".join(
            fmt(r.get(k)) for k in PARTS) + f" | {fmt(r.get('ttft_s'))} | {fmt(tps, '.1f')} | "
            f"{r.get('tokens', '')} |")
    return "\n".join(out)


def plot(rows: dict[str, dict], path: str, title: str) -> None:
    try:
        import matplotlib
    except ImportError:
        print("# plot: skipped (matplotlib not installed; pip install -e '.[peers]')")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = {n: r for n, r in rows.items() if "wall_s" in r and "error" not in r}
    if not done:
        return
    colours = dict(zip(PARTS, ("#9467bd", "#ff7f0e", "#d62728", "#2ca02c", "#c7c7c7")))
    fig, ax = plt.subplots(figsize=(9.5, 0.6 * len(done) + 1.6))
    ys = list(range(len(done)))[::-1]
    for y, (name, r) in zip(ys, done.items()):
        left = 0.0
        for k in PARTS:
            v = r.get(k) or 0.0
            if v > 0:
                ax.barh(y, v, left=left, color=colours[k], label=k[:-2])
                left += v
        ax.text(r["wall_s"], y, f" {r['wall_s']:.1f}s", va="center", fontsize=9)
    uniq = dict(zip(*ax.get_legend_handles_labels()[::-1]))
    names = {"compile": "compile / cache load"}
    keys = [k[:-2] for k in PARTS if k[:-2] in uniq]
    ax.legend([uniq[k] for k in keys], [names.get(k, k) for k in keys], fontsize=8,
              loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_yticks(ys, list(done))
    ax.set_xlabel("seconds from process start to exit")
    ax.set_xlim(0, max(r["wall_s"] for r in done.values()) * 1.15)
    ax.grid(axis="x", alpha=0.3)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"# plot: {path}")


def main(argv=None) -> int:
    args = parse_args(argv)
    from jmtp.model.checkpoints.loader import smollm2_path

    gguf = smollm2_path()
    Path(gguf).read_bytes()               # the same warm page cache for every row
    jmtp = str(Path(sys.executable).with_name("jmtp"))
    if not os.path.exists(jmtp):
        jmtp = shutil.which("jmtp") or "jmtp"
    head = (f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs | "
            f"{gguf.name} | greedy, {args.max_tokens} tokens | {args.rounds} round(s) | "
            f"load average at start {os.getloadavg()[0]:.1f}")
    print("# " + head, flush=True)
    runs: dict[str, list[dict]] = {}
    skipped: dict[str, dict] = {}
    if "hf" in args.skip:
        skipped["HF one-shot"] = {"skipped": "skipped (--skip)"}
    elif importlib.util.find_spec("torch") is None or importlib.util.find_spec("transformers") is None:
        skipped["HF one-shot"] = {"skipped": "not installed (pip install -e '.[test]')"}
    if "llamacpp" in args.skip:
        skipped["llama.cpp one-shot"] = {"skipped": "skipped (--skip)"}
    elif importlib.util.find_spec("llama_cpp") is None:
        skipped["llama.cpp one-shot"] = {"skipped": "not installed (pip install llama-cpp-python)"}
    if "jmtp" in args.skip:
        skipped["jmtp cold"] = skipped["jmtp warm"] = {"skipped": "skipped (--skip)"}

    def record(name, result):
        runs.setdefault(name, []).append(result)
        r = result
        print(f"# round {rnd}: {name}: " + (r["error"] if "error" in r else f"{r['wall_s']:.2f}s"),
              flush=True)

    for rnd in range(args.rounds):
        if "HF one-shot" not in skipped:
            record("HF one-shot", run_child(HF_CHILD, [str(gguf.parent), gguf.name, args.prompt,
                                                       str(args.max_tokens)]))
        if "llama.cpp one-shot" not in skipped:
            record("llama.cpp one-shot", run_child(LLAMACPP_CHILD, [str(gguf), args.prompt,
                                                                    str(args.max_tokens)]))
        if "jmtp" not in args.skip:
            with tempfile.TemporaryDirectory(prefix="jmtp-startup-") as tmp:
                xla, weights = os.path.join(tmp, "xla"), os.path.join(tmp, "weights")
                os.makedirs(xla)
                os.makedirs(weights)
                record("jmtp cold", run_jmtp(args, jmtp, xla, weights))
                record("jmtp warm", run_jmtp(args, jmtp, xla, weights))

    order = ["HF one-shot", "llama.cpp one-shot", "jmtp cold", "jmtp warm"]
    rows = {n: skipped[n] if n in skipped else median_run(runs[n]) for n in order
            if n in skipped or n in runs}
    print("\n" + table(rows) + "\n")
    for name, r in rows.items():
        if "text" in r:
            mode = f" [{r['compile_mode']}, {r['layer_loop']}]" if "layer_loop" in r else ""
            print(f"{name}{mode}: {' '.join(r['text'].split())[:80]!r}")
    print()

    def wall(n):
        r = rows.get(n, {})
        return r.get("wall_s") if "error" not in r else None

    checks = [("jmtp cold / HF one-shot", wall("jmtp cold"), wall("HF one-shot"), 1.5, "x"),
              ("jmtp warm / HF one-shot", wall("jmtp warm"), wall("HF one-shot"), 0.3, "x"),
              ("jmtp cold total", wall("jmtp cold"), 1.0, 30.0, " s"),
              ("jmtp warm total", wall("jmtp warm"), 1.0, 6.0, " s")]
    for label, a, b, target, unit in checks:
        if a is None or b is None:
            print(f"{label}: n/a")
            continue
        v = a / b
        print(f"{label}: {v:.2f}{unit} (target <= {target:g}{unit}) "
              f"{'PASS' if v <= target else 'MISS'}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"header": head, "args": {
            k: sorted(v) if isinstance(v, set) else v for k, v in vars(args).items()},
            "rows": rows, "runs": runs}, indent=2), encoding="utf-8")
    if args.plot:
        plot(rows, args.plot, head)
    return 1 if any("error" in r for r in rows.values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
