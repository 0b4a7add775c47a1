#!/usr/bin/env python
"""Routed-experts cost: ``ragged`` (sort by expert + ``jax.lax.ragged_dot``) vs ``dense`` (every
expert on every token) for one MoE FFN (:func:`jmtp.model.moe.moe_ffn`), per token count T.

The dense reference does E/k times the expert FLOPs of the ragged path; the ratio printed is
``dense ms / ragged ms`` (above 1: ragged is faster). Times are medians of ``--iters``
interleaved runs after one compile each, so a shared machine still gives usable ratios (absolute
milliseconds are only indicative there). Also checks that the two outputs agree.

    python scripts/bench_moe.py                          # H=512, E=64, k=8, I_e=256
    python scripts/bench_moe.py --experts 8 --top-k 2 --tokens 1,16,256
"""
from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from jmtp.model.config import MoEConfig
from jmtp.model.moe import moe_ffn


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--expert-size", type=int, default=256)
    ap.add_argument("--tokens", default="1,8,64,256")
    ap.add_argument("--iters", type=int, default=10)
    a = ap.parse_args(argv)
    for name in ("hidden", "experts", "top_k", "expert_size", "iters"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if a.top_k > a.experts:
        ap.error("--top-k must not exceed --experts")
    try:
        tokens = [int(t) for t in a.tokens.split(",")]
    except ValueError:
        ap.error("--tokens must be comma-separated integers")
    if any(t < 1 for t in tokens):
        ap.error("--tokens must be >= 1")
    moe = MoEConfig(a.experts, a.top_k, a.expert_size, scoring="sigmoid", norm_topk_prob=True,
                    score_bias=True)
    rng = np.random.default_rng(0)
    h, e, i = a.hidden, a.experts, a.expert_size
    r = lambda *s: jnp.asarray(rng.standard_normal(s) * s[-2] ** -0.5, jnp.float32)
    p = {"router": r(h, e), "router_bias": jnp.zeros((e,), jnp.float32),
         "experts_gate": r(e, h, i), "experts_up": r(e, h, i), "experts_down": r(e, i, h)}
    fns = {impl: jax.jit(lambda p, x, impl=impl: moe_ffn(moe, p, x, impl))
           for impl in ("ragged", "dense")}
    print(f"{jax.devices()[0].platform}: H={h} E={e} k={a.top_k} I_e={i}")
    print(f"{'T':>6} {'ragged ms':>10} {'dense ms':>10} {'dense/ragged':>13} {'max |diff|':>11}")
    for t in tokens:
        x = jnp.asarray(rng.standard_normal((t, h)), jnp.float32)
        outs = {k: f(p, x).block_until_ready() for k, f in fns.items()}   # compile
        times = {k: [] for k in fns}
        for _ in range(a.iters):
            for k, f in fns.items():
                t0 = time.perf_counter()
                f(p, x).block_until_ready()
                times[k].append(time.perf_counter() - t0)
        rg, dn = (1e3 * float(np.median(times[k])) for k in ("ragged", "dense"))
        diff = float(jnp.abs(outs["ragged"] - outs["dense"]).max())
        print(f"{t:>6} {rg:>10.3f} {dn:>10.3f} {dn / rg:>13.2f} {diff:>11.2e}")


if __name__ == "__main__":
    main()
