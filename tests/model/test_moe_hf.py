"""MoE targets from tiny random ``save_pretrained`` checkpoints (Qwen3-MoE, GLM-4.5, ERNIE-4.5-MoE):
jmtp's logits equal transformers' (fp32, |Δ| <= 1e-4) for a single prefill and for a prefill in
chunks over shuffled, NaN-poisoned KV blocks followed by one-token paged decode steps, with both
expert implementations (ragged_dot and the dense reference); a sharded checkpoint (several
safetensors files + index json) loads; GLM-4.5's MTP layer (``model.layers.{N}``, MoE block
inside) matches transformers' own ``Glm4MoeDecoderLayer`` run as the MTP block."""
from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import save_file

from jmtp.model import forward_logits, init_kv_cache, load_checkpoint, mtp_forward, ragged_batch
from tests.model.paged_logits import chunked_paged_logits

torch = pytest.importorskip("torch")
torch.set_num_threads(1)
transformers = pytest.importorskip("transformers")

V, H, L = 128, 64, 3
COMMON = dict(vocab_size=V, hidden_size=H, intermediate_size=96, moe_intermediate_size=32,
              num_hidden_layers=L, num_attention_heads=4, num_key_value_heads=2)

# Each: the HF config (several experts, top-k >= 2, shared experts where the family has them,
# a dense first layer) and the MoE layers jmtp must derive from it.
CASES = {
    "qwen3_moe": (lambda: transformers.Qwen3MoeConfig(
        **COMMON, head_dim=16, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
        mlp_only_layers=[0], tie_word_embeddings=False), (1, 2)),
    # every layer MoE: the layers stay one stack (one lax.scan)
    "qwen3_moe_all_sparse": (lambda: transformers.Qwen3MoeConfig(
        **COMMON, head_dim=16, num_experts=4, num_experts_per_tok=2, norm_topk_prob=False),
        (0, 1, 2)),
    "glm4_moe": (lambda: transformers.Glm4MoeConfig(
        **COMMON, head_dim=16, n_routed_experts=8, num_experts_per_tok=3, n_group=2, topk_group=1,
        n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=1.8,
        attention_bias=True, use_qk_norm=True, partial_rotary_factor=0.5), (1, 2)),
    "ernie4_5_moe": (lambda: transformers.Ernie4_5_MoeConfig(
        **COMMON, moe_num_experts=8, moe_k=2, moe_num_shared_experts=1, moe_layer_start_index=1,
        rope_theta=500000.0), (1, 2)),
}


def _randomize(model, seed: int):
    """Every tensor random (norms around 1, score-correction biases on the scale of the scores so
    that they change the choice), so a tensor in the wrong slot changes the logits."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            noise = torch.randn(p.shape, generator=g)
            if "e_score_correction_bias" in name:
                p.copy_(0.05 * noise)
            elif "inv_freq" in name:
                continue
            elif "norm" in name:
                p.copy_(1 + 0.2 * noise)
            else:
                p.copy_((0.5 if "embed" in name else 0.1) * noise)
    return model


def _build(case, seed, **config_kw):
    transformers.logging.set_verbosity_error()
    torch.manual_seed(seed)
    config = CASES[case][0]()
    for k, v in config_kw.items():
        setattr(config, k, v)
    config._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return _randomize(model, seed).eval()


@pytest.fixture(scope="module", params=list(CASES))
def checkpoint(request, tmp_path_factory):
    case = request.param
    path = tmp_path_factory.mktemp(case)
    model = _build(case, seed=len(case))
    # max_shard_size: several safetensors files plus model.safetensors.index.json
    model.save_pretrained(path, max_shard_size="100KB")
    cfg, params = load_checkpoint(path, dtype=jnp.float32)
    ids = np.random.default_rng(1).integers(0, V, size=29).tolist()
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].numpy()
    return case, path, cfg, params, ids, ref


def test_config_and_sharded_files(checkpoint):
    case, path, cfg, params, _, _ = checkpoint
    assert len(list(path.glob("*.safetensors"))) > 1 and (path / "model.safetensors.index.json").is_file()
    assert cfg.moe is not None and cfg.moe.layers == CASES[case][1]
    if case == "qwen3_moe_all_sparse":
        assert isinstance(params["layers"], dict) and params["layers"]["router"].shape == (L, H, 4)
    else:
        assert isinstance(params["layers"], tuple) and "w_gate" in params["layers"][0]
        assert all("router" in params["layers"][i] for i in cfg.moe.layers)
    if case == "glm4_moe":
        assert cfg.rotary_dim == 8 and cfg.attention_bias and cfg.qk_norm
        assert cfg.moe.scoring == "sigmoid" and cfg.moe.n_group == 2
        assert cfg.moe.routed_scaling_factor == pytest.approx(1.8)


@pytest.mark.parametrize("impl", ["ragged", "dense"])
def test_prefill_logits_match_transformers(checkpoint, impl):
    _, _, cfg, params, ids, ref = checkpoint
    cfg = cfg.replace(moe=cfg.moe.replace(implementation=impl))
    ours = np.asarray(forward_logits(cfg, params, ids))
    assert np.abs(ref).max() > 0.5
    np.testing.assert_allclose(ours, ref, rtol=0, atol=1e-4)


def test_chunked_prefill_and_paged_decode_match_transformers(checkpoint):
    """Prefill 20 tokens in chunks of 7 (the last one shorter), then decode the rest one token
    per step, over shuffled KV blocks poisoned with NaN; every row's logits = transformers'."""
    _, _, cfg, params, ids, ref = checkpoint
    got = chunked_paged_logits(cfg, params, ids, prefill=20, chunk=7)
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-4)


# ---------------------------------------------------------------------------------------------
# GLM-4.5 MTP layer (DeepSeek naming, MoE block inside)

def test_glm_mtp_layer_matches_transformers_block(tmp_path):
    """``model.layers.{N}.{enorm,hnorm,eh_proj,shared_head.norm}`` + a full MoE decoder layer.
    Reference: transformers' ``Glm4MoeDecoderLayer`` (layer index N, so MoE) with those weights,
    run on ``eh_proj([enorm(embed(x)); hnorm(h)])`` with a causal mask and GLM's partial RoPE,
    then ``shared_head.norm``."""
    target = _build("glm4_moe", seed=5)
    target.save_pretrained(tmp_path)
    donor = _build("glm4_moe", seed=6, num_hidden_layers=L + 1)   # its layer N is the MTP block
    block = donor.model.layers[L]
    rng = np.random.default_rng(0)
    p = f"model.layers.{L}."
    t = {p + k: v.detach().numpy().copy() for k, v in block.state_dict().items()}
    norms = {n: (1 + 0.2 * rng.standard_normal(H)).astype(np.float32)
             for n in ("enorm", "hnorm", "shared_head.norm")}
    t.update({p + n + ".weight": w for n, w in norms.items()})
    eh = (0.1 * rng.standard_normal((H, 2 * H))).astype(np.float32)
    t[p + "eh_proj.weight"] = eh
    save_file(t, str(tmp_path / "mtp.safetensors"))

    cfg, params = load_checkpoint(tmp_path, dtype=jnp.float32)
    assert (cfg.mtp_layout, cfg.num_mtp_layers, cfg.moe.mtp_moe) == ("deepseek", 1, True)
    assert "router_bias" in params["mtp"]["layer"]

    T = 9
    ids = rng.integers(0, V, size=T)
    hidden = rng.standard_normal((T, H)).astype(np.float32)
    # reference in torch
    rms = lambda x, w: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps) * w
    with torch.no_grad():
        e = target.model.embed_tokens(torch.tensor(ids))
        z = torch.cat([rms(e, torch.tensor(norms["enorm"])),
                       rms(torch.tensor(hidden), torch.tensor(norms["hnorm"]))], -1)
        x = (z @ torch.tensor(eh).T)[None]
        pos_ids = torch.arange(T)[None]
        cos_sin = target.model.rotary_emb(x, pos_ids)
        mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
        out = block(x, attention_mask=mask, position_ids=pos_ids, position_embeddings=cos_sin)
        out = out[0] if isinstance(out, tuple) else out
        want = rms(out[0], torch.tensor(norms["shared_head.norm"])).numpy()
    # jmtp: prefill the first 6 rows, then 3 one-row decode steps
    bs = 4
    cache = init_kv_cache(cfg, 1, 4, bs)
    tables = jnp.asarray([[2, 0, 3]], jnp.int32)
    got = []
    for a, b in [(0, 6), (6, 7), (7, 8), (8, 9)]:
        pos, meta = ragged_batch(jnp.array([b - a]), jnp.array([a]), tables, bs, b - a)
        h, _, cache = jax.jit(mtp_forward, static_argnums=0)(
            cfg, params, 0, jnp.asarray(ids[a:b], jnp.int32), jnp.asarray(hidden[a:b]), pos, meta,
            cache)
        got.append(np.asarray(h))
    np.testing.assert_allclose(np.concatenate(got), want, rtol=0, atol=1e-4)


def test_mtp_head_file_round_trip_sets_the_head_kind(tmp_path):
    """A MoE MTP head exported to a head file and attached again: same arrays, and
    ``cfg.moe.mtp_moe`` follows the file (MoE head onto a config that said dense); a MoE head
    onto a dense model is refused."""
    from jmtp.model import init_params
    from jmtp.model.checkpoints.mtp_head import attach_mtp_head, export_mtp_head
    from tests.runtime.conftest import TINY, TINY_MOE
    cfg = TINY.replace(**TINY_MOE)
    params = init_params(cfg, jax.random.key(0), std=0.3)
    export_mtp_head(str(tmp_path / "head.safetensors"), params["mtp"], cfg, dtype=jnp.float32)
    dense_head_cfg = cfg.replace(moe=cfg.moe.replace(mtp_moe=False))
    cfg2, params2 = attach_mtp_head(dense_head_cfg, params, str(tmp_path / "head.safetensors"))
    assert cfg2.moe.mtp_moe and cfg2 == cfg
    for k, v in params["mtp"]["layer"].items():
        np.testing.assert_array_equal(np.asarray(params2["mtp"]["layer"][k]), np.asarray(v))
    with pytest.raises(ValueError, match="MoE block but the model is dense"):
        attach_mtp_head(TINY.replace(num_layers=3), init_params(TINY.replace(num_layers=3),
                                                                 jax.random.key(0)),
                        str(tmp_path / "head.safetensors"))
