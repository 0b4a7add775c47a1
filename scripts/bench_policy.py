#!/usr/bin/env python
"""Host time of the dynamic speculation policy per decode step (jmtp issue 11).

The policy (:class:`jmtp.runtime.spec_policy.DynamicSpeculation`) plans each step's draft limits
on the host, outside the jitted step, so its time adds to every step. This times
``draft_limits`` (the plan) and ``observe`` (the bookkeeping) over ``--slots`` active slots
after a warm-up of synthetic steps: per-slot acceptance drawn at random, step costs growing
with the rows, power-of-two token buckets. Printed: milliseconds per call, mean over
``--steps`` calls. No model and no device: the numbers are this host's Python and NumPy.

    python scripts/bench_policy.py --slots 8,64,256,1024 --k 3
"""
from __future__ import annotations

import argparse
import platform
import time

import numpy as np


def pow2_bucket(rows: int, n: int):
    """Power-of-two token and slot buckets (the engine's are of this kind)."""
    from jmtp.runtime.buckets import StepBucket

    return StepBucket(1 << max(rows - 1, 0).bit_length(), 1 << max(n - 1, 0).bit_length())


def main(argv=None) -> int:
    from jmtp.runtime.spec_policy import DynamicSpeculation

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--slots", default="8,64,256,1024")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=300)
    ap.add_argument("--steps", type=int, default=300)
    args = ap.parse_args(argv)
    print(f"# {platform.machine()} {platform.python_version()} numpy {np.__version__} | "
          f"K={args.k}, {args.steps} timed calls after {args.warmup} synthetic steps\n")
    print("| slots | draft_limits ms | observe ms | steps that drafted |\n|---|---|---|---|")
    rng = np.random.default_rng(0)
    for b in (int(x) for x in args.slots.split(",")):
        p = DynamicSpeculation(b, args.k, pow2_bucket)
        active = np.ones((b,), bool)
        accept = rng.uniform(0.1, 0.9, b)            # per-slot acceptance of one draft

        def step(lim):
            na = np.minimum(lim, rng.geometric(1 - accept) - 1)
            rows = b + int(lim.sum())
            sec = 0.01 * (1 + rows / b / 4) * (1 + 0.05 * rng.random())
            return na, pow2_bucket(rows, b), sec

        for _ in range(args.warmup):
            lim = p.draft_limits(active)
            na, bucket, sec = step(lim)
            p.observe(lim, na, bucket, sec, depth=int(lim.max()), num_tokens=na + 1)
        plan = obs = 0.0
        drafted = p.num_drafting_plans
        for _ in range(args.steps):
            t0 = time.perf_counter()
            lim = p.draft_limits(active)
            t1 = time.perf_counter()
            na, bucket, sec = step(lim)
            t2 = time.perf_counter()
            p.observe(lim, na, bucket, sec, depth=int(lim.max()), num_tokens=na + 1)
            plan, obs = plan + t1 - t0, obs + time.perf_counter() - t2
        print(f"| {b} | {plan / args.steps * 1e3:.3f} | {obs / args.steps * 1e3:.3f} | "
              f"{p.num_drafting_plans - drafted}/{args.steps} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
