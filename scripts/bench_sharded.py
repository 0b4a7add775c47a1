"""Step time and per-device memory of the engine per mesh shape ``(data, model)``, in one run.

For every mesh in ``--meshes`` (``DATAxMODEL``, e.g. ``1x1,1x2,1x4,2x1,2x2``) and every
speculation setting in ``--ks`` (0 = plain decoding, 3 = MTP with K=3 drafts) this builds an
``LLM(tensor_parallel_size=MODEL, data_parallel_size=DATA)`` (the persistent compilation cache
left off, so compile times are real), generates the same greedy batch twice (warm-up, then timed)
and prints one table:

* warm tok/s and ms/step of the greedy batch (median of ``--repeats`` timed runs after the
  warm-up), and the mean acceptance length;
* compile seconds, apart from the timing: with ``--compile lazy`` (default) the buckets the
  workload uses are compiled during the warm-up and compile s = warm-up wall - timed wall; with
  ``--compile eager`` every step bucket and insert/release are compiled at construction and
  compile s is their sum (slower: MTP engines have ~10 buckets of 3-7 s each on 2 cores);
* parameter and KV-cache bytes on one device (``LLMEngine.memory_per_device()``; the KV column
  counts the MTP head's cache too);
* whether the greedy tokens and the seeded sampled tokens (temperature 0.8, fixed seeds) are
  identical to the ``1x1`` run of the same setting;
* ratios against ``1x1`` measured in this same run (step time, tok/s, parameter bytes per device).

A mesh the engine cannot build is a row of "n/a" with the engine's own reason (e.g. a
tensor-parallel size that does not divide the kv heads, or a data-parallel size that does not
divide ``--batch``).

Models: ``--model tiny`` (default) is a random Llama with 8 query and 8 kv heads (head_dim 32,
hidden 256, MLP 1024, vocabulary 2048, 4 layers, one-layer MTP head; sizes set by flags), so every
model-axis size in {1, 2, 4, 8} splits whole heads, the vocabulary and the MLP. Its MTP head is
random too, so its drafts are (almost) never accepted (acceptance length ~1.0): the MTP rows show
the cost of speculation under sharding, not its gain. ``--model smollm2``
loads the default SmolLM2-135M-Instruct GGUF with its shipped, trained MTP head (9 query / 3 kv
heads: the model axis can be 1 or 3; default meshes ``1x1,1x3,2x3``).

The script asks XLA for ``--host-devices`` CPU devices (``--xla_force_host_platform_device_count``,
default 8) before JAX starts, unless ``XLA_FLAGS`` already sets that count.

**On CPU these numbers measure overhead, not scaling.** The "devices" XLA makes on the host all
share the same cores (2 on our CI machines); a mesh of N CPU devices has no more compute or
memory bandwidth than one, and its collectives are in-process copies. A step-time ratio above 1
against ``1x1`` is the cost of partitioning (collectives, shard_map plumbing, smaller kernels), not
a prediction for TPU or GPU; docs/scaling.md holds the roofline for real hardware. What the CPU run
does show faithfully: per-device bytes (~1/TP of the sharded tensors) and token identity.

    python scripts/bench_sharded.py                                # tiny model, ~2-3 min
    python scripts/bench_sharded.py --model smollm2 --ks 3 --max-tokens 32
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

TINY_DEFAULTS = dict(vocab_size=2048, hidden_size=256, intermediate_size=1024, num_layers=4,
                     num_heads=8, num_kv_heads=8, head_dim=32)
DEFAULT_MESHES = {"tiny": "1x1,1x2,1x4,2x1,2x2", "smollm2": "1x1,1x3,2x3"}


def parse_meshes(text: str) -> list[tuple[int, int]]:
    """``"1x1,1x2,2x2"`` -> ``[(1, 1), (1, 2), (2, 2)]`` as ``(data, model)``.

    Raises:
      ValueError: an entry that is not ``DATAxMODEL`` with both sizes >= 1.
    """
    out = []
    for item in text.split(","):
        parts = item.strip().lower().split("x")
        if len(parts) != 2 or not all(p.isdigit() and int(p) >= 1 for p in parts):
            raise ValueError(f"--meshes: {item!r} is not DATAxMODEL with sizes >= 1 (e.g. 2x4)")
        out.append((int(parts[0]), int(parts[1])))
    if (1, 1) not in out:
        out.insert(0, (1, 1))            # the baseline every ratio is taken against
    return out


def force_host_devices(n: int) -> None:
    """Ask XLA:CPU for ``n`` host devices (must run before JAX initialises its backends)."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


def build_model(args):
    """``(ModelConfig, params, tokenizer or None)`` for ``--model``."""
    import jax
    if args.model == "smollm2":
        from jmtp.model import load_checkpoint, load_tokenizer
        cfg, params = load_checkpoint(None)
        return cfg, params, load_tokenizer(None)
    from jmtp.model import ModelConfig, init_params
    cfg = ModelConfig(**dict(TINY_DEFAULTS, hidden_size=args.hidden_size,
                             num_layers=args.num_layers, vocab_size=args.vocab_size),
                      eos_token_ids=(1,), num_mtp_layers=1)
    return cfg, init_params(cfg, jax.random.key(args.seed), std=args.init_std), None


def make_prompts(args, cfg, tok) -> list[list[int]]:
    """``--batch`` prompts: chat-formatted questions (SmolLM2) or random ids of 4..12 tokens."""
    import numpy as np
    if tok is not None:
        from bench_generate import QUESTIONS
        return [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]))
                for q in (QUESTIONS * args.batch)[: args.batch]]
    rng = np.random.default_rng(args.seed)
    return [rng.integers(2, cfg.vocab_size, size=int(rng.integers(4, 13))).tolist()
            for _ in range(args.batch)]


def run_one(args, cfg, params, tok, prompts, dp: int, tp: int, k: int) -> dict:
    """Build the engine for one mesh and setting, time it, return its row (or ``{"na": why}``)."""
    from jmtp import LLM, SamplingParams, SpeculativeConfig
    from jmtp.runtime.host.outputs import SpecDecodeMetrics

    spec = SpeculativeConfig("mtp", k) if k else None
    try:
        llm = LLM(model_config=cfg, params=params, tokenizer=tok, speculative_config=spec,
                  max_num_seqs=args.batch, max_model_len=args.max_model_len,
                  max_num_batched_tokens=args.max_num_batched_tokens, compile=args.compile,
                  compilation_cache_dir=None, tensor_parallel_size=tp, data_parallel_size=dp)
    except ValueError as e:
        msg = str(e)
        return {"na": "n/a (" + msg.split(" (")[0][:60] + ")", "why": msg}
    eng = llm.llm_engine
    greedy = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    llm.generate(prompts, greedy, use_tqdm=False)     # warm-up (lazy: compiles the buckets used)
    first_s = time.perf_counter() - t0
    walls = []
    for _ in range(args.repeats):      # same prompts, same buckets: nothing compiles any more
        t0 = time.perf_counter()
        outs = llm.generate(prompts, greedy, use_tqdm=False)
        walls.append(time.perf_counter() - t0)
    dt = statistics.median(walls)
    steps = llm.last_run_stats["steps"]
    if args.compile == "eager":        # every bucket, timed one by one at construction
        compile_s = sum(eng.compile_seconds.values())
    else:                              # the buckets this workload uses, compiled in the warm-up
        compile_s = first_s - dt
    sampled = llm.generate(prompts, [SamplingParams(max_tokens=args.max_tokens, ignore_eos=True,
                                                    temperature=0.8, seed=1000 + i)
                                     for i in range(len(prompts))], use_tqdm=False)
    metrics = SpecDecodeMetrics(accepted_per_position=[0] * k)
    for o in outs:
        metrics.merge(o.metrics)
    mem = eng.memory_per_device()
    print(f"  {dp}x{tp} K={k}: {dt / steps * 1e3:.2f} ms/step, compile {compile_s:.1f} s",
          file=sys.stderr, flush=True)
    return dict(tok_s=sum(len(o.token_ids) for o in outs) / dt, ms_step=dt / steps * 1e3,
                steps=steps, accept=metrics.mean_acceptance_length if k else 1.0,
                compile_s=compile_s, params=mem["params"], kv=mem["kv_cache"],
                tokens=[o.token_ids for o in outs], sampled=[o.token_ids for o in sampled])


def mib(n: int) -> str:
    return f"{n / 2**20:.2f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=("tiny", "smollm2"), default="tiny")
    ap.add_argument("--meshes", default=None,
                    help="comma-separated DATAxMODEL shapes; default "
                         f"{DEFAULT_MESHES['tiny']} (tiny), {DEFAULT_MESHES['smollm2']} (smollm2)")
    ap.add_argument("--ks", default="0,3", help="num_speculative_tokens per run; 0 = no speculation")
    ap.add_argument("--batch", type=int, default=2, help="prompts, and max_num_seqs")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--max-model-len", type=int, default=128)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None,
                    help="token budget per step; default batch*(max K+1), at least 8 (a small "
                         "budget means few step buckets to compile)")
    ap.add_argument("--repeats", type=int, default=5,
                    help="timed runs after the warm-up; ms/step and tok/s are their medians")
    ap.add_argument("--compile", choices=("lazy", "eager"), default="lazy",
                    help="lazy: compile the buckets the workload uses (compile s = first run - "
                         "warm run); eager: every bucket at construction (compile s = their sum)")
    ap.add_argument("--host-devices", type=int, default=8,
                    help="XLA CPU devices to create (unless XLA_FLAGS already sets a count)")
    ap.add_argument("--hidden-size", type=int, default=TINY_DEFAULTS["hidden_size"])
    ap.add_argument("--num-layers", type=int, default=TINY_DEFAULTS["num_layers"])
    ap.add_argument("--vocab-size", type=int, default=TINY_DEFAULTS["vocab_size"])
    ap.add_argument("--init-std", type=float, default=0.1, help="tiny model: weight init std")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    try:
        meshes = parse_meshes(args.meshes or DEFAULT_MESHES[args.model])
        ks = [int(x) for x in args.ks.split(",")]
    except ValueError as e:
        ap.error(str(e))
    for name, v, lo in (("--batch", args.batch, 1), ("--max-tokens", args.max_tokens, 1),
                        ("--host-devices", args.host_devices, 1), ("--repeats", args.repeats, 1)):
        if v < lo:
            ap.error(f"{name} must be >= {lo}, got {v}")
    if any(x < 0 for x in ks):
        ap.error(f"--ks must be >= 0, got {args.ks}")
    if args.max_num_batched_tokens is None:
        args.max_num_batched_tokens = max(8, args.batch * (max(ks) + 1))

    force_host_devices(args.host_devices)   # before the first `import jax`
    import jax

    cfg, params, tok = build_model(args)
    prompts = make_prompts(args, cfg, tok)
    devs = jax.devices()
    print(f"model={args.model} L={cfg.num_layers} H={cfg.hidden_size} Nq={cfg.num_heads} "
          f"Nkv={cfg.num_kv_heads} D={cfg.head_dim} I={cfg.intermediate_size} V={cfg.vocab_size} "
          f"batch={args.batch} max_tokens={args.max_tokens} devices={len(devs)}x"
          f"{devs[0].platform} ({os.cpu_count()} host cores)")
    if devs[0].platform == "cpu":
        print("note: CPU devices share the host's cores; ratios measure partitioning overhead, "
              "not scaling")

    rows = {}
    t_all = time.perf_counter()
    for k in ks:
        for dp, tp in meshes:
            rows[(k, dp, tp)] = run_one(args, cfg, params, tok, prompts, dp, tp, k)

    head = (f"{'mesh':>5} {'K':>2} {'tok/s':>8} {'ms/step':>8} {'steps':>5} {'acc.len':>7} "
            f"{'compile s':>9} {'params MiB/dev':>15} {'KV MiB/dev':>13} "
            f"{'greedy=1x1':>10} {'sampled=1x1':>11} {'step/1x1':>8} {'tok/s/1x1':>9} "
            f"{'param/1x1':>9}")
    print()
    print(head)
    print("-" * len(head))
    for k in ks:
        base = rows[(k, 1, 1)]
        for dp, tp in meshes:
            r = rows[(k, dp, tp)]
            name = f"{dp}x{tp}"
            if "na" in r:
                print(f"{name:>5} {k:>2} {r['na']}")
                continue
            same = "base" if (dp, tp) == (1, 1) else ("yes" if r["tokens"] == base["tokens"] else "NO")
            same_s = "base" if (dp, tp) == (1, 1) else ("yes" if r["sampled"] == base["sampled"] else "NO")
            print(f"{name:>5} {k:>2} {r['tok_s']:8.1f} {r['ms_step']:8.2f} {r['steps']:5d} "
                  f"{r['accept']:7.2f} {r['compile_s']:9.1f} "
                  f"{mib(r['params'][0]):>7}/{mib(r['params'][1]):<7} "
                  f"{mib(r['kv'][0]):>6}/{mib(r['kv'][1]):<6} {same:>10} {same_s:>11} "
                  f"{r['ms_step'] / base['ms_step']:8.2f} {r['tok_s'] / base['tok_s']:9.2f} "
                  f"{r['params'][0] / base['params'][0]:9.3f}")
    print()
    print("params/KV columns: MiB on one device / total; compile s: "
          + ("every step bucket + insert/release" if args.compile == "eager" else
             "warm-up wall - timed wall (the buckets used)")
          + "; ratios against 1x1 of the same K, this run")
    for (k, dp, tp), r in rows.items():
        if "na" in r:
            print(f"{dp}x{tp} K={k}: {r['why']}")
    print(f"total {time.perf_counter() - t_all:.0f} s")


if __name__ == "__main__":
    main()
