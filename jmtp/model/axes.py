"""Logical axis names of every model parameter (and of the KV cache), in one place.

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

Parameters (``[...]`` = only for some architectures; ``L`` = ``layers``)::

  embed                   f[V, H]          (vocab, embed)
  lm_head                 f[H, V]          (embed, vocab)       absent when tied
  final_norm              f[H]             (embed,)
  layers.attn_norm        f[L, H]          (layers, embed)
  layers.attn.wq          f[L, H, Nq·D]    (layers, embed, q_heads)
  layers.attn.wk / wv     f[L, H, Nkv·D]   (layers, embed, kv_heads)
  layers.attn.wo          f[L, Nq·D, H]    (layers, q_heads, embed)
  [layers.attn.bq]        f[L, Nq·D]       (layers, q_heads)    Qwen2 biases
  [layers.attn.bk / bv]   f[L, Nkv·D]      (layers, kv_heads)
  [layers.attn.q_norm/k_norm] f[L, D]      (layers, head_dim)   Qwen3
  [layers.attn.wq_a f[L,H,Rq], q_a_norm f[L,Rq], wq_b f[L,Rq,Nq(dn+dr)], wkv_a f[L,H,C+dr],
   kv_a_norm f[L,C], wkv_b f[L,C,Nq(dn+dv)]]  (layers, embed|-, -|q_heads)  DeepSeek MLA
  layers.mlp_norm         f[L, H]          (layers, embed)
  layers.mlp.w_gate/w_up  f[L, H, I]       (layers, embed, mlp)
  layers.mlp.w_down       f[L, I, H]       (layers, mlp, embed)
  MoE layers instead of w_gate/w_up/w_down (:mod:`jmtp.model.moe`):
  router                  f[L, H, E]       (layers, embed, -)      replicated
  [router_bias]           f[L, E]          (layers, -)          score-correction bias
  experts_gate/experts_up f[L, E, H, I_e]  (layers, experts, embed, expert_mlp)
  experts_down            f[L, E, I_e, H]  (layers, experts, expert_mlp, embed)
  [shared_gate/shared_up] f[L, H, I_s]     (layers, embed, mlp)  shared experts
  [shared_down]           f[L, I_s, H]     (layers, mlp, embed)
  mtp.enorm / hnorm / final_norm  f[N, H]  (layers, embed)
  mtp.eh_proj             f[N, 2H, H]      (layers, embed2, embed)
  mtp.layer.*             as ``layers.*`` with N stacked
  draft_head (Buffer)     f[N', H]         (vocab, embed)       FR-Spec draft LM head
  draft_ids / draft_vocab (Buffer) i32[N'] / i32[V]  (vocab,)
  [k_shift] (Buffer)      f32[L, Nkv, D]   (layers, kv_heads, head_dim)  int8 KV caches' key shift

KV cache ``k, v: f[L, num_blocks, block_size, Nkv·D]`` (heads merged, head-major: a split over
``model`` gives each device whole heads): :data:`KV_CACHE_AXES`.
"""
from __future__ import annotations

# The names themselves live in jmtp.core.mesh (with the logical -> mesh table).
from jmtp.core.mesh import (ALL, BLOCK_SIZE, BLOCKS, EMBED, EMBED2, EXPERT_MLP,  # noqa: F401
                            EXPERTS, HEAD_DIM, KV_HEADS, LAYERS, MLP, Q_HEADS, VOCAB)

# One decoder layer's parameters (unstacked), by their name in the layer's parameter dict.
LAYER_AXES: dict[str, tuple[str, ...]] = {
    "attn_norm": (EMBED,), "mlp_norm": (EMBED,),
    "wq": (EMBED, Q_HEADS), "wk": (EMBED, KV_HEADS), "wv": (EMBED, KV_HEADS), "wo": (Q_HEADS, EMBED),
    "bq": (Q_HEADS,), "bk": (KV_HEADS,), "bv": (KV_HEADS,),
    "q_norm": (HEAD_DIM,), "k_norm": (HEAD_DIM,),
    "w_gate": (EMBED, MLP), "w_up": (EMBED, MLP), "w_down": (MLP, EMBED),
    # DeepSeek MLA (jmtp.model.mla); the latent ranks (q_lora_rank, kv_lora_rank + rope) are
    # unnamed (replicated).
    "wq_a": (EMBED, None), "q_a_norm": (None,), "wq_b": (None, Q_HEADS),
    "wkv_a": (EMBED, None), "kv_a_norm": (None,), "wkv_b": (None, Q_HEADS),
    # MoE FFN (jmtp.model.moe). The router is unnamed on its expert axis: replicated, so that
    # every device routes its own tokens (expert parallelism splits only the experts).
    "router": (EMBED, None), "router_bias": (None,),
    "experts_gate": (EXPERTS, EMBED, EXPERT_MLP), "experts_up": (EXPERTS, EMBED, EXPERT_MLP),
    "experts_down": (EXPERTS, EXPERT_MLP, EMBED),
    "shared_gate": (EMBED, MLP), "shared_up": (EMBED, MLP), "shared_down": (MLP, EMBED),
    "shared_expert_gate": (EMBED, None),
    # gated attention output gate (Qwen3-Next / Qwen3.5)
    "wg": (EMBED, Q_HEADS),
    # gated DeltaNet (jmtp.model.gated_deltanet): key heads Hk·Dk and value heads Hv·Dv split
    # over the model axis like attention heads (each device whole key heads and their value
    # heads); the per-head vectors (a, b, dt_bias, A_log) with the value heads.
    "lin_q": (EMBED, Q_HEADS), "lin_k": (EMBED, Q_HEADS), "lin_v": (EMBED, Q_HEADS),
    "lin_z": (EMBED, Q_HEADS), "lin_a": (EMBED, Q_HEADS), "lin_b": (EMBED, Q_HEADS),
    "conv_q": (None, Q_HEADS), "conv_k": (None, Q_HEADS), "conv_v": (None, Q_HEADS),
    "dt_bias": (Q_HEADS,), "a_log": (Q_HEADS,), "lin_norm": (None,),
    "lin_out": (Q_HEADS, EMBED),
}

# Top-level and MTP-head parameters (MTP entries without their leading ``layers`` axis).
TOP_AXES: dict[str, tuple[str, ...]] = {
    "embed": (VOCAB, EMBED), "lm_head": (EMBED, VOCAB), "final_norm": (EMBED,),
    "draft_head": (VOCAB, EMBED), "draft_ids": (VOCAB,), "draft_vocab": (VOCAB,),
    "k_shift": (LAYERS, KV_HEADS, HEAD_DIM),
}
MTP_AXES: dict[str, tuple[str, ...]] = {
    "enorm": (EMBED,), "hnorm": (EMBED,), "final_norm": (EMBED,), "eh_proj": (EMBED2, EMBED),
}

KV_CACHE_AXES = (LAYERS, BLOCKS, BLOCK_SIZE, KV_HEADS)   # last axis: Nkv·D, heads major
#: Scales of a quantised cache ``f32[L, num_blocks, Nkv, block_size]`` (``KVCache.k_scale``).
KV_SCALE_AXES = (LAYERS, BLOCKS, KV_HEADS, BLOCK_SIZE)
