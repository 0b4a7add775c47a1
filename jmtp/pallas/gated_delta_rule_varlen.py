"""The engine's multi-slot chunked prefill of the gated delta rule as a Pallas TPU (Mosaic) kernel:
varlen over chunk-aligned slots.

Contract: :func:`jmtp.model.gated_deltanet.chunk_gated_delta_rule_varlen` (this module does not
import it, the package layering forbids it). The engine lays a step's long prefill chunks out so
that each slot's rows start at a chunk boundary (``gated_delta_rule_mixed``): ``n`` chunks of
``C`` rows, chunk ``i`` belonging to slot ``chunk_seq[i]`` (slots in increasing order, the chunks
of no slot after them, all-zero rows), ``chunk_first`` marking a slot's first chunk and
``chunk_last`` its last. The kernel returns every row's output and each slot's state after its
last chunk.

Algorithm: the WY/UT form of the gated delta rule (Yang, Kautz & Hatamizadeh 2024, arXiv
2412.06464), chunk by chunk exactly as :func:`jmtp.pallas.gated_delta_rule.chunk_step_vmem` (the
single-sequence kernel's chunk; its forward substitution and the reason for it are in that
module's docstring).

Grid ``(H, n)``: value heads ``"parallel"``, chunks ``"arbitrary"`` (sequential: the state is
carried in a VMEM scratch ``f32[Dk, Dv]`` from one chunk of a slot to the next). The chunk
metadata ``chunk_seq``, ``chunk_first`` (``i32[n]`` each) is scalar-prefetched into SMEM and used
by the index maps:

* ``init`` is read through a BlockSpec whose block is ``(chunk_seq[i], h)``, so Pallas DMAs the
  slot's initial state tile into VMEM only when the slot changes; a first chunk copies it into
  the scratch state;
* the final states are an output with the same block index: every chunk writes the state after
  it into the block, and Pallas writes the block back to HBM when the slot changes, so each
  slot's block ends holding the state after its last chunk (``chunk_last`` needs no test in the
  kernel). A slot without chunks keeps an unwritten block (unspecified, as in the contract).
  Chunks of no slot carry slot ``B - 1`` and zero rows, which leave the state unchanged.

Rows are tiled as in :mod:`jmtp.pallas.gated_delta_rule` (the packed ``[T, H·D]`` view when ``D``
is a multiple of 128, else head-major). ``interpret``: as there.

Verified (``tests/pallas/test_gated_delta_rule_varlen.py``): equal to the jnp reference in TPU
interpret mode (uninitialised memory NaN, out-of-bounds reads raising), and compiled with
libtpu's Mosaic compiler for a TPU topology ahead of time; the engine's step with it compiles for
``v5e:1x1`` (``tests/test_aot.py``). Not run on TPU hardware.
"""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jmtp.pallas.gated_delta_rule import (_check_rows, _expect, _from_head_tiles, _head_tiles,
                                          _interpret, _tile_spec, _tiled_shape, chunk_step_vmem)


def check_varlen_inputs(q, k, v, g, beta, chunk_seq, chunk_first, chunk_last, init) -> int:
    """Validate :func:`chunk_gated_delta_rule_varlen_pallas`'s arguments; returns ``C``.

    Expected: ``q, k f[n·C, H, Dk]``, ``v f[n·C, H, Dv]``, ``g, beta f[n·C, H]``,
    ``chunk_seq i32[n]``, ``chunk_first, chunk_last bool[n]`` (or integer), ``init f[B, H, Dk,
    Dv]``, with ``n >= 1`` dividing the rows.

    Raises:
      ValueError: naming the first inconsistent argument.
    """
    t, h, dk, dv = _check_rows(q, k, v, g, beta)
    n = tuple(getattr(chunk_seq, "shape", ()))[:1]
    if len(n) != 1 or n[0] < 1 or t % n[0]:
        raise ValueError(f"chunk_seq must be i32[n] with n >= 1 dividing the {t} rows, got shape "
                         f"{tuple(getattr(chunk_seq, 'shape', ()))}")
    _expect("chunk_seq", chunk_seq, n, "int", " [n]")
    _expect("chunk_first", chunk_first, n, "int_or_bool", " [n]")
    _expect("chunk_last", chunk_last, n, "int_or_bool", " [n]")
    b = tuple(getattr(init, "shape", ()))[:1] or (1,)
    _expect("init", init, (b[0], h, dk, dv), "float", " [B, H, Dk, Dv]")
    return t // n[0]


def _varlen_kernel(
    seq_ref, first_ref,        # scalar prefetch (SMEM) i32[n]
    q_ref, k_ref,              # VMEM f32[C, Dk]
    v_ref,                     # VMEM f32[C, Dv]
    b_ref, gc_ref,             # VMEM f32[C, 1] beta, cumulative decay (column)
    gr_ref,                    # VMEM f32[1, C] cumulative decay (row)
    s0_ref,                    # VMEM f32[Dk, Dv] the chunk's slot's initial state
    o_ref,                     # VMEM f32[C, Dv]
    sf_ref,                    # VMEM f32[Dk, Dv] the chunk's slot's final state
    s_ref, a_ref, t_ref,       # scratch: state, A, (I + A)^-1
    *, chunk: int,
):
    i = pl.program_id(1)

    @pl.when(first_ref[i] != 0)
    def _():
        s_ref[...] = s0_ref[...]

    s = chunk_step_vmem(q_ref, k_ref, v_ref, b_ref, gc_ref, gr_ref, s_ref[...], o_ref, a_ref,
                        t_ref, chunk)
    s_ref[...] = s
    sf_ref[...] = s


@functools.partial(jax.jit, static_argnames=("chunk", "interpret"))
def _varlen(q, k, v, g, beta, chunk_seq, chunk_first, init, *, chunk, interpret):
    t, h, dk = q.shape
    dv = v.shape[2]
    b_slots = init.shape[0]
    f32 = jnp.float32
    c, n = chunk, t // chunk
    seq = jnp.clip(chunk_seq.astype(jnp.int32), 0, b_slots - 1)
    first = (chunk_first.astype(jnp.int32) != 0).astype(jnp.int32)
    q, k, v, g, beta = (a.astype(f32) for a in (q, k, v, g, beta))
    gc = jnp.cumsum(g.reshape(n, c, h), axis=1)                          # [n, C, H]
    gcol = gc.reshape(n * c, h).T[..., None]                             # [H, T, 1]
    grow = gc.transpose(2, 0, 1)[:, :, None, :]                          # [H, n, 1, C]
    bcol = beta.T[..., None]                                             # [H, T, 1]
    qw, q_spec = _head_tiles(q, c)
    kw, k_spec = _head_tiles(k, c)
    vw, v_spec = _head_tiles(v, c)
    col_spec = pl.BlockSpec((None, c, 1), lambda hh, i, *_: (hh, i, 0))
    row_spec = pl.BlockSpec((None, None, 1, c), lambda hh, i, *_: (hh, i, 0, 0))
    slot_spec = pl.BlockSpec((None, None, dk, dv), lambda hh, i, sq, _: (sq[i], hh, 0, 0))
    o_spec, o_shape = _tile_spec(dv, c), _tiled_shape(t, h, dv)
    o, final = pl.pallas_call(
        functools.partial(_varlen_kernel, chunk=c),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(h, n),
            in_specs=[q_spec, k_spec, v_spec, col_spec, col_spec, row_spec, slot_spec],
            out_specs=[o_spec, slot_spec],
            scratch_shapes=[pltpu.VMEM((dk, dv), f32), pltpu.VMEM((c, c), f32),
                            pltpu.VMEM((c, c), f32)]),
        out_shape=[jax.ShapeDtypeStruct(o_shape, f32),
                   jax.ShapeDtypeStruct((b_slots, h, dk, dv), f32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=interpret,
        name="jmtp_chunk_gated_delta_rule_varlen_tpu",
    )(seq, first, qw, kw, vw, bcol, gcol, grow, init.astype(f32))
    return _from_head_tiles(o, t, h, dv), final


def chunk_gated_delta_rule_varlen_pallas(q, k, v, g, beta, chunk_seq, chunk_first, chunk_last,
                                         init, *, interpret: Any = None):
    """Pallas-TPU chunked gated delta rule over chunk-aligned slots; the contract of
    :func:`jmtp.model.gated_deltanet.chunk_gated_delta_rule_varlen` (module docstring).

    Args:
      q, k: ``f[n·C, H, Dk]`` prepared; v: ``f[n·C, H, Dv]``; g, beta: ``f[n·C, H]``.
      chunk_seq: ``i32[n]``; chunk_first, chunk_last: ``bool[n]`` (``chunk_last`` is implied by
        the layout: a slot's chunks are contiguous).
      init: ``f[B, H, Dk, Dv]``.
      interpret: None (interpret unless the host is a TPU), a bool or a
        ``pltpu.InterpretParams``.

    Returns:
      ``(o f32[n·C, H, Dv], final f32[B, H, Dk, Dv])``.

    Raises:
      ValueError: inconsistent shapes or dtypes (:func:`check_varlen_inputs`), a bad
        ``interpret``.
    """
    c = check_varlen_inputs(q, k, v, g, beta, chunk_seq, chunk_first, chunk_last, init)
    del chunk_last
    return _varlen(q, k, v, g, beta, chunk_seq, chunk_first, init, chunk=c,
                   interpret=_interpret(interpret))


__all__ = ["chunk_gated_delta_rule_varlen_pallas", "check_varlen_inputs"]
