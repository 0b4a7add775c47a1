"""Ragged paged attention as a Pallas GPU kernel (Triton backend), with split-K for decode.

Same contract as :func:`jmtp.pallas.ragged_paged_attention.ragged_paged_attention_reference`
(module docstring there). The cache is only read; new K/V are written beforehand by the companion
op :func:`jmtp.pallas.ragged_paged_attention.write_kv`.

**Why Triton and not Mosaic GPU.** JAX 0.10.x lowers ``pl.pallas_call`` to Mosaic GPU by default
and marks the Triton backend for deprecation (JAX 0.11). We still choose Triton
(``compiler_params=plgpu_triton.CompilerParams``) because:

* paged attention is a *gather*: each step reads ``bkv`` keys from scattered pages. Triton's
  masked pointer loads express that directly (one coalesced row of ``D`` elements per key); Mosaic
  GPU moves data with TMA/`copy_gmem_to_smem` tiles of fixed shape, i.e. one copy per page plus
  its barrier, and its WGMMA path is Hopper-only;
* the kernel must be testable on CPU. Pallas' generic interpreter (``interpret=True``) runs
  Triton-style kernels with any grid; the Mosaic GPU interpreter only supports a single block in
  the grid (see ``SharedInterpretParams`` in ``jax/_src/pallas/mosaic/interpret/params.py``);
* ``pl.pallas_call`` for Mosaic GPU is itself deprecated in favour of ``plgpu.kernel``.

A Mosaic GPU port is the follow-up once Triton is removed from JAX; the contract and the test base
stay.

Algorithm (FlashAttention online softmax, Dao et al. 2022, its tiling section; split-K "flash
decoding", Dao et al. 2023 blog "Flash-Decoding for long-context inference"; written from scratch):

* **Sequence-aligned query tiles.** The wrapper cuts every sequence's query rows into tiles of
  ``tq`` tokens (``sum_s ceil(q_len_s / tq) <= ceil(T / tq) + S`` tiles, a static bound, so the
  grid is static). A tile never mixes sequences, so its causal key range is tight and a decode
  window of 1..K+1 queries is one tile (the heuristic below sizes ``tq`` to the mean query
  length).
* **GQA.** Queries are regrouped per KV head as ``[Nkv, rows, D]`` with the group padded to a
  power of two ``Gp`` (Triton block shapes are powers of two); row ``t * Gp + g`` is query head
  ``h * G + g`` of token ``t``. One program handles ``R = tq * Gp`` rows of one KV head, so each
  key is loaded once for the whole head group.
* **Grid** ``(tile, kv_head, split)``. The tile's key range ``[k_lo, k_hi)`` (causal end, sliding
  window start) is cut into ``bkv``-key steps and the steps into ``splits`` contiguous chunks;
  program ``(w, h, sp)`` runs an online softmax over chunk ``sp``. Each key step gathers the
  block ids of its keys from the block table, then the keys/values with masked loads: keys outside
  ``[k_lo, k_hi)`` (hence past ``kv_len`` or in unused pages) are never loaded (``other=0``) and
  their scores are masked, so NaN-poisoned or recycled blocks cannot reach the result. Table
  entries are clamped to ``[0, num_blocks)`` before they become addresses.
* **Combine.** With ``splits == 1`` the kernel writes the normalised output. Otherwise it writes
  per-split ``acc`` (unnormalised), running max ``m`` and sum ``l`` in f32 and the wrapper
  combines them: ``m* = max m_i``, ``out = sum exp(m_i - m*) acc_i / sum exp(m_i - m*) l_i``.

Quantised caches (int8 / float8_e4m3fn values, ``f32[num_blocks, Nkv, block_size]`` scales,
:mod:`jmtp.pallas.kv_quant`): each key step also gathers the ``bkv`` scales of its keys for the
program's KV head (masked like the values), converts the 8-bit values to the q dtype (exact) and
applies the scales to the columns of the ``[R, bkv]`` products: ``s = (q . k8) * k_scale *
sm_scale`` and ``acc += (p * v_scale) @ v8``, which equal attention over the dequantised cache.

Heuristic (:func:`default_block_sizes`): ``tq`` is the next power of two of the mean query length
``ceil(T / S)``, so that ``R = tq * Gp`` lies in [16, 64] (16 = smallest ``tl.dot`` M, 64 = one
warp group's worth for prefill); ``bkv = 64`` keys per step (pages need not divide it); ``splits``
targets ~256 programs (two waves on a 132-SM H100/H200) and keeps at least two key steps per
split at the maximum context ``pages * block_size``; at most 16. None of this is tuned on hardware.

Any ``head_dim``: it is padded to ``Dp = max(16, next_pow2(D))`` (Triton block shapes are powers
of two) with zero queries and masked key/value column loads, so the padding costs no memory traffic.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from jmtp.pallas.attention_checks import check_shapes, compute_dtype

_MASK = -1e30
_TARGET_PROGRAMS = 256
_MAX_SPLITS = 16


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Static tiling of one kernel call.

    Attributes:
      num_queries_per_block: ``tq`` tokens per query tile (power of two).
      num_keys_per_block: ``bkv`` keys per step (power of two >= 16).
      num_splits: KV splits per tile (split-K); 1 = no combine step.
    """

    num_queries_per_block: int
    num_keys_per_block: int
    num_splits: int


def _next_pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def default_block_sizes(
    num_tokens: int, num_seqs: int, num_q_heads: int, num_kv_heads: int, block_size: int,
    pages_per_seq: int,
) -> BlockSizes:
    """The documented heuristic (module docstring); all arguments static."""
    gp = _next_pow2(num_q_heads // num_kv_heads)
    mean_q = _cdiv(max(num_tokens, 1), max(num_seqs, 1))
    tq = min(max(_next_pow2(mean_q), max(1, 16 // gp)), max(1, 64 // gp))
    bkv = 64
    tiles = max(_cdiv(num_tokens, tq), min(num_seqs, num_tokens))   # expected non-empty tiles
    max_splits = max(1, _cdiv(pages_per_seq * block_size, 2 * bkv))
    splits = max(1, min(_cdiv(_TARGET_PROGRAMS, max(1, tiles * num_kv_heads)), max_splits,
                        _MAX_SPLITS))
    return BlockSizes(tq, bkv, splits)


def _kernel(
    tile_seq_ref,     # i32[W]   sequence of each query tile
    tile_q0_ref,      # i32[W]   first packed token of the tile
    tile_nq_ref,      # i32[W]   tokens in the tile (0 = no work)
    kv_lens_ref,      # i32[S]
    tables_ref,       # i32[S * pages]
    cu_ref,           # i32[S + 1]
    q_ref,            # f[Nkv, (T + tq) * Gp, Dp]  (Dp = head_dim padded to a power of 2)
    k_ref,            # f[num_blocks * block_size, Nkv * D]
    v_ref,            # f[num_blocks * block_size, Nkv * D]
    *refs,            # quantized: ks, vs f32[num_blocks * Nkv * block_size]; then the outputs:
                      #   splits == 1: o f[Nkv, rows, Dp]; else acc f32[splits, Nkv, rows, Dp],
                      #   m f32[splits, Nkv, rows], l f32[splits, Nkv, rows]
    tq: int, group: int, gp: int, bkv: int, splits: int, block_size: int, pages_per_seq: int,
    num_blocks: int, num_kv_heads: int, head_dim: int, dp: int, sm_scale: float,
    sliding_window: int | None, soft_cap: float | None, precision: Any, quantized: bool,
):
    if quantized:
        ks_ref, vs_ref, *out_refs = refs
    else:
        out_refs = refs
    w, h, sp = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    rows = tq * gp
    nq = tile_nq_ref[w]

    @pl.when(nq > 0)
    def _():
        s = tile_seq_ref[w]
        q0 = tile_q0_ref[w]
        q_start = cu_ref[s]
        q_len = cu_ref[s + 1] - q_start
        kv_len = kv_lens_ref[s]

        r = jnp.arange(rows, dtype=jnp.int32)
        tok = lax.div(r, gp)                                           # token within the tile
        row_ok = (tok < nq) & (lax.rem(r, gp) < group)                 # bool[R]
        q_pos = kv_len - q_len + (q0 - q_start) + tok                  # i32[R]
        first_pos = kv_len - q_len + (q0 - q_start)
        k_hi = jnp.clip(first_pos + nq, 0, kv_len)
        if sliding_window is None:
            k_lo = jnp.int32(0)
        else:
            k_lo = jnp.clip(first_pos - sliding_window + 1, 0, k_hi)
        # Operands below are >= 0, so truncating lax.div/rem equal floor division.
        start = lax.div(k_lo, bkv) * bkv
        n_steps = lax.div(k_hi - start + bkv - 1, bkv)
        per_split = lax.div(n_steps + splits - 1, splits)
        step_lo = jnp.minimum(sp * per_split, n_steps)
        step_hi = jnp.minimum(step_lo + per_split, n_steps)

        rows_sl = pl.ds(q0 * gp, rows)
        q = pltr.load(q_ref.at[h, rows_sl, :], mask=row_ok[:, None], other=0)   # [R, Dp]
        d_idx = jnp.arange(dp, dtype=jnp.int32)                                 # i32[Dp]
        d_ok = d_idx < head_dim                            # head_dim padded to a power of two
        cols = h * head_dim + jnp.minimum(d_idx, head_dim - 1)

        def body(step, carry):
            acc, m, l = carry
            pos = start + step * bkv + jnp.arange(bkv, dtype=jnp.int32)            # i32[bkv]
            key_ok = (pos >= k_lo) & (pos < k_hi)
            page = jnp.minimum(lax.div(pos, block_size), pages_per_seq - 1)
            blk = pltr.load(tables_ref.at[s * pages_per_seq + page], mask=key_ok, other=0)
            blk = jnp.clip(blk, 0, num_blocks - 1)
            slot = blk * block_size + lax.rem(pos, block_size)
            kv_idx = (slot[:, None], cols[None, :])
            ld_ok = key_ok[:, None] & d_ok[None, :]
            if k_ref.dtype == jnp.float8_e4m3fn:
                # Triton lowers no integer fill value to fp8: load masked, zero after the cast.
                k = pltr.load(k_ref.at[kv_idx], mask=ld_ok).astype(q.dtype)         # [bkv, Dp]
                v = pltr.load(v_ref.at[kv_idx], mask=ld_ok).astype(q.dtype)
                k, v = (jnp.where(ld_ok, x, jnp.zeros_like(x)) for x in (k, v))
            else:
                k = pltr.load(k_ref.at[kv_idx], mask=ld_ok, other=0)                # [bkv, Dp]
                v = pltr.load(v_ref.at[kv_idx], mask=ld_ok, other=0)
            if k.dtype != q.dtype:         # narrower / 8-bit cache: compute in the q dtype
                k, v = k.astype(q.dtype), v.astype(q.dtype)
            sc = pltr.dot(q, k, trans_b=True, precision=precision) * sm_scale        # [R, bkv]
            if quantized:                  # this head's scales of the step's keys
                s_idx = (blk * num_kv_heads + h) * block_size + lax.rem(pos, block_size)
                k_sc = pltr.load(ks_ref.at[s_idx], mask=key_ok, other=0)             # f32[bkv]
                v_sc = pltr.load(vs_ref.at[s_idx], mask=key_ok, other=0)
                sc = sc * k_sc[None, :]
            if soft_cap is not None:
                sc = soft_cap * jnp.tanh(sc / soft_cap)
            mask = row_ok[:, None] & key_ok[None, :] & (pos[None, :] <= q_pos[:, None])
            if sliding_window is not None:
                mask = mask & (pos[None, :] > q_pos[:, None] - sliding_window)
            sc = jnp.where(mask, sc, _MASK)
            m_new = jnp.maximum(m, jnp.max(sc, axis=1))
            p = jnp.where(mask, jnp.exp(sc - m_new[:, None]), 0.0)
            alpha = jnp.exp(m - m_new)
            l = alpha * l + jnp.sum(p, axis=1)
            if quantized:
                p = p * v_sc[None, :]
            acc = alpha[:, None] * acc + pltr.dot(p.astype(v.dtype), v, precision=precision)
            return acc, m_new, l

        init = (jnp.zeros((rows, dp), jnp.float32), jnp.full((rows,), _MASK, jnp.float32),
                jnp.zeros((rows,), jnp.float32))
        acc, m, l = lax.fori_loop(step_lo, step_hi, body, init)

        if splits == 1:
            (o_ref,) = out_refs
            out = jnp.where(l[:, None] > 0, acc / jnp.where(l > 0, l, 1.0)[:, None], 0.0)
            pltr.store(o_ref.at[h, rows_sl, :], out.astype(o_ref.dtype), mask=row_ok[:, None])
        else:
            acc_ref, m_ref, l_ref = out_refs
            pltr.store(acc_ref.at[sp, h, rows_sl, :], acc, mask=row_ok[:, None])
            pltr.store(m_ref.at[sp, h, rows_sl], m, mask=row_ok)
            pltr.store(l_ref.at[sp, h, rows_sl], l, mask=row_ok)


@functools.partial(jax.jit, static_argnames=(
    "sm_scale", "sliding_window", "soft_cap", "block_sizes", "interpret", "num_warps",
    "num_stages"))
def _rpa_gpu(q, k_cache, v_cache, kv_lens, block_tables, cu_q_lens, k_scale, v_scale, *, sm_scale,
             sliding_window, soft_cap, block_sizes: BlockSizes, interpret: bool, num_warps: int,
             num_stages: int):
    num_tokens, num_q_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs, pages = block_tables.shape
    group = num_q_heads // num_kv_heads
    gp = _next_pow2(group)
    dp = max(16, _next_pow2(head_dim))
    tq, bkv, splits = (block_sizes.num_queries_per_block, block_sizes.num_keys_per_block,
                       block_sizes.num_splits)
    num_work = _cdiv(num_tokens, tq) + num_seqs        # static bound on sequence-aligned tiles
    t_rows = num_tokens + tq                           # padded so tile slices stay in bounds
    rows = t_rows * gp

    kv_lens = kv_lens.astype(jnp.int32)
    cu = jnp.minimum(cu_q_lens.astype(jnp.int32), num_tokens)
    tables = block_tables.astype(jnp.int32).reshape(-1)
    q_lens = jnp.maximum(cu[1:] - cu[:-1], 0)
    tiles_per_seq = (q_lens + tq - 1) // tq
    cu_tiles = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(tiles_per_seq)])
    wi = jnp.arange(num_work, dtype=jnp.int32)
    tile_seq = jnp.clip(jnp.searchsorted(cu_tiles, wi, side="right") - 1, 0, num_seqs - 1)
    tile_seq = tile_seq.astype(jnp.int32)
    tile_q0 = cu[tile_seq] + (wi - cu_tiles[tile_seq]) * tq
    tile_nq = jnp.where(wi < cu_tiles[-1], jnp.clip(cu[tile_seq + 1] - tile_q0, 0, tq), 0)

    qw = q.reshape(num_tokens, num_kv_heads, group, head_dim).transpose(1, 0, 2, 3)
    qw = jnp.pad(qw, ((0, 0), (0, t_rows - num_tokens), (0, gp - group), (0, dp - head_dim)))
    # Mixed dtypes compute in the wider one (the reference computes everything in f32); 8-bit
    # caches in the q dtype.
    qw = qw.reshape(num_kv_heads, rows, dp).astype(compute_dtype(q.dtype, k_cache.dtype))
    kf = k_cache.reshape(num_blocks * block_size, num_kv_heads * head_dim)
    vf = v_cache.reshape(num_blocks * block_size, num_kv_heads * head_dim)

    precision = (lax.Precision.HIGHEST if jnp.dtype(qw.dtype) == jnp.float32
                 else lax.Precision.DEFAULT)
    kernel = functools.partial(
        _kernel, tq=tq, group=group, gp=gp, bkv=bkv, splits=splits, block_size=block_size,
        pages_per_seq=pages, num_blocks=num_blocks, num_kv_heads=num_kv_heads, head_dim=head_dim,
        dp=dp, sm_scale=float(sm_scale), sliding_window=sliding_window, soft_cap=soft_cap,
        precision=precision, quantized=k_scale is not None)
    scales = () if k_scale is None else (k_scale.reshape(-1), v_scale.reshape(-1))
    if splits == 1:
        out_shape = [jax.ShapeDtypeStruct((num_kv_heads, rows, dp), q.dtype)]
    else:
        out_shape = [jax.ShapeDtypeStruct((splits, num_kv_heads, rows, dp), jnp.float32),
                     jax.ShapeDtypeStruct((splits, num_kv_heads, rows), jnp.float32),
                     jax.ShapeDtypeStruct((splits, num_kv_heads, rows), jnp.float32)]
    outs = pl.pallas_call(
        kernel,
        grid=(num_work, num_kv_heads, splits),
        out_shape=out_shape,
        compiler_params=pltr.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="jmtp_ragged_paged_attention_gpu",
    )(tile_seq, tile_q0, tile_nq, kv_lens, tables, cu, qw, kf, vf, *scales)

    if splits == 1:
        out = outs[0]
    else:
        acc, m, l = outs
        m_max = jnp.max(m, axis=0)
        wts = jnp.exp(m - m_max[None])
        l_sum = jnp.sum(wts * l, axis=0)
        acc_sum = jnp.sum(wts[..., None] * acc, axis=0)
        out = jnp.where(l_sum[..., None] > 0,
                        acc_sum / jnp.where(l_sum > 0, l_sum, 1.0)[..., None], 0.0)
    out = out.reshape(num_kv_heads, t_rows, gp, dp)[:, :num_tokens, :group, :head_dim]
    out = out.transpose(1, 0, 2, 3).reshape(num_tokens, num_q_heads, head_dim)
    # Rows of no sequence (padding) were never written by the kernel.
    valid = jnp.arange(num_tokens) < cu[-1]
    return jnp.where(valid[:, None, None], out, 0).astype(q.dtype)


def ragged_paged_attention_gpu(
    q: jax.Array,             # f[T, Nq, D]   packed queries (RoPE applied)
    k_cache: jax.Array,       # f[num_blocks, block_size, Nkv, D]
    v_cache: jax.Array,       # f[num_blocks, block_size, Nkv, D]
    kv_lens: jax.Array,       # i32[S]        keys per sequence, this step's tokens included
    block_tables: jax.Array,  # i32[S, pages] physical block ids (entries past kv_lens unused)
    cu_q_lens: jax.Array,     # i32[S+1]      exclusive prefix sums of query lengths
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    num_queries_per_block: int | None = None,
    num_keys_per_block: int | None = None,
    num_splits: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
    interpret: bool | None = None,
    k_scale: jax.Array | None = None,   # f32[num_blocks, Nkv, block_size] (quantised cache only)
    v_scale: jax.Array | None = None,   # f32[num_blocks, Nkv, block_size]
) -> jax.Array:               # f[T, Nq, D]  (q.dtype)
    """Pallas-GPU (Triton) ragged paged attention; contract of ``ragged_paged_attention_reference``.

    Args:
      sm_scale: multiplier of ``q . k`` (usually ``D ** -0.5``).
      sliding_window: keys at positions ``> pos - sliding_window`` only (``>= 1``), or None.
      soft_cap: logits ``soft_cap * tanh(s / soft_cap)`` (``> 0``), or None.
      num_queries_per_block / num_keys_per_block / num_splits: override
        :func:`default_block_sizes` (powers of two; ``tq * next_pow2(G) >= 16``, ``bkv >= 16``).
      num_warps / num_stages: Triton launch parameters.
      interpret: None = interpret iff the default backend is CPU.
      k_scale / v_scale: scales of an int8 / float8_e4m3fn cache (:mod:`jmtp.pallas.kv_quant`).

    Raises:
      ValueError: inconsistent shapes or scales, ``k_cache.dtype != v_cache.dtype``, bad block
        sizes, non-positive ``sliding_window``/``soft_cap``.
    """
    check_shapes(q, k_cache, v_cache, kv_lens, block_tables, cu_q_lens, k_scale, v_scale)
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache.dtype ({k_cache.dtype}) != v_cache.dtype ({v_cache.dtype})")
    num_tokens, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs, pages = block_tables.shape
    if sliding_window is not None and int(sliding_window) < 1:
        raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
    if soft_cap is not None and not float(soft_cap) > 0:
        raise ValueError(f"soft_cap must be > 0 or None, got {soft_cap}")
    d = default_block_sizes(num_tokens, num_seqs, num_q_heads, num_kv_heads, block_size, pages)
    tq = d.num_queries_per_block if num_queries_per_block is None else int(num_queries_per_block)
    bkv = d.num_keys_per_block if num_keys_per_block is None else int(num_keys_per_block)
    splits = d.num_splits if num_splits is None else int(num_splits)
    gp = _next_pow2(num_q_heads // num_kv_heads)
    if tq < 1 or tq & (tq - 1) or tq * gp < 16:
        raise ValueError(f"num_queries_per_block must be a power of two with "
                         f"num_queries_per_block * {gp} >= 16, got {tq}")
    if bkv < 16 or bkv & (bkv - 1):
        raise ValueError(f"num_keys_per_block must be a power of two >= 16, got {bkv}")
    if splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {splits}")
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    return _rpa_gpu(q, k_cache, v_cache, kv_lens, block_tables, cu_q_lens, k_scale, v_scale,
                    sm_scale=float(sm_scale),
                    sliding_window=None if sliding_window is None else int(sliding_window),
                    soft_cap=None if soft_cap is None else float(soft_cap),
                    block_sizes=BlockSizes(tq, bkv, splits), interpret=bool(interpret),
                    num_warps=int(num_warps), num_stages=int(num_stages))
