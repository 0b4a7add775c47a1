"""Gated delta rule Pallas kernels (:mod:`jmtp.pallas.gated_delta_rule`) against the jnp references
of :mod:`jmtp.model.gated_deltanet`.

The kernels run in TPU interpret mode on CPU (out-of-bounds reads raise, uninitialised memory is
NaN; one run with the race detector). The last test compiles both for a TPU topology ahead of time
with libtpu's Mosaic compiler (:mod:`jmtp.aot`'s compile-only devices), which is what interpret
mode cannot check: Mosaic's tiling and lowering rules.
``python tests/pallas/test_gated_delta_rule.py [topology]`` prints that compile report and nothing
else.
"""
from __future__ import annotations

import functools
import importlib.util
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.experimental.pallas import tpu as pltpu

from jmtp.model import gated_deltanet as gd
from jmtp.model import schema
from jmtp.pallas import gated_delta_rule as gdr

ATOL = 1e-5
RACE_CHECK = pltpu.InterpretParams(detect_races=True, out_of_bounds_reads="raise",
                                   uninitialized_memory="nan")


@pytest.fixture(autouse=True)
def _reset_tpu_interpreter():
    """A kernel that raised leaves the TPU interpreter's shared state behind; clear it."""
    yield
    pltpu.reset_tpu_interpret_mode_state()


# ------------------------------------------------------------------------------------------------
# Inputs
# ------------------------------------------------------------------------------------------------

def row_inputs(rng, t, h, dk, dv, repeat_keys=False):
    """Prepared rule inputs like the layer makes them: l2-normalised q (scaled) and k, decays
    ``g < 0``, ``beta`` in (0, 1)."""
    q = gd.l2norm(jnp.asarray(rng.normal(size=(t, h, dk)), jnp.float32)) * dk ** -0.5
    k = rng.normal(size=(t, h, dk))
    if repeat_keys:      # the worst case of the UT solve: (I + A) far from I
        k = np.broadcast_to(k[:1], k.shape)
    k = gd.l2norm(jnp.asarray(k, jnp.float32))
    v = jnp.asarray(rng.normal(size=(t, h, dv)), jnp.float32)
    g = -jnp.asarray(rng.uniform(0.0, 1.5, size=(t, h)), jnp.float32)
    beta = jnp.asarray(rng.uniform(0.0, 1.0, size=(t, h)), jnp.float32)
    if repeat_keys:
        g, beta = g * 0.01, jnp.full_like(beta, 0.99)
    return q, k, v, g, beta


def packed_meta(lens, t, window, *, pad_seq=0, ckpts=None):
    """Row metadata of sequences ``lens`` packed from row 0, padding rows after them (slot
    ``pad_seq``, no start, checkpoint -1). Like the engine: the last ``min(q, W)`` rows of a slot
    write checkpoints ``W - q + local``; ``ckpts`` overrides per-row checkpoints."""
    seq, start, ck = [], [], []
    for s, n in enumerate(lens):
        for i in range(n):
            seq.append(s)
            start.append(i == 0)
            c = window - n + i
            ck.append(c if c >= 0 else -1)
    assert len(seq) <= t
    while len(seq) < t:
        seq.append(pad_seq)
        start.append(False)
        ck.append(-1)
    if ckpts is not None:
        ck = list(ckpts)
    return (jnp.asarray(seq, jnp.int32), jnp.asarray(start, bool), jnp.asarray(ck, jnp.int32))


def nan_pool(b, w, h, dk, dv):
    return jnp.full((b, w, h, dk, dv), jnp.nan, jnp.float32)


def check_packed(args, *, rows_per_block=None, interpret=True):
    """Kernel vs ``gated_delta_rule_packed``; written checkpoints equal, all others untouched."""
    o_ref, pool_ref = gd.gated_delta_rule_packed(*args)
    o, pool = gdr.gated_delta_rule_packed_pallas(*args, interpret=interpret,
                                                 rows_per_block=rows_per_block)
    o, pool = jax.block_until_ready((o, pool))
    assert o.shape == o_ref.shape and o.dtype == jnp.float32
    np.testing.assert_allclose(o, o_ref, atol=ATOL, rtol=0)
    pool0 = np.asarray(args[-1])
    w = pool0.shape[1]
    written = np.zeros(pool0.shape[:2], bool)
    for s, c in zip(np.asarray(args[5]), np.asarray(args[7])):
        if c >= 0:
            written[s, min(c, w - 1)] = True
    pool, pool_ref = np.asarray(pool), np.asarray(pool_ref)
    np.testing.assert_allclose(pool[written], pool_ref[written], atol=ATOL, rtol=0)
    assert np.isfinite(pool[written]).all()
    np.testing.assert_array_equal(pool[~written], pool0[~written])   # NaN stays NaN, bit for bit
    return o, pool


# ------------------------------------------------------------------------------------------------
# Packed form
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("rows_per_block", [None, 8])
def test_packed_ragged_batch_with_padding(rows_per_block):
    """Three slots of 5, 7 and 4 rows (W = 4: the 5- and 7-row prefill chunks write only their
    last 4 rows, the 4-row verify window all), 4 padding rows; a pool of NaN. ``R = 8``: the
    state crosses row blocks, and slots straddle them."""
    rng = np.random.default_rng(0)
    t, h, dk, dv, b, w = 20, 2, 16, 8, 3, 4
    q, k, v, g, beta = row_inputs(rng, t, h, dk, dv)
    seq, start, ck = packed_meta([5, 7, 4], t, w)
    init = jnp.asarray(rng.normal(size=(b, h, dk, dv)), jnp.float32)
    check_packed((q, k, v, g, beta, seq, start, ck, init, nan_pool(b, w, h, dk, dv)),
                 rows_per_block=rows_per_block)


def test_packed_merged_layout_gqa_and_clamps():
    """Dk = Dv = 128 (the kernel tiles the packed [T, H·D] view): GQA inputs from
    ``prepare_qk`` (2 key heads -> 4 value heads), decode windows of 1 and 3 rows of slots 2 and
    0 (slot 1 idle, its checkpoints untouched), padding rows naming an out-of-range slot, and a
    checkpoint index >= W (clamped to W - 1 like the reference)."""
    rng = np.random.default_rng(1)
    t, hk, hv, d, b, w = 9, 2, 4, 128, 3, 3
    q, k = gd.prepare_qk(jnp.asarray(rng.normal(size=(t, hk, d)), jnp.float32),
                         jnp.asarray(rng.normal(size=(t, hk, d)), jnp.float32), hv)
    _, _, v, g, beta = row_inputs(rng, t, hv, d, d)
    seq = jnp.asarray([2, 0, 0, 0, 7, 7, 7, 7, 7], jnp.int32)
    start = jnp.asarray([1, 1, 0, 0, 0, 0, 0, 0, 0], bool)
    ck = jnp.asarray([2, 0, 1, 5, -1, -1, -1, -1, -1], jnp.int32)
    init = jnp.asarray(rng.normal(size=(b, hv, d, d)), jnp.float32)
    check_packed((q, k, v, g, beta, seq, start, ck, init, nan_pool(b, w, hv, d, d)))


def test_packed_race_detector_and_engine_row_metadata():
    """Row metadata from the engine's own :func:`packed_rows` (prefill chunk, verify windows,
    a fresh slot, padding rows mapped to the last slot); TPU interpret mode with the race
    detector: the double-buffered checkpoint DMAs never race."""
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as tpu_interpret
    rng = np.random.default_rng(2)
    t, h, dk, dv, b, w = 24, 2, 16, 16, 4, 4
    cu = jnp.asarray([0, 9, 13, 16, 18], jnp.int32)       # 9-row prefill, windows of 4, 3, 2
    positions = jnp.asarray(list(range(9)) + list(range(30, 34)) + list(range(7, 10))
                            + [0, 1] + [0] * 6, jnp.int32)
    rows = gd.packed_rows(cu, positions, w)
    q, k, v, g, beta = row_inputs(rng, t, h, dk, dv)
    init = jnp.asarray(rng.normal(size=(b, h, dk, dv)), jnp.float32)
    init = jnp.where(rows.fresh[cu[:-1]][:, None, None, None], 0.0, init)
    args = (q, k, v, g, beta, rows.seq, rows.valid & (rows.local == 0), rows.ckpt, init,
            nan_pool(b, w, h, dk, dv))
    check_packed(args, rows_per_block=8, interpret=RACE_CHECK)
    assert tpu_interpret.races is not None and not tpu_interpret.races.races_found, \
        "TPU interpreter reported a data race"


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lens=st.lists(st.integers(1, 6), min_size=1, max_size=4), data=st.data())
def test_packed_random_lengths(lens, data):
    """Random slot lengths (static shapes T = 16, B = 4, W = 3: one compile), random slots that
    hold no rows, random checkpoint pattern among the engine's (every row may or may not
    write), NaN pool; sometimes the first slot's rows do not start (they run from the zero
    state, as the reference's scan does)."""
    t, h, dk, dv, b, w = 16, 2, 8, 8, 4, 3
    lens = lens[:b]
    while sum(lens) > t:
        lens = lens[:-1]
    seed = data.draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    slots = rng.permutation(b)[:len(lens)]
    seq, start, ck = packed_meta(lens, t, w)
    seq = jnp.where(jnp.arange(t) < sum(lens), jnp.asarray(slots, jnp.int32)[
        jnp.minimum(seq, len(lens) - 1)], seq)
    start = start.at[0].set(data.draw(st.booleans()))
    keep = jnp.asarray(rng.uniform(size=t) < 0.7)
    ck = jnp.where(keep, ck, -1)
    q, k, v, g, beta = row_inputs(rng, t, h, dk, dv)
    init = jnp.asarray(rng.normal(size=(b, h, dk, dv)), jnp.float32)
    check_packed((q, k, v, g, beta, seq, start, ck, init, nan_pool(b, w, h, dk, dv)),
                 rows_per_block=8)


def test_as_rule_of_linear_attention_packed():
    """The kernel is a drop-in ``rule=`` of the engine's layer (GQA 1 -> 2 heads, conv state,
    checkpoints of :func:`packed_rows`)."""
    from jmtp.model.config import LinearAttentionConfig, ModelConfig
    lc = LinearAttentionConfig(num_key_heads=1, num_value_heads=2, key_head_dim=16,
                               value_head_dim=8)
    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                      num_heads=2, num_kv_heads=1, head_dim=16,
                      layer_types=("linear_attention", "full_attention"), linear=lc)
    rng = np.random.default_rng(3)
    p = {name: jnp.asarray(rng.normal(size=shape) * 0.3, jnp.float32)
         for name, shape in schema.linear_attention_shapes(cfg).items()}
    b, w, t = 3, 3, 12
    cu = jnp.asarray([0, 6, 9, 9], jnp.int32)
    positions = jnp.asarray(list(range(6)) + [20, 21, 22] + [0, 0, 0], jnp.int32)
    rows = gd.packed_rows(cu, positions, w)
    h = jnp.asarray(rng.normal(size=(t, cfg.hidden_size)), jnp.float32)
    conv_pool = jnp.asarray(rng.normal(size=(b, w, lc.conv_kernel_dim - 1, lc.conv_dim)),
                            jnp.float32)
    rec_pool = jnp.asarray(rng.normal(size=(b, w, 2, 16, 8)), jnp.float32)
    current = jnp.asarray([0, 2, 1], jnp.int32)
    run = functools.partial(gd.linear_attention_packed, cfg, p, h, rows, conv_pool, rec_pool,
                            current)
    out_ref, conv_ref, rec_ref = run()
    rule = functools.partial(gdr.gated_delta_rule_packed_pallas, interpret=True)
    out, conv, rec = run(rule=rule)
    np.testing.assert_allclose(out, out_ref, atol=ATOL, rtol=1e-5)
    np.testing.assert_array_equal(conv, conv_ref)
    np.testing.assert_allclose(rec, rec_ref, atol=ATOL, rtol=0)


# ------------------------------------------------------------------------------------------------
# Chunked form
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("t,chunk,d,init,repeat", [
    (20, 8, 16, True, False),      # chunks do not divide T
    (20, 64, 16, False, False),    # one chunk longer than T, zero initial state
    (13, 5, 16, True, False),      # chunk not a multiple of 8 (interpret mode only)
    (7, 1, 16, True, False),       # chunk 1: the recurrent rule
    (40, 16, 128, True, False),    # Dk = Dv = 128: the packed [T, H·D] view
    (24, 8, 16, False, True),      # one key repeated, beta ~ 1: (I + A) far from I
])
def test_chunk_matches_references(t, chunk, d, init, repeat):
    rng = np.random.default_rng(t * 100 + chunk)
    h, dv = 2, (d if d == 128 else 8)
    q, k, v, g, beta = row_inputs(rng, t, h, d, dv, repeat_keys=repeat)
    s0 = jnp.asarray(rng.normal(size=(h, d, dv)), jnp.float32) if init else None
    o_ref, s_ref = gd.chunk_gated_delta_rule(q, k, v, g, beta, s0, chunk_size=chunk)
    o, s = gdr.chunk_gated_delta_rule_pallas(q, k, v, g, beta, s0, chunk_size=chunk,
                                             interpret=True)
    assert o.shape == (t, h, dv) and s.shape == (h, d, dv)
    np.testing.assert_allclose(o, o_ref, atol=ATOL, rtol=0)
    np.testing.assert_allclose(s, s_ref, atol=ATOL, rtol=0)
    o_rec, states = gd.recurrent_gated_delta_rule(q, k, v, g, beta, s0)
    np.testing.assert_allclose(o, o_rec, atol=ATOL, rtol=0)
    np.testing.assert_allclose(s, states[-1], atol=ATOL, rtol=0)


def test_empty_inputs():
    q = jnp.zeros((0, 2, 8))
    g = jnp.zeros((0, 2))
    o, s = gdr.chunk_gated_delta_rule_pallas(q, q, q, g, g, None, chunk_size=4)
    assert o.shape == (0, 2, 8) and not s.any()
    i = jnp.zeros((0,), jnp.int32)
    pool = nan_pool(1, 2, 2, 8, 8)
    o, out = gdr.gated_delta_rule_packed_pallas(q, q, q, g, g, i, i.astype(bool), i,
                                                jnp.zeros((1, 2, 8, 8)), pool)
    assert o.shape == (0, 2, 8) and out is pool


# ------------------------------------------------------------------------------------------------
# Validation
# ------------------------------------------------------------------------------------------------

def _good(t=6, h=2, dk=8, dv=4, b=3, w=2):
    f = lambda *s: jnp.zeros(s, jnp.float32)   # noqa: E731
    i = jnp.zeros((t,), jnp.int32)
    return dict(q=f(t, h, dk), k=f(t, h, dk), v=f(t, h, dv), g=f(t, h), beta=f(t, h),
                row_seq=i, row_start=i.astype(bool), row_ckpt=i, init=f(b, h, dk, dv),
                pool=f(b, w, h, dk, dv))


@pytest.mark.parametrize("name,bad,match", [
    ("q", jnp.zeros((6, 2)), r"q must have shape \[T, H, Dk\]"),
    ("k", jnp.zeros((6, 2, 4)), r"k must have shape \(6, 2, 8\)"),
    ("v", jnp.zeros((5, 2, 4)), r"v must have shape \[T=6, H=2, Dv\]"),
    ("v", jnp.zeros((6, 2, 4), jnp.int32), "v must have a floating dtype"),
    ("g", jnp.zeros((6, 3)), r"g must have shape \(6, 2\)"),
    ("beta", jnp.zeros((6,)), r"beta must have shape \(6, 2\)"),
    ("row_seq", jnp.zeros((6,), jnp.float32), "row_seq must have an integer dtype"),
    ("row_start", jnp.zeros((5,), bool), r"row_start must have shape \(6,\)"),
    ("row_ckpt", jnp.zeros((6, 1), jnp.int32), r"row_ckpt must have shape \(6,\)"),
    ("pool", jnp.zeros((3, 2, 2, 8, 5)), r"pool must have shape \(3, 2, 2, 8, 4\)"),
    ("pool", jnp.zeros((3, 2, 2, 8)), r"pool must have shape \[N, W, H=2, Dk=8, Dv=4\]"),
    ("pool", jnp.zeros((3, 2, 2, 8, 4), jnp.bfloat16), "pool must have float32"),
    ("pool", jnp.zeros((3, 0, 2, 8, 4)), "W >= 1"),
    ("init", jnp.zeros((4, 2, 8, 4)), r"init must have shape \(3, 2, 8, 4\)"),
    ("init", jnp.zeros((3, 2, 8, 5)), r"init must have shape \(3, 2, 8, 4\)"),
])
def test_packed_validation_names_the_argument(name, bad, match):
    args = {**_good(), name: bad}
    with pytest.raises(ValueError, match=match):
        gdr.gated_delta_rule_packed_pallas(*args.values())
    with pytest.raises(ValueError, match=match):   # abstract inputs: nothing is traced
        gdr.check_packed_inputs(*(jax.ShapeDtypeStruct(a.shape, a.dtype)
                                  for a in args.values()))


def test_packed_bad_options():
    args = tuple(_good().values())
    with pytest.raises(ValueError, match="rows_per_block"):
        gdr.gated_delta_rule_packed_pallas(*args, rows_per_block=12)
    with pytest.raises(ValueError, match="interpret"):
        gdr.gated_delta_rule_packed_pallas(*args, interpret="yes")


@pytest.mark.parametrize("chunk_size", [0, -3, 2.0, True])
def test_chunk_validation(chunk_size):
    a = _good()
    with pytest.raises(ValueError, match="chunk_size must be an int >= 1"):
        gdr.chunk_gated_delta_rule_pallas(a["q"], a["k"], a["v"], a["g"], a["beta"], None,
                                          chunk_size)
    s0 = jnp.zeros((2, 4, 8))
    with pytest.raises(ValueError, match=r"initial_state must have shape \(2, 8, 4\)"):
        gdr.chunk_gated_delta_rule_pallas(a["q"], a["k"], a["v"], a["g"], a["beta"], s0)
    with pytest.raises(ValueError, match=r"k must have shape \(6, 2, 8\)"):
        gdr.chunk_gated_delta_rule_pallas(a["q"], a["k"][:, :1], a["v"], a["g"], a["beta"])


def test_interpret_default_follows_the_host():
    """``interpret=None``: TPU interpret mode (OOB reads raise, NaN memory) on a non-TPU host."""
    assert jax.default_backend() != "tpu"
    params = gdr._interpret(None)
    assert isinstance(params, pltpu.InterpretParams)
    assert params.out_of_bounds_reads == "raise" and params.uninitialized_memory == "nan"
    assert gdr._interpret(False) is False


# ------------------------------------------------------------------------------------------------
# Ahead-of-time compile for TPU (libtpu's Mosaic compiler, no TPU needed)
# ------------------------------------------------------------------------------------------------

#: Qwen3-Next-80B-A3B's linear-attention heads (Hv = 32, Dk = Dv = 128) in a verify step of 64
#: rows over 8 slots with W = 4 checkpoints.
QWEN3_NEXT = dict(t=64, h=32, dk=128, dv=128, b=8, w=4)


def compile_report(topology: str = "v5e:1x1", *, t=64, h=32, dk=128, dv=128, b=8, w=4,
                   chunk_size=64) -> dict:
    """Compile both kernels (``interpret=False``, pool donated) for one device of TPU
    ``topology`` and return ``{label: jmtp.aot.ExecutableReport}``."""
    from jmtp import aot
    dev = aot.topology_devices(topology)[0]
    sharding = jax.sharding.SingleDeviceSharding(dev)
    f32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32, sharding=sharding)  # noqa: E731
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32, sharding=sharding)    # noqa: E731
    rows = (f32(t, h, dk), f32(t, h, dk), f32(t, h, dv), f32(t, h), f32(t, h))
    packed = (*rows, i32(t), jax.ShapeDtypeStruct((t,), jnp.bool_, sharding=sharding), i32(t),
              f32(b, h, dk, dv), f32(b, w, h, dk, dv))
    jobs = {
        "packed": (jax.jit(functools.partial(gdr.gated_delta_rule_packed_pallas,
                                             interpret=False), donate_argnums=(9,)), packed),
        "chunk": (jax.jit(functools.partial(gdr.chunk_gated_delta_rule_pallas,
                                            chunk_size=chunk_size, interpret=False)),
                  (*rows, f32(h, dk, dv))),
    }
    out = {}
    for label, (fn, args) in jobs.items():
        t0 = time.perf_counter()
        exe = fn.trace(*args).lower().compile()
        out[label] = aot.ExecutableReport.of(label, exe, time.perf_counter() - t0)
    return out


@pytest.mark.xdist_group("aot")
@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                    reason="libtpu not installed (pip install jmtp[aot])")
def test_kernels_compile_for_tpu_ahead_of_time():
    """Both kernels pass libtpu's Mosaic compiler at Qwen3-Next shapes (v5e, one chip): one
    Mosaic call each, the packed pool updated in place (aliased, no temporaries)."""
    reps = compile_report("v5e:1x1", **QWEN3_NEXT)
    packed, chunk = reps["packed"], reps["chunk"]
    assert packed.mosaic_kernels == {"jmtp_gated_delta_rule_packed_tpu": 1}
    assert chunk.mosaic_kernels == {"jmtp_chunk_gated_delta_rule_tpu": 1}
    s = QWEN3_NEXT
    pool_bytes = 4 * s["b"] * s["w"] * s["h"] * s["dk"] * s["dv"]
    assert packed.alias_bytes == pool_bytes
    assert packed.temp_bytes < pool_bytes // 8


if __name__ == "__main__":
    for _label, _rep in compile_report(*sys.argv[1:2]).items():
        print(_label, _rep)
