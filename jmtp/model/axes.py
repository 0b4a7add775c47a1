"""Logical axis names of model parameters and of the KV cache (the names; which parameter has
which is :mod:`jmtp.model.schema`).

Each ``nnx.Param`` of :mod:`jmtp.model.modules` carries a tuple of these names, one per array
dimension, as its ``out_sharding`` metadata (created with ``eager_sharding=False``: the names are
metadata only until a mesh and logical-to-mesh rules are given, e.g. with
``flax.nnx.spmd.get_var_pspec`` under ``flax.linen.logical_axis_rules``). Sharding code maps these
names to mesh axes; model code never names mesh axes itself.

=============  ===========================================================================
name           dimension
=============  ===========================================================================
``layers``     leading axis of a stack of decoder layers (target: L, MTP head: N modules)
``embed``      the hidden size H (residual stream)
``embed2``     the concatenated ``[enorm(e) ; hnorm(h)]`` input of the MTP ``eh_proj`` (2H)
``vocab``      the vocabulary V (or the N ids of an FR-Spec draft vocabulary)
``q_heads``    the fused query projection ``Nq·D`` (whole heads when split by Nq's divisors)
``kv_heads``   the fused key / value projection ``Nkv·D`` (same)
``head_dim``   one head's D (Qwen3 q/k-norm weights)
``mlp``        the SwiGLU intermediate size I (also the MoE shared experts' width)
``experts``    the E routed experts of a MoE layer (expert parallelism maps it onto the mesh;
               the router's expert axis stays unnamed)
``expert_mlp`` one routed expert's SwiGLU width I_e
=============  ===========================================================================

Which parameter has which axes is :mod:`jmtp.model.schema` 's :data:`~jmtp.model.schema.LEAVES`
(with each parameter's shape, initialiser and dtype rule); the tables :data:`~jmtp.model.schema.LAYER_AXES`,
``TOP_AXES`` and ``MTP_AXES`` are derived from it.

KV cache ``k, v: f[L, num_blocks, block_size, Nkv·D]`` (heads merged, head-major: a split over
``model`` gives each device whole heads): :data:`KV_CACHE_AXES`.
"""
from __future__ import annotations

# The names themselves live in jmtp.core.mesh (with the logical -> mesh table).
from jmtp.core.mesh import (ALL, BLOCK_SIZE, BLOCKS, EMBED, EMBED2, EXPERT_MLP,  # noqa: F401
                            EXPERTS, HEAD_DIM, KV_HEADS, LAYERS, MLP, Q_HEADS, VOCAB)

KV_CACHE_AXES = (LAYERS, BLOCKS, BLOCK_SIZE, KV_HEADS)   # last axis: Nkv·D, heads major
#: Scales of a quantised cache ``f32[L, num_blocks, Nkv, block_size]`` (``KVCache.k_scale``).
KV_SCALE_AXES = (LAYERS, BLOCKS, KV_HEADS, BLOCK_SIZE)
