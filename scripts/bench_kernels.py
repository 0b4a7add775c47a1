#!/usr/bin/env python
"""Time the ragged paged attention kernels against the jnp reference on the default device.

Scenarios (one static shape each, compiled once, then timed):

* ``decode_q1``  — S=8 sequences, 1 query each, 512 keys each;
* ``decode_q4``  — S=8 verify windows of 4 queries (K=3), 512 keys each;
* ``mixed``      — 2 prefill chunks (256 queries at context 0 and 256 at context 512) with 6
  verify windows of 4 queries over 512 keys.

For every scenario and implementation it prints the median wall time of ``--iters`` calls
(``jax.block_until_ready``), the ratio reference/kernel (> 1: kernel faster), the max abs
difference to the reference, and the effective KV read bandwidth (bytes of the keys/values the
batch needs / time). Figures come from one run of this script on one device; nothing is
asserted.

On CPU the kernels run in Pallas interpret mode (simulation, orders of magnitude slower than the
reference) and the model shape shrinks (``--small`` is implied) — there the script only proves
that the pipeline runs. Usage::

    python scripts/bench_kernels.py                 # implementations for the default backend
    python scripts/bench_kernels.py --impls pallas_gpu --dtype bfloat16 --iters 50
"""
from __future__ import annotations

import argparse
import functools
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jmtp.pallas.ragged_paged_attention import ragged_paged_attention


def make_batch(q_lens, kv_lens, *, num_q_heads, num_kv_heads, head_dim, block_size, dtype,
               seed=0):
    """Packed queries and a paged cache with shuffled physical blocks for the given lengths."""
    rng = np.random.default_rng(seed)
    s = len(q_lens)
    pages = max(-(-max(kv_lens) // block_size), 1)
    num_blocks = s * pages + 1
    perm = rng.permutation(num_blocks)
    tables = np.full((s, pages), -1, np.int32)
    nxt = 0
    for i, kv in enumerate(kv_lens):
        for p in range(-(-kv // block_size)):
            tables[i, p] = perm[nxt]
            nxt += 1
    t = sum(q_lens)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    q = jnp.asarray(rng.standard_normal((t, num_q_heads, head_dim)), dtype)
    k = jnp.asarray(rng.standard_normal(shape), dtype)
    v = jnp.asarray(rng.standard_normal(shape), dtype)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    kv_bytes = 2 * sum(kv_lens) * num_kv_heads * head_dim * jnp.dtype(dtype).itemsize
    batch = (q, k, v, jnp.asarray(kv_lens, jnp.int32), jnp.asarray(tables), jnp.asarray(cu))
    return batch, kv_bytes


def time_fn(fn, args, iters, warmup):
    out = None
    for _ in range(warmup):
        out = jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        out = jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def main():
    backend = jax.default_backend()
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--impls", nargs="+", default=None,
                    help="kernels to time (default: the one for this backend; both on CPU)")
    ap.add_argument("--dtype", default=None, help="float32 | bfloat16 (default: bf16, f32 on CPU)")
    ap.add_argument("--iters", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--small", action="store_true", help="8 q heads / 2 kv heads (CPU default)")
    ap.add_argument("--block-size", type=int, default=16)
    args = ap.parse_args()

    on_cpu = backend == "cpu"
    impls = args.impls or {"tpu": ["pallas_tpu"], "gpu": ["pallas_gpu"]}.get(
        backend, ["pallas_tpu", "pallas_gpu"])
    dtype = jnp.dtype(args.dtype or ("float32" if on_cpu else "bfloat16"))
    iters = args.iters or (2 if on_cpu else 20)
    small = args.small or on_cpu
    nq, nkv, d = (8, 2, 128) if small else (32, 8, 128)
    print(f"device: {jax.devices()[0].device_kind} ({backend}); dtype {dtype.name}; "
          f"heads {nq}/{nkv}, head_dim {d}, block_size {args.block_size}; median of {iters}"
          + ("; kernels in INTERPRET mode (CPU): timings are not kernel performance" if on_cpu
             else ""))

    scenarios = {
        "decode_q1": ([1] * 8, [512] * 8),
        "decode_q4": ([4] * 8, [512] * 8),
        "mixed": ([256, 256] + [4] * 6, [256, 768] + [512] * 6),
    }
    print(f"{'scenario':<10} {'impl':<11} {'ms':>10} {'ref/impl':>9} {'max|diff|':>10} "
          f"{'KV GB/s':>8}")
    for name, (q_lens, kv_lens) in scenarios.items():
        batch, kv_bytes = make_batch(q_lens, kv_lens, num_q_heads=nq, num_kv_heads=nkv,
                                     head_dim=d, block_size=args.block_size, dtype=dtype)
        kw = dict(sm_scale=d ** -0.5)
        ref = jax.jit(functools.partial(ragged_paged_attention, **kw, implementation="reference"))
        t_ref, out_ref = time_fn(ref, batch, iters, args.warmup)
        print(f"{name:<10} {'reference':<11} {t_ref * 1e3:10.3f} {1.0:9.2f} {0.0:10.2e} "
              f"{kv_bytes / t_ref / 1e9:8.2f}", flush=True)
        for impl in impls:
            fn = jax.jit(functools.partial(ragged_paged_attention, **kw, implementation=impl))
            t, out = time_fn(fn, batch, iters, args.warmup)
            diff = float(jnp.max(jnp.abs(out.astype(jnp.float32) - out_ref.astype(jnp.float32))))
            print(f"{name:<10} {impl:<11} {t * 1e3:10.3f} {t_ref / t:9.2f} {diff:10.2e} "
                  f"{kv_bytes / t / 1e9:8.2f}", flush=True)


if __name__ == "__main__":
    main()
