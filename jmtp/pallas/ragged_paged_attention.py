"""Ragged paged attention: the one attention entry point of jmtp.

A *ragged batch* packs the query tokens of S sequences one after another into ``T`` rows (``T`` is a
static bucket; rows past the last sequence are padding). Each sequence keeps its keys and values in a
*paged KV cache*: fixed-size blocks of ``block_size`` positions, addressed through its row of the
*block table*. Prefill chunks and speculative verify windows ``[last token, d1..dk]`` mix freely in one
batch: for attention they are both "q_len new tokens at the end of a sequence of kv_len tokens".

Semantics (defined by :func:`ragged_paged_attention_reference`):

* sequence ``s`` owns query rows ``cu_q_lens[s] : cu_q_lens[s+1]``; ``q_len[s]`` is their count;
* ``kv_lens[s]`` counts the keys of sequence ``s`` *including* this step's new tokens (they must
  already be written, see :func:`write_kv`);
* query ``j`` of sequence ``s`` sits at position ``kv_lens[s] - q_len[s] + j`` and attends to key
  positions ``p <= `` its own (causal), optionally only ``p > pos - sliding_window``;
* key position ``p`` of sequence ``s`` lives in block ``block_tables[s, p // block_size]`` at offset
  ``p % block_size``; blocks past ``kv_lens[s]`` are never read (their contents may be anything,
  NaN included);
* padding rows (``>= cu_q_lens[S]``) get zeros.

Other implementations of the same contract behind ``implementation=``:
:func:`ragged_paged_attention_xla` (``"xla"``: plain jnp like the reference, but each query row
gathers only its own sequence's pages, and only the chunks of them its keys lie in, so its cost is
O(T · keys in use) instead of the reference's O(T · S · pages·block_size); the CPU default), and the Pallas kernels
:mod:`jmtp.pallas.ragged_paged_attention_tpu` (Mosaic TPU) and
:mod:`jmtp.pallas.ragged_paged_attention_gpu` (Triton); they only read the cache, :func:`write_kv`
stays the companion op that writes this step's keys and values.

**Quantised caches** (``kv_cache_dtype`` ``"int8"`` / ``"fp8_e4m3"``, :mod:`jmtp.pallas.kv_quant`):
``k_cache``/``v_cache`` hold 8-bit values and ``k_scale``/``v_scale`` ``f32[num_blocks, Nkv,
block_size]`` one scale per slot and KV head (FastDeploy's ``block_wise_fp8`` layout); key ``p``
of head ``h`` is ``k_cache[b, o, h] * k_scale[b, h, o]`` with ``b, o`` its block and offset. Every
implementation dequantises on read (the reference and the XLA path before the matmuls, the
kernels by scaling the score / probability columns, which is the same product); the companion
write is :func:`jmtp.pallas.kv_quant.write_kv_quantized`. Scales of positions no sequence owns
may be anything (NaN included), like the values.
"""
from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jmtp.core import mesh
from jmtp.core.platform import host_platform, kernel_interpret, platform_name
from jmtp.pallas.attention_checks import cache_dims, check_shapes, merge_heads, split_heads
from jmtp.pallas.kv_layout import cache_rows
from jmtp.pallas.kv_quant import gather_scales

IMPLEMENTATIONS = ("reference", "xla", "pallas_tpu", "pallas_gpu")


def token_seq_ids(cu_q_lens: jax.Array, num_tokens: int) -> jax.Array:
    """Sequence id of every packed row: ``i32[T]``; padding rows get ``S`` (one past the last)."""
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    # compare_all: one fused [T, S+1] comparison; the default binary search is a while loop of
    # tiny kernels, which XLA:CPU ran in every layer of every step.
    return (jnp.searchsorted(cu_q_lens, t, side="right", method="compare_all") - 1).astype(
        jnp.int32).clip(
        0, cu_q_lens.shape[0] - 1)


def ragged_paged_attention_reference(
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
    k_scale: jax.Array | None = None,   # f32[num_blocks, Nkv, block_size] (quantised cache only)
    v_scale: jax.Array | None = None,   # f32[num_blocks, Nkv, block_size]
) -> jax.Array:               # f[T, Nq, D]
    """Plain-jnp ragged paged attention: gathers each sequence's pages and runs masked softmax.

    Cost is O(T · S · pages·block_size) — the meaning of the op, not a fast path. A quantised
    cache is dequantised (``value * scale`` in f32) right after the gather.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs, pages = block_tables.shape
    group = num_q_heads // num_kv_heads
    max_kv = pages * block_size

    seq = token_seq_ids(cu_q_lens, num_tokens)                          # i32[T]
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]                              # i32[S]
    valid_tok = jnp.arange(num_tokens) < cu_q_lens[-1]                   # bool[T]
    q_pos = kv_lens[seq] - q_lens[seq] + (jnp.arange(num_tokens) - cu_q_lens[seq])  # i32[T]

    # Gather every sequence's pages, zeroing unused positions (their contents may be NaN).
    tables = jnp.clip(block_tables, 0, num_blocks - 1)
    kv_pos = jnp.arange(max_kv, dtype=jnp.int32)                         # i32[Lk]
    kv_valid = kv_pos[None, :] < kv_lens[:, None]                        # bool[S, Lk]
    k = k_cache[tables].reshape(num_seqs, max_kv, num_kv_heads, head_dim).astype(jnp.float32)
    v = v_cache[tables].reshape(num_seqs, max_kv, num_kv_heads, head_dim).astype(jnp.float32)
    if k_scale is not None:
        k = k * gather_scales(k_scale, tables).reshape(num_seqs, max_kv, num_kv_heads)[..., None]
        v = v * gather_scales(v_scale, tables).reshape(num_seqs, max_kv, num_kv_heads)[..., None]
    k = jnp.where(kv_valid[..., None, None], k, 0)
    v = jnp.where(kv_valid[..., None, None], v, 0)

    qf = q.astype(jnp.float32).reshape(num_tokens, num_kv_heads, group, head_dim)
    scores = jnp.einsum("tkgd,sjkd->tkgsj", qf, k) * sm_scale            # f[T, Nkv, G, S, Lk]
    if soft_cap is not None:
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    mask = (seq[:, None, None] == jnp.arange(num_seqs)[None, :, None])   # bool[T, S, 1]
    mask = mask & kv_valid[None] & (kv_pos[None, None, :] <= q_pos[:, None, None])
    if sliding_window is not None:
        mask = mask & (kv_pos[None, None, :] > q_pos[:, None, None] - sliding_window)
    mask = mask & valid_tok[:, None, None]
    mask = mask[:, None, None]                                           # bool[T, 1, 1, S, Lk]
    scores = jnp.where(mask, scores, -jnp.inf)
    m = jnp.max(scores, axis=(-2, -1), keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.where(mask, jnp.exp(scores - m), 0.0)
    denom = jnp.sum(p, axis=(-2, -1), keepdims=True)
    p = p / jnp.where(denom > 0, denom, 1.0)
    out = jnp.einsum("tkgsj,sjkd->tkgd", p, v)
    return out.reshape(num_tokens, num_q_heads, head_dim).astype(q.dtype)


def ragged_paged_attention_xla(
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
    q_tile: int = 32,
    kv_chunk: int = 256,
    rows_per_seq: int | None = None,
    k_scale: jax.Array | None = None,   # f32[num_blocks, Nkv, block_size] (quantised cache only)
    v_scale: jax.Array | None = None,   # f32[num_blocks, Nkv, block_size]
    fixed_chunks: bool = False,
) -> jax.Array:               # f[T, Nq, D]
    """Plain-XLA ragged paged attention for backends without a kernel (the CPU default).

    Same contract as :func:`ragged_paged_attention_reference`, different schedule:

    * the query rows are processed ``q_tile`` at a time (``lax.map``). A tile whose rows all belong
      to one sequence (prefill chunks) gathers that sequence's pages once; a mixed tile (decode rows
      of several sequences) lets each row gather its own sequence's pages. (One gather per tile
      instead of per row made a 582-token batch-1 prefill on a 2-core CPU take 5.9 s instead of
      22 s.)
    * the keys are visited ``kv_chunk`` positions (rounded down to whole pages, at least one) at a
      time with an online softmax (FlashAttention's running max and sum, Dao et al. 2022), in a
      loop whose bounds are *data*: a tile visits only the chunks holding keys some of its rows
      see (``[lo, hi)`` from ``kv_lens``, the causal position and the sliding window). The cost
      therefore follows the context actually in use, not the block table's width
      (``max_model_len``), and nothing recompiles when contexts grow.

    * with ``rows_per_seq = R`` (a static hint: most sequences have at most R query rows, e.g.
      the K+1 rows of speculative verify windows) the rows are visited *sequence by sequence*
      instead, R at a time (a loop of ``ceil(q_len / R)`` tiles per sequence, so any q_len is
      still right): each sequence's pages are gathered once per R rows, and its rows multiply
      them as one small matrix, where the mixed tiles above gather the pages once per row.

    * with ``fixed_chunks`` (batch-invariant mode, :mod:`jmtp.model.invariant`) a chunk is
      ``kv_chunk`` positions whatever the block table's width, and the chunks are always visited
      in the loop: a key's place in its chunk, the chunk's length and the code that reduces it
      are the same in every engine shape (a table narrower than a chunk would otherwise shorten
      it, and the sums over it would associate differently).

    Cost O(T · used keys · Nq · D); scratch O(q_tile · kv_chunk · Nkv · D), independent of the
    number of sequences S and of ``max_model_len``. A quantised cache's pages are dequantised right
    after their gather.

    Raises:
      ValueError: ``q_tile``, ``kv_chunk`` or ``rows_per_seq`` below 1.
    """
    if q_tile < 1 or kv_chunk < 1 or (rows_per_seq is not None and rows_per_seq < 1):
        raise ValueError(f"q_tile, kv_chunk and rows_per_seq must be >= 1, got {q_tile}, "
                         f"{kv_chunk} and {rows_per_seq}")
    num_tokens, num_q_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs, pages = block_tables.shape
    group = num_q_heads // num_kv_heads
    tile = max(1, min(q_tile, num_tokens))
    n_tiles = -(-num_tokens // tile)
    padded = n_tiles * tile
    chunk_pages = max(1, kv_chunk // block_size if fixed_chunks else
                      min(pages, kv_chunk // block_size))
    chunk = chunk_pages * block_size                                     # keys per loop step
    n_chunks = -(-pages // chunk_pages)
    tables_all = jnp.clip(block_tables, 0, num_blocks - 1)
    tables_all = jnp.pad(tables_all, ((0, 0), (0, n_chunks * chunk_pages - pages)))

    t = jnp.arange(padded, dtype=jnp.int32)
    seq = jnp.minimum(token_seq_ids(cu_q_lens, padded), num_seqs - 1)   # padding rows: masked
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
    valid_tok = t < cu_q_lens[-1]
    q_pos = kv_lens[seq] - q_lens[seq] + (t - cu_q_lens[seq])             # i32[T']
    hi = jnp.where(valid_tok, jnp.minimum(q_pos + 1, kv_lens[seq]), 0)   # keys [lo, hi) visible
    lo = jnp.zeros_like(hi) if sliding_window is None else jnp.maximum(q_pos - sliding_window + 1, 0)
    lo = jnp.minimum(lo, hi)
    qf = jnp.pad(q, ((0, padded - num_tokens), (0, 0), (0, 0))).astype(jnp.float32)
    qf = qf.reshape(n_tiles, tile, num_kv_heads, group, head_dim)
    offs = jnp.arange(chunk, dtype=jnp.int32)

    def gather(tables, lead):
        """K and V (f32, dequantised) of the pages ``tables i32[*lead, chunk_pages]``."""
        k = k_cache[tables].reshape(lead + (chunk, num_kv_heads, head_dim)).astype(jnp.float32)
        v = v_cache[tables].reshape(lead + (chunk, num_kv_heads, head_dim)).astype(jnp.float32)
        if k_scale is not None:
            k = k * gather_scales(k_scale, tables).reshape(lead + (chunk, num_kv_heads, 1))
            v = v * gather_scales(v_scale, tables).reshape(lead + (chunk, num_kv_heads, 1))
        return k, v

    def chunk_of(qt, seq_t, lo_t, hi_t, c, one_seq):
        """Masked scores of key chunk ``c``, their mask (broadcastable to the scores) and V.

        One-sequence tiles work head-major: ``qt f32[Nkv, tile·G, D]`` (row ``r = t·G + g``),
        scores ``f32[Nkv, tile·G, chunk]``. Mixed tiles: ``qt f32[tile, Nkv, G, D]``, scores
        ``f32[tile, Nkv, G, chunk]``. Both compute the two matmuls with the gathered keys and
        values as ``[..., Nkv, chunk, D]`` operands batched over the heads (the cheap copy of the
        gather) and swap the small score / probability tiles instead: written as
        ``einsum("tkgd,jkd->tkgj")``, XLA:CPU transposed K or V to ``[Nkv, D, chunk]`` in every
        chunk (30 layers, SmolLM2 shapes, < 250 keys: one decode row 2.11 -> 1.12 ms, an 8-row
        verify window 4.47 -> 2.73 ms, 8 slots x 4-row windows 28.1 -> 14.3 ms)."""
        kv_pos = c * chunk + offs                                        # i32[chunk]
        mask = (kv_pos[None, :] >= lo_t[:, None]) & (kv_pos[None, :] < hi_t[:, None])
        if one_seq:       # one sequence: its chunk of pages is gathered once for the tile
            table = jax.lax.dynamic_slice_in_dim(tables_all[seq_t[0]], c * chunk_pages, chunk_pages)
            used = jnp.any(mask, axis=0)                                 # keys some row sees
            k, v = gather(table, ())
            k = jnp.where(used[:, None, None], k, 0)   # unowned slots may hold NaN
            v = jnp.where(used[:, None, None], v, 0)
            # K as the dot's first operand: [Nkv, chunk, D] x [Nkv, tile·G, D] needs no transpose
            # of K; the scores come back [Nkv, chunk, tile·G] and are swapped (small).
            s = jnp.swapaxes(jax.lax.dot_general(jnp.swapaxes(k, 0, 1), qt,
                                                 (((2,), (2,)), ((0,), (0,)))), 1, 2)
            mask = jnp.repeat(mask, group, axis=0)[None]                # [1, tile·G, chunk]
        else:             # rows of several sequences: each row gathers its own pages
            tables = jax.lax.dynamic_slice_in_dim(tables_all[seq_t], c * chunk_pages, chunk_pages,
                                                  axis=1)
            k, v = gather(tables, (qt.shape[0],))
            k = jnp.where(mask[..., None, None], k, 0)
            v = jnp.where(mask[..., None, None], v, 0)
            # K first, batched over (row, kv head), as for one sequence above
            s = jnp.swapaxes(jax.lax.dot_general(jnp.swapaxes(k, 1, 2), qt,
                                                 (((3,), (3,)), ((0, 1), (0, 1)))), 2, 3)
            mask = mask[:, None, None, :]                                # [tile, 1, 1, chunk]
        s = s * sm_scale
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        return jnp.where(mask, s, -jnp.inf), mask, v

    def run_tile(args, one_seq):
        qt, seq_t, lo_t, hi_t = args                                    # [tile, Nkv, G, D], i32[tile]
        first = jnp.min(jnp.where(hi_t > lo_t, lo_t, jnp.iinfo(jnp.int32).max)) // chunk
        last = -(-jnp.max(hi_t) // chunk)                               # chunks [first, last)
        n = qt.shape[0]
        if one_seq:       # head-major rows (see chunk_of)
            qt = qt.transpose(1, 0, 2, 3).reshape(num_kv_heads, n * group, head_dim)

        def body(c, carry):
            m, den, acc = carry
            s, mask, v = chunk_of(qt, seq_t, lo_t, hi_t, c, one_seq)
            m_new = jnp.maximum(m, jnp.max(s, axis=-1))
            m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
            p = jnp.where(mask, jnp.exp(s - m_safe[..., None]), 0.0)
            alpha = jnp.where(jnp.isfinite(m), jnp.exp(m - m_safe), 0.0)
            if one_seq:   # [Nkv, chunk, tile·G] x [Nkv, chunk, D] -> [Nkv, tile·G, D]
                pv = jax.lax.dot_general(jnp.swapaxes(p, 1, 2), jnp.swapaxes(v, 0, 1),
                                         (((1,), (1,)), ((0,), (0,))))
            else:         # [tile, Nkv, chunk, G] x [tile, Nkv, chunk, D] -> [tile, Nkv, G, D]
                pv = jax.lax.dot_general(jnp.swapaxes(p, 2, 3), jnp.swapaxes(v, 1, 2),
                                         (((2,), (2,)), ((0, 1), (0, 1))))
            return m_new, alpha * den + jnp.sum(p, axis=-1), alpha[..., None] * acc + pv

        rows = (num_kv_heads, n * group) if one_seq else (n, num_kv_heads, group)
        init = (jnp.full(rows, -jnp.inf, jnp.float32), jnp.zeros(rows, jnp.float32),
                jnp.zeros(rows + (head_dim,), jnp.float32))
        if n_chunks == 1 and not fixed_chunks:   # one chunk: no loop (short models)
            _, den, acc = body(0, init)
        else:
            _, den, acc = jax.lax.fori_loop(jnp.minimum(first, last), last, body, init)
        out = acc / jnp.where(den > 0, den, 1.0)[..., None]
        if one_seq:
            out = out.reshape(num_kv_heads, n, group, head_dim).transpose(1, 0, 2, 3)
        return out

    if rows_per_seq is not None:
        return _by_sequence(q, kv_lens, cu_q_lens, run_tile, rows_per_seq, sliding_window,
                            (num_kv_heads, group, head_dim))

    if tile == 1 or num_seqs == 1:      # every tile holds one sequence (statically known)
        one_tile = functools.partial(run_tile, one_seq=True)
    else:
        def one_tile(args):
            seq_t = args[1]
            return jax.lax.cond(jnp.all(seq_t == seq_t[0]), lambda a: run_tile(a, True),
                                lambda a: run_tile(a, False), args)

    tiles = (qf, seq.reshape(n_tiles, tile), lo.reshape(n_tiles, tile), hi.reshape(n_tiles, tile))
    if n_tiles == 1:                    # e.g. a batch-1 decode row: no map around the tile
        out = one_tile(jax.tree.map(lambda a: a[0], tiles))[None]
    else:
        out = jax.lax.map(one_tile, tiles)
    out = out.reshape(padded, num_q_heads, head_dim)[:num_tokens]
    return out.astype(q.dtype)


def _by_sequence(q, kv_lens, cu_q_lens, run_tile, rows: int, sliding_window, head_shape):
    """The sequence-major schedule of :func:`ragged_paged_attention_xla` (``rows_per_seq``):
    for each sequence, its query rows ``rows`` at a time through ``run_tile`` (one-sequence
    tiles); rows past ``cu_q_lens[S]`` stay 0."""
    num_tokens = q.shape[0]
    num_seqs = kv_lens.shape[0]
    qf = jnp.pad(q.astype(jnp.float32), ((0, rows), (0, 0), (0, 0)))   # tiles may run past T
    qf = qf.reshape((num_tokens + rows,) + head_shape)
    r = jnp.arange(rows, dtype=jnp.int32)

    def seq_body(s, out):
        q_len = cu_q_lens[s + 1] - cu_q_lens[s]
        kv_len = kv_lens[s]

        def tile_body(j, out):
            start = cu_q_lens[s] + j * rows
            local = j * rows + r
            valid = local < q_len
            q_pos = kv_len - q_len + local
            hi = jnp.where(valid, jnp.minimum(q_pos + 1, kv_len), 0)
            lo = (jnp.zeros_like(hi) if sliding_window is None
                  else jnp.maximum(q_pos - sliding_window + 1, 0))
            qt = jax.lax.dynamic_slice_in_dim(qf, start, rows)
            o = run_tile((qt, jnp.full((rows,), s, jnp.int32), jnp.minimum(lo, hi), hi), True)
            old = jax.lax.dynamic_slice_in_dim(out, start, rows)
            return jax.lax.dynamic_update_slice_in_dim(
                out, jnp.where(valid[:, None, None, None], o, old), start, 0)

        return jax.lax.fori_loop(0, -(-q_len // rows), tile_body, out)

    out = jax.lax.fori_loop(0, num_seqs, seq_body, jnp.zeros_like(qf))
    return out[:num_tokens].reshape(q.shape).astype(q.dtype)


#: The Pallas kernels and the platform each is written for (others run in interpret mode).
KERNEL_PLATFORMS = {"pallas_tpu": "tpu", "pallas_gpu": "gpu"}


class AttentionBackend(NamedTuple):
    """A resolved attention choice, static in the engine step: the implementation and the
    platform the step is compiled for (which decides a kernel's interpret mode,
    :func:`jmtp.core.platform.kernel_interpret`). Pass it as ``implementation``."""

    implementation: str
    platform: str


def default_implementation(platform: str | None = None) -> str:
    """Best implementation for ``platform`` (None: the host's default backend): TPU ->
    ``"pallas_tpu"``, GPU -> ``"pallas_gpu"`` (Triton), anything else (CPU) -> ``"xla"``
    (kernels would only run in the slow interpret mode there)."""
    platform = platform or host_platform()
    if platform == "tpu":
        return "pallas_tpu"
    if platform == "gpu":
        return "pallas_gpu"
    return "xla"


def resolve_backend(implementation: str | None, platform: str | None = None) -> AttentionBackend:
    """``AttentionBackend(implementation or default_implementation(platform), platform)``.

    Raises:
      ValueError: an unknown ``implementation`` or platform."""
    platform = platform_name(platform) if platform else host_platform()
    impl = implementation or default_implementation(platform)
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS} or None, got {impl!r}")
    return AttentionBackend(impl, platform)


def ragged_paged_attention(
    q: jax.Array,             # f[T, Nq, D]
    k_cache: jax.Array,       # f[num_blocks, block_size, Nkv*D] merged, or [.., Nkv, D] split
    v_cache: jax.Array,       # same shape as k_cache
    kv_lens: jax.Array,       # i32[S]
    block_tables: jax.Array,  # i32[S, pages]
    cu_q_lens: jax.Array,     # i32[S+1]
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    implementation: str | AttentionBackend | None = None,
    interpret: Any = None,
    k_scale: jax.Array | None = None,   # f32[num_blocks, Nkv, block_size] (quantised cache only)
    v_scale: jax.Array | None = None,   # f32[num_blocks, Nkv, block_size]
    rows_per_seq: int | None = None,
    num_kv_heads: int | None = None,
    batch_invariant: bool = False,
) -> jax.Array:               # f[T, Nq, D]
    """Attention of a ragged batch of queries over a paged KV cache (see module docstring).

    Args:
      implementation: one of :data:`IMPLEMENTATIONS`, None for :func:`default_implementation`
        of the host, or an :class:`AttentionBackend` (what the engine passes: the implementation
        and the platform compiled for).
      k_scale / v_scale: the per-slot, per-head scales of an int8 / float8_e4m3fn cache (required
        for those dtypes, not allowed for others); see :mod:`jmtp.pallas.kv_quant`.
      rows_per_seq: ``"xla"`` only (the others ignore it): a static schedule hint, see
        :func:`ragged_paged_attention_xla`.
      batch_invariant: ``"xla"`` only: every row's result independent of the batch (queries
        ``rows_per_seq`` at a time per sequence, ``fixed_chunks``; :mod:`jmtp.model.invariant`).
      num_kv_heads: Nkv of a merged cache whose rows carry padding lanes
        (:mod:`jmtp.pallas.kv_layout`); default: the row width over ``D``.
      interpret: kernels only (ignored by ``"reference"`` and ``"xla"``): None = Pallas
        interpret mode iff the platform compiled for (the backend's, or the host's) is not the
        kernel's; a bool; or, for ``"pallas_tpu"``, a ``pltpu.InterpretParams``.

    Raises:
      ValueError: on inconsistent shapes or scales (at trace time) or an unknown
        ``implementation``.
    """
    check_shapes(q, k_cache, v_cache, kv_lens, block_tables, cu_q_lens, k_scale, v_scale,
                 num_kv_heads)
    impl, platform = (implementation if isinstance(implementation, AttentionBackend)
                      else resolve_backend(implementation))
    if interpret is None and impl in KERNEL_PLATFORMS:
        interpret = kernel_interpret(KERNEL_PLATFORMS[impl], platform)
    tp = mesh.model_axis_size()
    nkv = cache_dims(q, k_cache, num_kv_heads)[2]
    kernel_on_mesh = impl in KERNEL_PLATFORMS and bool(mesh.auto_axes())
    sharded = (tp > 1 or kernel_on_mesh) and nkv % tp == 0
    # one kv head shared by every query head (MQA; MLA's latent cache): the query heads split
    # over the model axis, each rank reading the whole (replicated) cache
    shared_kv = tp > 1 and nkv == 1 and q.shape[1] % tp == 0
    run = functools.partial(_dispatch, impl, sm_scale=sm_scale, sliding_window=sliding_window,
                            soft_cap=soft_cap, interpret=interpret, rows_per_seq=rows_per_seq,
                            num_kv_heads=nkv // tp if sharded else nkv,
                            batch_invariant=batch_invariant)
    args = (q, k_cache, v_cache, kv_lens, block_tables, cu_q_lens)
    args += (k_scale, v_scale) if k_scale is not None else ()
    if sharded or shared_kv:
        # Tensor parallel (a mesh set by jmtp.core.mesh.mesh_context): every rank attends
        # with its own kv heads and their query heads; the metadata is replicated. A kernel
        # always runs here on a mesh (Mosaic cannot be partitioned automatically), even when
        # the model axis has one device.
        heads, cache, scale = mesh.attention_specs(k_cache.ndim, shared_kv=shared_kv)
        rep = jax.sharding.PartitionSpec()
        specs = (heads, cache, cache, rep, rep, rep) + ((scale, scale) if k_scale is not None
                                                        else ())
        run = jax.shard_map(run, in_specs=specs, out_specs=heads,
                            axis_names=mesh.auto_axes(), check_vma=False)
        return run(*args)
    if kernel_on_mesh:   # kv heads not divisible by the model axis: every device all heads
        return mesh.manual_replicated(lambda *a: (run(*a),), num_outputs=1)(*args)[0]
    return run(*args)


def _dispatch(impl, q, k_cache, v_cache, kv_lens, block_tables, cu_q_lens, k_scale=None,
              v_scale=None, *, sm_scale, sliding_window, soft_cap, interpret, rows_per_seq=None,
              num_kv_heads=None, batch_invariant=False):
    """Call implementation ``impl`` (arguments as :func:`ragged_paged_attention`;
    ``num_kv_heads``: the heads of this (shard's) cache)."""
    kw = dict(sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
              k_scale=k_scale, v_scale=v_scale)
    # The TPU kernel reads the merged [num_blocks, block_size, Nkv*D] pool as it is (a split view
    # would be a relayout copy of the whole pool on TPU); the others take the split view (free
    # on CPU and GPU).
    cache_form = (merge_heads if impl == "pallas_tpu" else
                  (lambda c: split_heads(c, q, num_kv_heads)))
    args = (q, cache_form(k_cache), cache_form(v_cache), kv_lens, block_tables, cu_q_lens)
    if impl == "reference":
        return ragged_paged_attention_reference(*args, **kw)
    if impl == "xla":
        return ragged_paged_attention_xla(*args, **kw, rows_per_seq=rows_per_seq,
                                          fixed_chunks=batch_invariant)
    if impl == "pallas_tpu":
        from jmtp.pallas import ragged_paged_attention_tpu as tpu
        return tpu.ragged_paged_attention_tpu(*args, **kw, interpret=interpret,
                                              num_kv_heads=num_kv_heads)
    from jmtp.pallas import ragged_paged_attention_gpu as gpu
    return gpu.ragged_paged_attention_gpu(*args, **kw, interpret=interpret)


def write_kv(
    k_cache: jax.Array,       # f[num_blocks, block_size, Nkv*D] (or split [.., Nkv, D])
    v_cache: jax.Array,       # same shape as k_cache
    k_new: jax.Array,         # f[T, Nkv, D]
    v_new: jax.Array,         # f[T, Nkv, D]
    slot_mapping: jax.Array,  # i32[T]  block_id * block_size + offset; -1 = padding row (dropped)
) -> tuple[jax.Array, jax.Array]:
    """Scatter this step's keys/values into the paged cache (merged or split heads, as given).
    Rows with slot -1 write nothing. (A quantised cache is written by
    :func:`jmtp.pallas.kv_quant.write_kv_quantized`.)"""
    nb, bs = k_cache.shape[:2]
    rows = k_cache.shape[2:]                                    # (W,) or (Nkv, D)
    slots = jnp.where(slot_mapping < 0, nb * bs, slot_mapping)  # out of range -> dropped
    kf = k_cache.reshape((nb * bs,) + rows).at[slots].set(
        cache_rows(k_new, rows).astype(k_cache.dtype), mode="drop")
    vf = v_cache.reshape((nb * bs,) + rows).at[slots].set(
        cache_rows(v_new, rows).astype(v_cache.dtype), mode="drop")
    return kf.reshape(k_cache.shape), vf.reshape(v_cache.shape)

