"""``quantization="int8"`` quantises the token embedding per vocabulary row (and an untied LM
head per output channel): the int8 table's gather and tied LM head against numpy over the
dequantised table, the whole forward against jmtp's fp32 forward over the dequantised weights,
the FR-Spec draft head's rows, the check that names the table, and FP8 leaving the tables alone."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jmtp.model import forward_logits
from jmtp.model.modules import DraftHead
from jmtp.model.quant import check_quantized, dequantize, embedding, is_quantized, logits_from_rows
from jmtp.model.quant_params import config_paths, param_bytes, quantize_params
from jmtp.runtime.host.engine_args import with_draft_vocab
from tests.runtime.conftest import tiny_model


def _dequantised(params: dict) -> dict:
    """Every 8-bit leaf replaced by its f32 weight (the reference's parameters)."""
    return jax.tree_util.tree_map(lambda a: dequantize(a) if is_quantized(a) else a, params,
                                  is_leaf=is_quantized)


@pytest.mark.parametrize("tied", [True, False])
def test_int8_embedding_forward_equals_the_dequantised_table(tied):
    cfg, params = tiny_model(seed=5, tie_word_embeddings=tied)
    qcfg, q = quantize_params(cfg, params, "int8")
    v, h = cfg.vocab_size, cfg.hidden_size
    emb = q["embed"]
    assert emb.dtype == jnp.int8 and emb.block == (1, h) and emb.scale.shape == (v, 1)
    assert "embed" in qcfg.quantization.quantized
    assert ("lm_head" in q) == (not tied) == ("lm_head" in qcfg.quantization.quantized)
    if not tied:
        assert q["lm_head"].block == (h, 1) and q["lm_head"].scale.shape == (1, v)
    # the table: numpy value · scale per row, each weight within half a step of fp32
    table = np.asarray(emb.value, np.float64) * np.asarray(emb.scale, np.float64)
    assert np.all(np.abs(table - np.asarray(params["embed"])) <= 0.5 * np.asarray(emb.scale)
                  + 1e-7)
    ids = jnp.array([0, 7, 63, 7, 31], jnp.int32)
    np.testing.assert_allclose(np.asarray(embedding(emb, ids, jnp.float32)), table[ids],
                               rtol=1e-6, atol=1e-7)
    x = np.random.default_rng(0).standard_normal((3, h)).astype(np.float32)
    np.testing.assert_allclose(np.asarray(logits_from_rows(jnp.asarray(x), emb)), x @ table.T,
                               rtol=1e-5, atol=1e-5)
    # the whole forward (target logits; the MTP layer reads the same table) against jmtp's fp32
    # forward over the dequantised weights
    tokens = [3, 17, 5, 40, 22, 9, 60, 2, 2, 31, 11]
    got = np.asarray(forward_logits(qcfg, q, tokens, block_size=4))
    want = np.asarray(forward_logits(cfg, _dequantised(q), tokens, block_size=4))
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
    fp32 = np.asarray(forward_logits(cfg, params, tokens, block_size=4))
    assert np.abs(fp32 - want).max() > 1e-4 * np.abs(want).max()    # it is quantised
    # bytes: the tables' share, one per weight plus one f32 scale per vocabulary row (per LM
    # head column), from the arrays, against the same count without the tables
    got_b = param_bytes(q)
    no_tables = param_bytes({k: a for k, a in q.items() if k not in ("embed", "lm_head")})
    n_tab = 1 if tied else 2
    assert got_b["quantized_values"] - no_tables["quantized_values"] == n_tab * v * h
    assert got_b["scales"] - no_tables["scales"] == n_tab * 4 * v
    assert got_b["unquantized"] == no_tables["unquantized"]


def test_int8_draft_head_keeps_the_tables_int8_rows():
    cfg, params = tiny_model(seed=6)
    qcfg, q = quantize_params(cfg, params, "int8")
    ranking = jnp.asarray(np.random.default_rng(1).permutation(cfg.vocab_size), jnp.int32)
    out, n = with_draft_vocab(qcfg, dict(q, draft_vocab=ranking), 16)
    head = out["draft_head"]
    assert n == 16 and head.dtype == jnp.int8 and head.scale.shape == (16, 1)
    x = np.random.default_rng(2).standard_normal((2, cfg.hidden_size)).astype(np.float32)
    rows = np.asarray(dequantize(q["embed"]))[np.asarray(ranking)[:16]]
    np.testing.assert_allclose(np.asarray(DraftHead(out["draft_ids"], head)(jnp.asarray(x))),
                               x @ rows.T, rtol=1e-5, atol=1e-5)


def test_int8_table_against_a_float_config_is_refused_naming_it():
    cfg, params = tiny_model(seed=7)
    qcfg, q = quantize_params(cfg, params, "int8")
    qc = qcfg.quantization
    no_embed = qcfg.replace(quantization=type(qc)(
        "int8", None, tuple(p for p in qc.quantized if p != "embed")))
    with pytest.raises(ValueError, match="tensor 'embed' is 8-bit"):
        check_quantized(no_embed, q)
    with pytest.raises(ValueError, match="tensor 'embed' is a float array"):
        check_quantized(qcfg, dict(q, embed=params["embed"]))


def test_fp8_leaves_the_embedding_and_lm_head_in_float():
    cfg, params = tiny_model(seed=8, tie_word_embeddings=False)
    qcfg, q = quantize_params(cfg, params, "fp8", (16, 16))
    assert not is_quantized(q["embed"]) and not is_quantized(q["lm_head"])
    assert not {"embed", "lm_head"} & set(qcfg.quantization.quantized)
    assert not {"embed", "lm_head"} & set(config_paths(cfg, "fp8"))
    assert {"embed", "lm_head"} <= set(config_paths(cfg, "int8"))
