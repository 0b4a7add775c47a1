"""Parameter pytrees: random initialisation (tests, fresh MTP heads), kv-head replication and
validation, all following the schema of :mod:`jmtp.model.schema`."""
from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np

from jmtp.model import schema
from jmtp.model.config import ModelConfig
from jmtp.model.schema import layer_kinds, layer_shapes, layers_stacked, param_shapes
from jmtp.model.quant import QuantizedWeight, check_quantized, is_quantized, param_dtype

log = logging.getLogger(__name__)


def init_layers(cfg: ModelConfig, key: jax.Array, num: int, dtype, std: float = 0.02,
                moe: bool = False, linear: bool = False) -> dict:
    """Random stacked layers ``f[num, ...]``, each parameter by its schema rule
    (:func:`jmtp.model.schema.initial_value`: norms 1, matrices and biases N(0, std²), MoE
    score-correction biases 0 in f32, ...); parameter ``i`` of the sorted names draws from
    ``fold_in(key, i)``."""
    return {name: schema.initial_value(name, (num,) + shape, dtype, std, jax.random.fold_in(key, i))
            for i, (name, shape) in enumerate(sorted(layer_shapes(cfg, moe, linear).items()))}


def init_params(cfg: ModelConfig, key: jax.Array, dtype=jnp.float32, std: float = 0.02) -> dict:
    """Random parameters for ``cfg`` (tiny test models). Includes an MTP head if num_mtp_layers > 0."""
    k_emb, k_layers, k_head, k_mtp = jax.random.split(key, 4)
    keys = {"embed": k_emb, "lm_head": k_head}
    params = {name: schema.initial_value(name, shape, dtype, std, keys.get(name))
              for name, shape in schema.top_shapes(cfg).items()}
    params["layers"] = _init_target_layers(cfg, k_layers, dtype, std)
    if cfg.num_mtp_layers:
        params["mtp"] = init_mtp_params(cfg, params, k_mtp, dtype)
    return params


def _init_target_layers(cfg: ModelConfig, key, dtype, std):
    kinds = layer_kinds(cfg)
    if layers_stacked(cfg):
        return init_layers(cfg, key, cfg.num_layers, dtype, std, *kinds[0])
    return tuple(jax.tree_util.tree_map(lambda a: a[0], init_layers(
        cfg, jax.random.fold_in(key, i), 1, dtype, std, *m)) for i, m in enumerate(kinds))


def init_mtp_params(cfg: ModelConfig, params: dict, key: jax.Array, dtype=None) -> dict:
    """A fresh (untrained) MTP head for a target without MTP weights.

    The block starts as a copy of the target's last layer and ``eh_proj`` as a random projection;
    the final norm starts as the target's final norm; a hybrid target's head copies its last
    full-attention layer. (A MoE target's head therefore has the last
    layer's FFN kind: ``cfg.moe.mtp_moe`` must say the same, see
    :func:`mtp_moe_of_fresh_head`.) Used when a checkpoint ships no MTP tensors
    (logged), and as the starting point of ``jmtp train-mtp``.
    """
    n = max(cfg.num_mtp_layers, 1)
    h = cfg.hidden_size
    dtype = dtype or param_dtype(params)
    # Built in numpy: a handful of host ops instead of dozens of tiny XLA compiles at load time.
    seed = int(np.asarray(jax.random.key_data(key)).ravel()[-1]) if hasattr(key, "dtype") else 0
    rng = np.random.default_rng(seed)
    cast = lambda a: jnp.asarray(np.asarray(a, np.float32), dtype)
    layers = params["layers"]
    if cfg.is_hybrid:      # the head is full attention: copy the last full-attention layer
        layers = (layers[cfg.kv_layers[-1]],)
    last_layer = (layers[-1] if isinstance(layers, (list, tuple)) else
                  jax.tree_util.tree_map(lambda a: a[-1], layers))

    def repeat(k, a):      # n copies; an 8-bit layer's weights stay 8-bit (values and scales)
        if is_quantized(a):
            return QuantizedWeight(jnp.repeat(a.value[None], n, 0),
                                   jnp.repeat(a.scale[None], n, 0), a.block)
        return jnp.asarray(np.repeat(np.asarray(a, np.float32)[None], n, 0),
                           schema.leaf_dtype(k, dtype))
    last = {k: repeat(k, a) for k, a in last_layer.items()}
    eh = rng.standard_normal((n, 2 * h, h), np.float32) / np.sqrt(2 * h)
    return {
        "enorm": cast(np.ones((n, h))),
        "hnorm": cast(np.ones((n, h))),
        "eh_proj": cast(eh),
        "final_norm": cast(np.repeat(np.asarray(params["final_norm"], np.float32)[None], n, 0)),
        "layer": last,
    }


def mtp_moe_of_fresh_head(cfg: ModelConfig) -> ModelConfig:
    """``cfg`` with ``moe.mtp_moe`` set to the kind of the last target layer (of a hybrid model:
    the last full-attention layer; what :func:`init_mtp_params` copies)."""
    if cfg.moe is None:
        return cfg
    last = cfg.kv_layers[-1] if cfg.is_hybrid else -1
    return cfg.replace(moe=cfg.moe.replace(mtp_moe=cfg.moe_layer_kinds[last]))


KV_PROJECTIONS = ("wk", "wv", "bk", "bv")


def replicate_kv_heads(cfg: ModelConfig, params: dict, factor: int) -> tuple[ModelConfig, dict]:
    """The same model with every kv head repeated ``factor`` times, for tensor parallelism over
    more devices than kv heads (each device then holds one copy of the kv head its query heads
    use; vLLM and tpu-inference replicate the same way).

    Exact: kv head ``j`` becomes heads ``j·f .. j·f+f-1`` (the columns of ``wk``/``wv`` and the
    ``bk``/``bv`` entries of head ``j``, in every target and MTP layer, and the int8 cache's key
    shift row), so query head ``h`` of group size ``G' = G / f`` reads head ``h // G'``, a copy of
    its original head ``h // G``. The KV cache grows by ``f``. ``jax.ShapeDtypeStruct`` leaves
    (abstract parameters) get the new shapes.

    Returns:
      ``(cfg with num_kv_heads · factor, params)``.

    Raises:
      ValueError: ``factor`` < 1, or an MLA model (no kv heads to repeat).
    """
    if factor < 1 or cfg.is_mla:
        raise ValueError(f"kv heads can be replicated by a factor >= 1 of a GQA model, got "
                         f"factor={factor} for attention_type={cfg.attention_type!r}")
    if factor == 1:
        return cfg, params
    nkv, d = cfg.num_kv_heads, cfg.head_dim

    def heads(a, axis_len, d=d):   # repeat along the head axis of a [..., Nkv, X] view
        if is_quantized(a):        # 8-bit wk / wv: values per head, scales per head's columns
            bn = a.block[1]
            if d % bn:
                raise ValueError(f"kv heads of head_dim {d} cannot be replicated in 8-bit "
                                 f"blocks {a.block} (the block must divide head_dim)")
            return QuantizedWeight(heads(a.value, True), heads(a.scale, True, d // bn), a.block)
        if isinstance(a, jax.ShapeDtypeStruct):
            shape = list(a.shape)
            shape[-1 if axis_len else -2] *= factor
            return jax.ShapeDtypeStruct(tuple(shape), a.dtype)
        if axis_len:          # merged last axis Nkv·D
            x = a.reshape(a.shape[:-1] + (nkv, 1, d))
            x = jnp.broadcast_to(x, a.shape[:-1] + (nkv, factor, d))
            return x.reshape(a.shape[:-1] + (nkv * factor * d,))
        return jnp.repeat(a, factor, axis=-2)   # [..., Nkv, D] (key shift)

    def layer(p):
        return {k: heads(v, True) if k in KV_PROJECTIONS else v for k, v in p.items()}

    out = dict(params)
    ls = params["layers"]
    out["layers"] = tuple(layer(p) for p in ls) if isinstance(ls, (list, tuple)) else layer(ls)
    if "mtp" in params:
        out["mtp"] = {**params["mtp"], "layer": layer(params["mtp"]["layer"])}
    if "k_shift" in params:
        out["k_shift"] = heads(params["k_shift"], False)
    return cfg.replace(num_kv_heads=nkv * factor), out


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
        kinds = layer_kinds(cfg)
        for i, layer in enumerate(layers):
            walk(layer_shapes(cfg, *kinds[i]), layer, f"layers[{i}]")
        expected = {k: v for k, v in expected.items() if k != "layers"}
    elif not layers_stacked(cfg):
        raise ValueError(f"{source}: the model mixes dense and MoE layers (or attention and "
                         "linear-attention layers), so params['layers'] must be a tuple of "
                         "per-layer dicts")
    walk(expected, params, "")
    check_quantized(cfg, params, source)     # 8-bit weights where cfg.quantization says


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
