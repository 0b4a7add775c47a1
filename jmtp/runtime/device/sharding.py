"""Device mesh and sharding rules of jmtp, in one place.

The mesh has two axes, :data:`DATA` (request slots, data parallel) and :data:`MODEL` (tensor
parallel). Model code names only *logical* axes (:mod:`jmtp.model.axes`, carried by every
``nnx.Param`` as its ``out_sharding`` metadata); :data:`LOGICAL_TO_MESH` is the one table that maps
them to mesh axes, for the parameters, the KV caches and the engine state:

==================  ========  =============================================================
logical axis        mesh axis what it shards
==================  ========  =============================================================
``q_heads``         model     wq / bq columns, wo rows (column / row parallel attention)
``kv_heads``        model     wk, wv / bk, bv columns; the KV caches' heads axis
``mlp``             model     w_gate / w_up columns, w_down rows (column / row parallel MLP)
``vocab``           model     embedding rows, LM head columns, the FR-Spec draft head rows
``experts``         (none)    MoE routed experts; with expert parallelism (data, model): every
                              device of the mesh holds E / (DP·TP) whole experts
``expert_mlp``      model     one routed expert's width (tensor-parallel experts); none with
                              expert parallelism
``slots``           data      every per-slot array of the engine state (rows of B)
``data_shard``      data      the leading axis of the stacked state and KV caches (one entry
                              per data shard, :mod:`jmtp.runtime.device.data_parallel`)
everything else     (none)    replicated
==================  ========  =============================================================

Tensor parallelism is plain GSPMD: the parameters and caches are placed with these shardings,
the engine step is jitted with output shardings equal to the input ones (so the donated state and
caches are updated in place and nothing recompiles) and XLA inserts the collectives (one
all-reduce after each row-parallel matmul, a cross-shard max/argmax over the vocabulary). Ragged
paged attention runs under ``jax.shard_map`` over the kv heads
(:func:`jmtp.pallas.ragged_paged_attention.ragged_paged_attention` reads the mesh set by
:func:`mesh_context`).

A dimension mapped to ``model`` must split into whole pieces: ``tensor_parallel_size`` must divide
``num_heads`` and ``num_kv_heads``, or be a multiple of ``num_kv_heads`` dividing ``num_heads``:
the engine then replicates each kv head (:func:`jmtp.model.params.replicate_kv_heads`); else
:func:`check_tensor_parallel` raises. Multi-head latent attention splits its query heads only
(its one latent cache head is replicated over ``model``, ``docs/mla.md``). A ``vocab`` or
``mlp`` dimension that TP does not divide leaves that one tensor replicated.

Expert parallelism (``enable_expert_parallel=True``) maps ``experts`` to ``(data, model)`` and
``expert_mlp`` to nothing (:data:`~jmtp.core.mesh.EXPERT_PARALLEL_RULES`, given to
:func:`param_shardings` and :func:`logical_spec` as ``rules``): every device holds whole
experts, ``E / (DP·TP)`` of each MoE layer (:mod:`jmtp.model.expert_parallel`).

Data parallelism splits the request slots and the KV-block pool into ``data_parallel_size``
shards, each a small engine of its own inside the same jitted step
(:mod:`jmtp.runtime.device.data_parallel`): the state and caches carry a leading ``data_shard`` axis.
"""
from __future__ import annotations

import logging
from typing import Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

# The mesh vocabulary lives in jmtp.core.mesh (kernels and model code read it there); it is
# re-exported here with the placement rules built on it.
from jmtp.core.mesh import (DATA, DATA_SHARD, LOGICAL_TO_MESH, MESH_AXES, MODEL, SLOTS,
                            attention_specs, auto_axes, mesh_context, mesh_rules, model_axis_size,
                            uniform_any)
from jmtp.model import axes as ax

log = logging.getLogger(__name__)


def make_mesh(tensor_parallel_size: int = 1, data_parallel_size: int = 1,
              devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A ``(data, model)`` mesh of ``data_parallel_size × tensor_parallel_size`` devices.

    Args:
      tensor_parallel_size: size of the ``model`` axis.
      data_parallel_size: size of the ``data`` axis.
      devices: the devices to use, taken as given: the first ``DP·TP``, row-major (a model-axis
        group is ``TP`` consecutive devices). Default: :func:`mesh_devices` (``jax.devices()``
        of every process, each process contributing the same number, process-major, so that a
        model-axis group stays inside one process when ``TP`` divides the devices per process).

    Raises:
      ValueError: a size below 1, or more devices asked for than given; on several processes,
        ``DP·TP`` not a multiple of the process count.
    """
    for name, n in (("tensor_parallel_size", tensor_parallel_size),
                    ("data_parallel_size", data_parallel_size)):
        if not isinstance(n, (int, np.integer)) or n < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {n!r}")
    need = tensor_parallel_size * data_parallel_size
    devices = mesh_devices(need) if devices is None else list(devices)
    if need > len(devices):
        raise ValueError(
            f"data_parallel_size={data_parallel_size} x tensor_parallel_size="
            f"{tensor_parallel_size} needs {need} devices, but only {len(devices)} are available"
            + (" (on CPU, XLA_FLAGS=--xla_force_host_platform_device_count=N gives N devices)"
               if devices and devices[0].platform == "cpu" else ""))
    grid = np.asarray(devices[:need], dtype=object).reshape(data_parallel_size, tensor_parallel_size)
    return Mesh(grid, MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * 2)


def mesh_devices(num_devices: int) -> list[jax.Device]:
    """The ``num_devices`` global devices a default mesh uses, in mesh order.

    One process: the first ``num_devices`` of ``jax.devices()`` (its order kept). Several
    processes (multi-controller): every process must own devices of the mesh (each one runs the
    same program and reads its outputs), so each contributes ``num_devices / P`` of its own, in
    ``jax.devices()`` order within a process and process-major across them: reshaped to
    ``(DP, TP)``, a model-axis group is ``TP`` consecutive devices, inside one process when ``TP``
    divides ``num_devices / P``, else spanning whole processes. Returns every device when
    ``num_devices`` exceeds them (the caller reports the shortage).

    Raises:
      ValueError: several processes and ``num_devices`` not a multiple of their count.
    """
    devices = jax.devices()
    nproc = jax.process_count()
    if nproc == 1 or num_devices > len(devices):
        return list(devices)
    if num_devices % nproc:
        raise ValueError(
            f"the mesh needs {num_devices} devices, which {nproc} processes cannot contribute "
            f"equally (data_parallel_size x tensor_parallel_size must be a multiple of the "
            f"process count {nproc})")
    per = num_devices // nproc
    by_proc: dict[int, list] = {}
    for d in devices:
        by_proc.setdefault(d.process_index, []).append(d)
    short = {p: len(ds) for p, ds in by_proc.items() if len(ds) < per}
    if short or len(by_proc) != nproc:
        raise ValueError(f"each of the {nproc} processes must contribute {per} devices; device "
                         f"counts per process: { {p: len(ds) for p, ds in by_proc.items()} }")
    return [d for p in sorted(by_proc) for d in by_proc[p][:per]]


def check_mesh(mesh: Mesh) -> Mesh:
    """Return ``mesh`` if its axis names are :data:`MESH_AXES`, else raise ``ValueError``."""
    if tuple(mesh.axis_names) != MESH_AXES:
        raise ValueError(f"the mesh must have axes {MESH_AXES}, got {tuple(mesh.axis_names)}")
    return mesh


def mesh_sizes(mesh: Mesh) -> tuple[int, int]:
    """``(data_parallel_size, tensor_parallel_size)`` of a jmtp mesh."""
    return int(mesh.shape[DATA]), int(mesh.shape[MODEL])


def check_tensor_parallel(cfg, tensor_parallel_size: int) -> None:
    """Raise ``ValueError`` unless ``tensor_parallel_size`` divides the query and kv heads of
    ``cfg`` (a :class:`~jmtp.model.config.ModelConfig`; the engine has replicated the kv heads
    first where TP is a multiple of them, :func:`jmtp.model.params.replicate_kv_heads`); for
    multi-head latent attention only the query heads (the latent cache is replicated)."""
    tp = tensor_parallel_size
    # MLA: the query heads split, the one latent cache head replicated (docs/mla.md)
    heads = (("num_heads", cfg.num_heads),) if getattr(cfg, "is_mla", False) else (
        ("num_heads", cfg.num_heads), ("num_kv_heads", cfg.num_kv_heads))
    for name, n in heads:
        if n % tp:
            raise ValueError(
                f"tensor_parallel_size={tp} must divide {name}={n} (the model has "
                f"num_heads={cfg.num_heads}, num_kv_heads={cfg.num_kv_heads}); a multiple of "
                "num_kv_heads that divides num_heads also works (kv heads replicated)")


def logical_spec(names: Sequence[str | None], shape: Sequence[int], mesh: Mesh,
                 where: str = "", rules: dict | None = None) -> P:
    """The ``PartitionSpec`` of an array with logical axes ``names`` and ``shape`` on ``mesh``.

    ``rules``: the logical -> mesh table (default :data:`LOGICAL_TO_MESH`; with expert
    parallelism :func:`~jmtp.core.mesh.mesh_rules`). A dimension whose mesh axis (or axes
    together) does not divide it is left replicated (logged once per tensor); mesh axes of size
    1 are left out.

    Raises:
      ValueError: an unknown logical name, or ``len(names) != len(shape)``.
    """
    rules = LOGICAL_TO_MESH if rules is None else rules
    if len(names) != len(shape):
        raise ValueError(f"{where}: {len(names)} axis names {tuple(names)} for shape {tuple(shape)}")
    out = []
    for name, size in zip(names, shape):
        if name is None:
            out.append(None)
            continue
        if name not in rules:
            raise ValueError(f"{where}: unknown logical axis {name!r} (see LOGICAL_TO_MESH)")
        axes = rules[name]
        axes = tuple(a for a in ((axes,) if isinstance(axes, str) else axes or ())
                     if int(mesh.shape[a]) > 1)
        n = int(np.prod([int(mesh.shape[a]) for a in axes]))
        if n > 1 and size % n:
            log.info("%s: %s axis of size %d not divisible by mesh axes %s=%d; replicated",
                     where or "array", name, size, axes, n)
            axes = ()
        out.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return P(*out)


def _is_var(x) -> bool:
    return isinstance(x, nnx.Variable)


def param_shardings(model_state: nnx.State, mesh: Mesh,
                    expert_parallel: bool = False) -> nnx.State:
    """``model_state`` (from ``nnx.split``) with each Variable's value replaced by the
    ``NamedSharding`` its ``out_sharding`` logical names give on ``mesh`` (same tree structure, so
    ``jax.device_put(model_state, param_shardings(model_state, mesh))`` places it);
    ``expert_parallel``: the routed experts over every device
    (:data:`~jmtp.core.mesh.EXPERT_PARALLEL_RULES`).

    A Variable without ``out_sharding`` metadata is replicated."""
    rules = mesh_rules(expert_parallel)

    def one(path, v):
        shape = v.get_value().shape     # an array or a ShapeDtypeStruct (abstract params)
        names = v.get_metadata().get("out_sharding") or (None,) * len(shape)
        where = ".".join(str(getattr(k, "key", k)) for k in path)
        return v.replace(NamedSharding(mesh, logical_spec(names, shape, mesh, where, rules)))
    return jax.tree_util.tree_map_with_path(one, model_state, is_leaf=_is_var)


def data_specs(shardings) -> tuple[P, ...]:
    """The ``data`` part of each sharding of ``shardings`` (a pytree of ``NamedSharding``s,
    e.g. :func:`param_shardings`), in leaf order: the ``in_specs`` of the data-parallel
    ``shard_map`` (:func:`jmtp.runtime.device.data_parallel.data_parallel_step`), which is manual over
    ``data`` only. ``P()`` for a parameter replicated over ``data``; under expert parallelism a
    routed expert tensor's ``(data, model)`` axis becomes ``data`` (each shard sees its ``E/DP``
    experts, still split over ``model``)."""
    def keep(entry):
        axes = (entry,) if isinstance(entry, str) else tuple(entry or ())
        return DATA if DATA in axes else None
    return tuple(P(*(keep(e) for e in s.spec)) for s in jax.tree_util.tree_leaves(shardings))


def kv_cache_sharding(mesh: Mesh, num_kv_heads: int, stacked: bool = False,
                      scales: bool = False) -> NamedSharding:
    """Sharding of a KV cache array ``f[L, num_blocks, block_size, Nkv·D]``
    (:data:`jmtp.model.axes.KV_CACHE_AXES`), or with ``scales`` of a quantised cache's scales
    ``f32[L, num_blocks, Nkv, block_size]`` (:data:`~jmtp.model.axes.KV_SCALE_AXES`): kv heads over
    ``model``; with ``stacked``, the per-data-shard arrays with a leading axis over ``data``
    (``f[D, L, num_blocks/D, ...]``)."""
    names = ax.KV_SCALE_AXES if scales else ax.KV_CACHE_AXES
    shape = tuple(num_kv_heads if n == ax.KV_HEADS else 1 for n in names)
    if stacked:
        names, shape = (DATA_SHARD,) + tuple(names), (int(mesh.shape[DATA]),) + shape
    return NamedSharding(mesh, logical_spec(names, shape, mesh, "kv_cache"))


def kv_cache_shardings(mesh: Mesh, num_kv_heads: int, quantized: bool, stacked: bool = False,
                       linear_heads: int | None = None, linear_saved: bool = False):
    """The shardings of a whole :class:`jmtp.model.llama.KVCache` (a pytree prefix of it): values
    and, for a ``quantized`` cache, scales, each with its kv heads over ``model``
    (:func:`kv_cache_sharding`); with ``linear_heads`` (a hybrid model's value heads Hv) also its
    recurrent state pool (:func:`linear_state_shardings`, with its prefix-caching state
    checkpoints when ``linear_saved``)."""
    from jmtp.model.llama import KVCache
    values = kv_cache_sharding(mesh, num_kv_heads, stacked)
    lin = (None if linear_heads is None
           else linear_state_shardings(mesh, linear_heads, stacked, linear_saved))
    if not quantized:
        return KVCache(values, values, linear=lin)
    sc = kv_cache_sharding(mesh, num_kv_heads, stacked, scales=True)
    return KVCache(values, values, sc, sc, lin)


def linear_state_shardings(mesh: Mesh, num_value_heads: int, stacked: bool = False,
                           saved: bool = False):
    """Shardings of a :class:`jmtp.model.gated_deltanet.LinearState`: the delta-rule state
    ``f32[Ll, B, W, Hv, Dk, Dv]`` with its value heads over ``model`` (as the linear layers'
    value-head projections), the small convolution state and ``current`` replicated over
    ``model``; with ``saved`` its state checkpoints alike (:class:`jmtp.model.state_checkpoints.
    StateCheckpoints`: ``f32[Ll, S, Hv, Dk, Dv]`` heads over ``model``); with ``stacked`` a
    leading ``data_shard`` axis over ``data``."""
    from jmtp.model.gated_deltanet import LinearState
    from jmtp.model.state_checkpoints import StateCheckpoints
    lead = (DATA_SHARD,) if stacked else ()
    dn = (int(mesh.shape[DATA]),) if stacked else ()

    def spec(names, shape):
        return NamedSharding(mesh, logical_spec(lead + names, dn + shape, mesh, "linear_state"))

    rec = spec((None, None, None, ax.Q_HEADS, None, None), (1, 1, 1, num_value_heads, 1, 1))
    ckpts = None
    if saved:
        ckpts = StateCheckpoints(
            conv=spec((None,) * 4, (1,) * 4),
            recurrent=spec((None, None, ax.Q_HEADS, None, None), (1, 1, num_value_heads, 1, 1)),
            entry=spec((None,), (1,)))
    return LinearState(conv=spec((None,) * 5, (1,) * 5), recurrent=rec,
                       current=spec((None,), (1,)), saved=ckpts)


def state_sharding(mesh: Mesh) -> NamedSharding:
    """Sharding of every leaf of the stacked engine state (leading ``data_shard`` axis over
    ``data``, the rest replicated over ``model``); a prefix for the whole pytree."""
    return NamedSharding(mesh, P(LOGICAL_TO_MESH[DATA_SHARD]))


def replicated(mesh: Mesh) -> NamedSharding:
    """Every device holds the whole array (the engine state with ``data_parallel_size == 1``)."""
    return NamedSharding(mesh, P())


def per_device_bytes(tree) -> tuple[int, int]:
    """``(total bytes, bytes on the first device)`` of the arrays of ``tree`` (Variables
    unwrapped; ``jax.ShapeDtypeStruct`` leaves count their sharding's shard): what each device
    holds, for the start-up report, :mod:`jmtp.aot` and the tests."""
    total = local = 0
    for a in jax.tree_util.tree_leaves(tree):
        a = a.get_value() if isinstance(a, nnx.Variable) else a
        if isinstance(a, jax.ShapeDtypeStruct):   # abstract (jmtp.aot): its sharding's shard
            size = np.dtype(a.dtype).itemsize
            total += int(np.prod(a.shape)) * size
            local += int(np.prod(a.sharding.shard_shape(a.shape) if a.sharding is not None
                                 else a.shape)) * size
            continue
        total += a.nbytes
        shards = getattr(a, "addressable_shards", None)
        local += shards[0].data.nbytes if shards else a.nbytes
    return total, local


__all__ = ["DATA", "MODEL", "MESH_AXES", "SLOTS", "DATA_SHARD", "state_sharding",
           "LOGICAL_TO_MESH", "make_mesh", "mesh_devices", "check_mesh",
           "mesh_sizes", "check_tensor_parallel", "logical_spec", "param_shardings",
           "data_specs", "mesh_rules",
           "kv_cache_sharding", "kv_cache_shardings", "linear_state_shardings", "replicated", "attention_specs", "mesh_context",
           "per_device_bytes", "model_axis_size", "auto_axes", "uniform_any"]
