"""DeepSeek-V3 (multi-head latent attention) against transformers on tiny random checkpoints.

Every test compares to an independent computation: transformers' ``DeepseekV3ForCausalLM`` (torch,
CPU, fp32) for the loader and the forward, or the numpy reference of
:mod:`tests.model.mla_reference` for the MTP layer.
"""
from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jmtp.model import forward_logits, init_kv_cache, load_checkpoint, ragged_batch
from jmtp.model.llama import compute_logits, forward

torch = pytest.importorskip("torch")
torch.set_num_threads(1)
transformers = pytest.importorskip("transformers")

V = 128
BASE = dict(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16,
            qk_rope_head_dim=8, v_head_dim=12,
            # MoE as DeepSeek-V3's, scaled down: layer 0 dense, layer 1 (and the MTP layer) MoE with
            # 8 routed experts in 4 groups (2 kept), top-3, one shared expert, sigmoid router with a
            # score-correction bias, routed_scaling_factor
            first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=3,
            moe_intermediate_size=24, n_shared_experts=1, n_group=4, topk_group=2,
            routed_scaling_factor=2.5, norm_topk_prob=True,
            max_position_embeddings=256, tie_word_embeddings=False, num_mtp_layers=0)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 16, "mscale": 1.0, "mscale_all_dim": 0.7,
        "beta_fast": 32, "beta_slow": 1}

CASES = {
    # DeepSeek-V3's own shape: q compressed, interleaved RoPE, YaRN with mscale_all_dim
    "q_lora_interleaved_yarn": dict(q_lora_rank=24, rope_interleave=True, rope_parameters=YARN),
    # DeepSeek-V2-Lite style: one q_proj, rotate-half RoPE, no scaling
    "q_proj_plain_rope": dict(q_lora_rank=None, rope_interleave=False),
}


def _randomize(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.2 * noise if "norm" in name else (0.5 if "embed" in name else 0.08) * noise)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):   # zeros at init: make it matter
                b.copy_(0.1 * torch.randn(b.shape, generator=g))
    return model


def _save(path, seed=0, **kw):
    transformers.logging.set_verbosity_error()
    torch.manual_seed(seed)
    config = transformers.DeepseekV3Config(**{**BASE, **kw})
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize(model, seed).eval()
    model.save_pretrained(path)
    return model


def _hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


@pytest.fixture(scope="module", params=list(CASES))
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    model = _save(path, seed=len(request.param), **CASES[request.param])
    ids = np.random.default_rng(1).integers(0, V, size=29).tolist()
    return request.param, path, model, ids, _hf_logits(model, ids)


@pytest.mark.parametrize("path_kind", ["absorbed", "expanded"])
def test_logits_match_transformers(checkpoint, path_kind):
    case, path, _, ids, ref = checkpoint
    cfg, params = load_checkpoint(path, dtype=jnp.float32)
    assert cfg.is_mla and cfg.architecture == "DeepseekV3ForCausalLM"
    assert cfg.q_lora_rank == CASES[case]["q_lora_rank"] and cfg.kv_lora_rank == 32
    assert cfg.moe_layer_kinds == (False, True) and cfg.moe.n_group == 4
    assert cfg.moe.shared_intermediate_size == 24 and cfg.moe.routed_scaling_factor == 2.5
    assert (cfg.rope_scaling is not None) == ("rope_parameters" in CASES[case])
    ours = np.asarray(forward_logits(cfg.replace(mla_path=path_kind), params, ids, block_size=8))
    assert np.abs(ref).max() > 0.5
    np.testing.assert_allclose(ours, ref, rtol=0, atol=1e-4)


def _chunked_logits(cfg, params, seqs, schedule, block_size=4):
    """Logits of every position of each sequence in ``seqs``, run through the paged forward in
    steps: ``schedule[i]`` = new tokens per sequence at step i (prefill chunks, then decode 1s),
    all sequences packed into one ragged batch per step, sharing one block pool."""
    s = len(seqs)
    pages = max(-(-len(q) // block_size) for q in seqs)
    cache = init_kv_cache(cfg, cfg.num_layers, s * pages + 1, block_size, jnp.float32)
    tables = (1 + np.arange(s * pages, dtype=np.int32).reshape(pages, s).T)  # interleaved blocks
    done = [0] * s
    out = [[] for _ in range(s)]
    step = jax.jit(lambda ids, pos, meta, cache: forward(cfg, params, ids, pos, meta, cache))
    for new in schedule:
        new = [min(n, len(q) - d) for n, q, d in zip(new, seqs, done)]
        ids = np.concatenate([np.asarray(q[d:d + n], np.int32) for q, d, n in zip(seqs, done, new)])
        t = max(8, len(ids))
        pos, meta = ragged_batch(jnp.asarray(new, jnp.int32), jnp.asarray(done, jnp.int32),
                                 jnp.asarray(tables), block_size, t)
        h, cache = step(jnp.asarray(np.pad(ids, (0, t - len(ids)))), pos, meta, cache)
        logits = np.asarray(compute_logits(params, h))
        row = 0
        for i, n in enumerate(new):
            out[i].append(logits[row:row + n])
            row += n
            done[i] += n
    assert done == [len(q) for q in seqs]
    return [np.concatenate(o) for o in out]


def test_chunked_prefill_and_paged_decode(checkpoint):
    """Two sequences in one ragged batch: prefill in chunks of 5/3, then decode one token per step
    and a 3-token verify-like window, over a block pool shared by both."""
    case, path, model, ids, ref = checkpoint
    cfg, params = load_checkpoint(path, dtype=jnp.float32)
    other = np.random.default_rng(7).integers(0, V, size=17).tolist()
    schedule = [[5, 3], [5, 3], [5, 3], [1, 1], [1, 1], [3, 1], [1, 1]] + [[1, 1]] * 20
    for kind in ("absorbed", "expanded"):
        got = _chunked_logits(cfg.replace(mla_path=kind), params, [ids, other], schedule)
        np.testing.assert_allclose(got[0], ref, rtol=0, atol=1e-4)
        np.testing.assert_allclose(got[1], _hf_logits(model, other), rtol=0, atol=1e-4)


def test_absorbed_equals_expanded_on_random_params():
    """The decode (absorbed) and prefill (expanded) paths are one function."""
    from jmtp.model import ModelConfig, init_params
    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2,
                      num_heads=4, num_kv_heads=4, head_dim=8, attention_type="mla",
                      q_lora_rank=16, kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=8,
                      v_head_dim=20, num_mtp_layers=0)   # v wider than q/k: padding path
    params = init_params(cfg, jax.random.PRNGKey(0), std=0.2)
    ids = list(range(3, 40))
    a = np.asarray(forward_logits(cfg, params, ids, block_size=4))
    b = np.asarray(forward_logits(cfg.replace(mla_path="expanded"), params, ids, block_size=4))
    assert np.abs(a).max() > 0.5
    np.testing.assert_allclose(a, b, rtol=0, atol=2e-5)


def _quantize_fp8(w: np.ndarray, block: int):
    """Block-scaled fp8 e4m3 of ``w f32[M, N]`` as DeepSeek-V3 stores it: ``(q, scale_inv)`` with
    ``w ≈ q * scale_inv[i // block, j // block]`` (absmax / 448 per block)."""
    m, n = w.shape
    gm, gn = -(-m // block), -(-n // block)
    scale = np.zeros((gm, gn), np.float32)
    q = np.zeros((m, n), ml_dtypes.float8_e4m3fn)
    for i in range(gm):
        for j in range(gn):
            blk = w[i * block:(i + 1) * block, j * block:(j + 1) * block]
            s = max(float(np.abs(blk).max()) / 448.0, 1e-12)
            scale[i, j] = s
            q[i * block:(i + 1) * block, j * block:(j + 1) * block] = (blk / s).astype(
                ml_dtypes.float8_e4m3fn)
    return q, scale


def test_fp8_block_scaled_checkpoint(tmp_path):
    """An fp8 checkpoint (F8_E4M3 weights + weight_scale_inv, sharded) loads 8-bit: the values and
    scales are the file's (their product the dequantised weight exactly), and the logits equal
    transformers' on the dequantised model."""
    from safetensors.numpy import load_file, save_file
    from jmtp.model.quant import dequantize, is_quantized
    block = 16
    model = _save(tmp_path / "src", seed=3, q_lora_rank=24)
    tensors = load_file(str(tmp_path / "src" / "model.safetensors"))
    out = tmp_path / "fp8"
    out.mkdir()
    deq = {}
    for name, w in list(tensors.items()):
        # DeepSeek quantises the Linear weights (kv_a_proj_with_mqa included), not the router
        if name.endswith(("proj.weight", "proj_with_mqa.weight")) and w.ndim == 2:
            q, s = _quantize_fp8(w.astype(np.float32), block)
            tensors[name], tensors[name + "_scale_inv"] = q, s
            deq[name] = (q.astype(np.float32) * np.repeat(np.repeat(s, block, 0), block, 1)[
                :w.shape[0], :w.shape[1]])
    assert len(deq) >= 10
    names = sorted(tensors)
    shards = [names[:len(names) // 2], names[len(names) // 2:]]
    weight_map = {}
    for k, part in enumerate(shards):
        fname = f"model-0000{k + 1}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, str(out / fname))
        weight_map.update({n: fname for n in part})
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    hf = json.loads((tmp_path / "src" / "config.json").read_text())
    hf["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                 "weight_block_size": [block, block]}
    (out / "config.json").write_text(json.dumps(hf))
    cfg, params = load_checkpoint(out, dtype=jnp.float32)
    layers = params["layers"]          # dense layer 0 + MoE layer 1: a tuple of per-layer dicts
    assert is_quantized(layers[1]["wkv_b"]) and layers[1]["wkv_b"].dtype == jnp.float8_e4m3fn
    np.testing.assert_array_equal(np.asarray(dequantize(layers[1]["wkv_b"])),
                                  deq["model.layers.1.self_attn.kv_b_proj.weight"].T)
    np.testing.assert_array_equal(np.asarray(dequantize(layers[0]["w_down"])),
                                  deq["model.layers.0.mlp.down_proj.weight"].T)
    np.testing.assert_array_equal(np.asarray(dequantize(layers[1]["experts_up"][5])),
                                  deq["model.layers.1.mlp.experts.5.up_proj.weight"].T)
    # the reference: transformers on the dequantised weights (an fp32 checkpoint of them)
    ref_dir = tmp_path / "deq"
    ref_dir.mkdir()
    plain = load_file(str(tmp_path / "src" / "model.safetensors"))
    save_file({**plain, **deq}, str(ref_dir / "model.safetensors"), metadata={"format": "pt"})
    (ref_dir / "config.json").write_text((tmp_path / "src" / "config.json").read_text())
    model = transformers.AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32).eval()
    ids = list(range(5, 30))
    np.testing.assert_allclose(np.asarray(forward_logits(cfg, params, ids)), _hf_logits(model, ids),
                               rtol=0, atol=1e-4)
    # without the block size the loader refuses, naming the field
    del hf["quantization_config"]
    (out / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ValueError, match="weight_block_size"):
        load_checkpoint(out, dtype=jnp.float32)


def test_config_errors():
    from jmtp.model import ModelConfig
    with pytest.raises(ValueError, match="qk_rope_head_dim"):
        ModelConfig(attention_type="mla", kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=8,
                    v_head_dim=8, head_dim=16)
    with pytest.raises(ValueError, match="kv_lora_rank"):
        ModelConfig(attention_type="mla", head_dim=8, qk_nope_head_dim=8, qk_rope_head_dim=8,
                    v_head_dim=8)
    cfg = ModelConfig(attention_type="mla", head_dim=8, kv_lora_rank=8, qk_nope_head_dim=8,
                      qk_rope_head_dim=8, v_head_dim=8)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        init_kv_cache(cfg, 1, 4, 4, kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="mla_path"):
        cfg.replace(mla_path="naive")


# ---------------------------------------------------------------------------------------------
# The DeepSeek-V3 MTP layer (model.layers.{N}: enorm/hnorm/eh_proj/shared_head + an MLA block)
# against a numpy reference computed from the raw HF-layout tensors.
# ---------------------------------------------------------------------------------------------

def _mtp_tensors(rng, cfg_hf, n):
    """Random HF-named tensors of MTP module ``model.layers.{n}`` (torch ``[out, in]`` layout)."""
    h, nq, c = cfg_hf["hidden_size"], cfg_hf["num_attention_heads"], cfg_hf["kv_lora_rank"]
    dn, dr, dv = cfg_hf["qk_nope_head_dim"], cfg_hf["qk_rope_head_dim"], cfg_hf["v_head_dim"]
    i, r = cfg_hf["intermediate_size"], cfg_hf["q_lora_rank"]
    lin = lambda o, k: (0.08 * rng.standard_normal((o, k))).astype(np.float32)
    norm = lambda k: (1 + 0.2 * rng.standard_normal(k)).astype(np.float32)
    p = f"model.layers.{n}."
    t = {p + "enorm.weight": norm(h), p + "hnorm.weight": norm(h),
         p + "eh_proj.weight": (0.15 * rng.standard_normal((h, 2 * h))).astype(np.float32),
         p + "shared_head.norm.weight": norm(h),
         p + "input_layernorm.weight": norm(h), p + "post_attention_layernorm.weight": norm(h),
         p + "self_attn.kv_a_proj_with_mqa.weight": lin(c + dr, h),
         p + "self_attn.kv_a_layernorm.weight": norm(c),
         p + "self_attn.kv_b_proj.weight": lin(nq * (dn + dv), c),
         p + "self_attn.o_proj.weight": lin(h, nq * dv),

         # DeepSeek-V3 ships copies of the embedding and LM head in the MTP layer: ignored
         p + "embed_tokens.weight": np.zeros((V, h), np.float32),
         p + "shared_head.head.weight": np.zeros((V, h), np.float32)}
    e, ie = cfg_hf.get("n_routed_experts"), cfg_hf.get("moe_intermediate_size")
    if e:    # DeepSeek-V3's MTP layer holds a MoE block
        t[p + "mlp.gate.weight"] = lin(e, h) * 4
        t[p + "mlp.gate.e_score_correction_bias"] = (0.1 * rng.standard_normal(e)).astype(np.float32)
        for j in range(e):
            q = f"{p}mlp.experts.{j}."
            t.update({q + "gate_proj.weight": lin(ie, h), q + "up_proj.weight": lin(ie, h),
                      q + "down_proj.weight": lin(h, ie)})
        si = ie * cfg_hf["n_shared_experts"]
        t.update({p + "mlp.shared_experts.gate_proj.weight": lin(si, h),
                  p + "mlp.shared_experts.up_proj.weight": lin(si, h),
                  p + "mlp.shared_experts.down_proj.weight": lin(h, si)})
    else:
        t.update({p + "mlp.gate_proj.weight": lin(i, h), p + "mlp.up_proj.weight": lin(i, h),
                  p + "mlp.down_proj.weight": lin(h, i)})
    if r is None:
        t[p + "self_attn.q_proj.weight"] = lin(nq * (dn + dr), h)
    else:
        t.update({p + "self_attn.q_a_proj.weight": lin(r, h),
                  p + "self_attn.q_a_layernorm.weight": norm(r),
                  p + "self_attn.q_b_proj.weight": lin(nq * (dn + dr), r)})
    return t


def _np_rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _np_rope(x, pos, inv_freq, factor, interleave):
    """HF ``apply_rotary_pos_emb`` / ``apply_rotary_pos_emb_interleave`` on ``x [T, heads, dr]``."""
    ang = pos[:, None, None] * inv_freq[None, None, :]
    cos, sin = np.cos(ang) * factor, np.sin(ang) * factor
    half = x.shape[-1] // 2
    a, b = (x[..., 0::2], x[..., 1::2]) if interleave else (x[..., :half], x[..., half:])
    return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)


def _np_mla_block(t, p, x, pos, hf, rope):
    """DeepSeek-V3 decoder block (MLA + dense SwiGLU) over T causal tokens, float64."""
    W = lambda n: t[p + n].astype(np.float64).T
    T, nq = x.shape[0], hf["num_attention_heads"]
    c, dn, dr, dv = hf["kv_lora_rank"], hf["qk_nope_head_dim"], hf["qk_rope_head_dim"], hf["v_head_dim"]
    eps = hf["rms_norm_eps"]
    h = _np_rms(x, t[p + "input_layernorm.weight"], eps)
    if p + "self_attn.q_proj.weight" in t:
        q = h @ W("self_attn.q_proj.weight")
    else:
        q = _np_rms(h @ W("self_attn.q_a_proj.weight"), t[p + "self_attn.q_a_layernorm.weight"], 1e-6)
        q = q @ W("self_attn.q_b_proj.weight")
    q = q.reshape(T, nq, dn + dr)
    ckv = h @ W("self_attn.kv_a_proj_with_mqa.weight")
    lat = _np_rms(ckv[:, :c], t[p + "self_attn.kv_a_layernorm.weight"], 1e-6)
    k_pe = rope(ckv[:, None, c:], pos)
    q = np.concatenate([q[..., :dn], rope(q[..., dn:], pos)], axis=-1)
    kv = (lat @ W("self_attn.kv_b_proj.weight")).reshape(T, nq, dn + dv)
    k = np.concatenate([kv[..., :dn], np.broadcast_to(k_pe, (T, nq, dr))], axis=-1)
    v = kv[..., dn:]
    out = np.zeros((T, nq, dv))
    for hq in range(nq):
        s = q[:, hq] @ k[:, hq].T * hf["scaling"]
        s = np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
        pr = np.exp(s - s.max(-1, keepdims=True))
        out[:, hq] = (pr / pr.sum(-1, keepdims=True)) @ v[:, hq]
    x = x + out.reshape(T, nq * dv) @ W("self_attn.o_proj.weight")
    h = _np_rms(x, t[p + "post_attention_layernorm.weight"], eps)
    if p + "mlp.gate.weight" not in t:
        return x + _np_swiglu(t, p + "mlp.", h)
    return x + _np_deepseek_moe(t, p + "mlp.", h, hf)


def _np_swiglu(t, p, h):
    W = lambda n: t[p + n].astype(np.float64).T
    gate, up = h @ W("gate_proj.weight"), h @ W("up_proj.weight")
    return (gate / (1 + np.exp(-gate)) * up) @ W("down_proj.weight")


def _np_deepseek_moe(t, p, h, hf):
    """DeepSeek-V3 MoE (the tech report's DeepSeekMoE section): sigmoid affinities, choice by affinity + bias
    restricted to the ``topk_group`` groups with the largest top-2 sums, weights = affinities of
    the chosen experts normalised to 1 then times ``routed_scaling_factor``; plus shared experts."""
    e, k = hf["n_routed_experts"], hf["num_experts_per_tok"]
    g, kg = hf["n_group"], hf["topk_group"]
    s = 1 / (1 + np.exp(-(h @ t[p + "gate.weight"].astype(np.float64).T)))     # [T, E]
    out = _np_swiglu(t, p + "shared_experts.", h)
    for r in range(h.shape[0]):
        choice = s[r] + t[p + "gate.e_score_correction_bias"]
        groups = choice.reshape(g, e // g)
        top2 = np.sort(groups, axis=1)[:, -2:].sum(1)
        keep = np.argsort(-top2, kind="stable")[:kg]
        allowed = np.isin(np.arange(e) // (e // g), keep)
        chosen = np.argsort(-np.where(allowed, choice, -np.inf), kind="stable")[:k]
        w = s[r, chosen] / s[r, chosen].sum() * hf["routed_scaling_factor"]
        for j, wj in zip(chosen, w):
            out[r] += wj * _np_swiglu(t, f"{p}experts.{j}.", h[r:r + 1])[0]
    return out


def test_deepseek_v3_mtp_layer_matches_numpy(checkpoint, tmp_path):
    """MTP module 0 of a DeepSeek-V3 checkpoint (MLA + MoE block): jmtp's ``mtp_forward`` over a
    5-row prefill chunk, a 3-row chunk and 1-row decode steps on a paged MTP cache equals the
    numpy reference ``x = Block(eh_proj([enorm(embed(x_{t+1})); hnorm(h_t)]))``,
    ``logits = lm_head(shared_head.norm(x))``, with ``x`` (pre-norm) fed to the next sub-step."""
    import shutil
    from safetensors.numpy import load_file, save_file
    from jmtp.model import mtp_forward
    case, src, model, ids, _ = checkpoint
    path = tmp_path / "ckpt"
    shutil.copytree(src, path)
    hf = json.loads((path / "config.json").read_text())
    hf["num_nextn_predict_layers"] = 1
    (path / "config.json").write_text(json.dumps(hf))
    n = hf["num_hidden_layers"]
    t = _mtp_tensors(np.random.default_rng(5), hf, n)
    save_file(t, str(path / "mtp.safetensors"))
    cfg, params = load_checkpoint(path, dtype=jnp.float32)
    assert (cfg.mtp_layout, cfg.num_mtp_layers) == ("deepseek", 1) and cfg.mtp_is_moe

    base = load_file(str(path / "model.safetensors"))
    embed, lm_head = base["model.embed_tokens.weight"], base["lm_head.weight"]
    rot = model.model.rotary_emb
    inv_freq, factor = rot.inv_freq.double().numpy(), float(rot.attention_scaling)
    ref = dict(hf, scaling=float(model.model.layers[0].self_attn.scaling))
    rope = lambda x, pos: _np_rope(x, pos, inv_freq, factor, hf.get("rope_interleave", True))
    rng = np.random.default_rng(9)
    T = 14
    nxt_ids = rng.integers(0, V, size=T).astype(np.int32)
    hidden = rng.standard_normal((T, hf["hidden_size"])).astype(np.float32)
    p = f"model.layers.{n}."
    eps = hf["rms_norm_eps"]
    z = np.concatenate([_np_rms(embed[nxt_ids].astype(np.float64), t[p + "enorm.weight"], eps),
                        _np_rms(hidden.astype(np.float64), t[p + "hnorm.weight"], eps)], axis=-1)
    x_ref = _np_mla_block(t, p, z @ t[p + "eh_proj.weight"].T.astype(np.float64), np.arange(T),
                          ref, rope)
    logits_ref = _np_rms(x_ref, t[p + "shared_head.norm.weight"], eps) @ lm_head.T

    bs, pages = 4, -(-T // 4)
    cache = init_kv_cache(cfg, 1, pages + 2, bs)
    tables = jnp.asarray(np.arange(pages + 2, dtype=np.int32)[::-1][:pages][None])
    run = jax.jit(mtp_forward, static_argnums=(0,))
    got_logits, got_x, done = [], [], 0
    for chunk in [5, 3] + [1] * (T - 8):
        pos, meta = ragged_batch(jnp.array([chunk]), jnp.array([done]), tables, bs, max(chunk, 2))
        pad = lambda a: np.pad(a, [(0, max(chunk, 2) - chunk)] + [(0, 0)] * (a.ndim - 1))
        h, x, cache = run(cfg, params, 0, jnp.asarray(pad(nxt_ids[done:done + chunk])),
                          jnp.asarray(pad(hidden[done:done + chunk])), pos, meta, cache)
        got_logits.append(np.asarray(compute_logits(params, h))[:chunk])
        got_x.append(np.asarray(x)[:chunk])
        done += chunk
    np.testing.assert_allclose(np.concatenate(got_logits), logits_ref, rtol=0, atol=1e-4)
    np.testing.assert_allclose(np.concatenate(got_x), x_ref, rtol=0, atol=1e-4)


@pytest.mark.parametrize("impl", ["pallas_tpu", "pallas_gpu"])
def test_absorbed_path_on_every_attention_implementation(impl):
    """The absorbed path is MQA over the latent (head_dim C + dr): every ragged paged attention
    implementation (the Pallas kernels in interpret mode on CPU) gives the expanded path's result,
    over a prefill chunk and then a 3-row decode/verify window."""
    from jmtp.model import ModelConfig, init_params
    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=1,
                      num_heads=4, num_kv_heads=4, head_dim=8, attention_type="mla",
                      q_lora_rank=16, kv_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=8,
                      v_head_dim=8, num_mtp_layers=0)
    params = init_params(cfg, jax.random.PRNGKey(1), std=0.2)
    ids = np.arange(3, 26, dtype=np.int32)

    def run(c, impl):
        cache = init_kv_cache(c, 1, 5, 8)
        tables = jnp.asarray([[3, 1, 4, 0]], jnp.int32)
        outs = []
        for start, n in ((0, 20), (20, 3)):
            pos, meta = ragged_batch(jnp.array([n]), jnp.array([start]), tables, 8, n)
            h, cache = forward(c, params, jnp.asarray(ids[start:start + n]), pos, meta, cache, impl)
            outs.append(np.asarray(h))
        return np.concatenate(outs)

    ref = run(cfg.replace(mla_path="expanded"), "xla")
    np.testing.assert_allclose(run(cfg, impl), ref, rtol=0, atol=2e-5)


def test_nnx_module_and_params_for_mla_with_moe():
    """init_params / the NNX module build MLA (+ MoE) layers whose shapes check_params accepts, and
    from_params round-trips them (same logits)."""
    from flax import nnx
    from jmtp.model import LlamaForCausalLM, ModelConfig, check_params, init_params
    from jmtp.model.config import MoEConfig
    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2,
                      num_heads=4, num_kv_heads=4, head_dim=8, attention_type="mla",
                      kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=6,
                      num_mtp_layers=1,
                      moe=MoEConfig(8, 2, 16, layers=(1,), mtp_moe=True, scoring="sigmoid",
                                    score_bias=True, n_group=2, topk_group=1,
                                    shared_intermediate_size=16))
    params = init_params(cfg, jax.random.PRNGKey(0), std=0.2)
    check_params(cfg, params)
    assert params["layers"][0]["wkv_b"].shape == (12, 4 * (8 + 6))
    assert "router" in params["layers"][1] and "router" in params["mtp"]["layer"]
    check_params(cfg, LlamaForCausalLM(cfg, rngs=nnx.Rngs(0), stacked=False).to_params())
    again = LlamaForCausalLM.from_params(cfg, params).to_params()
    ids = list(range(10))
    np.testing.assert_array_equal(np.asarray(forward_logits(cfg, again, ids)),
                                  np.asarray(forward_logits(cfg, params, ids)))
