#!/usr/bin/env python
"""Measurements of ``scripts/device_check.sh`` (each subcommand writes one JSON file).

    python scripts/device_bench.py kernels --json K.json   # copy, matmul, attention, allocator
    python scripts/device_bench.py rows --json R.json      # stage (a): step time per token rows,
                                                           #   random weights, no checkpoint
    python scripts/device_bench.py speedup --model GGUF --json S.json   # stage (b)

Every timing is warm (the first call of each shape, which compiles, is reported apart), the
median of repeated runs, synchronised with ``jax.block_until_ready``; every subcommand stops
starting new measurements once ``--seconds`` have passed and writes what it has. ``--tiny``
shrinks every shape for the CPU rehearsal (``device_check.sh --dry-run``), which runs the same
code.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))


def _dump(path: str, obj: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2, default=str)
    os.replace(tmp, path)


def _timed(fn, args, iters: int, warmup: int = 1):
    """(median seconds, first-call seconds) of ``fn(*args)``, each run synchronised."""
    import jax
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    first = time.perf_counter() - t0
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts), first


def device_info() -> dict:
    import jax
    d = jax.devices()[0]
    return {"backend": jax.default_backend(), "device_kind": d.device_kind,
            "num_devices": jax.device_count(), "jax": jax.__version__}


# ------------------------------------------------------------------------------------- kernels
def attention_batch(b: int, q: int, ctx: int, nq: int, nkv: int, d: int, dtype, seed: int = 0,
                    block_size: int = 16):
    """``b`` sequences of ``q`` query rows over ``ctx`` cached positions each, their pages
    scattered over a shuffled pool (random values drawn on the device: a Llama-3-8B pool at
    batch 64 x 4096 positions is 1 GB); returns the kernel's arguments and the KV bytes it must
    read."""
    import jax
    import jax.numpy as jnp
    rng = np.random.default_rng(seed)
    pages = -(-ctx // block_size)
    nb = b * pages + 1
    tables = rng.permutation(nb)[:b * pages].reshape(b, pages).astype(np.int32)
    kq, kk, kv = jax.random.split(jax.random.PRNGKey(seed), 3)
    shape = (nb, block_size, nkv, d)
    args = (jax.random.normal(kq, (b * q, nq, d), dtype), jax.random.normal(kk, shape, dtype),
            jax.random.normal(kv, shape, dtype), jnp.full((b,), ctx, jnp.int32),
            jnp.asarray(tables), jnp.asarray(np.arange(b + 1, dtype=np.int32) * q))
    return args, 2 * b * ctx * nkv * d * jnp.dtype(dtype).itemsize


def cmd_kernels(a) -> int:
    """Copy bandwidth, bf16 matmul rate, attention and block-allocator kernels against HBM."""
    import functools

    import jax
    import jax.numpy as jnp

    from jmtp.pallas.block_allocator import allocate_blocks, init_allocator_state
    from jmtp.pallas.ragged_paged_attention import ragged_paged_attention
    from jmtp.runtime.host.roofline import H200, H200_DATASHEET_BW

    out = {"device": device_info(), "datasheet_bytes_per_s": H200_DATASHEET_BW, "rows": []}
    t_end = time.perf_counter() + a.seconds
    gpu = jax.default_backend() == "gpu"
    iters = 3 if a.tiny else 20
    key = jax.random.PRNGKey(0)
    # copy: read + write every byte of a random bf16 buffer (METHOD.md: bytes read plus written)
    n = 1 << (16 if a.tiny else 30)
    x = jax.random.normal(key, (n,), jnp.bfloat16)
    t, first = _timed(jax.jit(lambda v: v * 1.5 + 1.0), (x,), iters)
    copy_bw = 2 * n * 2 / t
    out["copy_bytes_per_s"] = copy_bw
    out["rows"].append({"kernel": "copy (x*1.5+1, bf16)", "bytes": 2 * n * 2, "seconds": t,
                        "bytes_per_s": copy_bw, "first_call_seconds": first})
    del x
    m = 256 if a.tiny else 8192
    xa = jax.random.normal(key, (m, m), jnp.bfloat16)
    xb = jax.random.normal(jax.random.PRNGKey(1), (m, m), jnp.bfloat16)
    t, first = _timed(jax.jit(lambda p, q: p @ q), (xa, xb), iters)
    out["matmul_flops_per_s"] = 2 * m ** 3 / t
    out["rows"].append({"kernel": f"matmul {m}^3 bf16", "flops": 2 * m ** 3, "seconds": t,
                        "flops_per_s": 2 * m ** 3 / t, "first_call_seconds": first})
    del xa, xb
    # attention: decode (1 query row) and verify (4 rows) windows over paged KV, model shapes
    impl = "pallas_gpu" if gpu else "reference"
    shapes = ([("tiny", 4, 2, 16, [2], [64])] if a.tiny else
              [("SmolLM2", 9, 3, 64, [8, 64], [1024, 4096]),
               ("Llama-3-8B", 32, 8, 128, [8, 64], [1024, 4096])])
    for name, nq, nkv, d, batches, ctxs in shapes:
        for b in batches:
            for ctx in ctxs:
                for q in (1, 4):
                    if time.perf_counter() > t_end:
                        out["cut_short"] = True
                        break
                    batch, kv_bytes = attention_batch(b, q, ctx, nq, nkv, d,
                                                      jnp.bfloat16 if gpu else jnp.float32)
                    fn = jax.jit(functools.partial(ragged_paged_attention, sm_scale=d ** -0.5,
                                                   implementation=impl))
                    t, first = _timed(fn, batch, iters)
                    out["rows"].append({
                        "kernel": f"attention {impl} {name} heads {nq}/{nkv}x{d}", "batch": b,
                        "context": ctx, "q_rows": q, "bytes": kv_bytes, "seconds": t,
                        "bytes_per_s": kv_bytes / t, "share_of_copy": kv_bytes / t / copy_bw,
                        "share_of_datasheet": kv_bytes / t / H200_DATASHEET_BW,
                        "first_call_seconds": first})
    # block allocator: release every slot then top each up (the engine's per-step call)
    for impl in (["reference", "pallas_gpu"] if gpu else ["reference"]):
        for slots, pages in ([(4, 8)] if a.tiny else [(64, 256), (256, 256)]):
            if time.perf_counter() > t_end:
                out["cut_short"] = True
                break
            nb = slots * pages
            stack, count, tables, owned = init_allocator_state(nb, slots, pages)
            need = jnp.full((slots,), pages // 2, jnp.int32)
            rel = jnp.zeros((slots,), bool)
            fn = jax.jit(functools.partial(allocate_blocks, implementation=impl))
            try:
                t, first = _timed(fn, (stack, count, tables, owned, rel, need), iters)
            except Exception as e:     # the Triton allocator has not run on a GPU before
                out["rows"].append({"kernel": f"block allocator {impl}", "error": repr(e)[:300]})
                continue
            nbytes = 4 * (2 * nb + 2 * slots * pages + 4 * slots)   # state read + written
            out["rows"].append({"kernel": f"block allocator {impl}", "slots": slots,
                                "pages": pages, "bytes": nbytes, "seconds": t,
                                "bytes_per_s": nbytes / t, "share_of_copy": nbytes / t / copy_bw,
                                "first_call_seconds": first})
    out["model_bytes_per_s"] = H200.hbm_bytes_per_s
    _dump(a.json, out)
    for r in out["rows"]:
        print(json.dumps(r))
    return 0


# ------------------------------------------------------------------------------------- rows
class FixedDepth:
    """A stand-in for the engine's dynamic policy that lets every slot draft ``depth`` tokens
    (so a K-draft engine runs its steps in the bucket of ``1 + depth`` rows per slot); the
    engine asks only what :class:`jmtp.runtime.host.spec_policy.DynamicSpeculation` answers."""

    num_plans = num_drafting_plans = num_holds = 0

    def __init__(self, num_slots: int, depth: int):
        self.num_slots, self.depth = num_slots, depth

    def draft_limits(self, active):
        return np.where(np.asarray(active, bool), self.depth, 0).astype(np.int32)

    def plan_context(self):
        return None

    def observe(self, *args, **kw):
        pass

    def reset_slot(self, b):
        pass


def shape_configs(tiny: bool):
    """``{name: ModelConfig}``: SmolLM2-135M- and Llama-3-8B-shaped targets (tiny: two small
    stand-ins with the same structure)."""
    from jmtp.model.config import ModelConfig
    from jmtp.model.checkpoints.hf_config import hf_config
    if tiny:
        return {"SmolLM2-shaped (tiny)": ModelConfig(vocab_size=512, hidden_size=64,
                                                     intermediate_size=128, num_layers=2,
                                                     num_heads=4, num_kv_heads=2, head_dim=16),
                "Llama-3-8B-shaped (tiny)": ModelConfig(vocab_size=640, hidden_size=64,
                                                        intermediate_size=160, num_layers=3,
                                                        num_heads=4, num_kv_heads=1, head_dim=16)}
    with open(os.path.join(HERE, "..", "configs", "llama-3-8b.json")) as f:
        l8 = hf_config(json.load(f), "configs/llama-3-8b.json")
    smol = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                       num_heads=9, num_kv_heads=3, head_dim=64, rope_theta=100000.0,
                       rms_norm_eps=1e-5, max_position_embeddings=8192, bos_token_id=1,
                       eos_token_ids=(2,))
    return {"SmolLM2-shaped": smol, "Llama-3-8B-shaped": l8}


def measure_engine(cfg, params, spec, batches, depths, *, context, new_tokens, dtype, deadline,
                   seed=0):
    """Decode-step times of one engine per (batch, depth, bucket): ``batch`` requests of
    ``context`` random prompt tokens, ``new_tokens`` each, every slot drafting ``depth``."""
    from jmtp import LLM, SamplingParams
    k = spec.num_speculative_tokens if spec is not None else 0
    t0 = time.perf_counter()
    llm = LLM(model_config=cfg, params=params, max_num_seqs=max(batches),
              max_model_len=context + new_tokens + k + 8, speculative_config=spec,
              compile="lazy", dtype=dtype, layer_loop="scan",
              max_num_batched_tokens=max(batches) * context + 64)
    eng = llm.llm_engine
    eng.async_scheduling = False    # one step at a time: each step timed from dispatch to outputs
    build = time.perf_counter() - t0
    rec: dict = {}
    run = eng.runner.run_step

    def timed(bucket, chunks, limits, guide=None):
        t = time.perf_counter()
        out = run(bucket, chunks, limits, guide)
        if not chunks.any() and bucket in compiled:     # warm decode steps only
            rec.setdefault(bucket, []).append(time.perf_counter() - t)
        compiled.add(bucket)
        return out

    compiled: set = set()
    eng.runner.run_step = timed
    rng = np.random.default_rng(seed)
    rows = []
    for b in batches:
        for d in depths:
            if time.perf_counter() > deadline:
                return rows, build, True
            if spec is not None:
                eng.spec_policy = FixedDepth(len(eng.scheduler.slots), d)
            prompts = [rng.integers(3, cfg.vocab_size, context).tolist() for _ in range(b)]
            sp = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
            rec.clear()
            t1 = time.perf_counter()
            outs = llm.generate(prompts, sp, use_tqdm=False)
            wall = time.perf_counter() - t1
            toks = sum(len(o.outputs[0].token_ids) for o in outs)
            for bucket, ts in sorted(rec.items()):
                rows.append({"batch": b, "depth": d, "bucket": bucket.label,
                             "rows_per_slot": bucket.num_tokens // bucket.num_slots,
                             "slots": bucket.num_slots, "steps": len(ts),
                             "step_seconds": statistics.median(ts),
                             "step_seconds_min": min(ts)})
            rows.append({"batch": b, "depth": d, "summary": True, "wall_seconds": wall,
                         "tokens": toks, "first_call_seconds": dict(
                             eng.runner.first_call_seconds)})
    del llm, eng
    gc.collect()
    return rows, build, False


def cmd_rows(a) -> int:
    """Stage (a): step time per token rows T = 1..K+1 for batch 1/8/64, plain against MTP and
    n-gram engines, random bf16 weights, with the roofline's prediction beside each row."""
    import jax
    import jax.numpy as jnp

    from jmtp import SpeculativeConfig
    from jmtp.model.params import init_mtp_params, init_params
    from jmtp.runtime.host.roofline import H200, step_cost

    deadline = time.perf_counter() + a.seconds
    dtype = jnp.float32 if a.tiny else jnp.bfloat16
    batches = [int(x) for x in a.batches.split(",")]
    context, new_tokens, k = a.context, a.new_tokens, a.k
    out = {"device": device_info(), "context": context, "new_tokens": new_tokens, "k": k,
           "dtype": jnp.dtype(dtype).name, "engines": []}
    shapes = shape_configs(a.tiny)
    if a.shapes:
        shapes = {n: c for i, (n, c) in enumerate(shapes.items()) if str(i) in a.shapes.split(",")}
    plans = []        # the anchors of the prediction first (plain and MTP), n-gram last
    methods = a.methods.split(",")
    small = [b for b in batches if b <= 8] or batches[:1]
    large = [b for b in batches if b not in small]
    mtp = SpeculativeConfig("mtp", k, num_model_steps=k)
    # small batches of both shapes first (the prediction's anchors), then the large batch, n-gram
    # last: a time box cuts the least informative measurements
    for group in (small, large):
        for name, cfg in shapes.items():
            if group and "plain" in methods:
                plans.append((name, cfg, "plain", None, [0], group))
            if group and "mtp" in methods:
                plans.append((name, cfg, f"mtp K={k}", mtp, sorted({0, 1, k}), group))
    for name, cfg in shapes.items():
        if "ngram" in methods:
            plans.append((name, cfg, f"ngram K={k}", SpeculativeConfig("ngram", k), [k], batches))
    params_of = {}
    for name, cfg, label, spec, depths, group in plans:
        if time.perf_counter() > deadline:
            out["cut_short"] = True
            break
        if name not in params_of:
            t0 = time.perf_counter()
            p = init_params(cfg, jax.random.PRNGKey(0), dtype=dtype)
            p["mtp"] = init_mtp_params(cfg, p, jax.random.PRNGKey(1), dtype=dtype)
            jax.block_until_ready(p)
            params_of[name] = p
            print(f"[rows] {name}: random params in {time.perf_counter() - t0:.1f} s", flush=True)
        params = params_of[name]
        try:
            rows, build, cut = measure_engine(cfg, params, spec, group, depths, context=context,
                                              new_tokens=new_tokens, dtype=dtype,
                                              deadline=deadline)
        except Exception as e:          # one engine failing must not lose the others
            out["engines"].append({"shape": name, "method": label, "error": repr(e)[:500]})
            print(f"[rows] {name} {label}: FAILED {e!r}"[:300], flush=True)
            continue
        for r in rows:
            if "summary" in r:
                continue
            mtp_steps = k if spec is not None and spec.method == "mtp" else 0
            pred = step_cost(cfg, H200, slots=r["slots"], rows_per_slot=r["rows_per_slot"],
                             context=context + new_tokens // 2, mtp_substeps=mtp_steps)
            r["predicted_device_seconds"] = pred.device_seconds
            r["memory_floor_seconds"] = pred.memory_floor_seconds
            print(f"[rows] {name} {label} {r['bucket']}: {r['step_seconds'] * 1e3:.3f} ms "
                  f"(predicted device {pred.device_seconds * 1e3:.3f} ms, memory floor "
                  f"{pred.memory_floor_seconds * 1e3:.3f} ms)", flush=True)
        out["engines"].append({"shape": name, "method": label, "build_seconds": build,
                               "rows": rows, "cut_short": cut})
        _dump(a.json, out)
        if cut:
            out["cut_short"] = True
            break
    _dump(a.json, out)
    return 0


# ------------------------------------------------------------------------------------- speedup
def cmd_speedup(a) -> int:
    """Stage (b): real weights, held-out prompts, greedy: plain against MTP (the model's head)
    and n-gram at each batch size; outputs must be identical to plain."""
    from jmtp import LLM, SamplingParams, SpeculativeConfig
    from jmtp.model import load_checkpoint, load_tokenizer
    from jmtp.model.checkpoints.loader import resolve_checkpoint, shipped_head_path
    from jmtp.model.checkpoints.mtp_head import head_metadata
    from jmtp.runtime.host.outputs import SpecDecodeMetrics
    sys.path.insert(0, HERE)
    from eval_acceptance import eval_prompts

    deadline = time.perf_counter() + a.seconds
    head = a.mtp_head if a.mtp_head != "auto" else shipped_head_path(resolve_checkpoint(a.model)[0])
    cfg, params = load_checkpoint(a.model, mtp_head=head)
    tok = load_tokenizer(a.model)
    meta = head_metadata(str(head)) if head is not None else {}
    ns = argparse.Namespace(eval_frac=None, split_seed=None, num_prompts=a.num_prompts)
    prompts = eval_prompts(tok, meta, ns)
    batches = [int(x) for x in a.batches.split(",")]
    sp = SamplingParams(max_tokens=a.max_tokens, temperature=0.0)
    variants = [("plain", None)] + [(f"mtp K={k}", SpeculativeConfig("mtp", k))
                                    for k in map(int, a.ks.split(","))]
    if a.ngram_k:
        variants.append((f"ngram K={a.ngram_k}", SpeculativeConfig("ngram", a.ngram_k)))
    out = {"device": device_info(), "model": str(resolve_checkpoint(a.model)[0]),
           "head": str(head), "num_prompts": len(prompts), "max_tokens": a.max_tokens, "rows": []}
    longest = max(map(len, prompts))
    plain_outs = {}
    if a.plain_from:
        with open(a.plain_from) as f:
            prev = json.load(f)
        for r in prev["rows"]:
            if r["method"] == "plain" and r["batch"] in batches and "outputs" in r:
                out["rows"].append({**r, "reused_from": a.plain_from})
                plain_outs[r["batch"]] = r["outputs"]
        variants = [v for v in variants if v[0] != "plain" or len(plain_outs) < len(batches)]
    for label, spec in variants:
        if time.perf_counter() > deadline:
            out["cut_short"] = True
            break
        t0 = time.perf_counter()
        llm = LLM(model_config=cfg, params=params, tokenizer=tok, max_num_seqs=max(batches),
                  max_model_len=longest + a.max_tokens + 16, speculative_config=spec,
                  compile="lazy")
        steps: dict = {}
        run = llm.llm_engine.runner.run_step
        seen: set = set()

        def timed(bucket, chunks, limits, guide=None, run=run, steps=steps, seen=seen):
            t = time.perf_counter()
            o = run(bucket, chunks, limits, guide)
            if not chunks.any() and bucket in seen:
                steps.setdefault(bucket.label, []).append(time.perf_counter() - t)
            seen.add(bucket)
            return o

        llm.llm_engine.runner.run_step = timed
        build = time.perf_counter() - t0
        for b in batches:
            if time.perf_counter() > deadline:
                out["cut_short"] = True
                break
            group = prompts[:max(b, min(len(prompts), a.prompts_per_batch * b))]
            t1 = time.perf_counter()
            llm.generate(group[:b], SamplingParams(max_tokens=4, temperature=0.0),
                         use_tqdm=False)              # compiles this batch's buckets
            warm = time.perf_counter() - t1
            steps.clear()
            t1 = time.perf_counter()
            outs = llm.generate(group, sp, use_tqdm=False)
            dt = time.perf_counter() - t1
            n = sum(len(o.outputs[0].token_ids) for o in outs)
            ids = [list(o.outputs[0].token_ids) for o in outs]
            row = {"method": label, "batch": b, "prompts": len(group), "tokens": n,
                   "seconds": dt, "tok_s": n / dt, "warmup_seconds": warm,
                   "build_seconds": build,
                   "step_seconds": {k: statistics.median(v) for k, v in steps.items()},
                   "steps": {k: len(v) for k, v in steps.items()}}
            if spec is None:
                plain_outs[b] = row["outputs"] = ids
            else:
                tot = SpecDecodeMetrics(accepted_per_position=[0] * spec.num_speculative_tokens)
                for o in outs:
                    tot.merge(o.metrics)
                row["mean_acceptance_length"] = tot.mean_acceptance_length
                row["per_position_acceptance"] = [c / max(tot.num_decode_steps, 1)
                                                  for c in tot.accepted_per_position]
                row["identical_to_plain"] = ids == plain_outs.get(b)
                base = next((r for r in out["rows"] if r["method"] == "plain"
                             and r["batch"] == b), None)
                if base is not None:
                    row["speedup"] = row["tok_s"] / base["tok_s"]
            out["rows"].append(row)
            print(json.dumps({k: v for k, v in row.items()
                              if k not in ("step_seconds", "steps", "outputs")}), flush=True)
            _dump(a.json, out)
        del llm
        gc.collect()
    _dump(a.json, out)
    bad = [r for r in out["rows"] if r.get("identical_to_plain") is False]
    return 1 if bad else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("kernels", "rows", "speedup"):
        p = sub.add_parser(name)
        p.add_argument("--json", required=True)
        p.add_argument("--seconds", type=float, default=120.0,
                       help="start no new measurement after this")
        p.add_argument("--tiny", action="store_true", help="CPU rehearsal sizes")
    p = sub.choices["rows"]
    p.add_argument("--batches", default="1,8,64")
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--context", type=int, default=256, help="prompt tokens per request")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--shapes", default="", help="indices of the shapes to run (default all: "
                   "0 SmolLM2-shaped, 1 Llama-3-8B-shaped)")
    p.add_argument("--methods", default="plain,mtp,ngram")
    p = sub.choices["speedup"]
    p.add_argument("--model", default=None)
    p.add_argument("--mtp-head", default="auto")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--ks", default="1,3")
    p.add_argument("--ngram-k", type=int, default=3)
    p.add_argument("--num-prompts", type=int, default=0, help="held-out prompts (0 = all)")
    p.add_argument("--prompts-per-batch", type=int, default=2,
                   help="prompts per run = this x the batch size (a queue)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--plain-from", default=None,
                   help="a speedup JSON of the same prompts: take its plain rows (and outputs) "
                        "instead of running plain decoding again")
    a = ap.parse_args(argv)
    return {"kernels": cmd_kernels, "rows": cmd_rows, "speedup": cmd_speedup}[a.cmd](a)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(HERE))
    raise SystemExit(main())
