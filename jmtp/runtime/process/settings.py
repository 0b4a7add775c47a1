"""What jmtp changes process-wide, in one place, and when.

``import jmtp`` changes nothing process-wide. The settings below are the process's, not one
engine's, so they are made at explicit points:

* **Building an engine** (``LLM(...)``, ``LLMEngine(...)``: :func:`prepare_process`):
  glibc's malloc settings for XLA:CPU's per-step scratch (:func:`tune_malloc`,
  :mod:`jmtp.runtime.process.host_malloc`; ``JMTP_MALLOC_TUNING=0`` opts out; full effect only before a
  JAX backend has started, since threads keep the malloc arena they started with) and JAX's
  persistent compilation cache folder (:func:`jmtp.runtime.process.compile.setup_compilation_cache`,
  the ``compilation_cache_dir`` argument; ``None`` leaves JAX's configuration alone).
* **The command line** (``jmtp generate | chat | serve``), first thing, before any JAX backend
  starts: :func:`tune_malloc`, and for ``generate`` / ``chat`` with scanned layers XLA:CPU's
  faster compile flag (:func:`jmtp.runtime.process.compile.use_fast_cpu_compiles`).
* **Serving** (:func:`jmtp.runtime.serve.server.serve`, so ``jmtp serve``, and the other
  processes of ``jmtp launch -- serve`` before they follow process 0), once the engine is built
  (and, under the default ``--compile eager``, compiled), before the first request:
  :func:`freeze_heap` (``JMTP_GC_FREEZE=0`` opts out).
* **Your call only**: ``jax.distributed`` (:func:`jmtp.runtime.process.distributed.initialize`, or
  ``jmtp launch``) and the multi-process helpers (:mod:`jmtp.core.multihost`: barriers and
  checks over the distributed client).
* **Read only**: the memory-map budget (:mod:`jmtp.runtime.process.host_maps` reads
  ``vm.max_map_count`` and ``/proc/self/maps``; it changes nothing, it refuses compiles that would
  cross the limit).
"""
from __future__ import annotations

import gc
import logging
import os
import time
import warnings

from jmtp.runtime.process import host_malloc

log = logging.getLogger(__name__)


def tune_malloc() -> bool:
    """Apply the malloc settings of :mod:`jmtp.runtime.process.host_malloc` where they help (XLA on the
    CPU, glibc) unless ``JMTP_MALLOC_TUNING=0``; a mistyped switch is a warning, not an error.
    Returns whether they are applied (also when an earlier call applied them)."""
    if host_malloc.applied:
        return True
    try:
        return host_malloc.configure()
    except ValueError as e:
        warnings.warn(f"{e}; malloc settings left alone", stacklevel=2)
        return False


def prepare_process(compilation_cache_dir: str | bool | None = "auto") -> str | None:
    """The process-wide settings an engine needs (module docstring): :func:`tune_malloc`, then
    JAX's persistent compilation cache; returns the cache folder in use (None: none).

    Raises:
      ValueError: a bad ``compilation_cache_dir`` (see
        :func:`~jmtp.runtime.process.compile.setup_compilation_cache`).
    """
    from jmtp.runtime.process.compile import setup_compilation_cache
    tune_malloc()
    return setup_compilation_cache(compilation_cache_dir)


def gc_freeze_enabled() -> bool:
    """Whether :func:`freeze_heap` freezes: ``$JMTP_GC_FREEZE`` is not ``0`` (default on)."""
    return os.environ.get("JMTP_GC_FREEZE", "1").strip() != "0"


def freeze_heap() -> int:
    """Collect once, then move every object alive now out of the cyclic garbage collector's
    reach (:func:`gc.freeze`), so that its full (generation-2) collections, which pause every
    Python thread (the engine's too), stop traversing the start-up heap: parameters' and
    executables' Python objects, JAX's caches, the tokenizer, the engine's tables. What the
    serving loop allocates later is collected as before; reference counting still frees frozen
    objects, and only a reference cycle made of frozen objects that dies later stays in memory.
    vLLM and SGLang freeze their serving processes' heaps after start-up for the same reason.
    Measured on an ``LLM`` process of SmolLM2 after a warm-up generate: ``docs/serving.md``.
    ``JMTP_GC_FREEZE=0`` opts out.

    Returns:
      the number of objects frozen by this call (0 when opted out).
    """
    if not gc_freeze_enabled():
        return 0
    t0 = time.perf_counter()
    before = gc.get_freeze_count()
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count() - before
    log.info("froze %d start-up objects out of the garbage collector's reach in %.2f s", frozen,
             time.perf_counter() - t0)
    return frozen


__all__ = ["tune_malloc", "prepare_process", "freeze_heap", "gc_freeze_enabled"]
