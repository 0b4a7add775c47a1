"""The 8-bit weight primitives (jmtp.model.quant) against numpy on the dequantised weights, the
host-side FP8 array the loaders rearrange (jmtp.model.checkpoints.fp8_checkpoint.QArray) and the checks of
``quantization_config``."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jmtp.model import quant
from jmtp.model.checkpoints.fp8_checkpoint import QArray, expected_fp8, parse_quantization_config

RNG = np.random.default_rng(0)


def _deq(w) -> np.ndarray:
    """numpy dequantisation of a QuantizedWeight: value · scale repeated over its blocks."""
    v, s = np.asarray(w.value).astype(np.float64), np.asarray(w.scale, np.float64)
    k, n = v.shape[-2:]
    bk, bn = w.block
    return v * np.repeat(np.repeat(s, bk, -2), bn, -1)[..., :k, :n]


# (method, block (bk, bn) or None = per output channel, K, N): blocks that tile both axes, a
# partial last block of outputs (DeepSeek-V3's kv_a_proj: 576 rows in 128-blocks), blocks that do
# not tile the input axis (the dequantising fallback)
CASES = [("int8", None, 64, 48), ("int8", None, 256, 24), ("fp8", (16, 16), 64, 48),
         ("fp8", (16, 16), 64, 40), ("fp8", (16, 16), 24, 32), ("int8", (32, 8), 64, 40),
         ("fp8", (128, 128), 64, 48)]


@pytest.mark.parametrize("method,block,k,n", CASES)
def test_quantize_error_bound_and_every_matmul_equals_the_dequantised_product(method, block, k, n):
    w = RNG.standard_normal((3, k, n)).astype(np.float32)
    q = quant.quantize(w, method, block)
    assert q.dtype == quant.STORAGE_DTYPES[method] and q.scale.shape == quant.scale_shape(
        w.shape, q.block)
    d = _deq(q)
    # absmax scaling: int8 rounds to within half a step; e4m3 to within 2^-4 relative (3 bits)
    s = np.repeat(np.repeat(np.asarray(q.scale), q.block[0], -2), q.block[1], -1)[..., :k, :n]
    bound = 0.5 * s if method == "int8" else np.abs(w) * 2.0 ** -4 + s * 2.0 ** -9
    assert np.all(np.abs(d - w) <= bound + 1e-7)
    x = RNG.standard_normal((5, k)).astype(np.float32)
    np.testing.assert_allclose(np.asarray(jax.jit(quant.matmul)(x, q[1])), x @ d[1],
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(quant.expert_matmul(x, q)),
                               np.einsum("th,ehi->eti", x, d), rtol=1e-5, atol=1e-5)
    xe = RNG.standard_normal((3, 5, k)).astype(np.float32)
    np.testing.assert_allclose(np.asarray(quant.expert_matmul(xe, q)),
                               np.einsum("eth,ehi->eti", xe, d), rtol=1e-5, atol=1e-5)
    sizes = np.array([2, 0, 3], np.int32)        # rows sorted by expert, an empty group
    rows = np.repeat(np.arange(3), sizes)
    np.testing.assert_allclose(np.asarray(jax.jit(quant.ragged_dot)(x, q, jnp.asarray(sizes))),
                               np.stack([x[i] @ d[rows[i]] for i in range(5)]),
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(quant.dequantize(q)), d, rtol=1e-6)


def test_plain_arrays_pass_through_unchanged():
    """Unquantised weights: the helpers are exactly @ / einsum / ragged_dot (same HLO)."""
    def matmul(a, b):
        return a @ b
    x, w = jnp.ones((4, 8)), jnp.ones((8, 6))
    assert jax.jit(quant.matmul).lower(x, w).as_text() == jax.jit(matmul).lower(x, w).as_text()


def test_quant_config_checks():
    with pytest.raises(ValueError, match="quantization must be one of"):
        quant.QuantConfig("int4")
    with pytest.raises(ValueError, match="weight_block_size"):
        quant.QuantConfig("fp8", (128, 0))
    with pytest.raises(ValueError, match="'layers.router' is not a quantisable"):
        quant.QuantConfig("fp8", (128, 128), ("layers.router",))
    c = quant.QuantConfig("fp8", (128, 64), ("layers.wq",))
    assert c.block(7168, 1536) == (64, 128) and c.covers("layers.wq")
    assert quant.QuantConfig("int8").block(576, 1024) == (576, 1)


def _qarray(m=48, n=40, b=(16, 8)):
    v = RNG.standard_normal((m, n)).astype(ml_dtypes.float8_e4m3fn)
    s = RNG.random((-(-m // b[0]), -(-n // b[1]))).astype(np.float32)
    return QArray(v, s, b, "t")


def _np_deq(a: QArray) -> np.ndarray:
    m, n = a.shape[-2:]
    return a.value.astype(np.float32) * np.repeat(np.repeat(a.scale, a.block[0], -2),
                                                  a.block[1], -1)[..., :m, :n]


def test_qarray_layout_operations_commute_with_dequantisation():
    a = _qarray()
    d = _np_deq(a)
    np.testing.assert_array_equal(_np_deq(a.T), d.T)
    np.testing.assert_array_equal(_np_deq(a[16:48]), d[16:48])
    np.testing.assert_array_equal(_np_deq(a[:, 8:]), d[:, 8:])
    perm = np.concatenate([np.arange(16)[::-1], np.arange(16, 48)])   # inside the first block
    np.testing.assert_array_equal(_np_deq(a[perm]), d[perm])
    st = np.stack([a, a.T.T])
    np.testing.assert_array_equal(_np_deq(st), np.stack([d, d]))
    np.testing.assert_array_equal(_np_deq(st.transpose(0, 2, 1)), np.stack([d.T, d.T]))
    cat = np.concatenate([a[16:], a[:16]])
    np.testing.assert_array_equal(_np_deq(cat), np.concatenate([d[16:], d[:16]]))
    for bad in (lambda: a[4:20], lambda: a[np.roll(np.arange(48), 1)], lambda: np.asarray(a),
                lambda: np.concatenate([a[:4], a[4:]]), lambda: a.reshape(-1)):
        with pytest.raises((ValueError, AttributeError)):
            bad()
    with pytest.raises(ValueError, match="weight_scale_inv has shape"):
        QArray(a.value, a.scale[:1], (16, 8), "t")


def test_quantization_config_fields_and_tensor_expectations():
    ok = parse_quantization_config({"quantization_config": {
        "quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic",
        "fmt": "e4m3", "modules_to_not_convert": ["lm_head", "mlp.gate"]}}, "c")
    assert ok.weight_block_size == (128, 128)
    assert parse_quantization_config({}, "c") is None
    for qc, field in [({"quant_method": "awq"}, "quant_method"),
                      ({"quant_method": "fp8"}, "weight_block_size"),
                      ({"quant_method": "fp8", "weight_block_size": [128, True]},
                       "weight_block_size"),
                      ({"quant_method": "fp8", "weight_block_size": [1, 1],
                        "activation_scheme": "weird"}, "activation_scheme"),
                      ({"quant_method": "fp8", "weight_block_size": [1, 1],
                        "scale_fmt": "ue8m0"}, "scale_fmt"),
                      ({"quant_method": "fp8", "weight_block_size": [1, 1],
                        "modules_to_not_convert": "lm_head"}, "modules_to_not_convert")]:
        with pytest.raises(ValueError, match=f"quantization_config.{field}"):
            parse_quantization_config({"quantization_config": qc}, "c")
    e = lambda name: expected_fp8(name, ok)     # noqa: E731
    assert e("model.layers.3.self_attn.kv_a_proj_with_mqa.weight") is True
    assert e("model.layers.3.mlp.experts.7.down_proj.weight") is True
    assert e("model.layers.3.mlp.gate_proj.weight") is True    # "mlp.gate" matches whole names
    assert e("model.layers.3.mlp.gate.weight") is False
    assert e("model.layers.61.eh_proj.weight") is None          # BF16 in DeepSeek-V3, FP8 allowed
    assert e("lm_head.weight") is False and e("model.embed_tokens.weight") is False
    assert e("model.layers.0.input_layernorm.weight") is False


def test_int8_kv_head_replication_and_scale_shardings():
    """8-bit wk/wv replicate their kv heads with their scales (replicate_kv_heads, tensor
    parallelism past the kv heads): the logits stay those of the unreplicated 8-bit model. Their
    scales carry the weight's logical axes (the per-channel input axis unnamed), so a model-axis
    split of the values splits the scales alike."""
    from flax import nnx
    from jax.sharding import AbstractMesh

    from jmtp.model import ModelConfig, forward_logits, init_params
    from jmtp.model.modules import LlamaForCausalLM
    from jmtp.model.params import replicate_kv_heads
    from jmtp.model.quant_params import quantize_params
    from jmtp.runtime.device.sharding import param_shardings
    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=8)
    qcfg, q = quantize_params(cfg, init_params(cfg, jax.random.key(0), std=0.3), "int8")
    rcfg, rq = replicate_kv_heads(qcfg, q, 2)
    assert rq["layers"]["wk"].scale.shape == (2, 1, 32)
    ids = list(range(3, 20))
    np.testing.assert_allclose(np.asarray(forward_logits(rcfg, rq, ids)),
                               np.asarray(forward_logits(qcfg, q, ids)), rtol=1e-5, atol=1e-5)
    _, state = nnx.split(LlamaForCausalLM.from_params(qcfg, q))
    mesh = AbstractMesh((1, 2), ("data", "model"))
    specs = param_shardings(state, mesh)
    wq = specs["layers"]["layers"]["attn"]["wq"]
    assert tuple(wq["value"].get_value().spec) == (None, None, "model")
    assert tuple(wq["scale"].get_value().spec) == (None, None, "model")
    wo = specs["layers"]["layers"]["attn"]["wo"]
    assert tuple(wo["value"].get_value().spec) == (None, "model", None)
    assert tuple(wo["scale"].get_value().spec) == (None, None, None)
    # the int8 embedding's per-row scales split over the vocabulary with its rows
    emb = specs["embed"]
    assert tuple(emb["value"].get_value().spec) == ("model", None)
    assert tuple(emb["scale"].get_value().spec) == ("model", None)
