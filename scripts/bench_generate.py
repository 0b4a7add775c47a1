"""Speculative vs plain generation on the same prompts, in one process.

Prints tokens/s with and without MTP speculation, their ratio, mean acceptance length,
per-position acceptance, and the split of the speculative step time between the target side
(forward + verify over the K+1 window) and the MTP proposer. The split is measured by running the
same windows with a drafter that costs nothing (fixed drafts): step time minus that = proposer.

    python scripts/bench_generate.py --batch 1 --num-speculative-tokens 3 --max-tokens 64
"""
from __future__ import annotations

import argparse
import time

import jax.numpy as jnp

from jmtp import LLM, SamplingParams, SpeculativeConfig
from jmtp.model import load_checkpoint, load_tokenizer
from jmtp.runtime.host.outputs import SpecDecodeMetrics

QUESTIONS = [
    "Write a Python function that checks whether a string is a palindrome.",
    "Explain what a hash map is in three sentences.",
    "What is the capital of Japan and what is it famous for?",
    "Give me a recipe for a simple tomato pasta.",
    "Write a short poem about the ocean.",
    "How do I reverse a list in Python?",
    "What are the three states of matter?",
    "Summarize the plot of Romeo and Juliet in two sentences.",
]


def run(llm, prompts, sp):
    llm.generate(prompts, sp, use_tqdm=False)               # warm-up: compile every bucket used
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    dt = time.perf_counter() - t0
    n = sum(len(o.token_ids) for o in outs)
    return outs, n / dt, llm.last_run_stats["steps"], dt


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--num-speculative-tokens", type=int, default=3)
    ap.add_argument("--num-model-steps", type=int, default=None)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--num-prompts", type=int, default=4)
    args = ap.parse_args()
    cfg, params = load_checkpoint(args.model)
    tok = load_tokenizer(args.model)
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]))
               for q in QUESTIONS[: args.num_prompts]]
    sp = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    k = args.num_speculative_tokens
    common = dict(model_config=cfg, params=params, tokenizer=tok, max_num_seqs=args.batch,
                  max_model_len=512, max_num_batched_tokens=max(128, args.batch * (k + 1)))
    plain_outs, plain_tps, plain_steps, plain_dt = run(LLM(**common), prompts, sp)
    spec_cfg = SpeculativeConfig("mtp", k, args.num_model_steps)
    spec_outs, spec_tps, spec_steps, spec_dt = run(LLM(speculative_config=spec_cfg, **common),
                                                   prompts, sp)
    # Same windows, no proposer: drafts that are always rejected cost nothing to produce.
    null = SpeculativeConfig("custom", k, drafter=_null_drafter(k))
    _, _, null_steps, null_dt = run(LLM(speculative_config=null, **common), prompts, sp)
    assert all(a.token_ids == b.token_ids for a, b in zip(plain_outs, spec_outs)), "not lossless!"
    tot = SpecDecodeMetrics(accepted_per_position=[0] * k)
    for o in spec_outs:
        tot.merge(o.metrics)
    step_spec = spec_dt / spec_steps
    step_target = null_dt / null_steps
    print(f"model={cfg.architecture} L={cfg.num_layers} batch={args.batch} K={k} "
          f"M={spec_cfg.m} prompts={len(prompts)} max_tokens={args.max_tokens}")
    print(f"plain:       {plain_tps:8.1f} tok/s  ({plain_steps} steps, {plain_dt / plain_steps * 1e3:.1f} ms/step)")
    print(f"speculative: {spec_tps:8.1f} tok/s  ({spec_steps} steps, {step_spec * 1e3:.1f} ms/step)")
    print(f"speedup (speculative / plain): {spec_tps / plain_tps:.2f}x")
    print(f"mean acceptance length: {tot.mean_acceptance_length:.2f}; per-position acceptance: "
          + ", ".join(f"{c / max(tot.num_decode_steps, 1):.2f}" for c in tot.accepted_per_position))
    print(f"step time split: target forward+verify {step_target * 1e3:.1f} ms "
          f"({step_target / step_spec:.0%}), MTP proposer {(step_spec - step_target) * 1e3:.1f} ms "
          f"({1 - step_target / step_spec:.0%})")


def _null_drafter(k):
    def drafter(state):
        return jnp.zeros((state.stop_flags.shape[0], k), jnp.int32)
    return drafter


if __name__ == "__main__":
    main()
