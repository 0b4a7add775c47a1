#!/usr/bin/env python
"""Asynchronous scheduling against the synchronous loop, in one process (jmtp issue 50).

Every engine is built and warmed by one untimed run of each loop (``compile="lazy"``: that run
compiles the buckets the loop uses; its time is reported separately); then its timed runs
alternate the loop (``LLMEngine.async_scheduling`` off, on, off, on ...) on the
same engine, ``--rounds`` times each. Per row: tokens/s of each loop and their ratio, whether
every output is identical, and from the engine's step timeline (:mod:`jmtp.runtime.host.timeline`)
the device idle time between consecutive steps as a share of the device's step time
(``device_idle_share``), and the host's time per step.

Rows:

* ``smollm2-mtp3 bN``: SmolLM2-135M-Instruct with its shipped MTP head, K=3, greedy, at batch 1
  and batch 8 (``--batches``): the bubble as a share of step time.
* ``tiny-mtp3 b64``: a tiny random model (SmolLM2's tokenizer, hidden 64, 2 layers, the first
  ``--tiny-vocab`` token ids: 4096 by default) with an untrained MTP head, K=3, 64 requests at
  once with stop strings: host work (detokenising 64 requests, stop strings, outputs) is a large
  share of a step. With SmolLM2's whole vocabulary (``--tiny-vocab 49152``) the step is bound by
  the 49152-wide LM head over 256 rows on this CPU (~90 ms) and the host's work is ~7 % of it
  (docs/async_scheduling.md); the prompts' token ids are taken modulo the vocabulary.
* ``smollm2-dyn-mtp3 b8 stop``: SmolLM2, the dynamic speculation policy, batch 8, stop strings.

The CPU is shared with other processes here: absolute figures are noisy, the interleaved ratios
less so. ``--quick`` runs fewer tokens and prompts (a smoke run).

    PYTHONPATH=. python scripts/bench_async.py --rounds 3 --json async.json
"""
from __future__ import annotations

import argparse
import json
import platform
import time


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="smollm2,tiny,dynamic",
                    help="which rows: smollm2 (batch 1 and 8), tiny (batch 64), dynamic")
    ap.add_argument("--batches", default="1,8", help="batches of the smollm2 rows")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tiny-vocab", type=int, default=4096,
                    help="vocabulary of the tiny row's model (SmolLM2's first ids)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--trace", default=None,
                    help="write a Chrome trace of the last round of each loop to TRACE.<row>.<mode>.json")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    args.rows = args.rows.split(",")
    args.batches = [int(x) for x in args.batches.split(",")]
    if args.quick:
        args.max_tokens, args.rounds = min(args.max_tokens, 24), min(args.rounds, 1)
    return args


def general_prompts(tok, n: int):
    from jmtp.model.checkpoints.loader import resolve_checkpoint, shipped_head_path
    from jmtp.model.checkpoints.mtp_head import head_metadata
    from jmtp.train.prompts import encode_chat, load_prompts, split_prompts

    meta = head_metadata(str(shipped_head_path(resolve_checkpoint(None)[0])))
    _, held = split_prompts(load_prompts(), float(meta.get("eval_frac", 0.1)),
                            int(meta.get("split_seed", 0)))
    prompts = [encode_chat(tok, p.text) for p in held]
    return [prompts[i % len(prompts)] for i in range(n)]


def measure(name: str, llm, prompts, sp, rounds: int, trace: str | None) -> dict:
    """Alternate the two loops on one engine; tokens/s, identical outputs and timeline shares."""
    eng = llm.llm_engine
    acc = {m: dict(sec=0.0, tok=0, outs=None, stats=[]) for m in (False, True)}
    t0 = time.perf_counter()
    for mode in (False, True):     # untimed: compiles the buckets each loop runs (lazy)
        eng.async_scheduling = mode
        llm.generate(prompts, sp, use_tqdm=False)
    print(f"# {name}: warm-up (compiles) {time.perf_counter() - t0:.1f} s, "
          f"{len(eng.compiled_buckets)} buckets", flush=True)
    for r in range(rounds):
        for mode in (False, True):
            eng.async_scheduling = mode
            eng.timeline.clear()
            eng.timeline.enable()
            t0 = time.perf_counter()
            outs = llm.generate(prompts, sp, use_tqdm=False)
            acc[mode]["sec"] += time.perf_counter() - t0
            eng.timeline.disable()
            acc[mode]["tok"] += sum(len(o.token_ids) for o in outs)
            acc[mode]["outs"] = [[c.token_ids for c in o.outputs] for o in outs]
            st = eng.timeline.stats()
            acc[mode]["stats"].append(st)
            if trace and r == rounds - 1:
                eng.timeline.write_chrome_trace(f"{trace}.{name}.{'async' if mode else 'sync'}"
                                                ".json")
    row = dict(row=name)
    for mode, key in ((False, "sync"), (True, "async")):
        a = acc[mode]
        tot = {k: sum(s[k] for s in a["stats"]) for k in a["stats"][0]}
        steps = max(tot["timeline_steps"], 1)
        row[key] = dict(tok_s=a["tok"] / a["sec"], tokens=a["tok"], seconds=a["sec"],
                        idle_share=tot["device_idle_seconds"] / max(tot["device_busy_seconds"],
                                                                   1e-12),
                        device_ms_per_step=1e3 * tot["device_busy_seconds"] / steps,
                        idle_ms_per_step=1e3 * tot["device_idle_seconds"] / steps,
                        host_ms_per_step=1e3 * (tot["host_plan_seconds"]
                                                + tot["host_dispatch_seconds"]
                                                + tot["host_output_seconds"]) / steps,
                        steps=tot["timeline_steps"])
    row["speedup"] = row["async"]["tok_s"] / row["sync"]["tok_s"]
    row["identical"] = acc[False]["outs"] == acc[True]["outs"]
    s, a = row["sync"], row["async"]
    print(f"| {name} | {s['tok_s']:.1f} | {a['tok_s']:.1f} | {row['speedup']:.2f}x | "
          f"{s['idle_share']:.1%} | {a['idle_share']:.1%} | {s['device_ms_per_step']:.1f} / "
          f"{a['device_ms_per_step']:.1f} | {s['host_ms_per_step']:.1f} / "
          f"{a['host_ms_per_step']:.1f} | {'yes' if row['identical'] else 'NO'} |", flush=True)
    return row


def build(label: str, **kw):
    from jmtp import LLM
    t0 = time.perf_counter()
    llm = LLM(compile="lazy", **kw)
    print(f"# {label}: built in {time.perf_counter() - t0:.1f} s", flush=True)
    return llm


def main(argv=None) -> int:
    args = parse_args(argv)
    from jmtp import SamplingParams, SpeculativeConfig
    from jmtp.model import load_checkpoint, load_tokenizer

    cfg, params = load_checkpoint(None)
    tok = load_tokenizer(None)
    n8 = 8 if args.quick else 16
    print(f"# {platform.machine()} | greedy, max_tokens {args.max_tokens} | rounds "
          f"{args.rounds} (sync and async alternating on one engine)", flush=True)
    print("\n| row | sync tok/s | async tok/s | async/sync | sync idle/step | async idle/step "
          "| device ms/step (sync / async) | host ms/step (sync / async) | identical |\n"
          "|---|---|---|---|---|---|---|---|---|", flush=True)
    rows = []
    sp = SamplingParams(max_tokens=args.max_tokens)
    stop_sp = SamplingParams(max_tokens=args.max_tokens, stop=["\n\n", ". The", "!"])
    if "smollm2" in args.rows:
        for b in args.batches:
            prompts = general_prompts(tok, b if b > 1 else 4)
            llm = build(f"smollm2-mtp3 b{b}", model_config=cfg, params=params, tokenizer=tok,
                        speculative_config=SpeculativeConfig("mtp", 3), max_num_seqs=b,
                        max_model_len=512)
            rows.append(measure(f"smollm2-mtp3 b{b}", llm, prompts, sp, args.rounds,
                                args.trace))
            del llm
    if "tiny" in args.rows:
        from jmtp.model import init_params
        tiny = cfg.replace(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                           num_kv_heads=2, head_dim=16, num_mtp_layers=1,
                           vocab_size=args.tiny_vocab, draft_vocab_size=0)
        import jax
        tparams = init_params(tiny, jax.random.key(0), std=0.3)
        prompts = [[t % args.tiny_vocab for t in p] for p in general_prompts(tok, 64)]
        llm = build("tiny-mtp3 b64", model_config=tiny, params=tparams, tokenizer=tok,
                    speculative_config=SpeculativeConfig("mtp", 3, draft_vocab_size=0),
                    max_num_seqs=64,
                    max_model_len=512, layer_loop="scan")
        rows.append(measure(f"tiny-v{args.tiny_vocab}-mtp3 b64 stop", llm, prompts, stop_sp, args.rounds,
                            args.trace))
        del llm
    if "dynamic" in args.rows:
        prompts = general_prompts(tok, n8)
        llm = build("smollm2-dyn-mtp3 b8", model_config=cfg, params=params, tokenizer=tok,
                    speculative_config=SpeculativeConfig("mtp", 3, speculation_policy="dynamic"),
                    max_num_seqs=8, max_model_len=512)
        # every decode bucket ahead (the policy may plan any), then seed its cost table
        from jmtp.runtime.device.buckets import decode_buckets, slot_buckets, StepBucket
        ec = llm.llm_engine.engine_config
        t0 = time.perf_counter()
        llm.llm_engine.compile_buckets([StepBucket(t, a) for a in slot_buckets(ec)
                                        for t in decode_buckets(ec, a)])
        llm.llm_engine.calibrate_speculation()
        print(f"# decode buckets compiled and timed in {time.perf_counter() - t0:.1f} s",
              flush=True)
        rows.append(measure("smollm2-dyn-mtp3 b8 stop", llm, prompts, stop_sp, args.rounds,
                            args.trace))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(args=vars(args), rows=rows), f, indent=2)
    return 0 if all(r["identical"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
