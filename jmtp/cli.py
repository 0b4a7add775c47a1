"""``jmtp`` command line: ``jmtp generate``, ``jmtp chat``, ``jmtp serve``, ``jmtp launch`` and
``jmtp compile`` (also ``python -m jmtp ...``)."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time


#: Batch slots of ``jmtp serve`` (and of ``generate`` with at least this many prompts).
DEFAULT_MAX_NUM_SEQS = 8


def build_llm(args):
    """The :class:`jmtp.LLM` described by the engine options of :func:`add_engine_args`."""
    from jmtp.runtime.config import SpeculativeConfig
    from jmtp.runtime.host.llm import LLM

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
               max_num_batched_tokens=getattr(args, "max_num_batched_tokens", None),
               attention_backend=args.attention_backend, block_allocator=args.block_allocator,
               kv_cache_dtype=None if args.kv_cache_dtype == "auto" else args.kv_cache_dtype,
               quantization=None if args.quantization == "auto" else args.quantization,
               max_logprobs=args.max_logprobs,
               seed=args.seed, mtp_head=None if args.mtp_head == "none" else args.mtp_head,
               compile=args.compile, compilation_cache_dir=None if cache == "none" else cache,
               tensor_parallel_size=getattr(args, "tensor_parallel_size", 1),
               data_parallel_size=getattr(args, "data_parallel_size", 1),
               enable_expert_parallel=getattr(args, "enable_expert_parallel", False),
               all2all_backend=getattr(args, "all2all_backend", "auto"),
               enable_prefix_caching=getattr(args, "enable_prefix_caching", False),
               layer_loop=getattr(args, "layer_loop", "auto"),
               batch_invariant=getattr(args, "batch_invariant", False),
               async_scheduling={"on": True, "off": False}.get(
                   getattr(args, "async_scheduling", "auto")))


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The engine options ``jmtp generate`` and ``jmtp serve`` share."""
    p.add_argument("--model", default=None, help="GGUF file or HF directory (default: SmolLM2-135M)")
    p.add_argument("--speculative-method", default="mtp", choices=["mtp", "ngram", "suffix"],
                   help="drafter: the model's MTP head, n-gram matches of the prompt and history, "
                        "or suffix decoding (suffix trees over prompts and earlier outputs)")
    p.add_argument("--num-speculative-tokens", type=int, default=3)
    p.add_argument("--num-model-steps", type=int, default=None)
    p.add_argument("--mtp-strategy", default="default",
                   choices=["default", "with_ngram", "with_suffix"],
                   help="with_ngram: n-gram matches extend the MTP drafts up to K (hybrid); "
                        "with_suffix: suffix drafts where the match is strong, MTP elsewhere")
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
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="token budget of one step, the largest step bucket (default 256, or "
                        "more when max-num-seqs x (K+1) needs it)")
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
    add_expert_parallel_args(p)
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8", "fp8_e4m3"],
                   help="KV-cache storage (target and MTP caches): auto = the model dtype; int8 / "
                        "fp8_e4m3 = 8-bit values with one f32 scale per token per KV head")
    add_quantization_arg(p)
    p.add_argument("--enable-prefix-caching", action="store_true",
                   help="reuse the target and MTP KV of cached full blocks of earlier requests "
                        "(shared prompt prefixes, multi-turn chats); one device only")
    p.add_argument("--batch-invariant", action="store_true",
                   help="every row's logits independent of its batch mates (fixed row tiles "
                        "and attention chunks): greedy speculative output equals plain decoding "
                        "bit for bit; slower steps (docs/architecture.md)")
    p.add_argument("--layer-loop", choices=["auto", "scan", "unrolled"], default="auto",
                   help="scan: the target's layers under one lax.scan (fastest start-up); "
                        "unrolled: one graph node per layer (~20%% faster steps on CPU, where "
                        "the scan copies each layer's weights; start-up 3-4x longer, also from "
                        "the compilation cache); auto: unrolled on CPU with one device, else "
                        "scan. Default: auto for serve, scan for generate and chat (where "
                        "start-up dominates)")
    p.add_argument("--compile", choices=["eager", "lazy"], default=None,
                   help="eager: compile every step bucket at start-up, so no request waits on "
                        "a compile; lazy: compile each bucket on first use. Default: "
                        "$JMTP_COMPILE, else lazy for generate (a one-shot run compiles only "
                        "what its prompts need) and chat (the rest compiles while the user "
                        "types) and eager for serve")
    p.add_argument("--async-scheduling", choices=["auto", "on", "off"], default="auto",
                   help="dispatch each step before reading the previous one's outputs, so host "
                        "work overlaps the device (same outputs); auto: on for GPU/TPU unless an "
                        "n-gram or suffix proposer runs, off on CPU (host and device share cores)")
    p.add_argument("--compilation-cache-dir", default="auto",
                   help="JAX persistent compilation cache folder (default 'auto': $JMTP_CACHE_DIR, "
                        "else ~/.cache/jmtp/xla; 'none': leave JAX's setting alone)")


def add_expert_parallel_args(p: argparse.ArgumentParser) -> None:
    """``--enable-expert-parallel`` and ``--all2all-backend`` (every command that builds an
    engine, ``jmtp compile`` too)."""
    p.add_argument("--enable-expert-parallel", action="store_true",
                   help="MoE models: split the routed experts over every device of the mesh "
                        "(data x model; must divide the experts) and dispatch each token to "
                        "the devices owning its experts; attention stays split by request over "
                        "data and by heads over model")
    p.add_argument("--all2all-backend", default="auto",
                   choices=["auto", "allgather_reducescatter", "ragged_all_to_all"],
                   help="token dispatch under expert parallelism (auto: all-gather + "
                        "reduce-scatter on CPU and where it moves fewer bytes, else ragged "
                        "all-to-all)")


def add_quantization_arg(p: argparse.ArgumentParser) -> None:
    """``--quantization`` (every command that builds an engine, ``jmtp compile`` included)."""
    p.add_argument("--quantization", default="auto", choices=["auto", "int8", "fp8"],
                   help="8-bit weights on the device (target and MTP decoder blocks): auto = "
                        "the checkpoint's own (a block-scaled FP8 checkpoint stays 8-bit); int8 "
                        "= weight-only, one scale per output channel; fp8 = float8_e4m3fn in "
                        "128x128 blocks (or the checkpoint's)")


def _process_seconds() -> float | None:
    """Seconds since this process started (Linux ``/proc``; 10 ms ticks), or None elsewhere."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])   # field 22: starttime
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(uptime - start_ticks / os.sysconf("SC_CLK_TCK"), 0.0)
    except (OSError, ValueError, IndexError):
        return None


def _start_up_defaults(args) -> None:
    """Start-up settings of ``generate`` and ``chat`` (where start-up dominates), before anything
    starts a JAX backend: XLA:CPU's faster compiles for scanned layers
    (:func:`jmtp.runtime.process.compile.use_fast_cpu_compiles`), and lazy compiles unless ``--compile``
    or ``$JMTP_COMPILE`` say otherwise (a one-shot run compiles only the buckets its prompts use;
    a chat compiles the rest in idle time)."""
    if args.layer_loop == "scan":
        from jmtp.runtime.process.compile import use_fast_cpu_compiles
        use_fast_cpu_compiles()
    if args.compile is None and not os.environ.get("JMTP_COMPILE"):
        args.compile = "lazy"


def _build_timed(args):
    """``(llm, import_s, load_s, compile_s, t0)``: :func:`build_llm` with the start-up split:
    seconds since the process started (imports; None off Linux), loading, compiling ahead
    (eager; 0 when lazy) and the ``perf_counter`` reading before the build."""
    import_s = _process_seconds()
    t0 = time.perf_counter()
    llm = build_llm(args)
    compile_s = sum(llm.compile_seconds.values())
    load_s = time.perf_counter() - t0 - compile_s
    return llm, import_s, load_s, compile_s, t0


def _generate(args) -> int:
    from jmtp.runtime.process import distributed as dist
    from jmtp.runtime.host.outputs import SpecDecodeMetrics
    from jmtp.runtime.host.sampling_params import SamplingParams

    _start_up_defaults(args)
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
    llm, import_s, load_s, compile_s, t0 = _build_timed(args)
    if args.chat:
        prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": p}])
                   for p in prompts]
    spec = llm.llm_engine.engine_config.spec
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
    # Lazy compiles happen inside generate, in each step bucket's first run.
    first_calls = llm.llm_engine.first_call_seconds if not llm.compile_seconds else {}
    compile_s += sum(first_calls.values())
    gen_s = st["seconds"] - sum(first_calls.values())
    ttft = st["time_to_first_token"]
    say(f"=== {st['generated_tokens']} tokens: time to first token "
        f"{'n/a' if ttft is None else f'{ttft:.2f}s'}, decode "
        f"{st['decode_tokens_per_second']:.1f} tok/s, "
        f"mean acceptance length={total.mean_acceptance_length:.2f}{per_pos}")
    how = (f"lazy: {len(first_calls)} step buckets at first use" if not llm.compile_seconds
           else f"eager: {len(llm.compile_seconds)} executables")
    total_s = (import_s or 0.0) + time.perf_counter() - t0
    say(f"=== start-up: import {'n/a' if import_s is None else f'{import_s:.1f}s'}, load "
        f"{load_s:.1f}s, compile or cache load {compile_s:.1f}s ({how}, cache "
        f"{llm.llm_engine.compilation_cache_dir or 'off'}); generate {gen_s:.1f}s; "
        f"total {total_s:.1f}s")
    if args.stats_json and main_process:
        with open(args.stats_json, "w", encoding="utf-8") as f:
            json.dump({"import_s": import_s, "load_s": load_s, "compile_s": compile_s,
                       "generate_s": gen_s, "ttft_s": ttft,
                       "decode_tok_s": st["decode_tokens_per_second"], "total_s": total_s,
                       "tokens": st["generated_tokens"], "text": outs[0].text,
                       "compile_mode": "eager" if llm.compile_seconds else "lazy",
                       "layer_loop": llm.llm_engine.layer_loop}, f, indent=1)
    mesh = llm.llm_engine.runner.mesh
    if mesh is not None:
        mem = llm.llm_engine.memory_per_device()
        say(f"=== mesh {dict(mesh.shape)}: per device params "
            f"{mem['params'][0] / 2**20:.1f} of {mem['params'][1] / 2**20:.1f} MiB, KV caches "
            f"{mem['kv_cache'][0] / 2**20:.1f} of {mem['kv_cache'][1] / 2**20:.1f} MiB")
    pb = llm.llm_engine.param_bytes()
    q = llm.model_config.quantization
    say(f"=== parameters ({q.describe() if q else 'model dtype'}): "
        f"{pb['total'] / 2**20:.1f} MiB (8-bit values {pb['quantized_values'] / 2**20:.1f} MiB, "
        f"scales {pb['scales'] / 2**20:.1f} MiB, other {pb['unquantized'] / 2**20:.1f} MiB)")
    kv = llm.llm_engine.kv_cache_bytes()
    say(f"=== KV cache ({llm.llm_engine.engine_config.kv_cache_dtype or 'model dtype'}): values "
        f"{kv['values'] / 2**20:.1f} MiB, scales {kv['scales'] / 2**20:.1f} MiB"
        + (f", recurrent state pool {kv['linear_state'] / 2**20:.1f} MiB"
           if kv.get("linear_state") else "")
        + (f", prefix-cache states {kv['prefix_states'] / 2**20:.1f} MiB"
           if kv.get("prefix_states") else ""))
    return 0


def _chat(args) -> int:
    from jmtp.chat import ChatSession, run_repl
    from jmtp.runtime.process import distributed as dist
    from jmtp.runtime.host.sampling_params import SamplingParams

    if dist.env_requested():
        raise ValueError("jmtp chat runs as one process; unset "
                         f"{', '.join(dist.ENV_VARS)}")
    _start_up_defaults(args)
    # prefix caching keeps the engine warm between turns (hybrid linear-attention models too:
    # their state at the last block boundary of a turn is kept, jmtp.runtime.host.prefix_states)
    args.enable_prefix_caching = True
    if args.max_num_seqs is None:
        args.max_num_seqs = 1
    llm, import_s, load_s, compile_s, _ = _build_timed(args)
    how = (f"eager: {len(llm.compile_seconds)} executables" if llm.compile_seconds
           else "lazy: step buckets compile at first use and while you type")
    print(f"=== start-up: import {'n/a' if import_s is None else f'{import_s:.1f}s'}, load "
          f"{load_s:.1f}s, compile or cache load {compile_s:.1f}s ({how}, cache "
          f"{llm.llm_engine.compilation_cache_dir or 'off'}); "
          f"layer loop {llm.llm_engine.layer_loop}",
          file=sys.stderr, flush=True)
    session = ChatSession(llm, SamplingParams(max_tokens=args.max_tokens,
                                              temperature=args.temperature), system=args.system)
    return run_repl(session)


def _serve(args) -> int:
    """``jmtp serve``; under ``jmtp launch`` (a multi-process mesh) process 0 serves HTTP and the
    others replay its engine calls (:mod:`jmtp.runtime.host.mirror`)."""
    import logging

    from jmtp.runtime.process import distributed as dist
    from jmtp.runtime.serve.server import serve
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    dist.initialize_from_env()       # before anything touches a device
    name = args.served_model_name or (
        "SmolLM2-135M-Instruct" if args.model is None
        else os.path.basename(os.path.normpath(args.model)))
    from jmtp.runtime.serve.server import ServerOptions
    options = ServerOptions(max_n=args.max_n, max_request_bytes=args.max_request_bytes,
                            ignore_unknown_fields=args.ignore_unknown_fields,
                            engine_stall_seconds=args.engine_stall_seconds)
    llm = build_llm(args)
    import jax
    if jax.process_count() == 1:
        return serve(llm, model_name=name, host=args.host, port=args.port,
                     log_level=args.log_level, options=options)
    from jmtp.runtime.host.mirror import MirroredEngine, follow
    if not dist.is_main_process():
        from jmtp.runtime.process.settings import freeze_heap
        freeze_heap()      # as process 0's serve() does: a collection here stalls every step
        return follow(llm.llm_engine)
    engine = MirroredEngine(llm.llm_engine)
    try:
        return serve(llm, model_name=name, host=args.host, port=args.port,
                     log_level=args.log_level, options=options, engine=engine)
    finally:
        engine.stop()


def build_parser() -> argparse.ArgumentParser:
    """The ``jmtp`` argument parser (subcommands generate, chat, serve, launch, compile)."""
    p = argparse.ArgumentParser(prog="jmtp", description="MTP speculative decoding in JAX")
    sub = p.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="generate text (greedy by default) with MTP speculation")
    g.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    g.add_argument("--prompts-file", help="text file, one prompt per line (or JSONL with 'prompt')")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--chat", action="store_true", help="apply the model's chat template")
    g.add_argument("--stats-json", default=None,
                   help="write the run's timings (import_s, load_s, compile_s, generate_s, ttft_s, "
                        "decode_tok_s, total_s) and the first output to this JSON file")
    add_engine_args(g)
    g.set_defaults(layer_loop="scan")    # one-shot: start-up (compiling or loading unrolled executables) dominates
    c = sub.add_parser("chat", help="interactive chat: a REPL over one warm engine (reads "
                       "lines until /exit or end of input; a pipe works too)",
                       description="Interactive chat with the model's chat template. The engine "
                       "stays warm between turns and prefix caching is always on (whatever "
                       "--enable-prefix-caching says), so a turn prefills only what is new in "
                       "the conversation; step buckets no turn has used yet compile in idle "
                       "time, while you type. Commands: /reset, /stats, /help, /exit, /quit. "
                       "Replies go to stdout, timings to stderr.")
    c.add_argument("--system", default=None, help="system prompt (default: the chat template's)")
    c.add_argument("--max-tokens", type=int, default=256, help="most tokens of one reply")
    c.add_argument("--temperature", type=float, default=0.0)
    add_engine_args(c)
    c.set_defaults(layer_loop="scan", enable_prefix_caching=True)
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (needs the `serve` extra)")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--served-model-name", default=None,
                   help="model id in the API (default: SmolLM2-135M-Instruct or the model's "
                        "file/directory name)")
    s.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"])
    s.add_argument("--max-n", type=int, default=128,
                   help="most samples one request may ask for: n, and len(prompt) x n for a "
                        "completions request with a list of prompts (default 128, OpenAI's)")
    s.add_argument("--max-request-bytes", type=int, default=8 * 2**20,
                   help="largest request body in bytes (default 8 MiB); a larger one gets HTTP "
                        "413 before it is read")
    s.add_argument("--ignore-unknown-fields", action="store_true",
                   help="log and drop unknown request fields (listed in the response header "
                        "Jmtp-Ignored-Fields) instead of answering HTTP 400")
    s.add_argument("--engine-stall-seconds", type=float, default=60.0,
                   help="/health answers 503 while the engine thread has spent longer than this "
                        "in one step (default 60; raise it with --compile lazy on large models)")
    add_engine_args(s)
    from jmtp.launch import add_launch_args
    la = sub.add_parser("launch", help="run a jmtp subcommand as N processes of one "
                        "jax.distributed job on this host (e.g. jmtp launch -n 2 "
                        "--devices-per-process 2 -- generate --tensor-parallel-size 4)")
    add_launch_args(la)
    from jmtp.aot import add_compile_args
    co = sub.add_parser("compile", help="compile the engine ahead of time for TPU topologies "
                        "(no TPU needed: libtpu's compiler) and report per-device HBM")
    add_compile_args(co)
    add_expert_parallel_args(co)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from jmtp.runtime.process.settings import tune_malloc
    tune_malloc()      # before any JAX backend starts (jmtp.runtime.process.settings)
    try:
        if args.cmd == "launch":
            from jmtp.launch import run_launch
            return run_launch(args)
        if args.cmd == "serve":
            return _serve(args)
        if args.cmd == "chat":
            return _chat(args)
        if args.cmd == "compile":
            from jmtp.aot import run_compile
            return run_compile(args)
        return _generate(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
