"""Mixture-of-experts feed-forward: router, routed experts, shared experts.

The routed experts are SwiGLU MLPs (Shazeer 2020) selected per token by a top-k router (Shazeer et
al. 2017; the gating variants are those of :class:`jmtp.model.config.MoEConfig`: Qwen3-MoE,
DeepSeek-V3 / GLM-4.5 (the DeepSeek-V3 technical report's DeepSeekMoE section, arXiv 2412.19437),
and ERNIE-4.5-MoE, as in transformers' ``modeling_qwen3_moe.py``, ``modeling_glm4_moe.py`` and
``modeling_ernie4_5_moe.py``).

One MoE layer's parameters (a layer dict of :mod:`jmtp.model.llama`, ``[in, out]`` weights; axes
in :mod:`jmtp.model.axes`)::

  router        f[H, E]        router_bias  f32[E]   (MoEConfig.score_bias)
  experts_gate  f[E, H, I_e]   experts_up   f[E, H, I_e]   experts_down f[E, I_e, H]
  shared_gate   f[H, I_s]      shared_up    f[H, I_s]      shared_down  f[I_s, H]  (I_s > 0)

Two implementations of the routed experts, chosen by ``MoEConfig.implementation``, give the
same result up to float rounding:

* ``"dense"`` (:func:`experts_dense`): the reference. Every expert runs on every token and the
  outputs are summed with the routing weights (zero for experts not chosen); cost ~ E·T.
* ``"ragged"`` (:func:`experts_ragged`): the T·k (token, expert) pairs are sorted by expert and
  each expert multiplies only its contiguous group (``jax.lax.ragged_dot`` with the group sizes);
  cost ~ k·T where the backend has a grouped matmul (XLA:TPU). Shapes are static (T·k rows
  whatever the routing), so it jits once per T. XLA:CPU lowers ``ragged_dot`` to a masked dense
  product over all E groups, so there it costs k times the dense reference.

``"auto"`` (the default) picks ``"ragged"`` on TPU and ``"dense"`` elsewhere
(:func:`resolve_implementation`). With ``MoEConfig.expert_parallel`` on a device mesh the routed
experts are split over the devices and :func:`moe_ffn` hands the layer to
:mod:`jmtp.model.expert_parallel` (the same math, each device running its own experts).

8-bit experts (:class:`jmtp.model.quant.QuantizedWeight`) go through the same two paths:
every matmul is one of :mod:`jmtp.model.quant`'s (``matmul``, ``expert_matmul``,
``ragged_dot``), which are plain ``@`` / ``einsum`` / ``ragged_dot`` on float arrays.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jmtp.core.platform import host_platform
from jmtp.model import expert_parallel
from jmtp.model import quant
from jmtp.model.config import ModelConfig, MoEConfig
from jmtp.model.invariant import row_tiled
from jmtp.model import schema
from jmtp.model.variables import new_weight, own_variables

DENSE_FFN_KEYS = ("w_gate", "w_up", "w_down")
MOE_KEYS = ("router", "router_bias", "experts_gate", "experts_up", "experts_down",
            "shared_gate", "shared_up", "shared_down")


def is_moe(p: dict) -> bool:
    """Whether a layer dict holds a MoE FFN (``router``) rather than a dense one."""
    return "router" in p


def swiglu(x: jax.Array, w_gate, w_up, w_down) -> jax.Array:
    """``(silu(x @ w_gate) * (x @ w_up)) @ w_down``: ``f[T, H] -> f[T, H]`` (weights float or
    8-bit, :func:`jmtp.model.quant.matmul`)."""
    mm = quant.matmul
    return mm(jax.nn.silu(mm(x, w_gate)) * mm(x, w_up), w_down)


def route(moe: MoEConfig, x: jax.Array, router: jax.Array,
          bias: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Top-k routing of tokens ``x f[T, H]`` with the router ``f[H, E]`` (fp32 throughout).

    Scores ``s = softmax(x W)`` or ``sigmoid(x W)``; experts are chosen by ``s + bias`` (bias
    ``f32[E]`` only when given), within the ``topk_group`` best of ``n_group`` groups (a group's
    score is the sum of its two best choice scores); their weights are ``s`` at the chosen
    experts (never the bias), renormalised if ``norm_topk_prob`` (by ``max(sum, norm_min)`` when
    ``norm_min > 0``, else by ``sum + 1e-20``), then times ``routed_scaling_factor``.

    Returns:
      ``(weights f32[T, k], ids i32[T, k])``.
    """
    logits = jnp.dot(x.astype(jnp.float32), router.astype(jnp.float32))
    scores = (jax.nn.softmax(logits, axis=-1) if moe.scoring == "softmax"
              else jax.nn.sigmoid(logits))
    choice = scores if bias is None else scores + bias.astype(jnp.float32)
    if moe.n_group > 1:
        t, e, g = x.shape[0], moe.num_experts, moe.n_group
        grouped = choice.reshape(t, g, e // g)
        group_scores = jax.lax.top_k(grouped, 2)[0].sum(-1)                    # f32[T, G]
        _, keep = jax.lax.top_k(group_scores, moe.topk_group)                  # i32[T, topk_group]
        mask = jnp.zeros((t, g), bool).at[jnp.arange(t)[:, None], keep].set(True)
        choice = jnp.where(jnp.repeat(mask, e // g, axis=1), choice, -jnp.inf)
    _, ids = jax.lax.top_k(choice, moe.num_experts_per_tok)
    weights = jnp.take_along_axis(scores, ids, axis=-1)
    if moe.norm_topk_prob:
        total = weights.sum(-1, keepdims=True)
        weights = weights / (jnp.maximum(total, moe.norm_min) if moe.norm_min > 0 else total + 1e-20)
    if moe.routed_scaling_factor != 1.0:
        weights = weights * moe.routed_scaling_factor
    return weights, ids.astype(jnp.int32)


def experts_dense(x, w_gate, w_up, w_down, weights, ids) -> jax.Array:
    """Reference: every expert on every token, summed with the routing weights.

    Args:
      x: f[T, H]; w_gate, w_up: f[E, H, I_e]; w_down: f[E, I_e, H] (float or 8-bit);
      weights: f32[T, k]; ids: i32[T, k] (from :func:`route`; an id ``E``, no expert of
        ``w_*``, contributes 0: a pair another device computes, :mod:`jmtp.model.expert_parallel`).

    Returns:
      f[T, H] in ``x.dtype``.
    """
    t, e = x.shape[0], w_gate.shape[0]
    gates = jnp.zeros((t, e + 1), jnp.float32).at[jnp.arange(t)[:, None], ids].add(weights)
    gates = gates[:, :e]
    em = quant.expert_matmul
    hid = jax.nn.silu(em(x, w_gate)) * em(x, w_up)
    y = em(hid, w_down)
    return jnp.einsum("te,eth->th", gates, y.astype(jnp.float32)).astype(x.dtype)


def experts_ragged(x, w_gate, w_up, w_down, weights, ids) -> jax.Array:
    """Sorted-by-expert grouped matmuls (``jax.lax.ragged_dot``); arguments and result as
    :func:`experts_dense`, except that an id ``E`` (no expert of ``w_*``: a pair another device
    computes, :mod:`jmtp.model.expert_parallel`) contributes 0.

    The ``T·k`` (token, expert) pairs are stably sorted by expert id; ``group_sizes i32[E]``
    counts each expert's rows, so expert ``e`` multiplies rows ``[sum(sizes[:e]),
    sum(sizes[:e+1]))`` only (the pairs of id ``E`` sort last, outside every group). Each row's
    output is scaled by its weight and the k rows of a token are summed back in its original
    order (fp32)."""
    t, k = ids.shape
    e = w_gate.shape[0]
    flat = ids.reshape(-1)                                                     # i32[T·k]
    order = jnp.argsort(flat, stable=True)                                     # pair index, sorted
    xs = x[order // k]                                                         # f[T·k, H]
    sizes = jnp.bincount(flat, length=e + 1)[:e].astype(jnp.int32)
    hid = (jax.nn.silu(quant.ragged_dot(xs, w_gate, sizes))
           * quant.ragged_dot(xs, w_up, sizes))
    y = quant.ragged_dot(hid, w_down, sizes).astype(jnp.float32)               # f32[T·k, H]
    y = jnp.where((flat[order] < e)[:, None], y * weights.reshape(-1)[order][:, None], 0.0)
    per_pair = jnp.zeros_like(y).at[order].set(y, unique_indices=True)
    return per_pair.reshape(t, k, -1).sum(1).astype(x.dtype)


EXPERT_IMPLEMENTATIONS = {"dense": experts_dense, "ragged": experts_ragged}


def resolve_implementation(implementation: str, platform: str | None = None) -> str:
    """``"auto"`` -> ``"ragged"`` on TPU, ``"dense"`` on other platforms; others unchanged.
    ``platform``: the platform compiled for (:mod:`jmtp.core.platform`; None: the host's; the
    engine resolves ``"auto"`` once, from its devices).

    Raises:
      ValueError: not ``"auto"``, ``"ragged"`` or ``"dense"``."""
    if implementation == "auto":
        return "ragged" if (platform or host_platform()) == "tpu" else "dense"
    if implementation not in EXPERT_IMPLEMENTATIONS:
        raise ValueError(f"MoE implementation must be one of "
                         f"{('auto',) + tuple(EXPERT_IMPLEMENTATIONS)}, got {implementation!r}")
    return implementation


def moe_ffn(moe: MoEConfig, p: dict, x: jax.Array, implementation: str | None = None) -> jax.Array:
    """The MoE FFN of one layer: routed experts (weighted) plus shared experts (unweighted).

    Args:
      moe: the configuration (gating, shared experts, default implementation).
      p: the layer dict (keys in the module docstring).
      x: f[T, H] post-norm hidden rows.
      implementation: ``"auto"``, ``"ragged"`` or ``"dense"``; default ``moe.implementation``.

    Returns:
      f[T, H].

    Raises:
      ValueError: unknown ``implementation``.
    """
    impl = resolve_implementation(implementation or moe.implementation)
    if expert_parallel.is_active(moe):     # routed experts split over the mesh
        return expert_parallel.moe_ffn(moe, p, x, route=route,
                                       experts=EXPERT_IMPLEMENTATIONS[impl], shared=shared_experts)
    weights, ids = route(moe, x, p["router"], p.get("router_bias"))
    out = EXPERT_IMPLEMENTATIONS[impl](x, p["experts_gate"], p["experts_up"], p["experts_down"],
                                       weights, ids)
    if "shared_gate" in p:
        out = out + shared_experts(p, x)
    return out


def shared_experts(p: dict, x: jax.Array) -> jax.Array:
    """The shared experts of a layer dict on ``x f[T, H]``: ``swiglu(x, shared_*)``, gated per
    token by ``sigmoid(x @ shared_expert_gate)`` when the layer has that gate (Qwen3-Next /
    Qwen3.5-MoE). f[T, H]."""
    shared = swiglu(x, p["shared_gate"], p["shared_up"], p["shared_down"])
    if "shared_expert_gate" in p:
        shared = jax.nn.sigmoid(x @ p["shared_expert_gate"]) * shared
    return shared


def ffn(cfg: ModelConfig, p: dict, x: jax.Array) -> jax.Array:
    """A layer's feed-forward on post-norm rows ``x f[T, H]``: the MoE block if the layer dict
    holds one (:func:`is_moe`), else the dense SwiGLU ``w_gate/w_up/w_down``."""
    if is_moe(p):
        if cfg.moe is None:
            raise ValueError("a layer holds MoE parameters (router) but ModelConfig.moe is None")
        return moe_ffn(cfg.moe, p, x)
    if cfg.batch_invariant:     # fixed row tiles (jmtp.model.invariant)
        return row_tiled(lambda t: swiglu(t, p["w_gate"], p["w_up"], p["w_down"]), x)
    return swiglu(x, p["w_gate"], p["w_up"], p["w_down"])


# ----------------------------------------------------------------------------------------------
# Flax NNX module
# ----------------------------------------------------------------------------------------------

class MoE(nnx.Module):
    """MoE feed-forward as NNX Params with logical axes (``experts`` for the expert axis):
    ``router f[H, E]``, optional ``router_bias f32[E]``, ``experts_gate/experts_up f[E, H, I_e]``,
    ``experts_down f[E, I_e, H]``, optional ``shared_gate/shared_up f[H, I_s]``,
    ``shared_down f[I_s, H]``; each with a leading ``layers`` axis of size ``num_stacked`` if given.

    Raises:
      ValueError: ``cfg.moe`` is None.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, dtype=jnp.float32,
                 num_stacked: int | None = None, std: float = 0.02, prefix: str = "layers"):
        self.moe = cfg.moe
        for name, shape in schema.moe_shapes(cfg).items():   # 8-bit where cfg.quantization says
            setattr(self, name, new_weight(cfg, name, shape, rngs=rngs, dtype=dtype, std=std,
                                           num_stacked=num_stacked, prefix=prefix))

    def __call__(self, x: jax.Array, implementation: str | None = None) -> jax.Array:
        """``f[T, H] -> f[T, H]`` (unstacked module only); see :func:`moe_ffn`."""
        params = jax.tree_util.tree_map(lambda v: v[...], self.variables(),
                                        is_leaf=lambda v: isinstance(v, nnx.Variable))
        return moe_ffn(self.moe, params, x, implementation)

    def variables(self) -> dict:
        return own_variables(self)
