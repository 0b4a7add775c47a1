"""Compilation out of the hot path: JAX's persistent compilation cache and ahead-of-time compiles.

Two independent pieces, both called once from ``LLM.__init__``:

* :func:`setup_compilation_cache` points JAX's persistent compilation cache at a per-user folder
  (default ``$JMTP_CACHE_DIR``, else ``$XDG_CACHE_HOME/jmtp/xla``, else ``~/.cache/jmtp/xla``), so a
  second process loads the step executables from disk instead of compiling them again.
* :func:`compile_ahead` compiles a jitted function for a list of argument tuples (one per static
  bucket key) with ``jit(f).lower(*args).compile()``, behind a tqdm bar. Lowering and compiling
  go through the same caches as a later call with arguments of the same shapes, so that call only
  traces and does not compile again (``tests/runtime/test_compile.py`` checks this with
  ``jax.log_compiles``). Nothing runs: donated buffers stay valid.

:func:`persistent_cache_off` turns that cache off around compiles for compile-only devices
(:mod:`jmtp.aot`), whose executables it could not load back.
"""
from __future__ import annotations

import contextlib
import logging
import os
import time
from typing import Any, Callable, Sequence

import jax

from jmtp.runtime.process.host_maps import MapBudget

log = logging.getLogger(__name__)

COMPILE_MODES = ("eager", "lazy", "fewest", "largest")
_OFF = ("", "0", "off", "none", "false")


def default_cache_dir() -> str | None:
    """The per-user cache folder: ``$JMTP_CACHE_DIR`` (``off``, ``0``, ``none``, ``false`` or empty
    = no cache: returns None), else ``$XDG_CACHE_HOME/jmtp/xla``, else ``~/.cache/jmtp/xla``."""
    env = os.environ.get("JMTP_CACHE_DIR")
    if env is not None:
        return None if env.strip().lower() in _OFF else os.path.expanduser(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "jmtp", "xla")


def setup_compilation_cache(cache_dir: str | bool | None = "auto") -> str | None:
    """Turn on JAX's persistent compilation cache for this process; return the folder in use.

    Args:
      cache_dir: ``"auto"``: keep a folder the user already gave JAX (``jax_compilation_cache_dir``),
        else :func:`default_cache_dir`. A path: use that folder (it replaces JAX's current one).
        ``None`` or ``False``: leave JAX's cache configuration as it is (no cache unless the user
        set JAX's own). ``True`` is the same as ``"auto"``.

    When jmtp sets the folder it also caches every entry, however small or quick to compile
    (``jax_persistent_cache_min_compile_time_secs=0``, ``jax_persistent_cache_min_entry_size_bytes
    =-1``): an engine's step compiles in seconds but each bucket is a separate entry. These are
    process-wide JAX settings; the folder must not be writable by users you do not trust (JAX
    loads executables from it).

    Raises:
      ValueError: ``cache_dir`` is not a string, bool or None, or the folder cannot be created.
    """
    from jax.experimental.compilation_cache import compilation_cache as cc

    if cache_dir is None or cache_dir is False:
        return jax.config.jax_compilation_cache_dir
    if cache_dir is True:
        cache_dir = "auto"
    if not isinstance(cache_dir, (str, os.PathLike)):
        raise ValueError(f"compilation_cache_dir must be 'auto', a path, None or False, got "
                         f"{cache_dir!r}")
    current = jax.config.jax_compilation_cache_dir
    if cache_dir == "auto":
        if current:
            return current            # the user's own JAX setting wins over jmtp's default
        path = default_cache_dir()
        if path is None:
            return None
    else:
        path = os.path.expanduser(os.fspath(cache_dir))
    path = os.path.abspath(path)
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise ValueError(f"compilation_cache_dir={path!r} cannot be created: {e}") from e
    if current and os.path.abspath(current) == path:
        return path
    cc.set_cache_dir(path)
    cc.reset_cache()                  # a folder set after JAX's first compile takes effect too
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    log.info("persistent compilation cache: %s", path)
    return path


@contextlib.contextmanager
def persistent_cache_off():
    """JAX's persistent compilation cache off inside the block, as it was after it.

    For compile-only devices (:mod:`jmtp.aot`'s TPU topologies on a CPU host): JAX decides once
    per process whether the cache is used, so with a folder set (``$JAX_COMPILATION_CACHE_DIR``,
    or an earlier ``LLM`` in the process) every compile-only executable was serialized into it,
    and an entry found again could not be loaded (a warning, "PjRtCompiler must be constructed
    with a Client", then the compile anyway). Its time cost was within noise in the test suite.
    Uses ``jax_enable_compilation_cache`` and JAX's ``reset_cache`` (its public experimental
    module) so the decision is taken again on each side of the block. The setting is process-wide:
    a compile in another thread during the block does not use the cache either.
    """
    from jax.experimental.compilation_cache import compilation_cache as cc
    was = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    cc.reset_cache()
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", was)
        cc.reset_cache()


def compile_ahead(fn: Callable, arg_lists: Sequence[tuple], *, labels: Sequence[Any] | None = None,
                  desc: str = "compile", progress: bool = True,
                  budget: MapBudget | None = None,
                  on_compiled: Callable[[int], None] | None = None,
                  on_executable: Callable[[Any, Any], None] | None = None) -> dict[Any, float]:
    """Compile the jitted ``fn`` once per argument tuple, ahead of its first call.

    Args:
      fn: a ``jax.jit``-wrapped function (static arguments marked there).
      arg_lists: one positional-argument tuple per bucket; static arguments are the bucket's key,
        arrays give the shapes and dtypes (``jax.ShapeDtypeStruct`` works too). Nothing is run and
        no buffer is donated.
      labels: one label per tuple for the report (default: its index).
      desc: the progress bar's title.
      progress: show a tqdm bar.
      budget: measures the memory mappings each compile adds
        (:class:`jmtp.runtime.process.host_maps.MapBudget`); from the second compile on, the ones still
        to come must fit in the process's ``vm.max_map_count`` before the next one starts.
      on_compiled: called with the index of each tuple as soon as its compile is done (so a
        caller keeps track of the finished ones when a later compile raises).
      on_executable: called with ``(label, jax.stages.Compiled)`` after each compile (memory
        analysis, HLO text, serialisation: :mod:`jmtp.aot`).

    Returns:
      ``{label: seconds}`` spent lowering and compiling each (a persistent-cache hit is quick).

    Raises:
      ValueError: ``labels`` and ``arg_lists`` differ in length.
      MapLimitError: with ``budget``, the remaining compiles would not fit in the map limit
        (XLA:CPU would abort the process part-way through them).
    """
    labels = list(range(len(arg_lists))) if labels is None else list(labels)
    if len(labels) != len(arg_lists):
        raise ValueError(f"got {len(labels)} labels for {len(arg_lists)} argument tuples")
    from tqdm.auto import tqdm

    times: dict[Any, float] = {}
    bar = tqdm(total=len(arg_lists), desc=desc, unit="bucket", disable=not progress)
    try:
        for i, (label, args) in enumerate(zip(labels, arg_lists)):
            bar.set_postfix_str(str(label))
            if budget is not None:
                budget.check(label, remaining=len(arg_lists) - i)
                budget.start()
            t0 = time.perf_counter()
            exe = fn.lower(*args).compile()
            times[label] = time.perf_counter() - t0
            if on_executable is not None:
                on_executable(label, exe)
            if budget is not None:
                budget.stop()
            if on_compiled is not None:
                on_compiled(i)
            bar.update(1)
    finally:
        bar.close()
    return times


#: XLA:CPU's older (non-MLIR) fusion emitters: a scanned SmolLM2 step bucket compiles in ~5 s
#: instead of ~7 s with the same decode speed (measured with jaxlib 0.10.2), but an unrolled one
#: takes twice as long. XLA aborts on a flag it does not know: set for jaxlib 0.10 only.
FAST_CPU_COMPILE_FLAG = "--xla_cpu_use_fusion_emitters=false"


def use_fast_cpu_compiles() -> bool:
    """Add :data:`FAST_CPU_COMPILE_FLAG` to ``XLA_FLAGS`` for this process, for start-up-bound
    runs with scanned layers (``jmtp generate``, ``jmtp chat``); the flag only concerns XLA:CPU.

    Must run before JAX starts its first backend (XLA reads ``XLA_FLAGS`` once). Leaves the
    flags alone when they already name the option, when the jaxlib is not 0.10.x, or when a
    backend already runs. Returns whether the flag is now set by this call.
    """
    import importlib.metadata

    flags = os.environ.get("XLA_FLAGS", "")
    name = FAST_CPU_COMPILE_FLAG.split("=")[0]
    try:
        version = tuple(int(x) for x in importlib.metadata.version("jaxlib").split(".")[:2])
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return False
    try:   # a private JAX function (present in jax 0.6-0.10); without it, assume started
        from jax._src import xla_bridge
        started = xla_bridge.backends_are_initialized()
    except (ImportError, AttributeError):
        started = True            # cannot tell: do not risk a flag XLA would ignore
    if name in flags or version != (0, 10) or started:
        return False
    os.environ["XLA_FLAGS"] = (flags + " " + FAST_CPU_COMPILE_FLAG).strip()
    return True


def resolve_compile_mode(mode: str | None) -> str:
    """``mode`` or, when None, ``$JMTP_COMPILE`` (default ``"eager"``).

    Raises:
      ValueError: not one of :data:`COMPILE_MODES`.
    """
    if mode is None:
        mode = os.environ.get("JMTP_COMPILE", "eager").strip().lower() or "eager"
    if mode not in COMPILE_MODES:
        raise ValueError(f"compile must be one of {COMPILE_MODES} (or $JMTP_COMPILE), got {mode!r}")
    return mode
