"""MTP tensors in the DeepSeek-V3/GLM and ERNIE-4.5 layouts: synthetic safetensors checkpoints
load, and ``mtp_forward`` matches a hand-written numpy implementation of
``h' = Block(eh_proj([enorm(embed(x)); hnorm(h)]))`` followed by the final norm, computed straight
from the raw checkpoint tensors (their own layout, fused projections, interleaved RoPE for ERNIE)."""
from __future__ import annotations

import json
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jmtp.model import init_kv_cache, load_checkpoint, mtp_forward, ragged_batch

torch = pytest.importorskip("torch")
torch.set_num_threads(1)  # torch's thread pool thrashes on a small shared CPU
transformers = pytest.importorskip("transformers")

V, H, I, L, NQ, NKV, D = 96, 64, 80, 2, 4, 2, 16
COMMON = dict(vocab_size=V, hidden_size=H, intermediate_size=I, num_hidden_layers=L,
              num_attention_heads=NQ, num_key_value_heads=NKV, head_dim=D, rms_norm_eps=1e-5)
EPS = 1e-5


def _save_target(path, arch: str, seed: int):
    transformers.logging.set_verbosity_error()
    torch.manual_seed(seed)
    if arch == "ernie_moe":   # layer 0 dense, layer 1 MoE (4 experts, top-2, a shared expert)
        config = transformers.Ernie4_5_MoeConfig(
            **COMMON, rope_theta=500000.0, moe_num_experts=4, moe_k=2, moe_intermediate_size=32,
            moe_num_shared_experts=1, moe_layer_start_index=1)
    else:
        config = (transformers.Ernie4_5Config(**COMMON, rope_theta=500000.0) if arch == "ernie"
                  else transformers.LlamaConfig(**COMMON, tie_word_embeddings=False))
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn(p.shape) if "norm" in name else 0.3 * torch.randn(p.shape))
    model.save_pretrained(path)
    return json.loads((path / "config.json").read_text())


def _block_tensors(rng, prefix: str, fused: bool, paddle: bool) -> dict[str, np.ndarray]:
    """One decoder block's checkpoint tensors. torch Linear = [out, in]; Paddle = [in, out]."""
    def lin(n_in, n_out):
        w = (0.3 * rng.standard_normal((n_out, n_in))).astype(np.float32)
        return np.ascontiguousarray(w.T) if paddle else w

    t = {prefix + "input_layernorm.weight": (1 + 0.2 * rng.standard_normal(H)).astype(np.float32),
         prefix + "post_attention_layernorm.weight": (1 + 0.2 * rng.standard_normal(H)).astype(
             np.float32),
         prefix + "self_attn.o_proj.weight": lin(NQ * D, H),
         prefix + "mlp.down_proj.weight": lin(I, H)}
    if fused:
        t[prefix + "self_attn.qkv_proj.weight"] = lin(H, (NQ + 2 * NKV) * D)
        t[prefix + "mlp.up_gate_proj.weight"] = lin(H, 2 * I)
    else:
        t.update({prefix + "self_attn.q_proj.weight": lin(H, NQ * D),
                  prefix + "self_attn.k_proj.weight": lin(H, NKV * D),
                  prefix + "self_attn.v_proj.weight": lin(H, NKV * D),
                  prefix + "mlp.gate_proj.weight": lin(H, I),
                  prefix + "mlp.up_proj.weight": lin(H, I)})
    return t


def _norm_vec(rng):
    return (1 + 0.2 * rng.standard_normal(H)).astype(np.float32)


def _write_deepseek(path, rng, n_modules=2):
    t = {}
    for j in range(n_modules):
        p = f"model.layers.{L + j}."
        t.update(_block_tensors(rng, p, fused=False, paddle=False))
        t[p + "enorm.weight"] = _norm_vec(rng)
        t[p + "hnorm.weight"] = _norm_vec(rng)
        t[p + "eh_proj.weight"] = (0.3 * rng.standard_normal((H, 2 * H))).astype(np.float32)
        t[p + "shared_head.norm.weight"] = _norm_vec(rng)
        # shipped by DeepSeek-V3 but aliases of the target's tensors: must be ignored
        t[p + "embed_tokens.weight"] = np.zeros((V, H), np.float32)
        t[p + "shared_head.head.weight"] = np.zeros((V, H), np.float32)
    save_file(t, str(path / "mtp.safetensors"))
    return t


def _write_ernie(path, rng, top: str, paddle: bool, fused: bool, subdir=True):
    p = f"{top}mtp_block.0."
    t = _block_tensors(rng, p, fused=fused, paddle=paddle)
    t[f"{top}mtp_emb_norm.0.weight"] = _norm_vec(rng)
    t[f"{top}mtp_hidden_norm.0.weight"] = _norm_vec(rng)
    eh = (0.3 * rng.standard_normal((H, 2 * H))).astype(np.float32)  # torch [out, in]
    t[f"{top}mtp_linear_proj.0.weight"] = np.ascontiguousarray(eh.T) if paddle else eh
    if subdir:  # where ERNIE ships its MTP weights
        (path / "mtp").mkdir(exist_ok=True)
        save_file(t, str(path / "mtp" / "model.safetensors"))
    else:
        save_file(t, str(path / "mtp.safetensors"))
    return t


# ---------------------------------------------------------------------------------------------
# numpy reference (independent of jmtp: raw checkpoint tensors, its own RoPE style)
# ---------------------------------------------------------------------------------------------

def np_rms(x, w):
    x = x.astype(np.float64)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + EPS) * w


def np_rope(x, pos, theta, interleaved):
    """x: [T, heads, D]. Rotate-half pairs (i, i+D/2) or interleaved pairs (2i, 2i+1)."""
    inv = 1.0 / theta ** (np.arange(0, D, 2) / D)
    ang = pos[:, None, None] * inv[None, None, :]
    cos, sin = np.cos(ang), np.sin(ang)
    if interleaved:
        a, b = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2], out[..., 1::2] = a * cos - b * sin, b * cos + a * sin
        return out
    a, b = x[..., :D // 2], x[..., D // 2:]
    return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)


def np_block(t, prefix, x, pos, theta, interleaved, paddle):
    """Pre-norm block over T tokens with causal GQA attention (every token sees itself and the
    earlier ones, i.e. the cache of the previous positions)."""
    W = (lambda n: t[prefix + n].astype(np.float64)) if paddle else (
        lambda n: t[prefix + n].astype(np.float64).T)             # -> [in, out]
    T = x.shape[0]
    h = np_rms(x, t[prefix + "input_layernorm.weight"])
    if prefix + "self_attn.qkv_proj.weight" in t:
        qkv = h @ W("self_attn.qkv_proj.weight")
        q, k, v = np.split(qkv, [NQ * D, NQ * D + NKV * D], axis=-1)
    else:
        q, k, v = (h @ W(f"self_attn.{n}_proj.weight") for n in "qkv")
    q = np_rope(q.reshape(T, NQ, D), pos, theta, interleaved)
    k = np_rope(k.reshape(T, NKV, D), pos, theta, interleaved)
    v = v.reshape(T, NKV, D)
    out = np.zeros((T, NQ, D))
    for hq in range(NQ):
        kv = hq // (NQ // NKV)
        s = q[:, hq] @ k[:, kv].T / np.sqrt(D)
        s = np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        out[:, hq] = (p / p.sum(-1, keepdims=True)) @ v[:, kv]
    x = x + out.reshape(T, NQ * D) @ W("self_attn.o_proj.weight")
    h = np_rms(x, t[prefix + "post_attention_layernorm.weight"])
    if prefix + "mlp.up_gate_proj.weight" in t:
        gate, up = np.split(h @ W("mlp.up_gate_proj.weight"), 2, axis=-1)
    else:
        gate, up = h @ W("mlp.gate_proj.weight"), h @ W("mlp.up_proj.weight")
    return x + (gate / (1 + np.exp(-gate)) * up) @ W("mlp.down_proj.weight")


def np_mtp(t, embed, ids, hidden, pos, *, enorm, hnorm, eh, eh_paddle, block, final_norm, theta,
           interleaved, paddle):
    z = np.concatenate([np_rms(embed[ids], t[enorm]), np_rms(hidden, t[hnorm])], axis=-1)
    x = z @ (t[eh] if eh_paddle else t[eh].T)
    x = np_block(t, block, x, pos, theta, interleaved, paddle)
    return np_rms(x, final_norm), x


_mtp_jit = jax.jit(mtp_forward, static_argnums=(0,))


def _run_jmtp(cfg, params, j, ids, hidden, prefill):
    """mtp_forward over the first ``prefill`` rows, then one decode row at position ``prefill``."""
    bs, pages = 8, 2
    cache = init_kv_cache(cfg, cfg.num_mtp_layers, pages * 1, bs)
    tables = jnp.arange(pages, dtype=jnp.int32)[None]
    pos, meta = ragged_batch(jnp.array([prefill]), jnp.array([0]), tables, bs, prefill)
    h0, n0, cache = _mtp_jit(cfg, params, j, jnp.asarray(ids[:prefill]),
                                jnp.asarray(hidden[:prefill]), pos, meta, cache)
    pos, meta = ragged_batch(jnp.array([1]), jnp.array([prefill]), tables, bs, 1)
    h1, n1, _ = _mtp_jit(cfg, params, j, jnp.asarray(ids[prefill:]), jnp.asarray(hidden[prefill:]),
                            pos, meta, cache)
    return (np.concatenate([np.asarray(h0), np.asarray(h1)]),
            np.concatenate([np.asarray(n0), np.asarray(n1)]))


def _inputs(rng, T=6):
    ids = rng.integers(0, V, size=T).astype(np.int32)
    hidden = rng.standard_normal((T, H)).astype(np.float32)
    return ids, hidden


# ---------------------------------------------------------------------------------------------


def test_deepseek_layout(tmp_path):
    rng = np.random.default_rng(0)
    _save_target(tmp_path, "llama", seed=0)
    t = _write_deepseek(tmp_path, rng, n_modules=2)
    cfg, params = load_checkpoint(tmp_path, dtype=jnp.float32)
    assert (cfg.mtp_layout, cfg.num_mtp_layers) == ("deepseek", 2)
    embed = load_file(str(tmp_path / "model.safetensors"))["model.embed_tokens.weight"]
    ids, hidden = _inputs(rng)
    pos = np.arange(len(ids))
    for j in range(2):
        p = f"model.layers.{L + j}."
        ref_h, ref_x = np_mtp(t, embed, ids, hidden, pos, enorm=p + "enorm.weight",
                              hnorm=p + "hnorm.weight", eh=p + "eh_proj.weight", eh_paddle=False,
                              block=p, final_norm=t[p + "shared_head.norm.weight"],
                              theta=cfg.rope_theta, interleaved=False, paddle=False)
        h, nxt = _run_jmtp(cfg, params, j, ids, hidden, prefill=len(ids) - 1)
        np.testing.assert_allclose(h, ref_h, rtol=1e-4, atol=1e-4, err_msg=f"module {j}")
        # DeepSeek layout feeds the pre-norm residual stream to the next sub-step
        np.testing.assert_allclose(nxt, ref_x, rtol=1e-4, atol=1e-4 * np.abs(ref_x).max())


@pytest.mark.parametrize("top,paddle,fused,arch", [
    ("ernie.", True, True, "ernie"), ("model.", False, False, "ernie"),
    ("ernie.", False, True, "ernie"),
    # ERNIE-4.5-MoE target: its MTP block is dense (FastDeploy ernie4_5_mtp: layer_id 0 <
    # moe_layer_start_index), with the target's dense intermediate_size
    ("ernie.", True, True, "ernie_moe")])
def test_ernie_layout(tmp_path, top, paddle, fused, arch):
    rng = np.random.default_rng(1)
    hf = _save_target(tmp_path, arch, seed=1)
    t = _write_ernie(tmp_path, rng, top, paddle=paddle, fused=fused)
    cfg, params = load_checkpoint(tmp_path, dtype=jnp.float32)
    assert (cfg.mtp_layout, cfg.num_mtp_layers, cfg.architecture) == (
        "ernie", 1, "Ernie4_5ForCausalLM" if arch == "ernie" else "Ernie4_5_MoeForCausalLM")
    if arch == "ernie_moe":
        assert cfg.moe.layers == (1,) and not cfg.moe.mtp_moe
        assert "router" in params["layers"][1] and "w_gate" in params["mtp"]["layer"]
    target = load_file(str(tmp_path / "model.safetensors"))
    embed = target["model.embed_tokens.weight"].astype(np.float64)
    ids, hidden = _inputs(rng)
    ref_h, _ = np_mtp(t, embed, ids, hidden, np.arange(len(ids)), enorm=f"{top}mtp_emb_norm.0.weight",
                      hnorm=f"{top}mtp_hidden_norm.0.weight", eh=f"{top}mtp_linear_proj.0.weight",
                      eh_paddle=paddle, block=f"{top}mtp_block.0.",
                      final_norm=target["model.norm.weight"],  # ERNIE shares the target's norm
                      theta=hf["rope_parameters"]["rope_theta"], interleaved=True, paddle=paddle)
    h, nxt = _run_jmtp(cfg, params, 0, ids, hidden, prefill=len(ids) - 1)
    np.testing.assert_allclose(h, ref_h, rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(nxt, h)  # ERNIE feeds the post-norm state back


def test_ernie_paddle_and_torch_layouts_load_identically(tmp_path):
    a, b = tmp_path / "paddle", tmp_path / "torch"
    for d, paddle in ((a, True), (b, False)):
        d.mkdir()
        _save_target(d, "ernie", seed=2)
        _write_ernie(d, np.random.default_rng(3), "ernie.", paddle=paddle, fused=True, subdir=False)
    _, pa = load_checkpoint(a, dtype=jnp.float32)
    _, pb = load_checkpoint(b, dtype=jnp.float32)
    for name in ("eh_proj", "enorm", "hnorm", "final_norm"):
        np.testing.assert_array_equal(np.asarray(pa["mtp"][name]), np.asarray(pb["mtp"][name]))
    for name, leaf in pa["mtp"]["layer"].items():
        np.testing.assert_array_equal(np.asarray(leaf), np.asarray(pb["mtp"]["layer"][name]))


def test_fresh_head_when_no_mtp_weights(tmp_path, caplog):
    _save_target(tmp_path, "llama", seed=4)
    with caplog.at_level(logging.INFO, logger="jmtp"):
        cfg, params = load_checkpoint(tmp_path, dtype=jnp.float32)
    assert f"no MTP weights in {tmp_path}: initialised a fresh MTP head" in caplog.text
    assert cfg.num_mtp_layers == 1 and params["mtp"]["eh_proj"].shape == (1, 2 * H, H)
    # the fresh block starts as a copy of the target's last layer (init_mtp_params)
    np.testing.assert_array_equal(np.asarray(params["mtp"]["layer"]["wq"][0]),
                                  np.asarray(params["layers"]["wq"][-1]))


def test_bad_mtp_checkpoints(tmp_path):
    rng = np.random.default_rng(5)
    _save_target(tmp_path, "llama", seed=5)
    # DeepSeek modules must start at N = num_hidden_layers
    t = {f"model.layers.{L + 1}.{n}.weight": _norm_vec(rng) for n in ("enorm", "hnorm")}
    save_file(t, str(tmp_path / "mtp.safetensors"))
    with pytest.raises(ValueError, match=r"numbered 2\.\.2"):
        load_checkpoint(tmp_path)
    # both layouts at once
    t = {f"model.layers.{L}.enorm.weight": _norm_vec(rng), "ernie.mtp_emb_norm.0.weight": _norm_vec(rng)}
    save_file(t, str(tmp_path / "mtp.safetensors"))
    with pytest.raises(ValueError, match="both"):
        load_checkpoint(tmp_path)
    # ERNIE projection of the wrong shape is named
    (tmp_path / "mtp.safetensors").unlink()
    _write_ernie(tmp_path, rng, "ernie.", paddle=True, fused=True)
    f = tmp_path / "mtp" / "model.safetensors"
    t = load_file(str(f))
    t["ernie.mtp_linear_proj.0.weight"] = np.zeros((H, H), np.float32)
    save_file(t, str(f))
    with pytest.raises(ValueError, match="ernie.mtp_linear_proj.0.weight"):
        load_checkpoint(tmp_path)
