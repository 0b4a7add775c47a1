#!/usr/bin/env python
"""``jmtp chat`` on a hybrid gated-DeltaNet checkpoint (issue 51): time to first token of a
conversation's second turn against its first, with prefix caching (state checkpoints) on.

No Qwen3.5 / Qwen3-Next weights are reachable here, so the checkpoint is a **random**
``Qwen3_5ForCausalLM`` written with transformers (``--hidden`` wide, ``--layers`` layers in the
3 : 1 gated-DeltaNet / gated-attention pattern, a random ``mtp.*`` layer) with SmolLM2's tokenizer
and chat template beside it, so the whole ``jmtp chat`` path runs: the checkpoint directory is
loaded as ``jmtp chat --model DIR`` loads it, and every turn goes through
:class:`jmtp.chat.ChatSession` (what the REPL runs), MTP K=3, ``max_num_seqs=1``.

Each timed conversation has its own long system prompt (``--system-tokens`` of random words), so
its first turn prefills it cold; the second turn repeats the conversation and adds a short user
message. One warm-up conversation of the same shape runs first, so the timed turns compile
nothing (each turn's ``compiled`` is checked empty and printed). Reported: both TTFTs per
conversation, the ratio, the cached prompt tokens of the second turn, and the median ratio.

    python scripts/bench_chat_hybrid.py --system-tokens 1000 --conversations 3
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

WORDS = ("river mountain lamp quiet orange window garden seven silver market paper engine "
         "cloud winter bridge copper signal forest letter harbor violet stone ladder music "
         "candle shadow planet needle thunder meadow").split()


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--system-tokens", type=int, default=1000)
    ap.add_argument("--conversations", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--checkpoint", default=None, help="reuse / write the checkpoint here")
    return ap.parse_args(argv)


def write_checkpoint(d: Path, hidden: int, layers: int) -> Path:
    """A random Qwen3.5 (dense) checkpoint with an MTP layer and SmolLM2's tokenizer files."""
    import json

    import torch
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    from jmtp.model.checkpoints.loader import load_tokenizer
    from tests.model.hybrid_fixtures import mtp_tensors, save_checkpoint
    if (d / "config.json").is_file():
        return d
    tok = load_tokenizer(None)
    torch.manual_seed(0)
    types = ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(layers)]
    cfg = Qwen3_5TextConfig(
        vocab_size=tok.vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
        num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=hidden // 4,
        linear_value_head_dim=hidden // 4, linear_conv_kernel_dim=4, num_hidden_layers=layers,
        layer_types=types, rms_norm_eps=1e-6, tie_word_embeddings=False,
        max_position_embeddings=4096, eos_token_id=list(tok.eos_token_ids)[0],
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                         "partial_rotary_factor": 0.25})
    model = Qwen3_5ForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.log(torch.empty_like(p).uniform_(0.5, 4)))
            elif "norm" in name:
                p.copy_(torch.randn_like(p) * 0.1 + (1.0 if "linear_attn.norm" in name else 0.0))
            else:
                p.copy_(torch.randn_like(p) * 0.05)
    save_checkpoint(model, d, mtp_tensors(model))
    tok.backend.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": tok.chat_template, **tok.special_tokens}))
    return d


def main(argv=None) -> int:
    args = parse_args(argv)
    import numpy as np

    import jmtp
    from jmtp.chat import ChatSession
    d = Path(args.checkpoint or tempfile.mkdtemp()) / "qwen35_random"
    write_checkpoint(d, args.hidden, args.layers)
    llm = jmtp.LLM(str(d), speculative_config=jmtp.SpeculativeConfig("mtp", args.k),
                   enable_prefix_caching=True, max_num_seqs=1, max_model_len=2048,
                   compile="lazy")
    rng = np.random.default_rng(0)
    sp = jmtp.SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)

    def conversation():
        system = " ".join(rng.choice(WORDS, int(args.system_tokens * 0.9)))
        s = ChatSession(llm, sp, system=system, warmup_delay=1e9)   # no idle-time compiles
        return [s.turn(q) for q in ("What is the first word?", "And the second one?")]

    conversation()                                          # warm-up: compiles the buckets
    rows = []
    for i in range(args.conversations):
        t1, t2 = conversation()
        rows.append((t1, t2))
        print(f"conversation {i}: turn 1 {t1.line()}\n                turn 2 {t2.line()}",
              file=sys.stderr, flush=True)
    ratios = [t2.time_to_first_token / t1.time_to_first_token for t1, t2 in rows]
    print(f"\n{platform.machine()}, {os.cpu_count()} CPUs | random Qwen3.5 (hidden {args.hidden}, "
          f"{args.layers} layers, 3:1 gated DeltaNet / attention) + random MTP layer, SmolLM2 "
          f"tokenizer | jmtp chat path (ChatSession), MTP K={args.k}, prefix caching on\n")
    print("| conversation | prompt tokens turn 1 / 2 | cached turn 2 | TTFT turn 1 (s) | TTFT turn 2 "
          "(s) | turn 2 / turn 1 | compiled in timed turns |")
    print("|---|---|---|---|---|---|---|")
    for i, (t1, t2) in enumerate(rows):
        print(f"| {i} | {t1.prompt_tokens} / {t2.prompt_tokens} | {t2.cached_tokens} | "
              f"{t1.time_to_first_token:.3f} | {t2.time_to_first_token:.3f} | "
              f"{t2.time_to_first_token / t1.time_to_first_token:.3f} | "
              f"{len(t1.compiled) + len(t2.compiled)} |")
    print(f"\nmedian TTFT turn 2 / turn 1: {statistics.median(ratios):.3f}")
    st = llm.llm_engine.get_stats()
    print(f"hit rate {st['prefix_cache_hit_rate']:.3f}, cached states {st['num_cached_states']}, "
          f"state cache {st['prefix_state_cache_bytes'] / 2**20:.2f} of "
          f"{st['prefix_state_cache_capacity_bytes'] / 2**20:.2f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
