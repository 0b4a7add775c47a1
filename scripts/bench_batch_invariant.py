#!/usr/bin/env python
"""Batch-invariant mode (``LLM(batch_invariant=True)``, issue 49) on SmolLM2: what it fixes and
what it costs.

**Exactness**, over the 48 evaluation prompts of ``docs/kvquant.md`` (the held-out general chat
prompts and the copy-heavy set, ``scripts/bench_spec.py``'s sets; chat template, greedy,
``--max-tokens`` tokens, ``max_num_seqs`` 8, so each request runs among 7 batch mates of other
lengths), for each configuration (``bf16``: bf16 weights and KV cache; ``int8``: the default f32
weights with an int8 KV cache) and each mode (the default, and ``batch_invariant=True``):

* MTP = plain: greedy MTP K=3 outputs token-identical to plain decoding's, out of 48;
* alone = batched: the first ``--alone`` prompts run one at a time, token-identical to their
  batched outputs (batch-invariant mode only; the default's is printed too).

**Cost**: decode and prefill time of the same engine shape with and without the mode, in f32 (the
CPU default) and interleaved in one run (``--cost-reps`` rounds of: each engine generates
``--cost-tokens`` tokens for a batch of 1 and of 8 prompts), compiles excluded (one warm-up
round first); ratios invariant / default. The host is shared: absolute times are noisy, the
ratios less so.

    python scripts/bench_batch_invariant.py                       # everything (long on a CPU)
    python scripts/bench_batch_invariant.py --configs bf16 --num-prompts 4 --max-tokens 16
    python scripts/bench_batch_invariant.py --skip-exactness      # the cost only
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import time


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default="bf16,int8", help="bf16, int8")
    ap.add_argument("--num-prompts", type=int, default=0, help="prompts per set (0 = all: 48)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--alone", type=int, default=8, help="prompts also run alone")
    ap.add_argument("--modes", default="default,invariant")
    ap.add_argument("--skip-exactness", action="store_true")
    ap.add_argument("--skip-cost", action="store_true")
    ap.add_argument("--cost-reps", type=int, default=3)
    ap.add_argument("--cost-tokens", type=int, default=32)
    return ap.parse_args(argv)


def exactness(args, cfg, params, tok, prompts, longest):
    import jax
    import jax.numpy as jnp

    from jmtp import LLM, SamplingParams, SpeculativeConfig
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    rows = []
    for conf in args.configs.split(","):
        kw = dict(model_config=cfg, tokenizer=tok, max_num_seqs=8, layer_loop="scan",
                  max_model_len=longest + args.max_tokens + 16, compile="lazy")
        if conf == "bf16":
            kw.update(dtype="bfloat16", params=jax.tree.map(
                lambda a: a.astype(jnp.bfloat16) if a.dtype == jnp.float32 else a, params))
        else:
            kw.update(params=params, kv_cache_dtype="int8")
        for mode in args.modes.split(","):
            bi = mode == "invariant"
            t0 = time.perf_counter()
            toks = {}
            for k in (0, 3):
                with LLM(speculative_config=SpeculativeConfig("mtp", k) if k else None,
                         batch_invariant=bi, **kw) as llm:
                    toks[k] = [o.outputs[0].token_ids
                               for o in llm.generate(prompts, sp, use_tqdm=False)]
                    if k == 3:
                        alone = [llm.generate([p], sp, use_tqdm=False)[0].outputs[0].token_ids
                                 for p in prompts[:args.alone]]
            same = sum(a == b for a, b in zip(toks[0], toks[3]))
            alone_same = sum(a == b for a, b in zip(alone, toks[3]))
            rows.append((conf, mode, same, len(prompts), alone_same, len(alone),
                         time.perf_counter() - t0))
            print(f"# {conf} {mode}: MTP = plain {same}/{len(prompts)}, MTP alone = batched "
                  f"{alone_same}/{len(alone)} ({rows[-1][-1]:.0f} s)", flush=True)
    print("\n| cache | mode | greedy MTP K=3 = plain | MTP alone = among 7 batch mates |")
    print("| --- | --- | --- | --- |")
    for conf, mode, same, n, asame, na, _ in rows:
        name = "bf16 weights and cache" if conf == "bf16" else "f32 weights, int8 KV"
        print(f"| {name} | {'batch_invariant=True' if mode == 'invariant' else 'default'} | "
              f"{same}/{n} | {asame}/{na} |")
    return rows


def cost(args, cfg, params, tok, prompts):
    from jmtp import LLM, SamplingParams, SpeculativeConfig
    sp = SamplingParams(max_tokens=args.cost_tokens, temperature=0.0, ignore_eos=True)
    engines = {}
    for k in (0, 3):
        for bi in (False, True):
            engines[k, bi] = LLM(model_config=cfg, params=params, tokenizer=tok, max_num_seqs=8,
                                 max_model_len=1024, compile="lazy", batch_invariant=bi,
                                 speculative_config=SpeculativeConfig("mtp", k) if k else None)
    times = {key: {"decode1": [], "decode8": [], "prefill8": []} for key in engines}
    for rep in range(args.cost_reps + 1):            # round 0: warm-up (compiles)
        for key, llm in engines.items():
            for batch in (1, 8):
                llm.generate(prompts[:batch], sp, use_tqdm=False)
                s = llm.last_run_stats
                if rep:
                    times[key][f"decode{batch}"].append(s["decode_tokens_per_second"])
                    if batch == 8:
                        times[key]["prefill8"].append(s["time_to_first_token"])
    for llm in engines.values():
        llm.close()
    med = lambda xs: sorted(xs)[len(xs) // 2]     # noqa: E731
    print("\n| engine | decode tok/s batch 1 (default / invariant) | ratio | decode tok/s "
          "batch 8 | ratio | prefill of 8 prompts, s | ratio |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    out = {}
    for k in (0, 3):
        d, i = times[k, False], times[k, True]
        r1 = med(i["decode1"]) / med(d["decode1"])
        r8 = med(i["decode8"]) / med(d["decode8"])
        rp = med(i["prefill8"]) / med(d["prefill8"])
        out[k] = dict(decode1=r1, decode8=r8, prefill8=rp)
        print(f"| {'plain' if not k else 'MTP K=3'} | {med(d['decode1']):.1f} / "
              f"{med(i['decode1']):.1f} | {r1:.2f} | {med(d['decode8']):.1f} / "
              f"{med(i['decode8']):.1f} | {r8:.2f} | {med(d['prefill8']):.2f} / "
              f"{med(i['prefill8']):.2f} | {rp:.2f} |")
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_spec import prompt_sets

    from jmtp.model import load_checkpoint, load_tokenizer
    cfg, params = load_checkpoint(None)
    tok = load_tokenizer(None)
    sets = prompt_sets(tok, ["general", "copy"], args.num_prompts)
    prompts = [p for ps in sets.values() for p in ps]
    longest = max(len(p) for p in prompts)
    print(f"# {platform.machine()}, {os.cpu_count()} CPUs, load average "
          f"{os.getloadavg()[0]:.1f} | SmolLM2-135M-Instruct + shipped MTP head | "
          f"{len(prompts)} prompts, max_tokens {args.max_tokens}, max_num_seqs 8", flush=True)
    if not args.skip_exactness:
        exactness(args, cfg, params, tok, prompts, longest)
    if not args.skip_cost:
        cost(args, cfg, params, tok, prompts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
