"""Step time of this checkout against another commit, interleaved, in one run.

A refactor must not slow the engine. This script checks out ``--baseline`` (default ``HEAD~1``)
into a temporary git worktree and times the same greedy SmolLM2 generations in both checkouts,
alternating baseline / current ``--rounds`` times per configuration so machine noise hits both
alike. Each measurement is a fresh subprocess that imports jmtp from its checkout and uses only
the public API (``jmtp.LLM``), so any two commits with that API can be compared. It prints, per
configuration (batch size x speculation), the median warm ms/step and tok/s of each side, their
ratio (current / baseline step time: < 1 is faster), the compile time per step bucket (eager
compilation, persistent cache off) and whether the generated tokens are identical.

    python scripts/bench_commits.py --baseline HEAD~1 --batches 1,8 --ks 0,3 --rounds 3

``--configs`` runs named engine configurations instead of ``--ks`` (each greedy and, with
``--sampled``, also seeded sampling at temperature 0.8, one seed per prompt): ``plain``, ``mtp``
(K=3), ``ngram`` (K=3), ``hybrid`` (MTP K=3 extended with n-gram matches), ``dynamic`` (MTP K=3
with the dynamic policy), ``prefix`` (MTP K=3 with prefix caching; the timed run hits the cache
the warm-up filled), ``int8`` (MTP K=3 with an int8 KV cache):

    python scripts/bench_commits.py --baseline d7b947b --batches 4 --configs all --sampled --rounds 1
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

from bench_generate import QUESTIONS   # the same prompts as bench_generate.py

CONFIGS = ("plain", "mtp", "ngram", "hybrid", "dynamic", "prefix", "int8")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Runs inside the checkout under test (PYTHONPATH = that checkout). argv: batch k max_tokens
# num_prompts questions-json. Prints one JSON line.
CHILD = r"""
import json, sys, time
from jmtp import LLM, SamplingParams, SpeculativeConfig
batch, k, max_tokens, num_prompts = map(int, sys.argv[1:5])
questions = json.loads(sys.argv[5])
config, sampled = (sys.argv[6], sys.argv[7] == "1") if len(sys.argv) > 6 else (None, False)
spec = SpeculativeConfig("mtp", k) if k else None
extra = {}
if config is not None:
    spec = {"plain": None, "ngram": SpeculativeConfig("ngram", 3),
            "hybrid": SpeculativeConfig("mtp", 3, mtp_strategy="with_ngram"),
            "dynamic": SpeculativeConfig("mtp", 3, speculation_policy="dynamic")}.get(
        config, SpeculativeConfig("mtp", 3))
    extra = {"prefix": dict(enable_prefix_caching=True), "int8": dict(kv_cache_dtype="int8")}.get(
        config, {})
t0 = time.perf_counter()
llm = LLM(None, speculative_config=spec, max_num_seqs=batch, max_model_len=512,
          compile="eager", compilation_cache_dir="auto", **extra)
build_s = time.perf_counter() - t0
tok = llm.llm_engine.tokenizer
prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]))
           for q in (questions * 4)[:num_prompts]]
sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
if sampled:
    sp = [SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.8, seed=100 + i)
          for i in range(len(prompts))]
llm.generate(prompts, sp, use_tqdm=False)                    # warm-up
t0 = time.perf_counter()
outs = llm.generate(prompts, sp, use_tqdm=False)
dt = time.perf_counter() - t0
steps = llm.last_run_stats["steps"]
n = sum(len(o.token_ids) for o in outs)
comp = {k2: v for k2, v in llm.llm_engine.compile_seconds.items() if k2.startswith("T=")}
print("RESULT " + json.dumps(dict(ms_per_step=dt / steps * 1e3, tok_s=n / dt, steps=steps,
                                  build_s=build_s, compile_s=comp,
                                  tokens=[o.token_ids for o in outs])))
"""


def measure(checkout: str, batch: int, k: int, max_tokens: int, num_prompts: int,
            config: str | None = None, sampled: bool = False, cache_dir: str = "off") -> dict:
    env = dict(os.environ, PYTHONPATH=checkout, JMTP_CACHE_DIR=cache_dir,
               JMTP_WEIGHTS_CACHE_DIR="off")
    argv = [str(batch), str(k), str(max_tokens), str(num_prompts), json.dumps(QUESTIONS)]
    if config is not None:
        argv += [config, "1" if sampled else "0"]
    out = subprocess.run([sys.executable, "-c", CHILD, *argv], cwd=checkout, env=env,
                         capture_output=True, text=True)
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise RuntimeError(f"no result from {checkout} (rc={out.returncode}):\n{out.stderr[-3000:]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", default="HEAD~1", help="git revision to compare against")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--ks", default="0,3", help="num_speculative_tokens; 0 = no speculation")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--configs", default=None,
                    help=f"comma-separated of {','.join(CONFIGS)} or 'all' (instead of --ks)")
    ap.add_argument("--compilation-cache", default="off", metavar="DIR",
                    help="a persistent compilation cache folder shared by both sides (compile "
                         "times then measure cache loads; default off: real compiles)")
    ap.add_argument("--sampled", action="store_true",
                    help="with --configs: also seeded sampling (temperature 0.8)")
    args = ap.parse_args()
    if args.configs:
        names = CONFIGS if args.configs == "all" else args.configs.split(",")
        cases = [(c, smp) for c in names for smp in ((False, True) if args.sampled else (False,))]
    else:
        cases = [(int(k), False) for k in args.ks.split(",")]
    tmp = tempfile.mkdtemp(prefix="jmtp-baseline-")
    base = os.path.join(tmp, "checkout")
    subprocess.run(["git", "-C", REPO, "worktree", "add", "--detach", base, args.baseline],
                   check=True, capture_output=True)
    rev = subprocess.run(["git", "-C", base, "rev-parse", "--short", "HEAD"], check=True,
                         capture_output=True, text=True).stdout.strip()
    cur = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], check=True,
                         capture_output=True, text=True).stdout.strip()
    print(f"baseline {args.baseline} = {rev}; current = {cur} (+ uncommitted changes)", flush=True)
    try:
        for batch in map(int, args.batches.split(",")):
            for case, sampled in cases:
                config, k = (case, 3) if isinstance(case, str) else (None, case)
                runs = {"baseline": [], "current": []}
                for _ in range(args.rounds):
                    for side, path in (("baseline", base), ("current", REPO)):
                        runs[side].append(measure(path, batch, k, args.max_tokens, batch,
                                                  config, sampled, args.compilation_cache))
                b, c = runs["baseline"], runs["current"]
                med = lambda rs, key: statistics.median(r[key] for r in rs)
                same = all(x["tokens"] == y["tokens"] for x, y in zip(b, c))
                label = f"batch={batch} " + (
                    f"{config}{' sampled' if sampled else ''}" if config
                    else (f"MTP K={k}" if k else "plain"))
                print(f"{label:24s} baseline {med(b, 'ms_per_step'):6.1f} ms/step "
                      f"{med(b, 'tok_s'):6.1f} tok/s | current {med(c, 'ms_per_step'):6.1f} ms/step "
                      f"{med(c, 'tok_s'):6.1f} tok/s | step-time ratio "
                      f"{med(c, 'ms_per_step') / med(b, 'ms_per_step'):.3f} | same tokens: {same}",
                      flush=True)
                for side, rs in (("baseline", b), ("current", c)):
                    comp = {key: statistics.median(r["compile_s"][key] for r in rs)
                            for key in rs[0]["compile_s"]}
                    print(f"    compile per bucket, {side}: " + ", ".join(
                        f"{key} {v:.1f}s" for key, v in comp.items()), flush=True)
    finally:
        subprocess.run(["git", "-C", REPO, "worktree", "remove", "--force", base],
                       capture_output=True)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
