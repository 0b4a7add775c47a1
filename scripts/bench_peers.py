#!/usr/bin/env python
"""jmtp against its peers on the same prompts, on one machine, in one run (jmtp issue 11, item 6).

Systems (greedy, chat template applied, the same prompt token ids for all):

* HF transformers greedy (fp32, the same GGUF dequantized by transformers' own ``gguf_file=``
  loader) and HF prompt-lookup decoding (``prompt_lookup_num_tokens``), batch 1;
* llama.cpp through llama-cpp-python (its native kernels on the GGUF's own Q4_1 weights), batch 1;
* jmtp plain / MTP (the shipped head) / n-gram / hybrid MTP+n-gram, at batch 1 and 8 (engines with
  ``max_num_seqs`` 1 and 8 given all prompts at once).

Every system is built and warmed first: jmtp compiles all its buckets at ``LLM(...)`` (reported in
the "compile s" column) and every system runs a short untimed pass over the same prompts. Then
``--rounds`` timed rounds, each running every system once, one after the other (interleaved, so a
VM's drift in speed over the run hits all systems alike): tok/s = generated tokens / wall seconds
over all rounds. All systems stay loaded together (about 6 GB for SmolLM2 with the defaults). Every jmtp output is checked identical to jmtp
plain at the same batch size; peers' outputs are compared with jmtp plain for information (fp32
kernels differ in rounding, llama.cpp quantizes activations). A peer that is not installed, or a
jmtp method the installed jmtp does not have, is reported as skipped.

    pip install -e '.[peers]'        # llama-cpp-python, matplotlib (transformers: the test extra)
    python scripts/bench_peers.py --out runs/peers           # ~10-15 min on 2 idle CPU cores
    python scripts/bench_peers.py --quick --out runs/peers   # a few minutes

Prompts: the held-out general chat prompts (``scripts/eval_acceptance.py``'s evaluation split) and
the copy-heavy set ``jmtp/data/prompts_copy.jsonl`` (``--copy-prompts``; one JSON object per line
with ``id`` and ``prompt``). Writes ``peers.md`` (the table), ``peers.json`` and ``peers.png``.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import platform
import time
from pathlib import Path

DEFAULT_COPY = Path(__file__).resolve().parent.parent / "jmtp" / "data" / "prompts_copy.jsonl"


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="runs/peers", help="folder for peers.md/.json/.png")
    ap.add_argument("--quick", action="store_true",
                    help="3 prompts per set, 48 tokens (unless given explicitly)")
    ap.add_argument("--num-prompts", type=int, default=None, help="prompts per set (default 8)")
    ap.add_argument("--max-tokens", type=int, default=None,
                    help="generated tokens per prompt (default 64; >= 48 for the issue's figures)")
    ap.add_argument("--batches", default="1,8", help="jmtp max_num_seqs values")
    ap.add_argument("--copy-prompts", default=str(DEFAULT_COPY), help="copy-heavy prompt JSONL")
    ap.add_argument("--sets", default="general,copy", help="prompt sets to run")
    ap.add_argument("--mtp-k", type=int, default=1, help="K of plain MTP (the shipped head)")
    ap.add_argument("--ngram-k", type=int, default=4, help="K of n-gram and hybrid drafting")
    ap.add_argument("--policy", default="fixed", choices=("fixed", "dynamic"),
                    help="jmtp speculation_policy of the MTP / n-gram / hybrid engines")
    ap.add_argument("--pld-tokens", type=int, default=10, help="HF prompt_lookup_num_tokens")
    ap.add_argument("--rounds", type=int, default=2,
                    help="timed rounds; each round runs every system once, interleaved")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="torch / llama.cpp threads")
    ap.add_argument("--skip", default="", help="comma-separated system names to skip "
                    "(hf, hf-pld, llama.cpp, plain, mtp, ngram, hybrid)")
    args = ap.parse_args(argv)
    quick = args.quick
    args.num_prompts = args.num_prompts or (3 if quick else 8)
    args.max_tokens = args.max_tokens or (48 if quick else 64)
    args.batches = [int(x) for x in args.batches.split(",")]
    args.sets = [s for s in args.sets.split(",") if s]
    args.skip = {s for s in args.skip.split(",") if s}
    if args.num_prompts < 1 or args.max_tokens < 1 or min(args.batches) < 1 or args.rounds < 1:
        ap.error("--num-prompts, --max-tokens, --batches and --rounds must be >= 1")
    return args


@dataclasses.dataclass
class Row:
    prompt_set: str
    system: str
    batch: int
    tok_s: float | None = None
    tokens: int = 0
    seconds: float = 0.0
    compile_s: float | None = None       # jmtp: LLM(...) ahead-of-time compiles; peers: load
    warmup_s: float = 0.0
    identical: str = ""                  # vs jmtp plain at the same batch ("8/8", or "-")
    mean_acc_len: float | None = None
    skipped: str = ""                    # reason, when skipped


# ---------------------------------------------------------------------------------- prompts
def load_sets(args, tok) -> dict[str, list[list[int]]]:
    from jmtp.model.checkpoints.loader import resolve_checkpoint, shipped_head_path
    from jmtp.model.checkpoints.mtp_head import head_metadata
    from jmtp.train.prompts import encode_chat, load_prompts, split_prompts

    sets: dict[str, list[list[int]]] = {}
    if "general" in args.sets:
        head = shipped_head_path(resolve_checkpoint(None)[0])
        meta = head_metadata(str(head)) if head is not None else {}
        _, held_out = split_prompts(load_prompts(), float(meta.get("eval_frac", 0.1)),
                                    int(meta.get("split_seed", 0)))
        sets["general"] = [encode_chat(tok, p.text) for p in held_out[: args.num_prompts]]
    if "copy" in args.sets:
        path = Path(args.copy_prompts)
        if path.is_file():
            with open(path, encoding="utf-8") as f:
                texts = [json.loads(line)["prompt"] for line in f if line.strip()]
            sets["copy"] = [encode_chat(tok, t) for t in texts[: args.num_prompts]]
        else:
            print(f"# copy-heavy prompts: {path} not found, set skipped")
    return sets


# ---------------------------------------------------------------------------------- jmtp
def jmtp_methods(args) -> dict[str, object]:
    """{name: SpeculativeConfig or None (plain) or a str (why it is skipped)}."""
    from jmtp import SpeculativeConfig

    def make(**kw):
        try:
            return SpeculativeConfig(**kw, speculation_policy=args.policy)
        except (TypeError, ValueError) as e:
            return f"not in this jmtp ({type(e).__name__}: {e})"

    return {
        "plain": None,
        "mtp": make(method="mtp", num_speculative_tokens=args.mtp_k, num_model_steps=args.mtp_k),
        "ngram": make(method="ngram", num_speculative_tokens=args.ngram_k, max_ngram_size=5,
                      min_ngram_size=1),
        "hybrid": make(method="mtp", mtp_strategy="with_ngram", num_speculative_tokens=args.ngram_k,
                       num_model_steps=1),
    }


@dataclasses.dataclass
class Runner:
    """One system ready to time: ``gen(prompts, max_new) -> (ids per prompt, mean acceptance
    length or None)``; ``setup_s`` = jmtp's ahead-of-time compile, or a peer's load time."""
    label: str
    batch: int
    gen: object
    setup_s: float
    tokens: dict = dataclasses.field(default_factory=dict)       # set -> generated tokens
    seconds: dict = dataclasses.field(default_factory=dict)      # set -> wall seconds
    warmup_s: dict = dataclasses.field(default_factory=dict)
    ids: dict = dataclasses.field(default_factory=dict)          # set -> last round's ids
    acc_len: dict = dataclasses.field(default_factory=dict)


def jmtp_runners(args, cfg, params, tok, sets, rows) -> list[Runner]:
    """Build every jmtp engine (``compile="eager"``: no timed pass compiles)."""
    from jmtp import LLM, SamplingParams
    from jmtp.runtime.host.outputs import SpecDecodeMetrics

    longest = max(len(p) for ps in sets.values() for p in ps)
    # Rounded up so that runs over other prompt subsets reuse the persistent compilation cache.
    max_model_len = -(-(longest + args.max_tokens + 16) // 256) * 256
    runners = []
    for b in args.batches:
        for name, spec in jmtp_methods(args).items():
            label = f"jmtp {name}"
            if name in args.skip:
                continue
            if isinstance(spec, str):
                rows += [Row(s, label, b, skipped=spec) for s in sets]
                print(f"# {label}: skipped ({spec})", flush=True)
                continue
            try:
                llm = LLM(model_config=cfg, params=params, tokenizer=tok, speculative_config=spec,
                          max_num_seqs=b, max_model_len=max_model_len, compile="eager")
            except (TypeError, ValueError) as e:
                rows += [Row(s, label, b, skipped=f"{type(e).__name__}: {e}") for s in sets]
                print(f"# {label}: skipped ({e})", flush=True)
                continue

            def gen(prompts, max_new, llm=llm, spec=spec):
                outs = llm.generate(prompts, SamplingParams(max_tokens=max_new, temperature=0.0),
                                    use_tqdm=False)
                tot = SpecDecodeMetrics(accepted_per_position=[0] * (spec.k if spec else 0))
                for o in outs:
                    tot.merge(o.metrics)
                return ([list(o.token_ids) for o in outs],
                        tot.mean_acceptance_length if spec else None)

            runners.append(Runner(label, b, gen, sum(llm.compile_seconds.values())))
            print(f"# {label} b={b}: compiled in {runners[-1].setup_s:.1f}s", flush=True)
    return runners


# ---------------------------------------------------------------------------------- peers
def _missing(mod: str) -> bool:
    return importlib.util.find_spec(mod) is None


def hf_runners(args, gguf_dir: str, gguf_name: str, sets, rows) -> list[Runner]:
    systems = [s for s in ("hf", "hf-pld") if s not in args.skip]
    if not systems:
        return []
    if _missing("torch") or _missing("transformers"):
        for s in systems:
            rows += [Row(n, "HF " + s, 1, skipped="torch/transformers not installed") for n in sets]
        print("# HF transformers: skipped (not installed; pip install -e '.[test]')")
        return []
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        gguf_dir, gguf_file=gguf_name, dtype=torch.float32).eval()
    load_s = time.perf_counter() - t0
    eos = model.generation_config.eos_token_id
    runners = []
    for system in systems:
        extra = {"prompt_lookup_num_tokens": args.pld_tokens} if system == "hf-pld" else {}
        label = "HF greedy" if system == "hf" else f"HF prompt-lookup ({args.pld_tokens})"

        def gen(prompts, max_new, extra=extra):
            outs = []
            for p in prompts:
                x = torch.tensor([p])
                with torch.inference_mode():
                    y = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                                       max_new_tokens=max_new, pad_token_id=eos, **extra)
                outs.append(y[0, len(p):].tolist())
            return outs, None
        runners.append(Runner(label, 1, gen, load_s))
    return runners


def llamacpp_runners(args, gguf_path: str, sets, rows) -> list[Runner]:
    if "llama.cpp" in args.skip:
        return []
    if _missing("llama_cpp"):
        rows += [Row(n, "llama.cpp", 1, skipped="llama-cpp-python not installed") for n in sets]
        print("# llama.cpp: skipped (pip install -e '.[peers]')")
        return []
    from llama_cpp import Llama

    longest = max(len(p) for ps in sets.values() for p in ps)
    t0 = time.perf_counter()
    llm = Llama(model_path=gguf_path, n_ctx=longest + args.max_tokens + 16,
                n_threads=args.threads, n_batch=512, verbose=False, seed=0)
    load_s = time.perf_counter() - t0

    def gen(prompts, max_new):
        outs = []
        for p in prompts:
            llm.reset()
            out = []
            # temperature 0 = llama.cpp's greedy sampler; stops at the model's end-of-generation.
            for t in llm.generate(p, temp=0.0, top_k=1, reset=True):
                if llm.token_is_eog(t) if hasattr(llm, "token_is_eog") else t == llm.token_eos():
                    out.append(t)
                    break
                out.append(t)
                if len(out) >= max_new:
                    break
            outs.append(out)
        return outs, None
    return [Runner("llama.cpp (Q4_1)", 1, gen, load_s)]


def time_interleaved(args, runners: list[Runner], sets) -> None:
    """Warm every runner on every set (4 tokens), then ``args.rounds`` rounds in which every
    runner generates ``args.max_tokens`` per prompt of every set, one after the other, so that
    the machine's drift over the run hits every system alike."""
    for r in runners:
        for sname, prompts in sets.items():
            t0 = time.perf_counter()
            r.gen(prompts, 4)
            r.warmup_s[sname] = time.perf_counter() - t0
    for rnd in range(args.rounds):
        for sname, prompts in sets.items():
            for r in runners:
                t0 = time.perf_counter()
                ids, acc = r.gen(prompts, args.max_tokens)
                dt = time.perf_counter() - t0
                r.seconds[sname] = r.seconds.get(sname, 0.0) + dt
                r.tokens[sname] = r.tokens.get(sname, 0) + sum(len(x) for x in ids)
                r.ids[sname], r.acc_len[sname] = ids, acc
                print(f"# round {rnd} {sname} {r.label} b={r.batch}: "
                      f"{sum(len(x) for x in ids) / dt:.1f} tok/s", flush=True)


def runner_rows(runners: list[Runner], sets) -> list[Row]:
    """Rows from the timed rounds; jmtp outputs are compared with jmtp plain at the same batch,
    the peers' with jmtp plain at batch 1."""
    rows = []
    for r in runners:
        ref_b = r.batch if r.label.startswith("jmtp") else 1
        ref = next((x for x in runners if x.label == "jmtp plain" and x.batch == ref_b), None)
        for sname in sets:
            if sname not in r.seconds:
                continue
            same = "-"
            if ref is not None and sname in ref.ids:
                same = f"{sum(a == c for a, c in zip(r.ids[sname], ref.ids[sname]))}/" \
                       f"{len(r.ids[sname])}"
            n, dt = r.tokens[sname], r.seconds[sname]
            rows.append(Row(sname, r.label, r.batch, n / dt, n, dt, r.setup_s,
                            r.warmup_s.get(sname, 0.0), same, r.acc_len.get(sname)))
    return rows


# ---------------------------------------------------------------------------------- report
def table(rows: list[Row]) -> str:
    lines = ["| prompts | system | batch | tok/s | vs HF greedy | vs jmtp plain (same batch) | "
             "mean acc. len | identical to jmtp plain | compile/load s | warm-up s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r.skipped:
            lines.append(f"| {r.prompt_set} | {r.system} | {r.batch} | skipped: {r.skipped} "
                         "| | | | | | |")
            continue
        hf = next((x for x in rows if x.prompt_set == r.prompt_set and x.system == "HF greedy"
                   and x.tok_s), None)
        pl = next((x for x in rows if x.prompt_set == r.prompt_set and x.system == "jmtp plain"
                   and x.batch == r.batch and x.tok_s), None)
        acc = f"{r.mean_acc_len:.2f}" if r.mean_acc_len else ""
        vs_hf = f"{r.tok_s / hf.tok_s:.2f}x" if hf else "-"
        vs_pl = f"{r.tok_s / pl.tok_s:.2f}x" if pl else "-"
        comp = "" if r.compile_s is None else f"{r.compile_s:.1f}"
        lines.append(f"| {r.prompt_set} | {r.system} | {r.batch} | {r.tok_s:.1f} | {vs_hf} | "
                     f"{vs_pl} | {acc} | {r.identical} | {comp} | {r.warmup_s:.1f} |")
    return "\n".join(lines)


def plot(rows: list[Row], path: Path, title: str):
    try:
        import matplotlib
    except ImportError:
        print("# plot: skipped (matplotlib not installed; pip install -e '.[peers]')")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sets = list(dict.fromkeys(r.prompt_set for r in rows))
    done = [r for r in rows if not r.skipped]
    names = list(dict.fromkeys(f"{r.system} (b={r.batch})" for r in done))
    fig, axes = plt.subplots(1, len(sets), figsize=(6.5 * len(sets), 0.45 * len(names) + 1.8),
                             sharey=True, squeeze=False)
    colours = {"HF": "#8c8c8c", "llama": "#d62728", "jmtp": "#1f77b4"}
    for ax, s in zip(axes[0], sets):
        vals = {f"{r.system} (b={r.batch})": r.tok_s for r in done if r.prompt_set == s}
        ys = list(range(len(names)))[::-1]
        v = [vals.get(n, 0.0) for n in names]
        bars = ax.barh(ys, v, color=[colours[n.split()[0].split(".")[0]] for n in names])
        for bar, x in zip(bars, v):
            ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2,
                    f" {x:.1f}" if x else " n/a", va="center", fontsize=9)
        ax.set_yticks(ys, names)
        ax.set_xlabel("generated tokens / s (warm, greedy)")
        ax.set_title(f"{s} prompts")
        ax.set_xlim(0, (max(v) or 1.0) * 1.2)
        ax.grid(axis="x", alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(rows: list[Row], sets: dict, head: str, args, out: Path) -> str:
    """Sort the rows, write peers.md / peers.json / peers.png under ``out``; return the table."""
    order = ["HF greedy", "HF prompt-lookup", "llama.cpp", "jmtp plain", "jmtp mtp", "jmtp ngram",
             "jmtp hybrid"]
    rows.sort(key=lambda r: (list(sets).index(r.prompt_set),
                             next(i for i, o in enumerate(order) if r.system.startswith(o)),
                             r.batch))
    md = table(rows)
    (out / "peers.md").write_text(f"{head}\n\n{md}\n", encoding="utf-8")
    (out / "peers.json").write_text(json.dumps({"header": head, "args": {
        k: (sorted(v) if isinstance(v, set) else v) for k, v in vars(args).items()}, "rows": [dataclasses.asdict(r) for r in rows]}, indent=2))
    plot(rows, out / "peers.png", head)
    return md


def main(argv=None) -> int:
    args = parse_args(argv)
    from jmtp.model import load_checkpoint, load_tokenizer
    from jmtp.model.checkpoints.loader import resolve_checkpoint

    gguf_path = str(resolve_checkpoint(None)[0])
    cfg, params = load_checkpoint(None)
    tok = load_tokenizer(None)
    sets = load_sets(args, tok)
    if not sets:
        print("no prompt set to run")
        return 2
    head = (f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs | "
            f"SmolLM2-135M-Instruct ({Path(gguf_path).name}) | greedy, {args.max_tokens} tokens, "
            + ", ".join(f"{len(v)} {k} prompts" for k, v in sets.items())
            + f" | jmtp: MTP K={args.mtp_k}, n-gram/hybrid K={args.ngram_k}, {args.policy} policy"
            + " | load average at start %.1f" % os.getloadavg()[0])
    print("# " + head, flush=True)
    rows: list[Row] = []
    t_all = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runners = (jmtp_runners(args, cfg, params, tok, sets, rows)
               + llamacpp_runners(args, gguf_path, sets, rows)
               + hf_runners(args, os.path.dirname(gguf_path), os.path.basename(gguf_path),
                            sets, rows))
    time_interleaved(args, runners, sets)
    rows += runner_rows(runners, sets)
    md = report(rows, sets, head, args, out)
    print(md)
    print(f"# total {time.perf_counter() - t_all:.0f}s")
    bad = [r for r in rows if r.system.startswith("jmtp") and r.identical not in ("", "-")
           and r.identical.split("/")[0] != r.identical.split("/")[1]]
    if bad:
        print("# NOT identical to jmtp plain: " + ", ".join(f"{r.system} b={r.batch} {r.prompt_set}"
                                                             for r in bad))
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
