"""The paged forward is independent of how a sequence is chunked, where its blocks live, and what
it is packed with."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jmtp.model import (ModelConfig, compute_logits, forward, forward_logits, init_kv_cache,
                        init_params, ragged_batch)

CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=6,
                  num_kv_heads=2, head_dim=8, qk_norm=True, attention_bias=True)
PARAMS = init_params(CFG, jax.random.key(0), std=0.3)
SEQ = [int(x) for x in np.random.default_rng(0).integers(0, 64, 23)]
_fwd = jax.jit(forward, static_argnums=0)


def _tables(rng, seqs_pages, num_blocks):
    ids = rng.permutation(num_blocks)
    rows, at = [], 0
    width = max(seqs_pages)
    for n in seqs_pages:
        row = np.full((width,), -1, np.int32)
        row[:n] = ids[at:at + n]
        rows.append(row)
        at += n
    return jnp.asarray(np.stack(rows))


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("chunk", [1, 3, 7])
def test_chunked_prefill_with_shuffled_blocks_equals_single_prefill(chunk, block_size):
    full = np.asarray(forward_logits(CFG, PARAMS, SEQ))
    num_blocks = 16
    pages = -(-len(SEQ) // block_size)
    cache = init_kv_cache(CFG, CFG.num_layers, num_blocks, block_size)
    # Poison every block: only the sequence's own, written positions may ever be read.
    cache = type(cache)(jnp.full_like(cache.k, jnp.nan), jnp.full_like(cache.v, jnp.nan))
    tables = _tables(np.random.default_rng(chunk), [pages], num_blocks)
    got = []
    for start in range(0, len(SEQ), chunk):
        ids = SEQ[start:start + chunk]
        pos, meta = ragged_batch(jnp.array([len(ids)]), jnp.array([start]), tables, block_size, 8)
        h, cache = _fwd(CFG, PARAMS, jnp.asarray(ids + [0] * (8 - len(ids)), jnp.int32), pos, meta,
                        cache)
        got.append(np.asarray(compute_logits(PARAMS, h))[: len(ids)])
    np.testing.assert_allclose(np.concatenate(got), full, atol=2e-5, rtol=1e-5)


def test_packed_sequences_equal_each_alone():
    other = [int(x) for x in np.random.default_rng(1).integers(0, 64, 11)]
    bs, num_blocks = 4, 24
    cache = init_kv_cache(CFG, CFG.num_layers, num_blocks, bs)
    tables = _tables(np.random.default_rng(5), [6, 3], num_blocks)
    ids = jnp.asarray(SEQ + other + [0] * (40 - len(SEQ) - len(other)), jnp.int32)
    pos, meta = ragged_batch(jnp.array([len(SEQ), len(other)]), jnp.array([0, 0]), tables, bs, 40)
    h, _ = _fwd(CFG, PARAMS, ids, pos, meta, cache)
    logits = np.asarray(compute_logits(PARAMS, h))
    np.testing.assert_allclose(logits[: len(SEQ)], np.asarray(forward_logits(CFG, PARAMS, SEQ)),
                               atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(logits[len(SEQ): len(SEQ) + len(other)],
                               np.asarray(forward_logits(CFG, PARAMS, other)), atol=2e-5, rtol=1e-5)
