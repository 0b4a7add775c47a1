"""Multi-head latent attention (MLA) of DeepSeek-V2/V3 over jmtp's paged cache.

Source of the algorithm: DeepSeek-V2 technical report (arXiv 2405.04434, section "Multi-Head Latent
Attention", and its appendix on absorbing the up-projections), DeepSeek-V3 (arXiv 2412.19437,
section "Multi-Head Latent Attention"); the reference the tests compare against is transformers'
``models/deepseek_v3/modeling_deepseek_v3.py`` (``DeepseekV3Attention``).

Per token (``x f[H]`` after the input RMSNorm), with C = ``kv_lora_rank``, dn / dr / dv =
``qk_nope_head_dim`` / ``qk_rope_head_dim`` / ``v_head_dim`` and Nq heads::

  q         = q_b(rms(q_a(x)))  or  q_proj(x)         f[Nq, dn + dr]  -> q_nope f[Nq, dn], q_pe
  c, k_pe   = kv_a(x)                                  f[C], f[dr]
  c         = rms(c)                                   (kv_a_layernorm, eps 1e-6 as in HF)
  q_pe,k_pe = RoPE(q_pe), RoPE(k_pe)                   (k_pe shared by every head)
  k_h       = [c @ W_UK_h ; k_pe],  v_h = c @ W_UV_h   (kv_b_proj = [W_UK_h | W_UV_h] per head)
  o         = wo(concat_h softmax(q_h . k_h * scale) v_h)

The paged cache holds one "head" per token: the latent ``[c ; k_pe] f[C + dr]`` (layer stack:
``KVCache.k f[L, num_blocks, block_size, C + dr]``; ``KVCache.v`` is a zero-width
``f[L, num_blocks, block_size, 0]`` placeholder so the cache pytree keeps its shape).

Two attention paths compute the same function (``ModelConfig.mla_path``):

* ``"absorbed"`` (decode path): ``q_lat_h = q_nope_h @ W_UK_h^T`` (f[C]) so that
  ``q_h . k_h = [q_lat_h ; q_pe_h] . [c ; k_pe]``: attention is MQA with one KV head of width
  C + dr over the latent cache itself (:func:`jmtp.pallas.ragged_paged_attention.ragged_paged_attention`
  with the latent as both keys and values; the value is its first C columns), then
  ``o_h = o_lat_h @ W_UV_h``. Any ``attention_impl`` works; no MLA-specific kernel exists yet
  (the Pallas kernels run it as plain MQA with head_dim C + dr, computing the dr rope columns of
  the value product needlessly).
* ``"expanded"`` (prefill path): the latents of the pages a batch addresses are up-projected to
  per-head keys ``f[Nq, dn + dr]`` and values ``f[Nq, dv]`` and ordinary multi-head attention runs
  on them (values zero-padded to the key width, the padding sliced off after).

The softmax scale is ``(dn + dr)^-0.5``, times ``mscale^2`` when a YaRN rope scaling with
``mscale_all_dim`` is configured (HF ``yarn_apply_mscale``).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jmtp.model.config import ModelConfig
from jmtp.model.metadata import AttentionMetadata
from jmtp.model.quant import dequantize, is_quantized, matmul
from jmtp.pallas.kv_layout import cache_rows
from jmtp.pallas.ragged_paged_attention import ragged_paged_attention

LATENT_NORM_EPS = 1e-6  # HF DeepseekV3RMSNorm default, used by q_a_layernorm / kv_a_layernorm


def softmax_scale(cfg: ModelConfig) -> float:
    """``(dn + dr)^-0.5``, times ``mscale^2`` for a YaRN scaling with ``mscale_all_dim`` (HF
    ``yarn_get_mscale``: ``0.1 * mscale_all_dim * ln(factor) + 1`` when factor > 1)."""
    scale = 1.0 / math.sqrt(cfg.qk_head_dim)
    rs = cfg.rope_scaling
    if rs is not None and getattr(rs, "rope_type", "llama3") == "yarn" and rs.mscale_all_dim:
        if rs.factor > 1:
            m = 0.1 * rs.mscale_all_dim * math.log(rs.factor) + 1.0
            scale *= m * m
    return scale


def _rms(x, w, eps):
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (y * w.astype(jnp.float32)).astype(x.dtype)


def project(cfg: ModelConfig, p: dict, h: jax.Array, positions: jax.Array, rope):
    """Queries and the cache entry of normed hidden rows ``h f[T, H]`` at ``positions i32[T]``.

    Args:
      rope: ``rope(x f[T, heads, dr], positions) -> f[T, heads, dr]`` (jmtp.model.llama's RoPE).

    Returns:
      ``(q_nope f[T, Nq, dn], q_pe f[T, Nq, dr], latent f[T, 1, C + dr])`` with RoPE applied to
      ``q_pe`` and the latent's ``k_pe`` part.
    """
    t, nq, dn, dr = h.shape[0], cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
    if "wq" in p:
        q = matmul(h, p["wq"])
    else:
        q = matmul(_rms(matmul(h, p["wq_a"]), p["q_a_norm"], LATENT_NORM_EPS), p["wq_b"])
    q = q.reshape(t, nq, dn + dr)
    q_nope, q_pe = q[..., :dn], rope(q[..., dn:], positions)
    ckv = matmul(h, p["wkv_a"])
    c = _rms(ckv[:, :cfg.kv_lora_rank], p["kv_a_norm"], LATENT_NORM_EPS)
    k_pe = rope(ckv[:, None, cfg.kv_lora_rank:], positions)[:, 0]
    return q_nope, q_pe, jnp.concatenate([c, k_pe], axis=-1)[:, None, :]


def split_kv_b(cfg: ModelConfig, wkv_b, dtype=None) -> tuple[jax.Array, jax.Array]:
    """``wkv_b f[C, Nq*(dn+dv)]`` -> ``(W_UK f[C, Nq, dn], W_UV f[C, Nq, dv])``. An 8-bit
    ``wkv_b`` is dequantised to ``dtype`` here, inside the step: its halves are contracted on
    different axes (the absorbed query contracts ``W_UK``'s head axis), and it is small
    (``C·Nq·(dn+dv)``: 16.8 M weights per DeepSeek-V3 layer, one layer at a time)."""
    if is_quantized(wkv_b):
        wkv_b = dequantize(wkv_b, dtype or jnp.float32)
    w = wkv_b.reshape(cfg.kv_lora_rank, cfg.num_heads, cfg.qk_nope_head_dim + cfg.v_head_dim)
    return w[..., :cfg.qk_nope_head_dim], w[..., cfg.qk_nope_head_dim:]


def write_latent(cache: jax.Array, latent: jax.Array, slot_mapping: jax.Array) -> jax.Array:
    """Scatter ``latent f[T, 1, C+dr]`` into ``cache f[num_blocks, block_size, C+dr]`` at
    ``slot_mapping i32[T]`` (``block * block_size + offset``; -1 rows write nothing)."""
    nb, bs = cache.shape[:2]
    slots = jnp.where(slot_mapping < 0, nb * bs, slot_mapping)
    flat = cache.reshape((nb * bs,) + cache.shape[2:])
    rows = cache_rows(latent, cache.shape[2:]).astype(cache.dtype)   # (+ padding lanes on TPU)
    return flat.at[slots].set(rows, mode="drop").reshape(cache.shape)


def attention_absorbed(cfg: ModelConfig, p: dict, q_nope, q_pe, cache: jax.Array,
                       meta: AttentionMetadata, attention_impl: str | None = None) -> jax.Array:
    """MLA with W_UK absorbed into the query and W_UV applied after attention (decode path).

    Args:
      q_nope: f[T, Nq, dn]; q_pe: f[T, Nq, dr] (roped).
      cache: f[num_blocks, block_size, C + dr] latent pool (one merged head), this step's rows already written.

    Returns:
      f[T, Nq, dv] per-head attention outputs (padding rows zero).
    """
    w_uk, w_uv = split_kv_b(cfg, p["wkv_b"], q_nope.dtype)
    q_lat = jnp.einsum("thd,chd->thc", q_nope, w_uk)
    q = jnp.concatenate([q_lat, q_pe.astype(q_lat.dtype)], axis=-1)     # f[T, Nq, C + dr]
    o = ragged_paged_attention(q, cache, cache, meta.kv_lens, meta.block_tables, meta.cu_q_lens,
                               sm_scale=softmax_scale(cfg), implementation=attention_impl,
                               num_kv_heads=1)
    return jnp.einsum("thc,chd->thd", o[..., :cfg.kv_lora_rank], w_uv)


def attention_expanded(cfg: ModelConfig, p: dict, q_nope, q_pe, cache: jax.Array,
                       meta: AttentionMetadata, attention_impl: str | None = None) -> jax.Array:
    """MLA with the cached latents up-projected to per-head keys and values (prefill path).

    Gathers the pages ``meta.block_tables i32[S, P]`` address (S·P pages), expands them to
    ``k f[S·P, block_size, Nq, dn+dr]`` and ``v f[.., dv]`` and runs ragged paged attention over
    that temporary per-sequence cache. Cost O(S·P·block_size·C·Nq·(dn+dv)) for the expansion.

    Returns:
      f[T, Nq, dv], as :func:`attention_absorbed`.
    """
    nb, bs = cache.shape[:2]
    s, pages = meta.block_tables.shape
    dn, dv, c = cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    nq = cfg.num_heads
    tables = jnp.clip(meta.block_tables, 0, nb - 1)
    lat = cache[tables][..., :c + cfg.qk_rope_head_dim].reshape(
        s * pages, bs, c + cfg.qk_rope_head_dim)
    w_uk, w_uv = split_kv_b(cfg, p["wkv_b"], cache.dtype)
    k_nope = jnp.einsum("nbc,chd->nbhd", lat[..., :c], w_uk)
    k_pe = jnp.broadcast_to(lat[:, :, None, c:], (s * pages, bs, nq, cfg.qk_rope_head_dim))
    k = jnp.concatenate([k_nope, k_pe.astype(k_nope.dtype)], axis=-1)
    v = jnp.einsum("nbc,chd->nbhd", lat[..., :c], w_uv)
    width = max(cfg.qk_head_dim, dv)
    pad = lambda a: jnp.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, width - a.shape[-1])])
    q = pad(jnp.concatenate([q_nope, q_pe.astype(q_nope.dtype)], axis=-1))
    new_tables = jnp.arange(s * pages, dtype=jnp.int32).reshape(s, pages)
    o = ragged_paged_attention(q, pad(k), pad(v), meta.kv_lens, new_tables, meta.cu_q_lens,
                               sm_scale=softmax_scale(cfg), implementation=attention_impl)
    return o[..., :dv]


def mla_attention(cfg: ModelConfig, p: dict, h: jax.Array, positions: jax.Array,
                  meta: AttentionMetadata, cache: jax.Array, rope,
                  attention_impl: str | None = None) -> tuple[jax.Array, jax.Array]:
    """One MLA sublayer on normed rows ``h f[T, H]``: writes this step's latents into ``cache``
    (``f[num_blocks, block_size, C+dr]``, addressed by ``meta``) and attends over it by
    ``cfg.mla_path``. Returns ``(out f[T, H] (after wo), cache)``."""
    t = h.shape[0]
    q_nope, q_pe, latent = project(cfg, p, h, positions, rope)
    slots = meta.slot_mapping
    if t == 1:  # keep the write a scatter (see jmtp.model.llama.decoder_layer)
        latent = jnp.concatenate([latent, jnp.zeros_like(latent)], 0)
        slots = jnp.concatenate([slots, jnp.full((1,), -1, slots.dtype)])
    cache = write_latent(cache, latent, slots)
    attend = attention_absorbed if cfg.mla_path == "absorbed" else attention_expanded
    o = attend(cfg, p, q_nope, q_pe, cache, meta, attention_impl)
    return matmul(o.reshape(t, cfg.num_heads * cfg.v_head_dim), p["wo"]), cache
