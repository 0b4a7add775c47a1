"""Cost follows the scheduled work: one request on a wide engine vs a one-slot engine, and batch-1
decoding at a long vs a short max_model_len, measured in one process, interleaved (A, B, A, B ...).

Prints, per configuration, the median tok/s of each engine over the rounds and their ratio (the
issue's target: one request on ``max_num_seqs=8`` >= 0.9x its speed on ``max_num_seqs=1``), the
number of compiled step variants and the wall time of each warm-up (compilation included). With
``--compile-all`` it also compiles every static bucket of ``step_buckets`` ahead of time for the
speculative 8-slot engine and prints each one's compile time.

    python scripts/bench_slots.py --max-tokens 64 --rounds 3
"""
from __future__ import annotations

import argparse
import statistics
import time

import jax

from jmtp import LLM, SamplingParams, SpeculativeConfig
from jmtp.model import load_checkpoint, load_tokenizer
from jmtp.runtime.device.buckets import step_buckets

PROMPT = "Explain what a hash map is and when to use one, in a few sentences."


def timed(llm, prompt, sp):
    t0 = time.perf_counter()
    out = llm.generate([prompt], sp, use_tqdm=False)[0]
    return out, len(out.token_ids) / (time.perf_counter() - t0)


def compare(name, engines, prompt, sp, rounds):
    """Warm every engine, then ``rounds`` interleaved timed runs; returns the median tok/s."""
    tps = {k: [] for k in engines}
    outs = {}
    for k, llm in engines.items():
        # The jit cache of engine_step is shared by all engines of the process: count the delta.
        n0, t0 = llm.llm_engine.runner.jitted_step._cache_size(), time.perf_counter()
        outs[k], _ = timed(llm, prompt, sp)
        print(f"  [{name}] {k}: warm-up {time.perf_counter() - t0:6.1f} s "
              f"({llm.llm_engine.runner.jitted_step._cache_size() - n0} step variants compiled)", flush=True)
    ref = next(iter(outs.values())).token_ids
    assert all(o.token_ids == ref for o in outs.values()), f"{name}: outputs differ!"
    for _ in range(rounds):
        for k, llm in engines.items():
            out, v = timed(llm, prompt, sp)
            assert out.token_ids == ref
            tps[k].append(v)
    med = {k: statistics.median(v) for k, v in tps.items()}
    a, b = list(engines)
    print(f"{name}: " + ", ".join(f"{k} {med[k]:6.1f} tok/s" for k in engines)
          + f"  ratio {a}/{b} = {med[a] / med[b]:.2f}x", flush=True)
    return med


def compile_all(llm):
    """AOT-compile every bucket of ``step_buckets`` and print each compile time."""
    ec = llm.llm_engine.engine_config
    total = 0.0
    for bucket in step_buckets(ec):
        t0 = time.perf_counter()
        runner = llm.llm_engine.runner
        runner.jitted_step.lower(*runner.step_args(bucket)).compile()
        dt = time.perf_counter() - t0
        total += dt
        print(f"  compile T={bucket.num_tokens:4d} A={bucket.num_slots}: {dt:5.1f} s", flush=True)
    print(f"  {len(step_buckets(ec))} buckets, {total:.1f} s in all")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--num-speculative-tokens", type=int, default=3)
    ap.add_argument("--skip", default="", help="comma list of parts to skip: plain,mtp,kvlen")
    ap.add_argument("--compile-all", action="store_true")
    args = ap.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    cfg, params = load_checkpoint(args.model)
    tok = load_tokenizer(args.model)
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": PROMPT}]))
    sp = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    k = args.num_speculative_tokens
    common = dict(model_config=cfg, params=params, tokenizer=tok)
    print(f"backend={jax.default_backend()} prompt={len(prompt)} tokens, max_tokens="
          f"{args.max_tokens}, greedy, rounds={args.rounds} (interleaved)")
    if "plain" not in skip:
        compare("plain, one request", {
            "B=8": LLM(max_num_seqs=8, max_model_len=256, **common),
            "B=1": LLM(max_num_seqs=1, max_model_len=256, **common)}, prompt, sp, args.rounds)
    if "mtp" not in skip:
        spec = SpeculativeConfig("mtp", k)
        wide = LLM(max_num_seqs=8, max_model_len=256, speculative_config=spec, **common)
        compare(f"MTP K={k}, one request", {
            "B=8": wide,
            "B=1": LLM(max_num_seqs=1, max_model_len=256, speculative_config=spec, **common)},
            prompt, sp, args.rounds)
        if args.compile_all:
            compile_all(wide)
    if "kvlen" not in skip:
        compare("plain batch-1, kv length", {
            "Lmax=2048": LLM(max_num_seqs=1, max_model_len=2048, **common),
            "Lmax=256": LLM(max_num_seqs=1, max_model_len=256, **common)}, prompt, sp,
            args.rounds)


if __name__ == "__main__":
    main()
