"""The ``jmtp`` command line: per-subcommand engine defaults."""
from __future__ import annotations

from jmtp.cli import build_parser


def test_layer_loop_defaults_generate_scan_serve_auto():
    """A one-shot ``jmtp generate`` defaults to the scan (its start-up, tracing 30 unrolled layers
    even from the compilation cache, dominates), ``jmtp serve`` to ``auto``; both accept every
    choice."""
    p = build_parser()
    assert p.parse_args(["generate", "--prompt", "x"]).layer_loop == "scan"
    assert p.parse_args(["serve"]).layer_loop == "auto"
    assert p.parse_args(["generate", "--layer-loop", "unrolled"]).layer_loop == "unrolled"
    assert p.parse_args(["serve", "--layer-loop", "scan"]).layer_loop == "scan"


def test_one_shot_commands_compile_lazily_unless_told(monkeypatch):
    """generate and chat default to lazy compiles (only the buckets the work uses); --compile and
    $JMTP_COMPILE win; serve keeps the library's default (eager: no compile inside traffic)."""
    import os

    from jmtp.cli import _start_up_defaults

    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))   # restored afterwards
    p = build_parser()
    monkeypatch.delenv("JMTP_COMPILE", raising=False)
    for cmd in (["generate", "--prompt", "x"], ["chat"]):
        args = p.parse_args(cmd)
        _start_up_defaults(args)
        assert args.compile == "lazy"
        args = p.parse_args(cmd + ["--compile", "eager"])
        _start_up_defaults(args)
        assert args.compile == "eager"
    monkeypatch.setenv("JMTP_COMPILE", "eager")
    args = p.parse_args(["generate"])
    _start_up_defaults(args)
    assert args.compile is None          # LLM resolves $JMTP_COMPILE itself
    assert p.parse_args(["serve"]).compile is None


def test_expert_parallel_switches_on_every_engine_command(monkeypatch):
    """``--enable-expert-parallel`` and ``--all2all-backend`` parse on generate, chat, serve and
    compile, and reach the engine's keywords (``LLM`` is replaced by a recorder)."""
    import pytest

    import jmtp.runtime.host.llm as engine
    from jmtp.cli import build_llm
    p = build_parser()
    for cmd in (["generate"], ["chat"], ["serve"], ["compile", "--topology", "v5e:2x2"]):
        args = p.parse_args(cmd + ["--enable-expert-parallel", "--all2all-backend",
                                   "ragged_all_to_all"])
        assert args.enable_expert_parallel and args.all2all_backend == "ragged_all_to_all"
        assert not p.parse_args(cmd).enable_expert_parallel
        assert p.parse_args(cmd).all2all_backend == "auto"
    with pytest.raises(SystemExit):
        p.parse_args(["generate", "--all2all-backend", "deepep"])
    seen = {}
    monkeypatch.setattr(engine, "LLM", lambda model, **kw: seen.update(kw))
    build_llm(p.parse_args(["generate", "--enable-expert-parallel"]))
    assert seen["enable_expert_parallel"] is True and seen["all2all_backend"] == "auto"


def test_serve_limits_default_to_openai_and_reject_nonsense():
    """``jmtp serve``'s own limits: OpenAI's n <= 128, 8 MiB bodies, unknown fields refused, a
    60 s stall bound; ServerOptions refuses limits below 1 by name."""
    import pytest

    from jmtp.runtime.serve.server.intake import ServerOptions

    p = build_parser()
    a = p.parse_args(["serve"])
    assert (a.max_n, a.max_request_bytes, a.ignore_unknown_fields, a.engine_stall_seconds,
            a.max_num_batched_tokens) == (128, 8 * 2**20, False, 60.0, None)
    a = p.parse_args(["serve", "--max-n", "4", "--max-request-bytes", "1000",
                      "--ignore-unknown-fields", "--engine-stall-seconds", "5",
                      "--max-num-batched-tokens", "16"])
    assert (a.max_n, a.max_request_bytes, a.ignore_unknown_fields, a.engine_stall_seconds,
            a.max_num_batched_tokens) == (4, 1000, True, 5.0, 16)
    for bad in (dict(max_n=0), dict(max_request_bytes=0), dict(engine_stall_seconds=0)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            ServerOptions(**bad)


def test_suffix_decoding_options_reach_the_speculative_config(monkeypatch):
    """``--speculative-method suffix`` and ``--mtp-strategy with_suffix`` build the
    SpeculativeConfig suffix decoding runs with (the LLM itself is not built here)."""
    import jmtp.runtime.host.llm as engine_mod
    from jmtp.cli import build_llm

    built = {}
    monkeypatch.setattr(engine_mod, "LLM", lambda *a, **kw: built.update(kw))
    p = build_parser()
    build_llm(p.parse_args(["serve", "--speculative-method", "suffix",
                            "--num-speculative-tokens", "7"]))
    spec = built["speculative_config"]
    assert (spec.method, spec.k, spec.uses_suffix) == ("suffix", 7, True)
    build_llm(p.parse_args(["serve", "--num-speculative-tokens", "5", "--num-model-steps", "1",
                            "--mtp-strategy", "with_suffix"]))
    spec = built["speculative_config"]
    assert (spec.method, spec.k, spec.m, spec.uses_suffix) == ("mtp", 5, 1, True)
