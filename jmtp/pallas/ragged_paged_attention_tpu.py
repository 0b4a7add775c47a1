"""Ragged paged attention as a Pallas TPU (Mosaic) kernel.

Same contract as :func:`jmtp.pallas.ragged_paged_attention.ragged_paged_attention_reference` (read
that module's docstring first): packed queries ``q f[T, Nq, D]`` of S sequences (prefill chunks and
(K+1)-token verify windows mixed), a paged cache ``f[num_blocks, block_size, W]`` (kv heads merged,
``W >= Nkv·D`` with padding lanes after the heads, :mod:`jmtp.pallas.kv_layout`), per-sequence
``kv_lens``, ``block_tables`` and ``cu_q_lens``. The new K/V must already be in the cache: this
kernel only *reads* the cache; :func:`jmtp.pallas.ragged_paged_attention.write_kv` stays the
companion op that scatters them (a fused write would need the cache donated and aliased through
the kernel and a per-page read-after-write ordering; XLA's scatter is already a single pass, so the
two-op form costs one extra launch and no extra HBM traffic on the attention side).

Algorithm (flash attention with online softmax, Dao et al. 2022, "FlashAttention", its tiling
section; the paged/ragged arrangement follows the public design notes of vLLM/tpu-inference's ragged
paged attention, written here from scratch):

* **Layout.** In the wrapper the queries are regrouped per KV head, ``q -> [Nkv, T_pad * G, D]``
  with row ``t * G + g`` holding query head ``h * G + g`` of token ``t`` (GQA: ``G = Nq / Nkv``);
  so one MXU matmul serves the whole query-head group of a KV head. The cache is read in the
  engine's merged layout ``[num_blocks, block_size, Nkv * D]`` (:func:`jmtp.model.llama.
  init_kv_cache`), so one DMA moves a whole page, all KV heads. (A split ``[.., Nkv, D]`` cache
  is accepted but reshaping it is a relayout copy of the whole pool on TPU, where the tiled
  layout covers the two minor axes: compiling for v5e showed 15 GiB of temporaries for a 3 GiB
  pool before the engine stored caches merged.)
* **Grid.** One grid step per *query tile* of ``tq`` packed tokens (``R = tq * G`` rows per KV
  head); tiles are independent (``"parallel"``). A tile may hold rows of several sequences: the
  sequences overlapping tile ``i`` are ``tile_seq_lo[i] .. tile_seq_hi[i]`` (computed in the
  wrapper, scalar-prefetched with ``kv_lens``, the flattened ``block_tables`` and ``cu_q_lens``).
* **KV stream.** For each such sequence the tile needs keys ``[k_lo, k_hi)``: ``k_hi`` is one past
  the last query position of its rows in the tile (causal), ``k_lo`` is ``0`` or, with a sliding
  window, the first position the first row may see. Those pages are streamed in *steps* of
  ``ppb`` pages. The (sequence, step) pairs of a tile form one flat loop, and step ``n + 1`` (of
  the same or the next sequence) is DMA'd into the other half of a double buffer while step ``n``
  is computed. Only pages inside ``[k_lo, k_hi)`` are ever DMA'd; table entries are additionally
  clamped to ``[0, num_blocks)``, so a ``-1`` entry can never become a DMA address.
* **Masking.** A score is kept iff its row belongs to the sequence, ``key <= query position``,
  the key lies in a page fetched in this step and below ``kv_len`` (and inside the window). Values
  of keys outside that range are zeroed before the ``p @ v`` matmul (``0 * NaN`` would poison the
  row otherwise), so stale or uninitialised buffer contents and NaN-poisoned blocks never reach the
  result.
* **Online softmax.** Running max ``m``, sum ``l`` and unnormalised accumulator ``acc`` live in
  VMEM scratch per KV head; rows with no key yet keep ``m = -1e30`` and a zero contribution.
  Output ``acc / l``; rows with ``l == 0`` (padding) are written as zeros.
* **Quantised caches** (int8 / float8_e4m3fn values with ``f32[num_blocks, Nkv, block_size]``
  scales, :mod:`jmtp.pallas.kv_quant`): each page's scales are DMA'd with its values, into
  ``f32[Nkv, bkv]`` buffers, so one KV head's scales are a lane row ``[1, bkv]``. The 8-bit
  values are converted to the q dtype (exact) and the scales applied to the columns of the
  ``[R, bkv]`` products: ``s = (q . k8) * k_scale * sm_scale`` and ``pv = (p * v_scale) @ v8``,
  which equal attention over the dequantised cache (the ``D``-wide tiles are never rescaled).
  Scales of keys outside the fetched range are zeroed like their values.

Block-size heuristic (:func:`default_block_sizes`, overridable per call):

* query tile ``tq``: ``~128 // G`` tokens rounded down to a power of two, so that ``R = tq * G``
  fills one 128-row MXU pass, at least one sublane tile (8 rows for 32-bit, 16 for 16-bit types)
  and at most ``T`` rounded up to that tile;
* KV step ``ppb`` pages: ``~512`` keys per step (amortises the ~0.35 µs per-step loop cost and
  keeps DMAs long) but the double-buffered K and V (``4 * ppb * block_size * Nkv * D`` elements)
  stay within 4 MiB of VMEM; at least 1, at most the table width.

Cost notes: decode tiles pack many sequences; each sequence's pages are streamed once per tile, and
the MXU works on all ``R`` rows although only that sequence's rows are unmasked (memory-bound
regime, so the extra MXU work is mostly hidden). Not tuned on hardware: see the module's tests for
what is verified (interpret mode on CPU, race detector, Mosaic lowering).

Known TPU constraints (checked by the Mosaic compiler, not here): ``block_size`` should be a
multiple of the sublane tile (8 for f32, 16 for bf16) so page DMAs land tile-aligned in VMEM;
``head_dim`` a multiple of 128 keeps the per-head lane slices aligned (others need lane shifts);
the whole flattened block table is scalar-prefetched into SMEM (``4 * S * pages`` bytes), so very
large tables would need per-tile table slices (not implemented).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jmtp.pallas.attention_checks import cache_dims, check_shapes, compute_dtype, merge_heads

_MASK = -1e30          # finite "minus infinity": exp(_MASK - m) == 0 and _MASK - _MASK == 0
_TARGET_ROWS = 128     # MXU rows per query tile
_TARGET_KEYS = 512     # keys per KV step
_KV_VMEM_BUDGET = 4 * 1024 * 1024   # bytes for 2 slots x (K, V) buffers
#: ``block_size`` of a quantised cache must be a multiple of this (TPU lanes) for the compiled
#: kernel: the scale DMAs land at lane offsets ``page * block_size`` (Mosaic refuses others,
#: found by compiling for v5e/v6e/v4 with :mod:`jmtp.aot`).
QUANTIZED_BLOCK_MULTIPLE = 128


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Static tiling of one kernel call.

    Attributes:
      num_queries_per_block: ``tq``, packed tokens per grid step (query tile).
      num_kv_pages_per_block: ``ppb``, cache pages per DMA step (double-buffered).
    """

    num_queries_per_block: int
    num_kv_pages_per_block: int


def _pow2_floor(x: int) -> int:
    return 1 << (max(1, x).bit_length() - 1)


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def default_block_sizes(
    num_tokens: int, num_q_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
    pages_per_seq: int, dtype: Any, row_width: int | None = None,
) -> BlockSizes:
    """The documented heuristic (module docstring) for ``tq`` and ``ppb``; all arguments static."""
    itemsize = jnp.dtype(dtype).itemsize
    sub = 8 if itemsize >= 4 else 16
    group = num_q_heads // num_kv_heads
    tq = max(sub, _pow2_floor(max(1, _TARGET_ROWS // group)))
    tq = min(tq, _round_up(max(num_tokens, 1), sub))
    bytes_per_key = 4 * (row_width or num_kv_heads * head_dim) * itemsize   # padded rows count
    keys = min(_TARGET_KEYS, max(block_size, _KV_VMEM_BUDGET // bytes_per_key))
    ppb = max(1, min(pages_per_seq, keys // block_size))
    return BlockSizes(tq, ppb)


def resolve_interpret(interpret: Any) -> Any:
    """``None`` -> TPU interpret mode iff the default backend is CPU; ``True`` -> default params.

    Returns ``False`` (compile with Mosaic) or a :class:`pltpu.InterpretParams`.
    """
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    if interpret is True:
        return pltpu.InterpretParams(out_of_bounds_reads="raise", uninitialized_memory="nan")
    if interpret is False or isinstance(interpret, pltpu.InterpretParams):
        return interpret
    raise ValueError(
        f"interpret must be None, a bool or pltpu.InterpretParams, got {type(interpret).__name__}")


def _kernel(
    # scalar prefetch (SMEM)
    kv_lens_ref,      # i32[S]
    tables_ref,       # i32[S * pages]
    cu_ref,           # i32[S + 1]
    seq_lo_ref,       # i32[num_tiles]  first sequence overlapping the tile
    seq_hi_ref,       # i32[num_tiles]  last one (inclusive; < seq_lo for an empty tile)
    # inputs
    q_ref,            # VMEM f[Nkv, R, D]
    k_hbm,            # ANY  f[num_blocks, block_size, Nkv * D]
    v_hbm,            # ANY  f[num_blocks, block_size, Nkv * D]
    *refs,            # quantized: ks_hbm, vs_hbm (ANY f32[num_blocks, Nkv, block_size]), then
                      # output o_ref (VMEM f[Nkv, R, D]), scratch k_buf, v_buf
                      # (VMEM f[2, ppb * block_size, Nkv * D]), quantized: ks_buf, vs_buf
                      # (VMEM f32[2, Nkv, ppb * block_size]); sems (DMA [2 or 4 (k/v/ks/vs),
                      # 2 (slot)]), acc_ref (VMEM f32[Nkv, R, D]), m_ref, l_ref (f32[Nkv, R, 1])
    tq: int, group: int, block_size: int, ppb: int, pages_per_seq: int, num_blocks: int,
    num_kv_heads: int, head_dim: int, sm_scale: float, sliding_window: int | None,
    soft_cap: float | None, precision: Any, quantized: bool,
):
    if quantized:
        ks_hbm, vs_hbm, o_ref, k_buf, v_buf, ks_buf, vs_buf, sems, acc_ref, m_ref, l_ref = refs
        copies = ((k_hbm, k_buf, False), (v_hbm, v_buf, False), (ks_hbm, ks_buf, True),
                  (vs_hbm, vs_buf, True))
    else:
        o_ref, k_buf, v_buf, sems, acc_ref, m_ref, l_ref = refs
        copies = ((k_hbm, k_buf, False), (v_hbm, v_buf, False))
    i = pl.program_id(0)
    rows = tq * group
    bkv = ppb * block_size
    tile_start = i * tq
    seq_lo = seq_lo_ref[i]
    seq_hi = seq_hi_ref[i]

    acc_ref[...] = jnp.zeros_like(acc_ref)
    m_ref[...] = jnp.full(m_ref.shape, _MASK, jnp.float32)
    l_ref[...] = jnp.zeros_like(l_ref)

    def seq_info(s):
        """Scalars of sequence s restricted to this tile's rows:
        (q_start, q_end, kv_len, page_lo, page_hi, num_steps)."""
        q_start = cu_ref[s]
        q_end = cu_ref[s + 1]
        kv_len = kv_lens_ref[s]
        lo = jnp.maximum(q_start, tile_start)
        hi = jnp.minimum(q_end, tile_start + tq)
        first_pos = kv_len - (q_end - q_start) + (lo - q_start)
        k_hi = jnp.clip(first_pos + (hi - lo), 0, kv_len)         # one past the last query
        if sliding_window is None:
            k_lo = jnp.int32(0)
        else:
            k_lo = jnp.clip(first_pos - sliding_window + 1, 0, k_hi)
        # All operands are >= 0: lax.div (truncation) == floor division, and lowers without the
        # sign fix-up of jnp's `//`.
        page_lo = lax.div(k_lo, block_size)
        page_hi = jnp.where(hi > lo, lax.div(k_hi + block_size - 1, block_size), page_lo)
        num_steps = jnp.maximum(lax.div(page_hi - page_lo + ppb - 1, ppb), 1)
        return q_start, q_end, kv_len, page_lo, page_hi, num_steps

    def step_pages(info, j):
        """First page and page count (0..ppb) of step j."""
        p0 = info[3] + j * ppb
        return p0, jnp.clip(info[4] - p0, 0, ppb)

    def page_dst(p):
        return pl.ds(pl.multiple_of(p * block_size, block_size), block_size)

    def dst(buf, slot, p, is_scale):
        """Where page p of a step lands: rows of a value buffer, columns of a scale buffer."""
        return buf.at[slot, :, page_dst(p)] if is_scale else buf.at[slot, page_dst(p)]

    def start_fetch(s, info, j, slot):
        p0, n = step_pages(info, j)

        def body(p, carry):
            col = jnp.minimum(p0 + p, pages_per_seq - 1)
            blk = jnp.clip(tables_ref[s * pages_per_seq + col], 0, num_blocks - 1)
            for kv, (src, buf, is_scale) in enumerate(copies):
                pltpu.make_async_copy(src.at[blk], dst(buf, slot, p, is_scale),
                                      sems.at[kv, slot]).start()
            return carry

        lax.fori_loop(0, n, body, 0)

    def wait_fetch(info, j, slot):
        _, n = step_pages(info, j)

        def body(p, carry):
            # A wait only needs the semaphore and the copy size: any source page will do.
            for kv, (src, buf, is_scale) in enumerate(copies):
                pltpu.make_async_copy(src.at[0], dst(buf, slot, p, is_scale),
                                      sems.at[kv, slot]).wait()
            return carry

        lax.fori_loop(0, n, body, 0)

    # Row r of a head block is token tile_start + r // group; computed in f32 (exact for the row
    # counts used here) to avoid a vector integer division.
    row_f = lax.broadcasted_iota(jnp.int32, (rows, 1), 0).astype(jnp.float32)
    row_tok = tile_start + ((row_f + 0.5) * (1.0 / group)).astype(jnp.int32)    # i32[R, 1]
    col = lax.broadcasted_iota(jnp.int32, (1, bkv), 1)                           # i32[1, bkv]
    col_v = lax.broadcasted_iota(jnp.int32, (bkv, 1), 0)                         # i32[bkv, 1]

    def fetched_scales(row, fetched_end):
        """Scales of keys past the fetched range are stale buffer contents (NaN in interpret
        mode): zero them so that ``0 * NaN`` cannot reach the accumulator."""
        return jnp.where(col < fetched_end, row, 0.0)

    def compute(info, j, slot):
        p0, n = step_pages(info, j)

        @pl.when(n > 0)
        def _():
            q_start, q_end, kv_len = info[:3]
            kv_base = p0 * block_size
            fetched_end = jnp.minimum(kv_len, (p0 + n) * block_size) - kv_base
            row_ok = (row_tok >= q_start) & (row_tok < q_end)                   # bool[R, 1]
            q_pos = kv_len - (q_end - q_start) + (row_tok - q_start) - kv_base  # i32[R, 1]
            mask = row_ok & (col < fetched_end) & (col <= q_pos)                 # bool[R, bkv]
            if sliding_window is not None:
                mask = mask & (col > q_pos - sliding_window)
            v_ok = col_v < fetched_end                                           # bool[bkv, 1]
            for h in range(num_kv_heads):
                hd = pl.ds(h * head_dim, head_dim)
                q = q_ref[h]                                                     # [R, D]
                k = k_buf[slot, :, hd]                                           # [bkv, D]
                v = v_buf[slot, :, hd]
                if k.dtype != q.dtype:     # narrower / 8-bit cache: compute in the q dtype
                    k, v = k.astype(q.dtype), v.astype(q.dtype)
                s_ = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision,
                                     preferred_element_type=jnp.float32) * sm_scale
                if quantized:              # dequantise: scale the key columns
                    s_ = s_ * ks_buf[slot, pl.ds(h, 1), :]                       # [1, bkv]
                if soft_cap is not None:
                    s_ = soft_cap * jnp.tanh(s_ / soft_cap)
                s_ = jnp.where(mask, s_, _MASK)
                m_prev = m_ref[h]
                m_new = jnp.maximum(m_prev, jnp.max(s_, axis=1, keepdims=True))
                p = jnp.where(mask, jnp.exp(s_ - m_new), 0.0)
                alpha = jnp.exp(m_prev - m_new)
                l_ref[h] = alpha * l_ref[h] + jnp.sum(p, axis=1, keepdims=True)
                m_ref[h] = m_new
                v = jnp.where(v_ok, v, jnp.zeros_like(v))
                if quantized:              # dequantise: scale the value columns of p
                    vs = fetched_scales(vs_buf[slot, pl.ds(h, 1), :], fetched_end)
                    p = p * vs
                pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                                     precision=precision, preferred_element_type=jnp.float32)
                acc_ref[h] = alpha * acc_ref[h] + pv

    @pl.when(seq_hi >= seq_lo)
    def _():
        info0 = seq_info(seq_lo)
        start_fetch(seq_lo, info0, 0, 0)

        def cond(carry):
            return carry[0] <= seq_hi

        def body(carry):
            # Flat loop over the (sequence, step) jobs of this tile; the next job's pages are
            # fetched into the other buffer slot while this one is computed.
            s, j, slot, *info = carry
            last = j + 1 >= info[5]
            ns = jnp.where(last, s + 1, s)
            nj = jnp.where(last, 0, j + 1)
            has_next = ns <= seq_hi
            ninfo = lax.cond(last & has_next, lambda: seq_info(ns), lambda: tuple(info))

            @pl.when(has_next)
            def _():
                start_fetch(ns, ninfo, nj, 1 - slot)

            wait_fetch(info, j, slot)
            compute(info, j, slot)
            return (ns, nj, 1 - slot, *ninfo)

        lax.while_loop(cond, body, (seq_lo, jnp.int32(0), jnp.int32(0), *info0))

    for h in range(num_kv_heads):
        l = l_ref[h]
        o_ref[h] = jnp.where(l > 0, acc_ref[h] / jnp.where(l > 0, l, 1.0), 0.0).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=(
    "sm_scale", "sliding_window", "soft_cap", "block_sizes", "interpret", "num_kv_heads"))
def _rpa_tpu(q, k_cache, v_cache, kv_lens, block_tables, cu_q_lens, k_scale, v_scale, *, sm_scale,
             sliding_window, soft_cap, block_sizes: BlockSizes, interpret, num_kv_heads):
    num_tokens, num_q_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = cache_dims(q, k_cache, num_kv_heads)
    num_seqs, pages = block_tables.shape
    group = num_q_heads // num_kv_heads
    tq, ppb = block_sizes.num_queries_per_block, block_sizes.num_kv_pages_per_block
    t_pad = _round_up(num_tokens, tq)
    num_tiles = t_pad // tq
    rows = tq * group

    kv_lens = kv_lens.astype(jnp.int32)
    cu = cu_q_lens.astype(jnp.int32)
    tables = block_tables.astype(jnp.int32).reshape(-1)
    total = jnp.minimum(cu[-1], num_tokens)
    starts = jnp.arange(num_tiles, dtype=jnp.int32) * tq
    lasts = jnp.minimum(starts + tq, total) - 1
    seq_lo = (jnp.searchsorted(cu, starts, side="right") - 1).astype(jnp.int32)
    seq_hi = (jnp.searchsorted(cu, lasts, side="right") - 1).astype(jnp.int32)
    seq_hi = jnp.where(starts < total, jnp.minimum(seq_hi, num_seqs - 1), seq_lo - 1)
    seq_lo = jnp.clip(seq_lo, 0, num_seqs - 1)

    qw = q.reshape(num_tokens, num_kv_heads, group, head_dim).transpose(1, 0, 2, 3)
    qw = jnp.pad(qw, ((0, 0), (0, t_pad - num_tokens), (0, 0), (0, 0)))
    # Mixed dtypes compute in the wider one (the reference computes everything in f32); 8-bit
    # caches in the q dtype.
    qw = qw.reshape(num_kv_heads, t_pad * group, head_dim).astype(
        compute_dtype(q.dtype, k_cache.dtype))
    kf, vf = merge_heads(k_cache), merge_heads(v_cache)   # merged already: no copy
    width = kf.shape[2]       # Nkv*D, or more with padding lanes after the heads (kv_layout)

    precision = (lax.Precision.HIGHEST if jnp.dtype(qw.dtype) == jnp.float32
                 else lax.Precision.DEFAULT)
    kernel = functools.partial(
        _kernel, tq=tq, group=group, block_size=block_size, ppb=ppb, pages_per_seq=pages,
        num_blocks=num_blocks, num_kv_heads=num_kv_heads, head_dim=head_dim,
        sm_scale=float(sm_scale), sliding_window=sliding_window,
        soft_cap=None if soft_cap is None else float(soft_cap), precision=precision,
        quantized=k_scale is not None)
    qo_spec = pl.BlockSpec((num_kv_heads, rows, head_dim), lambda i, *_: (0, i, 0))
    bkv = ppb * block_size
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    value_bufs = [pltpu.VMEM((2, bkv, width), k_cache.dtype),
                  pltpu.VMEM((2, bkv, width), v_cache.dtype)]
    inputs = [qw, kf, vf]
    if k_scale is not None:
        inputs += [k_scale, v_scale]
        value_bufs += [pltpu.VMEM((2, num_kv_heads, bkv), jnp.float32)] * 2
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=5,
            grid=(num_tiles,),
            in_specs=[qo_spec] + [any_spec] * (len(inputs) - 1),
            out_specs=qo_spec,
            scratch_shapes=value_bufs + [
                pltpu.SemaphoreType.DMA((len(value_bufs), 2)),
                pltpu.VMEM((num_kv_heads, rows, head_dim), jnp.float32),
                pltpu.VMEM((num_kv_heads, rows, 1), jnp.float32),
                pltpu.VMEM((num_kv_heads, rows, 1), jnp.float32),
            ]),
        out_shape=jax.ShapeDtypeStruct(qw.shape, q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        interpret=interpret,
        name="jmtp_ragged_paged_attention_tpu",
    )(kv_lens, tables, cu, seq_lo, seq_hi, *inputs)
    out = out.reshape(num_kv_heads, t_pad, group, head_dim)[:, :num_tokens]
    return out.transpose(1, 0, 2, 3).reshape(num_tokens, num_q_heads, head_dim)


def ragged_paged_attention_tpu(
    q: jax.Array,             # f[T, Nq, D]   packed queries (RoPE applied)
    k_cache: jax.Array,       # f[num_blocks, block_size, Nkv*D] (merged; split [.., Nkv, D] is
    v_cache: jax.Array,       #   reshaped, a relayout copy on TPU)
    kv_lens: jax.Array,       # i32[S]        keys per sequence, this step's tokens included
    block_tables: jax.Array,  # i32[S, pages] physical block ids (entries past kv_lens unused)
    cu_q_lens: jax.Array,     # i32[S+1]      exclusive prefix sums of query lengths
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    num_queries_per_block: int | None = None,
    num_kv_pages_per_block: int | None = None,
    interpret: Any = None,
    k_scale: jax.Array | None = None,   # f32[num_blocks, Nkv, block_size] (quantised cache only)
    v_scale: jax.Array | None = None,   # f32[num_blocks, Nkv, block_size]
    num_kv_heads: int | None = None,
) -> jax.Array:               # f[T, Nq, D]  (q.dtype)
    """Pallas-TPU ragged paged attention; contract of ``ragged_paged_attention_reference``.

    Args:
      sm_scale: multiplier of ``q . k`` (usually ``D ** -0.5``).
      sliding_window: keys at positions ``> pos - sliding_window`` only (``>= 1``), or None.
      soft_cap: logits ``soft_cap * tanh(s / soft_cap)`` (``> 0``), or None.
      num_queries_per_block / num_kv_pages_per_block: override :func:`default_block_sizes`.
      interpret: None (interpret iff the default backend is CPU), a bool, or a
        ``pltpu.InterpretParams`` (e.g. ``detect_races=True``) for TPU interpret mode.
      k_scale / v_scale: scales of an int8 / float8_e4m3fn cache (:mod:`jmtp.pallas.kv_quant`).
      num_kv_heads: Nkv of a merged cache with padding lanes (:mod:`jmtp.pallas.kv_layout`).

    Raises:
      ValueError: compiled (not interpreted) with a quantised cache whose ``block_size`` is not
        a multiple of :data:`QUANTIZED_BLOCK_MULTIPLE`.
      ValueError: inconsistent shapes or scales, ``k_cache.dtype != v_cache.dtype``, a
        non-positive ``sliding_window``/``soft_cap``/block size, or a bad ``interpret``.
    """
    check_shapes(q, k_cache, v_cache, kv_lens, block_tables, cu_q_lens, k_scale, v_scale,
                 num_kv_heads)
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache.dtype ({k_cache.dtype}) != v_cache.dtype ({v_cache.dtype})")
    if sliding_window is not None and int(sliding_window) < 1:
        raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
    if soft_cap is not None and not float(soft_cap) > 0:
        raise ValueError(f"soft_cap must be > 0 or None, got {soft_cap}")
    num_tokens, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = cache_dims(q, k_cache, num_kv_heads)
    interpret = resolve_interpret(interpret)
    if k_scale is not None and interpret is False and block_size % QUANTIZED_BLOCK_MULTIPLE:
        raise ValueError(
            f"a quantised cache needs block_size a multiple of {QUANTIZED_BLOCK_MULTIPLE} for the "
            f"compiled TPU kernel (got {block_size}): each page's scales land at lane offset "
            "page * block_size of the scale buffer, and Mosaic DMAs need lane-aligned offsets; "
            "use attention_backend='xla' (the engine falls back to it by itself)")
    sizes = default_block_sizes(num_tokens, num_q_heads, num_kv_heads, head_dim, block_size,
                                block_tables.shape[1], k_cache.dtype,
                                k_cache.shape[2] if k_cache.ndim == 3 else None)
    tq = sizes.num_queries_per_block if num_queries_per_block is None else num_queries_per_block
    ppb = sizes.num_kv_pages_per_block if num_kv_pages_per_block is None else num_kv_pages_per_block
    if tq < 1 or ppb < 1:
        raise ValueError(
            f"num_queries_per_block ({tq}) and num_kv_pages_per_block ({ppb}) must be >= 1")
    return _rpa_tpu(q, k_cache, v_cache, kv_lens, block_tables, cu_q_lens, k_scale, v_scale,
                    sm_scale=float(sm_scale),
                    sliding_window=None if sliding_window is None else int(sliding_window),
                    soft_cap=None if soft_cap is None else float(soft_cap),
                    block_sizes=BlockSizes(int(tq), int(ppb)),
                    interpret=interpret, num_kv_heads=num_kv_heads)
