"""Row layout of the merged paged KV cache ``f[..., block_size, W]`` (:class:`jmtp.model.llama.KVCache`).

A cache row holds one token's kv heads, head-major: head ``h`` at lanes ``[h·D, (h+1)·D)``. On TPU
each tensor-parallel shard's part of the row is padded to whole 128-lane tiles, so that XLA keeps
the pool in its natural tiled layout (a row of, say, 3·64 = 192 lanes made XLA lay the pool out
transposed at entry and copy it whole around every step: :mod:`jmtp.aot`). With ``G`` shards of
``Nkv/G`` heads, ``W = G · round_up(Nkv/G · D, lanes)``: shard ``g`` owns lanes
``[g·W/G, (g+1)·W/G)``, its heads first, then padding nobody reads. Elsewhere ``W = Nkv · D``.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jmtp.core.mesh import model_axis_size

#: TPU vector lanes: the tile width of the minor axis.
TPU_LANES = 128


def row_width(num_kv_heads: int, head_dim: int, groups: int = 1, lanes: int = 1) -> int:
    """``W`` for ``num_kv_heads`` heads of ``head_dim`` split into ``groups`` tensor-parallel
    shards, each shard's part rounded up to a multiple of ``lanes`` (1: no padding).

    Raises:
      ValueError: ``groups`` does not divide ``num_kv_heads``, or a size below 1."""
    if min(num_kv_heads, head_dim, groups, lanes) < 1 or num_kv_heads % groups:
        raise ValueError(f"row_width: groups={groups} must divide num_kv_heads={num_kv_heads} "
                         f"(all sizes >= 1, head_dim={head_dim}, lanes={lanes})")
    per = num_kv_heads // groups * head_dim
    return groups * (-(-per // lanes) * lanes)


def pack_rows(x: jax.Array, width: int, groups: int = 1) -> jax.Array:
    """``x f[T, Nkv, D]`` (or ``f[T, Nkv·D]``) as cache rows ``f[T, width]``: each of the
    ``groups`` shards' heads followed by its padding."""
    t = x.shape[0]
    flat = x.reshape(t, -1)
    if flat.shape[1] == width:
        return flat
    per = flat.reshape(t, groups, flat.shape[1] // groups)
    pad = width // groups - per.shape[2]
    return jnp.pad(per, ((0, 0), (0, 0), (0, pad))).reshape(t, width)


def cache_rows(x: jax.Array, rows: tuple[int, ...]) -> jax.Array:
    """``x f[T, Nkv, D]`` shaped as rows ``rows`` of a cache: split ``(Nkv, D)``, or merged
    ``(W,)`` with each tensor-parallel shard's padding lanes (:func:`pack_rows`; the shards are
    the ``model`` axis of the mesh being traced, :func:`jmtp.core.mesh.model_axis_size`)."""
    t = x.shape[0]
    if len(rows) == 2:
        return x.reshape((t,) + rows)
    return pack_rows(x, rows[0], model_axis_size() if x[0].size != rows[0] else 1)


def unpack_rows(cache: jax.Array, num_kv_heads: int, head_dim: int) -> jax.Array:
    """The split ``f[..., Nkv, D]`` view of one shard's (or an unsharded) merged cache
    ``f[..., W]``: the padding lanes dropped."""
    used = num_kv_heads * head_dim
    if cache.shape[-1] != used:
        cache = cache[..., :used]
    return cache.reshape(cache.shape[:-1] + (num_kv_heads, head_dim))


__all__ = ["TPU_LANES", "row_width", "pack_rows", "cache_rows", "unpack_rows"]
