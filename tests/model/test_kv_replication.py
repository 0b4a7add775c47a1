"""Kv-head replication for tensor parallelism beyond the kv heads
(:func:`jmtp.model.params.replicate_kv_heads`): the replicated model computes the same function."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jmtp.model.config import ModelConfig
from jmtp.model.params import init_params, replicate_kv_heads
from tests.model.paged_logits import chunked_paged_logits

CFG = ModelConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=8,
                  num_kv_heads=2, head_dim=16, attention_bias=True, qk_norm=True,
                  num_mtp_layers=1)


@pytest.mark.parametrize("factor", [2, 4])
def test_replicated_model_has_the_same_logits(factor):
    """Chunked prefill and paged decode over shuffled, NaN-poisoned blocks: logits of the model
    with each kv head repeated ``factor`` times equal the original's (fp32, 1e-5)."""
    params = init_params(CFG, jax.random.key(0))
    params["layers"]["bk"] = 0.1 * jax.random.normal(jax.random.key(1),
                                                     params["layers"]["bk"].shape)
    cfg2, params2 = replicate_kv_heads(CFG, params, factor)
    assert cfg2.num_kv_heads == CFG.num_kv_heads * factor
    assert params2["layers"]["wk"].shape[-1] == CFG.kv_size * factor
    assert params2["mtp"]["layer"]["wv"].shape[-1] == CFG.kv_size * factor
    ids = list(np.random.default_rng(0).integers(0, CFG.vocab_size, 13))
    want = chunked_paged_logits(CFG, params, ids, prefill=9, chunk=4)
    got = chunked_paged_logits(cfg2, params2, ids, prefill=9, chunk=4)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_head_order_and_abstract_params():
    """Kv head j becomes heads j*f .. j*f+f-1 (hand-built columns; the int8 key shift likewise); abstract leaves get shapes."""
    d = CFG.head_dim
    wk = jnp.concatenate([jnp.full((CFG.hidden_size, d), j, jnp.float32) for j in range(2)], -1)
    params = {"layers": {"wk": wk[None]}, "k_shift": jnp.arange(2.0)[None, :, None] * jnp.ones(d)}
    _, out = replicate_kv_heads(CFG, params, 4)
    heads = np.asarray(out["layers"]["wk"][0]).reshape(CFG.hidden_size, 8, d)[0, :, 0]
    np.testing.assert_array_equal(heads, [0, 0, 0, 0, 1, 1, 1, 1])
    np.testing.assert_array_equal(np.asarray(out["k_shift"])[0, :, 0], [0, 0, 0, 0, 1, 1, 1, 1])
    sds = {"layers": {"wv": jax.ShapeDtypeStruct((2, 64, 32), jnp.bfloat16)}}
    assert replicate_kv_heads(CFG, sds, 2)[1]["layers"]["wv"].shape == (2, 64, 64)
    with pytest.raises(ValueError, match="factor"):
        replicate_kv_heads(CFG, params, 0)
