#!/usr/bin/env python
"""Acceptance and speed of MTP speculation on the held-out evaluation prompts (jmtp issue 4).

For every batch size and every K, in one process: plain greedy decoding and MTP speculative
decoding of the same evaluation prompts (the split the shipped head never saw), reporting tokens/s
of both, their ratio, mean acceptance length (tokens per verify step), per-position acceptance, and
whether the outputs are identical. Every configuration is run once untimed first (compilation).

    python scripts/eval_acceptance.py --batches 1,8 --ks 1,2,3,4 --num-prompts 8 --max-tokens 128

Prompts: ``jmtp.train.prompts.load_prompts`` split with ``split_prompts(eval_frac, seed)`` -- by default
the values stored in the head's metadata (those of its training run), else 0.1 and 0.
"""
from __future__ import annotations

import argparse
import json
import platform
import time



def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--mtp-head", default="auto", help="head file, or 'auto' (the shipped head)")
    ap.add_argument("--batches", default="1,8", help="comma-separated max_num_seqs values")
    ap.add_argument("--ks", default="1,2,3,4", help="comma-separated num_speculative_tokens")
    ap.add_argument("--num-prompts", type=int, default=8, help="evaluation prompts used (0 = all)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--draft-vocab-size", type=int, default=None,
                    help="FR-Spec draft vocabulary (default: the head's own; 0 = full)")
    ap.add_argument("--eval-frac", type=float, default=None)
    ap.add_argument("--split-seed", type=int, default=None)
    ap.add_argument("--json", default=None, help="also write the rows to this JSON file")
    args = ap.parse_args(argv)
    args.batches = [int(x) for x in args.batches.split(",")]
    args.ks = [int(x) for x in args.ks.split(",")]
    if min(args.batches) < 1 or min(args.ks) < 1 or args.max_tokens < 1 or args.num_prompts < 0:
        ap.error("--batches, --ks and --max-tokens must be >= 1, --num-prompts >= 0")
    return args


def eval_prompts(tok, meta: dict, args) -> list[list[int]]:
    """Chat-templated token ids of the evaluation split (never trained on)."""
    from jmtp.train.prompts import encode_chat, load_prompts, split_prompts

    frac = args.eval_frac if args.eval_frac is not None else float(meta.get("eval_frac", 0.1))
    seed = args.split_seed if args.split_seed is not None else int(meta.get("split_seed", 0))
    _, held_out = split_prompts(load_prompts(), frac, seed)
    if args.num_prompts:
        held_out = held_out[: args.num_prompts]
    return [encode_chat(tok, p.text) for p in held_out]


def timed(llm, prompts, sp, k: int):
    """Warm-up (compiles the buckets this prompt set uses), then one timed run."""
    from jmtp import SamplingParams

    llm.generate(prompts, SamplingParams(max_tokens=k + 2, temperature=0.0), use_tqdm=False)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    dt = time.perf_counter() - t0
    return outs, dt, llm.last_run_stats["steps"]


def main(argv=None) -> int:
    args = parse_args(argv)
    from jmtp import LLM, SamplingParams, SpeculativeConfig
    from jmtp.model import load_checkpoint, load_tokenizer
    from jmtp.model.checkpoints.loader import shipped_head_path, resolve_checkpoint
    from jmtp.model.checkpoints.mtp_head import head_metadata
    from jmtp.runtime.host.outputs import SpecDecodeMetrics

    head = args.mtp_head if args.mtp_head != "auto" else shipped_head_path(
        resolve_checkpoint(args.model)[0])
    cfg, params = load_checkpoint(args.model, mtp_head=head)
    meta = head_metadata(str(head)) if head is not None else {}
    tok = load_tokenizer(args.model)
    prompts = eval_prompts(tok, meta, args)
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    longest = max(len(p) for p in prompts)
    print(f"# {platform.processor() or platform.machine()} | model {args.model or 'SmolLM2-135M-Instruct'}"
          f" | head {head} (trained steps {meta.get('steps', '?')}) | {len(prompts)} eval prompts, "
          f"greedy, max_tokens {args.max_tokens}")
    rows = []
    print("| batch | K | draft vocab | plain tok/s | spec tok/s | speedup | mean acc. len | "
          "per-position acceptance | identical |")
    print("|---|---|---|---|---|---|---|---|---|")
    for b in args.batches:
        common = dict(model_config=cfg, params=params, tokenizer=tok, max_num_seqs=b,
                      max_model_len=longest + args.max_tokens + 8)
        plain_outs, plain_dt, _ = timed(LLM(**common), prompts, sp, 0)
        n_plain = sum(len(o.token_ids) for o in plain_outs)
        for k in args.ks:
            spec = SpeculativeConfig("mtp", k, draft_vocab_size=args.draft_vocab_size)
            llm = LLM(speculative_config=spec, **common)
            outs, dt, steps = timed(llm, prompts, sp, k)
            n = sum(len(o.token_ids) for o in outs)
            tot = SpecDecodeMetrics(accepted_per_position=[0] * k)
            for o in outs:
                tot.merge(o.metrics)
            per_pos = [c / max(tot.num_decode_steps, 1) for c in tot.accepted_per_position]
            same = all(a.token_ids == c.token_ids for a, c in zip(plain_outs, outs))
            row = {"batch": b, "k": k,
                   "draft_vocab_size": llm.llm_engine.draft_vocab_size or cfg.vocab_size,
                   "plain_tok_s": n_plain / plain_dt, "spec_tok_s": n / dt,
                   "speedup": (n / dt) / (n_plain / plain_dt),
                   "mean_acceptance_length": tot.mean_acceptance_length,
                   "per_position_acceptance": per_pos, "identical": same,
                   "tokens": n, "plain_seconds": plain_dt, "spec_seconds": dt, "spec_steps": steps}
            rows.append(row)
            print(f"| {b} | {k} | {row['draft_vocab_size']} | {row['plain_tok_s']:.1f} | "
                  f"{row['spec_tok_s']:.1f} | {row['speedup']:.2f}x | "
                  f"{row['mean_acceptance_length']:.2f} | "
                  f"{', '.join(f'{x:.2f}' for x in per_pos)} | {'yes' if same else 'NO'} |",
                  flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"head": str(head), "head_metadata": meta, "num_prompts": len(prompts),
                       "max_tokens": args.max_tokens, "rows": rows}, f, indent=2)
    return 0 if all(r["identical"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
