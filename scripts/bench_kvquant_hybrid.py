#!/usr/bin/env python
"""8-bit KV caches on a hybrid gated-DeltaNet target (issue 51): the agreement measures of
``scripts/bench_kvquant.py`` (``docs/kvquant.md``) for a Qwen3-Next-layout model, whose KV cache
covers its full-attention layers only (the int8 key shift is calibrated for those).

No Qwen3-Next / Qwen3.5 weights are reachable here, so the model is a **random** transformers
checkpoint: ``--checkpoint DIR`` (an HF directory of ``Qwen3NextForCausalLM`` & co.), else the
tiny random Qwen3-Next of ``tests/model/hybrid_fixtures.py`` (5 layers: 3 gated DeltaNet, 2 gated
attention with 2 KV heads of 16; its ``mtp.*`` layer random too, so MTP acceptance is low). A
random model's next-token margins are not a trained model's, so the agreement figures say how the
quantised cache perturbs *this* function, not what a real checkpoint would show.

For each cache dtype (``none``, ``int8``, ``fp8_e4m3``) a plain and an MTP K=3 engine generate
greedily over random-token prompts; against the unquantised cache it reports prefix /
position-wise / identical agreement, the MTP acceptance length and its ratio, "MTP = plain" on the
same quantised cache, the teacher-forced top-1 agreement (prompt + unquantised output as one
prefill), the relative RMS error of the full-attention layers' keys and values as stored, and the
KV bytes.

    python scripts/bench_kvquant_hybrid.py --num-prompts 16 --max-tokens 32
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", default=None, help="HF checkpoint directory (default: tiny "
                    "random Qwen3-Next)")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--dtypes", default="none,int8,fp8_e4m3")
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args(argv)


def checkpoint(path):
    import jax.numpy as jnp

    from jmtp.model.checkpoints.hf_loader import load_hf
    if path is None:
        from pathlib import Path

        from tests.model import hybrid_fixtures as hx
        model = hx.hf_model("qwen3_next")
        path = hx.save_checkpoint(model, Path(tempfile.mkdtemp()) / "qwen3_next",
                                  hx.mtp_tensors(model))
    return load_hf(path, jnp.float32)


def teacher_forced(cfg, params, prompts, outputs, kv):
    """(positions whose argmax through a ``kv`` cache equals the f32 cache's, positions)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jmtp.model import compute_logits, forward
    from jmtp.model.kv_shift import with_k_shift
    from jmtp.model.llama import init_model_cache
    fwd = jax.jit(forward, static_argnums=0)
    shifted = with_k_shift(cfg, params, kv)
    same = total = 0
    for p, o in zip(prompts, outputs):
        ids = list(p) + list(o)
        t, bs = len(ids), 16
        pages = -(-t // bs)
        ids, pos, meta = _padded(ids, pages, bs)
        top = []
        for dt, pr in ((None, params), (kv, shifted)):
            cache = init_model_cache(cfg, pages, bs, kv_cache_dtype=dt)
            h, _ = fwd(cfg, pr, ids, pos, meta, cache)
            top.append(np.asarray(jnp.argmax(compute_logits(params, h[len(p) - 1:t - 1]), -1)))
        same += int((top[0] == top[1]).sum())
        total += len(o)
    return same, total


def _padded(ids, pages, bs):
    """``ids`` padded to ``pages`` full blocks (one compile per page count, not per length;
    the model is causal, so rows before the padding do not see it) and their ragged batch."""
    import jax.numpy as jnp

    from jmtp.model import ragged_batch
    tp = pages * bs
    pos, meta = ragged_batch(jnp.array([tp]), jnp.array([0]),
                             jnp.arange(pages, dtype=jnp.int32)[None], bs, tp)
    return jnp.asarray(list(ids) + [0] * (tp - len(ids)), jnp.int32), pos, meta


def kv_errors(cfg, params, prompts, kv):
    """Relative RMS error of the full-attention layers' K and V as an 8-bit cache stores them
    (int8: keys shifted and rotated, values rotated; fp8: plain), dequantised and rotated back."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jmtp.model import forward
    from jmtp.model.kv_shift import calibrate_k_shift
    from jmtp.model.llama import init_model_cache
    from jmtp.pallas import kv_quant
    q8 = kv_quant.storage_dtype(kv)
    mu = np.asarray(calibrate_k_shift(cfg, params)) if kv == "int8" else 0.0
    r = np.asarray(kv_quant.hadamard_rotation(cfg.head_dim)) if kv == "int8" else np.eye(
        cfg.head_dim, dtype=np.float32)
    err = {"K": [0.0, 0.0], "V": [0.0, 0.0]}
    fwd = jax.jit(forward, static_argnums=0)
    for ids in prompts:
        t, bs = len(ids), 16
        pages = -(-t // bs)
        _, cache = fwd(cfg, params, *_padded(ids, pages, bs), init_model_cache(cfg, pages, bs))
        for name, c in (("K", cache.k), ("V", cache.v)):
            x = np.asarray(c).reshape(cfg.num_kv_layers, -1, cfg.num_kv_heads, cfg.head_dim)[:, :t]
            xs = x - (mu[:, None] if name == "K" and kv == "int8" else 0.0)
            q, s = kv_quant.quantize(jnp.asarray(xs @ r), q8)
            err[name][0] += float(np.sum((np.asarray(kv_quant.dequantize(q, s)) @ r.T - xs) ** 2))
            err[name][1] += float(np.sum(xs ** 2))
    return {k: (a / b) ** 0.5 for k, (a, b) in err.items()}


def main(argv=None) -> int:
    args = parse_args(argv)
    import numpy as np

    import jmtp
    from bench_kvquant import agreement
    cfg, params = checkpoint(args.checkpoint)
    rng = np.random.default_rng(args.seed)
    prompts = [[int(x) for x in rng.integers(2, cfg.vocab_size, int(n))]
               for n in rng.integers(8, 41, args.num_prompts)]
    sp = jmtp.SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    dtypes = args.dtypes.split(",")
    out, acc, kvb = {}, {}, {}
    for dt in dtypes:
        kv = None if dt == "none" else dt
        for k in (0, args.k):
            llm = jmtp.LLM(model_config=cfg, params=params, kv_cache_dtype=kv, max_num_seqs=4,
                           max_model_len=128, block_size=16, compile="lazy",
                           speculative_config=jmtp.SpeculativeConfig("mtp", k) if k else None)
            res = llm.generate(prompts, sp, use_tqdm=False)
            out[dt, k] = [r.token_ids for r in res]
            if k:
                st = llm.llm_engine.get_stats()
                acc[dt] = 1 + st["num_accepted_tokens"] / max(st["num_decode_steps"], 1)
                kvb[dt] = llm.llm_engine.kv_cache_bytes()
            print(f"done {dt} K={k}", file=sys.stderr, flush=True)
    print(f"\n{platform.machine()}, {os.cpu_count()} CPUs | hybrid target {cfg.layer_types} "
          f"(kv layers {cfg.num_kv_layers}, {cfg.num_kv_heads} KV heads x {cfg.head_dim}; "
          f"{'random tiny Qwen3-Next' if args.checkpoint is None else args.checkpoint}) | "
          f"{len(prompts)} random-token prompts, greedy, max_tokens {args.max_tokens}\n")
    print("| cache | prefix-identical | position-wise | identical outputs | MTP K=3 acc. len | vs "
          "unquantised | MTP = plain (prefix) | teacher-forced top-1 | K rel. err | V rel. err "
          "| KV values (bytes) | scales |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for dt in dtypes:
        a = agreement(out["none", 0], out[dt, 0])
        mp = agreement(out[dt, 0], out[dt, args.k])
        if dt == "none":
            tf, err = "100 %", {"K": 0.0, "V": 0.0}
        else:
            same, tot = teacher_forced(cfg, params, prompts, out["none", 0], dt)
            tf, err = f"{100 * same / tot:.2f} % ({same}/{tot})", kv_errors(cfg, params,
                                                                          prompts[:8], dt)
        print(f"| {dt} | {100 * a['prefix']:.1f} % | {100 * a['positionwise']:.1f} % | "
              f"{a['identical']}/{a['prompts']} | {acc[dt]:.3f} | {acc[dt] / acc['none']:.3f} | "
              f"{mp['identical']}/{mp['prompts']} ({100 * mp['prefix']:.1f} %) | {tf} | "
              f"{err['K']:.4f} | {err['V']:.4f} | {kvb[dt]['values']} | {kvb[dt]['scales']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
