"""The process's memory-map budget, which XLA:CPU's compiled code uses up.

XLA:CPU links every kernel of a compiled executable (about one per fusion) into its own small
memory mappings: a code page, a read-only page and a data page. An executable keeps them while it
is alive, and an executable loaded from the persistent compilation cache is linked the same way.
Linux caps a process's mappings at ``vm.max_map_count`` (65,530 by default). Past it, LLVM's
allocation fails inside XLA, and XLA aborts the whole process ("LLVM ERROR: Unable to allocate
section memory!"): no Python exception, and every request in flight is lost.

Measured on the 2-core dev VM (jaxlib 0.10.2; SmolLM2-135M, 30 layers, unrolled, one slot,
``/proc/self/maps``): about 2,500 mappings for the first two step buckets; an engine compiled
eagerly holds ~9,450 (plain decoding, 12 buckets) to ~15,300 (n-gram K=7). So four (n-gram K=7) to
about seven (plain) such engines in one process, or one engine with several times as many buckets or
layers, reach the default limit. ``LLM(layer_loop="scan")`` compiles each layer's kernels once
instead of once per layer: ~5,500 mappings for the plain engine.

:class:`MapBudget` turns that abort into a :class:`MapLimitError` raised before the compile
that would cross the limit. It measures how many mappings each compile adds and refuses a compile
when the mappings in use plus the estimate would leave less than :data:`RESERVE` of the limit:
for the next compile the most any measured compile added, for each one after it the fewest (so a
projection over many buckets errs towards letting them through, and each compile is checked
again before it starts). Before anything is measured it refuses only when the mappings in use
already leave less than the reserve. Off Linux (no ``/proc``) it checks nothing. A budget is
per engine and not thread-safe: engines compiling in several threads at once can each pass
their check together.
"""
from __future__ import annotations

#: Mappings kept free for everything else the process maps (thread stacks, files, NumPy).
RESERVE = 2048

MAPS = "/proc/self/maps"
LIMIT = "/proc/sys/vm/max_map_count"


def map_count() -> int | None:
    """The number of memory mappings of this process (lines of ``/proc/self/maps``), or None
    where there is no ``/proc``."""
    try:
        with open(MAPS, "rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return None


def map_limit() -> int | None:
    """Linux's ``vm.max_map_count`` (the most mappings a process may hold), or None where it
    cannot be read."""
    try:
        with open(LIMIT) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


#: Mappings one step bucket's compile adds, for the estimate of :func:`engine_maps` (measured
#: with jaxlib 0.10.2's default flags, SmolLM2-135M plain decoding, 15 buckets at max_num_seqs=8:
#: ~750 per bucket with ``layer_loop="scan"``, ~1,090 unrolled over its 30 layers, i.e. ~12 per
#: further unrolled layer; the first bucket adds ~600 more). Rounded up by about a third: an
#: MTP step has more kernels than a plain one.
SCAN_BUCKET_MAPS = 1000
UNROLLED_LAYER_MAPS = 16
FIRST_COMPILE_MAPS = 800


def engine_maps(num_buckets: int, num_layers: int, unrolled: bool) -> int:
    """Estimated memory mappings an engine's ``num_buckets`` step buckets hold once compiled, for
    a target of ``num_layers`` layers run as a scan or unrolled (constants above)."""
    per = SCAN_BUCKET_MAPS + (UNROLLED_LAYER_MAPS * max(num_layers - 1, 0) if unrolled else 0)
    return FIRST_COMPILE_MAPS + num_buckets * per


def free_maps() -> int | None:
    """Mappings this process may still add before :data:`RESERVE` of ``vm.max_map_count`` is
    reached (None where there is nothing to count)."""
    limit, used = map_limit(), map_count()
    return None if limit is None or used is None else limit - RESERVE - used


class MapLimitError(RuntimeError):
    """Compiling another executable would exceed ``vm.max_map_count``; XLA would abort the
    process. Raised before the compile; what this process compiled so far stays usable."""


class MapBudget:
    """Measures the mappings each compile adds and refuses a compile that would cross the limit.

    Use::

        budget = MapBudget("step bucket")
        budget.check(label)          # raises MapLimitError if the next compile would not fit
        budget.start(); compile(); budget.stop()

    Args:
      what: what one compile makes, for the error message (e.g. ``"step bucket"``).
      limit: the process's map limit (default :func:`map_limit`; None: check nothing).
      count: a function returning the mappings in use (default :func:`map_count`).
    """

    def __init__(self, what: str, *, limit: int | None = -1, count=map_count):
        self.what = what
        self.limit = map_limit() if limit == -1 else limit
        self._count = count
        self._before: int | None = None
        self.added: list[int] = []   # mappings added by each measured compile

    @property
    def per_compile(self) -> int:
        """The fewest mappings a measured compile added, leaving out compiles that added none
        (JAX reused an executable it held); 0 before any."""
        return min((n for n in self.added if n > 0), default=0)

    def need(self, remaining: int) -> int:
        """Mappings ``remaining`` more compiles are estimated to add: the most one measured
        compile added, plus :attr:`per_compile` for each of the others."""
        if remaining < 1 or not self.per_compile:
            return 0
        return max(self.added) + self.per_compile * (remaining - 1)

    def check(self, label, remaining: int = 1) -> None:
        """Raise if ``remaining`` more compiles (:meth:`need`) would leave fewer than
        :data:`RESERVE` mappings of the limit.

        Args:
          label: the next compile's name, for the message.
          remaining: compiles still to come, this one included (>= 1).

        Raises:
          MapLimitError: they would not fit; the message gives the counts and the ways out.
        """
        if self.limit is None:
            return
        used = self._count()
        if used is None:
            return
        need = self.need(remaining)
        if used + need <= self.limit - RESERVE:
            return
        more = f"{remaining} more {self.what}s" if remaining > 1 else f"{self.what} {label}"
        measured = (f"{self.per_compile}-{max(self.added)} per {self.what}, measured"
                    if need else "none measured yet")
        raise MapLimitError(
            f"compiling {more} needs ~{need} more memory mappings ({measured}): {used} are in "
            f"use and vm.max_map_count is {self.limit}, keeping {RESERVE} in reserve. XLA:CPU "
            f"would abort the process past the limit (it maps every compiled kernel on its "
            f"own). Use compile='lazy' (only the buckets in use get compiled), "
            f"layer_loop='scan' (each layer's kernels compiled once), fewer engines per "
            f"process, a smaller max_num_seqs or max_num_batched_tokens (fewer step buckets), "
            f"or raise the limit: sysctl -w vm.max_map_count=262144")

    def start(self) -> None:
        """Mark the mappings in use before a compile."""
        self._before = self._count() if self.limit is not None else None

    def stop(self) -> None:
        """Record the mappings the compile since :meth:`start` added."""
        if self._before is not None:
            after = self._count()
            if after is not None:
                self.added.append(max(after - self._before, 0))
        self._before = None
