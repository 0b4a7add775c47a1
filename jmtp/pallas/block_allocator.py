"""On-device KV-block allocation: one contract, a plain-jnp reference and Pallas kernels.

The engine keeps the paged KV cache's bookkeeping on the device so that a whole engine step stays
one compiled graph with no host round trip. The state is

* a **free stack** ``free_stack i32[N]`` of block ids with ``free_count i32[]`` valid entries
  ``[0, free_count)``; the top of the stack is ``free_stack[free_count - 1]``;
* a **block table** ``block_tables i32[B, P]`` per slot (batch row): slot ``b`` owns the blocks in
  ``block_tables[b, :num_owned[b]]`` (contiguous, in sequence order: position ``p`` of the slot's
  sequence lives in block ``block_tables[b, p // block_size]``), the other entries are ``-1``.

Once per engine step :func:`allocate_blocks` does, in this order (the semantics are defined by
:func:`allocate_blocks_reference`):

1. **Release.** Every slot with ``release[b]`` (finished or preempted) pushes its owned blocks onto
   the stack, slots in increasing ``b``, each slot's blocks in table order (so the slot's last
   block ends up on top). Its table row becomes all ``-1`` and ``num_owned[b] = 0``.
2. **Allocate.** Slots in increasing ``b``: with ``need = num_needed[b] - num_owned[b]``
   (``num_owned`` after the release, so a released slot can be re-filled by a new request in the
   same call), a slot with ``need > 0`` pops ``need`` blocks, the top one first, and appends them
   to its table (``block_tables[b, num_owned[b] + j] = free_stack[free_count - 1 - j]``), all or
   nothing: if fewer than ``need`` blocks are left, or ``num_needed[b] > P`` (it can never fit; the
   host rejects such requests earlier), it gets none and ``paused[b] = True``. Later slots may
   still be served. Popped stack entries are overwritten with ``-1``; stack entries at or past the
   incoming ``free_count`` that are not pushed to are passed through unchanged.
3. Nothing else changes. ``num_needed[b] <= num_owned[b]`` keeps what the slot owns (never
   shrinks).

Invariants kept for a valid input state: a block id is owned by at most one slot and is never both
owned and free; ``free_count + sum(num_owned) == N`` is constant; a paused slot's row and
``num_owned`` are unchanged. An input state that violates the layout (``free_count`` outside
``[0, N]``, ``num_owned`` outside ``[0, P]``) gives a well-defined but meaningless result: counts
are clamped (``free_count`` to ``[0, N]``, a released slot's push count to ``[0, P]`` and to the
room left on the stack) and a slot with ``num_owned < 0`` is never served, so that no
implementation ever reads or writes outside its arrays. All implementations agree bit for bit on
every input, valid or not.

Source of the algorithm: a LIFO free stack of decoder blocks with "free, then allocate" per step is
FastDeploy's V0 allocator (its ``speculate_step_paddle`` op for the target and ``mtp_step_paddle``
for the MTP's decoder blocks). FastDeploy allocates one block per step and evicts inside
the op; jmtp instead tops every slot up to the blocks its next ``K + 1`` positions need, all or
nothing, and leaves preemption to the host (it sees ``paused``). This module is jmtp's own code.

Implementations (``implementation=``):

* ``"reference"``: plain jnp (vectorised scatter/gather, one ``lax.scan`` over the B slots for the
  sequential all-or-nothing decision). Runs everywhere; default on CPU and GPU.
* ``"pallas_tpu"``: Mosaic TPU kernel (:mod:`jmtp.pallas.block_allocator_kernel`), scalar loop over
  slots in SMEM, state updated in place (``input_output_aliases``). Default on TPU. On other
  backends it runs in TPU interpret mode with race detection and out-of-bounds reads raising.
  The whole state lives in SMEM while the kernel runs; a state that needs more than the SMEM
  budget (:func:`jmtp.pallas.block_allocator_kernel.tpu_smem_bytes` above
  :func:`~jmtp.pallas.block_allocator_kernel.tpu_smem_budget_bytes`, e.g. ``max_num_seqs=128`` at
  ``max_model_len=8192, block_size=16`` with the default ``num_blocks``) runs the ``"reference"``
  instead, with a one-time warning (:func:`resolve_implementation`). The choice is static (shapes
  are), so it is made at trace time and never fails there.
* ``"pallas_gpu"``: the same kernel body lowered through the Pallas Triton backend (one program,
  one warp). Not the GPU default yet: it is checked in interpret mode and by lowering to Triton IR
  on CPU, but has not been run on a GPU (see the kernel module for the reasons and the residual
  risk).
"""
from __future__ import annotations

import dataclasses
import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np

from jmtp.core.mesh import manual_replicated
from jmtp.core.platform import host_platform, kernel_interpret

IMPLEMENTATIONS = ("reference", "pallas_tpu", "pallas_gpu")
#: Values of ``EngineConfig.block_allocator`` / ``implementation=``: ``"auto"`` is
#: :func:`default_implementation`.
CHOICES = ("auto",) + IMPLEMENTATIONS

log = logging.getLogger(__name__)
_warned_fallbacks: set[tuple[int, int, int, int]] = set()  # (N, B, P, budget) already warned


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AllocResult:
    """New allocator state (all arrays; a pytree, so it passes through ``jit``)."""
    free_stack: jax.Array    # i32[N]    entries [0, free_count) are the free block ids
    free_count: jax.Array    # i32[]     number of free blocks
    block_tables: jax.Array  # i32[B, P] slot b owns block_tables[b, :num_owned[b]]; the rest is -1
    num_owned: jax.Array     # i32[B]
    paused: jax.Array        # bool[B]   slot needed blocks this step and got none


def _check_array(name: str, x, ndim: int, dtype) -> tuple[int, ...]:
    shape = getattr(x, "shape", None)
    dt = getattr(x, "dtype", None)
    if shape is None or dt is None:
        raise ValueError(f"{name} must be an array, got {type(x).__name__}")
    if len(shape) != ndim:
        raise ValueError(f"{name} must have {ndim} dimension(s), got shape {tuple(shape)}")
    if np.dtype(dt) != np.dtype(dtype):
        raise ValueError(f"{name} must have dtype {np.dtype(dtype).name}, got {np.dtype(dt).name}")
    return tuple(shape)


def validate_inputs(free_stack, free_count, block_tables, num_owned, release, num_needed
                    ) -> tuple[int, int, int]:
    """Trace-time checks of shapes and dtypes; returns ``(N, B, P)``.

    Raises:
      ValueError: naming the first argument whose rank, dtype or shape is inconsistent
        (``free_stack`` must be ``i32[N]`` with ``N >= 1``, ``free_count`` ``i32[]``,
        ``block_tables`` ``i32[B, P]`` with ``B, P >= 1``, ``num_owned`` and ``num_needed``
        ``i32[B]``, ``release`` ``bool[B]``).
    """
    (n,) = _check_array("free_stack", free_stack, 1, jnp.int32)
    _check_array("free_count", free_count, 0, jnp.int32)
    b, p = _check_array("block_tables", block_tables, 2, jnp.int32)
    if n < 1:
        raise ValueError(f"free_stack must hold at least 1 block (N >= 1), got N={n}")
    if b < 1 or p < 1:
        raise ValueError(f"block_tables must be i32[B, P] with B >= 1 and P >= 1, got ({b}, {p})")
    for name, x, dt in (("num_owned", num_owned, jnp.int32), ("release", release, jnp.bool_),
                        ("num_needed", num_needed, jnp.int32)):
        (bx,) = _check_array(name, x, 1, dt)
        if bx != b:
            raise ValueError(f"{name} must have shape [B]=[{b}] (B from block_tables), got [{bx}]")
    if n >= 2**31 - 1 or b * p >= 2**31 - 1:
        raise ValueError(f"N={n} and B*P={b * p} must stay below 2**31 - 1 (int32 indices)")
    return n, b, p


@jax.jit
def allocate_blocks_reference(
    free_stack: jax.Array,    # i32[N]
    free_count: jax.Array,    # i32[]
    block_tables: jax.Array,  # i32[B, P]
    num_owned: jax.Array,     # i32[B]
    release: jax.Array,       # bool[B]
    num_needed: jax.Array,    # i32[B]
) -> AllocResult:
    """Plain-jnp allocator; *defines* the semantics in the module docstring.

    Release is one scatter (offsets from a cumsum over the slots' push counts); the all-or-nothing
    decision is a ``lax.scan`` over the B slots carrying only the free count; the pops are then one
    gather (offsets from a cumsum over the granted counts). Cost O(N + B·P) plus B scan steps.
    """
    n = free_stack.shape[0]
    b, p = block_tables.shape
    i32 = jnp.int32

    # 1. Release: slot b pushes its first pushes[b] blocks at stack[top0 + start[b] + j].
    top0 = jnp.clip(free_count, 0, n).astype(i32)
    want_push = jnp.where(release, jnp.clip(num_owned, 0, p), 0).astype(i32)      # i32[B]
    room = n - top0
    incl = jnp.minimum(jnp.cumsum(want_push), room)                                 # i32[B]
    start = jnp.concatenate([jnp.zeros((1,), i32), incl[:-1]])                      # i32[B]
    pushes = incl - start
    j = jnp.arange(p, dtype=i32)[None, :]                                           # [1, P]
    dst = jnp.where(j < pushes[:, None], top0 + start[:, None] + j, n)              # [B, P]
    stack1 = free_stack.at[dst.reshape(-1)].set(block_tables.reshape(-1), mode="drop")
    top1 = top0 + incl[-1]
    tables1 = jnp.where(release[:, None], -1, block_tables)
    owned1 = jnp.where(release, 0, num_owned).astype(i32)

    # 2. Allocate, slots in order, all or nothing.
    need = num_needed - owned1                                                      # i32[B]
    feasible = (need > 0) & (num_needed <= p) & (owned1 >= 0)

    def decide(top, x):
        nd, ok = x
        fits = ok & (nd <= top)
        return top - jnp.where(fits, nd, 0), fits

    top2, fits = jax.lax.scan(decide, top1, (need, feasible))
    paused = (need > 0) & ~fits
    take = jnp.where(fits, need, 0)                                                 # i32[B]
    taken_before = jnp.cumsum(take) - take                                          # exclusive
    k = j - owned1[:, None]                                                         # [B, P]
    new = (k >= 0) & (k < take[:, None])
    src = jnp.clip(top1 - 1 - taken_before[:, None] - k, 0, n - 1)
    tables2 = jnp.where(new, stack1[src], tables1)
    pos = jnp.arange(n, dtype=i32)
    stack2 = jnp.where((pos >= top2) & (pos < top1), -1, stack1)
    owned2 = jnp.where(fits, num_needed, owned1).astype(i32)
    return AllocResult(free_stack=stack2, free_count=top2.astype(i32), block_tables=tables2,
                       num_owned=owned2, paused=paused)


def default_implementation(platform: str | None = None) -> str:
    """``"pallas_tpu"`` on TPU; ``"reference"`` elsewhere (GPU: see the module docstring).
    ``platform``: the platform compiled for (:mod:`jmtp.core.platform`; None: the host's)."""
    return "pallas_tpu" if (platform or host_platform()) == "tpu" else "reference"


def resolve_implementation(implementation: str | None, num_blocks: int, num_slots: int,
                           pages_per_slot: int, platform: str | None = None) -> str:
    """The implementation :func:`allocate_blocks` runs for a state of these (static) sizes.

    ``None`` and ``"auto"`` mean :func:`default_implementation`. ``"pallas_tpu"`` becomes
    ``"reference"`` when the kernel's SMEM footprint
    (:func:`~jmtp.pallas.block_allocator_kernel.tpu_smem_bytes` of ``(num_blocks, num_slots,
    pages_per_slot)``) exceeds :func:`~jmtp.pallas.block_allocator_kernel.tpu_smem_budget_bytes`;
    a ``logging`` warning with both figures is emitted the first time each size is seen. Both
    implementations give the same result bit for bit, so the fallback only changes speed.
    ``"pallas_gpu"`` keeps its state in GMEM and has no such limit.

    Args:
      implementation: one of :data:`CHOICES` or ``None``.
      num_blocks / num_slots / pages_per_slot: N, B, P of the state (Python ints, >= 1).
      platform: the platform compiled for (None: the host's); picks the ``"auto"`` kernel and
        the SMEM budget (:func:`~jmtp.pallas.block_allocator_kernel.tpu_smem_budget_bytes`).

    Returns:
      One of :data:`IMPLEMENTATIONS`.

    Raises:
      ValueError: ``implementation`` not in :data:`CHOICES` and not ``None``.
    """
    if implementation is not None and implementation not in CHOICES:
        raise ValueError(f"implementation must be one of {CHOICES} or None, got {implementation!r}")
    platform = platform or host_platform()
    impl = (default_implementation(platform) if implementation in (None, "auto")
            else implementation)
    if impl == "pallas_tpu":
        from jmtp.pallas import block_allocator_kernel as kernel
        need = kernel.tpu_smem_bytes(num_blocks, num_slots, pages_per_slot)
        budget = kernel.tpu_smem_budget_bytes(platform)
        if need > budget:
            key = (int(num_blocks), int(num_slots), int(pages_per_slot), int(budget))
            if key not in _warned_fallbacks:
                _warned_fallbacks.add(key)
                log.warning(
                    "pallas_tpu block allocator: the state needs %d bytes of SMEM (num_blocks=%d, "
                    "max_num_seqs=%d, pages_per_seq=%d), over the %d-byte SMEM budget; running the "
                    "'reference' allocator instead (same results)", need, num_blocks, num_slots,
                    pages_per_slot, budget)
            impl = "reference"
    return impl


def allocate_blocks(
    free_stack: jax.Array,    # i32[N]    free block ids; [0, free_count) valid, top free_count-1
    free_count: jax.Array,    # i32[]     number of free blocks
    block_tables: jax.Array,  # i32[B, P] slot b owns entries [0, num_owned[b]); the rest are -1
    num_owned: jax.Array,     # i32[B]
    release: jax.Array,       # bool[B]   return all of the slot's blocks this step
    num_needed: jax.Array,    # i32[B]    blocks the slot must own after this step (0: idle)
    *,
    implementation: str | None = None,
    interpret=None,
    platform: str | None = None,
) -> AllocResult:
    """Release the blocks of finished/preempted slots, then top every slot up to ``num_needed``.

    See the module docstring for the exact semantics, shared by all implementations. Call it inside
    the engine's jitted step; with the state donated, the Pallas kernels update it in place.

    Args:
      implementation: ``"reference" | "pallas_tpu" | "pallas_gpu"``, or ``"auto"``/``None`` for
        :func:`default_implementation`; resolved by :func:`resolve_implementation`, so
        ``"pallas_tpu"`` on a state too large for its SMEM budget runs the reference (with a
        one-time warning) instead of failing.
      platform: the platform the call is compiled for (:mod:`jmtp.core.platform`; None: the
        host's default backend); the engine passes ``EngineConfig.platform``.
      interpret: Pallas kernels only. ``None`` interprets when ``platform`` is not the
        kernel's platform (TPU interpret mode runs with ``detect_races=True`` and
        ``out_of_bounds_reads="raise"``); ``True``/``False`` forces it; for ``pallas_tpu`` a
        ``pltpu.InterpretParams`` is passed through. Interpret mode is slow (TPU: ~0.2-1 s per call
        on CPU at N=64..512 blocks), it is for tests only.

    Returns:
      :class:`AllocResult` (``paused bool[B]``: the slot needed blocks and got none; its row is
      unchanged).

    Raises:
      ValueError: at trace time, on an inconsistent shape or dtype (the message names the
        argument) or an unknown ``implementation``.
    """
    n, b, p = validate_inputs(free_stack, free_count, block_tables, num_owned, release, num_needed)
    platform = platform or host_platform()
    impl = resolve_implementation(implementation, n, b, p, platform)
    if impl == "reference":
        return allocate_blocks_reference(free_stack, free_count, block_tables, num_owned, release,
                                         num_needed)
    from jmtp.pallas import block_allocator_kernel as kernel
    if impl == "pallas_tpu":
        fn = functools.partial(kernel.allocate_blocks_tpu,
                               interpret=kernel_interpret("tpu", platform) if interpret is None
                               else interpret)
    else:
        fn = functools.partial(kernel.allocate_blocks_gpu,
                               interpret=kernel_interpret("gpu", platform) if interpret is None
                               else interpret)
    # On a mesh a kernel cannot be partitioned automatically (Mosaic refuses): every axis still
    # automatic here becomes manual, the (small) allocator state replicated over it.
    fn = manual_replicated(fn, num_outputs=5)
    stack, count, tables, owned, paused = fn(free_stack, free_count, block_tables, num_owned,
                                             release, num_needed)
    return AllocResult(free_stack=stack, free_count=count, block_tables=tables, num_owned=owned,
                       paused=paused)


def init_allocator_state(num_blocks: int, num_slots: int, pages_per_slot: int
                         ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Empty state: every block free (block 0 on top, so it is handed out first), no slot owns any.

    Returns ``(free_stack i32[N], free_count i32[], block_tables i32[B, P], num_owned i32[B])``.

    Raises:
      ValueError: if any size is < 1.
    """
    for name, v in (("num_blocks", num_blocks), ("num_slots", num_slots),
                    ("pages_per_slot", pages_per_slot)):
        if int(v) < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")
    return (jnp.arange(num_blocks - 1, -1, -1, dtype=jnp.int32),
            jnp.asarray(num_blocks, jnp.int32),
            jnp.full((num_slots, pages_per_slot), -1, jnp.int32),
            jnp.zeros((num_slots,), jnp.int32))


def check_state(free_stack, free_count, block_tables, num_owned) -> None:
    """Host-side (numpy) check of a *valid* allocator state; for tests and debugging.

    Checks: ``0 <= free_count <= N``; ``0 <= num_owned[b] <= P``; owned entries and free entries are
    block ids in ``[0, N)``, each id appearing exactly once across them (so no block is owned twice
    or both owned and free, and ``free_count + sum(num_owned) == N``); table entries past
    ``num_owned[b]`` are ``-1``.

    Raises:
      ValueError: describing the first violated invariant.
    """
    fs = np.asarray(free_stack)
    fc = int(np.asarray(free_count))
    bt = np.asarray(block_tables)
    no = np.asarray(num_owned)
    n = fs.shape[0]
    b, p = bt.shape
    if not 0 <= fc <= n:
        raise ValueError(f"free_count={fc} outside [0, {n}]")
    if (no < 0).any() or (no > p).any():
        raise ValueError(f"num_owned outside [0, {p}]: {no.tolist()}")
    col = np.arange(p)[None, :]
    owned_mask = col < no[:, None]
    if (bt[~owned_mask] != -1).any():
        raise ValueError("block_tables has entries != -1 past num_owned")
    ids = np.concatenate([fs[:fc], bt[owned_mask]])
    if ((ids < 0) | (ids >= n)).any():
        raise ValueError(f"block ids outside [0, {n}) in the free stack or the tables")
    counts = np.bincount(ids, minlength=n)
    if (counts != 1).any():
        dup = np.nonzero(counts > 1)[0].tolist()
        lost = np.nonzero(counts == 0)[0].tolist()
        raise ValueError(f"blocks held twice: {dup}; blocks lost: {lost}")


def blocks_needed(num_positions, block_size: int):
    """KV blocks that cover ``num_positions`` positions: ``ceil(num_positions / block_size)``.

    The one formula shared by the host (request validation, admission), the engine config
    (block-table width) and the device allocator (each step's top-up); works on Python ints and on
    integer arrays alike (``i32[B] -> i32[B]``).
    """
    return -(-num_positions // block_size)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BlockAllocatorState:
    """The allocator's state as one pytree (every field is data; shapes are static).

    Attributes:
      free_stack: i32[N]       free block ids; entries ``[0, free_count)`` valid, top at
                               ``free_count - 1``.
      free_count: i32[]        number of free blocks.
      block_tables: i32[B, P]  slot b owns ``block_tables[b, :num_owned[b]]``; the rest is -1.
      num_owned: i32[B]        blocks each slot owns.
    """

    free_stack: jax.Array
    free_count: jax.Array
    block_tables: jax.Array
    num_owned: jax.Array

    @classmethod
    def create(cls, num_blocks: int, num_slots: int, pages_per_slot: int,
               top_first: bool = False) -> "BlockAllocatorState":
        """Every block free, no slot owns any. ``top_first=False`` stacks ``arange(N)`` (block
        ``N - 1`` is handed out first, the engine's order); ``True`` is
        :func:`init_allocator_state`'s order (block 0 first).

        Raises:
          ValueError: if any size is < 1.
        """
        fs, fc, bt, no = init_allocator_state(num_blocks, num_slots, pages_per_slot)
        if not top_first:
            fs = fs[::-1]
        return cls(free_stack=fs, free_count=fc, block_tables=bt, num_owned=no)

    def allocate(self, release: jax.Array, num_needed: jax.Array, *,
                 implementation: str | None = None, platform: str | None = None
                 ) -> tuple["BlockAllocatorState", jax.Array]:
        """:func:`allocate_blocks` on this state: release ``bool[B]`` slots, then top every slot
        up to ``num_needed i32[B]`` blocks, all or nothing. Returns ``(new state, paused bool[B])``.
        ``implementation``: one of :data:`CHOICES` or ``None`` (the engine passes
        ``EngineConfig.block_allocator``); ``platform``: as :func:`allocate_blocks`.

        Raises:
          ValueError: at trace time, as :func:`allocate_blocks`.
        """
        r = allocate_blocks(self.free_stack, self.free_count, self.block_tables, self.num_owned,
                            release, num_needed, implementation=implementation,
                            platform=platform)
        return BlockAllocatorState(free_stack=r.free_stack, free_count=r.free_count,
                                   block_tables=r.block_tables, num_owned=r.num_owned), r.paused
