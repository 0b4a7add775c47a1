#!/usr/bin/env python
"""KV-cache quantisation on SmolLM2 (jmtp issue 15): greedy outputs, acceptance and bytes with
``kv_cache_dtype`` ``None`` / ``"int8"`` / ``"fp8_e4m3"``.

For each cache dtype the script builds a plain engine and an MTP K=3 engine (the shipped head) on
the default SmolLM2-135M-Instruct GGUF and generates greedily (chat template) over the evaluation
prompts: the held-out general chat prompts (the shipped head's evaluation split) and the
copy-heavy set ``jmtp/data/prompts_copy.jsonl``, the sets of ``scripts/bench_spec.py``. Reported
against the unquantised cache (the model dtype, f32 on CPU):

* **prefix**: tokens before each output's first divergence from the unquantised output, over all
  unquantised tokens (a stricter measure: one early flip counts every later token as lost);
* **position-wise**: tokens equal at the same position, over the longer output's length, summed
  over prompts (overall agreement, also after a divergence);
* **identical**: outputs equal in full;
* **MTP K=3 mean acceptance length** and its ratio to the unquantised cache's;
* **MTP = plain**: MTP output token-identical to plain decoding on the same quantised cache;
* **KV bytes** of each engine (values and scales apart, :meth:`LLMEngine.kv_cache_bytes`) and per
  token.

It also measures why the scales are per token per head and not per block per head: the K/V of a
prefill of the first evaluation prompts are captured (unquantised) and quantised both ways; the
relative RMS reconstruction error ``||x̂ - x|| / ||x||`` is printed for each format (also with the
Hadamard rotation, and for keys with the rotation and the key shift of ``jmtp.model.kv_shift``,
what an int8 cache stores). The teacher-forced int8 figures use the engine's key shift.

Prints markdown tables; ``--snippet FILE`` also writes them, with the command, as a markdown
section (``docs/kvquant.md`` holds the curated results).

    python scripts/bench_kvquant.py                       # all prompts, 64 tokens, batch 8
    python scripts/bench_kvquant.py --num-prompts 4 --max-tokens 32 --snippet /tmp/s.md
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time

DTYPES = ("none", "int8", "fp8_e4m3", "bf16")
#: "bf16" is a reference point, not a jmtp option: the f32 engine with its KV caches' values held
#: in bfloat16 (the accelerators' default cache), to show how far greedy decoding drifts from an
#: f32 cache without any 8-bit quantisation.


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sets", default="general,copy", help="prompt sets: general, copy")
    ap.add_argument("--num-prompts", type=int, default=0, help="prompts per set (0 = all)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8, help="max_num_seqs")
    ap.add_argument("--k", type=int, default=3, help="MTP drafts K")
    ap.add_argument("--dtypes", default=",".join(DTYPES))
    ap.add_argument("--granularity-prompts", type=int, default=8,
                    help="prompts whose prefill K/V measure per-token vs per-block scales")
    ap.add_argument("--snippet", default=None, help="also write the tables to this file")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    args.sets = args.sets.split(",")
    args.dtypes = args.dtypes.split(",")
    if args.dtypes[0] != "none" or any(d not in DTYPES for d in args.dtypes):
        ap.error(f"--dtypes must start with 'none' and name only {DTYPES}")
    return args


def agreement(ref: list[list[int]], out: list[list[int]]) -> dict:
    """Token agreement of ``out`` with ``ref`` (per prompt, summed): see the module docstring."""
    prefix = same = longest = total = identical = 0
    for a, b in zip(ref, out):
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        prefix += n
        total += len(a)
        same += sum(x == y for x, y in zip(a, b))
        longest += max(len(a), len(b))
        identical += a == b
    return dict(prefix=prefix / max(total, 1), positionwise=same / max(longest, 1),
                identical=identical, prompts=len(ref))


def granularity_errors(cfg, params, prompts, block_size: int = 16) -> dict:
    """Relative RMS reconstruction error of SmolLM2's K and V (all layers) quantised with one scale
    per token per head vs one per (full or partial) block of ``block_size`` tokens per head."""
    import jax.numpy as jnp
    import numpy as np

    from jmtp.model import forward, init_kv_cache, ragged_batch
    from jmtp.pallas import kv_quant

    from jmtp.model.kv_shift import calibrate_k_shift

    mu = np.asarray(calibrate_k_shift(cfg, params))                # f32[L, Nkv, D]
    ks, vs = [], []
    for ids in prompts:
        t = len(ids)
        pages = -(-t // block_size)
        cache = init_kv_cache(cfg, cfg.num_layers, pages, block_size, jnp.float32)
        tables = jnp.arange(pages, dtype=jnp.int32)[None]
        pos, meta = ragged_batch(jnp.array([t], jnp.int32), jnp.zeros((1,), jnp.int32), tables,
                                 block_size, t)
        _, cache = forward(cfg, params, jnp.asarray(ids, jnp.int32), pos, meta, cache)
        for store, c in ((ks, cache.k), (vs, cache.v)):
            c = np.asarray(c).reshape(cfg.num_layers, pages * block_size, cfg.num_kv_heads, -1)
            store.append((c, t))
    out = {}
    for name in ("int8", "fp8_e4m3"):
        q8 = kv_quant.storage_dtype(name)
        for kind, store in (("K", ks), ("V", vs)):
            err_tok = err_rot = err_blk = err_shift = norm = 0.0
            r = np.asarray(kv_quant.hadamard_rotation(cfg.head_dim))
            for c, t in store:
                x = c[:, :t]                                           # [L, t, Nkv, D]
                if kind == "K":   # keys minus the calibrated mean (jmtp.model.kv_shift), rotated
                    xs = x - mu[:, None]
                    q, s = kv_quant.quantize(jnp.asarray(xs @ r), q8)
                    err_shift += float(np.sum((np.asarray(kv_quant.dequantize(q, s)) @ r.T
                                               - xs) ** 2))
                q, s = kv_quant.quantize(jnp.asarray(x), q8)
                err_tok += float(np.sum((np.asarray(kv_quant.dequantize(q, s)) - x) ** 2))
                q, s = kv_quant.quantize(jnp.asarray(x @ r), q8)       # rotated, rotated back
                err_rot += float(np.sum((np.asarray(kv_quant.dequantize(q, s)) @ r.T - x) ** 2))
                # per block per head: absmax over the block's tokens and D
                n_blk = -(-t // block_size)
                xb = np.zeros((x.shape[0], n_blk * block_size) + x.shape[2:], np.float32)
                xb[:, :t] = x
                xb = xb.reshape(x.shape[0], n_blk, block_size, x.shape[2], x.shape[3])
                xb = np.moveaxis(xb, 2, 3).reshape(x.shape[0], n_blk, x.shape[2], -1)
                q, s = kv_quant.quantize(jnp.asarray(xb), q8)          # one scale per block·head
                deq = np.asarray(kv_quant.dequantize(q, s)).reshape(
                    x.shape[0], n_blk, x.shape[2], block_size, x.shape[3])
                deq = np.moveaxis(deq, 3, 2).reshape(x.shape[0], -1, x.shape[2], x.shape[3])
                err_blk += float(np.sum((deq[:, :t] - x) ** 2))
                norm += float(np.sum(x ** 2))
            out[name, kind] = (np.sqrt(err_tok / norm), np.sqrt(err_rot / norm),
                               np.sqrt(err_blk / norm), np.sqrt(err_shift / norm))
    return out


def window_vs_rows(cfg, params, ids, window: int = 4, block_size: int = 16) -> tuple[float, int]:
    """Why MTP can differ from plain decoding on a quantised cache: the f32 keys of the last
    ``window`` tokens of ``ids`` computed as one ``window``-row chunk vs as ``window`` one-row
    steps (same prefix before). Returns ``(max |difference|, positions·layers·heads not
    bit-identical)``."""
    import jax.numpy as jnp
    import numpy as np

    from jmtp.model import forward, init_kv_cache, ragged_batch

    t = len(ids)
    pages = -(-t // block_size)
    tables = jnp.arange(pages, dtype=jnp.int32)[None]

    def keys(chunks):
        cache, done = init_kv_cache(cfg, cfg.num_layers, pages, block_size, jnp.float32), 0
        for c in chunks:
            pos, meta = ragged_batch(jnp.array([c], jnp.int32), jnp.array([done], jnp.int32),
                                     tables, block_size, c)
            _, cache = forward(cfg, params, jnp.asarray(ids[done:done + c], jnp.int32), pos, meta,
                               cache)
            done += c
        k = np.asarray(cache.k).reshape(cfg.num_layers, -1, cfg.num_kv_heads, cfg.head_dim)
        return k[:, t - window:t]

    a, b = keys([t - window, window]), keys([t - window] + [1] * window)
    return float(np.abs(a - b).max()), int((a != b).any(-1).sum())


def teacher_forced(cfg, params, prompts, outputs, kv_cache_dtype, cache_dtype=None,
                   block_size: int = 16) -> tuple[int, int]:
    """Top-1 agreement without compounding: each prompt + its unquantised greedy output is run as
    one prefill with a ``kv_cache_dtype`` cache (or an unquantised ``cache_dtype`` cache) and with
    an f32 cache; returns ``(positions whose argmax agrees, positions)`` over the generated
    positions."""
    import jax.numpy as jnp
    import numpy as np

    from jmtp.model import compute_logits, forward, init_kv_cache, ragged_batch
    from jmtp.model.kv_shift import with_k_shift

    shifted = with_k_shift(cfg, params, kv_cache_dtype)     # what the engine runs an int8 cache with
    same = total = 0
    for p, o in zip(prompts, outputs):
        ids = list(p) + list(o)
        t = len(ids)
        pages = -(-t // block_size)
        tables = jnp.arange(pages, dtype=jnp.int32)[None]
        pos, meta = ragged_batch(jnp.array([t], jnp.int32), jnp.zeros((1,), jnp.int32), tables,
                                 block_size, t)
        top = []
        for kv, cd, pr in ((None, jnp.float32, params),
                           (kv_cache_dtype, cache_dtype or jnp.float32, shifted)):
            cache = init_kv_cache(cfg, cfg.num_layers, pages, block_size, cd, kv)
            h, _ = forward(cfg, pr, jnp.asarray(ids, jnp.int32), pos, meta, cache)
            top.append(np.asarray(jnp.argmax(compute_logits(params, h[len(p) - 1: t - 1]), -1)))
        same += int((top[0] == top[1]).sum())
        total += len(o)
    return same, total


def main(argv=None) -> int:
    args = parse_args(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_spec import prompt_sets

    from jmtp import LLM, SamplingParams, SpeculativeConfig
    from jmtp.model import load_checkpoint, load_tokenizer
    from jmtp.runtime.host.outputs import SpecDecodeMetrics

    cfg, params = load_checkpoint(None)
    tok = load_tokenizer(None)
    sets = prompt_sets(tok, args.sets, args.num_prompts)
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    longest = max(len(p) for ps in sets.values() for p in ps)
    head = (f"{platform.machine()}, {os.cpu_count()} CPUs | SmolLM2-135M-Instruct (Q4_1 GGUF, f32) + "
            f"shipped MTP head | greedy, chat template, max_tokens {args.max_tokens}, "
            f"max_num_seqs {args.batch} | " + ", ".join(f"{k}: {len(v)} prompts"
                                                        for k, v in sets.items()))
    print("# " + head, flush=True)

    t0 = time.perf_counter()
    gran_prompts = [p for ps in sets.values() for p in ps][: args.granularity_prompts]
    gran = granularity_errors(cfg, params, gran_prompts)
    print(f"# granularity measured in {time.perf_counter() - t0:.1f} s", flush=True)

    runs = {}
    for dt in args.dtypes:
        kv = None if dt in ("none", "bf16") else dt
        for k in (0, args.k):
            t0 = time.perf_counter()
            llm = LLM(model_config=cfg, params=params, tokenizer=tok, max_num_seqs=args.batch,
                      max_model_len=longest + args.max_tokens + 16, kv_cache_dtype=kv,
                      speculative_config=SpeculativeConfig("mtp", k) if k else None,
                      compile="lazy")
            if dt == "bf16":           # values in bfloat16, everything else unchanged
                import jax.numpy as jnp
                eng = llm.llm_engine.runner
                to_bf16 = lambda c: None if c is None else c._replace(
                    k=c.k.astype(jnp.bfloat16), v=c.v.astype(jnp.bfloat16))
                eng.cache, eng.mtp_cache = to_bf16(eng.cache), to_bf16(eng.mtp_cache)
            outs = {name: llm.generate(ps, sp, use_tqdm=False) for name, ps in sets.items()}
            runs[dt, k] = dict(outs=outs, bytes=llm.kv_cache_bytes(),
                               seconds=time.perf_counter() - t0)
            print(f"# {dt} K={k}: {runs[dt, k]['seconds']:.1f} s (lazy compile + generate)",
                  flush=True)
            del llm

    def tokens(dt, k, name):
        return [o.token_ids for o in runs[dt, k]["outs"][name]]

    def acc_len(dt, name):
        m = SpecDecodeMetrics(accepted_per_position=[0] * args.k)
        for o in runs[dt, args.k]["outs"][name]:
            m.merge(o.metrics)
        return m.mean_acceptance_length

    rows = []
    lines = ["| cache | prompts | prefix-identical tokens | position-wise identical tokens | "
             "identical outputs | MTP K=3 acc. len | vs unquantised | MTP = plain (prefix) |",
             "|---|---|---|---|---|---|---|---|"]
    for dt in args.dtypes:
        for name in list(sets) + ["all"]:
            names = list(sets) if name == "all" else [name]
            ref = [t for n in names for t in tokens("none", 0, n)]
            got = [t for n in names for t in tokens(dt, 0, n)]
            ag = agreement(ref, got)
            mtp_ag = agreement(got, [t for n in names for t in tokens(dt, args.k, n)])
            mtp_same = mtp_ag["identical"] == mtp_ag["prompts"]
            if name == "all":
                m = SpecDecodeMetrics(accepted_per_position=[0] * args.k)
                m0 = SpecDecodeMetrics(accepted_per_position=[0] * args.k)
                for n in names:
                    for o in runs[dt, args.k]["outs"][n]:
                        m.merge(o.metrics)
                    for o in runs["none", args.k]["outs"][n]:
                        m0.merge(o.metrics)
                al, al0 = m.mean_acceptance_length, m0.mean_acceptance_length
            else:
                al, al0 = acc_len(dt, name), acc_len("none", name)
            row = dict(cache=dt, set=name, **ag, acceptance_length=al,
                       acceptance_ratio=al / al0, mtp_equals_plain=mtp_same,
                       mtp_vs_plain_prefix=mtp_ag["prefix"],
                       mtp_vs_plain_identical=mtp_ag["identical"])
            rows.append(row)
            lines.append(f"| {dt} | {name} | {100 * ag['prefix']:.1f} % | "
                         f"{100 * ag['positionwise']:.1f} % | {ag['identical']}/{ag['prompts']} | "
                         f"{al:.3f} | {al / al0:.3f} | "
                         f"{mtp_ag['identical']}/{mtp_ag['prompts']} "
                         f"({100 * mtp_ag['prefix']:.1f} %) |")
    table = "\n".join(lines)

    f32 = runs["none", args.k]["bytes"]
    blines = ["| cache | KV values (MTP engine: target + MTP) | scales | values vs unquantised | "
              "values + scales vs unquantised | bytes per token (values + scales) |",
              "|---|---|---|---|---|---|"]
    layers = cfg.num_layers + 1
    for dt in args.dtypes:
        b = runs[dt, args.k]["bytes"]
        item = {"none": 4, "bf16": 2}.get(dt, 1)
        tok_values = 2 * layers * cfg.num_kv_heads * cfg.head_dim * item
        tok_scales = 0 if dt in ("none", "bf16") else 2 * layers * cfg.num_kv_heads * 4
        blines.append(f"| {dt} | {b['values'] / 2**20:.2f} MiB | {b['scales'] / 2**20:.2f} MiB | "
                      f"{b['values'] / f32['values']:.3f} | {b['total'] / f32['total']:.3f} | "
                      f"{tok_values} + {tok_scales} |")
    btable = "\n".join(blines)

    glines = ["| format | tensor | rel. RMS error, per token per head | same, Hadamard-rotated | "
              "rotated, keys minus the calibrated mean | per block (16 tokens) per head |",
              "|---|---|---|---|---|---|"]
    for (name, kind), (e_tok, e_rot, e_blk, e_shift) in gran.items():
        used = (lambda v: f"**{v:.4f}**")
        a, b = (f"{e_tok:.4f}", f"{e_rot:.4f}") if name == "int8" else (used(e_tok), f"{e_rot:.4f}")
        if name == "int8" and kind == "V":
            b = used(e_rot)
        c = "-" if kind == "V" else (used(e_shift) if name == "int8" else f"{e_shift:.4f}")
        glines.append(f"| {name} | {kind} | {a} | {b} | {c} | {e_blk:.4f} |")
    gtable = "\n".join(glines)

    diff, n_diff = window_vs_rows(cfg, params, gran_prompts[0])
    wline = (f"f32 keys of a prompt's last 4 tokens computed as one 4-row chunk vs four 1-row "
             f"steps: max |difference| {diff:.2e}, {n_diff} of {cfg.num_layers * 4 * cfg.num_kv_heads} "
             f"(layer, position, head) key vectors not bit-identical")
    print("# " + wline, flush=True)

    import jax.numpy as jnp
    tlines = ["| cache | teacher-forced top-1 agreement with the f32 cache |", "|---|---|"]
    allp = [p for ps in sets.values() for p in ps]
    ref = [t for n in sets for t in tokens("none", 0, n)]
    tf = {}
    for dt, label in [("bfloat16", "bf16 values (reference point)")] + [
            (d, d) for d in args.dtypes if d not in ("none", "bf16")]:
        kv, cd = (None, jnp.bfloat16) if dt == "bfloat16" else (dt, None)
        same, total = teacher_forced(cfg, params, allp, ref, kv, cd)
        tf[dt] = same / total
        tlines.append(f"| {label} | {100 * same / total:.2f} % ({same}/{total}) |")
    ttable = "\n".join(tlines)
    print("\n" + table + "\n\n" + btable + "\n\n" + gtable + "\n\n" + ttable, flush=True)
    cmd = "python scripts/bench_kvquant.py " + " ".join(argv if argv is not None else sys.argv[1:])
    date = datetime.date.today().isoformat()
    snippet = f"""## KV-cache quantisation

`LLM(kv_cache_dtype=...)` (vLLM's name; `EngineConfig.kv_cache_dtype`, CLI `--kv-cache-dtype
{{auto,int8,fp8_e4m3}}` for `jmtp generate` and `jmtp serve`) stores the target and the MTP KV
caches as `"int8"` or `"fp8_e4m3"` (OCP E4M3, `jnp.float8_e4m3fn`) values, a quarter of f32's
bytes (half of bf16's), plus one f32 scale per token per KV head (`scale = absmax / 127` or
`/ 448` over the head's D values). `None` (default) keeps the model dtype. The scales sit beside
the values, block-wise, in FastDeploy's `block_wise_fp8` layout (`f32[layers, num_blocks,
kv_heads, block_size]`). Keys and values are quantised in the KV write
(`jmtp.pallas.kv_quant.write_kv_quantized`); every attention implementation (reference, xla,
Pallas TPU, Pallas GPU) dequantises on read, the kernels by scaling the columns of `q·kᵀ` and
of `p` before `p·v`. `llm.kv_cache_bytes()` reports the bytes (values and scales apart); an
unknown dtype is a `ValueError` naming `kv_cache_dtype` and the allowed values.

Why per token and not one scale per block: a token's stored values then depend only on its own
K/V. Blocks fill incrementally (prefill chunks, then verify windows whose rejected drafts are
overwritten later); a per-block scale would have to requantise a block's earlier tokens whenever
a larger one (or a rejected draft) arrives, so the cache, and the tokens generated from it,
would depend on chunk sizes, speculation and preemption. The per-token error is also lower
(granularity table). The price is 4 bytes per token per head for K and V (6.25 % of the int8
values at D = 64). Greedy MTP equals greedy plain on the same int8 cache on the tiny test model
(`tests/runtime/test_kvquant_engine.py`); on SmolLM2 see "MTP = plain" below: a verify window's
K/V come from a (K+1)-row matmul whose last bits can differ from plain decoding's 1-row matmul,
and 8-bit rounding can turn that into a whole quantisation step. Measured here: {wline}.

int8 caches store K and V rotated by an orthonormal Hadamard matrix (the query is rotated alike
and the attention output rotated back: `jmtp.pallas.kv_quant.hadamard_rotation`), which spreads
outlier channels over the whole head and so lowers int8's per-token error, and the keys minus a
calibrated mean key per layer and KV head (`jmtp.model.kv_shift`, exact under softmax); fp8 is
stored unrotated and unshifted.

### KV-cache quantisation: measured {date}

`{cmd.strip()}`

{head}

Greedy outputs against the unquantised (f32) cache, plain decoding; MTP K=3 acceptance length
against MTP K=3 on the unquantised cache; "MTP = plain": speculative output token-identical to
plain decoding on the same quantised cache.

{table}

KV-cache bytes of the MTP engines ({cfg.num_layers} target layers + 1 MTP layer,
{cfg.num_kv_heads} KV heads × {cfg.head_dim}; `LLMEngine.kv_cache_bytes()`):

{btable}

Scale granularity, measured on the K/V of {len(gran_prompts)} prompts' prefills (all layers): one
f32 scale per token per KV head (FastDeploy's `block_wise_fp8` layout `[num_blocks, kv_heads,
block_size]`), with and without the Hadamard rotation (and for int8 keys the key shift),
against one per 16-token block per head (bold: what jmtp stores):

{gtable}

Per-token fidelity without compounding: each prompt plus its unquantised greedy output run as one
prefill with the quantised cache; the share of generated positions whose argmax equals the f32
cache's:

{ttable}
"""
    if args.snippet:
        os.makedirs(os.path.dirname(args.snippet) or ".", exist_ok=True)
        with open(args.snippet, "w") as f:
            f.write(snippet)
        print(f"# wrote {args.snippet}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(args=vars(args), rows=rows,
                           bytes={d: runs[d, args.k]["bytes"] for d in args.dtypes},
                           granularity={f"{a}/{b}": v for (a, b), v in gran.items()},
                           teacher_forced=tf), f,
                      indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
