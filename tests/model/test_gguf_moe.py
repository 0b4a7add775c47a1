"""GGUF loading of the MoE families, against files written by llama.cpp's own converter.

Fixtures (``tests/model/fixtures/gguf_moe/<family>/``, built by ``scripts/make_gguf_fixtures.py``):
a tiny random transformers checkpoint (``save_pretrained``) and ``model.gguf``, its conversion by
llama.cpp's ``convert_hf_to_gguf.py`` (F32). jmtp's GGUF-loaded model must give transformers'
logits on the HF files (fp32, |Δ| <= 1e-4) for a single prefill and for a chunked prefill plus
one-token paged decode steps over shuffled, NaN-poisoned KV blocks, and the same parameters as
jmtp's own HF loader. Bad files (a missing expert tensor, an expert count that disagrees with the
tensors) raise ValueError naming the tensor/field.
"""
from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

from jmtp.model import forward_logits, load_checkpoint
from tests.model.paged_logits import chunked_paged_logits

torch = pytest.importorskip("torch")
torch.set_num_threads(1)
transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

FIXTURES = Path(__file__).parent / "fixtures" / "gguf_moe"
# family -> (HF architecture, MoE layers)
FAMILIES = {
    "qwen3moe": ("Qwen3MoeForCausalLM", (0, 1)),
    # MLA with attn_k_b/attn_v_b (kv_b_proj split by the converter), YaRN, dense layer 0, grouped
    # sigmoid router with exp_probs_b, a shared expert
    "deepseek2": ("DeepseekV3ForCausalLM", (1, 2)),
    # the other MLA query form (attn_q), tied embeddings (no output.weight), no rope scaling,
    # ungrouped top-k without renormalisation (no expert_weights_norm key)
    "deepseek2-qproj": ("DeepseekV3ForCausalLM", (1,)),
    # partial rotary, q/k/v biases, q/k norm, dense layer 0, grouped sigmoid router, a shared
    # expert, one NextN (MTP) layer blk.3 with a MoE block
    "glm4moe": ("Glm4MoeForCausalLM", (1, 2)),
    # interleaved RoPE, dense layer 0, softmax router with the moe_statics bias (exp_probs_b,
    # stored [E, 1]), two shared experts
    "ernie4_5-moe": ("Ernie4_5_MoeForCausalLM", (1, 2)),
}
ARCHS = ["qwen3moe", "deepseek2", "glm4moe", "ernie4_5-moe"]   # directory = general.architecture


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request):
    fam = request.param
    d = FIXTURES / fam
    transformers.logging.set_verbosity_error()
    model = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    v = model.config.vocab_size
    ids = np.random.default_rng(1).integers(0, v, size=23).tolist()
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].numpy()
    cfg, params = load_checkpoint(d / "model.gguf", dtype=jnp.float32)
    return fam, d, cfg, params, ids, ref


def test_config_matches_hf_loader(family):
    fam, d, cfg, _, _, _ = family
    hf_cfg, _ = load_checkpoint(d, dtype=jnp.float32)
    assert cfg.architecture == FAMILIES[fam][0]
    assert cfg.moe is not None and cfg.moe.layers == FAMILIES[fam][1]
    # GGUF stores floats as f32, and GLM's converter adds eot/eom ids to the stop tokens; every
    # other field is the HF loader's
    assert cfg.rms_norm_eps == pytest.approx(hf_cfg.rms_norm_eps, rel=1e-6)
    assert cfg.moe.routed_scaling_factor == pytest.approx(hf_cfg.moe.routed_scaling_factor, rel=1e-6)
    assert set(hf_cfg.eos_token_ids) <= set(cfg.eos_token_ids)
    assert cfg.replace(rms_norm_eps=hf_cfg.rms_norm_eps, eos_token_ids=hf_cfg.eos_token_ids,
                       moe=cfg.moe.replace(routed_scaling_factor=hf_cfg.moe.routed_scaling_factor)
                       ) == hf_cfg
    if fam == "deepseek2":
        assert cfg.is_mla and cfg.rope_scaling.rope_type == "yarn"
        assert cfg.moe.shared_intermediate_size and cfg.moe.score_bias and cfg.moe.n_group == 2
    if fam == "deepseek2-qproj":
        assert cfg.q_lora_rank is None and cfg.tie_word_embeddings and cfg.rope_scaling is None
        assert not cfg.moe.norm_topk_prob and cfg.moe.routed_scaling_factor == 1.5
    if fam == "glm4moe":   # the NextN layer is loaded as the MTP module (not a fresh head)
        assert (cfg.num_layers, cfg.num_mtp_layers, cfg.mtp_layout) == (3, 1, "deepseek")
        assert cfg.moe.mtp_moe and cfg.rotary_dim == 4 and cfg.attention_bias and cfg.qk_norm


def test_params_equal_hf_loader(family):
    """Every target tensor equals the HF loader's (the fresh MTP heads are compared too: both come
    from the same key and the same target tensors)."""
    _, d, _, params, _, _ = family
    _, hf_params = load_checkpoint(d, dtype=jnp.float32)
    flat, tree = jax.tree_util.tree_flatten_with_path(params)
    hf_flat, hf_tree = jax.tree_util.tree_flatten_with_path(hf_params)
    assert tree == hf_tree
    for (path, a), (_, b) in zip(flat, hf_flat):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b),
                                      err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("impl", ["ragged", "dense"])
def test_prefill_logits_match_transformers(family, impl):
    _, _, cfg, params, ids, ref = family
    cfg = cfg.replace(moe=cfg.moe.replace(implementation=impl))
    ours = np.asarray(forward_logits(cfg, params, ids))
    assert np.abs(ref).max() > 0.5
    np.testing.assert_allclose(ours, ref, rtol=0, atol=1e-4)


def test_chunked_prefill_and_paged_decode_match_transformers(family):
    """Prefill 16 tokens in chunks of 6, then decode one token per step, over shuffled KV blocks
    poisoned with NaN; every row's logits = transformers'."""
    _, _, cfg, params, ids, ref = family
    got = chunked_paged_logits(cfg, params, ids, prefill=16, chunk=6)
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-4)


# ---------------------------------------------------------------------------------------------
# Bad files: a copy of a fixture with one tensor dropped or one metadata value changed

def _rewrite(src: Path, dst: Path, drop=(), meta=None, add=None) -> Path:
    """Copy the GGUF ``src`` to ``dst`` without the tensors in ``drop``, with the metadata
    values in ``meta`` (same value types) replaced and the f32 tensors ``add`` appended."""
    meta = meta or {}
    r = gguf.GGUFReader(str(src))
    arch = r.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(str(dst), arch)
    for key, field in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, meta.get(key, field.contents()), vtype, sub_type=sub)
    for t in r.tensors:
        if t.name not in drop:
            w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    for name, value in (add or {}).items():
        w.add_tensor(name, np.asarray(value, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


@pytest.mark.parametrize("fam", ARCHS)
def test_missing_expert_tensor(fam, tmp_path):
    path = _rewrite(FIXTURES / fam / "model.gguf", tmp_path / "m.gguf",
                    drop={"blk.1.ffn_up_exps.weight"})
    with pytest.raises(ValueError, match=r"m.gguf: missing tensor 'blk.1.ffn_up_exps.weight' "
                                         r"\(layer 1 is a MoE layer\)"):
        load_checkpoint(path, dtype=jnp.float32)


@pytest.mark.parametrize("fam", ARCHS)
def test_wrong_expert_count(fam, tmp_path):
    key = f"{fam}.expert_count"
    e = gguf.GGUFReader(str(FIXTURES / fam / "model.gguf")).fields[key].contents()
    path = _rewrite(FIXTURES / fam / "model.gguf", tmp_path / "e.gguf", meta={key: e * 2})
    layer = FAMILIES[fam][1][0]
    with pytest.raises(ValueError, match=rf"e.gguf: tensor 'blk.{layer}.ffn_gate_inp.weight' holds "
                                         rf"{e} experts but field {key} = {2 * e}"):
        load_checkpoint(path, dtype=jnp.float32)
    path = _rewrite(FIXTURES / fam / "model.gguf", tmp_path / "k.gguf",
                    meta={f"{fam}.expert_used_count": e + 1})
    with pytest.raises(ValueError, match=rf"k.gguf: field {fam}.expert_used_count = {e + 1} must "
                                         rf"lie in \[1, {key} = {e}\]"):
        load_checkpoint(path, dtype=jnp.float32)


def test_unknown_tensors_are_reported(tmp_path, caplog):
    """A tensor no jmtp parameter reads (Qwen2-MoE's shared-expert gate) is named in a warning;
    an output-projection bias, which jmtp's block lacks, is refused."""
    src = FIXTURES / "qwen3moe" / "model.gguf"
    path = _rewrite(src, tmp_path / "u.gguf", add={"blk.0.ffn_gate_inp_shexp.weight": np.ones(32)})
    with caplog.at_level("WARNING", logger="jmtp.model.checkpoints.gguf_loader"):
        load_checkpoint(path, dtype=jnp.float32)
    assert "u.gguf: 1 GGUF tensor(s) not used, e.g. blk.0.ffn_gate_inp_shexp.weight" in caplog.text
    path = _rewrite(src, tmp_path / "o.gguf", add={"blk.1.attn_output.bias": np.ones(32)})
    with pytest.raises(ValueError, match=r"o.gguf \(GGUF tensor 'blk.1.attn_output.bias'\): tensor "
                                         r"'model.layers.1.self_attn.o_proj.bias' is not supported"):
        load_checkpoint(path, dtype=jnp.float32)


def test_deepseek2_split_kv_b_and_router_errors(tmp_path):
    src = FIXTURES / "deepseek2" / "model.gguf"
    path = _rewrite(src, tmp_path / "kb.gguf", drop={"blk.2.attn_v_b.weight"})
    with pytest.raises(ValueError, match=r"kb.gguf: missing tensor 'blk.2.attn_v_b.weight' \(MLA "
                                         r"layer 2 has no blk.2.attn_kv_b.weight either\)"):
        load_checkpoint(path, dtype=jnp.float32)
    path = _rewrite(src, tmp_path / "g.gguf", meta={"deepseek2.expert_gating_func": 1})
    with pytest.raises(ValueError, match=r"g.gguf: field deepseek2.expert_gating_func = 1 .* not "
                                         r"supported"):
        load_checkpoint(path, dtype=jnp.float32)
    path = _rewrite(src, tmp_path / "b.gguf", drop={"blk.2.exp_probs_b.bias"})
    with pytest.raises(ValueError, match=r"b.gguf: missing tensor 'blk.2.exp_probs_b.bias'"):
        load_checkpoint(path, dtype=jnp.float32)


def test_deepseek2_legacy_unsplit_kv_b(tmp_path):
    """Files written before llama.cpp split ``kv_b_proj`` hold ``attn_kv_b.weight``
    (``[N·(dn+dv), C]``, HF's kv_b_proj) and no ``*_mla`` length keys; the same parameters load."""
    src = FIXTURES / "deepseek2"
    kv_b = {n: t for n, t in load_file(str(src / "model.safetensors")).items()
            if n.endswith("kv_b_proj.weight")}
    r = gguf.GGUFReader(str(src / "model.gguf"))
    dst = tmp_path / "legacy.gguf"
    w = gguf.GGUFWriter(str(dst), "deepseek2")
    legacy_len = {"deepseek2.attention.key_length": r.fields["deepseek2.attention.key_length_mla"],
                  "deepseek2.attention.value_length": r.fields["deepseek2.attention.value_length_mla"]}
    for key, field in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or "_mla" in key:
            continue
        field = legacy_len.get(key, field)
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, field.contents(), vtype, sub_type=sub)
    for t in r.tensors:
        if t.name.endswith(("attn_k_b.weight", "attn_v_b.weight")):
            if t.name.endswith("attn_k_b.weight"):
                i = t.name.split(".")[1]
                w.add_tensor(f"blk.{i}.attn_kv_b.weight",
                             kv_b[f"model.layers.{i}.self_attn.kv_b_proj.weight"])
            continue
        w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    cfg, params = load_checkpoint(dst, dtype=jnp.float32)
    want_cfg, want = load_checkpoint(src / "model.gguf", dtype=jnp.float32)
    assert cfg == want_cfg
    for a, b in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_glm4moe_missing_nextn_tensor(tmp_path):
    path = _rewrite(FIXTURES / "glm4moe" / "model.gguf", tmp_path / "n.gguf",
                    drop={"blk.3.nextn.eh_proj.weight"})
    with pytest.raises(ValueError, match=r"n.gguf: missing tensor 'blk.3.nextn.eh_proj.weight' "
                                         r"\(field glm4moe.nextn_predict_layers = 1"):
        load_checkpoint(path, dtype=jnp.float32)


def test_qwen3moe_q8_0_experts_within_quantisation_error():
    """llama.cpp's ``--outtype q8_0`` file: the 3-D expert tensors ``ffn_{gate,up}_exps`` are Q8_0
    (``ffn_down_exps`` F16). Each dequantised expert weight lies within half a Q8_0 step
    (``max|block| / 127 / 2`` per 32-value block along the input axis, plus the f16 rounding
    of the block scale: ``max|block| · 2^-10``) of transformers' weight
    for the same expert, so the expert stacking and block order survive quantisation; logits stay
    close to transformers'."""
    d = FIXTURES / "qwen3moe"
    r = gguf.GGUFReader(str(d / "model-q8_0.gguf"))
    assert {t.name: t.tensor_type.name for t in r.tensors}["blk.1.ffn_gate_exps.weight"] == "Q8_0"
    cfg, params = load_checkpoint(d / "model-q8_0.gguf", dtype=jnp.float32)
    hf = load_file(str(d / "model.safetensors"))
    e, h = cfg.moe.num_experts, cfg.hidden_size
    for i in range(cfg.num_layers):
        for proj, ours in (("gate_proj", "experts_gate"), ("up_proj", "experts_up")):
            want = np.stack([hf[f"model.layers.{i}.mlp.experts.{j}.{proj}.weight"] for j in range(e)])
            got = np.asarray(params["layers"][ours][i]).transpose(0, 2, 1)      # [E, I, H]
            blocks = want.reshape(e, -1, h // 32, 32)
            amax = np.abs(blocks).max(-1, keepdims=True)
            half_step = amax / 127 / 2 + amax * 2.0 ** -10    # + the f16 rounding of the scale
            err = np.abs(got - want).reshape(blocks.shape)
            assert (err <= half_step + 1e-7).all() and err.max() > 0, (i, proj)
        want = np.stack([hf[f"model.layers.{i}.mlp.experts.{j}.down_proj.weight"] for j in range(e)])
        got = np.asarray(params["layers"]["experts_down"][i]).transpose(0, 2, 1)  # [E, H, I]
        np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-6)                # F16
    transformers.logging.set_verbosity_error()
    model = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    ids = np.random.default_rng(2).integers(0, cfg.vocab_size, size=17).tolist()
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_allclose(np.asarray(forward_logits(cfg, params, ids)), ref, rtol=0, atol=3e-2)
