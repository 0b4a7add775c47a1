"""The variables of jmtp's NNX modules: ``nnx.Param`` s and :class:`Buffer` s created with their
logical axis names (:mod:`jmtp.model.axes`) as ``out_sharding`` metadata, 8-bit weights
(:func:`weight`: a :class:`~jmtp.model.quant.QuantizedWeight` of two Params) and the random
normal initialiser the fresh modules use. Shared by :mod:`jmtp.model.modules` and
:mod:`jmtp.model.moe`.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jmtp.model import axes as ax
from jmtp.model import schema
from jmtp.model.quant import QuantConfig, QuantizedWeight, quantize


class Buffer(nnx.Variable):
    """A non-trainable array of a module (the FR-Spec draft ids, draft LM head and token ranking).

    Not an ``nnx.Param``: optimizers built with ``wrt=nnx.Param`` leave it alone."""


def axis_names(names, stacked: bool) -> tuple[str, ...]:
    """``names`` with ``layers`` in front when ``stacked``."""
    return ((ax.LAYERS,) if stacked else ()) + tuple(names)


def param(value: jax.Array, names, stacked: bool = False) -> nnx.Param:
    """``nnx.Param(value)`` with logical axis names (``layers`` first when ``stacked``).

    Raises:
      ValueError: the number of names differs from ``value.ndim``."""
    names = axis_names(names, stacked)
    if len(names) != len(value.shape):
        raise ValueError(f"{len(names)} axis names {names} for an array of shape {value.shape}")
    return nnx.Param(value, out_sharding=names, eager_sharding=False)


def buffer(value: jax.Array, names) -> Buffer:
    """A :class:`Buffer` with logical axis names."""
    return Buffer(value, out_sharding=tuple(names), eager_sharding=False)


def normal(rngs: nnx.Rngs, shape, dtype, std: float) -> jax.Array:
    """``std``-scaled standard normal values of ``shape`` (drawn in f32, then cast to ``dtype``)."""
    return (std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)


def weight(quantization: QuantConfig | None, path: str, value: jax.Array, names,
           stacked: bool = False):
    """A linear weight of a module: ``param(value, names, stacked)``, or, when ``quantization``
    covers ``path`` (``"layers.wq"``, ``"mtp.layer.w_up"``, ``"embed"``, ...), ``value`` quantised to a
    :class:`~jmtp.model.quant.QuantizedWeight` whose ``value`` Param has the weight's logical
    axes and whose ``scale`` Param has them too, except an axis of one scale (per-channel
    scales' input axis), which is unnamed (replicated). Assign the result with ``nnx.data``."""
    if quantization is None or not quantization.covers(path):
        return param(value, names, stacked)
    q = quantize(value, quantization.method, quantization.block_for(path, value.shape))
    names = tuple(names)
    scale_names = names[:-2] + tuple(n if size > 1 else None
                                     for n, size in zip(names[-2:], q.scale.shape[-2:]))
    return nnx.data(QuantizedWeight(param(q.value, names, stacked),
                                    param(q.scale, scale_names, stacked), q.block))


def new_weight(cfg, name: str, shape: tuple[int, ...], *, rngs: nnx.Rngs, dtype, std: float,
               num_stacked: int | None = None, prefix: str = "layers"):
    """A fresh parameter ``name`` of ``shape`` (without the stack axis) as the schema
    (:mod:`jmtp.model.schema`) says: its initial value (``rngs.params()`` drawn only for random
    ones), its logical axes, ``layers`` first with ``num_stacked`` (the leading axis's size),
    8-bit where ``cfg.quantization`` covers ``prefix.name`` (:func:`weight`). Assign the result
    to the module's attribute ``name``."""
    lead = (num_stacked,) if num_stacked else ()
    key = rngs.params() if schema.needs_key(name) else None
    value = schema.initial_value(name, lead + tuple(shape), dtype, std, key)
    path = f"{prefix}.{name}" if prefix else name
    return weight(cfg.quantization, path, value, schema.LEAVES[name].axes, bool(num_stacked))


def own_variables(module) -> dict:
    """``{attribute: nnx.Param or QuantizedWeight}`` of a module's own weights (the layer dict
    entries it contributes)."""
    return {k: v for k, v in vars(module).items()
            if isinstance(v, (nnx.Param, QuantizedWeight))}
