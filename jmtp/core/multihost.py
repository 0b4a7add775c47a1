"""Host values in and out of a mesh that may span several processes (multi-controller JAX).

With :func:`jmtp.runtime.process.distributed.initialize`, every process runs the same host loop on the same
global mesh. Four rules keep that valid, and this module holds the helpers for them:

* **Into the mesh.** A value every process computes identically (weights, the initial engine
  state) is placed with :func:`put`: each process builds only its addressable shards from its own
  host copy (``jax.make_array_from_callback``), so nothing crosses hosts, and a fingerprint of
  every leaf is compared across processes once (:func:`check_same_across_processes`): processes
  that loaded different weights fail at start-up instead of decoding garbage (the fingerprints
  go through the coordination service's key-value store, not a device collective). Small
  per-step host inputs (numpy chunks and draft limits, the insert row) go to the jitted step as
  uncommitted single-device arrays (``jnp.asarray``); jit then copies each process's own value
  onto that process's devices of the input sharding (``shard_device_array``: local copies only), which is
  valid because every process passes the same values (same host loop).
* **Out of the mesh.** Everything the host reads (the step's ``StepOutput``, the free-block count
  after a release) goes through :func:`fetch`: a fully replicated array is read from the local
  copy, a sharded one that is not fully addressable is gathered from every process
  (``process_allgather``, a collective: every process calls it at the same point of the loop).
* **Same decisions.** Given the same outputs, the host loops stay in lockstep; nothing on the host
  may depend on the process index (except printing on process 0).
* **Arrive together.** On CPU, gloo sets up each group's communicator at its first collective and
  gives up when a peer has not arrived within 30 s. A process still compiling (a lazily compiled
  bucket; a slow, busy host) can be that late. :func:`barrier` (the coordination service's
  barrier, with a long timeout) lines the processes up before the first run of each compiled
  shape (:class:`SyncFirstCall`: it compiles that shape, waits for every process, then runs it).

In a single process every helper reduces to the plain JAX call (``jax.device_put``,
``jax.device_get``).
"""
from __future__ import annotations

import itertools
import os
import zlib
from typing import Any, Callable

import jax
import numpy as np

#: Seconds a process waits at :func:`barrier` for the others (``$JMTP_BARRIER_TIMEOUT``).
DEFAULT_BARRIER_TIMEOUT_S = 1200

_barriers = itertools.count()


def _host(x) -> np.ndarray:
    return np.asarray(x)


def _readable(x) -> bool:
    return (not isinstance(x, jax.Array) or x.is_fully_addressable or x.is_fully_replicated)


def barrier(name: str, timeout_s: float | None = None) -> None:
    """Wait until every process of the job reaches this point (no-op on one process).

    A barrier of the ``jax.distributed`` coordination service (no device collective), so it
    tolerates a late process for ``timeout_s`` (default ``$JMTP_BARRIER_TIMEOUT`` or
    :data:`DEFAULT_BARRIER_TIMEOUT_S`). Every process must call it in the same order: each call
    gets the id ``jmtp/<n>/<name>`` from a per-process counter.

    Raises:
      jax.errors.JaxRuntimeError: a process did not arrive in time (or died).
    """
    if jax.process_count() == 1 or _client() is None:
        return
    _client().wait_at_barrier(f"jmtp/{next(_barriers)}/{name}", _timeout_ms(timeout_s))


class SyncFirstCall:
    """A jitted function whose first call per compiled shape, on a multi-process mesh, compiles
    that shape (``fn.lower(*args).compile()``, no buffers donated), waits at :func:`barrier` for
    every process, then runs; later calls run at once. On one process it is ``fn``.

    Every other attribute (``lower``, ``_cache_size``, …) is ``fn``'s.

    Args:
      fn: a ``jax.jit``-wrapped function.
      key: maps the positional arguments to a hashable key of the compiled shape (e.g. the
        static bucket argument); default: one shape.
      name: the barrier's name.
    """

    def __init__(self, fn, key: Callable[[tuple], Any] | None = None, name: str = "first-call"):
        self._fn, self._key, self._name = fn, key or (lambda args: None), name
        self._ready: set = set()

    def __call__(self, *args):
        if jax.process_count() > 1:
            k = self._key(args)
            if k not in self._ready:
                self._fn.lower(*args).compile()
                barrier(f"{self._name}/{k}")
                self._ready.add(k)
        return self._fn(*args)

    def __getattr__(self, name):
        return getattr(self._fn, name)


def fetch(tree):
    """``jax.device_get`` valid on every process of a multi-process mesh.

    Leaves that are fully addressable or fully replicated are read locally (one batched
    ``jax.device_get``); a leaf sharded across processes is gathered first
    (``jax.experimental.multihost_utils.process_allgather(tiled=True)``, the global array). The
    gather is a collective: every process must call :func:`fetch` on the same tree at the same
    point. Returns the tree with numpy leaves (non-array leaves unchanged).
    """
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    if all(_readable(x) for x in leaves):
        return jax.device_get(tree)
    from jax.experimental import multihost_utils
    out = [np.asarray(multihost_utils.process_allgather(x, tiled=True)) if not _readable(x)
           else jax.device_get(x) for x in leaves]
    return jax.tree_util.tree_unflatten(treedef, out)


def fingerprints(tree) -> np.ndarray:
    """``u32[num_leaves, 2]``: per array leaf, its CRC-32 over the host bytes and its byte count
    (a cheap identity of the values, compared across processes)."""
    rows = []
    for x in jax.tree_util.tree_leaves(tree):
        h = np.ascontiguousarray(_host(x))
        rows.append((zlib.crc32(h.view(np.uint8).reshape(-1)), h.nbytes % 2**32))
    return np.asarray(rows, np.uint32).reshape(-1, 2)


def _client():
    from jax._src import distributed as _dist
    return _dist.global_state.client


def _timeout_ms(timeout_s: float | None) -> int:
    if timeout_s is None:
        timeout_s = float(os.environ.get("JMTP_BARRIER_TIMEOUT", DEFAULT_BARRIER_TIMEOUT_S))
    return int(timeout_s * 1000)


def allgather_host(value: bytes, name: str, timeout_s: float | None = None) -> list[bytes]:
    """``value`` of every process, in process order, through the coordination service's
    key-value store (no device collective, so a late process only has to arrive within
    ``timeout_s``, as at :func:`barrier`). One process: ``[value]``. Every process must call it in
    the same order."""
    if jax.process_count() == 1 or _client() is None:
        return [value]
    client, n = _client(), next(_barriers)
    prefix = f"jmtp/{n}/{name}"
    client.key_value_set_bytes(f"{prefix}/{jax.process_index()}", value)
    return [client.blocking_key_value_get_bytes(f"{prefix}/{p}", _timeout_ms(timeout_s))
            for p in range(jax.process_count())]


def check_same_across_processes(tree, what: str = "value") -> None:
    """Raise ``RuntimeError`` unless every process holds the same ``tree`` (same leaves, same
    bytes; compared by :func:`fingerprints`, exchanged with :func:`allgather_host`). No-op on
    one process.

    Every process must call it (in the same order as the other helpers here).

    Raises:
      RuntimeError: naming the first differing leaf (its path) and the processes that differ
        from process 0.
    """
    if jax.process_count() == 1:
        return
    mine = fingerprints(tree)
    every = [np.frombuffer(b, np.uint32).reshape(-1, 2)
             for b in allgather_host(mine.tobytes(), f"check/{what}")]
    if any(e.shape != mine.shape for e in every):
        raise RuntimeError(f"{what}: processes hold trees of different sizes "
                           f"({[e.shape[0] for e in every]} leaves)")
    every = np.stack(every)                                       # [P, num_leaves, 2]
    bad = np.nonzero((every != every[0:1]).any(axis=2))          # (process, leaf)
    if bad[0].size:
        paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(tree)]
        leaf = int(bad[1][0])
        procs = sorted({int(p) for p, l in zip(*bad) if l == leaf})
        raise RuntimeError(
            f"{what}: {paths[leaf] or 'the value'} differs between process 0 and process(es) "
            f"{procs}; every process must load / build identical values (same checkpoint, same "
            "seeds)")


def put(tree, shardings, *, what: str = "value", check: bool = True):
    """Place ``tree`` (host or device arrays, the same on every process) with ``shardings`` (a
    tree of ``jax.sharding.Sharding`` of the same structure, possibly spanning processes).

    One process: ``jax.device_put(tree, shardings)``. Several: each leaf goes through a host copy
    and ``jax.make_array_from_callback``, so each process fills only its addressable shards (no
    cross-host transfer, no per-leaf collective), and with ``check`` the values are first
    compared across processes (:func:`check_same_across_processes`). A leaf that is already a
    global array (not fully addressable) is resharded with ``jax.device_put``.

    Raises:
      RuntimeError: with ``check``, the processes hold different values.
    """
    if jax.process_count() == 1:
        return jax.device_put(tree, shardings)
    with_path, treedef = jax.tree_util.tree_flatten_with_path(tree)
    leaves = [x for _, x in with_path]
    specs = treedef.flatten_up_to(shardings)
    glob = [isinstance(x, jax.Array) and not x.is_fully_addressable for x in leaves]
    host = [None if g else _host(x) for x, g in zip(leaves, glob)]
    if check:
        check_same_across_processes({jax.tree_util.keystr(p): h for (p, _), h
                                     in zip(with_path, host) if h is not None}, what)
    out = [jax.device_put(x, s) if g else
           jax.make_array_from_callback(h.shape, s, lambda idx, h=h: h[idx])
           for x, g, h, s in zip(leaves, glob, host, specs)]
    return jax.tree_util.tree_unflatten(treedef, out)


__all__ = ["fetch", "put", "fingerprints", "check_same_across_processes", "barrier",
           "allgather_host",
           "SyncFirstCall", "DEFAULT_BARRIER_TIMEOUT_S"]
