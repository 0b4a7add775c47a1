#!/usr/bin/env python
"""Decode-forward throughput of a checkpoint (default: SmolLM2-135M-Instruct) with jmtp's paged
forward: batch B sequences, each adding q new tokens after ``--context`` cached ones (q = 1 is
plain decode, q = 4 a speculative verify window [last token, d1..d3]).

Reports per configuration: milliseconds per forward (target forward + LM head over all B*q rows),
tokens/s (B*q per forward) and effective weight bandwidth = bytes of target weights read per
forward / time (every layer weight, the final norm and the LM head — the tied embedding table
counted once; the embedding gather of B*q rows and the KV cache are not counted).

Usage:
  python scripts/bench_forward.py [--model PATH] [--dtypes float32,bfloat16] [--batches 1,8]
                                  [--q-lens 1,4] [--context 128] [--iters 20] [--json OUT]
"""
from __future__ import annotations

import argparse
import functools
import json
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np

from jmtp.model import compute_logits, forward, init_kv_cache, load_checkpoint, ragged_batch

BLOCK_SIZE = 16


def weight_bytes(params: dict) -> int:
    """Bytes of target weights one forward reads (MTP head excluded)."""
    return sum(leaf.nbytes for key, sub in params.items() if key != "mtp"
               for leaf in jax.tree_util.tree_leaves(sub))


@functools.partial(jax.jit, static_argnums=(0, 5), donate_argnums=(4,))
def _decode(cfg, params, ids, context_lens, cache, q_len):
    """One ragged batch: every sequence appends ``q_len`` tokens after ``context_lens[s]``."""
    b = context_lens.shape[0]
    pages = cache.k.shape[1] // b
    tables = jnp.arange(b * pages, dtype=jnp.int32).reshape(b, pages)
    positions, meta = ragged_batch(jnp.full((b,), q_len, jnp.int32), context_lens, tables,
                                   BLOCK_SIZE, ids.shape[0])
    h, cache = forward(cfg, params, ids, positions, meta, cache)
    return compute_logits(params, h), cache


def bench_one(cfg, params, batch: int, q_len: int, context: int, iters: int) -> dict:
    pages = -(-(context + q_len) // BLOCK_SIZE)
    dtype = params["embed"].dtype
    cache = init_kv_cache(cfg, cfg.num_layers, batch * pages, BLOCK_SIZE, dtype)
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(0, cfg.vocab_size, size=batch * q_len), jnp.int32)
    ctx = jnp.full((batch,), context, jnp.int32)
    t0 = time.perf_counter()
    logits, cache = _decode(cfg, params, ids, ctx, cache, q_len)
    logits.block_until_ready()
    compile_s = time.perf_counter() - t0
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        logits, cache = _decode(cfg, params, ids, ctx, cache, q_len)
        logits.block_until_ready()
        times.append(time.perf_counter() - t0)
    t = float(np.median(times))
    wb = weight_bytes(params)
    return {"dtype": str(dtype), "batch": batch, "q_len": q_len, "context": context,
            "ms_per_forward": 1e3 * t, "tokens_per_s": batch * q_len / t,
            "weight_bytes": wb, "effective_GBps": wb / t / 1e9, "first_call_s": compile_s}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint (default: SmolLM2-135M-Instruct Q4_1)")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--q-lens", default="1,4")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--json", default=None, help="also write the rows to this JSON file")
    args = ap.parse_args(argv)
    if args.context < 0 or args.iters < 1:
        raise ValueError("--context must be >= 0 and --iters >= 1")

    rows = []
    print(f"backend={jax.default_backend()} devices={jax.devices()} cpu={platform.processor() or '?'}")
    print(f"{'dtype':>9} {'B':>3} {'q':>3} {'ms/fwd':>9} {'tok/s':>9} {'GB/s':>7} {'1st(s)':>7}")
    for dt in args.dtypes.split(","):
        cfg, params = load_checkpoint(args.model, dtype=dt)
        for b in (int(x) for x in args.batches.split(",")):
            for q in (int(x) for x in args.q_lens.split(",")):
                r = bench_one(cfg, params, b, q, args.context, args.iters)
                rows.append(r)
                print(f"{r['dtype']:>9} {b:>3} {q:>3} {r['ms_per_forward']:>9.2f} "
                      f"{r['tokens_per_s']:>9.1f} {r['effective_GBps']:>7.2f} "
                      f"{r['first_call_s']:>7.1f}", flush=True)
        print(f"  weights read per forward ({dt}): {rows[-1]['weight_bytes'] / 1e6:.1f} MB")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
