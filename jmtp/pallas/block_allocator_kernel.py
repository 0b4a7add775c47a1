"""Pallas kernels for :func:`jmtp.pallas.block_allocator.allocate_blocks` (TPU and GPU).

Both kernels run the same scalar body, :func:`_allocator_body`: one serial pass over the B slots
for the release (push) and one for the allocation (pop), exactly the semantics of
:func:`jmtp.pallas.block_allocator.allocate_blocks_reference`. The work is O(pushed + popped blocks
+ B + P·released slots) scalar operations, no vector work at all: block bookkeeping is inherently
serial (each slot's all-or-nothing decision depends on what the earlier slots took), tiny (B <= a
few hundred slots) and runs once per engine step.

TPU (Mosaic), :func:`allocate_blocks_tpu`:

* ``free_stack`` and the flattened ``block_tables`` stay in HBM (``memory_space=ANY``), aliased
  input to output; the kernel DMAs each whole into an SMEM scratch buffer, works there with scalar
  loads and stores, and DMAs it back. ``free_count``, ``num_owned``, ``release``, ``num_needed``
  and ``paused`` are small SMEM blocks (``free_count`` and ``num_owned`` aliased too).
* SMEM footprint: ``4·(N + B·P + 5·B + 2)`` bytes (:func:`tpu_smem_bytes`), bounded by
  :func:`tpu_smem_budget_bytes` (half the core's SMEM: 512 KiB from TPU v4 on). Already
  ``max_num_seqs=128`` at ``max_model_len=8192, block_size=16`` (P=512) with the default
  N = B·P = 65536 blocks needs 526,856 bytes, just over. ``allocate_blocks`` then runs the jnp
  reference instead (:func:`jmtp.pallas.block_allocator.resolve_implementation`);
  :func:`allocate_blocks_tpu` itself refuses such a state. A windowed variant that DMAs only the
  touched stack range and table rows would lift the limit (not written).
* Bools are passed as int32: SMEM holds 32-bit words.

GPU, :func:`allocate_blocks_gpu`, Pallas **Triton** backend, ``grid=(1,)``, ``num_warps=1``:

* Why Triton and not Mosaic GPU: the body is a serial scalar loop over global memory. Triton's
  program model (one logical thread of control per program) matches it directly; Mosaic GPU is
  organised around warpgroups, SMEM/TMA pipelines and wgmma, where a scalar read-modify-write loop
  on GMEM by 128 threads would need explicit single-thread predication that cannot be validated
  without a GPU. Known cost: JAX 0.11 deprecates the Pallas Triton backend; when it goes, the GPU
  path falls back to the reference (an XLA ``scan`` over B slots) or gets a Mosaic GPU port of the
  same body.
* The state lives in GMEM, aliased input to output, so the kernel touches only the entries it
  changes.
* Memory ordering: all threads of the one warp run the same uniform scalar code; a
  ``debug_barrier`` (``bar.sync``, which also orders the CTA's memory accesses) separates the
  release phase (writes the pushed stack entries and ``num_owned``) from the allocation phase
  (reads them), so every read-after-write across phases is ordered. Within a phase no location is
  written and then read again. Residual, unverified risk: this kernel has been run in interpret
  mode and lowered to Triton IR on CPU only, never on a GPU — that is why ``allocate_blocks`` does
  not pick it by default.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

#: SMEM the TPU kernel may use, in bytes, when the chip's own size is unknown (interpret mode):
#: half of the 1 MiB per-TensorCore SMEM of TPU v4, v5e, v5p, v6e and v7x (``smem_capacity_bytes``
#: of ``jax.experimental.pallas.tpu.get_tpu_info()``, jax 0.10; 16 KiB on v2/v3). The other half
#: is headroom for what Mosaic and XLA place in SMEM themselves and for alignment padding.
TPU_SMEM_BUDGET_BYTES = 512 * 1024


def tpu_smem_bytes(num_blocks: int, num_slots: int, pages_per_slot: int) -> int:
    """SMEM bytes the TPU kernel (:func:`allocate_blocks_tpu`) needs: ``4·(N + B·P + 5·B + 2)``.

    Every SMEM buffer of the kernel holds int32 words (4 bytes); with N = ``num_blocks``,
    B = ``num_slots``, P = ``pages_per_slot``:

    * scratch: the free stack ``N`` and the flattened block tables ``B·P`` (DMA'd in from HBM);
    * inputs: ``free_count`` 1, ``num_owned`` B, ``release`` B (bool as int32), ``num_needed`` B;
    * outputs: ``free_count`` 1, ``num_owned`` B, ``paused`` B.

    ``free_count`` and ``num_owned`` are aliased input to output but counted twice (an upper
    bound: whether Mosaic shares the two buffers is not relied on). Alignment padding of each
    buffer is not counted (it is covered by the budget's headroom).

    Args:
      num_blocks, num_slots, pages_per_slot: N, B, P (Python ints).

    Returns:
      bytes (int).
    """
    return 4 * (num_blocks + num_slots * pages_per_slot + 5 * num_slots + 2)


def tpu_smem_budget_bytes(platform: str | None = None) -> int:
    """SMEM bytes the TPU kernel may use: :data:`TPU_SMEM_BUDGET_BYTES` (read at call time), and
    when compiling for TPU on a TPU host at most half the core's ``smem_capacity_bytes``
    (``pltpu.get_tpu_info()``; the constant alone if that query fails, or when compiling ahead
    of time from another host, :mod:`jmtp.aot`). ``platform``: the platform compiled for (None:
    the host's)."""
    budget = TPU_SMEM_BUDGET_BYTES
    if (platform or "tpu") == "tpu" and jax.default_backend() == "tpu":
        try:
            from jax.experimental.pallas import tpu as pltpu
            budget = min(budget, int(pltpu.get_tpu_info().smem_capacity_bytes) // 2)
        except Exception:  # pragma: no cover - unknown chip / jax API change: keep the constant
            pass
    return budget


def _allocator_body(stack, count, tables, owned, release, needed, paused, *,
                    capacity: int, num_slots: int, pages: int, phase_barrier=None):
    """Serial allocator on refs (all int32, 1-D): the contract of ``allocate_blocks_reference``.

    Refs (read/write unless noted): ``stack[N]``, ``count[1]``, ``tables[B*P]`` (row-major
    ``[B, P]``), ``owned[B]``, ``release[B]`` (read; nonzero = release), ``needed[B]`` (read),
    ``paused[B]`` (written: 1 = paused). Every index is bounded for any input values.
    """
    n_cap, p = capacity, pages
    i32 = jnp.int32
    zero, one = i32(0), i32(1)

    # ---- 1. release: push each released slot's blocks (table order), clear its row.
    def release_slot(b, top):
        rel = release[b] != 0
        n = jnp.where(rel, jnp.clip(owned[b], 0, p), zero)
        n = jnp.minimum(n, n_cap - top)
        base = b * p

        def push(j, t):
            stack[t] = tables[base + j]
            return t + 1

        top = lax.fori_loop(zero, n, push, top)

        @pl.when(rel)
        def _():
            def clear(j, c):
                tables[base + j] = i32(-1)
                return c

            lax.fori_loop(0, p, clear, zero)
            owned[b] = zero

        return top

    top = lax.fori_loop(0, num_slots, release_slot, jnp.clip(count[0], 0, n_cap))
    if phase_barrier is not None:
        phase_barrier()

    # ---- 2. allocate: slots in order, all or nothing, the top of the stack first.
    def alloc_slot(b, top):
        have = owned[b]
        want = needed[b]
        need = want - have
        fits = (need > 0) & (want <= p) & (have >= 0) & (need <= top)
        paused[b] = jnp.where((need > 0) & ~fits, one, zero)
        n = jnp.where(fits, need, zero)
        base = b * p + have

        def pop(j, c):
            src = top - 1 - j
            tables[base + j] = stack[src]
            stack[src] = i32(-1)
            return c

        lax.fori_loop(zero, n, pop, zero)

        @pl.when(fits)
        def _():
            owned[b] = want

        return top - n

    count[0] = lax.fori_loop(0, num_slots, alloc_slot, top)


def _split(free_stack, free_count, block_tables, num_owned, release, num_needed):
    n = free_stack.shape[0]
    b, p = block_tables.shape
    args = (free_stack, free_count.reshape(1), block_tables.reshape(b * p), num_owned,
            release.astype(jnp.int32), num_needed)
    out_shape = (jax.ShapeDtypeStruct((n,), jnp.int32), jax.ShapeDtypeStruct((1,), jnp.int32),
                 jax.ShapeDtypeStruct((b * p,), jnp.int32), jax.ShapeDtypeStruct((b,), jnp.int32),
                 jax.ShapeDtypeStruct((b,), jnp.int32))
    return n, b, p, args, out_shape


def _join(outs, b, p):
    stack, count, tables, owned, paused = outs
    return stack, count.reshape(()), tables.reshape(b, p), owned, paused != 0


def default_tpu_interpret_params():
    """TPU interpret mode used on non-TPU backends: race detector on, out-of-bounds reads raise."""
    from jax.experimental.pallas import tpu as pltpu
    return pltpu.InterpretParams(detect_races=True, out_of_bounds_reads="raise")


@functools.partial(jax.jit, static_argnames=("interpret",))
def allocate_blocks_tpu(free_stack, free_count, block_tables, num_owned, release, num_needed, *,
                        interpret=False):
    """Mosaic TPU kernel. Arguments as ``allocate_blocks`` (already validated).

    Args:
      interpret: ``False`` (compile for TPU), ``True`` (interpret with
        :func:`default_tpu_interpret_params`) or a ``pltpu.InterpretParams``.

    Returns:
      ``(free_stack i32[N], free_count i32[], block_tables i32[B, P], num_owned i32[B],
      paused bool[B])``.

    Raises:
      ValueError: if the state needs more than :func:`tpu_smem_budget_bytes` of SMEM
        (``allocate_blocks`` never calls it with such a state: it runs the reference instead).
    """
    from jax.experimental.pallas import tpu as pltpu

    n, b, p, args, out_shape = _split(free_stack, free_count, block_tables, num_owned, release,
                                      num_needed)
    smem, budget = tpu_smem_bytes(n, b, p), tpu_smem_budget_bytes()
    if smem > budget:
        raise ValueError(
            f"pallas_tpu allocator state needs {smem} bytes of SMEM (free_stack N={n}, "
            f"block_tables B*P={b}*{p}), over the {budget}-byte budget; use "
            "implementation='reference'")

    def kernel(stack_in, count_in, tables_in, owned_in, release_ref, needed_ref,
               stack_out, count_out, tables_out, owned_out, paused_ref, stack_s, tables_s):
        pltpu.sync_copy(stack_in, stack_s)
        pltpu.sync_copy(tables_in, tables_s)
        count_out[0] = count_in[0]

        def copy_owned(i, c):
            owned_out[i] = owned_in[i]
            return c

        lax.fori_loop(0, b, copy_owned, 0)
        _allocator_body(stack_s, count_out, tables_s, owned_out, release_ref, needed_ref,
                        paused_ref, capacity=n, num_slots=b, pages=p)
        pltpu.sync_copy(stack_s, stack_out)
        pltpu.sync_copy(tables_s, tables_out)

    hbm = pl.BlockSpec(memory_space=pl.ANY)
    smem_spec = pl.BlockSpec(memory_space=pltpu.SMEM)
    if interpret is True:
        interpret = default_tpu_interpret_params()
    outs = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        in_specs=[hbm, smem_spec, hbm, smem_spec, smem_spec, smem_spec],
        out_specs=(hbm, smem_spec, hbm, smem_spec, smem_spec),
        scratch_shapes=[pltpu.SMEM((n,), jnp.int32), pltpu.SMEM((b * p,), jnp.int32)],
        input_output_aliases={0: 0, 1: 1, 2: 2, 3: 3},
        interpret=interpret or False,
        name="jmtp_allocate_blocks_tpu",
    )(*args)
    return _join(outs, b, p)


@functools.partial(jax.jit, static_argnames=("interpret",))
def allocate_blocks_gpu(free_stack, free_count, block_tables, num_owned, release, num_needed, *,
                        interpret=False):
    """Pallas Triton kernel (one program, one warp). Arguments and returns as
    :func:`allocate_blocks_tpu`; ``interpret=True`` runs Pallas' generic interpreter."""
    from jax.experimental.pallas import triton as pltriton

    n, b, p, args, out_shape = _split(free_stack, free_count, block_tables, num_owned, release,
                                      num_needed)
    barrier = None if interpret else pltriton.debug_barrier

    def kernel(stack_in, count_in, tables_in, owned_in, release_ref, needed_ref,
               stack, count, tables, owned, paused_ref):
        del stack_in, count_in, tables_in, owned_in  # aliased with the outputs: same memory
        _allocator_body(stack, count, tables, owned, release_ref, needed_ref, paused_ref,
                        capacity=n, num_slots=b, pages=p, phase_barrier=barrier)

    outs = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(1,),
        input_output_aliases={0: 0, 1: 1, 2: 2, 3: 3},
        compiler_params=pltriton.CompilerParams(num_warps=1, num_stages=1),
        interpret=bool(interpret),
        name="jmtp_allocate_blocks_gpu",
    )(*args)
    return _join(outs, b, p)
