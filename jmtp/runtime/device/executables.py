"""How long an engine's compiled executables live, and what releases them.

JAX keeps what a jitted function compiled in caches keyed by the Python function object: the
jit's C++ dispatch cache, and the tracing, lowering and compilation caches behind it (keyed weakly
on the function, or on the jaxpr and module its trace produced). The executables therefore live as
long as the function object does. Had the runner jitted the module-level
:func:`~jmtp.runtime.device.step.engine_step` itself, every step bucket any engine of the process ever
compiled would stay loaded until ``jax.clear_caches()`` (measured with jaxlib 0.10.2: deleting a
tiny engine and collecting it left its ~7,500 memory mappings in place; ``clear_caches`` dropped
them). On XLA:CPU each compiled kernel holds memory mappings of its own
(:mod:`jmtp.runtime.process.host_maps`), so a process that builds engines one after another would reach
``vm.max_map_count`` although it never holds more than one.

:func:`engine_function` gives each engine configuration a function object of its own: engines of
the same configuration share it (and so share their executables, as before: a second engine of a
configuration compiles nothing), and when the last engine holding it is closed
(:meth:`DeviceRunner.close <jmtp.runtime.device.runner.DeviceRunner.close>`) or collected, the object
dies and JAX drops every executable compiled for it. ``tests/runtime/test_engine_close.py``
measures the mappings of ``/proc/self/maps`` before, during and after.
"""
from __future__ import annotations

import functools
import weakref
from typing import Callable, Hashable

_FUNCTIONS: "weakref.WeakValueDictionary[tuple, Callable]" = weakref.WeakValueDictionary()


def engine_function(fn: Callable, key: Hashable) -> Callable:
    """``fn`` under a function object owned by the engines of configuration ``key``.

    Args:
      fn: a module-level function an engine jits (e.g. ``engine_step``).
      key: what tells engines apart whose executables should live and die apart (hashable: the
        model's graph definition, the engine config, the device...). Engines with equal keys
        get the same object.

    Returns:
      a ``functools.partial`` of ``fn`` with ``fn``'s name and signature; it lives while some
      caller holds it (the jitted function built on it does), and JAX's caches of it go with it.
    """
    k = (fn, key)
    f = _FUNCTIONS.get(k)
    if f is None:
        f = functools.update_wrapper(functools.partial(fn), fn)
        _FUNCTIONS[k] = f
    return f


def live_functions() -> int:
    """Engine function objects alive in this process (for tests and diagnostics)."""
    return len(_FUNCTIONS)


__all__ = ["engine_function", "live_functions"]
