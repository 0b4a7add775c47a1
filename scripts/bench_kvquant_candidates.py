#!/usr/bin/env python
"""Cheap screening of int8 KV-cache variants on SmolLM2 (jmtp issue 15): teacher-forced fidelity
of fake-quantised K/V, without building engines.

Each evaluation prompt (``scripts/bench_spec.py``'s general + copy sets, every ``--step``-th)
plus its greedy output on the unquantised cache (generated once with a plain f32 engine) runs as
one causal forward of a dense re-implementation of the target (``jmtp.model.llama``'s
projections, RoPE and MLP; plain causal softmax attention) in which each layer's K and V pass
through quantise -> dequantise before attention. Every variant is compared with the same forward
without quantisation over the generated positions:

* **top-1**: share of positions whose argmax equals the f32 one (``flips``: how many differ);
* **KL**: mean ``KL(p_f32 || p_variant)`` of the next-token distributions (nats), the smooth
  measure that ranks variants whose flips are too few to compare;
* **rel. logit error**: ``||logits - logits_f32|| / ||logits_f32||``.

Variants (all int8, one f32 scale per token and KV head unless said): Hadamard-rotated (what
jmtp stored before the key shift), K or V alone, bf16 values (no 8-bit rounding: the reference
point), per-channel K smoothing (SmoothQuant arXiv:2211.10438 / QServe's SmoothAttention
arXiv:2405.04532; ``s = sqrt(stat_k / stat_q)`` per rotary pair, from calibration prompts),
attention-sink positions kept exact (IntactKV arXiv:2403.01241), two scale groups per head,
asymmetric V, and the key shift (the calibrated mean key subtracted, ``jmtp.model.kv_shift``).
Calibration statistics come from the first ``--calib-prompts`` training-split prompts (never
evaluation prompts) or, for the shipped shift, from random token ids.
``--layers`` adds a per-layer attribution: KL with only one layer's keys quantised.
``--noise N`` measures how much the free-running agreement (``scripts/bench_kvquant.py``'s
position-wise figure) varies between int8 quantisers of the same quality: N plain int8 engines
whose key shift is a tiny random vector (1e-3 of the mean key's element size: as good as no
shift, but some values land on the other side of a rounding boundary) and N with the shift
calibrated from other seeds, each generating greedily over the same prompts.

    python scripts/bench_kvquant_candidates.py                  # 24 prompts, all variants
    python scripts/bench_kvquant_candidates.py --step 1 --variants int8,shift
"""
from __future__ import annotations

import argparse
import functools
import os
import sys
import time

VARIANTS = ("int8", "bf16", "k_only", "v_only", "smooth_max", "smooth_rms", "sink4", "groups2",
            "v_asym", "shift_prompts", "shift", "shift_groups2", "shift_sink4", "shift_smooth",
            "shift_smooth_pow2")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--step", type=int, default=2, help="every n-th evaluation prompt")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--calib-prompts", type=int, default=16)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--layers", action="store_true", help="per-layer attribution of the shift")
    ap.add_argument("--noise", type=int, default=0,
                    help="free-running spread: N plain int8 engines unshifted (tiny random shifts) "
                         "and N shifted (calibration seeds), position-wise agreement of each")
    args = ap.parse_args(argv)
    args.variants = args.variants.split(",")
    bad = [v for v in args.variants if v not in VARIANTS]
    if bad or args.step < 1:
        ap.error(f"--variants must name only {VARIANTS}; --step >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import jax
    import jax.numpy as jnp
    import numpy as np
    from bench_spec import prompt_sets

    from jmtp import LLM, SamplingParams
    from jmtp.model import load_checkpoint, load_tokenizer
    from jmtp.model.kv_shift import calibrate_k_shift
    from jmtp.model.llama import _mlp_block, compute_logits, project_qkv, rms_norm
    from jmtp.pallas import kv_quant

    cfg, params = load_checkpoint(None)
    tok = load_tokenizer(None)
    L, NQ, NKV, D = cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    G = NQ // NKV
    R = kv_quant.hadamard_rotation(D)
    sets = prompt_sets(tok, ["general", "copy"], 0)
    prompts = [p for ps in sets.values() for p in ps][:: args.step]
    t0 = time.perf_counter()
    llm = LLM(model_config=cfg, params=params, tokenizer=tok, max_num_seqs=8, compile="lazy",
              max_model_len=max(map(len, prompts)) + args.max_tokens + 16)
    outs = [o.token_ids for o in llm.generate(
        prompts, SamplingParams(max_tokens=args.max_tokens, temperature=0.0), use_tqdm=False)]
    del llm
    print(f"# {len(prompts)} prompts, f32 greedy outputs in {time.perf_counter() - t0:.0f} s",
          flush=True)

    def q8(x, groups, asym):
        sh = x.shape
        x = x.reshape(sh[:-1] + (groups, sh[-1] // groups))
        if asym:
            lo, hi = x.min(-1, keepdims=True), x.max(-1, keepdims=True)
            s = (hi - lo) / 255.0
            s = jnp.where(s > 0, s, 1.0)
            return (jnp.round((x - lo) / s) * s + lo).reshape(sh)
        s = jnp.abs(x).max(-1, keepdims=True) / 127.0
        return (jnp.round(x / jnp.where(s > 0, s, 1.0)) * s).reshape(sh)

    def fake(x, opt, smooth):
        kind = opt.get("kind", "int8")
        if kind == "none":
            return x
        if kind == "bf16":
            return x.astype(jnp.bfloat16).astype(jnp.float32)
        y = q8((x / smooth) @ R, opt.get("groups", 1), opt.get("asym", False))
        return (y @ R.T) * smooth

    @functools.partial(jax.jit, static_argnames=("kopt", "vopt", "nsink"))
    def forward(params, ids, smooth, shift, lmask, kopt, vopt, nsink):
        """Dense causal forward; ``smooth, shift f32[L, Nkv, D]``, ``lmask f32[L]`` (1 =
        quantise that layer). Returns logits and per-layer (max |q| over the group, K)."""
        kopt, vopt = dict(kopt), dict(vopt)
        t = ids.shape[0]
        pos = jnp.arange(t, dtype=jnp.int32)
        causal = jnp.tril(jnp.ones((t, t), bool))
        exact = (pos < nsink)[:, None, None]

        def body(x, inp):
            p, s, u, m = inp
            q, k, v = project_qkv(cfg, p, x, pos)
            kh = jnp.where(exact, k, fake(k - u, kopt, s) + u)
            vh = jnp.where(exact, v, fake(v, vopt, 1.0))
            kh, vh = m * kh + (1 - m) * k, m * vh + (1 - m) * v
            sc = jnp.einsum("tngd,snd->ngts", q.reshape(t, NKV, G, D), kh) / np.sqrt(D)
            pr = jax.nn.softmax(jnp.where(causal, sc, -1e30), -1)
            o = jnp.einsum("ngts,snd->tngd", pr, vh).reshape(t, NQ * D)
            x = _mlp_block(cfg, p, x + o @ p["wo"])
            return x, (jnp.abs(q).reshape(t, NKV, G, D).max(2), k)

        x, stats = jax.lax.scan(body, params["embed"][ids], (params["layers"], smooth, shift,
                                                             lmask))
        return compute_logits(params, rms_norm(x, params["final_norm"], cfg.rms_norm_eps)), stats

    ones, zeros, all_layers = (jnp.ones((L, NKV, D)), jnp.zeros((L, NKV, D)), jnp.ones((L,)))
    none = (("kind", "none"),)
    pad = lambda ids: jnp.asarray(list(ids) + [0] * (-len(ids) % 128), jnp.int32)  # noqa: E731

    # Calibration statistics (training prompts, not evaluation ones).
    from jmtp.model.checkpoints.loader import resolve_checkpoint, shipped_head_path
    from jmtp.model.checkpoints.mtp_head import head_metadata
    from jmtp.train.prompts import encode_chat, load_prompts, split_prompts
    meta = head_metadata(str(shipped_head_path(resolve_checkpoint(None)[0])))
    train, _ = split_prompts(load_prompts(), float(meta.get("eval_frac", 0.1)),
                             int(meta.get("split_seed", 0)))
    qmax = kmax = np.zeros((L, NKV, D))
    qsq = ksq = ksum = np.zeros((L, NKV, D))
    count = 0
    for pr in train[: args.calib_prompts]:
        ids = encode_chat(tok, pr.text)
        _, (qa, ka) = forward(params, pad(ids), ones, zeros, all_layers, none, none, 0)
        qa, ka = np.asarray(qa)[:, : len(ids)], np.asarray(ka)[:, : len(ids)]
        qmax, kmax = np.maximum(qmax, qa.max(1)), np.maximum(kmax, np.abs(ka).max(1))
        qsq, ksq, ksum = qsq + (qa ** 2).sum(1), ksq + (ka ** 2).sum(1), ksum + ka.sum(1)
        count += len(ids)
    kmean, qrms, krms = ksum / count, np.sqrt(qsq / count), np.sqrt(ksq / count)
    kres = np.sqrt(np.maximum(krms ** 2 - kmean ** 2, 1e-12))      # RMS of keys minus the mean
    shift_rand = calibrate_k_shift(cfg, params)
    h = D // 2
    pair = lambda a, f: np.concatenate([f(a[..., :h], a[..., h:])] * 2, -1)  # noqa: E731
    cos = np.sum(np.asarray(shift_rand) * kmean, -1) / (
        np.linalg.norm(shift_rand, axis=-1) * np.linalg.norm(kmean, axis=-1))
    print(f"# mean key / key RMS (per layer, mean over heads): "
          f"{np.round(np.linalg.norm(kmean, axis=-1).mean(-1) / np.linalg.norm(krms, axis=-1).mean(-1), 2).tolist()}")
    print(f"# random-id vs prompt mean key: cosine {cos.mean():.3f}, norm ratio "
          f"{(np.linalg.norm(shift_rand, axis=-1) / np.linalg.norm(kmean, axis=-1)).mean():.3f}")

    smooth_max = np.sqrt(pair(kmax, np.maximum) / pair(qmax, np.maximum))
    smooth_rms = np.sqrt(pair(krms, np.hypot) / pair(qrms, np.hypot))
    smooth_res = np.sqrt(pair(kres, np.hypot) / pair(qrms, np.hypot))
    j = lambda a: jnp.asarray(a, jnp.float32)                       # noqa: E731
    table = {
        "int8": ("int8, rotated (before the shift)", {}, {}, {}),
        "bf16": ("bf16 values (reference point)", {"kind": "bf16"}, {"kind": "bf16"}, {}),
        "k_only": ("int8 K only (V exact)", {}, {"kind": "none"}, {}),
        "v_only": ("int8 V only (K exact)", {"kind": "none"}, {}, {}),
        "smooth_max": ("K smoothing, max statistics", {}, {}, dict(smooth=j(smooth_max))),
        "smooth_rms": ("K smoothing, RMS statistics", {}, {}, dict(smooth=j(smooth_rms))),
        "sink4": ("first 4 positions exact", {}, {}, dict(nsink=4)),
        "groups2": ("2 scale groups per head (K and V)", {"groups": 2}, {"groups": 2}, {}),
        "v_asym": ("asymmetric V (zero point)", {}, {"asym": True}, {}),
        "shift_prompts": ("key shift, mean over training prompts", {}, {},
                          dict(shift=j(kmean))),
        "shift": ("**key shift, mean over random ids (shipped)**", {}, {},
                  dict(shift=shift_rand)),
        "shift_groups2": ("key shift + 2 K scale groups", {"groups": 2}, {},
                          dict(shift=shift_rand)),
        "shift_sink4": ("key shift + first 4 positions exact", {}, {},
                        dict(shift=shift_rand, nsink=4)),
        "shift_smooth": ("key shift + K smoothing (RMS of keys minus the mean)", {}, {},
                         dict(shift=shift_rand, smooth=j(smooth_res))),
        "shift_smooth_pow2": ("same, smoothing rounded to powers of two", {}, {},
                              dict(shift=shift_rand, smooth=j(2.0 ** np.round(np.log2(smooth_res))))),
    }
    ref = {}

    def evaluate(kopt, vopt, smooth=ones, shift=zeros, nsink=0, lmask=all_layers, idx=None):
        same = total = 0
        kl = sq = 0.0
        for i in (range(len(prompts)) if idx is None else idx):
            p, o = prompts[i], outs[i]
            ids, sl = list(p) + list(o), slice(len(p) - 1, len(p) + len(o) - 1)
            if i not in ref:
                ref[i] = np.asarray(forward(params, pad(ids), ones, zeros, all_layers, none, none,
                                            0)[0][sl])
            a = ref[i]
            b = np.asarray(forward(params, pad(ids), smooth, shift, lmask,
                                   tuple(sorted(kopt.items())), tuple(sorted(vopt.items())),
                                   nsink)[0][sl])
            same += int((a.argmax(-1) == b.argmax(-1)).sum())
            total += len(o)
            la, lb = jax.nn.log_softmax(a, -1), jax.nn.log_softmax(b, -1)
            kl += float(jnp.sum(jnp.exp(la) * (la - lb)))
            sq += float(np.sum((a - b) ** 2)) / float(np.sum(a ** 2)) * len(o)
        return same, total, kl / total, np.sqrt(sq / total)

    lines = [f"Teacher-forced, {len(prompts)} evaluation prompts (every {args.step}th of the "
             f"general + copy sets), {args.max_tokens} generated tokens each:", "",
             "| variant | top-1 agreement | flips | mean KL (nats) | rel. logit error |",
             "|---|---|---|---|---|"]
    for name in args.variants:
        label, kopt, vopt, kw = table[name]
        same, total, kl, rel = evaluate(kopt, vopt, **kw)
        lines.append(f"| {label} | {100 * same / total:.2f} % | {total - same} | {kl:.2e} | "
                     f"{rel:.4f} |")
        print(lines[-1], flush=True)
    if args.layers:
        per = []
        idx = list(range(0, len(prompts), max(1, len(prompts) // 8)))
        for layer in range(L):
            m = np.zeros(L, np.float32)
            m[layer] = 1
            per.append(evaluate({}, {"kind": "none"}, shift=shift_rand, lmask=jnp.asarray(m),
                                idx=idx)[2])
        lines += ["", f"KL x 1e6 with only one layer's keys quantised (shifted), layers 0..{L - 1}, "
                  f"{len(idx)} prompts: {[round(1e6 * x, 1) for x in per]}"]
    if args.noise:
        from bench_kvquant import agreement
        mu = np.asarray(shift_rand)
        size = float(np.linalg.norm(mu, axis=-1).mean() / np.sqrt(D))
        lines += ["", f"Free-running, plain int8 engines, {len(prompts)} prompts:", "",
                  "| quantiser | seed | position-wise | prefix | identical outputs |",
                  "|---|---|---|---|---|"]
        for label, make in (
                ("unshifted (tiny random shift)", lambda sd: 1e-3 * size * np.random.default_rng(
                    sd + 1).standard_normal(mu.shape)),
                ("shifted", lambda sd: np.asarray(calibrate_k_shift(cfg, params, seed=sd)))):
            for sd in range(args.noise):
                llm = LLM(model_config=cfg, params={**params, "k_shift": j(make(sd))},
                          tokenizer=tok, max_num_seqs=8, compile="lazy", kv_cache_dtype="int8",
                          max_model_len=max(map(len, prompts)) + args.max_tokens + 16)
                got = [o.token_ids for o in llm.generate(
                    prompts, SamplingParams(max_tokens=args.max_tokens, temperature=0.0),
                    use_tqdm=False)]
                del llm
                ag = agreement(outs, got)
                lines.append(f"| {label} | {sd} | {100 * ag['positionwise']:.1f} % | "
                             f"{100 * ag['prefix']:.1f} % | {ag['identical']}/{ag['prompts']} |")
                print(lines[-1], flush=True)
    print("\n" + "\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
