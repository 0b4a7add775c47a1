"""Expert parallelism: a MoE layer's routed experts split over every device of the mesh, each
token dispatched to the devices that own its experts and back (dropless).

Layout (``LLM(enable_expert_parallel=True)``, the rows of
:data:`jmtp.core.mesh.EXPERT_PARALLEL_RULES`): on a ``(data, model)`` mesh of ``N = DP·TP``
devices, device ``r = d·TP + m`` (data-major) holds the ``E/N`` whole experts
``[r·E/N, (r+1)·E/N)`` of every MoE layer (target and MTP layer): ``experts_gate/up f[E/N, H,
I_e]``, ``experts_down f[E/N, I_e, H]``. The router is replicated (every device routes its own
tokens, fp32, :func:`jmtp.model.moe.route`), the shared experts stay tensor-parallel (their
width split over ``model``, as the dense MLP), attention stays as it is: split by request over
``data`` (jmtp's data-parallel step: "DP attention") and by heads over ``model``.

The engine step runs under a ``shard_map`` manual over ``data``
(:mod:`jmtp.runtime.device.data_parallel`), so a MoE layer sees its data shard's token rows
``x f[T, H]``, replicated over ``model``. :func:`moe_ffn` enters a second ``shard_map`` over the
axes still automatic (``model``), so that every collective below is explicit, and dispatches in
one of two ways (``MoEConfig.all2all_backend``):

* ``"allgather_reducescatter"``: all-gather the rows of every data shard (``[DP·T, H]``, one
  all-gather over ``data``); every device routes all of them and runs only its own experts on the
  (token, expert) pairs that chose them (the others weigh 0); the weighted partial sums are
  reduce-scattered back to their data shard (one reduce-scatter over ``data``), the shared
  experts' row-parallel partial sums added, and one all-reduce over ``model`` completes both.
  Three collectives per MoE layer (one when ``DP = 1``: the all-reduce a tensor-parallel MLP
  has anyway). Bytes per device and layer ≈ ``(2·(DP-1) + 2·(TP-1)/TP)·T·H``.
* ``"ragged_all_to_all"``: each model rank takes ``T/TP`` of the rows, routes them, sorts its
  ``T/TP·k`` pairs by expert (so by owning device) and sends each device exactly its rows
  (``jax.lax.ragged_all_to_all``; offsets from one all-gather of the per-expert counts
  ``i32[N, E]``); the owner runs its experts over what it received (grouped by expert), sends
  the rows back the same way, and the sender weighs and sums each token's k rows. An all-reduce
  over ``model`` (with the shared experts' partial sums; an all-gather without shared experts)
  returns the full ``[T, H]``. Four collectives per layer; bytes ≈ ``(2·k·(N-1)/(N·TP) +
  2·(TP-1)/TP)·T·H``: fewer than the all-gather's when ``k·(N-1)/(N·TP) < DP - 1`` (large
  meshes, small k). The receive buffer holds the worst case, ``N·T/TP·min(k, E/N)`` rows
  (dropless: every token reaches its k experts whatever the routing).

``"auto"`` (:func:`resolve_all2all_backend`): the all-gather form on CPU (XLA:CPU has no
``ragged-all-to-all``: there the op is emulated by an all-gather, for tests only) and wherever
it moves no more bytes than the ragged exchange; the ragged exchange on TPU/GPU meshes where it
moves fewer. ``docs/moe.md`` has the collective counts of compiled steps and CPU step times.

Both give the one-device result up to float summation order: each (token, expert) pair is
computed once, by the expert's owner, with the same SwiGLU, and the k weighted rows and the
shared expert are summed (partial sums in the activation dtype, as a tensor-parallel
all-reduce).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jmtp.core import mesh as jm
from jmtp.model.config import ALL2ALL_BACKENDS, MoEConfig

#: The expert-parallel group: every axis of the mesh, data-major (as the experts' placement).
EP_AXES = (jm.DATA, jm.MODEL)


def is_active(moe: MoEConfig) -> bool:
    """Whether :func:`moe_ffn` applies: ``moe.expert_parallel`` and a ``(data, model)`` mesh of
    more than one device set for the trace (:func:`jmtp.core.mesh.mesh_context`)."""
    if not moe.expert_parallel:
        return False
    mesh = jax.sharding.get_abstract_mesh()
    return (not mesh.empty and all(a in mesh.axis_names for a in EP_AXES)
            and math.prod(int(mesh.shape[a]) for a in EP_AXES) > 1)


def check_expert_parallel(moe: MoEConfig, data_parallel_size: int,
                          tensor_parallel_size: int) -> None:
    """Raise ``ValueError`` unless the mesh's ``DP·TP`` devices split the routed experts whole.

    Raises:
      ValueError: ``num_experts`` not a multiple of ``DP·TP`` (the sizes are in the message)."""
    n = data_parallel_size * tensor_parallel_size
    if moe.num_experts % n:
        raise ValueError(
            f"enable_expert_parallel: num_experts={moe.num_experts} must be a multiple of the "
            f"mesh's data_parallel_size x tensor_parallel_size = {data_parallel_size} x "
            f"{tensor_parallel_size} = {n} devices (each holds num_experts / {n} whole experts)")


def dispatch_bytes(backend: str, dp: int, tp: int, k: int) -> float:
    """Bytes one device sends and receives per MoE layer, in units of ``T·H`` activation rows
    (``T``: the data shard's token rows): the model behind :func:`resolve_all2all_backend`.

    ``"allgather_reducescatter"``: ``2·(DP-1)`` (all-gather and reduce-scatter rings over
    ``data``) ``+ 2·(TP-1)/TP`` (all-reduce over ``model``); ``"ragged_all_to_all"``:
    ``2·k·(N-1)/(N·TP)`` (each of the ``T/TP`` rows a device routes goes to k experts, the share
    ``(N-1)/N`` of them off the device, and comes back) ``+ 2·(TP-1)/TP``."""
    n = dp * tp
    combine = 2.0 * (tp - 1) / tp
    if backend == "allgather_reducescatter":
        return 2.0 * (dp - 1) + combine
    if backend == "ragged_all_to_all":
        return 2.0 * k * (n - 1) / (n * tp) + combine
    raise ValueError(f"backend must be one of {ALL2ALL_BACKENDS[1:]}, got {backend!r}")


def resolve_all2all_backend(backend: str, platform: str, dp: int, tp: int, k: int) -> str:
    """The dispatch ``backend="auto"`` stands for on ``platform`` with a ``(dp, tp)`` mesh and
    ``k`` experts per token: ``"allgather_reducescatter"`` on CPU (XLA:CPU implements no
    ``ragged-all-to-all``) and wherever it moves no more bytes (:func:`dispatch_bytes`; it also
    has fewer collectives, 3 against 4), else ``"ragged_all_to_all"``. Others are returned as
    they are.

    Raises:
      ValueError: an unknown ``backend``."""
    if backend not in ALL2ALL_BACKENDS:
        raise ValueError(f"all2all_backend must be one of {ALL2ALL_BACKENDS}, got {backend!r}")
    if backend != "auto":
        return backend
    if platform == "cpu":
        return "allgather_reducescatter"
    ag = dispatch_bytes("allgather_reducescatter", dp, tp, k)
    return ("ragged_all_to_all" if dispatch_bytes("ragged_all_to_all", dp, tp, k) < ag
            else "allgather_reducescatter")


# ----------------------------------------------------------------------------------------------
# the MoE FFN under expert parallelism
# ----------------------------------------------------------------------------------------------

def moe_ffn(moe: MoEConfig, p: dict, x: jax.Array, *, route, experts, shared) -> jax.Array:
    """The MoE FFN of one layer (routed plus shared experts) with the routed experts split over
    the mesh (module docstring); the same function as :func:`jmtp.model.moe.moe_ffn`, which
    calls it with its own math (this module owns only the placement and the dispatch).

    Args:
      moe: the layer's configuration (``all2all_backend`` resolved, not ``"auto"``).
      p: the layer dict (keys of :func:`jmtp.model.schema.moe_shapes`); ``experts_*`` placed by
        :data:`~jmtp.core.mesh.EXPERT_PARALLEL_RULES` (inside the data-parallel ``shard_map``:
        this data shard's ``E/DP`` experts, split over ``model``).
      x: f[T, H] post-norm rows (this data shard's; replicated over ``model``).
      route: ``(moe, x, router, bias) -> (weights f32[T, k], ids i32[T, k])``
        (:func:`jmtp.model.moe.route`).
      experts: ``(x, w_gate, w_up, w_down, weights, ids) -> f[T, H]`` over the experts of
        ``w_*``, an id equal to their count contributing 0
        (:data:`jmtp.model.moe.EXPERT_IMPLEMENTATIONS`).
      shared: ``(p, x) -> f[T, H]``, the shared experts (:func:`jmtp.model.moe.shared_experts`).

    Returns:
      f[T, H], replicated over ``model``.

    Raises:
      ValueError: ``num_experts`` not a multiple of the mesh's devices, or
        ``all2all_backend="auto"`` (the engine resolves it).
    """
    mesh = jax.sharding.get_abstract_mesh()
    sizes = {a: int(mesh.shape[a]) for a in EP_AXES}
    check_expert_parallel(moe, sizes[jm.DATA], sizes[jm.MODEL])
    if moe.all2all_backend not in ALL2ALL_BACKENDS[1:]:
        raise ValueError(f"MoEConfig.all2all_backend={moe.all2all_backend!r} must be resolved "
                         "(jmtp.model.expert_parallel.resolve_all2all_backend) before tracing")
    auto = jm.auto_axes()
    inner = tuple(a for a in EP_AXES if a in auto)          # made manual here
    tp = sizes[jm.MODEL] if jm.MODEL in inner else 1
    has_shared = "shared_gate" in p
    # shared experts row-parallel inside (their partial sums join the one all-reduce over
    # model): their width must split, and the tokens must be replicated over model only
    split_shared = (has_shared and jm.MODEL in inner and p["shared_gate"].shape[-1] % tp == 0
                    and all(sizes[a] == 1 for a in inner if a != jm.MODEL))
    names = ["router", "experts_gate", "experts_up", "experts_down"]
    names += ["router_bias"] if "router_bias" in p else []
    rep, ex = P(), P(inner if len(inner) != 1 else inner[0])
    specs = [rep, ex, ex, ex] + ([rep] if "router_bias" in p else [])
    if split_shared:
        names += ["shared_gate", "shared_up", "shared_down"]
        specs += [P(None, jm.MODEL), P(None, jm.MODEL), P(jm.MODEL, None)]
        if "shared_expert_gate" in p:
            names.append("shared_expert_gate")
            specs.append(rep)
    body = _allgather_reducescatter if moe.all2all_backend == "allgather_reducescatter" \
        else _ragged_all_to_all

    fns = (route, experts, shared)

    def run(x, *arrays):
        q = dict(zip(names, arrays))
        return body(moe, q, x, fns, sizes, inner, split_shared)

    if inner:
        run = jax.shard_map(run, in_specs=(rep, *specs), out_specs=rep, axis_names=set(inner),
                            check_vma=False)
    out = run(x, *(p[n] for n in names))
    if has_shared and not split_shared:      # tensor-parallel by GSPMD, its own all-reduce
        out = out + shared(p, x)
    return out


def _live(axes, sizes) -> tuple[str, ...]:
    return tuple(a for a in axes if sizes[a] > 1)


def _local_experts(experts, x, q: dict, weights, ids, first):
    """This device's experts ``[first, first + El)`` over the pairs ``(x f[T, H], ids i32[T,
    k])`` that chose them, weighted (``weights f32[T, k]``); the other pairs get id ``El``
    (contributing 0). Returns f[T, H] in ``x.dtype``."""
    el = q["experts_gate"].shape[0]
    mine = (ids >= first) & (ids < first + el)
    local = jnp.where(mine, ids - first, el).astype(jnp.int32)
    return experts(x, q["experts_gate"], q["experts_up"], q["experts_down"],
                   jnp.where(mine, weights, 0.0), local)


def _allgather_reducescatter(moe, q, x, fns, sizes, inner, split_shared):
    """All-gather the data shards' rows, run this device's experts, reduce-scatter back and
    all-reduce over ``model`` (module docstring). ``x f[T, H]`` -> f[T, H]."""
    route, experts, shared = fns
    tokens = _live(tuple(a for a in EP_AXES if a not in inner), sizes)   # split by the caller
    xg = jax.lax.all_gather(x, tokens, axis=0, tiled=True) if tokens else x
    weights, ids = route(moe, xg, q["router"], q.get("router_bias"))
    el = q["experts_gate"].shape[0]
    first = jax.lax.axis_index(EP_AXES) * el
    y = _local_experts(experts, xg, q, weights, ids, first)
    if tokens:
        y = jax.lax.psum_scatter(y, tokens, scatter_dimension=0, tiled=True)
    if split_shared:    # this device's slice of the shared width: a row-parallel partial sum
        y = y + shared(q, x).astype(y.dtype)
    rest = _live(inner, sizes)
    return jax.lax.psum(y, rest) if rest else y


def _exclusive_cumsum(a: jax.Array, axis: int) -> jax.Array:
    return jnp.cumsum(a, axis=axis) - a


def _ragged_all_to_all(moe, q, x, fns, sizes, inner, split_shared):
    """Send each device exactly the rows routed to its experts and back (module docstring).
    ``x f[T, H]`` -> f[T, H]."""
    route, experts, shared = fns
    t, h = x.shape
    k, e = moe.num_experts_per_tok, moe.num_experts
    group = _live(EP_AXES, sizes)
    n = math.prod(sizes[a] for a in EP_AXES)
    el = e // n
    me = jax.lax.axis_index(EP_AXES)
    rep = _live(inner, sizes)                         # the axes the rows are replicated over
    r = math.prod(sizes[a] for a in rep)
    tl = -(-t // r)                                   # rows this device routes
    xp = jnp.pad(x, ((0, tl * r - t), (0, 0)))
    j = jax.lax.axis_index(rep) if rep else 0
    xs = jax.lax.dynamic_slice_in_dim(xp, j * tl, tl)
    weights, ids = route(moe, xs, q["router"], q.get("router_bias"))
    flat = ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)            # pairs by expert, so by owning device
    rows = xs[order // k]                                                    # f[tl·k, H]
    counts = jnp.bincount(flat, length=e).astype(jnp.int32)                  # i32[E]
    c = jax.lax.all_gather(counts, group, axis=0, tiled=False).reshape(n, e)  # i32[N, E]
    s = c.reshape(n, n, el).sum(-1)                   # s[i, j]: rows device i sends device j
    into = _exclusive_cumsum(s, 0)                    # where i's rows start on receiver j
    fromm = _exclusive_cumsum(s, 1)                   # where i's rows for j start on i
    cap = n * tl * min(k, el)                         # the most rows a device can receive
    exchange = _exchange(group)
    got = exchange(rows, jnp.zeros((cap, h), x.dtype), fromm[me], s[me], into[me], s[:, me])
    # the local expert of each received row: segments (sender i, local expert) in that order
    seg_ends = jnp.cumsum(jax.lax.dynamic_slice_in_dim(c, me * el, el, axis=1).reshape(-1))
    which = jnp.searchsorted(seg_ends, jnp.arange(cap, dtype=jnp.int32), side="right")
    valid = which < n * el
    lid = (which % el).astype(jnp.int32)[:, None]
    out = _local_experts(experts, got, q, valid[:, None].astype(jnp.float32),
                         jnp.where(valid[:, None], lid, -1), 0)             # f[cap, H]
    back = exchange(out, jnp.zeros((tl * k, h), x.dtype), into[:, me], s[:, me], fromm[:, me],
                    s[me])
    pairs = jnp.zeros_like(back).at[order].set(back, unique_indices=True)
    y = (pairs.astype(jnp.float32) * weights.reshape(-1, 1)).reshape(tl, k, h).sum(1)
    y = y.astype(x.dtype)                                                    # f[tl, H]
    if split_shared:
        full = jax.lax.dynamic_update_slice_in_dim(jnp.zeros_like(xp), y, j * tl, 0)
        full = full + shared(q, xp).astype(x.dtype)
        return (jax.lax.psum(full, rep) if rep else full)[:t]
    return (jax.lax.all_gather(y, rep, axis=0, tiled=True) if rep else y)[:t]


def _exchange(axes: tuple[str, ...]):
    """``jax.lax.ragged_all_to_all`` over ``axes`` (same arguments); on CPU, where XLA has no
    ``ragged-all-to-all``, an emulation by all-gather with the same result (for tests: the
    ``"auto"`` dispatch never picks the ragged exchange on CPU)."""
    def real(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes):
        return jax.lax.ragged_all_to_all(operand, output, input_offsets, send_sizes,
                                         output_offsets, recv_sizes, axis_name=axes)

    def emulated(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes):
        me = jax.lax.axis_index(axes)
        ops = jax.lax.all_gather(operand, axes, axis=0, tiled=False)   # [N, R, ...]
        start = jax.lax.all_gather(input_offsets, axes, axis=0, tiled=False)[:, me]   # i32[N]
        size = jax.lax.all_gather(send_sizes, axes, axis=0, tiled=False)[:, me]
        dest = jax.lax.all_gather(output_offsets, axes, axis=0, tiled=False)[:, me]
        row = jnp.arange(ops.shape[1], dtype=jnp.int32)[None, :]
        keep = (row >= start[:, None]) & (row < (start + size)[:, None])
        to = jnp.where(keep, dest[:, None] + row - start[:, None], output.shape[0])
        flat = ops.reshape((-1,) + ops.shape[2:])
        return output.at[to.reshape(-1)].set(flat, mode="drop")

    def run(*args):
        return jax.lax.platform_dependent(*args, cpu=emulated, default=real)
    return run


__all__ = ["EP_AXES", "is_active", "check_expert_parallel", "dispatch_bytes",
           "resolve_all2all_backend", "moe_ffn"]
