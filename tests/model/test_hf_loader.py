"""Tiny random checkpoints written by transformers ``save_pretrained``: jmtp's logits must equal
transformers' logits of the same model (fp32, |Δ| <= 1e-4)."""
from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest

from jmtp.model import forward_logits, load_checkpoint
from jmtp.model.config import RopeScaling

torch = pytest.importorskip("torch")
torch.set_num_threads(1)  # torch's thread pool thrashes on a small shared CPU
transformers = pytest.importorskip("transformers")

COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2)


def _randomize(model, seed: int):
    """Every parameter random (norm weights around 1), so a tensor loaded into the wrong slot,
    transposed, or skipped changes the logits."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.2 * noise if "norm" in name else (0.5 if "embed" in name else 0.08) * noise)
    return model


def _save(tmp_path, config, seed=0, **save_kw):
    transformers.logging.set_verbosity_error()
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize(model, seed).eval()
    model.save_pretrained(tmp_path, **save_kw)
    return model


def _hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


CASES = {
    "llama_tied": lambda: transformers.LlamaConfig(**COMMON, tie_word_embeddings=True),
    "llama_untied": lambda: transformers.LlamaConfig(**COMMON, tie_word_embeddings=False,
                                                     eos_token_id=[2, 5]),
    "llama3_rope_scaling": lambda: transformers.LlamaConfig(
        **COMMON, rope_theta=500000.0, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16}),
    "llama_yarn_rope_scaling": lambda: transformers.LlamaConfig(
        **COMMON, max_position_embeddings=64, rope_parameters={
            "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
            "original_max_position_embeddings": 16}),
    "qwen2_bias": lambda: transformers.Qwen2Config(**COMMON, tie_word_embeddings=False),
    "qwen3_qk_norm": lambda: transformers.Qwen3Config(**COMMON, head_dim=24),
    "ernie4_5_interleaved_rope": lambda: transformers.Ernie4_5Config(**COMMON, head_dim=16),
}


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(tmp_path, case):
    model = _save(tmp_path, CASES[case](), seed=len(case))
    cfg, params = load_checkpoint(tmp_path, dtype=jnp.float32)
    ids = np.random.default_rng(1).integers(0, 128, size=37).tolist()
    ours = np.asarray(forward_logits(cfg, params, ids))
    ref = _hf_logits(model, ids)
    assert np.abs(ref).max() > 0.5  # non-trivial logits
    np.testing.assert_allclose(ours, ref, rtol=0, atol=1e-4)
    assert cfg.num_layers == 2 and cfg.vocab_size == 128
    assert cfg.num_mtp_layers == 1  # no MTP tensors: a fresh head


def test_config_fields(tmp_path):
    _save(tmp_path / "a", CASES["llama3_rope_scaling"]())
    cfg, _ = load_checkpoint(tmp_path / "a", dtype=jnp.float32)
    assert cfg.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 16) and cfg.rope_theta == 500000.0
    _save(tmp_path / "b", CASES["llama_untied"]())
    cfg, params = load_checkpoint(tmp_path / "b", dtype=jnp.float32)
    assert cfg.eos_token_ids == (2, 5) and not cfg.tie_word_embeddings and "lm_head" in params
    _save(tmp_path / "c", CASES["qwen3_qk_norm"]())
    cfg, params = load_checkpoint(tmp_path / "c", dtype=jnp.float32)
    assert cfg.qk_norm and cfg.head_dim == 24 and params["layers"]["q_norm"].shape == (2, 24)
    _save(tmp_path / "d", CASES["qwen2_bias"]())
    cfg, params = load_checkpoint(tmp_path / "d", dtype=jnp.float32)
    assert cfg.attention_bias and params["layers"]["bk"].shape == (2, 32)


def test_sharded_checkpoint(tmp_path):
    model = _save(tmp_path, CASES["llama_untied"](), seed=3, max_shard_size="20KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 3  # really sharded
    cfg, params = load_checkpoint(tmp_path, dtype=jnp.float32)
    ids = list(range(3, 40))
    np.testing.assert_allclose(np.asarray(forward_logits(cfg, params, ids)), _hf_logits(model, ids),
                               rtol=0, atol=1e-4)


def test_bf16_checkpoint_and_dtype(tmp_path):
    """bf16 safetensors are read exactly; dtype= casts the whole pytree."""
    model = _save(tmp_path, CASES["qwen2_bias"](), seed=4)
    model.to(torch.bfloat16).save_pretrained(tmp_path)
    cfg, params = load_checkpoint(tmp_path, dtype=jnp.float32)
    ref_embed = model.model.embed_tokens.weight.detach().float().numpy()
    np.testing.assert_array_equal(np.asarray(params["embed"]), ref_embed)
    ref_wq = model.model.layers[1].self_attn.q_proj.weight.detach().float().numpy()
    np.testing.assert_array_equal(np.asarray(params["layers"]["wq"][1]), ref_wq.T)
    cfg16, p16 = load_checkpoint(tmp_path, dtype="bfloat16")
    dtypes = {leaf.dtype for leaf in __import__("jax").tree_util.tree_leaves(p16)}
    assert dtypes == {jnp.dtype(jnp.bfloat16)}
    ids = list(range(5, 30))
    l32 = np.asarray(forward_logits(cfg, params, ids))
    l16 = np.asarray(forward_logits(cfg16, p16, ids))
    assert np.abs(l16 - l32).max() <= 0.05 * np.abs(l32).max()


def test_generation_config_eos_merged(tmp_path):
    _save(tmp_path, transformers.LlamaConfig(**COMMON, eos_token_id=7))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9]}))
    cfg, _ = load_checkpoint(tmp_path, dtype=jnp.float32)
    assert cfg.eos_token_ids == (7, 9)
