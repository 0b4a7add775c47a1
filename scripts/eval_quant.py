#!/usr/bin/env python
"""8-bit weights on the evaluation prompts: greedy agreement with fp32, MTP acceptance, bytes.

For each weight format (fp32, then ``LLM(quantization=...)`` ``int8`` and/or ``fp8``), in one
process, greedy generation of the held-out evaluation prompts (the split the shipped MTP head
never saw, as ``scripts/eval_acceptance.py``) with MTP speculation (K=3; greedy speculation is
lossless, so its tokens are the format's own greedy tokens), against the fp32 tokens: how many
outputs are identical, the mean length of the common prefix (as a share of the fp32 output), the
share of positions that agree, and the teacher-forced next-token agreement (the format's argmax
at every position of the fp32 outputs, fed the fp32 tokens: per-token fidelity without the
divergence a free-running comparison compounds); the mean acceptance length of the (quantised)
MTP head; the parameter bytes from the device arrays (8-bit values, scales, the rest) and their
ratio to fp32.
Every configuration runs once untimed first (compilation); tokens/s are from a second run
(``--no-timing``: one run, no tokens/s).

    python scripts/eval_quant.py --formats int8,fp8 --max-tokens 128 --batch 8
"""
from __future__ import annotations

import argparse
import json
import platform
import time


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--formats", default="int8",
                    help="comma-separated: int8, fp8, bf16 (fp32 weights rounded to bf16, a "
                         "baseline of the same kind of perturbation; compute stays fp32)")
    ap.add_argument("--num-prompts", type=int, default=0, help="evaluation prompts used (0 = all)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--k", type=int, default=3, help="MTP speculative tokens")
    ap.add_argument("--no-timing", action="store_true",
                    help="one run per format (compiles included), no tokens/s")
    ap.add_argument("--json", default=None)
    return ap.parse_args(argv)


def agreement(ref: list[list[int]], got: list[list[int]]) -> dict:
    """Identical outputs, mean common-prefix share, share of equal positions (over the fp32
    output's length)."""
    same, prefix, equal, total = 0, 0.0, 0, 0
    for a, b in zip(ref, got):
        same += a == b
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        prefix += n / max(len(a), 1)
        equal += sum(x == y for x, y in zip(a, b))
        total += len(a)
    return {"identical": same, "of": len(ref), "prefix_share": prefix / max(len(ref), 1),
            "position_agreement": equal / max(total, 1)}


def teacher_forced(cfg, params, prompts, outputs) -> tuple[int, int]:
    """``(agreeing, total)`` next-token argmaxes of ``params`` over ``prompt + output`` at the
    output's positions, against the output's tokens."""
    import numpy as np

    from jmtp.model import forward_logits
    agree = total = 0
    for p, o in zip(prompts, outputs):
        seq = list(p) + list(o)
        padded = seq + [0] * (-len(seq) % 64)
        top = np.asarray(forward_logits(cfg, params, padded, block_size=64)).argmax(-1)
        pred = top[len(p) - 1:len(seq) - 1]
        agree += int((pred == np.asarray(o)).sum())
        total += len(o)
    return agree, total


def main(argv=None) -> int:
    args = parse_args(argv)
    from jmtp import LLM, SamplingParams, SpeculativeConfig
    from jmtp.model import load_checkpoint, load_tokenizer
    from jmtp.model.checkpoints.loader import resolve_checkpoint, shipped_head_path
    from jmtp.model.checkpoints.mtp_head import head_metadata
    from jmtp.model.quant_params import quantize_params
    from jmtp.runtime.host.outputs import SpecDecodeMetrics
    from jmtp.train.prompts import encode_chat, load_prompts, split_prompts

    head = shipped_head_path(resolve_checkpoint(args.model)[0])
    cfg, params = load_checkpoint(args.model)
    meta = head_metadata(str(head)) if head is not None else {}
    tok = load_tokenizer(args.model)
    _, held_out = split_prompts(load_prompts(), float(meta.get("eval_frac", 0.1)),
                                int(meta.get("split_seed", 0)))
    held_out = held_out[:args.num_prompts] if args.num_prompts else held_out
    prompts = [encode_chat(tok, p.text) for p in held_out]
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    model = args.model or "SmolLM2-135M-Instruct"
    print(f"# {platform.processor() or platform.machine()} | {model}"
          f" | {len(prompts)} eval prompts, greedy, max_tokens {args.max_tokens}, batch "
          f"{args.batch}, MTP K={args.k}")
    rows, ref = [], None
    formats = [None] + [f for f in args.formats.split(",") if f]
    import jax
    import jax.numpy as jnp
    for fmt in formats:
        if fmt == "bf16":
            c, p = cfg, jax.tree_util.tree_map(
                lambda a: a.astype(jnp.bfloat16).astype(a.dtype)
                if jnp.issubdtype(a.dtype, jnp.floating) else a, params)
        else:
            c, p = (cfg, params) if fmt is None else quantize_params(cfg, params, fmt)
        llm = LLM(model_config=c, params=p, tokenizer=tok, max_num_seqs=args.batch,
                  max_model_len=max(len(x) for x in prompts) + args.max_tokens + 8,
                  speculative_config=SpeculativeConfig("mtp", args.k), compile="lazy",
                  layer_loop="scan")
        if not args.no_timing:
            llm.generate(prompts, sp, use_tqdm=False)    # compiles the buckets it uses
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        dt = time.perf_counter() - t0
        toks = [list(o.outputs[0].token_ids) for o in outs]
        tot = SpecDecodeMetrics(accepted_per_position=[0] * args.k)
        for o in outs:
            tot.merge(o.metrics)
        pb = llm.param_bytes()
        ref = ref or (toks, pb["total"])
        tf = teacher_forced(c, p, prompts, ref[0])
        row = {"format": fmt or "fp32", **agreement(ref[0], toks),
               "teacher_forced": tf[0] / max(tf[1], 1),
               "mean_acceptance_length": tot.mean_acceptance_length,
               "tok_s": None if args.no_timing else sum(len(t) for t in toks) / dt,
               "param_bytes": pb,
               "bytes_vs_fp32": pb["total"] / ref[1]}
        rows.append(row)
        del llm
    print("| weights | identical outputs | common prefix | equal positions | teacher-forced "
          "next token | mean acc. len (K=3) | params MiB (8-bit + scales + rest) | vs fp32 | "
          "tok/s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        b = r["param_bytes"]
        print(f"| {r['format']} | {r['identical']}/{r['of']} | {r['prefix_share']:.1%} | "
              f"{r['position_agreement']:.1%} | {r['teacher_forced']:.2%} | "
              f"{r['mean_acceptance_length']:.2f} | "
              f"{b['total'] / 2**20:.1f} ({b['quantized_values'] / 2**20:.1f} + "
              f"{b['scales'] / 2**20:.2f} + {b['unquantized'] / 2**20:.1f}) | "
              f"{r['bytes_vs_fp32']:.3f} | "
              f"{'-' if r['tok_s'] is None else format(r['tok_s'], '.1f')} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"num_prompts": len(prompts), "max_tokens": args.max_tokens, "rows": rows},
                      f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
