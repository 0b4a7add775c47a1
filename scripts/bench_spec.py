#!/usr/bin/env python
"""Speculation variants against plain decoding, in one process, on three prompt sets (jmtp
issues 11 and 48).

Variants (``--variants``, comma-separated): ``plain``, ``mtpK`` (MTP, K drafts), ``ngramK``
(prompt-lookup, K drafts, n = 5..1; ``ngramK.N``: n = 5..N), ``hybridK.M`` (M MTP drafts extended by n-gram matches to K),
``dynngramK`` / ``dynmtpK`` / ``dynhybridK.M`` (the same with ``speculation_policy="dynamic"``;
a trailing ``-g``, e.g. ``dynmtp3-g``, turns the policy's guard on the realised rate off:
``DynamicSpeculation.guard_samples = 0``), ``suffixK`` (suffix decoding, up to K drafts),
``mtpsuffixK.M`` (suffix decoding with M MTP drafts where the suffix match is weak:
``mtp_strategy="with_suffix"``).
Prompt sets (``--sets``): the held-out general chat prompts (the shipped head's evaluation
split), the copy-heavy set ``jmtp/data/prompts_copy.jsonl`` and the agentic sessions
``scripts/data/agentic_sessions.json`` (tool calls and code-edit loops, multi-turn: each turn's
prompt holds the model's earlier replies; run by ``scripts/agentic_workload.py`` as an agent
fleet). Greedy, chat template applied. Suffix decoding's global tree is emptied before every
timed pass (and after the warm-up), so each pass drafts only from what it served itself.

For each batch size (``--batches``; batch B runs the prompts with ``max_num_seqs=B``, so B
requests are in flight) every variant's engine is built and warmed once (compilation, reported
separately), then the timed runs interleave the variants ``--rounds`` times (A, B, C, A, B, C ...)
and each variant's tokens/s is total tokens / total seconds over its rounds. Printed per row:
tok/s, ratio to plain, mean acceptance length, whether every output equals plain decoding (without
``plain`` among the variants: the first variant's outputs), and
for dynamic variants the share of steps whose limits allowed a draft and how often the guard held
drafting off (each hold is one losing window; see :mod:`jmtp.runtime.host.spec_policy`); for suffix
variants the host time in the suffix trees per step and its share of the wall time.

Engines are built with ``compile="eager"`` (every step bucket compiled at construction, see
:mod:`jmtp.runtime.process.compile`), so no timed run compiles.

    python scripts/bench_spec.py --batches 1,8 --num-prompts 8 --max-tokens 64
    python scripts/bench_spec.py --batches 1,8 --sets general,agentic \
        --variants plain,ngram7.2,suffix7,mtpsuffix7.1 --num-prompts 20 --max-tokens 96
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
    ap.add_argument("--sets", default="general,copy",
                    help="prompt sets: general, copy, agentic")
    ap.add_argument("--num-prompts", type=int, default=8, help="prompts per set (0 = all)")
    ap.add_argument("--sessions", type=int, default=0,
                    help="agentic sessions of each kind (0 = all: 6 tool, 4 code)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--layer-loop", default="auto", choices=["auto", "scan", "unrolled"],
                    help="LLM(layer_loop=...) of every engine")
    ap.add_argument("--enable-prefix-caching", action="store_true",
                    help="every engine caches prompt prefixes (as agent servers do: a session's "
                         "next turn then prefills only what is new)")
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
    if base.startswith("mtp") and not base.startswith("mtpsuffix"):
        return SpeculativeConfig("mtp", int(base[3:]), speculation_policy=policy)
    if base.startswith("ngram"):      # ngramK, or ngramK.N: n-grams of N..5 tokens only
        k, _, n = base[5:].partition(".")
        return SpeculativeConfig("ngram", int(k), min_ngram_size=int(n) if n else None,
                                 speculation_policy=policy)
    if base.startswith("hybrid"):
        k, m = (int(x) for x in base[6:].split("."))
        return SpeculativeConfig("mtp", k, m, mtp_strategy="with_ngram", speculation_policy=policy)
    if base.startswith("suffix"):
        return SpeculativeConfig("suffix", int(base[6:]), speculation_policy=policy)
    if base.startswith("mtpsuffix"):
        k, m = (int(x) for x in base[9:].split("."))
        return SpeculativeConfig("mtp", k, m, mtp_strategy="with_suffix",
                                 speculation_policy=policy)
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


def suffix_counters(llm) -> dict[str, float] | None:
    """A suffix engine's host seconds in its trees and step count (None for other engines)."""
    stats = llm.llm_engine.get_stats()
    if "suffix_host_seconds" not in stats:
        return None
    return dict(host=stats["suffix_host_seconds"], steps=stats["num_steps"])


def empty_suffix_cache(llm) -> None:
    """Forget the outputs a suffix engine's global tree holds (no-op for other engines)."""
    if llm.llm_engine.suffix is not None:
        llm.llm_engine.suffix.cache.clear()


def prompt_sets(tok, names, n):
    from jmtp.model.checkpoints.loader import resolve_checkpoint, shipped_head_path
    from jmtp.model.checkpoints.mtp_head import head_metadata
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
    unknown = set(names) - {"general", "copy", "agentic"}
    if unknown:
        raise SystemExit(f"unknown prompt sets {sorted(unknown)}")
    return out


def warm_up(llm, prompts):
    """A short generation over the prompts (the step buckets are compiled already; this runs each
    code path once and lets a dynamic engine's policy start learning step costs)."""
    from jmtp import SamplingParams

    k = llm.llm_engine.engine_config.k
    llm.generate(prompts, SamplingParams(max_tokens=k + 2, temperature=0.0),
                 use_tqdm=False)


def main(argv=None) -> int:
    args = parse_args(argv)
    from jmtp import SamplingParams
    from jmtp.model import load_checkpoint, load_tokenizer
    from jmtp.runtime.host.outputs import SpecDecodeMetrics

    cfg, params = load_checkpoint(None)
    tok = load_tokenizer(None)
    sets = prompt_sets(tok, args.sets, args.num_prompts)
    sessions = warm_prompts = None
    if "agentic" in args.sets:
        import agentic_workload as aw
        sessions = aw.load_sessions(args.sessions)
        warm_prompts = aw.first_prompts(tok, sessions)
        sets["agentic"] = sessions      # run as sessions, not as prompts
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    longest = max([len(p) for k, ps in sets.items() if k != "agentic" for p in ps] + [0])
    # rounded up as scripts/bench_peers.py does: the same engine shapes, so the two scripts share
    # their compiled steps through the persistent compilation cache; the agentic sessions'
    # conversations grow turn by turn, up to a bound
    longest = max(longest + args.max_tokens + 16, 0 if sessions is None else
                  aw.max_conversation_tokens(tok, sessions, args.max_tokens))
    max_model_len = -(-longest // 256) * 256
    print(f"# {platform.machine()} | SmolLM2-135M-Instruct + shipped head | greedy, max_tokens "
          f"{args.max_tokens} | rounds {args.rounds} | layer_loop {args.layer_loop} | prefix "
          f"caching {'on' if args.enable_prefix_caching else 'off'} | "
          + ", ".join(f"{k}: {len(v)} {'sessions' if k == 'agentic' else 'prompts'}"
                      for k, v in sets.items()), flush=True)
    rows = []
    for b in args.batches:
        engines = {}
        for name in args.variants:
            t0 = time.perf_counter()
            llm = build(name, model_config=cfg, params=params, tokenizer=tok, max_num_seqs=b,
                        max_model_len=max_model_len, compile="eager",
                        layer_loop=args.layer_loop,
                        enable_prefix_caching=args.enable_prefix_caching)
            warm_up(llm, [p for k, ps in sets.items() if k != "agentic" for p in ps]
                    + (warm_prompts or []))
            empty_suffix_cache(llm)
            engines[name] = llm
            print(f"# batch {b} {name}: built and warmed in {time.perf_counter() - t0:.1f} s",
                  flush=True)
        for set_name, ps in sets.items():
            acc = {n: dict(sec=0.0, tok=0, outs=None, m=SpecDecodeMetrics(),
                           pol=collections.Counter(), sfx=collections.Counter())
                   for n in args.variants}
            for _ in range(args.rounds):
                for name in args.variants:          # interleaved
                    llm = engines[name]
                    empty_suffix_cache(llm)
                    before, sfx0 = policy_counts(llm), suffix_counters(llm)
                    t0 = time.perf_counter()
                    if set_name == "agentic":
                        done = aw.run_sessions(llm, ps, sp)
                        outs = [done[k] for k in sorted(done)]
                    else:
                        outs = llm.generate(ps, sp, use_tqdm=False)
                    acc[name]["sec"] += time.perf_counter() - t0
                    if before is not None:
                        after = policy_counts(llm)
                        acc[name]["pol"].update({k: after[k] - before[k] for k in after})
                    if sfx0 is not None:
                        sfx1 = suffix_counters(llm)
                        acc[name]["sfx"].update({k: sfx1[k] - sfx0[k] for k in sfx1})
                    acc[name]["tok"] += sum(len(o.token_ids) for o in outs)
                    acc[name]["outs"] = outs
                    for o in outs:
                        acc[name]["m"].merge(o.metrics)
            base = acc["plain"] if "plain" in acc else None
            print(f"\n{set_name} prompts, batch {b}\n\n| variant | tok/s | vs plain | mean acc. len "
                  "| identical | min tokens | drafting steps | guard holds | suffix host "
                  "ms/step (share) |\n|---|---|---|---|---|---|---|---|---|")
            for name in args.variants:
                a = acc[name]
                rate = a["tok"] / a["sec"]
                ratio = rate / (base["tok"] / base["sec"]) if base else float("nan")
                ref = base or acc[args.variants[0]]   # without plain: the first variant's
                same = all(x.token_ids == y.token_ids for x, y in zip(ref["outs"], a["outs"]))
                mal = a["m"].mean_acceptance_length
                mn = min(len(o.token_ids) for o in a["outs"])
                pol = ({key: a["pol"][key] for key in ("steps", "drafting", "holds")}
                       if policy_counts(engines[name]) is not None else None)
                rows.append(dict(batch=b, set=set_name, variant=name, tok_s=rate, ratio=ratio,
                                 mean_acceptance_length=mal, identical=same, min_tokens=mn,
                                 policy=pol))
                share = (f"{pol['drafting']}/{pol['steps']} | {pol['holds']}" if pol is not None
                         else "- | -")
                sfx = a["sfx"]
                host = (f"{1e3 * sfx['host'] / max(sfx['steps'], 1):.2f} "
                        f"({100 * sfx['host'] / a['sec']:.1f} %)" if sfx else "-")
                rows[-1]["suffix_host_seconds"] = sfx.get("host") if sfx else None
                rows[-1]["num_steps"] = sfx.get("steps") if sfx else None
                print(f"| {name} | {rate:.1f} | {ratio:.2f}x | {mal:.2f} | "
                      f"{'yes' if same else 'NO'} | {mn} | {share} | {host} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(args=vars(args), rows=rows), f, indent=2)
    return 0 if all(r["identical"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
