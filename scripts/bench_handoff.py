#!/usr/bin/env python
"""Prefill -> decode hand-off on SmolLM2 (jmtp issue 15): bytes, time and token identity.

For each K, two ``LLM`` instances share the default SmolLM2-135M-Instruct weights and the shipped
MTP head (K drafts, M = K substeps): the prefill instance (``--batch`` slots) and the decode
instance (``--decode-batch`` slots, half the KV blocks). Over the held-out general chat prompts
(the shipped head's evaluation split, chat template) the script runs, greedy and seeded sampled
(temperature 0.8):

* the one-instance reference: ``prefill_llm.generate(prompts)``;
* the hand-off: ``states = prefill_llm.prefill(prompts)``, every state through
  ``to_bytes`` / ``RequestState.from_bytes``, then ``decode_llm.import_request(states)``.

It prints, per K and mode: the serialised bytes per request (mean) and per prompt token, split into
target KV pages, MTP KV pages and the ``EngineState`` row; the export time per request (gathering
the row and pages to host, inside ``prefill``), serialise / deserialise time, the import time per
request (allocating blocks, scattering pages, writing the row: one jitted call), whether every
output is token-identical to the reference, whether the per-position acceptance counts are
identical, and the mean acceptance length. Every jitted shape is warmed up first. Timings on a
shared CPU are indicative only; the bytes and the identities are what carry over.

    python scripts/bench_handoff.py                      # K=1,2,3, 8 prompts, 48 tokens
    python scripts/bench_handoff.py --ks 3 --num-prompts 4 --json /tmp/h.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ks", default="1,2,3", help="comma-separated K values")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--batch", type=int, default=4, help="max_num_seqs of the prefill LLM")
    ap.add_argument("--decode-batch", type=int, default=8, help="max_num_seqs of the decode LLM")
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--json", default=None, help="also write the rows here")
    args = ap.parse_args(argv)
    try:
        args.ks = [int(k) for k in args.ks.split(",")]
    except ValueError:
        ap.error(f"--ks must be comma-separated ints, got {args.ks!r}")
    if any(k < 1 for k in args.ks) or args.num_prompts < 1 or args.max_tokens < 1:
        ap.error("--ks, --num-prompts and --max-tokens must be >= 1")
    return args


def timed(obj, name: str, log: list):
    """Wrap method ``name`` of ``obj`` so each call's wall time is appended to ``log``."""
    orig = getattr(obj, name)

    def wrapper(*a, **kw):
        t0 = time.perf_counter()
        try:
            return orig(*a, **kw)
        finally:
            log.append(time.perf_counter() - t0)
    setattr(obj, name, wrapper)


def main(argv=None) -> int:
    args = parse_args(argv)
    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    from bench_spec import prompt_sets

    from jmtp import LLM, RequestState, SamplingParams, SpeculativeConfig
    from jmtp.model import load_checkpoint, load_tokenizer

    cfg, params = load_checkpoint(None)
    tok = load_tokenizer(None)
    prompts = prompt_sets(tok, ["general"], args.num_prompts)["general"]
    modes = {"greedy": SamplingParams(max_tokens=args.max_tokens),
             "sampled": SamplingParams(max_tokens=args.max_tokens, temperature=0.8, seed=0)}
    rows = []
    print(f"SmolLM2-135M-Instruct + shipped head, {len(prompts)} held-out chat prompts "
          f"({sum(map(len, prompts))} prompt tokens), max_tokens {args.max_tokens}, prefill LLM "
          f"{args.batch} slots, decode LLM {args.decode_batch} slots", flush=True)
    for k in args.ks:
        common = dict(model_config=cfg, params=params, tokenizer=tok, compile="lazy",
                      max_model_len=args.max_model_len,
                      speculative_config=SpeculativeConfig("mtp", k, k))
        a = LLM(max_num_seqs=args.batch, **common)
        pages = a.llm_engine.engine_config.pages_per_seq
        b = LLM(max_num_seqs=args.decode_batch,
                num_blocks=max(args.decode_batch * pages // 2, pages), **common)
        export_t, import_t = [], []
        timed(a.llm_engine, "_export", export_t)
        timed(b.llm_engine, "_admit_import", import_t)
        warm = SamplingParams(max_tokens=k + 2)     # compile the step, gather and import shapes
        a.generate(prompts, warm, use_tqdm=False)
        b.import_request(a.prefill(prompts, warm), use_tqdm=False)
        for mode, sp in modes.items():
            ref = a.generate(prompts, sp, use_tqdm=False)
            export_t.clear(), import_t.clear()
            t0 = time.perf_counter()
            states = a.prefill(prompts, sp)
            prefill_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            blobs = [s.to_bytes() for s in states]
            ser_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            states = [RequestState.from_bytes(x) for x in blobs]
            de_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            outs = b.import_request(states, use_tqdm=False)
            decode_s = time.perf_counter() - t0
            n = len(prompts)
            nb = [s.nbytes() for s in states]
            same = sum(o.token_ids == r.token_ids for o, r in zip(outs, ref))
            same_acc = sum(o.metrics.accepted_per_position == r.metrics.accepted_per_position
                           for o, r in zip(outs, ref))
            steps = sum(o.metrics.num_decode_steps for o in outs)
            toks = sum(o.metrics.num_decode_tokens for o in outs)
            row = dict(
                k=k, mode=mode, requests=n,
                bytes_per_request=sum(map(len, blobs)) / n,
                bytes_per_prompt_token=sum(map(len, blobs)) / sum(map(len, prompts)),
                target_kv=sum(x["target_kv"] for x in nb) / n,
                mtp_kv=sum(x["mtp_kv"] for x in nb) / n, row=sum(x["row"] for x in nb) / n,
                export_ms=1e3 * sum(export_t) / n, serialize_ms=1e3 * ser_s / n,
                deserialize_ms=1e3 * de_s / n, import_ms=1e3 * sum(import_t) / n,
                prefill_s=prefill_s, decode_s=decode_s,
                tokens_identical=same, acceptance_identical=same_acc,
                mean_acceptance_length=toks / steps if steps else 0.0,
                ref_mean_acceptance_length=(sum(r.metrics.num_decode_tokens for r in ref)
                                            / max(sum(r.metrics.num_decode_steps for r in ref), 1)))
            rows.append(row)
            print(json.dumps(row), flush=True)
        del a, b
    print()
    print("| K | mode | bytes/request | bytes/prompt token | target KV | MTP KV | row | export "
          "ms/req | to_bytes ms/req | from_bytes ms/req | import ms/req | tokens identical | "
          "acceptance identical | acc. length |")
    print("|" + "---|" * 14)
    for r in rows:
        print(f"| {r['k']} | {r['mode']} | {r['bytes_per_request'] / 1e6:.2f} MB | "
              f"{r['bytes_per_prompt_token'] / 1e3:.1f} kB | {r['target_kv'] / 1e6:.2f} MB | "
              f"{r['mtp_kv'] / 1e6:.3f} MB | {r['row'] / 1e3:.0f} kB | {r['export_ms']:.1f} | "
              f"{r['serialize_ms']:.1f} | {r['deserialize_ms']:.1f} | {r['import_ms']:.1f} | "
              f"{r['tokens_identical']}/{r['requests']} | {r['acceptance_identical']}/"
              f"{r['requests']} | {r['mean_acceptance_length']:.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    bad = [r for r in rows if r["tokens_identical"] != r["requests"]
           or r["acceptance_identical"] != r["requests"]]
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
