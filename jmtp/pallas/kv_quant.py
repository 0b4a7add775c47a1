"""KV-cache quantisation: 8-bit values with one f32 scale per token per KV head.

``kv_cache_dtype`` (vLLM's name for the option) selects how the paged KV cache stores keys and
values:

* ``None``: the model dtype (no quantisation, no scales);
* ``"int8"``: symmetric int8, ``x ≈ q · scale`` with ``q = round(x / scale)`` in ``[-127, 127]``;
* ``"fp8_e4m3"``: OCP FP8 E4M3 (``jnp.float8_e4m3fn``, largest finite value 448),
  ``x ≈ fp8(x / scale) · scale``.

**Scale granularity.** One f32 scale per (token, KV head): ``scale = max_d |x[d]| / qmax`` over the
head's ``D`` values (qmax 127 for int8, 448 for fp8). The scales live beside the values in the
paged cache, block-wise, in FastDeploy's ``block_wise_fp8`` layout: a layer's scale pool is
``f32[num_blocks, num_kv_heads, block_size]`` (FastDeploy's ``cache_k_scale`` /
``cache_v_scale``, shape ``[max_num_blocks, kv_num_heads, block_size]``), i.e. one scale per slot
and head. We chose this over one scale per block per head because:

1. a token's stored values depend on its own K/V only. Blocks are filled incrementally (a
   prefill chunk, then decode windows of 1..K+1 tokens whose rejected drafts are overwritten
   later); with a per-block scale, a larger token (or a rejected draft) would force the block's
   earlier tokens to be requantised with the larger scale, so the cache contents, and the tokens
   generated from them, would depend on how the block happened to be written (chunk sizes,
   speculation, preemption). With per-token scales the stored value of a token does not depend
   on the write pattern. (Speculative and plain decoding can still differ: XLA:CPU's f32 K/V
   of a token computed in a multi-row verify window and in a one-row decode step differ in
   their last bits (measured on SmolLM2: up to 1.8e-5 absolute after a 4-row window vs four
   1-row steps; ``scripts/bench_kvquant.py`` prints the figure), and where such a value sits on a rounding boundary the 8-bit code differs by
   one step, which can flip a later near-tie argmax; ``scripts/bench_kvquant.py`` counts it);
2. per-token scales lose less: ``scripts/bench_kvquant.py`` measures the reconstruction error of
   SmolLM2's real K/V under both granularities (``docs/kvquant.md``);
3. the cost is 4 bytes per token per head per K/V, ``4 / D`` of the int8 values (6.25 % for
   ``D = 64``), reported separately by :meth:`jmtp.runtime.host.llm_engine.LLMEngine.kv_cache_bytes`.

Quantisation happens in the KV write (:func:`write_kv_quantized`, called where the step writes
this step's K/V into the paged cache); every attention implementation dequantises on read
(:mod:`jmtp.pallas.ragged_paged_attention` and its kernels). Before the write, an int8 cache's
K/V are Hadamard-rotated (:func:`hadamard_rotation`) and its keys shifted by a calibrated mean key
(:mod:`jmtp.model.kv_shift`), both in :func:`jmtp.model.llama.decoder_layer`.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

#: Allowed values of ``kv_cache_dtype`` (vLLM's names).
KV_CACHE_DTYPES = (None, "int8", "fp8_e4m3")

_STORAGE = {"int8": jnp.dtype(jnp.int8), "fp8_e4m3": jnp.dtype(jnp.float8_e4m3fn)}
_QMAX = {jnp.dtype(jnp.int8): 127.0, jnp.dtype(jnp.float8_e4m3fn): 448.0}

#: Dtype of the scales.
SCALE_DTYPE = jnp.dtype(jnp.float32)


def check_kv_cache_dtype(kv_cache_dtype, field: str = "kv_cache_dtype") -> str | None:
    """Return ``kv_cache_dtype`` if it is one of :data:`KV_CACHE_DTYPES`.

    Raises:
      ValueError: naming ``field`` and the allowed values.
    """
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"{field} must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
    return kv_cache_dtype


def storage_dtype(kv_cache_dtype: str) -> jnp.dtype:
    """The array dtype of a quantised cache: int8 or float8_e4m3fn."""
    return _STORAGE[check_kv_cache_dtype(kv_cache_dtype)]


def is_quantized_dtype(dtype) -> bool:
    """Whether ``dtype`` is one of the 8-bit storage dtypes (values that need scales)."""
    return jnp.dtype(dtype) in _QMAX


def quantize(x: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """Quantise each ``D``-vector of ``x`` with its own scale.

    Args:
      x: ``f[..., D]`` (keys or values, e.g. ``f[T, Nkv, D]``).
      dtype: storage dtype, ``int8`` or ``float8_e4m3fn``.

    Returns:
      ``(q, scale)``: ``q`` of ``dtype`` and shape ``x.shape``; ``scale f32[...]`` (``x.shape[:-1]``)
      with ``x ≈ q * scale[..., None]``. An all-zero vector gets scale 0 and ``q = 0``.
    """
    dtype = jnp.dtype(dtype)
    qmax = _QMAX[dtype]
    xf = x.astype(jnp.float32)
    scale = jnp.max(jnp.abs(xf), axis=-1) / qmax
    y = xf / jnp.where(scale > 0, scale, 1.0)[..., None]
    # |y| <= qmax up to one rounding of the division; clip so fp8 cannot overflow to NaN.
    y = jnp.clip(y, -qmax, qmax)
    if dtype == jnp.int8:
        y = jnp.round(y)
    return y.astype(dtype), scale.astype(SCALE_DTYPE)


def hadamard_rotation(d: int, dtype=jnp.float32) -> jax.Array:
    """Orthonormal ``f[d, d]`` rotation applied to keys, values and queries before an int8 cache.

    A Sylvester Hadamard matrix ``H_n / sqrt(n)`` for the largest power of two ``n`` dividing
    ``d``, repeated ``d / n`` times on the diagonal (block-diagonal when ``d`` is not a power of
    two). Because ``R`` is orthonormal, ``(q R)·(k R) = q·k`` and ``attn(V R) Rᵀ = attn(V)``, so
    the attention result is unchanged in exact arithmetic; but the rotated vectors have their
    energy spread over all ``n`` coordinates, so a per-token absmax scale is no longer set by a
    few outlier channels. SmolLM2's keys have a median absmax/RMS of ~5 per (token, head); the
    rotation halves int8's relative RMS error on its K (0.0113 -> 0.0055, ``scripts/
    bench_kvquant.py``). Source: the incoherence processing of QuaRot (Ashkboos et al. 2024,
    arXiv:2404.00456) applied to the KV cache. FP8 keeps per-coordinate exponents, so rotating
    does not help it (measured slightly worse) and :func:`rotation_for` returns ``None`` for it.
    """
    n = d & -d                                     # largest power of two dividing d
    h = np.ones((1, 1), np.float32)
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    r = np.kron(np.eye(d // n, dtype=np.float32), h / np.sqrt(n, dtype=np.float32))
    return jnp.asarray(r, dtype)


def rotation_for(cache_dtype, d: int, dtype) -> jax.Array | None:
    """The rotation :func:`hadamard_rotation` (in ``dtype``) when the cache is int8, else
    ``None`` (f32/bf16 caches and fp8 are stored unrotated)."""
    if jnp.dtype(cache_dtype) != jnp.dtype(jnp.int8):
        return None
    return hadamard_rotation(d, dtype)


def dequantize(q: jax.Array, scale: jax.Array, dtype=jnp.float32) -> jax.Array:
    """``q * scale[..., None]`` in ``dtype``: ``q [..., D]`` (8-bit), ``scale f32[...]``."""
    return (q.astype(jnp.float32) * scale.astype(jnp.float32)[..., None]).astype(dtype)


def write_kv_quantized(
    k_cache: jax.Array,       # q8[num_blocks, block_size, Nkv*D] merged (or split [.., Nkv, D])
    v_cache: jax.Array,       # same shape as k_cache
    k_scale: jax.Array,       # f32[num_blocks, Nkv, block_size]
    v_scale: jax.Array,       # f32[num_blocks, Nkv, block_size]
    k_new: jax.Array,         # f[T, Nkv, D]
    v_new: jax.Array,         # f[T, Nkv, D]
    slot_mapping: jax.Array,  # i32[T]  block_id * block_size + offset; -1 = padding row (dropped)
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Quantise this step's keys/values per token and head and scatter values and scales into the
    paged cache (the quantised counterpart of
    :func:`jmtp.pallas.ragged_paged_attention.write_kv`). Rows with slot -1 write nothing.

    Returns ``(k_cache, v_cache, k_scale, v_scale)`` updated.

    Raises:
      ValueError: the cache is not int8/float8_e4m3fn or the scale shapes do not match it.
    """
    nb, bs = k_cache.shape[:2]
    rows = k_cache.shape[2:]        # (Nkv*D,) merged or (Nkv, D) split
    nkv = k_new.shape[1]
    if not is_quantized_dtype(k_cache.dtype) or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"write_kv_quantized needs int8 or float8_e4m3fn caches, got "
                         f"{k_cache.dtype} / {v_cache.dtype}")
    if k_scale.shape != (nb, nkv, bs) or v_scale.shape != (nb, nkv, bs):
        raise ValueError(f"k_scale/v_scale must be f32[num_blocks, Nkv, block_size] = "
                         f"{(nb, nkv, bs)}, got {k_scale.shape} and {v_scale.shape}")
    kq, ks = quantize(k_new, k_cache.dtype)
    vq, vs = quantize(v_new, v_cache.dtype)
    slots = jnp.where(slot_mapping < 0, nb * bs, slot_mapping)   # out of range -> dropped
    blk, off = slots // bs, slots % bs
    from jmtp.pallas.kv_layout import cache_rows
    kf = k_cache.reshape((nb * bs,) + rows).at[slots].set(cache_rows(kq, rows), mode="drop")
    vf = v_cache.reshape((nb * bs,) + rows).at[slots].set(cache_rows(vq, rows), mode="drop")
    k_scale = k_scale.at[blk, :, off].set(ks, mode="drop")
    v_scale = v_scale.at[blk, :, off].set(vs, mode="drop")
    return kf.reshape(k_cache.shape), vf.reshape(v_cache.shape), k_scale, v_scale


def gather_scales(scale: jax.Array, blocks: jax.Array) -> jax.Array:
    """Scales of the pages ``blocks i32[...]`` as one per key position:
    ``scale f32[num_blocks, Nkv, bs]`` -> ``f32[..., bs, Nkv]``."""
    return jnp.swapaxes(scale[blocks], -1, -2)
