"""The parameter schema: every parameter's shape, logical axes, initialiser and dtype rule, once.

Two tables say everything about a parameter:

- :data:`LEAVES` maps a parameter's name (its key in :mod:`jmtp.model.llama`'s parameter dict)
  to a :class:`Leaf`: its logical axis names (:mod:`jmtp.model.axes`, one per dimension, without
  a stack's leading ``layers`` axis), how a fresh one is initialised and whether it stays f32
  whatever the model dtype;
- the ``*_shapes(cfg)`` functions give each block's parameter shapes for a
  :class:`~jmtp.model.config.ModelConfig` (the architecture decides which parameters exist).

Everything else is derived from them: :func:`param_shapes` and :func:`param_specs` (the whole
tree, what :func:`jmtp.model.params.check_params` and the loaders check against),
:func:`abstract_params` (``jax.ShapeDtypeStruct`` s for AOT compiles and abstract engines),
:func:`initial_value` (the random initialisers of :func:`jmtp.model.params.init_params` and of
the NNX modules of :mod:`jmtp.model.modules`, which build their ``nnx.Param`` s by iterating the
same shape functions), and the axis tables :data:`LAYER_AXES` / :data:`TOP_AXES` /
:data:`MTP_AXES` that sharding reads.

Layout of the tree (``[...]`` only for some architectures, ``L`` stacked layers, ``N`` MTP
modules; names and axes in :mod:`jmtp.model.axes`)::

  embed f[V, H]   [lm_head f[H, V]]   final_norm f[H]
  layers.<layer_shapes>     stacked f[L, ...] (or a tuple of L dicts, :func:`layers_stacked`)
  [mtp.enorm / hnorm / final_norm f[N, H], mtp.eh_proj f[N, 2H, H], mtp.layer.<layer_shapes>]
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jmtp.model.axes import (EMBED, EMBED2, EXPERT_MLP, EXPERTS, HEAD_DIM, KV_HEADS, LAYERS, MLP,
                             Q_HEADS, VOCAB)
from jmtp.model.config import ModelConfig

INITS = ("normal", "ones", "zeros", "fan_in")


@dataclasses.dataclass(frozen=True)
class Leaf:
    """What one named parameter is, whatever its shape.

    Attributes:
      axes: logical axis names, one per dimension (None: replicated).
      init: a fresh value: ``"normal"`` N(0, std²) with the caller's std, ``std`` set: N(0,
        std²) with this std, ``"fan_in"`` N(0, 1/fan_in) (fan_in = the second-to-last dim),
        ``"ones"``, ``"zeros"``.
      std: a fixed standard deviation for ``"normal"`` (gated-DeltaNet convolution taps).
      f32: kept in f32 whatever the model dtype (the MoE score-correction bias).
    """

    axes: tuple
    init: str = "normal"
    std: float | None = None
    f32: bool = False

    def __post_init__(self):
        if self.init not in INITS:
            raise ValueError(f"Leaf.init must be one of {INITS}, got {self.init!r}")


_ONES, _ZEROS = "ones", "zeros"

#: Every parameter by name (decoder-layer ones without their ``layers`` axis).
LEAVES: dict[str, Leaf] = {
    # top level
    "embed": Leaf((VOCAB, EMBED)), "lm_head": Leaf((EMBED, VOCAB)),
    "final_norm": Leaf((EMBED,), _ONES),
    # decoder layer: norms and GQA attention (Qwen2 biases, Qwen3 q/k norms, gated output)
    "attn_norm": Leaf((EMBED,), _ONES), "mlp_norm": Leaf((EMBED,), _ONES),
    "wq": Leaf((EMBED, Q_HEADS)), "wk": Leaf((EMBED, KV_HEADS)), "wv": Leaf((EMBED, KV_HEADS)),
    "wo": Leaf((Q_HEADS, EMBED)),
    "bq": Leaf((Q_HEADS,)), "bk": Leaf((KV_HEADS,)), "bv": Leaf((KV_HEADS,)),
    "wg": Leaf((EMBED, Q_HEADS)),
    "q_norm": Leaf((HEAD_DIM,), _ONES), "k_norm": Leaf((HEAD_DIM,), _ONES),
    # DeepSeek MLA (jmtp.model.mla): the latent ranks are unnamed (replicated)
    "wq_a": Leaf((EMBED, None)), "q_a_norm": Leaf((None,), _ONES), "wq_b": Leaf((None, Q_HEADS)),
    "wkv_a": Leaf((EMBED, None)), "kv_a_norm": Leaf((None,), _ONES),
    "wkv_b": Leaf((None, Q_HEADS)),
    # dense SwiGLU FFN
    "w_gate": Leaf((EMBED, MLP)), "w_up": Leaf((EMBED, MLP)), "w_down": Leaf((MLP, EMBED)),
    # MoE FFN (jmtp.model.moe): the router's expert axis is unnamed, so every device routes its
    # own tokens (expert parallelism splits only the experts)
    "router": Leaf((EMBED, None)), "router_bias": Leaf((None,), _ZEROS, f32=True),
    "experts_gate": Leaf((EXPERTS, EMBED, EXPERT_MLP)),
    "experts_up": Leaf((EXPERTS, EMBED, EXPERT_MLP)),
    "experts_down": Leaf((EXPERTS, EXPERT_MLP, EMBED)),
    "shared_gate": Leaf((EMBED, MLP)), "shared_up": Leaf((EMBED, MLP)),
    "shared_down": Leaf((MLP, EMBED)), "shared_expert_gate": Leaf((EMBED, None)),
    # gated DeltaNet (jmtp.model.gated_deltanet): key heads Hk·Dk and value heads Hv·Dv split
    # like attention heads; the per-head vectors with the value heads. Initialised as
    # transformers does up to A's range: A_log = 0, dt_bias = 1, taps N(0, 0.25).
    "lin_q": Leaf((EMBED, Q_HEADS)), "lin_k": Leaf((EMBED, Q_HEADS)),
    "lin_v": Leaf((EMBED, Q_HEADS)), "lin_z": Leaf((EMBED, Q_HEADS)),
    "lin_a": Leaf((EMBED, Q_HEADS)), "lin_b": Leaf((EMBED, Q_HEADS)),
    "conv_q": Leaf((None, Q_HEADS), std=0.5), "conv_k": Leaf((None, Q_HEADS), std=0.5),
    "conv_v": Leaf((None, Q_HEADS), std=0.5),
    "dt_bias": Leaf((Q_HEADS,), _ONES), "a_log": Leaf((Q_HEADS,), _ZEROS),
    "lin_norm": Leaf((None,), _ONES), "lin_out": Leaf((Q_HEADS, EMBED)),
    # MTP modules (without their leading ``layers`` axis of N)
    "enorm": Leaf((EMBED,), _ONES), "hnorm": Leaf((EMBED,), _ONES),
    "eh_proj": Leaf((EMBED2, EMBED), "fan_in"),
    # buffers (never initialised at random: derived at load time)
    "draft_head": Leaf((VOCAB, EMBED)), "draft_ids": Leaf((VOCAB,)), "draft_vocab": Leaf((VOCAB,)),
    "k_shift": Leaf((LAYERS, KV_HEADS, HEAD_DIM), f32=True),
}

_TOP = ("embed", "lm_head", "final_norm", "draft_head", "draft_ids", "draft_vocab", "k_shift")
_MTP = ("enorm", "hnorm", "final_norm", "eh_proj")
#: Axis tables derived from :data:`LEAVES` (what sharding reads): decoder-layer parameters,
#: top-level parameters and buffers, MTP-module parameters (without their leading axis).
LAYER_AXES = {k: v.axes for k, v in LEAVES.items() if k not in _TOP + _MTP}
TOP_AXES = {k: LEAVES[k].axes for k in _TOP}
MTP_AXES = {k: LEAVES[k].axes for k in _MTP}


# -- shapes, by block ----------------------------------------------------------------------------

def attention_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """One layer's attention parameters. GQA: ``wq f[H, Nq·D]``, ``wk, wv f[H, Nkv·D]``,
    ``wo f[Nq·D, H]``, Qwen2 biases ``bq, bk, bv`` (``cfg.attention_bias``), the gated output's
    ``wg f[H, Nq·D]`` (``cfg.attn_output_gate``), Qwen3 ``q_norm, k_norm f[D]``
    (``cfg.qk_norm``). MLA (DeepSeek, ``[in, out]`` weights, :mod:`jmtp.model.mla`)::

      [wq_a f[H, Rq], q_a_norm f[Rq], wq_b f[Rq, Nq*(dn+dr)]]   (q_lora_rank = Rq)
      [wq f[H, Nq*(dn+dr)]]                                       (q_lora_rank None)
      wkv_a f[H, C+dr]  kv_a_norm f[C]  wkv_b f[C, Nq*(dn+dv)]  wo f[Nq*dv, H]
    """
    h = cfg.hidden_size
    if cfg.is_mla:
        nq, c = cfg.num_heads, cfg.kv_lora_rank
        qd = nq * cfg.qk_head_dim
        shapes = {"wkv_a": (h, c + cfg.qk_rope_head_dim), "kv_a_norm": (c,),
                  "wkv_b": (c, nq * (cfg.qk_nope_head_dim + cfg.v_head_dim)),
                  "wo": (nq * cfg.v_head_dim, h)}
        if cfg.q_lora_rank is None:
            shapes["wq"] = (h, qd)
        else:
            shapes.update(wq_a=(h, cfg.q_lora_rank), q_a_norm=(cfg.q_lora_rank,),
                          wq_b=(cfg.q_lora_rank, qd))
        return shapes
    q, kv = cfg.q_size, cfg.kv_size
    shapes = {"wq": (h, q), "wk": (h, kv), "wv": (h, kv), "wo": (q, h)}
    if cfg.attention_bias:
        shapes.update(bq=(q,), bk=(kv,), bv=(kv,))
    if cfg.attn_output_gate:
        shapes.update(wg=(h, q))
    if cfg.qk_norm:
        shapes.update(q_norm=(cfg.head_dim,), k_norm=(cfg.head_dim,))
    return shapes


def linear_attention_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """A linear-attention (gated DeltaNet) layer's token mixer: ``lin_q, lin_k f[H, Hk·Dk]``,
    ``lin_v, lin_z f[H, Hv·Dv]``, ``lin_a, lin_b f[H, Hv]``, ``conv_q, conv_k f[Kc, Hk·Dk]``,
    ``conv_v f[Kc, Hv·Dv]``, ``dt_bias, a_log f[Hv]``, ``lin_norm f[Dv]``, ``lin_out
    f[Hv·Dv, H]``."""
    lc, hs = cfg.linear, cfg.hidden_size
    kd, vd, hv, kc = lc.key_dim, lc.value_dim, lc.num_value_heads, lc.conv_kernel_dim
    return {"lin_q": (hs, kd), "lin_k": (hs, kd), "lin_v": (hs, vd), "lin_z": (hs, vd),
            "lin_a": (hs, hv), "lin_b": (hs, hv), "conv_q": (kc, kd), "conv_k": (kc, kd),
            "conv_v": (kc, vd), "dt_bias": (hv,), "a_log": (hv,), "lin_norm": (lc.value_head_dim,),
            "lin_out": (vd, hs)}


def mlp_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The dense SwiGLU FFN: ``w_gate, w_up f[H, I]``, ``w_down f[I, H]``."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    return {"w_gate": (h, i), "w_up": (h, i), "w_down": (i, h)}


def moe_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """A MoE FFN (:mod:`jmtp.model.moe`): ``router f[H, E]``, ``experts_gate, experts_up
    f[E, H, I_e]``, ``experts_down f[E, I_e, H]``, ``[router_bias f32[E]]``
    (``moe.score_bias``), ``[shared_gate, shared_up f[H, I_s], shared_down f[I_s, H],
    [shared_expert_gate f[H, 1]]]``.

    Raises:
      ValueError: ``cfg.moe`` is None."""
    m = cfg.moe
    if m is None:
        raise ValueError("moe_shapes: ModelConfig.moe is None (a dense model)")
    h, e, i = cfg.hidden_size, m.num_experts, m.moe_intermediate_size
    shapes = {"router": (h, e), "experts_gate": (e, h, i), "experts_up": (e, h, i),
              "experts_down": (e, i, h)}
    if m.score_bias:
        shapes["router_bias"] = (e,)
    if m.shared_intermediate_size:
        s = m.shared_intermediate_size
        shapes.update(shared_gate=(h, s), shared_up=(h, s), shared_down=(s, h))
        if m.shared_expert_gate:
            shapes["shared_expert_gate"] = (h, 1)
    return shapes


def layer_shapes(cfg: ModelConfig, moe: bool = False,
                 linear: bool = False) -> dict[str, tuple[int, ...]]:
    """One decoder layer (no leading layer axis): ``attn_norm f[H]``, the token mixer
    (:func:`attention_shapes`, or :func:`linear_attention_shapes` with ``linear``),
    ``mlp_norm f[H]`` and the FFN (:func:`mlp_shapes`, or :func:`moe_shapes` with ``moe``)."""
    h = cfg.hidden_size
    mixer = linear_attention_shapes(cfg) if linear else attention_shapes(cfg)
    return {"attn_norm": (h,), **mixer, "mlp_norm": (h,),
            **(moe_shapes(cfg) if moe else mlp_shapes(cfg))}


def top_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The top-level parameters: ``embed f[V, H]``, ``lm_head f[H, V]`` (untied only),
    ``final_norm f[H]``."""
    v, h = cfg.vocab_size, cfg.hidden_size
    shapes = {"embed": (v, h)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (h, v)
    shapes["final_norm"] = (h,)
    return shapes


def mtp_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """One MTP module's own parameters: ``enorm, hnorm, final_norm f[H]``, ``eh_proj f[2H, H]``
    (its decoder layer is :func:`layer_shapes` with ``cfg.mtp_is_moe``)."""
    h = cfg.hidden_size
    return {"enorm": (h,), "hnorm": (h,), "eh_proj": (2 * h, h), "final_norm": (h,)}


def layer_kinds(cfg: ModelConfig) -> tuple[tuple[bool, bool], ...]:
    """``(moe, linear)`` of every target layer (the arguments of :func:`layer_shapes`)."""
    return tuple((m, cfg.layer_type(i) == "linear_attention")
                 for i, m in enumerate(cfg.moe_layer_kinds))


def layers_stacked(cfg: ModelConfig) -> bool:
    """Whether the target's layers are one stack (``params["layers"]`` a dict of ``f[L, ...]``,
    run under one ``lax.scan``): every layer has the same kind. A model mixing dense and MoE
    layers, or attention and linear-attention layers, holds a tuple of L per-layer dicts, run as
    an unrolled loop."""
    return len(set(layer_kinds(cfg))) == 1


# -- the whole tree -----------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """One leaf of the parameter tree: its full shape (stack axis included), logical axes and
    :class:`Leaf` rule."""

    name: str
    shape: tuple[int, ...]
    axes: tuple
    leaf: Leaf

    def dtype(self, dtype):
        """The leaf's dtype in a model of ``dtype`` (f32 where the leaf says so)."""
        return jnp.float32 if self.leaf.f32 else dtype


def _specs(shapes: dict, lead: tuple[int, ...] = ()) -> dict[str, TensorSpec]:
    stack = (LAYERS,) if lead else ()
    return {k: TensorSpec(k, lead + tuple(s), stack + LEAVES[k].axes, LEAVES[k])
            for k, s in shapes.items()}


def param_specs(cfg: ModelConfig) -> dict:
    """Every leaf of the parameter tree of ``cfg`` as a :class:`TensorSpec`: ``"layers"`` a dict
    of stacked specs, or a tuple of L per-layer dicts when :func:`layers_stacked` is false;
    ``"lm_head"`` only when untied; ``"mtp"`` only with ``cfg.num_mtp_layers``."""
    kinds = layer_kinds(cfg)
    if layers_stacked(cfg):
        layers = _specs(layer_shapes(cfg, *kinds[0]), (cfg.num_layers,))
    else:
        layers = tuple(_specs(layer_shapes(cfg, *k)) for k in kinds)
    out = {**_specs(top_shapes(cfg)), "layers": layers}
    n = cfg.num_mtp_layers
    if n:
        out["mtp"] = {**_specs(mtp_shapes(cfg), (n,)),
                      "layer": _specs(layer_shapes(cfg, cfg.mtp_is_moe), (n,))}
    return out


def _is_spec(x) -> bool:
    return isinstance(x, TensorSpec)


def param_shapes(cfg: ModelConfig) -> dict:
    """:func:`param_specs` with each leaf's shape tuple (what loaders and
    :func:`jmtp.model.params.check_params` check against)."""
    return jax.tree_util.tree_map(lambda s: s.shape, param_specs(cfg), is_leaf=_is_spec)


def param_axes(cfg: ModelConfig) -> dict:
    """:func:`param_specs` with each leaf's logical axis names (``layers`` first when stacked)."""
    return jax.tree_util.tree_map(lambda s: s.axes, param_specs(cfg), is_leaf=_is_spec)


def abstract_params(cfg: ModelConfig, dtype) -> dict:
    """The float parameter tree of ``cfg`` as ``jax.ShapeDtypeStruct`` s in ``dtype`` (f32 leaves
    where :class:`Leaf` says so); nothing allocated. 8-bit weights:
    :func:`jmtp.model.quant_params.abstract_quantized`."""
    return jax.tree_util.tree_map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype(dtype)),
                                  param_specs(cfg), is_leaf=_is_spec)


def leaf_dtype(name: str, dtype):
    """The dtype a parameter called ``name`` takes in a model of ``dtype`` (loaders)."""
    leaf = LEAVES.get(name)
    return jnp.float32 if leaf is not None and leaf.f32 else dtype


def needs_key(name: str) -> bool:
    """Whether a fresh ``name`` is drawn at random (takes a PRNG key)."""
    return LEAVES[name].init in ("normal", "fan_in")


def initial_value(name: str, shape: tuple[int, ...], dtype, std: float = 0.02,
                  key: jax.Array | None = None) -> jax.Array:
    """A fresh value of parameter ``name`` of ``shape`` (stack axis included) by its
    :class:`Leaf` rule; random draws are made in f32 then cast (``key`` required for those,
    :func:`needs_key`).

    Raises:
      ValueError: an unknown parameter name, or no ``key`` for a random one."""
    if name not in LEAVES:
        raise ValueError(f"unknown parameter {name!r} (jmtp.model.schema.LEAVES)")
    leaf = LEAVES[name]
    dtype = jnp.float32 if leaf.f32 else dtype
    if leaf.init == "ones":
        return jnp.ones(shape, dtype)
    if leaf.init == "zeros":
        return jnp.zeros(shape, dtype)
    if key is None:
        raise ValueError(f"a random initial value of {name!r} needs a PRNG key")
    scale = shape[-2] ** -0.5 if leaf.init == "fan_in" else (leaf.std or std)
    return (scale * jax.random.normal(key, shape, jnp.float32)).astype(dtype)
