"""Is the engine step's program the same as at another commit? Compares lowered StableHLO.

A refactor of host code or module layout must not change what runs on the device. This script
checks out ``--baseline`` (default ``HEAD~1``) into a temporary git worktree and, in a fresh
subprocess per checkout, builds SmolLM2 engines (lazy: nothing compiles), lowers the jitted step
for the smallest, a middle and the largest step bucket of each configuration and hashes the
StableHLO text (no source locations; the outputs' ``jax.result_info`` names, which follow the
outputs' pytree paths, are compared apart). Equal hashes mean the same program: the same tokens and
the same step time by construction, without timing noise. It prints one line per bucket and
exits 1 on any difference.

    python scripts/compare_step_hlo.py --baseline d7b947b
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = [(0, 1, "unrolled"), (3, 1, "unrolled"), (3, 1, "scan"), (0, 8, "unrolled"),
           (3, 8, "unrolled")]    # (num_speculative_tokens, max_num_seqs, layer_loop)

CHILD = r"""
import hashlib, json, re, sys
import numpy as np, jax.numpy as jnp
from jmtp import LLM, SpeculativeConfig
try:                                    # module layout of issue 46 (runtime/device/)
    from jmtp.runtime.device.buckets import step_buckets
except ImportError:                     # older checkouts
    from jmtp.runtime.buckets import step_buckets      # rewrite-imports: keep
out = {}
for k, B, loop in json.loads(sys.argv[1]):
    llm = LLM(None, speculative_config=SpeculativeConfig("mtp", k) if k else None,
              max_num_seqs=B, max_model_len=512, compile="lazy", compilation_cache_dir=None,
              layer_loop=loop)
    e = llm.llm_engine
    # older checkouts held the step on the engine (private names), newer ones on its runner
    run = getattr(e, "runner", None)
    sec = run.shard_config if run is not None else e._shard_ec
    step = run.jitted_step if run is not None else e._step
    bks = step_buckets(sec)
    zeros = jnp.asarray(np.zeros((sec.max_num_seqs,), np.int32))
    for bk in (bks[0], bks[len(bks) // 2], bks[-1]):
        if run is not None and hasattr(run, "step_args"):      # the one argument builder
            args = run.step_args(bk)
        else:
            args = (e.graphdef, sec, e.speculative_config.drafter, bk, e.attention_backend,
                    e.params, e.state, e.cache, e.mtp_cache, zeros, zeros)
            if run is not None and hasattr(run, "neutral_guide"):   # structured-output inputs
                args += run.neutral_guide()
        text = step.lower(*args).as_text()
        # jax.result_info labels each output with its pytree path ("[1].target.k" where the
        # 13-argument step returned "[1].k"): a name, not the program; hashed apart
        bare = re.sub(r'jax\.result_info = "[^"]*"', "jax.result_info", text)
        h = lambda t: hashlib.sha256(t.encode()).hexdigest()[:16]
        out[f"K={k} B={B} {loop} T={bk.num_tokens} A={bk.num_slots}"] = [h(bare), h(text)]
print(json.dumps(out))
"""


def hashes(checkout: str) -> dict:
    env = dict(os.environ, PYTHONPATH=checkout, JMTP_WEIGHTS_CACHE_DIR=os.environ.get(
        "JMTP_WEIGHTS_CACHE_DIR", "off"))
    r = subprocess.run([sys.executable, "-c", CHILD, json.dumps(CONFIGS)], cwd=checkout, env=env,
                       capture_output=True, text=True, check=True)
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--baseline", default="HEAD~1", help="git revision to compare against")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        base = os.path.join(tmp, "baseline")
        subprocess.run(["git", "-C", REPO, "worktree", "add", "--detach", base, args.baseline],
                       check=True, capture_output=True)
        try:
            old = hashes(base)
        finally:
            subprocess.run(["git", "-C", REPO, "worktree", "remove", "--force", base],
                           capture_output=True)
    new = hashes(REPO)
    same = named = 0
    for key in old:
        o, n = old[key], new.get(key, [None, None])
        ok = o[0] == n[0]
        same += ok
        named += o[1] == n[1]
        print(f"{'same' if ok else 'DIFFERENT'}  {key}  {o[0]}  {n[0]}"
              f"{'' if o[1] == n[1] else '  (output names differ)'}")
    print(f"{same}/{len(old)} step programs identical to {args.baseline} "
          f"({named}/{len(old)} with the outputs' jax.result_info names too)")
    return 0 if same == len(old) else 1


if __name__ == "__main__":
    sys.exit(main())
