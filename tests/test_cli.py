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
