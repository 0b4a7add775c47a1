"""Gated-DeltaNet rule forms on this machine's default backend: the token-by-token recurrent scan
against the chunked WY/UT form over one prefill, and the engine's mixed rule
(:func:`jmtp.model.gated_deltanet.gated_delta_rule_mixed`) on a prefill step and on a decode step
of verify windows. Times are warm medians; compile times are reported separately.

    python scripts/bench_gdn.py [--heads 8] [--dim 128] [--tokens 512] [--slots 8] [--k 3]

Qwen3-Next-80B's linear layers have 32 value heads of Dk = Dv = 128 (per device: 32 / TP).
"""
from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jmtp.model import gated_deltanet as gd


def timed(fn, *args, repeats: int = 5):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    compile_s = time.perf_counter() - t0
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times), compile_s


def inputs(rng, t, h, d):
    q = jnp.asarray(rng.standard_normal((t, h, d)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((t, h, d)), jnp.float32)
    q, k = gd.prepare_qk(q, k, h)
    v = jnp.asarray(rng.standard_normal((t, h, d)), jnp.float32)
    g = jnp.asarray(-np.abs(rng.standard_normal((t, h))) * 0.1, jnp.float32)
    beta = jnp.asarray(1 / (1 + np.exp(-rng.standard_normal((t, h)))), jnp.float32)
    return q, k, v, g, beta


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--chunk", type=int, default=64)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    h, d, t, b, w = a.heads, a.dim, a.tokens, a.slots, a.k + 1
    print(f"backend {jax.default_backend()}: Hv={h}, Dk=Dv={d}, prefill T={t}, "
          f"{b} slots x K+1={w} window rows")
    q, k, v, g, beta = inputs(rng, t, h, d)
    s0 = jnp.zeros((h, d, d), jnp.float32)
    rec = jax.jit(lambda *x: gd.recurrent_gated_delta_rule(*x)[0][-1])
    chk = jax.jit(lambda *x: gd.chunk_gated_delta_rule(*x, chunk_size=a.chunk)[0][-1])
    r_s, r_c = timed(rec, q, k, v, g, beta, s0)
    c_s, c_c = timed(chk, q, k, v, g, beta, s0)
    print(f"one prefill of {t} rows: recurrent {r_s * 1e3:.1f} ms, chunked (C={a.chunk}) "
          f"{c_s * 1e3:.1f} ms: chunked/recurrent time {c_s / r_s:.2f}x "
          f"(compile {r_c:.1f} s / {c_c:.1f} s)")

    def mixed_step(lens):
        tt = max(sum(lens), 1)
        x = inputs(rng, tt, h, d)
        cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        pos = np.concatenate([np.arange(n) + 16 for n in lens]).astype(np.int32)
        rows = gd.packed_rows(jnp.asarray(cu), jnp.asarray(pos), w)
        qlens = jnp.asarray(lens, jnp.int32)
        init = jnp.zeros((len(lens), h, d, d), jnp.float32)
        pool = jnp.zeros((len(lens), w, h, d, d), jnp.float32)
        fn = jax.jit(lambda *z: gd.gated_delta_rule_mixed(*z[:5], rows, qlens, *z[5:],
                                                          chunk_size=a.chunk)[0])
        return timed(fn, *x, init, pool)

    pre_s, pre_c = mixed_step([t] + [0] * (b - 1))
    dec_s, dec_c = mixed_step([w] * b)
    print(f"engine rule, prefill step ({t} rows, one slot): {pre_s * 1e3:.1f} ms "
          f"(compile {pre_c:.1f} s); decode step ({b}x{w} rows): {dec_s * 1e3:.1f} ms "
          f"(compile {dec_c:.1f} s); per row: prefill {pre_s / t * 1e6:.0f} us, "
          f"decode {dec_s / (b * w) * 1e6:.0f} us")


if __name__ == "__main__":
    main()
