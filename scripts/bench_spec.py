#!/usr/bin/env python
"""Speculation variants against plain decoding, in one process, on two prompt sets (jmtp issue 11).

Variants (``--variants``, comma-separated): ``plain``, ``mtpK`` (MTP, K drafts), ``ngramK``
(prompt-lookup, K drafts, n = 5..1; ``ngramK.N``: n = 5..N), ``hybridK.M`` (M MTP drafts extended by n-gram matches to K),
``dynngramK`` / ``dynmtpK`` / ``dynhybridK.M`` (the same with ``speculation_policy="dynamic"``;
a trailing ``-g``, e.g. ``dynmtp3-g``, turns the policy's guard on the realised rate off:
``DynamicSpeculation.guard_samples = 0``).
Prompt sets: the held-out general chat prompts (the shipped head's evaluation split) and the
copy-heavy set ``jmtp/data/prompts_copy.jsonl``. Greedy, chat template applied.

For each batch size (``--batches``; batch B runs the prompts with ``max_num_seqs=B``, so B
requests are in flight) every variant's engine is built and warmed once (compilation, reported
separately), then the timed runs interleave the variants ``--rounds`` times (A, B, C, A, B, C ...)
and each variant's tokens/s is total tokens / total seconds over its rounds. Printed per row:
tok/s, ratio to plain, mean acceptance length, whether every output equals plain decoding, and
for dynamic variants the share of steps whose limits allowed a draft and how often the guard held
drafting off (each hold is one losing window; see :mod:`jmtp.runtime.spec_policy`).

Engines are built with ``compile="eager"`` (every step bucket compiled at construction, see
:mod:`jmtp.runtime.compile`), so no timed run compiles.

    python scripts/bench_spec.py --batches 1,8 --num-prompts 8 --max-tokens 64
"""
from __future__ import annotations

import argparse
import collections
import json
import platform
import time


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--variants", default="plain,mtp1,mtp2,mtp3,ngram3,ngram4,ngram5,hybrid3.1,"
                                          "dynngram3,dynhybrid3.1")
    ap.add_argument("--sets", default="general,copy", help="prompt sets: general, copy")
    ap.add_argument("--num-prompts", type=int, default=8, help="prompts per set (0 = all)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--layer-loop", default="auto", choices=["auto", "scan", "unrolled"],
                    help="LLM(layer_loop=...) of every engine")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    args.batches = [int(x) for x in args.batches.split(",")]
    args.variants = args.variants.split(",")
    args.sets = args.sets.split(",")
    return args


def spec_for(name: str):
    """SpeculativeConfig of a variant name (None for plain; a ``-g`` suffix, guard off, is set on
    the built engine by :func:`build`)."""
    from jmtp import SpeculativeConfig

    if name.endswith("-g"):
        if not name.startswith("dyn") or name == "dynplain-g":
            raise SystemExit(f"variant {name!r}: '-g' (no guard) needs a dynamic variant (dyn...)")
        name = name[:-2]
    policy = "dynamic" if name.startswith("dyn") else "fixed"
    base = name[3:] if name.startswith("dyn") else name
    if base == "plain":
        return None
    if base.startswith("mtp"):
        return SpeculativeConfig("mtp", int(base[3:]), speculation_policy=policy)
    if base.startswith("ngram"):      # ngramK, or ngramK.N: n-grams of N..5 tokens only
        k, _, n = base[5:].partition(".")
        return SpeculativeConfig("ngram", int(k), min_ngram_size=int(n) if n else None,
                                 speculation_policy=policy)
    if base.startswith("hybrid"):
        k, m = (int(x) for x in base[6:].split("."))
        return SpeculativeConfig("mtp", k, m, mtp_strategy="with_ngram", speculation_policy=policy)
    raise SystemExit(f"unknown variant {name!r}")


def build(name: str, **llm_kwargs):
    """The engine of variant ``name``: ``LLM(speculative_config=spec_for(name), **llm_kwargs)``,
    with the dynamic policy's guard turned off for a ``-g`` variant."""
    from jmtp import LLM

    llm = LLM(speculative_config=spec_for(name), **llm_kwargs)
    if name.endswith("-g"):
        llm.llm_engine.spec_policy.guard_samples = 0
    return llm


def policy_counts(llm) -> dict[str, int] | None:
    """Counters of a dynamic engine's policy from ``LLMEngine.get_stats`` (None for other
    engines): ``steps`` planned, ``drafting`` steps whose limits allowed a draft (probes
    included; an n-gram slot may still find no match), ``holds`` by the guard (losing windows)."""
    stats = llm.llm_engine.get_stats()
    if "spec_policy_plans" not in stats:
        return None
    return dict(steps=stats["spec_policy_plans"], drafting=stats["spec_policy_drafting_plans"],
                holds=stats["spec_policy_holds"])


def prompt_sets(tok, names, n):
    from jmtp.model.loader import resolve_checkpoint, shipped_head_path
    from jmtp.model.mtp_head import head_metadata
    from jmtp.train.prompts import encode_chat, load_prompts, split_prompts
    import importlib.resources
    import json as _json

    out = {}
    if "general" in names:
        meta = head_metadata(str(shipped_head_path(resolve_checkpoint(None)[0])))
        _, held = split_prompts(load_prompts(), float(meta.get("eval_frac", 0.1)),
                                int(meta.get("split_seed", 0)))
        out["general"] = [encode_chat(tok, p.text) for p in held[: n or None]]
    if "copy" in names:
        path = importlib.resources.files("jmtp.data") / "prompts_copy.jsonl"
        rows = [_json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        out["copy"] = [encode_chat(tok, r["prompt"]) for r in rows[: n or None]]
    return out


def warm_up(llm, prompts):
    """A short generation over the prompts (the step buckets are compiled already; this runs each
    code path once and lets a dynamic engine's policy start learning step costs)."""
    from jmtp import SamplingParams

    llm.generate(prompts, SamplingParams(max_tokens=llm.engine_config.k + 2, temperature=0.0),
                 use_tqdm=False)


def main(argv=None) -> int:
    args = parse_args(argv)
    from jmtp import SamplingParams
    from jmtp.model import load_checkpoint, load_tokenizer
    from jmtp.runtime.outputs import SpecDecodeMetrics

    cfg, params = load_checkpoint(None)
    tok = load_tokenizer(None)
    sets = prompt_sets(tok, args.sets, args.num_prompts)
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    longest = max(len(p) for ps in sets.values() for p in ps)
    # rounded up as scripts/bench_peers.py does: the same engine shapes, so the two scripts share
    # their compiled steps through the persistent compilation cache
    max_model_len = -(-(longest + args.max_tokens + 16) // 256) * 256
    print(f"# {platform.machine()} | SmolLM2-135M-Instruct + shipped head | greedy, max_tokens "
          f"{args.max_tokens} | rounds {args.rounds} | layer_loop {args.layer_loop} | "
          + ", ".join(f"{k}: {len(v)} prompts" for k, v in sets.items()), flush=True)
    rows = []
    for b in args.batches:
        engines = {}
        for name in args.variants:
            t0 = time.perf_counter()
            llm = build(name, model_config=cfg, params=params, tokenizer=tok, max_num_seqs=b,
                        max_model_len=max_model_len, compile="eager",
                        layer_loop=args.layer_loop)
            warm_up(llm, [p for ps in sets.values() for p in ps])
            engines[name] = llm
            print(f"# batch {b} {name}: built and warmed in {time.perf_counter() - t0:.1f} s",
                  flush=True)
        for set_name, ps in sets.items():
            acc = {n: dict(sec=0.0, tok=0, outs=None, m=SpecDecodeMetrics(),
                           pol=collections.Counter()) for n in args.variants}
            for _ in range(args.rounds):
                for name in args.variants:          # interleaved
                    before = policy_counts(engines[name])
                    t0 = time.perf_counter()
                    outs = engines[name].generate(ps, sp, use_tqdm=False)
                    acc[name]["sec"] += time.perf_counter() - t0
                    if before is not None:
                        after = policy_counts(engines[name])
                        acc[name]["pol"].update({k: after[k] - before[k] for k in after})
                    acc[name]["tok"] += sum(len(o.token_ids) for o in outs)
                    acc[name]["outs"] = outs
                    for o in outs:
                        acc[name]["m"].merge(o.metrics)
            base = acc["plain"] if "plain" in acc else None
            print(f"\n{set_name} prompts, batch {b}\n\n| variant | tok/s | vs plain | mean acc. len "
                  "| identical | min tokens | drafting steps | guard holds |\n"
                  "|---|---|---|---|---|---|---|---|")
            for name in args.variants:
                a = acc[name]
                rate = a["tok"] / a["sec"]
                ratio = rate / (base["tok"] / base["sec"]) if base else float("nan")
                same = base is None or all(x.token_ids == y.token_ids
                                           for x, y in zip(base["outs"], a["outs"]))
                mal = a["m"].mean_acceptance_length
                mn = min(len(o.token_ids) for o in a["outs"])
                pol = ({key: a["pol"][key] for key in ("steps", "drafting", "holds")}
                       if policy_counts(engines[name]) is not None else None)
                rows.append(dict(batch=b, set=set_name, variant=name, tok_s=rate, ratio=ratio,
                                 mean_acceptance_length=mal, identical=same, min_tokens=mn,
                                 policy=pol))
                share = (f"{pol['drafting']}/{pol['steps']} | {pol['holds']}" if pol is not None
                         else "- | -")
                print(f"| {name} | {rate:.1f} | {ratio:.2f}x | {mal:.2f} | "
                      f"{'yes' if same else 'NO'} | {mn} | {share} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(args=vars(args), rows=rows), f, indent=2)
    return 0 if all(r["identical"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
