"""The gated delta rule (Gated DeltaNet linear attention) as Pallas TPU (Mosaic) kernels.

Two kernels with the contracts of the jnp forms in :mod:`jmtp.model.gated_deltanet` (read that
module's docstring first; this module does not import it, the package layering forbids it):

* :func:`gated_delta_rule_packed_pallas`: the engine's packed ragged form
  (``gated_delta_rule_packed``): rows of several slots packed one after another, each slot
  starting from its own state, the state after every *marked* row written to one checkpoint of a
  pool; a drop-in ``rule=`` of ``linear_attention_packed``;
* :func:`chunk_gated_delta_rule_pallas`: the chunked WY/UT form over one sequence
  (``chunk_gated_delta_rule``), for prefill.

Algorithm: the gated delta rule of Yang, Kautz & Hatamizadeh 2024 ("Gated Delta Networks:
Improving Mamba2 with Delta Rule", arXiv 2412.06464). Per value head, with state
``S f32[Dk, Dv]`` and row ``t``'s query/key ``q_t, k_t f32[Dk]`` (prepared: l2-normalised, the
query scaled), value ``v_t f32[Dv]``, decay ``g_t <= 0`` and write strength ``beta_t``::

    S   <- exp(g_t) · S
    S   <- S + k_t ⊗ (beta_t · (v_t - Sᵀ k_t))
    o_t  = Sᵀ q_t

Shapes and dtypes (both kernels): ``q, k f[T, H, Dk]``, ``v f[T, H, Dv]``, ``g, beta f[T, H]``
(any float dtype, computed in fp32; GQA is the caller's business: key heads are already
repeated to the ``H = Hv`` value heads), states ``f32[.., H, Dk, Dv]``, outputs ``f32``.

**Packed kernel.** Grid ``(H, T_pad / R)``: value heads are independent (``"parallel"``, split
over the TensorCores of a megacore chip), row blocks of ``R`` rows run in order
(``"arbitrary"``), and inside a block the rows are a ``lax.fori_loop``. Each program keeps its
head's state ``S`` in a VMEM scratch ``f32[Dk, Dv]`` that persists over the row blocks. The row
metadata (``row_seq``, ``row_start``, ``row_ckpt``: 12 bytes per row) is scalar-prefetched into
SMEM; ``exp(g)`` (computed in the wrapper, bit-identical to the reference's) and ``beta`` come
per head and row block as SMEM blocks. A row with ``row_start`` reloads ``S`` from ``init`` by a
DMA of that one ``[Dk, Dv]`` tile (``init`` stays in HBM). The checkpoint pool is aliased input
→ output (``input_output_aliases``) and stays in HBM: only marked rows write, each by a DMA of
``S`` into ``pool[seq, ckpt, head]`` from one of two VMEM staging tiles, so the write of one
checkpoint overlaps the next rows' compute; every other checkpoint keeps its bytes (a pool
pre-filled with NaN stays NaN outside the written tiles). This is the "SPEC mode" state layout
of vLLM's ``gdn_attn`` / tpu-inference's linear-attention kernels, described here in words and
written from scratch: a verify window of ``q`` rows writes the state after each of its last
``min(q, W)`` rows into ``W = K + 1`` slots of the request, and after verification the request
continues from the checkpoint of its last accepted row, so a rejected draft costs no recompute.
Per row the kernel does three ``[1, D] x [D, D]`` MXU products (``Sᵀk``, the rank-1 update
``k ⊗ delta`` as a transposed-lhs product, ``Sᵀq``) and ``O(Dk·Dv)`` VPU work.

**Chunked kernel.** Grid ``(H, n)`` over heads (``"parallel"``) and chunks of ``C`` rows (the
chunk loop, ``"arbitrary"``: sequential, the state in VMEM scratch between chunks; a grid axis
rather than an in-kernel ``fori_loop`` so that Pallas pipelines the DMA of chunk ``i + 1``'s
rows under chunk ``i``'s compute and VMEM stays ``O(C·D)`` for any sequence length). Split of
the work: the wrapper computes only the per-chunk cumulative decay ``gc`` (a cumsum, in two
layouts: a column ``[C, 1]`` and a row ``[1, C]``, so the kernel needs no transpose); everything
else is in the kernel, per chunk (Yang et al.'s WY/UT form, as ``chunk_gated_delta_rule``)::

    D   = exp(gc_i - gc_j) (i >= j)            A = strict_lower((beta·K) Kᵀ ∘ D)
    T   = (I + A)⁻¹                             (forward substitution, one row per step)
    U   = T (beta·V),   W = T (beta·exp(gc)·K)  (the UT transform)
    V'  = U - W S,      O = (exp(gc)·Q) S + lower(Q Kᵀ ∘ D) V'
    S  <- exp(gc_C) S + (exp(gc_C - gc)·K)ᵀ V'

``T`` is built row by row in a VMEM scratch: ``T[i] = e_i - A[i, :] T`` (rows ``>= i`` of ``T``
are still zero, and ``A`` is strictly lower), ``C`` sequential ``[1, C] x [C, C]`` products; the
inverse is then applied with two full MXU products. (The product form
``(I - A)(I + A²)(I + A⁴)…`` would avoid the sequential loop but loses all precision when keys
repeat: the powers of ``A`` grow like binomial coefficients; with 64 equal keys and
``beta = 0.99`` its fp32 error is ~3e10 where forward substitution's is ~2e-8.)

Layouts: the kernels read ``[rows, D]`` tiles of one head. With ``Dk`` and ``Dv`` multiples of
128 (every real model: 128) the packed ``[T, H·D]`` view is tiled directly (block ``(R, D)`` at
column block ``h``; no copy); otherwise the wrapper transposes to head-major ``[H, T, D]``, so the
last two block dimensions are always legal Mosaic tiles (full ``D``; ``R`` and ``C`` multiples of
8 or the whole axis).

Interpret mode: ``interpret=None`` interprets unless the host's default backend is TPU
(:func:`jmtp.core.platform.kernel_interpret`, as the engine decides for its other Mosaic
kernels); ``True`` is TPU interpret mode with out-of-bounds reads raising and uninitialised
memory NaN (:func:`jmtp.pallas.ragged_paged_attention_tpu.resolve_interpret`); a
``pltpu.InterpretParams`` is passed through (e.g. ``detect_races=True``).

What is verified (``tests/pallas/test_gated_delta_rule.py``): both kernels equal the jnp
references in TPU interpret mode on CPU, and compile with libtpu's real Mosaic compiler for a TPU
topology (ahead of time, :mod:`jmtp.aot`'s compile-only devices) at Qwen3-Next's head shape. Not
run or timed on TPU hardware.
"""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jmtp.core.platform import host_platform, kernel_interpret
from jmtp.pallas.ragged_paged_attention_tpu import resolve_interpret as _resolve_tpu_interpret

_LANES = 128        # a head dim that is a multiple of this is tiled in the packed [T, H*D] view
_SUBLANES = 8       # f32 rows per sublane tile
#: Default rows per block of the packed kernel (``R``): long enough to amortise the per-grid-step
#: cost, short enough that the double-buffered q/k/v/o blocks stay small in VMEM.
DEFAULT_ROWS_PER_BLOCK = 256
_HIGHEST = lax.Precision.HIGHEST


# ------------------------------------------------------------------------------------------------
# Validation
# ------------------------------------------------------------------------------------------------

def _shape(x) -> tuple[int, ...]:
    return tuple(getattr(x, "shape", ()))


def _expect(name: str, x, shape: tuple, kind: str, what: str = "") -> None:
    """Raise ValueError unless ``x`` has ``shape`` and a dtype of ``kind`` ('float', 'int',
    'int_or_bool', 'f32')."""
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise ValueError(f"{name} must be an array of shape {shape}, got {type(x).__name__}")
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}{what}, got {tuple(x.shape)}")
    dt = jnp.dtype(x.dtype)
    ok = {"float": jnp.issubdtype(dt, jnp.floating),
          "f32": dt == jnp.float32,
          "int": jnp.issubdtype(dt, jnp.integer),
          "int_or_bool": jnp.issubdtype(dt, jnp.integer) or dt == jnp.bool_}[kind]
    if not ok:
        want = {"float": "a floating dtype", "f32": "float32", "int": "an integer dtype",
                "int_or_bool": "bool or an integer dtype"}[kind]
        raise ValueError(f"{name} must have {want} (shape {tuple(shape)}), got {dt}")


def _check_rows(q, k, v, g, beta) -> tuple[int, int, int, int]:
    """Shared checks of the row inputs; returns ``(T, H, Dk, Dv)``."""
    if len(_shape(q)) != 3:
        raise ValueError(f"q must have shape [T, H, Dk] (rank 3), got {_shape(q)}")
    t, h, dk = _shape(q)
    _expect("q", q, (t, h, dk), "float")
    _expect("k", k, (t, h, dk), "float", " [T, H, Dk] like q")
    if len(_shape(v)) != 3 or _shape(v)[:2] != (t, h):
        raise ValueError(f"v must have shape [T={t}, H={h}, Dv], got {_shape(v)}")
    dv = _shape(v)[2]
    _expect("v", v, (t, h, dv), "float")
    _expect("g", g, (t, h), "float", " [T, H]")
    _expect("beta", beta, (t, h), "float", " [T, H]")
    if dk < 1 or dv < 1 or h < 1:
        raise ValueError(f"head sizes must be >= 1, got H={h}, Dk={dk}, Dv={dv}")
    return t, h, dk, dv


def check_packed_inputs(q, k, v, g, beta, row_seq, row_start, row_ckpt, init, pool) -> None:
    """Validate :func:`gated_delta_rule_packed_pallas`'s arguments (shapes and dtypes only; works
    on tracers and ``jax.ShapeDtypeStruct``).

    Expected: ``q, k f[T, H, Dk]``, ``v f[T, H, Dv]``, ``g, beta f[T, H]``, ``row_seq i32[T]``,
    ``row_start bool[T]`` (or integer), ``row_ckpt i32[T]``, ``init f[B, H, Dk, Dv]``,
    ``pool f32[N, W, H, Dk, Dv]`` with ``N >= B`` and ``W >= 1``.

    Raises:
      ValueError: naming the first inconsistent argument and the shape / dtype it should have.
    """
    t, h, dk, dv = _check_rows(q, k, v, g, beta)
    _expect("row_seq", row_seq, (t,), "int", " [T]")
    _expect("row_start", row_start, (t,), "int_or_bool", " [T]")
    _expect("row_ckpt", row_ckpt, (t,), "int", " [T]")
    ps = _shape(pool)
    if len(ps) != 5:
        raise ValueError(f"pool must have shape [N, W, H={h}, Dk={dk}, Dv={dv}], got {ps}")
    _expect("pool", pool, (ps[0], ps[1], h, dk, dv), "f32", " [N, W, H, Dk, Dv]")
    if ps[0] < 1 or ps[1] < 1:
        raise ValueError(f"pool needs N >= 1 entries and W >= 1 checkpoints, got {ps}")
    ins = _shape(init)
    b_slots = ins[0] if len(ins) == 4 and 1 <= ins[0] <= ps[0] else min(ps[0], max(ins[:1] or (1,)))
    _expect("init", init, (b_slots, h, dk, dv), "float",
            f" [B, H, Dk, Dv] with 1 <= B <= N={ps[0]} (pool entries)")


def check_chunk_inputs(q, k, v, g, beta, initial_state, chunk_size) -> None:
    """Validate :func:`chunk_gated_delta_rule_pallas`'s arguments: ``q, k f[T, H, Dk]``,
    ``v f[T, H, Dv]``, ``g, beta f[T, H]``, ``initial_state f[H, Dk, Dv]`` or None, an integer
    ``chunk_size >= 1``.

    Raises:
      ValueError: naming the first inconsistent argument and what it should be.
    """
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be an int >= 1, got {chunk_size!r}")
    _, h, dk, dv = _check_rows(q, k, v, g, beta)
    if initial_state is not None:
        _expect("initial_state", initial_state, (h, dk, dv), "float", " [H, Dk, Dv]")


def _interpret(interpret: Any) -> Any:
    """``None`` -> interpret unless the host is a TPU; then ``False`` or ``InterpretParams``."""
    if interpret is None:
        interpret = kernel_interpret("tpu", host_platform())
    return _resolve_tpu_interpret(interpret)


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _tile_spec(d: int, rows: int) -> pl.BlockSpec:
    """BlockSpec of the ``[rows, D]`` tile of head ``h``, row block ``j`` (grid ``(h, j)``) in
    the layout of :func:`_head_tiles`."""
    if d % _LANES == 0:
        return pl.BlockSpec((rows, d), lambda hh, j, *_: (j, hh))
    return pl.BlockSpec((None, rows, d), lambda hh, j, *_: (hh, j, 0))


def _tiled_shape(t: int, h: int, d: int) -> tuple[int, ...]:
    return (t, h * d) if d % _LANES == 0 else (h, t, d)


def _head_tiles(x: jax.Array, rows: int) -> tuple[jax.Array, pl.BlockSpec]:
    """``x f32[T, H, D]`` as kernel operand and the BlockSpec of its ``[rows, D]`` tiles: the
    packed ``[T, H·D]`` view when ``D`` is a multiple of 128 (no copy), else head-major
    ``[H, T, D]``."""
    t, h, d = x.shape
    x = x.reshape(t, h * d) if d % _LANES == 0 else x.transpose(1, 0, 2)
    return x, _tile_spec(d, rows)


def _from_head_tiles(o: jax.Array, t: int, h: int, d: int) -> jax.Array:
    """Inverse of :func:`_head_tiles` for an output, cut to ``t`` rows: ``f32[t, H, D]``."""
    if d % _LANES == 0:
        return o.reshape(-1, h, d)[:t]
    return o.transpose(1, 0, 2)[:t]


def _dot(a, b):
    """``a @ b`` in fp32 at full precision."""
    return lax.dot_general(a, b, (((1,), (0,)), ((), ())), precision=_HIGHEST,
                           preferred_element_type=jnp.float32)


def _dot_tn(a, b):
    """``aᵀ @ b`` (contract the rows)."""
    return lax.dot_general(a, b, (((0,), (0,)), ((), ())), precision=_HIGHEST,
                           preferred_element_type=jnp.float32)


def _dot_nt(a, b):
    """``a @ bᵀ`` (contract the columns)."""
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=_HIGHEST,
                           preferred_element_type=jnp.float32)


# ------------------------------------------------------------------------------------------------
# Packed ragged form
# ------------------------------------------------------------------------------------------------

def _packed_kernel(
    # scalar prefetch (SMEM)
    seq_ref,          # i32[T_pad] slot of each row, clamped to [0, B)
    start_ref,        # i32[T_pad] 1: reload the state from init before the row
    ckpt_ref,         # i32[T_pad] checkpoint written after the row (clamped to < W), -1 none
    base_ref,         # i32[1] pool entry of slot 0 (the layer's offset in a flat pool)
    # inputs
    q_ref, k_ref,     # VMEM f32[R, Dk]
    v_ref,            # VMEM f32[R, Dv]
    a_ref, b_ref,     # SMEM f32[1, R] exp(g) and beta of this head's rows
    init_hbm,         # ANY f32[B, H, Dk, Dv]
    pool_in,          # ANY f32[N, W, H, Dk, Dv] (aliased to pool_hbm; never read)
    # outputs
    o_ref,            # VMEM f32[R, Dv]
    pool_hbm,         # ANY f32[N, W, H, Dk, Dv]
    # scratch
    s_ref,            # VMEM f32[Dk, Dv] the head's state, carried over the row blocks
    stage_ref,        # VMEM f32[2, Dk, Dv] checkpoint staging tiles
    sems,             # DMA semaphores [2]
    *, rows: int,
):
    del pool_in
    h = pl.program_id(0)
    j = pl.program_id(1)

    @pl.when(j == 0)
    def _():
        s_ref[...] = jnp.zeros_like(s_ref)

    def wait_slot(slot):
        # A wait needs only the semaphore and the copy size: any [Dk, Dv] destination will do.
        pltpu.make_async_copy(stage_ref.at[slot], pool_hbm.at[0, 0, h], sems.at[slot]).wait()

    def row(r, started):
        t = j * rows + r
        seq = seq_ref[t]

        @pl.when(start_ref[t] != 0)
        def _():
            pltpu.sync_copy(init_hbm.at[seq, h], s_ref)

        kt = k_ref[pl.ds(r, 1), :]                                   # [1, Dk]
        s = s_ref[...] * a_ref[0, r]                                 # decay
        delta = (v_ref[pl.ds(r, 1), :] - _dot(kt, s)) * b_ref[0, r]  # [1, Dv]
        s = s + _dot_tn(kt, delta)                                   # k ⊗ delta
        s_ref[...] = s
        o_ref[pl.ds(r, 1), :] = _dot(q_ref[pl.ds(r, 1), :], s)
        ck = ckpt_ref[t]
        write = ck >= 0
        slot = started % 2

        @pl.when(write)
        def _():
            @pl.when(started >= 2)
            def _():
                wait_slot(slot)          # the DMA that last used this staging tile

            stage_ref[slot] = s
            pltpu.make_async_copy(stage_ref.at[slot], pool_hbm.at[base_ref[0] + seq, ck, h],
                                  sems.at[slot]).start()

        return started + write.astype(jnp.int32)

    started = lax.fori_loop(0, rows, row, jnp.int32(0))

    # Drain: the last one or two checkpoint DMAs of this block are still in flight.
    @pl.when(started >= 2)
    def _():
        wait_slot(started % 2)

    @pl.when(started >= 1)
    def _():
        wait_slot((started - 1) % 2)


@functools.partial(jax.jit, static_argnames=("rows", "interpret"))
def _packed(q, k, v, g, beta, row_seq, row_start, row_ckpt, init, pool, pool_base, *, rows,
            interpret):
    t, h, dk = q.shape
    dv = v.shape[2]
    b_slots, w = init.shape[0], pool.shape[1]
    t_pad = _round_up(t, rows)
    pad = t_pad - t
    f32 = jnp.float32
    padt = lambda a, value=0: jnp.pad(  # noqa: E731
        a, [(0, pad)] + [(0, 0)] * (a.ndim - 1), constant_values=value)
    # Metadata: padding rows neither start nor write; slot and checkpoint indices clamped so
    # that no DMA address can leave the pool.
    seq = padt(jnp.clip(row_seq.astype(jnp.int32), 0, b_slots - 1))
    start = padt(row_start.astype(jnp.int32) != 0).astype(jnp.int32)
    ck = row_ckpt.astype(jnp.int32)
    ck = padt(jnp.where(ck >= 0, jnp.minimum(ck, w - 1), -1), -1)
    base = jnp.clip(jnp.asarray(pool_base, jnp.int32), 0, pool.shape[0] - b_slots).reshape(1)
    qw, q_spec = _head_tiles(padt(q.astype(f32)), rows)
    kw, k_spec = _head_tiles(padt(k.astype(f32)), rows)
    vw, v_spec = _head_tiles(padt(v.astype(f32)), rows)
    nb = t_pad // rows
    # [H, nb, 1, R]: the block's last two dims (1, R) are whole dims (a Mosaic tiling rule)
    per_head = lambda a: a.T.reshape(h, nb, 1, rows)  # noqa: E731
    decay = per_head(padt(jnp.exp(g.astype(f32)), 1.0))
    bt = per_head(padt(beta.astype(f32)))
    smem_rows = pl.BlockSpec((None, None, 1, rows), lambda hh, jj, *_: (hh, jj, 0, 0),
                             memory_space=pltpu.SMEM)
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    o_spec, o_shape = _tile_spec(dv, rows), _tiled_shape(t_pad, h, dv)
    o, pool = pl.pallas_call(
        functools.partial(_packed_kernel, rows=rows),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4,
            grid=(h, nb),
            in_specs=[q_spec, k_spec, v_spec, smem_rows, smem_rows, any_spec, any_spec],
            out_specs=[o_spec, any_spec],
            scratch_shapes=[pltpu.VMEM((dk, dv), f32), pltpu.VMEM((2, dk, dv), f32),
                            pltpu.SemaphoreType.DMA((2,))]),
        out_shape=[jax.ShapeDtypeStruct(o_shape, f32), jax.ShapeDtypeStruct(pool.shape, f32)],
        # operands: 4 scalar-prefetch, q, k, v, exp(g), beta, init, pool (index 10) -> output 1
        input_output_aliases={10: 1},
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=interpret,
        name="jmtp_gated_delta_rule_packed_tpu",
    )(seq, start, ck, base, qw, kw, vw, decay, bt, init.astype(f32), pool)
    return _from_head_tiles(o, t, h, dv), pool


def gated_delta_rule_packed_pallas(q, k, v, g, beta, row_seq, row_start, row_ckpt, init, pool,
                                   pool_base=0, *, interpret: Any = None,
                                   rows_per_block: int | None = None):
    """Pallas-TPU gated delta rule over a packed ragged batch; the contract of
    :func:`jmtp.model.gated_deltanet.gated_delta_rule_packed` (pass it as ``rule=`` of
    ``linear_attention_packed``).

    Args:
      q, k: ``f[T, H, Dk]`` prepared (l2-normalised, the query scaled); v: ``f[T, H, Dv]``;
        g, beta: ``f[T, H]`` (computed in fp32).
      row_seq: ``i32[T]`` slot of each row (rows of a slot contiguous). Rows that start or
        write must name a slot in ``[0, B)`` (others are clamped into it; padding rows may
        hold anything).
      row_start: ``bool[T]`` the row is its slot's first: the state is reloaded from ``init``.
      row_ckpt: ``i32[T]`` checkpoint the state after the row is written to, -1 = none
        (``>= W`` writes ``W - 1``, like the reference). Marked rows must name distinct
        ``(slot, checkpoint)`` pairs (the engine's always do): two checkpoint DMAs in flight
        to one tile would land in either order.
      init: ``f[B, H, Dk, Dv]`` each slot's state before this step.
      pool: ``f32[N, W, H, Dk, Dv]`` the checkpoints, slot ``s`` at entry ``pool_base + s``
        (``N >= B``; the engine's flat view of every linear layer's pool); aliased to the
        returned pool (donate it under ``jit`` to update it in place), tiles of unmarked
        checkpoints keep their bytes.
      pool_base: ``int`` or ``i32[]`` in ``[0, N - B]`` (clamped into it).
      interpret: None (interpret unless the host is a TPU), a bool, or a
        ``pltpu.InterpretParams``.
      rows_per_block: ``R``, rows per grid step (a multiple of 8; default
        ``min(DEFAULT_ROWS_PER_BLOCK, T rounded up to 8)``).

    Returns:
      ``(o f32[T, H, Dv], pool f32[N, W, H, Dk, Dv])``.

    Raises:
      ValueError: inconsistent shapes or dtypes (:func:`check_packed_inputs`), a bad
        ``rows_per_block`` or ``interpret``.
    """
    check_packed_inputs(q, k, v, g, beta, row_seq, row_start, row_ckpt, init, pool)
    t, h, _ = q.shape
    if rows_per_block is None:
        rows_per_block = min(DEFAULT_ROWS_PER_BLOCK, _round_up(max(t, 1), _SUBLANES))
    if (isinstance(rows_per_block, bool) or not isinstance(rows_per_block, int)
            or rows_per_block < 1 or rows_per_block % _SUBLANES):
        raise ValueError(f"rows_per_block must be a positive multiple of {_SUBLANES}, "
                         f"got {rows_per_block!r}")
    interpret = _interpret(interpret)
    if t == 0:
        return jnp.zeros((0, h, v.shape[2]), jnp.float32), pool
    return _packed(q, k, v, g, beta, row_seq, row_start, row_ckpt, init, pool, pool_base,
                   rows=rows_per_block, interpret=interpret)


# ------------------------------------------------------------------------------------------------
# Chunked form (one sequence)
# ------------------------------------------------------------------------------------------------

def chunk_step_vmem(q_ref, k_ref, v_ref, b_ref, gc_ref, gr_ref, s, o_ref, a_ref, t_ref,
                    c: int):
    """One chunk of the WY/UT form inside a Mosaic kernel (module docstring): this head's rows
    ``q_ref, k_ref [C, Dk]``, ``v_ref [C, Dv]``, ``b_ref`` beta ``[C, 1]``, the cumulative decay
    as a column ``gc_ref [C, 1]`` and a row ``gr_ref [1, C]``, the state ``s f32[Dk, Dv]``
    before the chunk; writes the chunk's output to ``o_ref [C, Dv]`` (scratch ``a_ref``,
    ``t_ref [C, C]``) and returns the state after it."""
    qc, kc, vc, bc = q_ref[...], k_ref[...], v_ref[...], b_ref[...]
    gcol, grow = gc_ref[...], gr_ref[...]
    ri = lax.broadcasted_iota(jnp.int32, (c, c), 0)
    ci = lax.broadcasted_iota(jnp.int32, (c, c), 1)
    causal, strict = ri >= ci, ri > ci
    decay = jnp.where(causal, jnp.exp(jnp.where(causal, gcol - grow, 0.0)), 0.0)   # [C, C]
    kb = kc * bc
    a_ref[...] = jnp.where(strict, _dot_nt(kb, kc) * decay, 0.0)
    t_ref[...] = jnp.zeros_like(t_ref)
    lane = lax.broadcasted_iota(jnp.int32, (1, c), 1)

    def forward(r, carry):
        # T[r] = e_r - A[r, :] T: rows >= r of T are still zero and A is strictly lower.
        t_ref[pl.ds(r, 1), :] = ((lane == r).astype(jnp.float32)
                                 - _dot(a_ref[pl.ds(r, 1), :], t_ref[...]))
        return carry

    lax.fori_loop(0, c, forward, 0)
    tinv = t_ref[...]
    egc = jnp.exp(gcol)                                                  # [C, 1]
    u = _dot(tinv, vc * bc)                                              # [C, Dv]
    w = _dot(tinv, kb * egc)                                             # [C, Dk]
    attn = jnp.where(causal, _dot_nt(qc, kc) * decay, 0.0)               # [C, C]
    v_new = u - _dot(w, s)
    o_ref[...] = _dot(qc * egc, s) + _dot(attn, v_new)
    g_last = grow[:, c - 1:c]                                            # [1, 1]
    return s * jnp.exp(g_last) + _dot_tn(kc * jnp.exp(g_last - gcol), v_new)


def _chunk_kernel(
    q_ref, k_ref,     # VMEM f32[C, Dk] this head's rows of chunk i
    v_ref,            # VMEM f32[C, Dv]
    b_ref,            # VMEM f32[C, 1] beta
    gc_ref,           # VMEM f32[C, 1] cumulative decay within the chunk (column)
    gr_ref,           # VMEM f32[1, C] the same as a row
    s0_ref,           # VMEM f32[Dk, Dv] initial state of the head
    o_ref,            # VMEM f32[C, Dv]
    sf_ref,           # VMEM f32[Dk, Dv] final state of the head
    s_ref,            # scratch VMEM f32[Dk, Dv] state between chunks
    a_ref,            # scratch VMEM f32[C, C] A
    t_ref,            # scratch VMEM f32[C, C] (I + A)^-1
    *, chunk: int,
):
    i = pl.program_id(1)

    @pl.when(i == 0)
    def _():
        s_ref[...] = s0_ref[...]

    s_ref[...] = chunk_step_vmem(q_ref, k_ref, v_ref, b_ref, gc_ref, gr_ref, s_ref[...], o_ref,
                                 a_ref, t_ref, chunk)

    @pl.when(i == pl.num_programs(1) - 1)
    def _():
        sf_ref[...] = s_ref[...]


@functools.partial(jax.jit, static_argnames=("chunk", "interpret"))
def _chunked(q, k, v, g, beta, initial_state, *, chunk, interpret):
    t, h, dk = q.shape
    dv = v.shape[2]
    f32 = jnp.float32
    c = chunk
    pad = (-t) % c
    n = (t + pad) // c
    # Padding rows (the last chunk's tail): zeros, g = 0 and beta = 0, as the reference pads.
    padt = lambda a: jnp.pad(a.astype(f32), [(0, pad)] + [(0, 0)] * (a.ndim - 1))  # noqa: E731
    q, k, v, g, beta = (padt(a) for a in (q, k, v, g, beta))
    gc = jnp.cumsum(g.reshape(n, c, h), axis=1)                          # [n, C, H]
    gcol = gc.reshape(n * c, h).T[..., None]                             # [H, T_pad, 1]
    grow = gc.transpose(2, 0, 1)[:, :, None, :]                          # [H, n, 1, C]
    bcol = beta.T[..., None]                                             # [H, T_pad, 1]
    qw, q_spec = _head_tiles(q, c)
    kw, k_spec = _head_tiles(k, c)
    vw, v_spec = _head_tiles(v, c)
    col_spec = pl.BlockSpec((None, c, 1), lambda hh, i: (hh, i, 0))
    row_spec = pl.BlockSpec((None, None, 1, c), lambda hh, i: (hh, i, 0, 0))
    state_spec = pl.BlockSpec((None, dk, dv), lambda hh, i: (hh, 0, 0))
    o_spec, o_shape = _tile_spec(dv, c), _tiled_shape(n * c, h, dv)
    s0 = (jnp.zeros((h, dk, dv), f32) if initial_state is None else initial_state.astype(f32))
    o, s = pl.pallas_call(
        functools.partial(_chunk_kernel, chunk=c),
        grid=(h, n),
        in_specs=[q_spec, k_spec, v_spec, col_spec, col_spec, row_spec, state_spec],
        out_specs=[o_spec, state_spec],
        out_shape=[jax.ShapeDtypeStruct(o_shape, f32), jax.ShapeDtypeStruct((h, dk, dv), f32)],
        scratch_shapes=[pltpu.VMEM((dk, dv), f32), pltpu.VMEM((c, c), f32),
                        pltpu.VMEM((c, c), f32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=interpret,
        name="jmtp_chunk_gated_delta_rule_tpu",
    )(qw, kw, vw, bcol, gcol, grow, s0)
    return _from_head_tiles(o, t, h, dv), s


def chunk_gated_delta_rule_pallas(q, k, v, g, beta, initial_state=None, chunk_size: int = 64,
                                  *, interpret: Any = None):
    """Pallas-TPU chunked gated delta rule over one sequence; the contract of
    :func:`jmtp.model.gated_deltanet.chunk_gated_delta_rule`.

    Args:
      q, k: ``f[T, H, Dk]`` prepared; v: ``f[T, H, Dv]``; g, beta: ``f[T, H]`` (fp32 inside).
      initial_state: ``f[H, Dk, Dv]`` or None (zeros).
      chunk_size: ``C`` rows per chunk (any ``C >= 1``; ``T`` need not be a multiple: the last
        chunk is padded with rows that change nothing). On TPU ``C`` should be a multiple of 8
        (64 is the usual choice); the Mosaic compiler checks it.
      interpret: None (interpret unless the host is a TPU), a bool, or a
        ``pltpu.InterpretParams``.

    Returns:
      ``(o f32[T, H, Dv], final_state f32[H, Dk, Dv])``.

    Raises:
      ValueError: inconsistent shapes or dtypes, ``chunk_size < 1``
        (:func:`check_chunk_inputs`), or a bad ``interpret``.
    """
    check_chunk_inputs(q, k, v, g, beta, initial_state, chunk_size)
    interpret = _interpret(interpret)
    t, h, dk = q.shape
    if t == 0:
        s0 = (jnp.zeros((h, dk, v.shape[2]), jnp.float32) if initial_state is None
              else initial_state.astype(jnp.float32))
        return jnp.zeros((0, h, v.shape[2]), jnp.float32), s0
    return _chunked(q, k, v, g, beta, initial_state, chunk=int(chunk_size), interpret=interpret)


__all__ = ["gated_delta_rule_packed_pallas", "chunk_gated_delta_rule_pallas",
           "check_packed_inputs", "check_chunk_inputs", "DEFAULT_ROWS_PER_BLOCK"]
