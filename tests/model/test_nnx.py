"""The Flax NNX modules: classes, logical axes on every parameter, split/merge, and their forward
against the pure functions and an independent numpy reference."""
from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jmtp.model import ModelConfig, init_kv_cache, init_params, ragged_batch
from jmtp.model import axes as ax
from jmtp.model import llama
from jmtp.model.modules import (MLP, MODULE_CLASSES, Attention, Buffer, DecoderLayer, DecoderStack,
                                DraftHead, LlamaForCausalLM, MTPHead)

CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=3, num_heads=4,
                  num_kv_heads=2, head_dim=8, qk_norm=True, attention_bias=True,
                  tie_word_embeddings=False, num_mtp_layers=2)
SEQ = [int(x) for x in np.random.default_rng(0).integers(0, 64, 13)]


def _model(cfg=CFG, **kw):
    return LlamaForCausalLM(cfg, rngs=nnx.Rngs(0), **kw)


def test_model_classes_are_nnx_modules():
    from jmtp.model.modules import GatedDeltaNet
    for cls in (Attention, GatedDeltaNet, MLP, DecoderLayer, DecoderStack, MTPHead, DraftHead,
                LlamaForCausalLM):
        assert issubclass(cls, nnx.Module), cls
    assert set(MODULE_CLASSES) == {Attention, GatedDeltaNet, MLP, DecoderLayer, DecoderStack,
                                   MTPHead, DraftHead, LlamaForCausalLM}
    m = _model()
    assert isinstance(m.layers, DecoderStack) and isinstance(m.layers.layers, DecoderLayer)
    assert isinstance(m.layers.layers.attn, Attention) and isinstance(m.layers.layers.mlp, MLP)
    assert isinstance(m.mtp, MTPHead)


@pytest.mark.parametrize("cfg", [CFG, CFG.replace(qk_norm=False, attention_bias=False,
                                                  tie_word_embeddings=True, num_mtp_layers=1)])
@pytest.mark.parametrize("stacked", [True, False])
def test_every_param_has_logical_axes(cfg, stacked):
    m = _model(cfg, stacked=stacked)
    m.set_buffer("draft_vocab", jnp.arange(cfg.vocab_size, dtype=jnp.int32))
    m.set_draft_head(jnp.arange(8, dtype=jnp.int32), jnp.zeros((8, cfg.hidden_size)))
    params = nnx.to_flat_state(nnx.state(m, nnx.Param))
    assert len(params) >= 12
    for path, var in params:
        names = var.get_metadata().get("out_sharding")
        assert names is not None, path
        assert len(names) == var.ndim, (path, names, var.shape)
        assert all(n in ax.ALL for n in names), (path, names)
        # Layer stacks: the leading axis is ``layers``, and only there.
        in_stack = "mtp" in path or (stacked and path[0] == "layers")
        assert (names[0] == ax.LAYERS) == in_stack, (path, names)
        assert ax.LAYERS not in names[1:], (path, names)
    # The axes of a parameter are those of the table in jmtp.model.axes.
    flat = dict((".".join(map(str, p)), v) for p, v in params)
    lay = "layers.layers" if stacked else "layers.layers.0"
    assert flat[f"{lay}.attn.wq"].get_metadata()["out_sharding"][-2:] == (ax.EMBED, ax.Q_HEADS)
    assert flat["mtp.eh_proj"].get_metadata()["out_sharding"] == (ax.LAYERS, ax.EMBED2, ax.EMBED)
    assert flat["embed"].get_metadata()["out_sharding"] == (ax.VOCAB, ax.EMBED)
    # Buffers are not Params (an optimizer with wrt=nnx.Param leaves them) but carry axes too.
    buffers = nnx.to_flat_state(nnx.state(m, Buffer))
    assert {p for p, _ in buffers} == {("draft_vocab",), ("draft_head", "token_ids"),
                                       ("draft_head", "weight")}
    for _, var in buffers:
        assert len(var.get_metadata()["out_sharding"]) == var.ndim


def test_logical_axes_map_to_partition_specs():
    m = _model()
    state = nnx.state(m, nnx.Param)
    specs = nnx.get_partition_spec(state)
    wq = specs["layers"]["layers"]["attn"]["wq"]
    assert tuple(wq.get_value() if hasattr(wq, "get_value") else wq) == (
        ax.LAYERS, ax.EMBED, ax.Q_HEADS)


def test_from_params_round_trip_and_split_merge():
    params = init_params(CFG, jax.random.key(1), std=0.3)
    m = LlamaForCausalLM.from_params(CFG, params)
    chex.assert_trees_all_equal(m.to_params(), params)
    graphdef, state = nnx.split(m)
    m2 = nnx.merge(graphdef, state)
    chex.assert_trees_all_equal(m2.to_params(), params)
    chex.assert_shape(state["layers"]["layers"]["attn"]["wq"], (3, 32, 32))
    # The state indexes like the parameter dict (what LLMEngine.runner.params returns).
    np.testing.assert_array_equal(np.asarray(state["embed"]), np.asarray(params["embed"]))
    unstacked = LlamaForCausalLM.from_params(CFG, llama.unstack_layers(params))
    chex.assert_trees_all_equal(unstacked.to_params(), llama.unstack_layers(params))
    with pytest.raises(ValueError, match="missing tensor mtp.eh_proj"):
        LlamaForCausalLM.from_params(CFG, {**params, "mtp": {k: v for k, v in params["mtp"].items()
                                                             if k != "eh_proj"}})
    with pytest.raises(ValueError, match=r"layers\.wq: shape"):
        LlamaForCausalLM.from_params(CFG, {**params, "layers": {**params["layers"],
                                                                "wq": jnp.zeros((3, 3))}})
    with pytest.raises(ValueError, match="unknown entries"):
        LlamaForCausalLM.from_params(CFG, {**params, "bogus": jnp.zeros(())})


def _np_rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * w


def _np_rope(x, pos, d, theta):
    inv = 1.0 / theta ** (np.arange(0, d, 2) / d)
    ang = pos[:, None] * inv[None]
    cos, sin = np.cos(ang)[:, None], np.sin(ang)[:, None]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


def _np_forward(cfg, p, ids):
    """Dense causal Llama/Qwen forward in float64 numpy (independent of jmtp.model.llama)."""
    p = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), p)
    t, nq, nkv, d = len(ids), cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    pos = np.arange(t, dtype=np.float64)
    x = p["embed"][np.asarray(ids)]
    L = p["layers"]
    for i in range(cfg.num_layers):
        w = {k: v[i] for k, v in L.items()}
        h = _np_rms(x, w["attn_norm"], cfg.rms_norm_eps)
        q = (h @ w["wq"] + w["bq"]).reshape(t, nq, d)
        k = (h @ w["wk"] + w["bk"]).reshape(t, nkv, d)
        v = (h @ w["wv"] + w["bv"]).reshape(t, nkv, d)
        q, k = _np_rms(q, w["q_norm"], cfg.rms_norm_eps), _np_rms(k, w["k_norm"], cfg.rms_norm_eps)
        q, k = _np_rope(q, pos, d, cfg.rope_theta), _np_rope(k, pos, d, cfg.rope_theta)
        k, v = np.repeat(k, nq // nkv, 1), np.repeat(v, nq // nkv, 1)
        s = np.einsum("thd,shd->hts", q, k) / np.sqrt(d)
        s = np.where(np.tril(np.ones((t, t), bool))[None], s, -np.inf)
        a = np.exp(s - s.max(-1, keepdims=True))
        a /= a.sum(-1, keepdims=True)
        x = x + np.einsum("hts,shd->thd", a, v).reshape(t, nq * d) @ w["wo"]
        h = _np_rms(x, w["mlp_norm"], cfg.rms_norm_eps)
        g = h @ w["w_gate"]
        x = x + (g / (1 + np.exp(-g)) * (h @ w["w_up"])) @ w["w_down"]
    return _np_rms(x, p["final_norm"], cfg.rms_norm_eps) @ p["lm_head"]


def _prefill_inputs(cfg, t, bs=4):
    pages = -(-t // bs)
    cache = init_kv_cache(cfg, cfg.num_layers, pages, bs)
    pos, meta = ragged_batch(jnp.array([t], jnp.int32), jnp.zeros((1,), jnp.int32),
                             jnp.arange(pages, dtype=jnp.int32)[None], bs, t)
    return pos, meta, cache


def test_nnx_forward_equals_pure_forward_and_numpy_reference():
    m = _model()
    graphdef, state = nnx.split(m)
    ids = jnp.asarray(SEQ, jnp.int32)
    pos, meta, cache = _prefill_inputs(CFG, len(SEQ))

    @jax.jit
    def nnx_logits(state, cache):          # the engine's pattern: merge the pure state inside
        model = nnx.merge(graphdef, state)
        h, cache = model(ids, pos, meta, cache)
        return model.logits(h), cache

    got, got_cache = nnx_logits(state, cache)
    params = m.to_params()
    h, want_cache = llama.forward(CFG, params, ids, pos, meta, cache)
    chex.assert_trees_all_close(got, llama.compute_logits(params, h), atol=1e-5, rtol=1e-5)
    chex.assert_trees_all_close(got_cache, want_cache, atol=1e-5, rtol=1e-5)
    chex.assert_shape(got, (len(SEQ), CFG.vocab_size))
    np.testing.assert_allclose(np.asarray(got), _np_forward(CFG, params, SEQ), atol=2e-4, rtol=1e-3)


def test_nnx_mtp_forward_equals_pure_mtp_forward():
    m = _model()
    ids = jnp.asarray(SEQ, jnp.int32)
    hidden = jax.random.normal(jax.random.key(3), (len(SEQ), CFG.hidden_size))
    pos, meta, _ = _prefill_inputs(CFG, len(SEQ))
    cache = init_kv_cache(CFG, CFG.num_mtp_layers, meta.block_tables.shape[1], 4)
    for layer in range(CFG.num_mtp_layers):
        got = m.mtp_forward(layer, ids, hidden, pos, meta, cache)
        want = llama.mtp_forward(CFG, m.to_params(), layer, ids, hidden, pos, meta, cache)
        chex.assert_trees_all_close(got, want)
    with pytest.raises(ValueError, match="no MTP head"):
        _model(num_mtp=0).mtp_forward(0, ids, hidden, pos, meta, cache)


def test_mlp_module_call_equals_layer_math():
    mlp = MLP(CFG, rngs=nnx.Rngs(2))
    x = jax.random.normal(jax.random.key(4), (5, CFG.hidden_size))
    g = np.asarray(x @ mlp.w_gate[...], np.float64)
    want = (g / (1 + np.exp(-g)) * np.asarray(x @ mlp.w_up[...])) @ np.asarray(mlp.w_down[...])
    np.testing.assert_allclose(np.asarray(mlp(x)), want, atol=1e-5, rtol=1e-5)


def test_merging_the_state_inside_jit_compiles_to_the_dict_graph():
    """The engine's jitted step takes the model's nnx.State and merges it inside; the target
    forward + logits compiled that way has the same instructions (opcode and shape) as the pure
    functions on the parameter dict, so merging costs nothing at run time."""
    import collections
    import re

    cfg = CFG.replace(qk_norm=False, attention_bias=False, num_mtp_layers=1)
    params = init_params(cfg, jax.random.key(0))
    graphdef, state = nnx.split(LlamaForCausalLM.from_params(cfg, params))
    T, bs, nb = 8, 4, 8
    ids = jnp.arange(T, dtype=jnp.int32) % cfg.vocab_size
    pos, meta = ragged_batch(jnp.asarray([5, 3], jnp.int32), jnp.zeros((2,), jnp.int32),
                             jnp.arange(2 * 4, dtype=jnp.int32).reshape(2, 4), bs, T)
    cache = init_kv_cache(cfg, cfg.num_layers, nb, bs)

    def with_module(st, cache):
        model = nnx.merge(graphdef, st)
        h, cache = model(ids, pos, meta, cache)
        return model.logits(h), cache

    def with_dict(p, cache):
        h, cache = llama.forward(cfg, p, ids, pos, meta, cache)
        return llama.compute_logits(p, h), cache

    new = jax.jit(with_module).lower(state, cache).compile().as_text()
    old = jax.jit(with_dict).lower(params, cache).compile().as_text()

    def ops(text):
        return collections.Counter(m.groups() for m in re.finditer(
            r"^\s*(?:ROOT )?\S+ = (\S+) ([\w-]+)\(", text, re.M))

    assert sum(ops(new).values()) > 50
    assert ops(new) == ops(old)
    np.testing.assert_array_equal(jax.jit(with_module)(state, cache)[0],
                                  jax.jit(with_dict)(params, cache)[0])


def test_draft_head_scores_and_maps_back_to_the_vocabulary():
    """FR-Spec DraftHead: logits over its N rows only; picks map back through token_ids and q is
    zero off those N tokens (hand case)."""
    w = jnp.asarray([[1.0, 0.0], [0.0, 2.0], [1.0, 1.0]])
    head = DraftHead(jnp.asarray([7, 2, 5], jnp.int32), w)
    h = jnp.asarray([[3.0, 1.0], [0.0, 1.0]])
    np.testing.assert_allclose(head(h), [[3.0, 2.0, 4.0], [0.0, 2.0, 1.0]])
    probs = jnp.asarray([[0.2, 0.3, 0.5], [1.0, 0.0, 0.0]])
    tokens, full = head.to_vocab(jnp.asarray([2, 0]), probs, 8)
    np.testing.assert_array_equal(tokens, [5, 7])
    want = np.zeros((2, 8))
    want[0, [7, 2, 5]] = [0.2, 0.3, 0.5]
    want[1, 7] = 1.0
    np.testing.assert_allclose(full, want)
    with pytest.raises(ValueError, match="DraftHead.weight"):
        DraftHead(jnp.arange(3, dtype=jnp.int32), jnp.zeros((4, 2)))
    with pytest.raises(ValueError, match="draft_ids and draft_head"):
        LlamaForCausalLM.from_params(CFG, dict(init_params(CFG, jax.random.key(0)),
                                               draft_ids=jnp.arange(3, dtype=jnp.int32)))


def test_hybrid_module_layers_carry_logical_axes_and_run_the_pure_forward():
    """A hybrid (gated-DeltaNet) model as NNX modules: an unstacked DecoderStack whose linear
    layers hold a GatedDeltaNet with logical axis names (value heads over the model axis); its
    parameter dict is the pure function's, and ``from_params`` rebuilds the same module."""
    from jmtp.model import axes as ax
    from jmtp.model.llama import init_model_cache
    from jmtp.model.metadata import ragged_batch
    from jmtp.model.modules import GatedDeltaNet
    from tests.runtime.conftest import TINY, TINY_HYBRID
    cfg = TINY.replace(**TINY_HYBRID)
    m = LlamaForCausalLM(cfg, rngs=nnx.Rngs(0), stacked=False)
    lin = m.layers.layers[0].attn
    assert isinstance(lin, GatedDeltaNet) and isinstance(m.layers.layers[1].attn, Attention)
    assert lin.lin_v.get_metadata()["out_sharding"] == (ax.EMBED, ax.Q_HEADS)
    assert "wg" in m.layers.layers[1].attn.variables()
    params = m.to_params()
    again = LlamaForCausalLM.from_params(cfg, params)
    ids = jnp.asarray(SEQ[:8], jnp.int32)
    pos, meta = ragged_batch(jnp.array([8]), jnp.array([0]), jnp.arange(2)[None], 4, 8)
    cache = init_model_cache(cfg, 2, 4)
    h1, c1 = m(ids, pos, meta, cache)
    h2, c2 = again(ids, pos, meta, cache)
    np.testing.assert_array_equal(np.asarray(h1), np.asarray(h2))
    assert c1.linear is not None and np.isfinite(np.asarray(c1.linear.recurrent)).all()
