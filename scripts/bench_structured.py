#!/usr/bin/env python
"""Constrained decoding with and without speculation, in one process (jmtp issue 37).

Engines (SmolLM2-135M-Instruct, greedy, chat template): ``plain`` (no speculation) and ``mtp``
(its MTP head, K=3). Each runs the same prompts, at each batch size, as:

* ``free``: unconstrained, each prompt generating exactly as many tokens as its constrained
  output (``ignore_eos``, ``max_tokens`` = that length), so both cases pay the same prefill and
  decode the same number of tokens and their tok/s compare the step costs;
* ``json``: constrained by a schema of long fixed keys (the structure is mostly forced);
* ``json-nojf``: the same with jump-forward drafts off (``mtp`` only): what masking alone gives;
* ``mixed``: every other prompt constrained, the rest free with the constrained lengths
  (``plain`` only): what constrained requests cost their unconstrained batch mates.

Every engine is built with ``compile="eager"`` (or ``--compile lazy --warmup``: one untimed
round first) and warmed; the timed runs interleave the cases
``--rounds`` times and each case's tok/s is total tokens / total seconds over its rounds. Printed
per row: tok/s, ratio to the same engine's ``free`` run and to ``plain`` with the same constraint,
mean acceptance length (tokens per decode step), forced drafts, host seconds spent on bitmasks
per step, and whether every JSON output validates and greedy outputs equal ``plain``'s.

    python scripts/bench_structured.py --batches 1,8 --num-prompts 8 --max-tokens 160
"""
from __future__ import annotations

import argparse
import json
import time

SCHEMA = {
    "type": "object", "additionalProperties": False,
    "required": ["customer_identification_number", "customer_full_legal_name",
                 "customer_shipping_address_line", "customer_preferred_contact_method",
                 "customer_loyalty_program_membership", "customer_account_creation_year"],
    "properties": {
        "customer_identification_number": {"type": "integer", "minimum": 1, "maximum": 99999},
        "customer_full_legal_name": {"type": "string", "maxLength": 24},
        "customer_shipping_address_line": {"type": "string", "maxLength": 32},
        "customer_preferred_contact_method": {"type": "string",
                                              "enum": ["electronic_mail", "telephone_call",
                                                       "postal_letter"]},
        "customer_loyalty_program_membership": {"type": "boolean"},
        "customer_account_creation_year": {"type": "integer", "minimum": 1990, "maximum": 2026},
    }}
PROMPTS = ["Create a customer record for a bakery owner in Lyon.",
           "Create a customer record for a retired teacher.",
           "Create a customer record for a student in Boston.",
           "Create a customer record for a software engineer.",
           "Create a customer record for a farmer in Kenya.",
           "Create a customer record for a nurse in Madrid.",
           "Create a customer record for a musician.",
           "Create a customer record for a small hotel."]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", default=None, help="write the rows here")
    ap.add_argument("--compile", default="eager", choices=["eager", "lazy"],
                    help="lazy: compile on first use (then --warmup keeps compiles out of the "
                         "timed rounds)")
    ap.add_argument("--warmup", action="store_true",
                    help="run every case once, untimed, before the timed rounds")
    args = ap.parse_args(argv)
    args.batches = [int(x) for x in args.batches.split(",")]
    return args


def main(argv=None):
    args = parse_args(argv)
    import jsonschema

    from jmtp import LLM, SamplingParams, SpeculativeConfig
    from jmtp.runtime.host.structured import StructuredOutputsParams

    prompts = (PROMPTS * 4)[:args.num_prompts]
    constrained = SamplingParams(max_tokens=args.max_tokens,
                                 structured_outputs=StructuredOutputsParams(json=SCHEMA))
    rows = []
    for batch in args.batches:
        engines, compile_s = {}, {}
        for name, spec in (("plain", None), ("mtp", SpeculativeConfig("mtp", 3, 3))):
            t0 = time.perf_counter()
            llm = LLM(speculative_config=spec, max_num_seqs=batch, max_model_len=1024,
                      compile=args.compile)
            llm.chat([[{"role": "user", "content": prompts[0]}]], constrained, use_tqdm=False)
            engines[name], compile_s[name] = llm, time.perf_counter() - t0
        cases = [("plain", "json"), ("plain", "free"), ("plain", "mixed"), ("mtp", "json"),
                 ("mtp", "free"), ("mtp", "json-nojf")]
        lengths = None
        acc = {c: dict(tokens=0, seconds=0.0, steps=0, dtokens=0, forced=0, host=0.0,
                       csteps=0, valid=True, texts=None) for c in cases}
        msgs = [[{"role": "user", "content": p}] for p in prompts]
        for rnd in range(-1 if args.warmup else 0, args.rounds):
            for case in cases:
                name, kind = case
                llm = engines[name]
                eng = llm.llm_engine
                eng.requests.structured.jump_forward = kind != "json-nojf"
                sp = ([SamplingParams(max_tokens=n, ignore_eos=True) for n in lengths]
                      if kind in ("free", "mixed") else constrained)
                if kind == "mixed":
                    sp = [constrained if i % 2 == 0 else x for i, x in enumerate(sp)]
                before = eng.get_stats()
                t = time.perf_counter()
                outs = llm.chat(msgs, sp, use_tqdm=False)
                secs = time.perf_counter() - t
                after = eng.get_stats()
                if case == ("plain", "json") and lengths is None:
                    lengths = [len(o.outputs[0].token_ids) for o in outs]
                if rnd < 0:          # the warm-up round compiles; nothing is counted
                    continue
                a = acc[case]
                a["seconds"] += secs
                a["tokens"] += sum(len(o.outputs[0].token_ids) for o in outs)
                for key, stat in (("steps", "num_decode_steps"), ("dtokens", "num_decode_tokens"),
                                  ("forced", "structured_forced_drafts"),
                                  ("host", "structured_host_seconds"),
                                  ("csteps", "structured_constrained_steps")):
                    a[key] += after[stat] - before[stat]
                a["texts"] = [o.outputs[0].text for o in outs]
                if kind != "free":
                    for o in (outs if kind != "mixed" else outs[::2]):
                        try:
                            jsonschema.validate(json.loads(o.outputs[0].text), SCHEMA)
                        except (json.JSONDecodeError, jsonschema.ValidationError):
                            a["valid"] = False
        tps = {c: a["tokens"] / a["seconds"] for c, a in acc.items()}
        print(f"\nbatch {batch}: {len(prompts)} prompts, max_tokens {args.max_tokens}, "
              f"{args.rounds} rounds; compile+warm: " +
              ", ".join(f"{k} {v:.0f} s" for k, v in compile_s.items()))
        print(f"{'engine':6s} {'case':10s} {'tok/s':>7s} {'vs free':>8s} {'vs plain':>8s} "
              f"{'acc.len':>7s} {'forced':>6s} {'mask ms/step':>12s} valid  =plain")
        for case, a in acc.items():
            name, kind = case
            ref = "free" if kind in ("free", "mixed") else "json"
            base = acc[("plain", ref)]
            row = dict(batch=batch, engine=name, case=kind, tok_s=tps[case],
                       vs_free=tps[case] / tps[(name, "free")],
                       vs_plain=tps[case] / tps[("plain", ref)],
                       acceptance_length=a["dtokens"] / max(a["steps"], 1),
                       forced=a["forced"] / args.rounds,
                       mask_ms_per_step=1e3 * a["host"] / max(a["csteps"], 1),
                       valid=a["valid"] if kind != "free" else None,
                       equal_plain=(a["texts"] == base["texts"] if kind != "mixed" else
                                    a["texts"][1::2] == base["texts"][1::2]))
            rows.append(row)
            print(f"{name:6s} {kind:10s} {row['tok_s']:7.1f} {row['vs_free']:8.3f} "
                  f"{row['vs_plain']:8.3f} {row['acceptance_length']:7.2f} {row['forced']:6.0f} "
                  f"{row['mask_ms_per_step']:12.2f} {str(row['valid']):5s}  {row['equal_plain']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
