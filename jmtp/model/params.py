"""Parameter pytrees: random initialisation (tests, fresh MTP heads) and validation."""
from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np

from jmtp.model.config import ModelConfig

log = logging.getLogger(__name__)


def layer_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Shapes of one decoder layer's parameters (without the leading layer axis)."""
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    if cfg.is_mla:
        from jmtp.model import mla
        return {"attn_norm": (h,), **mla.layer_shapes(cfg), "mlp_norm": (h,), "w_gate": (h, i),
                "w_up": (h, i), "w_down": (i, h)}
    shapes = {
        "attn_norm": (h,), "wq": (h, cfg.q_size), "wk": (h, cfg.kv_size), "wv": (h, cfg.kv_size),
        "wo": (cfg.q_size, h), "mlp_norm": (h,), "w_gate": (h, i), "w_up": (h, i), "w_down": (i, h),
    }
    if cfg.attention_bias:
        shapes.update(bq=(cfg.q_size,), bk=(cfg.kv_size,), bv=(cfg.kv_size,))
    if cfg.qk_norm:
        shapes.update(q_norm=(d,), k_norm=(d,))
    return shapes


def param_shapes(cfg: ModelConfig) -> dict:
    """Expected shape of every leaf of the parameter pytree (see :mod:`jmtp.model.llama`)."""
    h, v, n = cfg.hidden_size, cfg.vocab_size, cfg.num_mtp_layers
    shapes = {
        "embed": (v, h),
        "final_norm": (h,),
        "layers": {k: (cfg.num_layers,) + s for k, s in layer_shapes(cfg).items()},
    }
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (h, v)
    if n:
        shapes["mtp"] = {
            "enorm": (n, h), "hnorm": (n, h), "eh_proj": (n, 2 * h, h), "final_norm": (n, h),
            "layer": {k: (n,) + s for k, s in layer_shapes(cfg).items()},
        }
    return shapes


def _is_norm(name: str) -> bool:
    return name.endswith("norm")


def init_layers(cfg: ModelConfig, key: jax.Array, num: int, dtype, std: float = 0.02) -> dict:
    """Random stacked layers: norms = 1, biases = small normal, matrices = N(0, std²)."""
    out = {}
    for idx, (name, shape) in enumerate(sorted(layer_shapes(cfg).items())):
        k = jax.random.fold_in(key, idx)
        if _is_norm(name):
            out[name] = jnp.ones((num,) + shape, dtype)
        else:
            out[name] = (std * jax.random.normal(k, (num,) + shape, jnp.float32)).astype(dtype)
    return out


def init_params(cfg: ModelConfig, key: jax.Array, dtype=jnp.float32, std: float = 0.02) -> dict:
    """Random parameters for ``cfg`` (tiny test models). Includes an MTP head if num_mtp_layers > 0."""
    k_emb, k_layers, k_head, k_mtp = jax.random.split(key, 4)
    params = {
        "embed": (std * jax.random.normal(k_emb, (cfg.vocab_size, cfg.hidden_size))).astype(dtype),
        "final_norm": jnp.ones((cfg.hidden_size,), dtype),
        "layers": init_layers(cfg, k_layers, cfg.num_layers, dtype, std),
    }
    if not cfg.tie_word_embeddings:
        params["lm_head"] = (std * jax.random.normal(
            k_head, (cfg.hidden_size, cfg.vocab_size))).astype(dtype)
    if cfg.num_mtp_layers:
        params["mtp"] = init_mtp_params(cfg, params, k_mtp, dtype)
    return params


def init_mtp_params(cfg: ModelConfig, params: dict, key: jax.Array, dtype=None) -> dict:
    """A fresh (untrained) MTP head for a target without MTP weights.

    The block starts as a copy of the target's last layer and ``eh_proj`` as a random projection;
    the final norm starts as the target's final norm. Used when a checkpoint ships no MTP tensors
    (logged), and as the starting point of ``jmtp train-mtp``.
    """
    n = max(cfg.num_mtp_layers, 1)
    h = cfg.hidden_size
    dtype = dtype or params["embed"].dtype
    # Built in numpy: a handful of host ops instead of dozens of tiny XLA compiles at load time.
    seed = int(np.asarray(jax.random.key_data(key)).ravel()[-1]) if hasattr(key, "dtype") else 0
    rng = np.random.default_rng(seed)
    cast = lambda a: jnp.asarray(np.asarray(a, np.float32), dtype)
    last = jax.tree_util.tree_map(lambda a: cast(np.repeat(np.asarray(a[-1:], np.float32), n, 0)),
                                  params["layers"])
    eh = rng.standard_normal((n, 2 * h, h), np.float32) / np.sqrt(2 * h)
    return {
        "enorm": cast(np.ones((n, h))),
        "hnorm": cast(np.ones((n, h))),
        "eh_proj": cast(eh),
        "final_norm": cast(np.repeat(np.asarray(params["final_norm"], np.float32)[None], n, 0)),
        "layer": last,
    }


def check_params(cfg: ModelConfig, params: dict, source: str = "params") -> None:
    """Raise ``ValueError`` naming the tensor if any leaf is missing or has the wrong shape.

    ``params["layers"]`` may be stacked (``f[L, ...]`` leaves) or unstacked (a list of ``L``
    per-layer dicts, :func:`jmtp.model.llama.unstack_layers`)."""
    expected = param_shapes(cfg)
    walk = _walk_shapes(source)

    layers = params.get("layers") if isinstance(params, dict) else None
    if isinstance(layers, (list, tuple)):  # unstacked layers (jmtp.model.llama.unstack_layers)
        if len(layers) != cfg.num_layers:
            raise ValueError(f"{source}: {len(layers)} unstacked layers, expected {cfg.num_layers}")
        per_layer = layer_shapes(cfg)
        for i, layer in enumerate(layers):
            walk(per_layer, layer, f"layers[{i}]")
        expected = {k: v for k, v in expected.items() if k != "layers"}
    walk(expected, params, "")


def _walk_shapes(source: str):
    def walk(exp, got, path):
        for name, shape in exp.items():
            where = f"{path}.{name}" if path else name
            if name not in got:
                raise ValueError(f"{source}: missing tensor {where!r} (expected shape {shape})")
            if isinstance(shape, dict):
                walk(shape, got[name], where)
            elif tuple(got[name].shape) != tuple(shape):
                raise ValueError(
                    f"{source}: tensor {where!r} has shape {tuple(got[name].shape)}, expected {shape}")

    return walk
