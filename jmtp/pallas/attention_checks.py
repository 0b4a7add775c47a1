"""Argument checks and the compute dtype shared by every ragged paged attention implementation
(the jnp reference and XLA path in :mod:`jmtp.pallas.ragged_paged_attention`, the TPU and GPU
kernels): one contract, validated the same way before any of them traces."""
from __future__ import annotations

import jax.numpy as jnp

from jmtp.pallas.kv_layout import unpack_rows
from jmtp.pallas.kv_quant import is_quantized_dtype


def cache_dims(q, k_cache, num_kv_heads: int | None = None) -> tuple[int, int, int, int]:
    """``(num_blocks, block_size, Nkv, D)`` of a paged cache given split
    ``[num_blocks, block_size, Nkv, D]`` or merged ``[num_blocks, block_size, W]`` (the engine's
    layout, :mod:`jmtp.pallas.kv_layout`: kv heads major, ``D = q``'s head dim, ``W >= Nkv·D``
    with padding lanes after the heads). ``num_kv_heads``: Nkv of a merged cache (default
    ``W / D``, a cache without padding).

    Raises:
      ValueError: another rank, or a merged width that cannot hold the heads."""
    d = q.shape[-1]
    if k_cache.ndim == 4:
        return tuple(k_cache.shape)
    if k_cache.ndim == 3 and d:
        nb, bs, w = k_cache.shape
        nkv = w // d if num_kv_heads is None else num_kv_heads
        if nkv >= 1 and (nkv * d == w if num_kv_heads is None else nkv * d <= w):
            return nb, bs, nkv, d
    raise ValueError(
        "k_cache/v_cache must be [num_blocks, block_size, num_kv_heads, head_dim] or merged "
        f"[num_blocks, block_size, W >= num_kv_heads * head_dim] (head_dim {d} from q, "
        f"num_kv_heads {num_kv_heads}), got {k_cache.shape}")


def split_heads(cache, q, num_kv_heads: int | None = None):
    """The split ``[num_blocks, block_size, Nkv, D]`` view of a merged or split cache (padding
    lanes dropped; a free reshape in XLA:CPU and on GPU, a relayout on TPU, whose kernel reads
    the merged form)."""
    if cache.ndim == 4:
        return cache
    _, _, nkv, d = cache_dims(q, cache, num_kv_heads)
    return unpack_rows(cache, nkv, d)


def merge_heads(cache):
    """The merged ``[num_blocks, block_size, Nkv·D]`` form of a split or merged cache."""
    return cache.reshape(cache.shape[:2] + (-1,)) if cache.ndim == 4 else cache


def check_shapes(q, k_cache, v_cache, kv_lens, block_tables, cu_q_lens, k_scale=None,
                 v_scale=None, num_kv_heads: int | None = None) -> None:
    """Raise ValueError naming the argument whose shape or dtype breaks the ragged paged
    attention contract (see :func:`jmtp.pallas.ragged_paged_attention.ragged_paged_attention`):
    caches split ``[num_blocks, block_size, Nkv, D]`` or merged ``[num_blocks, block_size,
    Nkv·D]`` (:func:`cache_dims`)."""
    if q.ndim != 3:
        raise ValueError(f"q must be [T, num_q_heads, head_dim], got shape {q.shape}")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache shapes differ: {k_cache.shape} and {v_cache.shape}")
    _, _, nkv, d = cache_dims(q, k_cache, num_kv_heads)
    if d != q.shape[2]:
        raise ValueError(f"head_dim mismatch: q has {q.shape[2]}, cache has {d}")
    if q.shape[1] % nkv:
        raise ValueError(
            f"num_q_heads ({q.shape[1]}) must be a multiple of num_kv_heads ({nkv})")
    s = kv_lens.shape[0]
    if kv_lens.ndim != 1 or block_tables.ndim != 2 or block_tables.shape[0] != s:
        raise ValueError(
            f"kv_lens must be i32[S] and block_tables i32[S, pages], got {kv_lens.shape} and "
            f"{block_tables.shape}")
    if cu_q_lens.shape != (s + 1,):
        raise ValueError(f"cu_q_lens must be i32[S+1] = i32[{s + 1}], got {cu_q_lens.shape}")
    check_scales(k_cache, v_cache, k_scale, v_scale, nkv)


def check_scales(k_cache, v_cache, k_scale, v_scale, num_kv_heads: int | None = None) -> bool:
    """Whether the cache is quantised; raises ValueError on inconsistent scales."""
    if (k_scale is None) != (v_scale is None):
        raise ValueError("k_scale and v_scale must be given together")
    quantized = is_quantized_dtype(k_cache.dtype)
    if k_scale is None:
        if quantized:
            raise ValueError(f"a {k_cache.dtype} cache needs k_scale/v_scale (f32[num_blocks, Nkv, "
                             "block_size])")
        return False
    if not quantized or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"k_scale/v_scale need an int8 or float8_e4m3fn cache, got "
                         f"{k_cache.dtype} / {v_cache.dtype}")
    nb, bs = k_cache.shape[:2]
    nkv = k_cache.shape[2] if num_kv_heads is None else num_kv_heads
    for name, sc in (("k_scale", k_scale), ("v_scale", v_scale)):
        if sc.shape != (nb, nkv, bs) or sc.dtype != jnp.float32:
            raise ValueError(f"{name} must be f32[num_blocks, Nkv, block_size] = f32{[nb, nkv, bs]}"
                             f", got {sc.dtype}{list(sc.shape)}")
    return True


def compute_dtype(q_dtype, cache_dtype):
    """Dtype the kernels multiply in: the wider of q and cache; q's own for 8-bit caches."""
    if is_quantized_dtype(cache_dtype):
        return jnp.dtype(q_dtype)
    return jnp.promote_types(q_dtype, cache_dtype)
