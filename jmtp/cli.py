"""``jmtp`` command line: ``jmtp generate``, ``jmtp serve`` and ``jmtp launch`` (also
``python -m jmtp ...``)."""
from __future__ import annotations

import argparse
import json
import sys
import time


#: Batch slots of ``jmtp serve`` (and of ``generate`` with at least this many prompts).
DEFAULT_MAX_NUM_SEQS = 8


def build_llm(args):
    """The :class:`jmtp.LLM` described by the engine options of :func:`add_engine_args`."""
    from jmtp.runtime.config import SpeculativeConfig
    from jmtp.runtime.engine import LLM

    spec = None
    if not args.no_spec:
        spec = SpeculativeConfig(
            args.speculative_method, args.num_speculative_tokens, args.num_model_steps,
            draft_vocab_size=args.draft_vocab_size, mtp_strategy=args.mtp_strategy,
            max_ngram_size=args.max_ngram_size, min_ngram_size=args.min_ngram_size,
            speculation_policy=args.speculation_policy)
    cache = args.compilation_cache_dir
    max_num_seqs = DEFAULT_MAX_NUM_SEQS if args.max_num_seqs is None else args.max_num_seqs
    return LLM(args.model, speculative_config=spec, max_num_seqs=max_num_seqs,
               max_model_len=args.max_model_len, num_blocks=args.num_blocks,
               attention_backend=args.attention_backend, block_allocator=args.block_allocator,
               kv_cache_dtype=None if args.kv_cache_dtype == "auto" else args.kv_cache_dtype,
               max_logprobs=args.max_logprobs,
               seed=args.seed, mtp_head=None if args.mtp_head == "none" else args.mtp_head,
               compile=args.compile, compilation_cache_dir=None if cache == "none" else cache,
               tensor_parallel_size=getattr(args, "tensor_parallel_size", 1),
               data_parallel_size=getattr(args, "data_parallel_size", 1),
               enable_prefix_caching=getattr(args, "enable_prefix_caching", False),
               layer_loop=getattr(args, "layer_loop", "auto"))


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The engine options ``jmtp generate`` and ``jmtp serve`` share."""
    p.add_argument("--model", default=None, help="GGUF file or HF directory (default: SmolLM2-135M)")
    p.add_argument("--speculative-method", default="mtp", choices=["mtp", "ngram"],
                   help="drafter: the model's MTP head, or n-gram matches of the prompt and history")
    p.add_argument("--num-speculative-tokens", type=int, default=3)
    p.add_argument("--num-model-steps", type=int, default=None)
    p.add_argument("--mtp-strategy", default="default", choices=["default", "with_ngram"],
                   help="with_ngram: n-gram matches extend the MTP drafts up to K (hybrid)")
    p.add_argument("--max-ngram-size", type=int, default=5)
    p.add_argument("--min-ngram-size", type=int, default=None)
    p.add_argument("--speculation-policy", default="fixed", choices=["fixed", "dynamic"],
                   help="dynamic: per-slot draft counts follow measured acceptance and step cost")
    p.add_argument("--no-spec", action="store_true", help="plain decoding (no speculation)")
    p.add_argument("--draft-vocab-size", type=int, default=None,
                   help="FR-Spec draft vocabulary (default: the MTP head's own; 0 = full vocabulary)")
    p.add_argument("--mtp-head", default="auto",
                   help="MTP head file (default 'auto': the checkpoint's own, else the head jmtp "
                        "ships for it; 'none': a fresh, untrained head)")
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help="batch slots (default: generate: min(8, number of prompts); serve: 8)")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--num-blocks", type=int, default=None,
                   help="KV blocks (default: every slot can hold max-model-len tokens)")
    p.add_argument("--max-logprobs", type=int, default=0,
                   help="largest logprobs / top_logprobs served (0: logprobs off)")
    p.add_argument("--seed", type=int, default=0, help="seeds requests that send no seed")
    p.add_argument("--attention-backend", default=None,
                   choices=[None, "reference", "xla", "pallas_tpu", "pallas_gpu"])
    p.add_argument("--block-allocator", default="auto",
                   choices=["auto", "reference", "pallas_tpu", "pallas_gpu"],
                   help="on-device KV-block allocator (auto: the Pallas TPU kernel on TPU, the jnp "
                        "reference elsewhere; a state too large for TPU SMEM runs the reference)")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="devices of the tensor-parallel ('model') mesh axis; must divide the "
                        "query and kv heads (on CPU: XLA_FLAGS=--xla_force_host_platform_"
                        "device_count=N gives N devices)")
    p.add_argument("--data-parallel-size", type=int, default=1,
                   help="devices of the data-parallel ('data') mesh axis: slots, KV blocks and "
                        "the step's token budget split into that many shards (must divide "
                        "--max-num-seqs, --num-blocks and --max-num-batched-tokens)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8", "fp8_e4m3"],
                   help="KV-cache storage (target and MTP caches): auto = the model dtype; int8 / "
                        "fp8_e4m3 = 8-bit values with one f32 scale per token per KV head")
    p.add_argument("--enable-prefix-caching", action="store_true",
                   help="reuse the target and MTP KV of cached full blocks of earlier requests "
                        "(shared prompt prefixes, multi-turn chats); one device only")
    p.add_argument("--layer-loop", choices=["auto", "scan", "unrolled"], default="auto",
                   help="scan: the target's layers under one lax.scan (fastest start-up); "
                        "unrolled: one graph node per layer (~20%% faster steps on CPU, where "
                        "the scan copies each layer's weights; start-up 3-4x longer, also from "
                        "the compilation cache); auto: unrolled on CPU with one device, else "
                        "scan. Default: auto for serve, scan for generate (a one-shot run, "
                        "where start-up dominates)")
    p.add_argument("--compile", choices=["eager", "lazy"], default=None,
                   help="eager: compile every step bucket at start-up (default, or "
                        "$JMTP_COMPILE); lazy: compile each bucket on first use")
    p.add_argument("--compilation-cache-dir", default="auto",
                   help="JAX persistent compilation cache folder (default 'auto': $JMTP_CACHE_DIR, "
                        "else ~/.cache/jmtp/xla; 'none': leave JAX's setting alone)")


def _generate(args) -> int:
    from jmtp.runtime import distributed as dist
    from jmtp.runtime.outputs import SpecDecodeMetrics
    from jmtp.runtime.sampling import SamplingParams

    # One process of a multi-process job (jmtp launch sets the variables): join it before
    # anything touches a device. Every process generates; only process 0 prints.
    dist.initialize_from_env()
    main_process = dist.is_main_process()
    say = print if main_process else (lambda *a, **k: None)

    prompts = list(args.prompt or [])
    if args.prompts_file:
        with open(args.prompts_file, encoding="utf-8") as f:
            for line in f:
                line = line.rstrip("\n")
                if not line.strip():
                    continue
                prompts.append(json.loads(line)["prompt"] if line.lstrip().startswith("{") else line)
    if not prompts:
        prompts = ["Write a Python function that checks whether a number is prime."]
    if args.max_num_seqs is None:
        # No more slots than prompts: every slot count adds step shapes to compile (at least
        # one slot per data shard).
        dp = max(getattr(args, "data_parallel_size", 1), 1)
        args.max_num_seqs = -(-min(DEFAULT_MAX_NUM_SEQS, len(prompts)) // dp) * dp
    t0 = time.perf_counter()
    llm = build_llm(args)
    compile_s = sum(llm.compile_seconds.values())
    load_s = time.perf_counter() - t0 - compile_s
    if args.chat:
        prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": p}])
                   for p in prompts]
    spec = llm.speculative_config
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    outs = llm.generate(prompts, sp, use_tqdm=len(prompts) > 1 and main_process)
    total = SpecDecodeMetrics(accepted_per_position=[0] * spec.k)
    for o in outs:
        say(f"--- prompt {o.request_id} ({len(o.prompt_token_ids)} tokens, "
            f"{len(o.token_ids)} generated, finish={o.finish_reason})")
        say(o.text)
        total.merge(o.metrics)
    st = llm.last_run_stats
    per_pos = ""
    if spec.enabled and total.num_decode_steps:
        per_pos = " per-position acceptance=" + ",".join(
            f"{c / total.num_decode_steps:.2f}" for c in total.accepted_per_position)
    lazy = " (incl. lazy compiles)" if not llm.compile_seconds else ""
    say(f"=== {st['generated_tokens']} tokens in {st['seconds']:.2f}s "
        f"({st['tokens_per_second']:.1f} tok/s{lazy}) "
        f"mean acceptance length={total.mean_acceptance_length:.2f}{per_pos}")
    say(f"=== start-up: load {load_s:.1f}s, compile {compile_s:.1f}s "
        f"({len(llm.compile_seconds)} executables, cache {llm.compilation_cache_dir or 'off'}); "
        f"generate {st['seconds']:.1f}s; total {time.perf_counter() - t0:.1f}s")
    if llm.mesh is not None:
        mem = llm.llm_engine.memory_per_device()
        say(f"=== mesh {dict(llm.mesh.shape)}: per device params "
            f"{mem['params'][0] / 2**20:.1f} of {mem['params'][1] / 2**20:.1f} MiB, KV caches "
            f"{mem['kv_cache'][0] / 2**20:.1f} of {mem['kv_cache'][1] / 2**20:.1f} MiB")
    kv = llm.llm_engine.kv_cache_bytes()
    say(f"=== KV cache ({llm.engine_config.kv_cache_dtype or 'model dtype'}): values "
        f"{kv['values'] / 2**20:.1f} MiB, scales {kv['scales'] / 2**20:.1f} MiB")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The ``jmtp`` argument parser (subcommands generate, serve, launch)."""
    p = argparse.ArgumentParser(prog="jmtp", description="MTP speculative decoding in JAX")
    sub = p.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="generate text (greedy by default) with MTP speculation")
    g.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    g.add_argument("--prompts-file", help="text file, one prompt per line (or JSONL with 'prompt')")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--chat", action="store_true", help="apply the model's chat template")
    add_engine_args(g)
    g.set_defaults(layer_loop="scan")    # one-shot: start-up (compiling or loading unrolled executables) dominates
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (needs the `serve` extra)")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--served-model-name", default=None,
                   help="model id in the API (default: SmolLM2-135M-Instruct or the model's "
                        "file/directory name)")
    s.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"])
    add_engine_args(s)
    from jmtp.launch import add_launch_args
    la = sub.add_parser("launch", help="run a jmtp subcommand as N processes of one "
                        "jax.distributed job on this host (e.g. jmtp launch -n 2 "
                        "--devices-per-process 2 -- generate --tensor-parallel-size 4)")
    add_launch_args(la)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.cmd == "launch":
            from jmtp.launch import run_launch
            return run_launch(args)
        if args.cmd == "serve":
            from jmtp.runtime import distributed as dist
            if dist.env_requested():
                raise ValueError("jmtp serve runs as one process; multi-process serving (each "
                                 "request broadcast to every process) is not implemented — "
                                 f"unset {', '.join(dist.ENV_VARS)}")
            import logging

            from jmtp.runtime.server import serve
            logging.basicConfig(level=args.log_level.upper(),
                                format="%(asctime)s %(levelname)s %(name)s: %(message)s")
            return serve(args)
        return _generate(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
