#!/usr/bin/env python
"""How fast can prompt-lookup drafting get on this machine? A ceiling for jmtp issue 11.

Three measurements in one run, batch 1, greedy, chat template, on the prompt sets of
``scripts/bench_spec.py`` (held-out general chat prompts, the copy-heavy set):

1. **Live**: plain decoding and n-gram drafting with K = ``--live-k`` (fixed policy), interleaved
   ``--rounds`` times; end-to-end tok/s (prefill included) and the median time of the decode
   steps of each token bucket T (a T-row verify step; the plain engine's T = 1).
2. **Simulated acceptance** on the plain greedy outputs, for each K in ``--ks``: jmtp's own rule
   (:func:`jmtp.runtime.device.ngram.ngram_match`, n = 5..1, earliest match) and an *oracle* lookup
   drafter: of every earlier occurrence of the last token, the one whose continuation matches
   the true next tokens longest (it sees the future, so it never drafts a rejected token: no
   lookup drafter can accept more). Both drafts are verified as the engine would (greedy), so
   the acceptance length (AL: tokens per decode step) is exact for that drafter.
3. **Predicted decode-only speed-up** of each simulated drafter: tokens × cost(T=1) / Σ over its
   steps of cost(bucket of 1 + drafts), with the live per-bucket costs of step 1 (buckets the live
   engine never ran are interpolated linearly in T from the measured ones). End-to-end ratios are
   lower: the prefill costs the same with and without drafting.

    python scripts/bench_ngram_ceiling.py --num-prompts 6 --max-tokens 48 --ks 3,5,7 --rounds 2
"""
from __future__ import annotations

import argparse
import collections
import time


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sets", default="copy,general", help="prompt sets: general, copy")
    ap.add_argument("--num-prompts", type=int, default=6, help="prompts per set (0 = all)")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--ks", default="3,5,7", help="draft counts K simulated")
    ap.add_argument("--live-k", type=int, default=7, help="K of the live n-gram engine (its "
                    "buckets 1, 2, 4, ..., K+1 give the cost table)")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args(argv)
    args.sets = args.sets.split(",")
    args.ks = [int(k) for k in args.ks.split(",")]
    if args.num_prompts < 0 or args.max_tokens < 2 or args.rounds < 1 or args.live_k < 1 or \
            any(k < 1 for k in args.ks):
        ap.error("--num-prompts >= 0, --max-tokens >= 2, --rounds >= 1, K >= 1")
    return args


def oracle_drafts(hist: list[int], future: list[int], k: int) -> int:
    """Accepted drafts of the oracle lookup drafter: the longest agreement with ``future`` among
    the continuations of the earlier occurrences of ``hist[-1]`` (at most ``k``)."""
    best, last = 0, hist[-1]
    for i in range(len(hist) - 1):
        if hist[i] != last:
            continue
        a = 0
        while (a < k and i + 1 + a < len(hist) and a < len(future)
               and hist[i + 1 + a] == future[a]):
            a += 1
        best = max(best, a)
    return best


def simulate(prompts, outputs, k: int, drafter: str, max_tokens: int):
    """``(tokens, steps, rows)``: decode steps after the prefill's first token, each drafting
    with ``drafter`` (``"jmtp"`` or ``"oracle"``) at most ``max_tokens - generated - 1`` tokens
    (the engine's cap) and verified greedily; ``rows`` = 1 + drafts of each step (the verify
    window)."""
    import jax.numpy as jnp
    import numpy as np

    from jmtp.runtime.device.ngram import ngram_match

    tokens = steps = 0
    rows = []
    for prompt, out in zip(prompts, outputs):
        hist, pos = list(prompt) + [out[0]], 1
        while pos < len(out):
            future = out[pos:]
            budget = max(0, min(k, max_tokens - pos - 1))   # the engine's draft budget
            if drafter == "oracle":
                a = oracle_drafts(hist, future, min(budget, len(future) - 1))
                drafted = a
            else:
                d, c = ngram_match(jnp.asarray([hist], jnp.int32),
                                   jnp.asarray([len(hist)], jnp.int32),
                                   jnp.asarray([budget], jnp.int32), 5, 1, k)
                d = np.asarray(d)[0, :int(c[0])]
                a = 0
                while a < min(len(d), len(future) - 1) and d[a] == future[a]:
                    a += 1       # (the answer's last token is the final step's correction/bonus)
                drafted = len(d)
            rows.append(1 + drafted)
            hist += future[:a + 1]
            pos += a + 1
            steps += 1
            tokens += a + 1
    return tokens, steps, rows


def bucket_cost(cost: dict[int, float], rows: int, buckets: list[int]) -> float:
    """Seconds of the decode bucket holding ``rows``: measured, else interpolated linearly in T
    between the measured buckets around it.

    Raises:
      ValueError: the bucket lies outside the measured ones (raise ``--live-k``)."""
    t = next(b for b in buckets if b >= rows)
    if t in cost:
        return cost[t]
    lo = [b for b in cost if b < t]
    hi = [b for b in cost if b > t]
    if not lo or not hi:
        raise ValueError(f"no live cost around a {t}-row step (measured: {sorted(cost)}); run "
                         f"with a larger --live-k")
    a, b = max(lo), min(hi)
    return cost[a] + (cost[b] - cost[a]) * (t - a) / (b - a)


def main(argv=None):
    args = parse_args(argv)
    import numpy as np
    from bench_spec import prompt_sets

    from jmtp import LLM, SamplingParams, SpeculativeConfig
    from jmtp.model import load_checkpoint, load_tokenizer

    cfg, params = load_checkpoint(None)
    tok = load_tokenizer(None)
    sets = prompt_sets(tok, args.sets, args.num_prompts)
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    print(f"batch 1, greedy, {args.max_tokens} tokens, sets {args.sets}, "
          f"{args.num_prompts or 'all'} prompts per set, live n-gram K={args.live_k}, "
          f"{args.rounds} rounds")
    for name, prompts in sets.items():
        max_len = max(map(len, prompts)) + args.max_tokens + args.live_k + 8
        engines, steps = {}, {}
        for label, spec in (("plain", None), (f"ngram{args.live_k}",
                                              SpeculativeConfig("ngram", args.live_k))):
            t0 = time.perf_counter()
            llm = LLM(model_config=cfg, params=params, tokenizer=tok, max_num_seqs=1,
                      max_model_len=max_len, speculative_config=spec, compile="eager")
            eng, rec = llm.llm_engine, collections.defaultdict(list)
            eng.async_scheduling = False     # each step timed from dispatch to its outputs
            run = eng.runner.run_step

            def timed(bucket, chunks, limits, guide=None, run=run, rec=rec):
                t = time.perf_counter()
                out = run(bucket, chunks, limits, guide)
                if not chunks.any():                      # decode steps only
                    rec[bucket.num_tokens].append(time.perf_counter() - t)
                return out

            eng.runner.run_step = timed
            llm.generate(prompts[:1], sp, use_tqdm=False)              # warm
            rec.clear()
            engines[label], steps[label] = llm, rec
            print(f"  [{name}] {label}: built, compiled and warmed in "
                  f"{time.perf_counter() - t0:.1f} s")
        toks = {k: 0 for k in engines}
        secs = {k: 0.0 for k in engines}
        outputs = {}
        for _ in range(args.rounds):
            for label, llm in engines.items():
                t0 = time.perf_counter()
                outs = llm.generate(prompts, sp, use_tqdm=False)
                secs[label] += time.perf_counter() - t0
                toks[label] += sum(len(o.outputs[0].token_ids) for o in outs)
                outputs[label] = [list(o.outputs[0].token_ids) for o in outs]
        spec_label = f"ngram{args.live_k}"
        same = sum(a == b for a, b in zip(outputs["plain"], outputs[spec_label]))
        rate = {k: toks[k] / secs[k] for k in engines}
        cost = {t: float(np.median(v)) for t, v in steps[spec_label].items()}
        plain_step = float(np.median(steps["plain"][1]))
        print(f"\n### {name}: live (end-to-end, prefill included)\n")
        print(f"plain {rate['plain']:.1f} tok/s (decode step {plain_step * 1e3:.1f} ms); "
              f"{spec_label} {rate[spec_label]:.1f} tok/s = "
              f"**{rate[spec_label] / rate['plain']:.2f}x** plain; identical {same}/{len(prompts)}")
        print("live verify-step cost by token bucket T (n-gram engine, median ms, steps): " +
              ", ".join(f"T={t}: {cost[t] * 1e3:.1f} ({len(steps[spec_label][t])})"
                        for t in sorted(cost)) + f"; plain T=1: {plain_step * 1e3:.1f}")
        print(f"\n### {name}: simulated drafters on the plain greedy outputs\n")
        print("| drafter | K | acceptance length | drafts per step | predicted decode-only "
              "speed-up vs plain |")
        print("|---|---|---|---|---|")
        for k in args.ks:
            buckets = sorted({min(2 ** i, k + 1) for i in range(k.bit_length() + 1)} | {k + 1})
            for drafter in ("jmtp", "oracle"):
                n_tok, n_steps, rows = simulate(prompts, outputs["plain"], k, drafter,
                                                args.max_tokens)
                t_spec = sum(bucket_cost(cost, r, buckets) for r in rows)
                print(f"| {'jmtp n-gram (n=5..1)' if drafter == 'jmtp' else 'oracle lookup'} | "
                      f"{k} | {n_tok / n_steps:.2f} | {(sum(rows) - n_steps) / n_steps:.2f} | "
                      f"{n_tok * plain_step / t_spec:.2f}x |")


if __name__ == "__main__":
    import os
    import sys
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main()
