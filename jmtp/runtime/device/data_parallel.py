"""Data parallelism over request slots: each data shard is a small engine of its own.

With ``data_parallel_size = D`` the engine's ``max_num_seqs = B`` slots, ``num_blocks = N`` KV
blocks and per-step token budget are split into D shards of ``B/D`` slots, ``N/D`` blocks and
``max_num_batched_tokens/D`` tokens (:func:`shard_config`). Every
array of the engine state and of both KV caches is held *stacked*: a leading axis of size D (the
logical axis :data:`jmtp.runtime.device.sharding.DATA_SHARD`, mapped to the mesh's ``data`` axis) in
front of the single-shard layout, so shard ``d`` lives on the devices of data row ``d`` only:

=======================  ==============================================================
state field              stacked shape (``Bl = B/D``, ``Nl = N/D``)
=======================  ==============================================================
per-slot arrays          ``[D, Bl, ...]`` (global slot ``b`` is shard ``b // Bl``, row ``b % Bl``)
``blocks.free_stack``    ``[D, Nl]``: shard-local block ids ``0..Nl-1``
``blocks.free_count``    ``[D]``
KV caches                ``f[D, L, Nl, block_size, Nkv, head_dim]``
=======================  ==============================================================

The engine step and the slot operations (but the hand-off gather) run under one ``jax.shard_map``
that is manual over ``data`` only (``axis_names={"data"}``): inside it each shard runs the ordinary
single-shard functions (:func:`jmtp.runtime.device.step.engine_step`; for the slot operations
:func:`one_shard_op`, derived from :data:`jmtp.runtime.device.placement.DEVICE_OPS`) on its own
slots, blocks and caches with ``EngineConfig`` :func:`shard_config`, while the ``model`` axis stays
automatic (GSPMD tensor parallelism, attention under its own ``shard_map`` over kv heads). The
parameters enter replicated over ``data``, except the routed experts under expert parallelism:
each shard sees its ``E/D`` experts. Otherwise no array crosses data shards, except the MoE
layers' token rows under expert parallelism (:mod:`jmtp.model.expert_parallel`; a run-time
branch around a model forward must then be taken alike by every shard:
:func:`jmtp.core.mesh.uniform_any`) and the small per-step results the host reads
(:class:`~jmtp.runtime.device.step.StepOutput`, gathered to every device so every process of a
multi-process run can read them). A request never spans shards: its slot, block table and blocks
belong to one shard, and its per-slot sampling parameters, seeds and random stream move with its
row, so a padding row can never lend a real row its temperature.

Every shard runs the same static ``(T, A)`` bucket in a step (one graph): the host picks it for
the busiest shard (:meth:`jmtp.runtime.host.llm_engine.LLMEngine.step`).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from jmtp.runtime.config import EngineConfig
from jmtp.runtime.device.handoff_ops import gather_slot
from jmtp.runtime.device.sharding import DATA
from jmtp.runtime.device.spec import Caches, StepInputs, StepSpec
from jmtp.runtime.device.step import engine_step, set_slot_state_of


def shard_config(ec: EngineConfig, data_parallel_size: int) -> EngineConfig:
    """The :class:`EngineConfig` of one data shard: ``max_num_seqs``, ``num_blocks`` and the
    per-step token budget ``max_num_batched_tokens`` (and a hybrid model's prefix-caching state
    checkpoints ``num_state_checkpoints``) divided by D; everything else (K, block
    size, max_model_len, allocator) unchanged. (The engine's sizes are totals over the shards, as
    the ``slots`` axis is one axis sharded over ``data``.)

    Raises:
      ValueError: ``data_parallel_size`` < 1, or it does not divide ``max_num_seqs``,
        ``num_blocks`` or ``max_num_batched_tokens`` (the names and values are in the message), or
        a shard would get fewer blocks than one ``max_model_len`` sequence needs.
    """
    d = int(data_parallel_size)
    if d < 1:
        raise ValueError(f"data_parallel_size must be >= 1, got {data_parallel_size}")
    if d == 1:
        return ec
    for name in ("max_num_seqs", "num_blocks", "max_num_batched_tokens", "num_state_checkpoints"):
        v = getattr(ec, name)
        if v % d:
            raise ValueError(f"data_parallel_size={d} must divide {name}={v} (each data shard "
                             f"owns {name}/data_parallel_size of them)")
    local = dataclasses.replace(ec, max_num_seqs=ec.max_num_seqs // d,
                                num_blocks=ec.num_blocks // d,
                                max_num_batched_tokens=ec.max_num_batched_tokens // d,
                                num_state_checkpoints=ec.num_state_checkpoints // d)
    if local.num_blocks < local.pages_per_seq:
        raise ValueError(
            f"num_blocks={ec.num_blocks} over data_parallel_size={d} leaves {local.num_blocks} "
            f"blocks per shard, fewer than one max_model_len={ec.max_model_len} sequence needs "
            f"({local.pages_per_seq}); raise num_blocks or lower data_parallel_size")
    return local


def stack_shards(tree, data_parallel_size: int):
    """``tree`` (single-shard arrays) repeated along a new leading axis of size D."""
    return jax.tree_util.tree_map(
        lambda x: jnp.broadcast_to(x[None], (data_parallel_size,) + x.shape), tree)


def _squeeze(tree):
    return jax.tree_util.tree_map(lambda x: x[0], tree)


def _expand(tree):
    return jax.tree_util.tree_map(lambda x: x[None], tree)


def _on_shard(mesh: Mesh, body, in_specs, out_specs):
    """``shard_map`` manual over ``data`` only (``model`` stays automatic)."""
    return jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                         axis_names={DATA}, check_vma=False)


def data_parallel_step(mesh: Mesh, spec: StepSpec, model_state, state, caches: Caches,
                       inputs: StepInputs, *, param_specs=None):
    """:func:`~jmtp.runtime.device.step.engine_step` on every data shard at once.

    Args:
      mesh: the engine's mesh (bound before jitting).
      spec: as for ``engine_step``, static; ``spec.engine`` is the *shard's* config
        (:func:`shard_config`).
      model_state: as for ``engine_step``, replicated over ``data``, except under expert
        parallelism the routed experts, split over ``data`` too.
      state, caches: stacked (module docstring).
      inputs: :class:`~jmtp.runtime.device.spec.StepInputs` stacked per shard: ``prefill_chunk``,
        ``draft_limit`` i32[D, B/D]; ``token_bitmask`` i32[D, B/D, K+1, NW]; ``draft_override``
        i32[D, B/D, K].
      param_specs: the ``data`` part of each leaf of ``model_state``'s placement, in leaf order
        (:func:`jmtp.runtime.device.sharding.data_specs`); None: every parameter replicated over
        ``data``.

    Returns:
      ``(state, caches, StepOutput)``, all stacked: ``StepOutput`` fields are ``[D, B/D, ...]``
      and ``free_count`` is ``i32[D]``.
    """
    leaves, treedef = jax.tree_util.tree_flatten(model_state)
    specs = tuple(param_specs) if param_specs is not None else (P(),) * len(leaves)
    if len(specs) != len(leaves):
        raise ValueError(f"param_specs has {len(specs)} entries for {len(leaves)} parameters")

    def body(leaves, state, caches, inputs):
        state, caches, out = engine_step(
            spec, jax.tree_util.tree_unflatten(treedef, leaves), _squeeze(state),
            _squeeze(caches), _squeeze(inputs))
        # prompt logprobs are per packed row of a shard: not served on a mesh (refused at intake)
        out = dataclasses.replace(out, prompt_logprobs=None, prompt_top_ids=None,
                                  prompt_top_logprobs=None, prompt_row_start=None)
        return _expand((state, caches, out))

    d = P(DATA)
    return _on_shard(mesh, body, (list(specs), d, d, d), d)(list(leaves), state, caches, inputs)


def one_shard_op(mesh: Mesh, single, *args, config: EngineConfig | None = None,
                 stacked: int = 1, pick: str = "where", idle=None, free: bool = False):
    """A slot operation ``single`` on one data shard: the data-parallel form of every
    :data:`~jmtp.runtime.device.placement.DEVICE_OPS` entry that declares no ``sharded`` function
    of its own (insert, release, retire, push_free, import).

    Args:
      mesh: the engine's mesh (bound before jitting).
      single: the single-shard function, called ``single(*config, *local, *rest)``.
      args: ``(*trees, shard, *rest)``: the first ``stacked`` arguments stacked per shard (the
        state; for the import also both caches), ``shard`` i32[] the data shard that runs it,
        ``rest`` replicated (the slot row and the operation's own arguments).
      config: the shard's :class:`EngineConfig`, passed first to ``single`` (None: not passed).
      stacked: how many leading arguments (and leading results) are stacked per shard.
      pick: how the other shards keep theirs: ``"where"`` (every shard runs ``single``, and
        ``jnp.where`` keeps the result on ``shard`` only; ``single`` returns the state alone) or
        ``"cond"`` (``lax.cond``: only ``shard`` runs it, the others return ``idle``).
      idle: with ``"cond"``, the others' results: ``idle(config, *local)``, shaped as
        ``single``'s.
      free: also return the new state's ``free_count`` per shard.

    Returns:
      ``single``'s first ``stacked`` results stacked again, each further result with a leading
      axis of D (only row ``shard`` is meaningful), then with ``free`` ``free_count i32[D]``; a
      lone result unwrapped.
    """
    cfg = () if config is None else (config,)

    def body(*a):
        local, shard, rest = tuple(_squeeze(x) for x in a[:stacked]), a[stacked], a[stacked + 1:]
        if pick == "where":
            new = single(*cfg, *local, *rest)
            mine = jax.lax.axis_index(DATA) == shard
            res = jax.tree_util.tree_map(lambda n, o: jnp.where(mine, n, o), new, local[0])
        else:
            ops = local[0] if stacked == 1 else local
            unpack = (lambda o: (o,)) if stacked == 1 else tuple
            res = jax.lax.cond(jax.lax.axis_index(DATA) == shard,
                               lambda o: single(*cfg, *unpack(o), *rest),
                               lambda o: idle(config, *unpack(o)), ops)
        res = res if type(res) is tuple else (res,)
        out = tuple(_expand(x) for x in res[:stacked]) + tuple(x[None] for x in res[stacked:])
        out += (res[0].free_count[None],) if free else ()
        return out if len(out) > 1 else out[0]

    return _on_shard(mesh, body, (P(DATA),) * stacked + (P(),) * (len(args) - stacked),
                     P(DATA))(*args)


def data_parallel_set_slot_state(mesh: Mesh, cache, shard, slot, load_entry, capture_entry):
    """:func:`~jmtp.runtime.device.slots.set_slot_state_of` on row ``slot`` of data shard ``shard``
    (entries shard-local); the other shards' caches unchanged."""
    def body(cache, shard, slot, load_entry, capture_entry):
        local = _squeeze(cache)
        # no cond over the cache (a conditional's result is a new buffer): the other shards
        # load nothing and keep their capture entry
        mine = jax.lax.axis_index(DATA) == shard
        keep = local.linear.saved.entry[slot]
        new = set_slot_state_of(local, slot, jnp.where(mine, load_entry, -1),
                                jnp.where(mine, capture_entry, keep))
        return _expand(new)

    r = P()
    return _on_shard(mesh, body, (P(DATA), r, r, r, r), P(DATA))(cache, shard, slot, load_entry,
                                                                 capture_entry)


def shard_gather(state, cache, mtp_cache, shard, slot, page_ids):
    """:func:`~jmtp.runtime.device.handoff_ops.gather_slot` of row ``slot`` of data shard ``shard`` of the
    stacked state and caches (jit it with replicated output shardings: the host reads it)."""
    pick = lambda t: jax.tree_util.tree_map(lambda x: x[shard], t)
    return gather_slot(pick(state), pick(cache), pick(mtp_cache), slot, page_ids)


__all__ = ["shard_config", "stack_shards", "data_parallel_step", "one_shard_op",
           "data_parallel_set_slot_state", "shard_gather"]
