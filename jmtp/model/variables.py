"""The variables of jmtp's NNX modules: ``nnx.Param`` s and :class:`Buffer` s created with their
logical axis names (:mod:`jmtp.model.axes`) as ``out_sharding`` metadata, and the random normal
initialiser the fresh modules use. Shared by :mod:`jmtp.model.modules` and :mod:`jmtp.model.moe`.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jmtp.model import axes as ax


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
