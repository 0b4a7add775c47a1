#!/usr/bin/env python
"""Host cost per committed token of suffix decoding's trees (``jmtp.runtime.host.suffix_decoding``).

For each of ``--requests`` requests: a random prompt, then ``--tokens`` output tokens, each one
drafted for (:meth:`SuffixCache.speculate` over the local and the global tree) and then appended
(:meth:`SuffixCache.extend`), as the engine does per slot and step. Two texts: ``novel`` (random
tokens: nothing repeats) and ``repeated`` (every request re-emits one text with a change every
``--change-every`` tokens). Prints microseconds per token for drafting and appending, and the
global tree's nodes. Pure Python (no JAX); timings are the host's.

    python scripts/bench_suffix_tree.py --requests 8 --tokens 500
"""
from __future__ import annotations

import argparse
import random
import time

from jmtp.runtime.host.suffix_decoding import SuffixCache


def run(kind: str, a) -> dict:
    rng = random.Random(0)
    base = [rng.randrange(a.vocab) for _ in range(a.tokens)]
    cache = SuffixCache(a.depth, 64, 10 ** 6)
    t_spec = t_ext = 0.0
    n = 0
    for r in range(a.requests):
        ctx = [rng.randrange(a.vocab) for _ in range(a.prompt)]
        cache.start(r, ctx)
        out = ([rng.randrange(a.vocab) for _ in range(a.tokens)] if kind == "novel" else
               [t if i % a.change_every else rng.randrange(a.vocab) for i, t in enumerate(base)])
        for t in out:
            t0 = time.perf_counter()
            cache.speculate(r, ctx[-(a.depth - 1):], a.k, 1.0, 0.1)
            t1 = time.perf_counter()
            cache.extend(r, [t])
            ctx.append(t)
            t_spec += t1 - t0
            t_ext += time.perf_counter() - t1
            n += 1
        cache.stop(r)
    return dict(text=kind, tokens=n, speculate_us=1e6 * t_spec / n, extend_us=1e6 * t_ext / n,
                nodes=cache.global_tree.num_nodes)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=300)
    ap.add_argument("--tokens", type=int, default=500)
    ap.add_argument("--change-every", type=int, default=50)
    ap.add_argument("--depth", type=int, default=24, help="suffix_decoding_max_tree_depth")
    ap.add_argument("--k", type=int, default=7, help="drafts per window")
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args(argv)
    print("| text | tokens | draft µs/token | append µs/token | total µs/token | global nodes |")
    print("|---|---|---|---|---|---|")
    for _ in range(a.rounds):
        for kind in ("novel", "repeated"):
            r = run(kind, a)
            print(f"| {r['text']} | {r['tokens']} | {r['speculate_us']:.1f} | {r['extend_us']:.1f} "
                  f"| {r['speculate_us'] + r['extend_us']:.1f} | {r['nodes']} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
