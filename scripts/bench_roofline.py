#!/usr/bin/env python
"""Batch-1 decode against the memory roofline: how many of the machine's bytes/s the engine uses.

A batch-1 decode step of a small model is memory-bound: every weight is read once per step, so the
fastest possible step is ``parameter bytes / memory bandwidth``. This script measures both, in one
process:

* the machine's memory bandwidth (best of several 512 MB reductions and copies, numpy and XLA);
* the target forward (+ LM head) over T = 1, 2, 4, 8 rows of one sequence (the verify-window cost
  model: how step time grows with rows) and its parts — attention layers (norm, q/k/v/o
  projections, KV write, paged attention), MLPs, LM head — each as bytes read / time;
* the whole engine step (``LLM.generate`` at batch 1, plain decoding): per-step time minus the
  forward = sampling/verify/update + host loop;
* with ``--layers stacked,unstacked``: the same for both layer layouts
  (:func:`jmtp.model.llama.unstack_layers`), interleaved A/B;
* with ``--vs-hf``: plain greedy tokens/s of jmtp vs HF transformers on the same GGUF (fp32,
  batch 1, same chat prompts, ``--max-tokens`` new tokens each), interleaved, outputs compared.

Times are medians of ``--iters`` interleaved runs (the variants alternate), so a machine shared with
other work still gives usable ratios; compile times are reported separately.

    python scripts/bench_roofline.py                      # roofline table, stacked layers
    python scripts/bench_roofline.py --layers stacked,unstacked --rows 1,4
    python scripts/bench_roofline.py --vs-hf --max-tokens 64
"""
from __future__ import annotations

import argparse
import functools
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jmtp.model import init_kv_cache, load_checkpoint, ragged_batch
from jmtp.model import llama

BLOCK = 16
CHAT = [
    "Write a Python function that checks whether a string is a palindrome.",
    "Explain what a hash map is in three sentences.",
    "What is the capital of Japan and what is it famous for?",
    "Give me a recipe for a simple tomato pasta.",
]


# ------------------------------------------------------------------------------------ bandwidth
def memory_bandwidth(mb: int = 512, reps: int = 5) -> dict:
    """Best-of-``reps`` GB/s of a sum (read) and a copy (read + write) over ``mb`` MB, numpy and XLA."""
    a = np.ones(mb * 2**20 // 4, np.float32)
    b = np.empty_like(a)
    x = jnp.asarray(a)
    jsum = jax.jit(jnp.sum)
    jsum(x).block_until_ready()

    def best(f, nbytes):
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            f()
            ts.append(time.perf_counter() - t0)
        return nbytes / min(ts) / 1e9

    out = {"numpy_sum": best(lambda: a.sum(), a.nbytes),
           "numpy_copy": best(lambda: np.copyto(b, a), 2 * a.nbytes),
           "xla_sum": best(lambda: jsum(x).block_until_ready(), a.nbytes)}
    del a, b, x
    return out


#: ``--layers`` variant -> ``LLM(layer_loop=...)`` of its engine (the default, ``"auto"``, is
#: unrolled on CPU).
LOOPS = {"stacked": "scan", "unstacked": "unrolled"}


# ------------------------------------------------------------------------------------ bytes
def nbytes(tree) -> int:
    return sum(int(np.prod(l.shape)) * l.dtype.itemsize for l in jax.tree_util.tree_leaves(tree))


def component_bytes(params: dict) -> dict:
    """Bytes each part of a batch-1 step reads (weights only; the KV cache and the embedding
    gather of T rows are not counted)."""
    layers = params["layers"]
    if isinstance(layers, (list, tuple)):
        layers = {k: [l[k] for l in layers] for k in layers[0]}
    attn = {k: v for k, v in layers.items() if k not in ("mlp_norm", "w_gate", "w_up", "w_down")}
    mlp = {k: layers[k] for k in ("mlp_norm", "w_gate", "w_up", "w_down")}
    head = params.get("lm_head", params["embed"])
    return {"attention": nbytes(attn), "mlp": nbytes(mlp),
            "lm_head": nbytes(head) + nbytes(params["final_norm"])}


# ------------------------------------------------------------------------------------ parts
def _meta(t, context, pages):
    tables = jnp.arange(pages, dtype=jnp.int32)[None]
    return ragged_batch(jnp.array([t], jnp.int32), jnp.array([context], jnp.int32), tables, BLOCK, t)


@functools.partial(jax.jit, static_argnums=(0, 4, 5, 6), donate_argnums=(3,))
def _full(cfg, params, ids, cache, context, pages, part):
    """``part``: "forward" (layers + LM head), "layers", "attention" (attention half of every
    layer), "mlp" (MLP half of every layer), "lm_head"."""
    t = ids.shape[0]
    positions, meta = _meta(t, context, pages)
    if part == "lm_head":
        return llama.compute_logits(params, params["embed"][ids]), cache
    if part in ("forward", "layers"):
        h, cache = llama.forward(cfg, params, ids, positions, meta, cache)
        return (llama.compute_logits(params, h) if part == "forward" else h), cache
    # Half layers: the model's decoder_layer with the other half's weights zeroed would still read
    # them, so run the matching half of the block on the same layer layout instead.
    x = params["embed"][ids]
    layers = params["layers"]

    def attn_half(x, p, kc, vc, i):
        q, k, v = llama.project_qkv(cfg, p, x, positions)
        view = llama._layer_view(meta, llama.KVCache(cache.k, cache.v), i)
        if t == 1:
            k, v = (jnp.concatenate([a, jnp.zeros_like(a)], 0) for a in (k, v))
            slots = jnp.concatenate([view.slot_mapping, jnp.full((1,), -1, jnp.int32)])
        else:
            slots = view.slot_mapping
        kc, vc = llama.write_kv(kc, vc, k, v, slots)
        a = llama.ragged_paged_attention(q, kc, vc, view.kv_lens, view.block_tables, view.cu_q_lens,
                                         sm_scale=cfg.head_dim ** -0.5)
        return x + a.reshape(t, cfg.q_size) @ p["wo"], kc, vc

    def mlp_half(x, p, kc, vc, i):
        h = llama.rms_norm(x, p["mlp_norm"], cfg.rms_norm_eps)
        return x + (jax.nn.silu(h @ p["w_gate"]) * (h @ p["w_up"])) @ p["w_down"], kc, vc

    half = attn_half if part == "attention" else mlp_half
    kc, vc = llama._flat(cache.k), llama._flat(cache.v)
    if isinstance(layers, (list, tuple)):
        for i, p in enumerate(layers):
            x, kc, vc = half(x, p, kc, vc, i)
    else:
        n = jax.tree_util.tree_leaves(layers)[0].shape[0]
        (x, kc, vc), _ = jax.lax.scan(lambda c, ip: (half(c[0], ip[1], c[1], c[2], ip[0]), None),
                                      (x, kc, vc), (jnp.arange(n), layers))
    return x, llama.KVCache(kc.reshape(cache.k.shape), vc.reshape(cache.v.shape))


def time_parts(cfg, variants: dict, parts, rows, context, num_blocks, pages, iters):
    """Median ms of every (variant, part, T), variants interleaved; also first-call seconds."""
    res, first = {}, {}
    for t in rows:
        ids = jnp.asarray(np.arange(t) % cfg.vocab_size, jnp.int32)
        for part in parts:
            caches = {}
            for name, params in variants.items():
                cache = init_kv_cache(cfg, cfg.num_layers, num_blocks, BLOCK, params["embed"].dtype)
                t0 = time.perf_counter()
                out, cache = _full(cfg, params, ids, cache, context, pages, part)
                out.block_until_ready()
                first[(name, part, t)] = time.perf_counter() - t0
                caches[name] = cache
            times = {name: [] for name in variants}
            for _ in range(iters):
                for name, params in variants.items():
                    t0 = time.perf_counter()
                    out, caches[name] = _full(cfg, params, ids, caches[name], context, pages, part)
                    out.block_until_ready()
                    times[name].append(time.perf_counter() - t0)
            for name in variants:
                res[(name, part, t)] = 1e3 * float(np.median(times[name]))
            del caches
    return res, first


def engine_step_ms(cfg, variants: dict, tok, max_tokens, iters):
    """Median ms per decode step of ``LLM.generate`` (batch 1, plain), variants interleaved."""
    from jmtp import LLM, SamplingParams
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": CHAT[0]}]))
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    llms = {}
    for name, params in variants.items():
        llms[name] = LLM(model_config=cfg, params=params, tokenizer=tok, max_num_seqs=1,
                         max_model_len=512, layer_loop=LOOPS[name])
        llms[name].generate([prompt], sp, use_tqdm=False)
    times = {name: [] for name in variants}
    for _ in range(iters):
        for name, llm in llms.items():
            llm.generate([prompt], sp, use_tqdm=False)
            st = llm.last_run_stats
            times[name].append(1e3 * st["seconds"] / st["steps"])
    return {name: float(np.median(v)) for name, v in times.items()}


# ------------------------------------------------------------------------------------ vs HF
def load_hf():
    import gguf
    import torch
    import transformers
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
    from conftest import SMOLLM2_FILE, _smollm2_dir
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    saved = gguf.GGUFReader, gguf.get_tensor_name_map   # memoised while loading (speed only)
    gguf.GGUFReader = functools.lru_cache(maxsize=None)(saved[0])
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(saved[1])
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            _smollm2_dir(), gguf_file=SMOLLM2_FILE, dtype=torch.float32)
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = saved
    return model.eval()


def vs_hf(cfg, variants, tok, max_tokens, iters, torch_threads):
    import torch
    torch.set_num_threads(torch_threads)
    hf = load_hf()
    from jmtp import LLM, SamplingParams
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}])) for q in CHAT]
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    llms = {name: LLM(model_config=cfg, params=p, tokenizer=tok, max_num_seqs=1, max_model_len=512,
                      layer_loop=LOOPS[name]) for name, p in variants.items()}

    def run_jmtp(llm):
        t0 = time.perf_counter()
        outs = [list(llm.generate([p], sp, use_tqdm=False)[0].token_ids) for p in prompts]
        return time.perf_counter() - t0, outs

    def run_hf():
        t0 = time.perf_counter()
        outs = []
        with torch.no_grad():
            for p in prompts:
                o = hf.generate(torch.tensor([p]), max_new_tokens=max_tokens,
                                min_new_tokens=max_tokens, do_sample=False)
                outs.append(o[0, len(p):].tolist())
        return time.perf_counter() - t0, outs

    for llm in llms.values():
        run_jmtp(llm)                                   # warm-up: compile every bucket used
    run_hf()
    n = max_tokens * len(prompts)
    times = {name: [] for name in llms} | {"hf": []}
    outs = {}
    for r in range(iters):
        dt, outs["hf"] = run_hf()
        times["hf"].append(dt)
        for name, llm in llms.items():
            dt, outs[name] = run_jmtp(llm)
            times[name].append(dt)
        print("  round %d: " % r + "  ".join(f"{k} {n / v[-1]:.1f} tok/s" for k, v in times.items()),
              flush=True)
    print(f"\nvs HF transformers greedy (fp32, batch 1, {len(prompts)} prompts x {max_tokens} "
          f"tokens, torch threads={torch_threads}, {iters} interleaved rounds, medians)")
    hf_tps = n / float(np.median(times["hf"]))
    print(f"  {'hf':>10}: {hf_tps:6.1f} tok/s")
    for name in llms:
        tps = n / float(np.median(times[name]))
        ratios = np.array(times["hf"]) / np.array(times[name])
        same = sum(a == b for a, b in zip(outs[name], outs["hf"]))
        print(f"  {name:>10}: {tps:6.1f} tok/s  = {np.median(ratios):.2f}x HF (per-round "
              f"{' '.join(f'{x:.2f}' for x in ratios)}); outputs identical to HF: {same}/{len(prompts)}")


# ------------------------------------------------------------------------------------ main
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--layers", default="stacked", help="comma list of stacked, unstacked")
    ap.add_argument("--rows", default="1,2,4,8", help="T values of the forward cost model")
    ap.add_argument("--context", type=int, default=128, help="cached tokens before the T rows")
    ap.add_argument("--num-blocks", type=int, default=40, help="KV blocks in the cache")
    ap.add_argument("--pages", type=int, default=32, help="block-table width (pages per sequence)")
    ap.add_argument("--iters", type=int, default=9)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--no-parts", action="store_true", help="skip the per-component timing")
    ap.add_argument("--no-engine", action="store_true", help="skip the engine step timing")
    ap.add_argument("--vs-hf", action="store_true", help="also compare with HF transformers greedy")
    ap.add_argument("--torch-threads", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args(argv)
    names = args.layers.split(",")
    if any(n not in ("stacked", "unstacked") for n in names):
        raise ValueError(f"--layers entries must be stacked or unstacked, got {args.layers!r}")
    rows = [int(x) for x in args.rows.split(",")]
    if (args.context + max(rows)) > args.pages * BLOCK or args.pages > args.num_blocks:
        raise ValueError("--context + max(--rows) must fit in --pages blocks, --pages <= --num-blocks")

    print(f"backend={jax.default_backend()} cpus={os.cpu_count()} jax={jax.__version__} "
          f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")
    bw = memory_bandwidth()
    roof = max(bw.values())
    print("memory bandwidth (best of 5, 512 MB): " + "  ".join(f"{k} {v:.1f} GB/s" for k, v in bw.items()))

    from jmtp.model import load_tokenizer
    cfg, params = load_checkpoint(args.model)
    params = {k: v for k, v in params.items() if k != "mtp"}
    tok = load_tokenizer(args.model)
    variants = {n: (llama.unstack_layers(params) if n == "unstacked" else params) for n in names}
    cb = component_bytes(params)
    total = sum(cb.values())
    print(f"weights read per batch-1 step: {total / 1e6:.1f} MB (" + ", ".join(
        f"{k} {v / 1e6:.1f}" for k, v in cb.items()) + f"); roofline step {1e3 * total / roof / 1e9:.1f} ms"
          f" = {roof * 1e9 / total:.1f} tok/s at {roof:.1f} GB/s")

    if not args.no_parts:
        parts = ["forward", "layers", "attention", "mlp", "lm_head"]
        res, first = time_parts(cfg, variants, parts, rows, args.context, args.num_blocks,
                                args.pages, args.iters)
        pbytes = {"forward": total, "layers": cb["attention"] + cb["mlp"],
                  "attention": cb["attention"], "mlp": cb["mlp"], "lm_head": cb["lm_head"]}
        print(f"\nforward parts, T rows of one sequence after {args.context} cached tokens "
              f"(num_blocks={args.num_blocks}, pages={args.pages}); median of {args.iters}")
        print(f"{'layers':>10} {'part':>10} {'T':>3} {'ms':>8} {'GB/s':>7} {'roofline':>8} "
              f"{'x T=1':>6} {'1st(s)':>7}")
        for name in names:
            for part in parts:
                for t in rows:
                    ms = res[(name, part, t)]
                    gbs = pbytes[part] / ms / 1e6
                    print(f"{name:>10} {part:>10} {t:>3} {ms:8.2f} {gbs:7.1f} {gbs / roof:8.0%} "
                          f"{ms / res[(name, part, rows[0])]:6.2f} {first[(name, part, t)]:7.1f}")
    if not args.no_engine:
        eng = engine_step_ms(cfg, variants, tok, args.max_tokens, args.iters)
        print(f"\nengine (LLM.generate, batch 1, plain, {args.max_tokens} tokens, prefill step "
              "included): ms per step")
        for name, ms in eng.items():
            line = f"  {name:>10}: {ms:.2f} ms/step = {1e3 / ms:.1f} tok/s; {total / ms / 1e6:.1f} GB/s " \
                   f"= {total / ms / 1e6 / roof:.0%} of roofline"
            if not args.no_parts and 1 in rows:
                fwd = res[(name, "forward", 1)]
                line += f"; forward T=1 {fwd:.2f} ms, rest (sampling/verify/update/host) {ms - fwd:.2f} ms"
            print(line)
    if args.vs_hf:
        vs_hf(cfg, variants, tok, args.max_tokens, max(3, args.iters // 3), args.torch_threads)


if __name__ == "__main__":
    main()
