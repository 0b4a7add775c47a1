#!/usr/bin/env python
"""Prefix caching on SmolLM2 (jmtp issue 15): time to first token on a repeated ~1k-token prefix,
hit rate, and greedy outputs / acceptance with the cache on and off.

Workload: one long system message (instruction prompts of ``jmtp/data/prompts_instruct.jsonl``
joined into a ~``--prefix-tokens``-token "reference document"), then chats with distinct user
questions (chat template). For plain decoding and MTP K=``--k`` (the shipped head), with
``enable_prefix_caching`` off and on, one engine each (``max_num_seqs=1``, so every request runs
alone and its time to first token is its own prefill):

0. every step bucket is compiled ahead (``compile="eager"``; the persistent compilation cache
   makes a second run of the script start faster), so no timed step compiles;
1. warm-up: ``--warmup`` chats (untimed; with the cache on, they fill it with the system
   prefix);
2. timed: ``--questions`` other chats, each ``--turns`` turns (turn t+1 = the turn-t messages, the
   model's reply and a follow-up question). **TTFT** = wall time from ``add_request`` to the step
   that returns the request's first token; the median over the timed first turns is reported
   (later turns too, apart).

Printed: TTFT off / on and the ratio (off ÷ on), the hit rate (cached prompt tokens / prompt
tokens, ``get_stats()["prefix_cache_hit_rate"]``) over the timed chats, the mean acceptance
length (MTP) on / off, and whether every greedy output is identical on / off. Timings on a shared
CPU are noisy: the ratio is the figure to read.

    python scripts/bench_prefix.py                       # 1k prefix, 4 chats x 2 turns, K=3
    python scripts/bench_prefix.py --questions 2 --max-tokens 8 --out /tmp/prefix.md
"""
from __future__ import annotations

import argparse
import datetime
import importlib.resources
import json
import os
import platform
import statistics
import time


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefix-tokens", type=int, default=1000, help="system prefix length (~)")
    ap.add_argument("--questions", type=int, default=4, help="timed chats")
    ap.add_argument("--warmup", type=int, default=2, help="untimed chats first")
    ap.add_argument("--turns", type=int, default=2, help="turns per timed chat")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--k", type=int, default=3, help="MTP drafts K (0: plain only)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--out", default=None, help="also write the markdown table here")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    for name in ("prefix_tokens", "questions", "turns", "max_tokens"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.warmup < 1:
        ap.error("--warmup must be >= 1 (the timed chats need compiled buckets)")
    return args


def instruct_prompts() -> list[str]:
    path = importlib.resources.files("jmtp.data") / "prompts_instruct.jsonl"
    return [json.loads(line)["prompt"] for line in path.read_text().splitlines() if line.strip()]


def system_prefix(tok, texts: list[str], n_tokens: int) -> str:
    """A system message of about ``n_tokens`` tokens built from ``texts``."""
    parts, doc = [], ""
    for i, t in enumerate(texts * 8):
        parts.append(f"{i + 1}. {t}")
        doc = "Reference list of tasks users have asked about:\n" + "\n".join(parts)
        if len(tok.encode(doc)) >= n_tokens:
            break
    return doc


def run_chat(engine, tok, system: str, question: str, follow_ups: list[str], sp,
             rid: str) -> tuple[list[list[int]], list[float], int]:
    """One chat, turn by turn, alone in the engine. Returns (outputs, TTFT per turn, prompt
    tokens)."""
    msgs = [{"role": "system", "content": system}]
    outs, ttfts, n_prompt = [], [], 0
    for t, q in enumerate([question] + follow_ups):
        msgs.append({"role": "user", "content": q})
        ids = tok.encode(tok.apply_chat_template(msgs, add_generation_prompt=True))
        n_prompt += len(ids)
        t0 = time.perf_counter()
        engine.add_request(f"{rid}-{t}", ids, sp)
        first = None
        while engine.has_unfinished_requests():
            for o in engine.step():
                if first is None and o.outputs[0].token_ids:
                    first = time.perf_counter() - t0
                if o.finished:
                    out = o.outputs[0]
        ttfts.append(first)
        outs.append(list(out.token_ids))
        msgs.append({"role": "assistant", "content": out.text})
    return outs, ttfts, n_prompt


def main(argv=None) -> int:
    args = parse_args(argv)
    from jmtp import LLM, SamplingParams, SpeculativeConfig
    from jmtp.model import load_checkpoint, load_tokenizer

    cfg, params = load_checkpoint(None)
    tok = load_tokenizer(None)
    texts = instruct_prompts()
    system = system_prefix(tok, texts[40:], args.prefix_tokens)
    qs = texts[: args.warmup + args.questions]
    follow = ["Now say it again in one short sentence.", "Give one more example.",
              "Thank you. Anything else?"]
    follow_ups = (follow * args.turns)[: args.turns - 1]
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    n_sys = len(tok.encode(tok.apply_chat_template([{"role": "system", "content": system}],
                                                   add_generation_prompt=False)))
    max_len = n_sys + 128 + args.turns * (args.max_tokens + 64)
    head = (f"{platform.machine()}, {os.cpu_count()} CPUs | SmolLM2-135M-Instruct (Q4_1 GGUF, f32) "
            f"+ shipped MTP head | system prefix {n_sys} tokens, block size {args.block_size}, "
            f"{args.warmup} warm-up + {args.questions} timed chats x {args.turns} turns, greedy, "
            f"max_tokens {args.max_tokens}, max_num_seqs 1")
    print("# " + head, flush=True)

    runs = {}
    for k in ([0, args.k] if args.k else [0]):
        for caching in (False, True):
            t0 = time.perf_counter()
            llm = LLM(model_config=cfg, params=params, tokenizer=tok, max_num_seqs=1,
                      max_model_len=max_len, block_size=args.block_size, compile="eager",
                      speculative_config=SpeculativeConfig("mtp", k) if k else None,
                      enable_prefix_caching=caching)
            eng = llm.llm_engine
            for i in range(args.warmup):
                run_chat(eng, tok, system, qs[i], follow_ups, sp, f"w{i}")
            before = eng.get_stats()
            outs, first, later = [], [], []
            for i in range(args.warmup, args.warmup + args.questions):
                o, tt, _ = run_chat(eng, tok, system, qs[i], follow_ups, sp, f"q{i}")
                outs.append(o)
                first.append(tt[0])
                later += tt[1:]
            st = eng.get_stats()
            hit = (None if not caching else
                   (st["prefix_cache_hit_tokens"] - before["prefix_cache_hit_tokens"])
                   / max(st["prefix_cache_queried_tokens"] - before["prefix_cache_queried_tokens"], 1))
            drafts = st["num_draft_tokens"] - before["num_draft_tokens"]
            steps = st["num_decode_steps"] - before["num_decode_steps"]
            toks = st["num_decode_tokens"] - before["num_decode_tokens"]
            runs[k, caching] = dict(
                outs=outs, ttft_first=statistics.median(first),
                ttft_later=statistics.median(later) if later else None, hit_rate=hit,
                acceptance_length=(toks / steps) if (k and steps) else None,
                accepted=st["num_accepted_tokens"] - before["num_accepted_tokens"], drafts=drafts,
                seconds=time.perf_counter() - t0)
            r = runs[k, caching]
            print(f"# K={k} caching={'on' if caching else 'off'}: TTFT first turn "
                  f"{r['ttft_first'] * 1e3:.1f} ms, later turns "
                  f"{(r['ttft_later'] or 0) * 1e3:.1f} ms, hit rate {hit}, acceptance length "
                  f"{r['acceptance_length']}, {r['seconds']:.1f} s", flush=True)
            del llm, eng

    lines = [f"Measured {datetime.date.today()} ({head}); `python scripts/bench_prefix.py "
             f"--prefix-tokens {args.prefix_tokens} --questions {args.questions} --warmup "
             f"{args.warmup} --turns {args.turns} --max-tokens {args.max_tokens} --k {args.k}`:",
             "",
             "| decoding | TTFT off (ms) | TTFT on (ms) | TTFT off ÷ on | later turns off / on (ms) "
             "| hit rate (timed chats) | mean acceptance length off / on | greedy outputs identical |",
             "|---|---|---|---|---|---|---|---|"]
    summary = {}
    for k in sorted({k for k, _ in runs}):
        off, on = runs[k, False], runs[k, True]
        ratio = off["ttft_first"] / on["ttft_first"]
        same = off["outs"] == on["outs"]
        later = ("n/a" if off["ttft_later"] is None else
                 f"{off['ttft_later'] * 1e3:.0f} / {on['ttft_later'] * 1e3:.0f}")
        acc = ("n/a" if not k else
               f"{off['acceptance_length']:.3f} / {on['acceptance_length']:.3f}")
        name = "plain" if not k else f"MTP K={k}"
        lines.append(f"| {name} | {off['ttft_first'] * 1e3:.0f} | {on['ttft_first'] * 1e3:.0f} | "
                     f"**{ratio:.1f}×** | {later} | {on['hit_rate'] * 100:.1f} % | {acc} | "
                     f"{'yes' if same else 'NO'} |")
        summary[name] = dict(ttft_off_s=off["ttft_first"], ttft_on_s=on["ttft_first"],
                             ratio=ratio, hit_rate=on["hit_rate"], identical=same,
                             acceptance_off=off["acceptance_length"],
                             acceptance_on=on["acceptance_length"],
                             accepted_off=off["accepted"], accepted_on=on["accepted"])
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
