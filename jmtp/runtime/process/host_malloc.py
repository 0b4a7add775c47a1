"""glibc malloc settings that keep XLA:CPU's per-step scratch memory mapped between steps.

XLA:CPU allocates each execution's temporary buffer (``compiled.memory_analysis()
.temp_size_in_bytes``) with ``malloc`` and frees it afterwards. glibc serves allocations above its
mmap threshold, at most 32 MiB on 64-bit, with a fresh ``mmap`` and returns them with ``munmap``,
so every step of a program whose scratch exceeds 32 MiB touches fresh pages: the kernel zeroes
each 4 KiB page on its first write. Measured on the 2-core dev VM (SmolLM2-135M, fp32, idle
8-slot step, ``ru_minflt``): plain decoding (17 MiB of scratch) 57-203 minor page faults per
step; n-gram K=3 (46 MiB: the ``[A, K+1, V]`` window logits and verification buffers) 4,424
faults and ~4 ms more per step (32.4 against 28.5 ms), the "~5 % floor" of a speculative step
without drafts; n-gram K=7 (89 MiB) 4,521 faults. With the settings below: 0-1 faults per step
and the step costs what plain decoding costs.

:func:`configure` turns off mmap for large allocations (``M_MMAP_MAX = 0``), keeps freed heap
memory instead of returning it to the kernel (``M_TRIM_THRESHOLD`` = 1 GiB) and uses one malloc
arena (``M_ARENA_MAX = 1``: a thread arena's heaps are at most 64 MiB, so larger scratch would be
mapped afresh anyway). Building an engine and the ``jmtp`` command call it
(:func:`jmtp.runtime.process.settings.tune_malloc`; call that yourself before touching JAX for the full
effect: arenas are assigned to a thread at its first allocation, so a later call only partly
helps), when the
process will run XLA on the CPU: no accelerator plugin installed (``jax_plugins`` entry points,
``libtpu``) or ``JAX_PLATFORMS`` naming ``cpu`` first. On accelerator hosts host RAM holds
checkpoints on their way to the device, which is better returned to the kernel, so nothing is
changed there. ``JMTP_MALLOC_TUNING=1`` / ``=0`` forces it on / off.

The settings are process-wide (they are glibc's); they apply to glibc on Linux only and are a
no-op elsewhere. The cost: freed memory stays in the process (up to the trim threshold above the
heap's top), so RSS does not shrink after a large temporary allocation.
"""
from __future__ import annotations

import ctypes
import importlib.metadata
import importlib.util
import logging
import os
import pkgutil
import sys

log = logging.getLogger(__name__)

#: glibc ``mallopt`` parameters (``<malloc.h>``).
M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8

#: ``(parameter, value)`` pairs :func:`configure` sets.
SETTINGS = ((M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, 1 << 30), (M_ARENA_MAX, 1))

ENV = "JMTP_MALLOC_TUNING"


#: True once :func:`configure` applied the settings in this process.
applied = False


def runs_xla_on_cpu() -> bool:
    """True when this process will run XLA on the CPU: ``JAX_PLATFORMS`` names ``cpu`` first, or
    it is unset and no accelerator plugin is installed (JAX's two discovery routes: a
    ``jax_plugins`` entry point or a ``jax_plugins.*`` module; and ``libtpu``). Does not
    initialise any JAX backend."""
    platforms = os.environ.get("JAX_PLATFORMS", "").strip()
    if platforms:
        return platforms.split(",")[0].strip().lower() == "cpu"
    if importlib.util.find_spec("libtpu") is not None:
        return False
    try:
        if list(importlib.metadata.entry_points(group="jax_plugins")):
            return False
        ns = importlib.util.find_spec("jax_plugins")
        return ns is None or not list(pkgutil.iter_modules(ns.submodule_search_locations or []))
    except Exception:  # noqa: BLE001 -- unreadable metadata: assume an accelerator may exist
        return False


def _jax_backend_started() -> bool:
    bridge = sys.modules.get("jax._src.xla_bridge")
    return bool(getattr(bridge, "_backends", None))


def _glibc_mallopt():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version      # glibc only (musl's mallopt does nothing)
        return libc.mallopt
    except (OSError, AttributeError):
        return None


def configure(force: bool | None = None) -> bool:
    """Apply :data:`SETTINGS` with glibc's ``mallopt`` (see the module docstring).

    Args:
      force: True / False applies / skips regardless of the platform check; None (default)
        follows ``JMTP_MALLOC_TUNING`` (``1`` / ``0``), else :func:`runs_xla_on_cpu`.

    Returns:
      True when every setting was applied; False when skipped, not glibc, or ``mallopt``
      refused one (logged).

    Raises:
      ValueError: ``JMTP_MALLOC_TUNING`` set to something other than ``0`` or ``1``
        (:func:`jmtp.runtime.process.settings.tune_malloc` turns this into a warning).
    """
    global applied
    if force is None:
        env = os.environ.get(ENV, "").strip()
        if env not in ("", "0", "1"):
            raise ValueError(f"{ENV}={env!r}: must be 0 or 1 (unset: automatic)")
        force = (env == "1") if env else runs_xla_on_cpu()
    if not force:
        return False
    mallopt = _glibc_mallopt()
    if mallopt is None:
        return False
    if _jax_backend_started():
        log.info("jmtp.runtime.process.host_malloc: a JAX backend was already running when the malloc "
                 "settings were applied; its threads keep their own arenas, so XLA:CPU scratch "
                 "above 64 MiB may still be mapped afresh every step (call "
                 "jmtp.runtime.process.settings.tune_malloc() before touching JAX)")
    failed = [param for param, value in SETTINGS if mallopt(param, value) != 1]
    if failed:
        log.warning("mallopt refused parameters %s: XLA:CPU scratch above 32 MiB may be "
                    "mapped afresh every step", failed)
        return False
    applied = True
    return True
