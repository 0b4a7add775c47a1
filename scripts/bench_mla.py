#!/usr/bin/env python
"""Multi-head latent attention: cache bytes and the absorbed vs expanded path, as ratios.

For a random MLA model (``--preset tiny`` or ``--preset dsv3-layer``: one layer with DeepSeek-V3's
attention shapes, 128 heads, C=512, dn=128, dr=64, dv=128, H=7168 shrunk by ``--hidden``) it prints

* cache values per token per layer: the latent ``C + dr`` vs the expanded per-head keys and values
  ``Nq·(dn + dr + dv)`` (what a GQA cache with Nkv = Nq would hold) and their ratio;
* the forward time of the two paths (``ModelConfig.mla_path``) for a decode step (``--batch``
  sequences x 1 row, each with ``--context`` cached tokens) and a prefill chunk (``--chunk`` rows of
  one sequence after ``--context`` cached tokens): medians of ``--iters`` interleaved runs and the
  ratio expanded / absorbed.

Times on a shared CPU are only indicative; the ratios are what to read.

    python scripts/bench_mla.py --preset tiny
    python scripts/bench_mla.py --preset dsv3-layer --hidden 1024 --context 512 --batch 4
"""
from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jmtp.model import ModelConfig, init_kv_cache, init_params, ragged_batch
from jmtp.model.llama import forward

PRESETS = {
    "tiny": dict(hidden_size=64, num_heads=4, kv_lora_rank=32, q_lora_rank=24, qk_nope_head_dim=16,
                 qk_rope_head_dim=8, v_head_dim=16, intermediate_size=96),
    "dsv3-layer": dict(hidden_size=7168, num_heads=128, kv_lora_rank=512, q_lora_rank=1536,
                       qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                       intermediate_size=256),
}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", choices=list(PRESETS), default="tiny")
    ap.add_argument("--hidden", type=int, default=None, help="override hidden_size")
    ap.add_argument("--heads", type=int, default=None, help="override num_heads")
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--context", type=int, default=256, help="cached tokens per sequence")
    ap.add_argument("--batch", type=int, default=4, help="decode sequences")
    ap.add_argument("--chunk", type=int, default=64, help="prefill chunk rows")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--impl", default="xla", help="attention implementation")
    a = ap.parse_args(argv)
    for name in ("context", "batch", "chunk", "block_size", "iters", "layers"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")

    kw = dict(PRESETS[a.preset])
    if a.hidden:
        kw["hidden_size"] = a.hidden
    if a.heads:
        kw["num_heads"] = a.heads
    cfg = ModelConfig(vocab_size=256, num_layers=a.layers, num_kv_heads=kw["num_heads"],
                      head_dim=kw["qk_rope_head_dim"], attention_type="mla", num_mtp_layers=0, **kw)
    latent = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    expanded = cfg.num_heads * (cfg.qk_head_dim + cfg.v_head_dim)
    print(f"cache values/token/layer: latent {latent}, expanded k+v {expanded}, "
          f"ratio {expanded / latent:.1f}x")

    params = init_params(cfg, jax.random.PRNGKey(0), std=0.02)
    bs = a.block_size
    pages = -(-(a.context + a.chunk) // bs)
    seqs = max(a.batch, 1)
    cache = init_kv_cache(cfg, cfg.num_layers, seqs * pages, bs)
    tables = jnp.arange(seqs * pages, dtype=jnp.int32).reshape(seqs, pages)
    rng = np.random.default_rng(0)

    def case(q_lens, ctx):
        t = int(sum(q_lens))
        pos, meta = ragged_batch(jnp.asarray(q_lens, jnp.int32), jnp.asarray(ctx, jnp.int32),
                                 tables, bs, t)
        return jnp.asarray(rng.integers(0, 256, t), jnp.int32), pos, meta

    cases = {"decode": case([1] * seqs, [a.context] * seqs),
             "prefill": case([a.chunk] + [0] * (seqs - 1), [a.context] + [0] * (seqs - 1))}
    fns = {p: jax.jit(lambda ids, pos, meta, c, p=p: forward(cfg.replace(mla_path=p), params, ids,
                                                             pos, meta, c, a.impl)[0])
           for p in ("absorbed", "expanded")}
    for name, (ids, pos, meta) in cases.items():
        times = {p: [] for p in fns}
        for p, f in fns.items():
            t0 = time.perf_counter()
            f(ids, pos, meta, cache).block_until_ready()
            print(f"  compile {name}/{p}: {time.perf_counter() - t0:.1f} s")
        for _ in range(a.iters):
            for p, f in fns.items():
                t0 = time.perf_counter()
                f(ids, pos, meta, cache).block_until_ready()
                times[p].append(time.perf_counter() - t0)
        med = {p: statistics.median(v) * 1e3 for p, v in times.items()}
        print(f"{name:8s} absorbed {med['absorbed']:8.2f} ms  expanded {med['expanded']:8.2f} ms  "
              f"expanded/absorbed {med['expanded'] / med['absorbed']:.2f}")


if __name__ == "__main__":
    main()
