"""Ragged paged attention: reference vs numpy oracle; XLA path, Pallas TPU / GPU kernels vs reference.

Kernels run in Pallas interpret mode on CPU (TPU: simulated DMAs/semaphores with the race
detector and out-of-bounds reads raising). What real hardware would add (Mosaic layout passes,
Triton compilation, speed) is not checked here; the lowering tests only run the Python-side
Pallas -> Mosaic / Pallas -> Triton-IR lowering for TPU and CUDA targets.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu
from jax._src.pallas.mosaic.interpret import interpret_pallas_call as tpu_interpret

from jmtp.pallas import ragged_paged_attention as rpa
from jmtp.pallas import ragged_paged_attention_gpu as rpa_gpu
from jmtp.pallas import ragged_paged_attention_tpu as rpa_tpu

from attention_test_base import (  # tests/pallas is on sys.path (rootdir-relative import)
    Config, RaggedPagedAttentionTestBase, attention_numpy_loop, build_case, check_output,
    reference_output)

RACE_CHECK = pltpu.InterpretParams(detect_races=True, out_of_bounds_reads="raise",
                                   uninitialized_memory="nan")


@pytest.fixture(autouse=True)
def _reset_tpu_interpreter():
    """A kernel that raised leaves the TPU interpreter's shared state behind; clear it."""
    yield
    pltpu.reset_tpu_interpret_mode_state()


class TestReference(RaggedPagedAttentionTestBase):
    """The jnp reference against the float64 numpy loop oracle."""

    implementation = "reference"

    def expected(self, case):
        kw = {k: v for k, v in case.kwargs().items() if k not in ("k_scale", "v_scale")}
        return attention_numpy_loop(case.q, *case.dequantized(), case.kv_lens, case.block_tables,
                                    case.cu_q_lens, **kw)

    def call(self, case, **sizes):
        return reference_output(case)


class TestXLA(RaggedPagedAttentionTestBase):
    """The per-row-gather XLA path (the CPU default) against the reference."""

    implementation = "xla"

    @pytest.mark.parametrize("kv_chunk", [8, 24, 256])
    def test_small_tiles_cross_sequences(self, kv_chunk):
        """A 3-row query tile: tiles straddle sequence boundaries and the padding rows; key chunks
        of 1 page, 3 pages (the last one partly past the table) and the whole table."""
        cfg = Config(8, 2, 3, 64, num_tokens=40, num_seqs=5, max_kv=60)
        case = build_case(cfg, [5, 17, 0, 1, 9], [30, 60, 44, 1, 9], stale_tables=True, seed=3)
        out = rpa.ragged_paged_attention_xla(*case.jax_args(), **case.kwargs(), q_tile=3,
                                             kv_chunk=kv_chunk)
        check_output(case, out, self.expected(case))

    @pytest.mark.parametrize("rows", [1, 3, 4, 64])
    @pytest.mark.parametrize("window,cap", [(None, None), (6, 20.0)])
    def test_sequence_major_schedule(self, rows, window, cap):
        """``rows_per_seq``: rows visited sequence by sequence, ``rows`` at a time; sequences
        with more rows (a 30-row prefill chunk) loop over several tiles, idle sequences over
        none; key chunks of 2 pages."""
        cfg = Config(8, 2, 3, 64, num_tokens=48, num_seqs=5, max_kv=60, sliding_window=window,
                     soft_cap=cap)
        case = build_case(cfg, [4, 30, 0, 1, 3], [33, 60, 44, 1, 9], stale_tables=True, seed=13)
        out = rpa.ragged_paged_attention_xla(*case.jax_args(), **case.kwargs(), kv_chunk=16,
                                             rows_per_seq=rows)
        check_output(case, out, self.expected(case))

    def test_wide_block_table_reads_only_used_chunks(self):
        """A block table 64x wider than any context (max_model_len far above the keys in use),
        whose unused entries point at NaN-filled blocks: same output as the tight table, since the
        key loop stops at the last chunk some row sees."""
        cfg = Config(8, 2, 3, 64, num_tokens=24, num_seqs=3, max_kv=40)
        case = build_case(cfg, [1, 4, 16], [33, 40, 16], stale_tables=True, seed=9)
        args = list(case.jax_args())
        kc, vc = args[1], args[2]
        nan_blocks = 4
        pad = jnp.full((nan_blocks,) + kc.shape[1:], jnp.nan, kc.dtype)
        args[1], args[2] = jnp.concatenate([kc, pad]), jnp.concatenate([vc, pad])
        wide = np.full((3, 64 * case.block_tables.shape[1]), kc.shape[0], np.int32)  # NaN blocks
        wide[:, :case.block_tables.shape[1]] = case.block_tables
        args[4] = jnp.asarray(wide)
        out = rpa.ragged_paged_attention_xla(*args, **case.kwargs(), q_tile=8, kv_chunk=16)
        check_output(case, out, self.expected(case))
        tight = rpa.ragged_paged_attention_xla(*case.jax_args(), **case.kwargs(), q_tile=8,
                                               kv_chunk=16)
        np.testing.assert_array_equal(np.asarray(out), np.asarray(tight))

    def test_bad_sizes(self):
        cfg = Config(8, 2, 3, 64, num_tokens=8, num_seqs=2, max_kv=16)
        case = build_case(cfg, [1, 1], [4, 9], stale_tables=False, seed=1)
        with pytest.raises(ValueError, match="kv_chunk"):
            rpa.ragged_paged_attention_xla(*case.jax_args(), **case.kwargs(), kv_chunk=0)
        with pytest.raises(ValueError, match="rows_per_seq"):
            rpa.ragged_paged_attention_xla(*case.jax_args(), **case.kwargs(), rows_per_seq=0)


    @pytest.mark.parametrize("window,cap", [(None, None), (6, 20.0)])
    def test_one_sequence_tiles_gather_once(self, window, cap):
        """4-row tiles: rows 0-27 are tiles of sequence 0 only (one gather per tile), tile 28-31
        mixes sequences 0 and 1, the rest is padding (NaN queries, NaN in unowned blocks)."""
        cfg = Config(8, 2, 3, 64, num_tokens=40, num_seqs=3, max_kv=60, sliding_window=window,
                     soft_cap=cap)
        case = build_case(cfg, [30, 3, 0], [45, 3, 7], stale_tables=True, seed=5)
        for kv_chunk in (8, 256):      # key chunks of one page (window spans several), all
            out = rpa.ragged_paged_attention_xla(*case.jax_args(), **case.kwargs(), q_tile=4,
                                                 kv_chunk=kv_chunk)
            check_output(case, out, self.expected(case))

    @pytest.mark.parametrize("window,cap", [(None, None), (6, 20.0)])
    def test_statically_one_sequence_batches(self, window, cap):
        """The schedules chosen at trace time when every tile holds one sequence: a single row
        (a decode step of one slot among four, the row owned by the third sequence; no tile
        map) and a one-sequence batch of 40 rows in 4-row tiles with 11 padding rows (no
        per-tile test)."""
        one_row = Config(8, 2, 3, 64, num_tokens=1, num_seqs=4, max_kv=60,
                         sliding_window=window, soft_cap=cap)
        case = build_case(one_row, [0, 0, 1, 0], [9, 0, 37, 5], stale_tables=True, seed=21)
        for kv_chunk in (8, 256):
            out = rpa.ragged_paged_attention_xla(*case.jax_args(), **case.kwargs(),
                                                 kv_chunk=kv_chunk)
            check_output(case, out, self.expected(case))
        one_seq = Config(8, 2, 3, 64, num_tokens=40, num_seqs=1, max_kv=60,
                         sliding_window=window, soft_cap=cap)
        case = build_case(one_seq, [29], [50], stale_tables=True, seed=22)
        out = rpa.ragged_paged_attention_xla(*case.jax_args(), **case.kwargs(), q_tile=4,
                                             kv_chunk=16)
        check_output(case, out, self.expected(case))


class TestPallasTPU(RaggedPagedAttentionTestBase):
    """Mosaic TPU kernel in TPU interpret mode, race detector on, OOB reads raise."""

    implementation = "pallas_tpu"

    def sizes(self, config):
        return dict(config.tpu_sizes)

    def call(self, case, **sizes):
        out = rpa_tpu.ragged_paged_attention_tpu(*case.jax_args(), **case.kwargs(),
                                                 interpret=RACE_CHECK, **sizes)
        out = jax.block_until_ready(out)
        assert tpu_interpret.races is not None and not tpu_interpret.races.races_found, \
            "TPU interpreter reported a data race"
        return out

    def test_multi_tile_multi_step(self):
        """Small tiles and 1-page steps: many tiles, sequences spanning tiles, cross-sequence
        prefetch in the double buffer."""
        cfg = Config(8, 2, 3, 64, num_tokens=40, num_seqs=5, max_kv=60)
        case = build_case(cfg, [5, 17, 0, 1, 9], [30, 60, 44, 1, 9], stale_tables=True, seed=7)
        self._check(case, num_queries_per_block=8, num_kv_pages_per_block=1)


class TestPallasGPU(RaggedPagedAttentionTestBase):
    """Triton kernel: compiled on a GPU (scripts/device_check.sh), else Pallas' generic interpret
    mode."""

    implementation = "pallas_gpu"

    def sizes(self, config):
        return dict(config.gpu_sizes)

    def call(self, case, **sizes):
        return rpa_gpu.ragged_paged_attention_gpu(*case.jax_args(), **case.kwargs(),
                                                  interpret=jax.default_backend() != "gpu",
                                                  **sizes)

    @pytest.mark.parametrize("splits", [1, 3])
    def test_split_k_matches(self, splits):
        """Same batch with and without split-K (different combine paths)."""
        cfg = Config(8, 1, 8, 64, num_tokens=24, num_seqs=4, max_kv=200)
        case = build_case(cfg, [5, 1, 16, 2], [200, 7, 16, 120], stale_tables=True, seed=11)
        self._check(case, num_splits=splits, num_keys_per_block=16)


def test_numpy_oracle_hand_worked():
    """One query, two keys: scores (0, ln 3) -> weights (1/4, 3/4); the oracle and the reference
    must both give 0.25 * v0 + 0.75 * v1 (and ignore the NaN-poisoned third slot)."""
    q = np.zeros((2, 1, 2), np.float32)
    q[0, 0] = [np.log(3.0), 0.0]
    k = np.full((2, 4, 1, 2), np.nan, np.float32)
    v = np.full((2, 4, 1, 2), np.nan, np.float32)
    # Sequence 0 stores positions 0, 1 in block 1 (block 0 unused).
    k[1, 0, 0], k[1, 1, 0] = [0.0, 5.0], [1.0, 5.0]
    v[1, 0, 0], v[1, 1, 0] = [4.0, 0.0], [0.0, 8.0]
    args = (q, k, v, np.array([2], np.int32), np.array([[1, -1]], np.int32),
            np.array([0, 1], np.int32))
    want = np.zeros((2, 1, 2))
    want[0, 0] = [1.0, 6.0]
    np.testing.assert_allclose(attention_numpy_loop(*args, sm_scale=1.0), want, atol=1e-12)
    ref = jax.jit(functools.partial(rpa.ragged_paged_attention_reference, sm_scale=1.0))
    got = ref(*map(jnp.asarray, args))
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-6)
    # Sliding window 1: only the own position (key 1) -> v1 exactly.
    want[0, 0] = [0.0, 8.0]
    np.testing.assert_allclose(attention_numpy_loop(*args, sm_scale=1.0, sliding_window=1), want)


def test_dispatcher_routes_to_kernels():
    """``implementation=`` + ``interpret=`` pass through the public entry point."""
    cfg = Config(8, 1, 1, 64, num_tokens=16, num_seqs=2, max_kv=20)
    case = build_case(cfg, [3, 9], [20, 9], stale_tables=True, seed=5)
    want = reference_output(case)
    for impl, interp in (("pallas_tpu", RACE_CHECK), ("pallas_gpu", True)):
        out = rpa.ragged_paged_attention(*case.jax_args(), **case.kwargs(), implementation=impl,
                                         interpret=interp)
        check_output(case, out, want)
    assert rpa.default_implementation() == "xla"   # CPU


def _abstract_args(dtype, t=64, nkv=2, group=4, d=128, bs=16, nb=64, s=8, pages=16):
    f = lambda *shape: jax.ShapeDtypeStruct(shape, dtype)          # noqa: E731
    i = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)      # noqa: E731
    return (f(t, nkv * group, d), f(nb, bs, nkv, d), f(nb, bs, nkv, d), i(s), i(s, pages),
            i(s + 1))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("kernel,platform", [
    (rpa_tpu.ragged_paged_attention_tpu, "tpu"), (rpa_gpu.ragged_paged_attention_gpu, "cuda")])
def test_kernel_lowers_for_hardware(kernel, platform, dtype):
    """Compiled (non-interpret) kernels lower to Mosaic TPU / Triton IR custom calls. This runs
    the Pallas lowering rules only; Mosaic layout passes and Triton's compiler need the device."""
    fn = jax.jit(functools.partial(kernel, sm_scale=0.125, sliding_window=32, soft_cap=3.0,
                                   interpret=False))
    text = fn.trace(*_abstract_args(dtype)).lower(lowering_platforms=(platform,)).as_text()
    assert ("tpu_custom_call" if platform == "tpu" else "__gpu$xla.gpu.triton") in text


@pytest.mark.parametrize("kv_quant", ["int8", "fp8_e4m3"])
@pytest.mark.parametrize("kernel,platform", [
    (rpa_tpu.ragged_paged_attention_tpu, "tpu"), (rpa_gpu.ragged_paged_attention_gpu, "cuda")])
def test_quantized_kernel_lowers_for_hardware(kernel, platform, kv_quant):
    """bf16 queries over an 8-bit cache with f32 scales lower to Mosaic TPU / Triton IR (Triton
    has no integer fill value for fp8 loads: the kernel loads fp8 unfilled and zeros after the
    cast). The compiled TPU kernel needs ``block_size`` a multiple of 128 with a quantised cache
    (the real Mosaic compiler refuses the scale DMAs at other offsets, tests/test_aot.py): a
    smaller block is refused early, with a ValueError naming the limit."""
    q8 = jnp.dtype(jnp.int8 if kv_quant == "int8" else jnp.float8_e4m3fn)

    def lower(bs):
        q, k, v, *rest = _abstract_args(jnp.bfloat16, bs=bs)
        k, v = (jax.ShapeDtypeStruct(x.shape, q8) for x in (k, v))
        sc = jax.ShapeDtypeStruct((k.shape[0], k.shape[2], k.shape[1]), jnp.float32)
        fn = jax.jit(lambda *a: kernel(*a[:6], sm_scale=0.125, sliding_window=32, interpret=False,
                                       k_scale=a[6], v_scale=a[7]))
        return fn.trace(q, k, v, *rest, sc, sc).lower(lowering_platforms=(platform,)).as_text()

    if platform == "tpu":
        with pytest.raises(ValueError, match="multiple of 128"):
            lower(16)
    text = lower(128 if platform == "tpu" else 16)
    assert ("tpu_custom_call" if platform == "tpu" else "__gpu$xla.gpu.triton") in text


def test_validation_errors():
    case = build_case(Config(8, 1, 2, 64, num_tokens=8, num_seqs=1, max_kv=8), [1], [1],
                      stale_tables=False, seed=0)
    q, k, v, kv, bt, cu = case.jax_args()
    kw = dict(sm_scale=0.1)
    with pytest.raises(ValueError, match="implementation"):
        rpa.ragged_paged_attention(q, k, v, kv, bt, cu, **kw, implementation="cuda")
    for kernel in (rpa_tpu.ragged_paged_attention_tpu, rpa_gpu.ragged_paged_attention_gpu):
        with pytest.raises(ValueError, match="sliding_window"):
            kernel(q, k, v, kv, bt, cu, **kw, sliding_window=0)
        with pytest.raises(ValueError, match="soft_cap"):
            kernel(q, k, v, kv, bt, cu, **kw, soft_cap=-1.0)
        with pytest.raises(ValueError, match="head_dim"):
            kernel(q[..., :32], k, v, kv, bt, cu, **kw)
        with pytest.raises(ValueError, match="dtype"):
            kernel(q, k, v.astype(jnp.bfloat16), kv, bt, cu, **kw)
        with pytest.raises(ValueError, match="cu_q_lens"):
            kernel(q, k, v, kv, bt, cu[:1], **kw)
    with pytest.raises(ValueError, match="num_keys_per_block"):
        rpa_gpu.ragged_paged_attention_gpu(q, k, v, kv, bt, cu, **kw, num_keys_per_block=24)
    with pytest.raises(ValueError, match="num_queries_per_block"):
        rpa_tpu.ragged_paged_attention_tpu(q, k, v, kv, bt, cu, **kw, num_queries_per_block=0)
    with pytest.raises(ValueError, match="interpret"):
        rpa_tpu.ragged_paged_attention_tpu(q, k, v, kv, bt, cu, **kw, interpret="yes")


def test_tpu_block_size_heuristic():
    # Decode, GQA 8, bf16: 16-token tile = 128 MXU rows; 512 keys/step fits the 4 MiB budget.
    sizes = rpa_tpu.default_block_sizes(8, 64, 8, 128, 16, 64, jnp.bfloat16)
    assert sizes == rpa_tpu.BlockSizes(16, 32)
    # MHA f32 with many KV heads: step shrinks to the VMEM budget (4 * keys * 32 * 128 * 4 B).
    sizes = rpa_tpu.default_block_sizes(1024, 32, 32, 128, 16, 512, jnp.float32)
    assert sizes.num_queries_per_block == 128
    assert 4 * sizes.num_kv_pages_per_block * 16 * 32 * 128 * 4 <= 4 * 2**20
    # Never more pages than the table has, never less than one.
    assert rpa_tpu.default_block_sizes(3, 3, 1, 64, 32, 2, jnp.float32) == rpa_tpu.BlockSizes(8, 2)
    sizes = rpa_tpu.default_block_sizes(8, 8, 8, 256, 256, 4, jnp.float32)
    assert sizes.num_kv_pages_per_block == 1


def test_gpu_block_size_heuristic():
    # Decode, 8 sequences x 1 token, GQA 8: a 2-token tile (16 rows), split-K for parallelism.
    sizes = rpa_gpu.default_block_sizes(8, 8, 64, 8, 16, 32)
    assert sizes.num_queries_per_block * 8 == 16 and sizes.num_splits > 1
    # Long prefill: 64-row tiles, enough programs without splitting.
    sizes = rpa_gpu.default_block_sizes(8192, 4, 32, 8, 16, 256)
    assert sizes.num_queries_per_block * 4 == 64 and sizes.num_splits == 1
    # Splits never exceed what the maximum context can fill (2 key steps each).
    assert rpa_gpu.default_block_sizes(8, 8, 8, 8, 16, 4).num_splits == 1
