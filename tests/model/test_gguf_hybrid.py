"""GGUF loading of the hybrid gated-DeltaNet family (``qwen3next``, ``qwen35``, ``qwen35moe``),
against files written by llama.cpp's own converter.

Fixtures (``tests/model/fixtures/gguf_moe/<family>/``, built by ``scripts/make_gguf_fixtures.py``):
a tiny random transformers checkpoint (``save_pretrained``) with an ``mtp.*`` layer
(``model-mtp.safetensors``) and ``model.gguf``, its conversion by llama.cpp's
``convert_hf_to_gguf.py`` (F32; the MTP layer becomes the NextN layer ``blk.4``). jmtp's
GGUF-loaded model must give transformers' logits on the HF files (fp32, |Δ| <= 1e-4) for a single
prefill and for a chunked prefill plus one-token paged decode steps in one slot of a state pool
over shuffled KV blocks, with every block, state slot and checkpoint NaN-poisoned; and the same
config and parameters (MTP head included) as jmtp's own HF loader. Bad files raise ValueError
naming the tensor / field.
"""
from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jmtp.model import forward_logits, load_checkpoint
from jmtp.model.checkpoints.loader import load_config

torch = pytest.importorskip("torch")
torch.set_num_threads(1)
transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from tests.model.hybrid_fixtures import hf_logits, paged_slot_logits  # noqa: E402

FIXTURES = Path(__file__).parent / "fixtures" / "gguf_moe"
L, F = "linear_attention", "full_attention"
# family (= general.architecture) -> (HF architecture, layer types, MoE)
FAMILIES = {
    # fused qkvz / ba regrouped by the converter; every layer MoE with a gated shared expert; a
    # layer pattern that is not full_attention_interval's (attention.recurrent_layers)
    "qwen3next": ("Qwen3NextForCausalLM", (L, F, L, F), True),
    # dense, tied embeddings (no output.weight); value heads stored "tiled"
    "qwen35": ("Qwen3_5ForCausalLM", (L, L, F, L), False),
    # MoE with a gated shared expert; value heads stored "tiled"
    "qwen35moe": ("Qwen3_5MoeForCausalLM", (L, L, L, F), True),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request):
    fam = request.param
    d = FIXTURES / fam
    transformers.logging.set_verbosity_error()
    model = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    ids = np.random.default_rng(1).integers(0, model.config.vocab_size, size=23).tolist()
    ref = hf_logits(model, ids)
    cfg, params = load_checkpoint(d / "model.gguf", dtype=jnp.float32)
    return fam, d, cfg, params, ids, ref


def test_config_matches_hf_loader(family):
    fam, d, cfg, _, _, _ = family
    hf_cfg, _ = load_checkpoint(d, dtype=jnp.float32)
    arch, types, moe = FAMILIES[fam]
    assert cfg.architecture == arch and cfg.layer_types == types
    # GGUF stores floats as f32; every other field is the HF loader's
    assert cfg.rms_norm_eps == pytest.approx(hf_cfg.rms_norm_eps, rel=1e-6)
    assert cfg.replace(rms_norm_eps=hf_cfg.rms_norm_eps) == hf_cfg
    assert (cfg.num_mtp_layers, cfg.mtp_layout, cfg.attn_output_gate) == (1, "qwen3_next", True)
    assert cfg.linear.num_value_heads == 2 * cfg.linear.num_key_heads and cfg.rotary_dim == 4
    assert (cfg.moe is not None) == moe and cfg.tie_word_embeddings == (fam == "qwen35")
    if moe:
        assert cfg.moe.layers == (0, 1, 2, 3) and cfg.moe.mtp_moe and cfg.moe.shared_expert_gate


def test_params_equal_hf_loader(family):
    """Every tensor (the MTP head's too) equals the HF loader's: exactly, up to ``a_log``, which
    the file holds as ``-exp(A_log)`` (one f32 rounding)."""
    _, d, _, params, _, _ = family
    _, hf_params = load_checkpoint(d, dtype=jnp.float32)
    flat, tree = jax.tree_util.tree_flatten_with_path(params)
    hf_flat, hf_tree = jax.tree_util.tree_flatten_with_path(hf_params)
    assert tree == hf_tree
    assert "mtp" in params
    for (path, a), (_, b) in zip(flat, hf_flat):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7,
                                   err_msg=jax.tree_util.keystr(path))


def test_prefill_logits_match_transformers(family):
    _, _, cfg, params, ids, ref = family
    ours = np.asarray(forward_logits(cfg, params, ids))
    assert np.abs(ref).max() > 0.5
    np.testing.assert_allclose(ours, ref, rtol=0, atol=1e-4)


def test_paged_slot_logits_match_transformers(family):
    """Prefill 16 tokens in chunks of 6, then decode one token per step, in slot 2 of a 4-slot
    state pool with 3 checkpoints, over shuffled KV blocks; blocks, slots and checkpoints start
    as NaN. Every row's logits = transformers'."""
    _, _, cfg, params, ids, ref = family
    got = paged_slot_logits(cfg, params, ids, prefill=16, chunk=6)
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-4)


# ---------------------------------------------------------------------------------------------
# Metadata variants and bad files: a copy of a fixture with tensors dropped / replaced or
# metadata values replaced / removed

def _rewrite(src: Path, dst: Path, drop=(), meta=None, drop_meta=(), data=None) -> Path:
    """Copy the GGUF ``src`` to ``dst`` without the tensors ``drop`` and the metadata keys
    ``drop_meta``, with the metadata values in ``meta`` (same value types) and the f32 tensor
    values in ``data`` replaced."""
    meta, data = meta or {}, data or {}
    r = gguf.GGUFReader(str(src))
    w = gguf.GGUFWriter(str(dst), r.fields["general.architecture"].contents())
    for key, field in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key in drop_meta:
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, meta.get(key, field.contents()), vtype, sub_type=sub)
    for t in r.tensors:
        if t.name in drop:
            continue
        if t.name in data:
            value = np.asarray(data[t.name], np.float32)
            w.add_tensor(t.name, value.reshape(np.asarray(t.data).shape))
        else:
            w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def _load(path):
    return load_checkpoint(path, dtype=jnp.float32)


def test_missing_ssm_tensor(tmp_path):
    src = FIXTURES / "qwen35" / "model.gguf"
    path = _rewrite(src, tmp_path / "a.gguf", drop={"blk.3.ssm_a"})
    with pytest.raises(ValueError, match=r"a.gguf: missing tensor 'blk.3.ssm_a' \(layer 3 is a "
                                         r"linear-attention layer\)"):
        _load(path)
    path = _rewrite(FIXTURES / "qwen3next" / "model.gguf", tmp_path / "ba.gguf",
                    drop={"blk.0.ssm_ba.weight"})
    with pytest.raises(ValueError, match=r"ba.gguf: missing tensor 'blk.0.ssm_ba.weight'"):
        _load(path)


def test_bad_files(tmp_path):
    src = FIXTURES / "qwen35moe" / "model.gguf"
    # the MTP layer's NextN projection
    path = _rewrite(src, tmp_path / "n.gguf", drop={"blk.4.nextn.eh_proj.weight"})
    with pytest.raises(ValueError, match=r"n.gguf: missing tensor 'blk.4.nextn.eh_proj.weight' "
                                         r"\(blk.4 is the MTP layer 0 \(field "
                                         r"qwen35moe.nextn_predict_layers = 1\)\)"):
        _load(path)
    # a MoE layer's shared-expert gate
    path = _rewrite(src, tmp_path / "g.gguf", drop={"blk.2.ffn_gate_inp_shexp.weight"})
    with pytest.raises(ValueError, match=r"g.gguf: missing tensor "
                                         r"'blk.2.ffn_gate_inp_shexp.weight' \(layer 2 is a MoE "
                                         r"layer\)"):
        _load(path)
    # an expert count the tensors disagree with
    path = _rewrite(src, tmp_path / "e.gguf", meta={"qwen35moe.expert_count": 8})
    with pytest.raises(ValueError, match=r"e.gguf: tensor 'blk.0.ffn_gate_inp.weight' holds 4 "
                                         r"experts but field qwen35moe.expert_count = 8"):
        _load(path)
    # ssm_a must be -exp(A_log) < 0
    path = _rewrite(src, tmp_path / "s.gguf", data={"blk.0.ssm_a": np.ones(4)})
    with pytest.raises(ValueError, match=r"s.gguf: tensor 'blk.0.ssm_a' must hold -exp\(A_log\)"):
        _load(path)
    # a layer pattern that does not cover block_count, or makes the MTP layer recurrent
    path = _rewrite(src, tmp_path / "r.gguf",
                    meta={"qwen35moe.attention.recurrent_layers": [True, True, True, False, True]})
    with pytest.raises(ValueError, match=r"r.gguf: field qwen35moe.attention.recurrent_layers "
                                         r"marks an MTP layer \(blk.4\) recurrent"):
        _load(path)
    # value heads that are no multiple of the key heads
    path = _rewrite(src, tmp_path / "h.gguf", meta={"qwen35moe.ssm.time_step_rank": 3})
    with pytest.raises(ValueError, match=r"h.gguf: fields qwen35moe.ssm.time_step_rank = 3"):
        _load(path)


def test_layer_pattern_from_full_attention_interval(tmp_path):
    """Without ``attention.recurrent_layers`` llama.cpp's rule applies: layer ``i`` is full
    attention iff ``(i + 1) % full_attention_interval == 0`` (Qwen3.5-MoE's pattern is interval 4;
    the same model loads)."""
    src = FIXTURES / "qwen35moe" / "model.gguf"
    path = _rewrite(src, tmp_path / "i.gguf", drop_meta={"qwen35moe.attention.recurrent_layers"})
    cfg, params = _load(path)
    want_cfg, want = _load(src)
    assert cfg == want_cfg and cfg.layer_types == (L, L, L, F)
    for a, b in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    path = _rewrite(src, tmp_path / "i2.gguf", drop_meta={"qwen35moe.attention.recurrent_layers"},
                    meta={"qwen35moe.full_attention_interval": 2})
    assert load_config(path).layer_types == (L, F, L, F)
    with pytest.raises(ValueError, match=r"i2.gguf: tensor 'blk.1.ssm_a' makes blk.1 a "
                                         r"linear-attention layer but the metadata \(field "
                                         r"qwen35moe.attention.recurrent_layers, else "
                                         r"qwen35moe.full_attention_interval\) makes it full"):
        _load(path)
