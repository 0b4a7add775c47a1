"""8-bit weights in the parameter pytree: which paths are quantised, quantising a loaded model,
the abstract (shape-only) form for ahead-of-time compiles, the checks, and the byte counts.

Paths name a parameter of every layer that has it: ``"layers.wq"`` (target layers, stacked or
not), ``"mtp.layer.w_up"`` (the MTP modules' block), ``"mtp.eh_proj"``
(:class:`jmtp.model.quant.QuantConfig`), ``"embed"`` / ``"lm_head"`` the top-level tables.
``LLM(quantization="int8" | "fp8")`` quantises the decoder-block linears
(:data:`~jmtp.model.quant.QUANTIZABLE`) of the target and of the MTP layer; ``"int8"`` also the
token embedding (one scale per vocabulary row: a tied embedding's one int8 table serves the
gather and the LM head) and an untied LM head (per output channel), which the MTP layer shares.
Norms, routers, biases, the MTP ``eh_proj`` and gated-DeltaNet projections stay in the model
dtype, and with ``"fp8"`` the embedding and LM head too (the published FP8 checkpoints keep the
same set in BF16, DeepSeek-V3's ``eh_proj`` included).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jmtp.model.config import ModelConfig
from jmtp.model.schema import layer_kinds, layer_shapes
from jmtp.model.quant import (DEFAULT_FP8_BLOCK, EMBEDDINGS, MTP_PROJECTIONS, QUANT_METHODS, QUANTIZABLE,
                              QuantConfig, QuantizedWeight, dequantize, is_quantized, leaf_bytes,
                              quantize, scale_shape)


def _layer_dicts(params: dict):
    """``(path prefix, layer dict)`` of every target layer dict (one stacked dict, or one per
    layer) and of the MTP block."""
    layers = params.get("layers", {})
    for d in (layers if isinstance(layers, (list, tuple)) else (layers,)):
        yield "layers", d
    if "mtp" in params:
        yield "mtp.layer", params["mtp"]["layer"]


def quantized_paths(params: dict) -> tuple[str, ...]:
    """The paths whose leaves are :class:`~jmtp.model.quant.QuantizedWeight` s."""
    out = {f"{pre}.{k}" for pre, d in _layer_dicts(params) for k, v in d.items()
           if is_quantized(v)}
    out |= {k for k in EMBEDDINGS if is_quantized(params.get(k))}
    if "mtp" in params:
        out |= {f"mtp.{k}" for k in MTP_PROJECTIONS if is_quantized(params["mtp"].get(k))}
    return tuple(sorted(out))


def default_paths(params: dict, method: str = "fp8") -> tuple[str, ...]:
    """Paths ``quantization=method`` quantises: every decoder-block linear of the target and
    the MTP block present in ``params``, and with ``"int8"`` the embedding and LM head."""
    tables = {k for k in EMBEDDINGS if k in params} if method == "int8" else set()
    return tuple(sorted({f"{pre}.{k}" for pre, d in _layer_dicts(params) for k in d
                         if k in QUANTIZABLE} | tables))


def _check_uniform(params: dict) -> None:
    """Raise ``ValueError`` when a parameter is 8-bit in some target layers and not in others,
    or 8-bit with different blocks (one :class:`QuantConfig` describes all of them)."""
    layers = params.get("layers")
    if not isinstance(layers, (list, tuple)):
        return
    for k in {k for d in layers for k in d}:
        kinds = {(is_quantized(d[k]), getattr(d[k], "block", None),
                  str(d[k].dtype) if is_quantized(d[k]) else None) for d in layers if k in d}
        if len(kinds) > 1:
            bad = [i for i, d in enumerate(layers) if k in d and not is_quantized(d[k])]
            raise ValueError(f"tensor 'layers[{bad[0] if bad else 0}].{k}': some target layers "
                             f"hold it in 8 bits and others not (or in other blocks); one "
                             "quantisation per parameter name is supported")


def config_from_params(cfg: ModelConfig, params: dict, method: str,
                       weight_block_size: tuple[int, int] | None,
                       activation_scheme: str = "dynamic") -> ModelConfig:
    """``cfg`` with ``quantization`` describing the 8-bit leaves of ``params`` (None when there
    are none).

    Raises:
      ValueError: a parameter 8-bit in some layers only (:func:`_check_uniform`).
    """
    _check_uniform(params)
    paths = quantized_paths(params)
    if not paths:
        return cfg.replace(quantization=None)
    return cfg.replace(quantization=QuantConfig(method, weight_block_size, paths,
                                                activation_scheme))


def _convert(w, method: str, block_hf: tuple[int, int] | None, per_row: bool = False):
    """One weight in ``method``'s 8 bits: a float array quantised; an 8-bit weight of the same
    method and blocks kept; another 8-bit weight dequantised (f32) and quantised again.
    ``per_row``: one scale per row ``(1, N)`` (the embedding table)."""
    k, n = w.shape[-2:]
    block = (1, n) if per_row else None if block_hf is None else (block_hf[1], block_hf[0])
    want = block or (k, 1)
    if is_quantized(w):
        if w.dtype == jnp.dtype(QuantConfig(method).storage_dtype) and w.block == want:
            return w
        w = dequantize(w, jnp.float32)
    return quantize(w, method, block)


def quantize_params(cfg: ModelConfig, params: dict, method: str,
                    weight_block_size: tuple[int, int] | None = None) -> tuple[ModelConfig, dict]:
    """Every decoder-block linear of the target and the MTP block (:func:`default_paths`) in
    ``method``'s 8 bits, with ``"int8"`` also the embedding ``embed`` (one scale per vocabulary
    row) and an untied ``lm_head`` (per output channel); the other parameters unchanged.

    Args:
      method: ``"int8"`` (default: one scale per output channel) or ``"fp8"`` (default: the
        checkpoint's blocks when it has 8-bit weights already, else 128×128; the embedding and
        LM head stay as they are, as the published FP8 checkpoints keep them).
      weight_block_size: ``(out, in)`` block (HF order), or None for the default above.

    Returns:
      ``(cfg with quantization set, params)``. Weights already 8-bit in the requested method and
      blocks (an FP8 checkpoint's) are kept as they are; others (an FP8 weight asked to be int8)
      are dequantised and quantised again, one tensor at a time.

    Raises:
      ValueError: an unknown method.
    """
    if method not in QUANT_METHODS:
        raise ValueError(f"quantization must be one of {QUANT_METHODS} or None, got {method!r}")
    q = cfg.quantization
    if weight_block_size is None and method == "fp8":
        weight_block_size = (q.weight_block_size if q is not None and q.method == "fp8"
                             and q.weight_block_size else DEFAULT_FP8_BLOCK)
    def layer(d: dict) -> dict:
        return {k: (_convert(v, method, weight_block_size) if k in QUANTIZABLE else v)
                for k, v in d.items()}

    out = dict(params)
    if method == "int8":
        if "embed" in params:
            out["embed"] = _convert(params["embed"], method, None, per_row=True)
        if "lm_head" in params:
            out["lm_head"] = _convert(params["lm_head"], method, None)
    ls = params["layers"]
    out["layers"] = tuple(layer(d) for d in ls) if isinstance(ls, (list, tuple)) else layer(ls)
    if "mtp" in params:
        mtp = dict(params["mtp"], layer=layer(params["mtp"]["layer"]))
        for k in MTP_PROJECTIONS:     # kept 8-bit only if the checkpoint has it so
            if is_quantized(mtp.get(k)):
                mtp[k] = _convert(mtp[k], method, weight_block_size)
        out["mtp"] = mtp
    return config_from_params(cfg, out, method, weight_block_size,
                              q.activation_scheme if q is not None else "dynamic"), out


def with_quantization(cfg: ModelConfig, params: dict, quantization: str | None
                      ) -> tuple[ModelConfig, dict]:
    """The engine's ``quantization`` argument applied to loaded or given weights: None keeps them
    as they are (an FP8 checkpoint's weights stay 8-bit, its float ones float; ``cfg`` is made to
    describe them), ``"int8"`` / ``"fp8"`` quantise (:func:`quantize_params`).

    Raises:
      ValueError: an unknown value (naming ``quantization``), or mixed layers.
    """
    if quantization is None:
        q = cfg.quantization
        if q is None and not quantized_paths(params):
            return cfg, params
        method = q.method if q is not None else _method_of(params)
        return config_from_params(cfg, params, method, q.weight_block_size if q else None,
                                  q.activation_scheme if q else "dynamic"), params
    return quantize_params(cfg, params, quantization)


def _method_of(params: dict) -> str:
    for _, d in _layer_dicts(params):
        for v in d.values():
            if is_quantized(v):
                return "fp8" if v.dtype == jnp.float8_e4m3fn else "int8"
    return "int8"


def abstract_quantized(cfg: ModelConfig, params: dict) -> dict:
    """Abstract parameters (``jax.ShapeDtypeStruct`` leaves) with every path of
    ``cfg.quantization`` as an 8-bit :class:`QuantizedWeight` of ShapeDtypeStructs (values in the
    storage dtype, f32 scales): what ``jmtp compile`` plans with."""
    q = cfg.quantization
    if q is None:
        return params

    def one(pre: str, d: dict) -> dict:
        out = {}
        for k, v in d.items():
            path = f"{pre}.{k}" if pre else k
            if q.covers(path) and not is_quantized(v):
                blk = q.block_for(path, v.shape)
                v = QuantizedWeight(jax.ShapeDtypeStruct(v.shape, q.storage_dtype),
                                    jax.ShapeDtypeStruct(scale_shape(v.shape, blk), jnp.float32),
                                    blk)
            out[k] = v
        return out

    out = dict(params)
    out.update(one("", {k: params[k] for k in EMBEDDINGS if k in params}))
    ls = params["layers"]
    out["layers"] = (tuple(one("layers", d) for d in ls) if isinstance(ls, (list, tuple))
                     else one("layers", ls))
    if "mtp" in params:
        mtp = dict(params["mtp"], layer=one("mtp.layer", params["mtp"]["layer"]))
        mtp.update(one("mtp", {k: mtp[k] for k in MTP_PROJECTIONS if k in mtp}))
        out["mtp"] = mtp
    return out


def param_bytes(params: dict) -> dict[str, int]:
    """Bytes of a parameter dict (the pytree of :mod:`jmtp.model.llama`, arrays or
    ``jax.ShapeDtypeStruct`` s) by kind: ``quantized_values`` (the 8-bit values), ``scales``,
    ``unquantized`` (every other leaf), ``total``, and ``quantized_elements`` (the number of 8-bit
    weights). Whole arrays, not per device (:func:`jmtp.runtime.device.sharding.per_device_bytes`)."""
    values = scales = other = elements = 0
    for leaf in jax.tree_util.tree_leaves(params, is_leaf=is_quantized):
        if is_quantized(leaf):
            values += leaf_bytes(leaf.value)
            scales += leaf_bytes(leaf.scale)
            elements += int(np.prod(leaf.value.shape))
        else:
            other += leaf_bytes(leaf)
    return dict(quantized_values=values, scales=scales, unquantized=other,
                total=values + scales + other, quantized_elements=elements)


def config_paths(cfg: ModelConfig, method: str = "fp8") -> tuple[str, ...]:
    """The paths ``quantization=method`` (or a published FP8 config) makes 8-bit, from the
    config alone: every decoder-block linear of the target layers and of an MTP block, and with
    ``"int8"`` the embedding and an untied LM head."""
    names = {k for kind in layer_kinds(cfg) for k in layer_shapes(cfg, *kind)}
    mtp = set(layer_shapes(cfg, cfg.mtp_is_moe))
    tables = set()
    if method == "int8":
        tables = {"embed"} | (set() if cfg.tie_word_embeddings else {"lm_head"})
    return tuple(sorted({f"layers.{k}" for k in names if k in QUANTIZABLE}
                        | {f"mtp.layer.{k}" for k in mtp if k in QUANTIZABLE} | tables))


def config_quantization(cfg: ModelConfig, quantization: str | None,
                        checkpoint_quant=None) -> ModelConfig:
    """``cfg`` with the ``quantization`` an engine built from it alone (no weights: ``jmtp
    compile``) would have: None keeps a checkpoint's own FP8 ``quantization_config``
    (``checkpoint_quant``, :class:`~jmtp.model.checkpoints.fp8_checkpoint.CheckpointQuant`) or none;
    ``"int8"`` / ``"fp8"`` as :func:`quantize_params` (:func:`config_paths`).

    Raises:
      ValueError: an unknown ``quantization``.
    """
    if quantization is None and checkpoint_quant is None:
        return cfg
    method = quantization or "fp8"
    if method not in QUANT_METHODS:
        raise ValueError(f"quantization must be one of {QUANT_METHODS} or None, got "
                         f"{quantization!r}")
    block = None
    if method == "fp8":
        block = checkpoint_quant.weight_block_size if checkpoint_quant else DEFAULT_FP8_BLOCK
    scheme = checkpoint_quant.activation_scheme if checkpoint_quant else "dynamic"
    return cfg.replace(quantization=QuantConfig(method, block, config_paths(cfg, method), scheme))


__all__ = ["quantized_paths", "default_paths", "config_from_params", "quantize_params",
           "with_quantization", "abstract_quantized", "param_bytes", "config_paths",
           "config_quantization"]
