"""The gated delta rule as Pallas GPU kernels (Triton backend): the engine's packed recurrent rule
and its chunked prefill over chunk-aligned slots.

Contracts: :func:`jmtp.model.gated_deltanet.gated_delta_rule_packed` (verify windows and short
chunks: rows of several slots packed one after another, each slot starting from its own state,
the state after every marked row written to one checkpoint of a pool) and
:func:`jmtp.model.gated_deltanet.chunk_gated_delta_rule_varlen` (long prefill chunks laid out
chunk-aligned per slot). The jnp forms are the references; this module does not import them (the
package layering forbids it). Triton rather than Mosaic GPU for the reasons in
:mod:`jmtp.pallas.ragged_paged_attention_gpu` (CPU interpret mode over any grid, gathers).

Algorithm: the gated delta rule of Yang, Kautz & Hatamizadeh 2024 (arXiv 2412.06464); per value
head, with state ``S f32[Dk, Dv]``: ``S <- exp(g_t) S``, ``S <- S + k_t ⊗ beta_t (v_t - Sᵀ k_t)``,
``o_t = Sᵀ q_t``. **Each column of S evolves on its own** (the update of column ``j`` reads only
column ``j`` and the row's ``k, q, g, beta``), so the kernels tile the value dimension: a program
owns ``S[:, cols]`` of one head, ``Dk × BV`` fp32 in registers (FLA's ``fused_recurrent``
kernels split ``Dv`` the same way; written here from scratch).

* **Packed kernel**, grid ``(H, Dv / BV)``: the program runs the step's rows in order (a
  ``fori_loop``), reloading its tile from ``init[seq]`` at a slot's first row and storing it into
  ``pool[pool_base + seq, ckpt]`` after a marked row (a masked store: unmarked rows write
  nothing; the pool is aliased input → output, so checkpoints not written keep their bytes).
* **Varlen chunked kernel**, grid ``(H, Dv / BV)``: the program runs the chunks in order; per
  chunk of ``C`` rows the WY/UT form (``D = exp(gc_i - gc_j)``, ``A = strict_lower((beta·K) Kᵀ ∘
  D)``, ``T = (I + A)⁻¹`` by forward substitution over the register tile, ``U = T (beta·V)``,
  ``W = T (beta·exp(gc)·K)``, ``V' = U - W S``, ``O = (exp(gc)·Q) S + lower(Q Kᵀ ∘ D) V'``,
  ``S <- exp(gc_C) S + (exp(gc_C - gc)·K)ᵀ V'``); the cumulative decay ``gc`` comes from the
  wrapper. A slot's first chunk loads ``init[seq]``; every chunk stores the state into
  ``final[seq]``, so a slot's entry ends as the state after its last chunk.

Sizes: ``BV`` (``block_v``) defaults to ``min(Dv, 32)`` (a 128 × 32 fp32 tile is 16 KiB of
registers over 4 warps); ``Dk``, ``Dv`` and ``C`` must be powers of two for Triton's block
shapes (every Qwen3-Next / Qwen3.5 head is 128; the engine's chunk is 64). None of this is tuned
on hardware.

Verified (``tests/pallas/test_gated_delta_rule_varlen.py``): both kernels equal the jnp
references in Pallas' interpret mode on CPU, over NaN-poisoned pools. **Not compiled or run on a
GPU in the session that wrote them** (no GPU was available): ``scripts/device_check.sh``'s
``gdn_gpu`` stage compiles and checks them on the next GPU.
"""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

_HIGHEST = lax.Precision.HIGHEST


def _block_v(dv: int, block_v: int | None) -> int:
    bv = min(dv, 32) if block_v is None else int(block_v)
    if bv < 1 or dv % bv:
        raise ValueError(f"block_v must divide Dv={dv}, got {block_v!r}")
    return bv


def _interp(interpret) -> bool:
    return jax.default_backend() != "gpu" if interpret is None else bool(interpret)


def _check(name: str, x, shape: tuple) -> None:
    if tuple(getattr(x, "shape", ())) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got "
                         f"{tuple(getattr(x, 'shape', ()))}")


def _check_rows(q, k, v, g, beta):
    if len(getattr(q, "shape", ())) != 3:
        raise ValueError(f"q must have shape [T, H, Dk], got {tuple(getattr(q, 'shape', ()))}")
    t, h, dk = q.shape
    _check("k", k, (t, h, dk))
    if len(getattr(v, "shape", ())) != 3 or v.shape[:2] != (t, h):
        raise ValueError(f"v must have shape [T={t}, H={h}, Dv], got {tuple(v.shape)}")
    _check("g", g, (t, h))
    _check("beta", beta, (t, h))
    return t, h, dk, v.shape[2]


# ------------------------------------------------------------------------------------------------
# Packed recurrent rule
# ------------------------------------------------------------------------------------------------

def _packed_kernel(seq_ref, start_ref, ckpt_ref, base_ref, q_ref, k_ref, v_ref, eg_ref, b_ref,
                   init_ref, pool_in, o_ref, pool_ref, *, t: int, bv: int, dk: int,
                   b_slots: int, n_entries: int, w: int):
    del pool_in                    # aliased to pool_ref
    h, j = pl.program_id(0), pl.program_id(1)
    cols = pl.ds(j * bv, bv)
    base = base_ref[0]

    def row(r, s):
        seq = jnp.clip(seq_ref[r], 0, b_slots - 1)
        s = jnp.where(start_ref[r] != 0, init_ref[seq, h, :, cols], s)     # [Dk, BV]
        kt = k_ref[r, h, :]                                                # [Dk]
        s = s * eg_ref[r, h]
        delta = (v_ref[r, h, cols] - jnp.sum(kt[:, None] * s, axis=0)) * b_ref[r, h]
        s = s + kt[:, None] * delta[None, :]
        o_ref[r, h, cols] = jnp.sum(q_ref[r, h, :][:, None] * s, axis=0)
        ck = ckpt_ref[r]
        e = jnp.clip(base + seq, 0, n_entries - 1)
        pltr.store(pool_ref.at[e, jnp.clip(ck, 0, w - 1), h, :, cols], s,
                   mask=jnp.full(s.shape, ck >= 0))
        return s

    lax.fori_loop(0, t, row, jnp.zeros((dk, bv), jnp.float32))


@functools.partial(jax.jit, static_argnames=("bv", "interpret", "num_warps"))
def _packed(q, k, v, g, beta, row_seq, row_start, row_ckpt, init, pool, pool_base, *, bv,
            interpret, num_warps):
    t, h, dk = q.shape
    dv = v.shape[2]
    b_slots = init.shape[0]
    n_entries, w = pool.shape[:2]
    f32 = jnp.float32
    base = jnp.asarray(pool_base, jnp.int32).reshape(1)
    kernel = functools.partial(_packed_kernel, t=t, bv=bv, dk=dk, b_slots=b_slots,
                               n_entries=n_entries, w=w)
    o, pool = pl.pallas_call(
        kernel,
        grid=(h, dv // bv),
        out_shape=[jax.ShapeDtypeStruct((t, h, dv), f32), jax.ShapeDtypeStruct(pool.shape, f32)],
        input_output_aliases={10: 1},
        compiler_params=pltr.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="jmtp_gated_delta_rule_packed_gpu",
    )(row_seq.astype(jnp.int32), row_start.astype(jnp.int32), row_ckpt.astype(jnp.int32), base,
      q.astype(f32), k.astype(f32), v.astype(f32), jnp.exp(g.astype(f32)), beta.astype(f32),
      init.astype(f32), pool)
    return o, pool


def gated_delta_rule_packed_gpu(q, k, v, g, beta, row_seq, row_start, row_ckpt, init, pool,
                                pool_base=0, *, interpret: Any = None, block_v: int | None = None,
                                num_warps: int = 4):
    """Pallas GPU packed gated delta rule; the contract of
    :func:`jmtp.model.gated_deltanet.gated_delta_rule_packed` (a drop-in ``rule=``).

    Args: as the reference (``pool f32[N, W, H, Dk, Dv]`` aliased to the returned pool, slot
      ``s`` at entry ``pool_base + s``); ``interpret``: None = interpret unless the default
      backend is a GPU; ``block_v``: value columns per program (``BV``, divides ``Dv``).

    Returns:
      ``(o f32[T, H, Dv], pool)``.

    Raises:
      ValueError: inconsistent shapes, a bad ``block_v``.
    """
    t, h, dk, dv = _check_rows(q, k, v, g, beta)
    for name, x in (("row_seq", row_seq), ("row_start", row_start), ("row_ckpt", row_ckpt)):
        _check(name, x, (t,))
    if len(getattr(pool, "shape", ())) != 5 or pool.shape[2:] != (h, dk, dv):
        raise ValueError(f"pool must have shape [N, W, H={h}, Dk={dk}, Dv={dv}], got "
                         f"{tuple(getattr(pool, 'shape', ()))}")
    _check("init", init, (init.shape[0], h, dk, dv))
    if t == 0:
        return jnp.zeros((0, h, dv), jnp.float32), pool
    return _packed(q, k, v, g, beta, row_seq, row_start, row_ckpt, init, pool, pool_base,
                   bv=_block_v(dv, block_v), interpret=_interp(interpret),
                   num_warps=int(num_warps))


# ------------------------------------------------------------------------------------------------
# Chunked rule over chunk-aligned slots
# ------------------------------------------------------------------------------------------------

def _dot(a, b, trans_a=False, trans_b=False):
    return pltr.dot(a, b, trans_a=trans_a, trans_b=trans_b, precision=_HIGHEST)


def _varlen_kernel(seq_ref, first_ref, q_ref, k_ref, v_ref, b_ref, gc_ref, init_ref, o_ref, f_ref,
                   *, n: int, c: int, bv: int, dk: int, b_slots: int):
    h, j = pl.program_id(0), pl.program_id(1)
    cols = pl.ds(j * bv, bv)
    ri = lax.broadcasted_iota(jnp.int32, (c, c), 0)
    ci = lax.broadcasted_iota(jnp.int32, (c, c), 1)
    causal, strict = ri >= ci, ri > ci
    lane = lax.broadcasted_iota(jnp.int32, (c,), 0)

    def chunk(i, s):
        sq = jnp.clip(seq_ref[i], 0, b_slots - 1)
        s = jnp.where(first_ref[i] != 0, init_ref[sq, h, :, cols], s)      # [Dk, BV]
        rows = pl.ds(i * c, c)
        qc, kc = q_ref[rows, h, :], k_ref[rows, h, :]                      # [C, Dk]
        vc = v_ref[rows, h, cols]                                          # [C, BV]
        bc, gc = b_ref[rows, h], gc_ref[rows, h]                           # [C]
        decay = jnp.where(causal, jnp.exp(jnp.where(causal, gc[:, None] - gc[None, :], 0.0)),
                          0.0)
        kb = kc * bc[:, None]
        a = jnp.where(strict, _dot(kb, kc, trans_b=True) * decay, 0.0)

        def forward(r, tm):
            # T[r] = e_r - A[r, :] T (rows >= r of T still zero, A strictly lower)
            a_r = jnp.sum(jnp.where(ri == r, a, 0.0), axis=0)              # A[r, :]
            new = (lane == r).astype(jnp.float32) - jnp.sum(a_r[:, None] * tm, axis=0)
            return jnp.where(ri == r, new[None, :], tm)

        tm = lax.fori_loop(0, c, forward, jnp.zeros((c, c), jnp.float32))
        egc = jnp.exp(gc)
        u = _dot(tm, vc * bc[:, None])                                     # [C, BV]
        wk = _dot(tm, kb * egc[:, None])                                   # [C, Dk]
        attn = jnp.where(causal, _dot(qc, kc, trans_b=True) * decay, 0.0)
        v_new = u - _dot(wk, s)
        o_ref[rows, h, cols] = _dot(qc * egc[:, None], s) + _dot(attn, v_new)
        g_last = jnp.sum(jnp.where(lane == c - 1, gc, 0.0))
        s = s * jnp.exp(g_last) + _dot(kc * jnp.exp(g_last - gc)[:, None], v_new, trans_a=True)
        f_ref[sq, h, :, cols] = s
        return s

    lax.fori_loop(0, n, chunk, jnp.zeros((dk, bv), jnp.float32))


@functools.partial(jax.jit, static_argnames=("c", "bv", "interpret", "num_warps"))
def _varlen(q, k, v, g, beta, chunk_seq, chunk_first, init, *, c, bv, interpret, num_warps):
    t, h, dk = q.shape
    dv = v.shape[2]
    n, b_slots = t // c, init.shape[0]
    f32 = jnp.float32
    gc = jnp.cumsum(g.astype(f32).reshape(n, c, h), axis=1).reshape(t, h)
    kernel = functools.partial(_varlen_kernel, n=n, c=c, bv=bv, dk=dk, b_slots=b_slots)
    return pl.pallas_call(
        kernel,
        grid=(h, dv // bv),
        out_shape=[jax.ShapeDtypeStruct((t, h, dv), f32),
                   jax.ShapeDtypeStruct((b_slots, h, dk, dv), f32)],
        compiler_params=pltr.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="jmtp_chunk_gated_delta_rule_varlen_gpu",
    )(chunk_seq.astype(jnp.int32), chunk_first.astype(jnp.int32), q.astype(f32), k.astype(f32),
      v.astype(f32), beta.astype(f32), gc, init.astype(f32))


def chunk_gated_delta_rule_varlen_gpu(q, k, v, g, beta, chunk_seq, chunk_first, chunk_last, init,
                                      *, interpret: Any = None, block_v: int | None = None,
                                      num_warps: int = 4):
    """Pallas GPU chunked gated delta rule over chunk-aligned slots; the contract of
    :func:`jmtp.model.gated_deltanet.chunk_gated_delta_rule_varlen` (``chunk_last`` is implied
    by the layout: a slot's chunks are contiguous).

    Returns:
      ``(o f32[n·C, H, Dv], final f32[B, H, Dk, Dv])``.

    Raises:
      ValueError: inconsistent shapes (``n`` must divide the rows), a bad ``block_v``.
    """
    t, h, dk, dv = _check_rows(q, k, v, g, beta)
    n = tuple(getattr(chunk_seq, "shape", ()))
    if len(n) != 1 or n[0] < 1 or t % n[0]:
        raise ValueError(f"chunk_seq must be i32[n] with n >= 1 dividing the {t} rows, got "
                         f"shape {n}")
    _check("chunk_first", chunk_first, n)
    _check("chunk_last", chunk_last, n)
    _check("init", init, (init.shape[0] if init.ndim == 4 else -1, h, dk, dv))
    return _varlen(q, k, v, g, beta, chunk_seq, chunk_first, init, c=t // n[0],
                   bv=_block_v(dv, block_v), interpret=_interp(interpret),
                   num_warps=int(num_warps))


__all__ = ["gated_delta_rule_packed_gpu", "chunk_gated_delta_rule_varlen_gpu"]
