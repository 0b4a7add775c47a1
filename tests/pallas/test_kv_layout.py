"""The merged cache row layout with padding lanes (:mod:`jmtp.pallas.kv_layout`): widths worked by
hand, the shard placement, and attention / forward over padded rows equal to unpadded ones."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jmtp.pallas import kv_layout
from jmtp.pallas import ragged_paged_attention as rpa


@pytest.mark.parametrize("nkv,d,groups,lanes,want", [
    (3, 64, 1, 128, 256),      # SmolLM2: 192 lanes -> two tiles
    (3, 64, 3, 128, 384),      # one 64-lane head per shard -> a 128-lane tile each
    (8, 128, 4, 128, 1024),    # Llama-3-8B at TP=4: aligned, no padding
    (2, 128, 1, 1, 256),       # off TPU: no padding
    (1, 576, 1, 128, 640),     # an MLA latent (512 + 64)
])
def test_row_width(nkv, d, groups, lanes, want):
    assert kv_layout.row_width(nkv, d, groups, lanes) == want


def test_row_width_rejects_uneven_groups():
    with pytest.raises(ValueError, match="groups=2 must divide num_kv_heads=3"):
        kv_layout.row_width(3, 64, 2, 128)


def test_pack_places_each_shards_heads_before_its_padding():
    x = jnp.arange(2 * 4 * 3, dtype=jnp.float32).reshape(2, 4, 3)   # T=2, Nkv=4, D=3
    rows = np.asarray(kv_layout.pack_rows(x, 16, groups=2))          # 2 shards x 8 lanes
    want = np.zeros((2, 16), np.float32)
    for t in range(2):
        want[t, 0:6] = np.asarray(x[t, 0:2]).reshape(-1)    # shard 0: heads 0, 1
        want[t, 8:14] = np.asarray(x[t, 2:4]).reshape(-1)   # shard 1: heads 2, 3
    np.testing.assert_array_equal(rows, want)
    back = kv_layout.unpack_rows(jnp.asarray(want[:, :8]), 2, 3)     # shard 0's local view
    np.testing.assert_array_equal(np.asarray(back), np.asarray(x[:, :2]))


@pytest.mark.parametrize("impl", ["reference", "xla", "pallas_tpu", "pallas_gpu"])
def test_attention_over_padded_rows_ignores_the_padding(impl):
    """Every implementation over a merged cache whose padding lanes hold NaN equals the same
    implementation over the split cache."""
    rng = np.random.default_rng(0)
    nb, bs, nkv, d, nq, t = 8, 8, 2, 32, 4, 6
    q = jnp.asarray(rng.standard_normal((t, nq, d)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((nb, bs, nkv, d)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((nb, bs, nkv, d)), jnp.float32)
    width = kv_layout.row_width(nkv, d, 1, 128)
    pad = lambda c: jnp.concatenate(                                 # noqa: E731
        [c.reshape(nb, bs, -1), jnp.full((nb, bs, width - nkv * d), jnp.nan)], -1)
    meta = (jnp.array([10, 5], jnp.int32), jnp.array([[3, 1], [6, 0]], jnp.int32),
            jnp.array([0, 4, 6], jnp.int32))
    kw = dict(sm_scale=0.2, implementation=impl)
    want = rpa.ragged_paged_attention(q, k, v, *meta, **kw)
    got = rpa.ragged_paged_attention(q, pad(k), pad(v), *meta, **kw, num_kv_heads=nkv)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_forward_with_padded_cache_rows_has_the_same_logits():
    """The model over a cache with padded rows (what a TPU engine allocates) gives the logits of
    the unpadded cache: chunked prefill and paged decode over shuffled, NaN-poisoned blocks."""
    from jmtp.model.config import ModelConfig
    from jmtp.model.params import init_params
    from tests.model.paged_logits import chunked_paged_logits
    cfg = ModelConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_layers=2,
                      num_heads=6, num_kv_heads=3, head_dim=16, num_mtp_layers=0)
    params = init_params(cfg, jax.random.key(0))
    ids = list(np.random.default_rng(1).integers(0, cfg.vocab_size, 11))
    want = chunked_paged_logits(cfg, params, ids, prefill=7, chunk=3)
    got = chunked_paged_logits(cfg, params, ids, prefill=7, chunk=3, row_width=128)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
