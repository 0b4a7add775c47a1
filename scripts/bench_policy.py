#!/usr/bin/env python
"""Host time of the dynamic speculation policy per decode step (jmtp issue 11).

The policy (:class:`jmtp.runtime.host.spec_policy.DynamicSpeculation`) plans each step's draft limits
on the host, outside the jitted step, so its time adds to every step. This times
``draft_limits`` (the plan) and ``observe`` (the bookkeeping) on synthetic steps: per-slot
acceptance drawn at random, step costs growing with the rows, and the engine's own step buckets
(``choose_bucket`` of an ``EngineConfig`` with ``max_num_seqs`` = the slots and a token budget
of ``slots * (K + 1)``). ``--proposer mtp`` proposes every allowed draft; ``--proposer ngram``
proposes a slot's allowed drafts all or none, all with a per-slot probability drawn at random
(a prompt-lookup match), so presence (counted by default) falls below 1 and the plan also
tries its second ranking (gain per expected row). Columns:

* ``plan ms``: mean over ``--steps`` calls with every slot active, after ``--warmup`` steps;
* ``plan ms, n varies``: the same with the number of active slots drawn at random each step
  (after a warm-up that saw every n, as a long-running server has);
* ``first plan at an n``: the mean of the first call at each number of active slots (it asks
  the bucket function for every row count of that n once; later calls reuse the table).

No model and no device: the numbers are this host's Python and NumPy.

    python scripts/bench_policy.py --slots 8,64,256,1024 --k 3 [--proposer ngram]
"""
from __future__ import annotations

import argparse
import platform
import time

import numpy as np


def main(argv=None) -> int:
    from jmtp.runtime.device.buckets import choose_bucket
    from jmtp.runtime.config import EngineConfig, SpeculativeConfig
    from jmtp.runtime.host.spec_policy import DynamicSpeculation

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--slots", default="8,64,256,1024")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=300)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--proposer", default="mtp", choices=["mtp", "ngram"])
    args = ap.parse_args(argv)
    print(f"# {platform.machine()} Python {platform.python_version()} NumPy {np.__version__} | "
          f"K={args.k}, proposer {args.proposer}, {args.steps} timed calls per column\n")
    print("| slots | plan ms | plan ms, n varies | first plan at an n | observe ms |\n"
          "|---|---|---|---|---|")
    rng = np.random.default_rng(0)
    for b in (int(x) for x in args.slots.split(",")):
        ec = EngineConfig(max_num_seqs=b, max_model_len=256, block_size=16,
                          num_blocks=b * 16 + 1, max_num_batched_tokens=b * (args.k + 1),
                          spec=SpeculativeConfig("mtp", args.k))

        def bucket_of(rows, n, ec=ec):
            return choose_bucket(ec, rows, n, has_prefill=False)

        p = DynamicSpeculation(b, args.k, bucket_of)
        accept = rng.uniform(0.1, 0.9, b)            # per-slot acceptance of one draft
        match = rng.uniform(0.1, 0.9, b)             # per-slot chance of proposing (ngram)

        def step(active, timed):
            t0 = time.perf_counter()
            lim = p.draft_limits(active)
            t1 = time.perf_counter()
            nd = lim if args.proposer == "mtp" else np.where(rng.random(b) < match, lim, 0)
            na = np.minimum(nd, rng.geometric(1 - accept) - 1)
            n = int(active.sum())
            rows = n + int(nd.sum())
            sec = 0.01 * (1 + rows / b / 4) * (1 + 0.05 * rng.random())
            t2 = time.perf_counter()
            p.observe(nd, na, bucket_of(rows, n), sec, depth=int(lim.max()),
                      num_tokens=np.where(active, na + 1, 0), num_allowed=lim)
            t3 = time.perf_counter()
            return t1 - t0, t3 - t2

        def active_of(n):
            mask = np.zeros((b,), bool)
            mask[rng.choice(b, n, replace=False)] = True
            return mask

        first = [step(active_of(n), True)[0] for n in range(1, b + 1)]   # every n once
        full = np.ones((b,), bool)
        for _ in range(args.warmup):
            step(full, False)
        plan, obs = np.array([step(full, True) for _ in range(args.steps)]).mean(0)
        varied = np.mean([step(active_of(int(rng.integers(1, b + 1))), True)[0]
                          for _ in range(args.steps)])
        print(f"| {b} | {plan * 1e3:.3f} | {varied * 1e3:.3f} | {np.mean(first) * 1e3:.3f} | "
              f"{obs * 1e3:.3f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
