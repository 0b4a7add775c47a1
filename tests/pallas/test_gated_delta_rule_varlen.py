"""The varlen chunked gated-delta-rule kernels (TPU: :mod:`jmtp.pallas.gated_delta_rule_varlen`;
GPU: :mod:`jmtp.pallas.gated_delta_rule_gpu`) against the jnp reference
:func:`jmtp.model.gated_deltanet.chunk_gated_delta_rule_varlen`, in interpret mode on CPU (the GPU
kernels compiled with Triton when the backend is a GPU: ``scripts/device_check.sh``), with
the states of slots that have no chunk NaN (never read) and the engine's mixed rule over a pool
poisoned with NaN; the GPU packed recurrent kernel against ``gated_delta_rule_packed``; the TPU
kernel compiled for a TPU topology ahead of time."""
from __future__ import annotations

import functools
import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from jmtp.model import gated_deltanet as gd
from jmtp.pallas import gated_delta_rule_gpu as gdg
from jmtp.pallas import gated_delta_rule_varlen as gdv
from tests.pallas.test_gated_delta_rule import nan_pool, packed_meta, row_inputs

ATOL = 2e-5


@pytest.fixture(autouse=True)
def _reset_tpu_interpreter():
    yield
    pltpu.reset_tpu_interpret_mode_state()


def varlen_case(lens, c, h=2, dk=16, dv=8, extra_chunks=2, seed=0):
    """Slots of ``lens`` rows laid out chunk-aligned (``C = c``), then ``extra_chunks`` chunks of
    no slot (zero rows, slot B-1) like the engine's layout; slots without rows get a NaN initial
    state (a kernel must not read it)."""
    rng = np.random.default_rng(seed)
    b = len(lens)
    per = [-(-n // c) for n in lens]
    n = sum(per) + extra_chunks
    q, k, v, g, beta = (np.zeros((n * c,) + a.shape[1:], np.float32)
                        for a in row_inputs(rng, 1, h, dk, dv))
    seq, first, last = [], [], []
    row = 0
    for s, (ln, m) in enumerate(zip(lens, per)):
        rows = row_inputs(rng, ln, h, dk, dv)
        for dst, src in zip((q, k, v, g, beta), rows):
            dst[row:row + ln] = np.asarray(src)
        seq += [s] * m
        first += [i == 0 for i in range(m)]
        last += [i == m - 1 for i in range(m)]
        row += m * c
    seq += [b - 1] * extra_chunks
    first += [False] * extra_chunks
    last += [False] * extra_chunks
    init = rng.normal(size=(b, h, dk, dv)).astype(np.float32)
    init[[i for i, ln in enumerate(lens) if ln == 0]] = np.nan
    arrays = [jnp.asarray(a) for a in (q, k, v, g, beta)]
    meta = (jnp.asarray(seq, jnp.int32), jnp.asarray(first), jnp.asarray(last))
    return (*arrays, *meta, jnp.asarray(init)), per


def check_varlen(kernel, lens, c, **kw):
    args, per = varlen_case(lens, c, **kw)
    o_ref, f_ref = gd.chunk_gated_delta_rule_varlen(*args)
    o, f = jax.block_until_ready(kernel(*args))
    real = np.zeros(o.shape[0], bool)
    row = 0
    for ln, m in zip(lens, per):
        real[row:row + ln] = True
        row += m * c
    np.testing.assert_allclose(np.asarray(o)[real], np.asarray(o_ref)[real], atol=ATOL, rtol=0)
    has = [ln > 0 for ln in lens]
    np.testing.assert_allclose(np.asarray(f)[has], np.asarray(f_ref)[has], atol=ATOL, rtol=0)
    assert np.isfinite(np.asarray(f)[has]).all()
    # each slot's final state also equals the recurrent reference over its own rows
    row = 0
    for s, (ln, m) in enumerate(zip(lens, per)):
        if ln:
            _, states = gd.recurrent_gated_delta_rule(*(a[row:row + ln] for a in args[:5]),
                                                      args[8][s])
            np.testing.assert_allclose(np.asarray(f)[s], np.asarray(states[-1]), atol=ATOL)
        row += m * c


TPU_VARLEN = functools.partial(gdv.chunk_gated_delta_rule_varlen_pallas, interpret=True)
# (interpret=None: compiled with Triton on a GPU, interpreted elsewhere)
GPU_VARLEN = functools.partial(gdg.chunk_gated_delta_rule_varlen_gpu, interpret=None)


@pytest.mark.parametrize("kernel", [TPU_VARLEN, GPU_VARLEN], ids=["tpu", "gpu"])
@pytest.mark.parametrize("lens,c", [([9, 0, 17, 5], 8), ([3], 4), ([0, 30], 8)])
def test_varlen_equals_reference(kernel, lens, c):
    """Slots of several chunks, a slot with none (NaN initial state, never read), a partial last
    chunk, trailing chunks of no slot."""
    check_varlen(kernel, lens, c)


def test_varlen_tpu_merged_layout():
    """Dk = Dv = 128: the kernel tiles the packed [T, H·D] view."""
    check_varlen(TPU_VARLEN, [20, 7], 8, dk=128, dv=128, h=2)


@pytest.mark.parametrize("chunk_rule,rule", [
    (TPU_VARLEN, None),
    (GPU_VARLEN, functools.partial(gdg.gated_delta_rule_packed_gpu, interpret=None)),
], ids=["tpu", "gpu"])
def test_mixed_rule_with_kernels_over_a_nan_pool(chunk_rule, rule):
    """The engine's mixed rule with the kernels (slots of 9, 2, 3 and 6 rows, W = 3, a flat pool
    of two layers' entries at ``pool_base`` = B): the same outputs and checkpoints as with the
    jnp forms; every entry and checkpoint not written stays NaN."""
    rng = np.random.default_rng(2)
    lens, w, b, h, dk, dv = [9, 2, 3, 6], 3, 5, 4, 16, 8
    t = sum(lens) + 3
    q, k, v, g, beta = row_inputs(rng, t, h, dk, dv)
    cu = np.concatenate([[0], np.cumsum(lens + [0])])
    pos = np.concatenate([np.arange(n) + 4 for n in lens] + [np.zeros(3, int)])
    rows = gd.packed_rows(jnp.asarray(cu, jnp.int32), jnp.asarray(pos, jnp.int32), w)
    init = jnp.asarray(rng.normal(size=(b, h, dk, dv)), jnp.float32)
    pool = nan_pool(2 * b, w, h, dk, dv)
    args = (q, k, v, g, beta, rows, init, pool)
    o_ref, p_ref = gd.gated_delta_rule_mixed(*args, chunk_size=4, pool_base=b)
    o, p = gd.gated_delta_rule_mixed(*args, rule=rule, chunk_size=4, pool_base=b,
                                     chunk_rule=chunk_rule)
    np.testing.assert_allclose(np.asarray(o)[:sum(lens)], np.asarray(o_ref)[:sum(lens)],
                               atol=ATOL, rtol=0)
    p, p_ref = np.asarray(p), np.asarray(p_ref)
    np.testing.assert_array_equal(np.isnan(p), np.isnan(p_ref))
    np.testing.assert_allclose(p[~np.isnan(p)], p_ref[~np.isnan(p_ref)], atol=ATOL, rtol=0)
    assert np.isnan(p[:b]).all()           # the other layer's entries: untouched


@pytest.mark.parametrize("bv", [None, 4])
def test_gpu_packed_equals_reference(bv):
    """The GPU packed recurrent kernel: three slots of 5, 7 and 4 rows (W = 4), padding rows, a
    pool of NaN at ``pool_base`` 3 of a 6-entry flat pool: the same outputs and checkpoints as
    ``gated_delta_rule_packed``, the other checkpoints bit for bit NaN; ``bv``: value columns per
    program."""
    rng = np.random.default_rng(0)
    t, h, dk, dv, b, w = 20, 2, 16, 8, 3, 4
    q, k, v, g, beta = row_inputs(rng, t, h, dk, dv)
    seq, start, ck = packed_meta([5, 7, 4], t, w)
    init = jnp.asarray(rng.normal(size=(b, h, dk, dv)), jnp.float32)
    args = (q, k, v, g, beta, seq, start, ck, init, nan_pool(2 * b, w, h, dk, dv))
    o_ref, p_ref = gd.gated_delta_rule_packed(*args, pool_base=b)
    o, p = gdg.gated_delta_rule_packed_gpu(*args, pool_base=b, interpret=None, block_v=bv)
    np.testing.assert_allclose(np.asarray(o)[:16], np.asarray(o_ref)[:16], atol=ATOL, rtol=0)
    p, p_ref = np.asarray(p), np.asarray(p_ref)
    np.testing.assert_array_equal(np.isnan(p), np.isnan(p_ref))
    np.testing.assert_allclose(p[~np.isnan(p)], p_ref[~np.isnan(p_ref)], atol=ATOL, rtol=0)


def test_validation_names_the_argument():
    args, _ = varlen_case([5], 4)
    bad = list(args)
    bad[5] = jnp.zeros((3,), jnp.int32)              # 3 chunks do not divide 8 rows
    with pytest.raises(ValueError, match="chunk_seq"):
        gdv.chunk_gated_delta_rule_varlen_pallas(*bad)
    bad = list(args)
    bad[8] = jnp.zeros((1, 2, 16, 4))
    with pytest.raises(ValueError, match="init"):
        gdg.chunk_gated_delta_rule_varlen_gpu(*bad)


@pytest.mark.xdist_group("aot")
@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                    reason="libtpu not installed (pip install jmtp[aot])")
def test_varlen_kernel_compiles_for_tpu_ahead_of_time():
    """libtpu's Mosaic compiler accepts the varlen kernel at Qwen3-Next's head shape (32 value
    heads of 128 x 128, C = 64, 8 slots): one Mosaic call."""
    from jmtp import aot
    dev = aot.topology_devices("v5e:1x1")[0]
    sh = jax.sharding.SingleDeviceSharding(dev)
    n, c, h, d, b = 6, 64, 32, 128, 8
    f32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32, sharding=sh)  # noqa: E731
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32, sharding=sh)    # noqa: E731
    args = (f32(n * c, h, d), f32(n * c, h, d), f32(n * c, h, d), f32(n * c, h), f32(n * c, h),
            i32(n), i32(n), i32(n), f32(b, h, d, d))
    fn = jax.jit(functools.partial(gdv.chunk_gated_delta_rule_varlen_pallas, interpret=False))
    rep = aot.ExecutableReport.of("varlen", fn.trace(*args).lower().compile(), 0.0)
    assert rep.mosaic_kernels == {"jmtp_chunk_gated_delta_rule_varlen_tpu": 1}
