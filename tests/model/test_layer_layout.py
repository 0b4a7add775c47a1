"""The forward's layouts for speed keep its numbers: the in-place view of the stacked KV cache
(each layer writes exactly its own slots, padding rows nothing, other blocks untouched), the
unstacked (unrolled) layers, and the LM head contracting the [V, H] table directly."""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jmtp.model import (ModelConfig, compute_logits, forward, init_kv_cache, init_params,
                        ragged_batch)
from jmtp.model.llama import project_qkv, unstack_layers

CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=3, num_heads=6,
                  num_kv_heads=2, head_dim=8, qk_norm=True, attention_bias=True)
PARAMS = init_params(CFG, jax.random.key(1), std=0.3)
BS, NB = 4, 10
_fwd = jax.jit(forward, static_argnums=0)


def _reference_kv(params, ids, positions, slots, cache_k, cache_v):
    """Independent reference of the cache after a forward: run the layers one by one with the
    plain per-layer formulas (attention from the reference implementation over a dense history
    would need the old tokens; instead take each layer's input from ``forward`` run on a
    1-layer-shorter model), writing K/V at ``slots`` of that layer's slice in numpy."""
    k_ref, v_ref = np.array(cache_k), np.array(cache_v)
    for layer in range(CFG.num_layers):
        if layer == 0:
            x = params["embed"][ids]
        else:
            sub = {**params,
                   "layers": jax.tree_util.tree_map(lambda a: a[:layer], params["layers"])}
            x = _hidden_before_norm(CFG.replace(num_layers=layer), sub, ids, positions)
        p = jax.tree_util.tree_map(lambda a: a[layer], params["layers"])
        _, k, v = project_qkv(CFG, p, x, positions)
        for row, s in enumerate(np.asarray(slots)):
            if s >= 0:
                # the cache stores the kv heads merged, head h at [h*D, (h+1)*D)
                k_ref[layer, s // BS, s % BS] = np.asarray(k[row]).reshape(-1)
                v_ref[layer, s // BS, s % BS] = np.asarray(v[row]).reshape(-1)
    return k_ref, v_ref


def _hidden_before_norm(cfg, params, ids, positions):
    """Residual stream after ``cfg.num_layers`` layers of a fresh single prefill (positions 0..)."""
    from jmtp.model import llama
    t = ids.shape[0]
    cache = init_kv_cache(cfg, cfg.num_layers, NB, BS)
    tables = jnp.arange(NB, dtype=jnp.int32)[None, : -(-t // BS)]
    pos, meta = ragged_batch(jnp.array([t]), jnp.array([0]), tables, BS, t)
    x, _ = llama._run_layers(cfg, params["layers"], params["embed"][ids], pos, meta, cache, None)
    return x


@pytest.mark.parametrize("rows,padding", [(1, 0), (3, 0), (3, 2)])
@pytest.mark.parametrize("unstacked", [False, True])
def test_prefill_writes_each_layers_own_slots(rows, padding, unstacked):
    """A first prefill of ``rows`` tokens (+ ``padding`` padding rows) into scattered blocks: every
    layer's K/V lands at its slots of its own layer; every other cache entry keeps its sentinel."""
    params = unstack_layers(PARAMS) if unstacked else PARAMS
    rng = np.random.default_rng(rows + 10 * padding)
    ids = jnp.asarray(rng.integers(0, CFG.vocab_size, rows + padding), jnp.int32)
    tables = jnp.asarray(rng.permutation(NB)[None, :2].astype(np.int32))
    pos, meta = ragged_batch(jnp.array([rows]), jnp.array([0]), tables, BS, rows + padding)
    cache = init_kv_cache(CFG, CFG.num_layers, NB, BS)
    sentinel = jnp.arange(cache.k.size, dtype=jnp.float32).reshape(cache.k.shape) + 1000.0
    cache = type(cache)(sentinel, -sentinel)
    _, new = _fwd(CFG, params, ids, pos, meta, cache)
    slots = np.asarray(meta.slot_mapping)
    assert (slots[rows:] == -1).all() and (slots[:rows] >= 0).all()
    k_ref, v_ref = _reference_kv(PARAMS, ids[:rows], pos[:rows], slots[:rows], sentinel, -sentinel)
    np.testing.assert_allclose(np.asarray(new.k), k_ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(new.v), v_ref, rtol=1e-5, atol=1e-5)


def test_unstacked_layers_give_the_same_decode():
    """Prefill + three 1-row decode steps: unstacked layers give the stacked layers' logits."""
    seq = [int(x) for x in np.random.default_rng(3).integers(0, CFG.vocab_size, 9)]
    tables = jnp.asarray([[4, 7, 1]], jnp.int32)
    out = {}
    for name, params in (("stacked", PARAMS), ("unstacked", unstack_layers(PARAMS))):
        cache = init_kv_cache(CFG, CFG.num_layers, NB, BS)
        logits = []
        pos, meta = ragged_batch(jnp.array([6]), jnp.array([0]), tables, BS, 8)
        h, cache = _fwd(CFG, params, jnp.asarray(seq[:6] + [0, 0], jnp.int32), pos, meta, cache)
        logits.append(np.asarray(compute_logits(params, h))[:6])
        for i in range(6, 9):
            pos, meta = ragged_batch(jnp.array([1]), jnp.array([i]), tables, BS, 1)
            h, cache = _fwd(CFG, params, jnp.asarray([seq[i]], jnp.int32), pos, meta, cache)
            logits.append(np.asarray(compute_logits(params, h)))
        out[name] = np.concatenate(logits)
    assert out["stacked"].shape == (9, CFG.vocab_size)
    np.testing.assert_allclose(out["unstacked"], out["stacked"], rtol=1e-5, atol=1e-5)


def test_unstack_layers_splits_every_leaf():
    split = unstack_layers(PARAMS)
    assert isinstance(split["layers"], tuple) and len(split["layers"]) == CFG.num_layers
    for i, layer in enumerate(split["layers"]):
        for k, v in layer.items():
            np.testing.assert_array_equal(np.asarray(v), np.asarray(PARAMS["layers"][k][i]))
    assert unstack_layers(split) is split
    assert split["embed"] is PARAMS["embed"]


@pytest.mark.parametrize("t", [1, 4])
def test_tied_lm_head_equals_matmul_with_the_transposed_table(t):
    h = jax.random.normal(jax.random.key(t), (t, CFG.hidden_size))
    want = np.asarray(h) @ np.asarray(PARAMS["embed"]).T
    np.testing.assert_allclose(np.asarray(compute_logits(PARAMS, h)), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("t", [1, 3])
def test_compiled_decode_copies_no_cache_or_embedding(t):
    """Structure, not speed: the compiled forward + LM head holds no copy of a whole stacked
    cache (or of one layer's slice of it) and no transposed copy of the embedding table."""
    cfg = CFG.replace(vocab_size=4000)
    params = init_params(cfg, jax.random.key(2))
    nb = 64
    cache = init_kv_cache(cfg, cfg.num_layers, nb, BS)
    tables = jnp.arange(4, dtype=jnp.int32)[None]

    def step(params, ids, cache):
        pos, meta = ragged_batch(jnp.array([t]), jnp.array([5]), tables, BS, t)
        h, cache = forward(cfg, params, ids, pos, meta, cache)
        return compute_logits(params, h), cache

    hlo = jax.jit(step, donate_argnums=2).lower(params, jnp.zeros((t,), jnp.int32),
                                                cache).compile().as_text()
    kv = cfg.num_kv_heads * cfg.head_dim
    big = {nb * BS * kv, cfg.num_layers * nb * BS * kv, cfg.vocab_size * cfg.hidden_size}
    for line in hlo.splitlines():
        m = re.match(r"\s*(?:ROOT )?\S+ = f32\[([\d,]+)\]\S* (copy|transpose|dynamic-slice)\(", line)
        if m:
            n = int(np.prod([int(d) for d in m.group(1).split(",")]))
            assert n not in big, line.strip()[:200]


def test_check_params_accepts_unstacked_layers_and_names_bad_ones():
    from jmtp.model.params import check_params
    cfg = CFG.replace(num_mtp_layers=0)
    params = {k: v for k, v in PARAMS.items() if k != "mtp"}
    split = unstack_layers(params)
    check_params(cfg, split)
    with pytest.raises(ValueError, match="2 unstacked layers, expected 3"):
        check_params(cfg, {**split, "layers": split["layers"][:2]})
    bad = split["layers"][1] | {"wq": jnp.zeros((3, 3))}
    with pytest.raises(ValueError, match=r"layers\[1\]\.wq"):
        check_params(cfg, {**split, "layers": (split["layers"][0], bad, split["layers"][2])})
