"""Build the tiny MoE GGUF test fixtures under ``tests/model/fixtures/gguf_moe/<family>/``.

For every family: a tiny random transformers checkpoint (``save_pretrained``, fp32 safetensors,
deterministic seeds) plus a tiny tokenizer trained on a fixed text (byte-level BPE with
``tokenizers``; SentencePiece for ERNIE, whose converter reads ``tokenizer.model``), then
llama.cpp's own ``convert_hf_to_gguf.py`` turns the directory into ``model.gguf`` (``--outtype
f32``). The tests (``tests/model/test_gguf_moe.py``; ``tests/model/test_gguf_hybrid.py`` for the
hybrid gated-DeltaNet families ``qwen3next``, ``qwen35``, ``qwen35moe``) compare jmtp's
GGUF-loaded logits with transformers run on the committed HF files, so the converter is the
independent reference for tensor names/layouts and metadata keys; CI never needs it.

The hybrid families also carry an ``mtp.*`` layer (``model-mtp.safetensors``: transformers
creates none), which llama.cpp's converter writes as the NextN layer ``blk.{N}``.

Usage (the converter ships in the llama-cpp-python sdist, ``vendor/llama.cpp``; the committed
fixtures were made with llama-cpp-python 0.3.36; ERNIE also needs ``sentencepiece``, here and in
the converter: e.g. ``pip install --target /tmp/spdeps sentencepiece``, then add ``/tmp/spdeps``
to ``PYTHONPATH`` and set ``CONVERTER_PYTHONPATH=/tmp/spdeps``)::

    pip download --no-deps --no-binary :all: llama-cpp-python -d /tmp/llcpp   # then untar
    PYTHONPATH=$PWD python scripts/make_gguf_fixtures.py \
        /tmp/llcpp/llama_cpp_python-*/vendor/llama.cpp [family ...]

The converter needs ``torch``, ``transformers``, ``numpy`` (and its bundled ``gguf-py``); it runs
in a subprocess with ``PYTHONPATH=<llama.cpp>/gguf-py``. One patch is applied there: llama.cpp
identifies a BPE pre-tokenizer by hashing the token ids of a fixed text, which no tiny tokenizer
can match, so ``TextModel.get_vocab_base_pre`` is made to answer ``"default"`` (the tokenizer's
pre-tokenizer name is metadata only; the weights and hyper-parameters are converted untouched).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "model" / "fixtures" / "gguf_moe"
VOCAB = 320
CORPUS = ("The quick brown fox jumps over the lazy dog. Mixture-of-experts layers route every "
          "token to a few experts; multi-token prediction drafts several tokens at once. "
          "def fibonacci(n): return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n") * 4

COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
              num_attention_heads=4, max_position_embeddings=256, rms_norm_eps=1e-6,
              bos_token_id=0, eos_token_id=1, tie_word_embeddings=False)


def _configs():
    import transformers

    return {
        # llama.cpp's qwen3moe always renormalises the top-k weights and makes every layer MoE,
        # so the HF config says the same (norm_topk_prob, no mlp_only_layers, step 1).
        "qwen3moe": transformers.Qwen3MoeConfig(
            **COMMON, num_key_value_heads=2, head_dim=8, moe_intermediate_size=16, num_experts=4,
            num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
            mlp_only_layers=[], rope_theta=10000.0),
        # DeepSeek-V3's shape scaled down: q compressed, interleaved RoPE, YaRN (mscale equal to
        # mscale_all_dim, as in the V3/R1 releases: GGUF keeps only the latter), layer 0 dense,
        # 8 routed experts in 2 groups (1 kept), top-2, one shared expert, sigmoid router with a
        # score-correction bias; scoring_func/topk_method as in DeepSeek-V3's config.json.
        "deepseek2": transformers.DeepseekV3Config(
            **{**COMMON, "num_hidden_layers": 3}, num_key_value_heads=4, q_lora_rank=16,
            kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
            first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2,
            moe_intermediate_size=16, n_shared_experts=1, n_group=2, topk_group=1,
            routed_scaling_factor=2.5, norm_topk_prob=True, rope_interleave=True,
            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                             "original_max_position_embeddings": 16, "mscale": 1.0,
                             "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1},
            scoring_func="sigmoid", topk_method="noaux_tc", num_mtp_layers=0),
        # the other MLA query form (one q_proj -> attn_q, DeepSeek-V2-Lite style) with tied
        # embeddings (no output.weight), no rope scaling, ungrouped top-k, no top-k renormalisation
        "deepseek2-qproj": transformers.DeepseekV3Config(
            **{**COMMON, "tie_word_embeddings": True}, num_key_value_heads=4, q_lora_rank=None,
            kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
            first_k_dense_replace=1, n_routed_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=16, n_shared_experts=1, n_group=1, topk_group=1,
            routed_scaling_factor=1.5, norm_topk_prob=False, rope_interleave=True,
            scoring_func="sigmoid", topk_method="noaux_tc", num_mtp_layers=0),
        # GLM-4.5's shape scaled down: partial rotary 0.5, q/k/v biases, q/k norm, layer 0 dense,
        # grouped sigmoid router with a score-correction bias, a shared expert, and one NextN
        # (MTP) layer, model.layers.{N} (written by _add_nextn_layer: transformers' model has none)
        "glm4moe": transformers.Glm4MoeConfig(
            **{**COMMON, "num_hidden_layers": 3}, num_key_value_heads=2, head_dim=8,
            n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
            n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=1.8,
            norm_topk_prob=True, moe_intermediate_size=16, attention_bias=True, use_qk_norm=True,
            partial_rotary_factor=0.5, num_nextn_predict_layers=1),
        # ERNIE-4.5-21B-A3B's shape scaled down: interleaved RoPE, layer 0 dense, softmax router
        # with moe_statics bias, two shared experts. llama.cpp stores the shared width as
        # intermediate_size // num_key_value_heads (= 2 x 16 here, as in the 21B release).
        "ernie4_5-moe": transformers.Ernie4_5_MoeConfig(
            **{**COMMON, "num_hidden_layers": 3, "intermediate_size": 64}, num_key_value_heads=2,
            moe_num_experts=8, moe_k=2, moe_num_shared_experts=2, moe_intermediate_size=16,
            moe_layer_start_index=1, moe_layer_end_index=2, moe_layer_interval=1,
            rope_theta=500000.0, use_bias=False),
        **_hybrid_configs(),
    }


# The hybrid gated-DeltaNet families (tests/model/test_gguf_hybrid.py): linear layers with
# Hk = 2 key heads serving Hv = 4 value heads (so the converter's per-key-head regrouping of
# Qwen3-Next and its grouped -> tiled value-head order of Qwen3.5 are exercised), gated full
# attention with partial rotary 0.5, and llama.cpp's layer rules: every Qwen3-Next / Qwen3.5-MoE
# layer is MoE with a gated shared expert (the llama.cpp graphs have no dense layers there).
_LIN, _FULL = "linear_attention", "full_attention"
HYBRID = dict(num_key_value_heads=2, head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
              linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
              rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                               "partial_rotary_factor": 0.5})
HYBRID_FAMILIES = ("qwen3next", "qwen35", "qwen35moe")


def _hybrid_configs():
    import transformers

    return {
        # Qwen3-Next: no mtp_num_hidden_layers in config.json (as released; the converter counts
        # the mtp.layers.* it finds), a layer pattern that is not full_attention_interval's
        "qwen3next": transformers.Qwen3NextConfig(
            **{**COMMON, "num_hidden_layers": 4}, **HYBRID,
            layer_types=[_LIN, _FULL, _LIN, _FULL], num_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=8, shared_expert_intermediate_size=16, decoder_sparse_step=1,
            mlp_only_layers=[], norm_topk_prob=True),
        # Qwen3.5 dense, tied embeddings (as the small Qwen3.5 releases)
        "qwen35": transformers.Qwen3_5TextConfig(
            **{**COMMON, "num_hidden_layers": 4, "tie_word_embeddings": True}, **HYBRID,
            layer_types=[_LIN, _LIN, _FULL, _LIN], mtp_num_hidden_layers=1),
        # Qwen3.5-MoE, the released pattern (full attention every 4th layer)
        "qwen35moe": transformers.Qwen3_5MoeTextConfig(
            **{**COMMON, "num_hidden_layers": 4}, **HYBRID,
            layer_types=[_LIN, _LIN, _LIN, _FULL], num_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=8, shared_expert_intermediate_size=16,
            mtp_num_hidden_layers=1),
    }


def _sentencepiece(path: Path):
    """ERNIE's converter reads a SentencePiece ``tokenizer.model``: a byte-fallback BPE trained on
    CORPUS (VOCAB pieces; 0 <s>, 1 </s>, 2 <unk>; no normaliser table)."""
    import io

    import sentencepiece as spm

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS.splitlines() * 8), model_writer=buf, vocab_size=VOCAB,
        model_type="bpe", byte_fallback=True, character_coverage=1.0, unk_id=2, bos_id=0,
        eos_id=1, pad_id=-1, hard_vocab_limit=False, minloglevel=2, num_threads=1,
        normalization_rule_name="identity")
    (path / "tokenizer.model").write_bytes(buf.getvalue())
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
         "add_prefix_space": False}, indent=1))


# (converter --outtype, file name, extra converter flags) per family; default an F32 model.gguf.
# The Q8_0 file has 3-D block-quantised expert tensors (gate/up; down stays F16: 16 inputs are
# not a 32-value block). (--fuse-gate-up-exps is refused for these four architectures.)
OUTTYPES = {
    "qwen3moe": [("f32", "model.gguf", ()), ("q8_0", "model-q8_0.gguf", ())],
}

# special tokens per family (the converter's GLM vocabulary code looks these up by name; for
# qwen3_5_moe_text configs transformers' AutoTokenizer, which the converter calls, picks
# Qwen3_5Tokenizer, which adds <|endoftext|> past the vocabulary unless the tokenizer has it)
SPECIALS = {
    "glm4moe": ["[gMASK]", "<|user|>", "<|endoftext|>", "<|observation|>"],
    **{fam: ["<|endoftext|>"] for fam in ("qwen3next", "qwen35", "qwen35moe")},
}


def _add_nextn_layer(model, out: Path, seed: int):
    """A DeepSeek/GLM "NextN" MTP module ``model.layers.{N}.{enorm, hnorm, eh_proj,
    shared_head.norm}`` plus a full decoder layer (MoE), saved as ``model-mtp.safetensors``."""
    import torch
    import transformers
    from safetensors.torch import save_file

    n = model.config.num_hidden_layers
    cfg = model.config.__class__(**{**model.config.to_dict(), "num_hidden_layers": n + 1})
    donor = _randomize(transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32),
                       seed)
    p = f"model.layers.{n}."
    t = {}
    for k, v in donor.model.layers[n].state_dict().items():
        if k == "mlp.experts.gate_up_proj":     # transformers v5 in-memory layout -> hub layout
            i = v.shape[1] // 2
            for e in range(v.shape[0]):
                t[f"{p}mlp.experts.{e}.gate_proj.weight"] = v[e, :i].clone().contiguous()
                t[f"{p}mlp.experts.{e}.up_proj.weight"] = v[e, i:].clone().contiguous()
        elif k == "mlp.experts.down_proj":
            for e in range(v.shape[0]):
                t[f"{p}mlp.experts.{e}.down_proj.weight"] = v[e].clone().contiguous()
        else:
            t[p + k] = v.detach().clone().contiguous()
    g = torch.Generator().manual_seed(seed)
    h = cfg.hidden_size
    for name in ("enorm", "hnorm", "shared_head.norm"):
        t[p + name + ".weight"] = 1 + 0.2 * torch.randn(h, generator=g)
    t[p + "eh_proj.weight"] = 0.1 * torch.randn(h, 2 * h, generator=g)
    save_file(t, str(out / "model-mtp.safetensors"))


def _hub_layout(state: dict, prefix: str) -> dict:
    """A layer's ``state_dict`` under ``prefix``, transformers v5's fused in-memory expert tensors
    written in the hub layout (``experts.{e}.{gate,up,down}_proj.weight``)."""
    t = {}
    for k, v in state.items():
        if k == "mlp.experts.gate_up_proj":
            i = v.shape[1] // 2
            for e in range(v.shape[0]):
                t[f"{prefix}mlp.experts.{e}.gate_proj.weight"] = v[e, :i].clone().contiguous()
                t[f"{prefix}mlp.experts.{e}.up_proj.weight"] = v[e, i:].clone().contiguous()
        elif k == "mlp.experts.down_proj":
            for e in range(v.shape[0]):
                t[f"{prefix}mlp.experts.{e}.down_proj.weight"] = v[e].clone().contiguous()
        else:
            t[prefix + k] = v.detach().clone().contiguous()
    return t


def _randomize_hybrid(model, seed: int):
    """Every tensor of a hybrid model random, as ``tests/model/hybrid_fixtures.py`` does:
    zero-centred norms around 0 (the gated norm ``linear_attn.norm`` around 1), ``A_log`` the log
    of U(0.5, 4), ``dt_bias`` N(0, 0.25), everything else N(0, 0.15²); so the converter's
    ``1 + w``, ``-exp(A_log)`` and every reordering change the logits if undone wrongly."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if name.endswith("A_log"):
                p.copy_(torch.log(0.5 + 3.5 * torch.rand(p.shape, generator=g)))
            elif name.endswith("dt_bias"):
                p.copy_(0.5 * noise)
            elif "norm" in name:
                p.copy_(0.2 * noise + (1.0 if name.endswith("linear_attn.norm.weight") else 0.0))
            else:
                p.copy_(0.15 * noise)
    return model


def _add_mtp_layer(model, out: Path, seed: int):
    """A Qwen3-Next / Qwen3.5 MTP layer in the released layout, saved as
    ``model-mtp.safetensors`` (the converter reads ``model*.safetensors``): ``mtp.fc`` over
    ``[embedding; hidden]``, the zero-centred norms ``mtp.pre_fc_norm_embedding`` /
    ``pre_fc_norm_hidden`` / ``norm``, and ``mtp.layers.0.*``, a full-attention decoder layer
    (MoE for the MoE families) with its own random weights."""
    import torch
    import transformers
    from safetensors.torch import save_file

    cfg = model.config
    n = cfg.num_hidden_layers
    donor_cfg = cfg.__class__(**{**cfg.to_dict(), "num_hidden_layers": n + 1,
                                 "layer_types": list(cfg.layer_types) + ["full_attention"]})
    donor = _randomize_hybrid(
        transformers.AutoModelForCausalLM.from_config(donor_cfg, dtype=torch.float32), seed)
    t = _hub_layout(donor.model.layers[n].state_dict(), "mtp.layers.0.")
    g = torch.Generator().manual_seed(seed + 1)
    h = cfg.hidden_size
    t["mtp.fc.weight"] = 0.15 * torch.randn(h, 2 * h, generator=g)
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        t[f"mtp.{name}.weight"] = 0.2 * torch.randn(h, generator=g)
    save_file(t, str(out / "model-mtp.safetensors"))


def _randomize(model, seed: int):
    """Every tensor random (norms around 1, score-correction biases on the scale of the scores),
    so a tensor in the wrong slot changes the logits."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if "inv_freq" in name:
                continue
            noise = torch.randn(p.shape, generator=g)
            if "e_score_correction_bias" in name or "moe_statics" in name:
                p.copy_(0.05 * noise)
            elif "norm" in name:
                p.copy_(1 + 0.2 * noise)
            else:
                p.copy_((0.5 if "embed" in name else 0.1) * noise)
    return model


def _tokenizer(path: Path, specials=()):
    """A byte-level BPE of VOCAB tokens trained on CORPUS; ids 0/1 are ``<s>``/``</s>``, then
    ``specials``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<s>", "</s>", *specials],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator([CORPUS], trainer)
    assert tok.get_vocab_size() <= VOCAB, tok.get_vocab_size()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(path)


_CONVERT = """
import runpy, sys
sys.path.insert(0, {llama!r})
from conversion import base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "default"
sys.argv = ["convert_hf_to_gguf.py", {src!r}, "--outfile", {out!r}, "--outtype", {outtype!r},
            *{flags!r}]
runpy.run_path({script!r}, run_name="__main__")
"""


def build(family: str, llama_cpp: Path, seed: int = 0):
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(seed)
    config = _configs()[family]
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    hybrid = family in HYBRID_FAMILIES
    (_randomize_hybrid if hybrid else _randomize)(model, seed + len(family)).eval()
    out = OUT / family
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    model.save_pretrained(out)
    if getattr(config, "num_nextn_predict_layers", 0):
        _add_nextn_layer(model, out, seed + 100)
    if hybrid:
        _add_mtp_layer(model, out, seed + 100)
    if family.startswith("ernie"):
        _sentencepiece(out)
    else:
        _tokenizer(out, SPECIALS.get(family, ()))
    for outtype, name, flags in OUTTYPES.get(family, [("f32", "model.gguf", ())]):
        with tempfile.TemporaryDirectory() as tmp:
            gguf_tmp = Path(tmp) / name
            code = _CONVERT.format(llama=str(llama_cpp), src=str(out), out=str(gguf_tmp),
                                   outtype=outtype, flags=list(flags),
                                   script=str(llama_cpp / "convert_hf_to_gguf.py"))
            extra = os.environ.get("CONVERTER_PYTHONPATH")  # e.g. a --target dir with sentencepiece
            env = dict(os.environ, PYTHONPATH=os.pathsep.join(
                [str(llama_cpp / "gguf-py")] + ([extra] if extra else [])))
            subprocess.run([sys.executable, "-c", code], check=True, env=env)
            shutil.copy(gguf_tmp, out / name)
    sizes = {p.name: p.stat().st_size for p in sorted(out.iterdir())}
    print(family, json.dumps(sizes))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("llama_cpp", type=Path, help="llama.cpp source directory (has "
                    "convert_hf_to_gguf.py, conversion/ and gguf-py/)")
    ap.add_argument("families", nargs="*", help="default: all")
    args = ap.parse_args()
    if not (args.llama_cpp / "convert_hf_to_gguf.py").is_file():
        raise SystemExit(f"{args.llama_cpp}: no convert_hf_to_gguf.py")
    for fam in args.families or list(_configs()):
        build(fam, args.llama_cpp.resolve())


if __name__ == "__main__":
    main()
