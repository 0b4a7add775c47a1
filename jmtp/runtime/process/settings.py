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
* **Your call only**: ``jax.distributed`` (:func:`jmtp.runtime.process.distributed.initialize`, or
  ``jmtp launch``) and the multi-process helpers (:mod:`jmtp.core.multihost`: barriers and
  checks over the distributed client).
* **Read only**: the memory-map budget (:mod:`jmtp.runtime.process.host_maps` reads
  ``vm.max_map_count`` and ``/proc/self/maps``; it changes nothing, it refuses compiles that would
  cross the limit).
"""
from __future__ import annotations

import warnings

from jmtp.runtime.process import host_malloc


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


__all__ = ["tune_malloc", "prepare_process"]
