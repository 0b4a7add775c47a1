"""The module-returning loaders: :func:`jmtp.model.load_model` (a checkpoint as a
``LlamaForCausalLM``) and :func:`jmtp.model.load_mtp_head_module` (a head file as an ``MTPHead``)
hold exactly the arrays of the dict loaders, with logical axes on every parameter."""
from __future__ import annotations

import json

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file

from jmtp.model import (LlamaForCausalLM, ModelConfig, MTPHead, init_params, load_checkpoint,
                        load_model, load_mtp_head, load_mtp_head_module)
from jmtp.model import axes as ax
from jmtp.model.checkpoints.mtp_head import export_mtp_head

V, H, I, L, NQ, NKV, D = 48, 32, 40, 2, 4, 2, 8


def _write_hf(path, arch: str):
    """A random 2-layer checkpoint in the transformers layout (torch Linear = [out, in]):
    Qwen2 (q/k/v biases) or Qwen3 (q/k norms), untied LM head."""
    rng = np.random.default_rng(7)
    r = lambda *s: (0.3 * rng.standard_normal(s)).astype(np.float32)
    t = {"model.embed_tokens.weight": r(V, H), "model.norm.weight": 1 + r(H),
         "lm_head.weight": r(V, H)}
    for i in range(L):
        p = f"model.layers.{i}."
        t.update({p + "input_layernorm.weight": 1 + r(H),
                  p + "post_attention_layernorm.weight": 1 + r(H),
                  p + "self_attn.q_proj.weight": r(NQ * D, H),
                  p + "self_attn.k_proj.weight": r(NKV * D, H),
                  p + "self_attn.v_proj.weight": r(NKV * D, H),
                  p + "self_attn.o_proj.weight": r(H, NQ * D),
                  p + "mlp.gate_proj.weight": r(I, H), p + "mlp.up_proj.weight": r(I, H),
                  p + "mlp.down_proj.weight": r(H, I)})
        if arch == "Qwen2ForCausalLM":
            t.update({p + "self_attn.q_proj.bias": r(NQ * D), p + "self_attn.k_proj.bias": r(NKV * D),
                      p + "self_attn.v_proj.bias": r(NKV * D)})
        else:
            t.update({p + "self_attn.q_norm.weight": 1 + r(D), p + "self_attn.k_norm.weight": 1 + r(D)})
    path.mkdir(parents=True, exist_ok=True)
    save_file(t, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({
        "architectures": [arch], "vocab_size": V, "hidden_size": H, "intermediate_size": I,
        "num_hidden_layers": L, "num_attention_heads": NQ, "num_key_value_heads": NKV,
        "head_dim": D, "rms_norm_eps": 1e-6, "tie_word_embeddings": False}))
    return path


def _assert_axes(module):
    params = nnx.to_flat_state(nnx.state(module, nnx.Param))
    assert params
    for path, var in params:
        names = var.get_metadata().get("out_sharding")
        assert names is not None and len(names) == var.ndim, (path, names, var.shape)
        assert all(n in ax.ALL for n in names), (path, names)
    return len(params)


@pytest.mark.parametrize("arch", ["Qwen2ForCausalLM", "Qwen3ForCausalLM"])
def test_load_model_holds_the_dict_loaders_arrays(tmp_path, arch):
    ckpt = _write_hf(tmp_path / "ckpt", arch)
    cfg, model = load_model(ckpt, dtype=jnp.float32)
    cfg_d, params = load_checkpoint(ckpt, dtype=jnp.float32)
    assert cfg == cfg_d and cfg.architecture == arch
    assert isinstance(model, LlamaForCausalLM) and isinstance(model.mtp, MTPHead)
    assert model.lm_head is not None and model.draft_vocab is None
    assert _assert_axes(model) >= 20
    chex.assert_trees_all_equal(model.to_params(), params)      # fresh head included
    for leaf in jax.tree_util.tree_leaves(model.to_params()):
        assert leaf.dtype == jnp.float32
    graphdef, state = nnx.split(model)
    np.testing.assert_array_equal(np.asarray(state["layers"]["layers"]["attn"]["wq"]),
                                  np.asarray(params["layers"]["wq"]))
    chex.assert_trees_all_equal(nnx.merge(graphdef, state).to_params(), params)
    # bf16 load: every parameter in the requested dtype.
    _, m16 = load_model(ckpt, dtype="bfloat16")
    assert {leaf.dtype for leaf in jax.tree_util.tree_leaves(m16.to_params())} == {jnp.dtype(jnp.bfloat16)}


def test_load_model_with_a_head_file(tmp_path):
    """``mtp_head=path``: the module's head is the file's (cast to the model dtype) and the file's
    token ranking becomes the ``draft_vocab`` buffer, as with ``load_checkpoint``."""
    ckpt = _write_hf(tmp_path / "ckpt", "Qwen3ForCausalLM")
    cfg0, p0 = load_checkpoint(ckpt, dtype=jnp.float32, mtp_head=None)
    mtp = init_params(cfg0.replace(num_mtp_layers=2), jax.random.key(3), std=0.3)["mtp"]
    ranking = np.random.default_rng(1).permutation(V).astype(np.int32)
    head_path = str(tmp_path / "head.safetensors")
    export_mtp_head(head_path, mtp, cfg0, draft_vocab=ranking, draft_vocab_size=16)  # bf16
    cfg, model = load_model(ckpt, dtype=jnp.float32, mtp_head=head_path)
    cfg_d, params = load_checkpoint(ckpt, dtype=jnp.float32, mtp_head=head_path)
    assert cfg == cfg_d and (cfg.num_mtp_layers, cfg.draft_vocab_size) == (2, 16)
    chex.assert_trees_all_equal(model.to_params(), params)
    chex.assert_trees_all_equal(model.mtp.to_params(),
                                load_mtp_head(head_path, dtype=jnp.float32))
    assert model.mtp.eh_proj.shape == (2, 2 * H, H)
    assert np.asarray(model.draft_vocab[...]).tolist() == ranking.tolist()
    with pytest.raises(FileNotFoundError):
        load_model(ckpt, mtp_head=str(tmp_path / "none.safetensors"))
    with pytest.raises(ValueError, match="does not exist"):
        load_model(tmp_path / "missing")


def test_load_mtp_head_module(tmp_path):
    cfg = ModelConfig(vocab_size=V, hidden_size=H, intermediate_size=I, num_layers=1, num_heads=NQ,
                      num_kv_heads=NKV, head_dim=D, qk_norm=True, num_mtp_layers=2)
    mtp = init_params(cfg, jax.random.key(0), std=0.3)["mtp"]
    path = str(tmp_path / "head.safetensors")
    export_mtp_head(path, mtp, cfg)                               # bf16 on disk
    head = load_mtp_head_module(path, cfg)
    assert isinstance(head, MTPHead)
    assert _assert_axes(head) == 4 + 11                            # 4 head + 11 layer tensors
    assert head.eh_proj.get_metadata()["out_sharding"] == (ax.LAYERS, ax.EMBED2, ax.EMBED)
    chex.assert_trees_all_equal(head.to_params(), load_mtp_head(path))
    assert head.eh_proj.dtype == jnp.bfloat16
    f32 = load_mtp_head_module(path, cfg, dtype=jnp.float32)
    chex.assert_trees_all_equal(f32.to_params(), load_mtp_head(path, dtype=jnp.float32))
    # The module exports to the same file as its dict.
    again = str(tmp_path / "again.safetensors")
    export_mtp_head(again, f32, cfg, dtype=jnp.bfloat16)
    chex.assert_trees_all_equal(load_mtp_head(again), load_mtp_head(path))
    # A head that does not fit the model is refused, naming why.
    with pytest.raises(FileNotFoundError):
        load_mtp_head_module(str(tmp_path / "none.safetensors"), cfg)
    with pytest.raises(ValueError, match="hidden_size"):
        load_mtp_head_module(path, cfg.replace(hidden_size=64))
    with pytest.raises(ValueError, match=r"missing tensor mtp\.layer\.b[qkv]"):
        load_mtp_head_module(path, cfg.replace(attention_bias=True))
    with pytest.raises(ValueError, match=r"unexpected tensors \['layer.k_norm', 'layer.q_norm'\]"):
        load_mtp_head_module(path, cfg.replace(qk_norm=False))
    with pytest.raises(ValueError, match=r"mtp.layer.wq: shape"):
        MTPHead.from_params(cfg, {**mtp, "layer": {**mtp["layer"], "wq": jnp.zeros((2, 3, 3))}})
    with pytest.raises(ValueError, match="missing tensor mtp.eh_proj"):
        MTPHead.from_params(cfg, {k: v for k, v in mtp.items() if k != "eh_proj"})
