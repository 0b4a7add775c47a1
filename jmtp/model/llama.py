"""Llama-family decoder and MTP head as pure functions over a parameter pytree.

These functions are the math of the Flax NNX modules of :mod:`jmtp.model.modules`
(``LlamaForCausalLM.to_params()`` is this pytree; the logical axis names of every entry are in
:mod:`jmtp.model.axes`).

Parameter pytree (weights stored ``[in, out]`` so that ``y = x @ W``; per-layer tensors stacked on a
leading layer axis L so that the layers run under one ``lax.scan``)::

  embed        f[V, H]
  lm_head      f[H, V]              (absent when tie_word_embeddings: embed.T is used)
  final_norm   f[H]
  layers:      attn_norm f[L,H]  wq f[L,H,Nq*D]  wk,wv f[L,H,Nkv*D]  wo f[L,Nq*D,H]
               [bq f[L,Nq*D] bk,bv f[L,Nkv*D]]   (attention_bias, Qwen2)
               [q_norm,k_norm f[L,D]]            (qk_norm, Qwen3)
               mlp_norm f[L,H]  w_gate,w_up f[L,H,I]  w_down f[L,I,H]
               (MoE layers instead: router, [router_bias], experts_*, [shared_*],
               see jmtp.model.moe; a model mixing dense and MoE layers holds ``layers`` as a
               tuple of L per-layer dicts, jmtp.model.schema.layers_stacked)
  mtp:         enorm,hnorm f[N,H]  eh_proj f[N,2H,H]  final_norm f[N,H]  layer: {as `layers`, N stacked}
  [k_shift     f32[L,Nkv,D]]        (int8 KV caches only: key shift, jmtp.model.kv_shift)

Any linear weight above may be an 8-bit :class:`jmtp.model.quant.QuantizedWeight` (values and
scales, same ``[in, out]`` layout; ``ModelConfig.quantization`` says which): every matmul with a
weight goes through :func:`jmtp.model.quant.matmul` (via :func:`jmtp.model.invariant.matmul`).

The KV cache of a stack of ``L`` layers is :class:`KVCache` with ``k, v: f[L, num_blocks, block_size,
W]``, the kv heads merged head-major into ``W >= Nkv·D`` lanes (:mod:`jmtp.pallas.kv_layout`; 8-bit values plus ``k_scale, v_scale: f32[L, num_blocks, Nkv, block_size]`` when
``kv_cache_dtype`` quantises it, :mod:`jmtp.pallas.kv_quant`). The MTP head has its own
one-layer-per-MTP-module cache addressed by the same block ids.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jmtp.model import mla
from jmtp.model.config import ModelConfig
from jmtp.model import moe
from jmtp.model import gated_deltanet as gdn
from jmtp.model import invariant
from jmtp.model import quant
from jmtp.model.quant import param_dtype
from jmtp.model.gated_deltanet import LinearState
from jmtp.model.metadata import AttentionMetadata
from jmtp.pallas import kv_quant
from jmtp.pallas.kv_layout import TPU_LANES, row_width
from jmtp.pallas.ragged_paged_attention import ragged_paged_attention, write_kv


class KVCache(NamedTuple):
    """Paged KV cache of a layer stack.

    Attributes:
      k, v: ``f[L, num_blocks, block_size, W]`` (int8 / float8_e4m3fn when quantised): the kv
        heads *merged* into one axis, head-major (head ``h`` at ``[h·D, (h+1)·D)``), ``W = Nkv·D``
        off TPU; on TPU each tensor-parallel shard's part padded to whole 128-lane tiles
        (:mod:`jmtp.pallas.kv_layout`). TPU tiled layouts cover the two minor axes: merged and
        lane-aligned, XLA keeps the pool in its natural layout and the Pallas kernel DMAs whole
        pages of it, where a split ``[.., Nkv, D]`` pool (or unpadded 192-lane rows) was laid
        out transposed and copied whole around every step (issue 35, found by compiling for TPU
        with :mod:`jmtp.aot`). Under tensor parallelism the last axis splits over ``model``: each
        device holds whole heads. MLA: the latent ``[L, num_blocks, block_size, C + dr]``.
      k_scale, v_scale: ``f32[L, num_blocks, Nkv, block_size]``, one scale per slot and KV head
        (FastDeploy's ``block_wise_fp8`` layout), or ``None`` for an unquantised cache.
      linear: a hybrid model's recurrent state pool (:class:`jmtp.model.gated_deltanet.LinearState`,
        per slot, K+1 checkpoints), or None. ``L`` above then counts the full-attention layers
        only (``ModelConfig.kv_layers``).
    """

    k: jax.Array
    v: jax.Array
    k_scale: jax.Array | None = None
    v_scale: jax.Array | None = None
    linear: "LinearState | None" = None

    @property
    def quantized(self) -> bool:
        return self.k_scale is not None

    @property
    def paged(self) -> "KVCache":
        """The paged part only (``linear`` dropped)."""
        return KVCache(self.k, self.v, self.k_scale, self.v_scale)

    def nbytes(self) -> tuple[int, int]:
        """``(value bytes, scale bytes)`` of the whole cache."""
        values = self.k.size * self.k.dtype.itemsize + self.v.size * self.v.dtype.itemsize
        if not self.quantized:
            return values, 0
        return values, (self.k_scale.size * self.k_scale.dtype.itemsize
                        + self.v_scale.size * self.v_scale.dtype.itemsize)


def cache_row_width(cfg: ModelConfig, tensor_parallel_size: int = 1,
                    platform: str = "cpu") -> int:
    """Lanes of one cache row (:mod:`jmtp.pallas.kv_layout`): ``Nkv·D`` (MLA: ``C + dr``), on TPU
    with each of the ``tensor_parallel_size`` shards' part padded to a multiple of 128."""
    lanes = TPU_LANES if platform == "tpu" else 1
    if cfg.is_mla:
        return row_width(1, cfg.kv_cache_head_dim, 1, lanes)
    return row_width(cfg.num_kv_heads, cfg.head_dim, tensor_parallel_size, lanes)


def init_kv_cache(cfg: ModelConfig, num_layers: int, num_blocks: int, block_size: int,
                  dtype=jnp.float32, kv_cache_dtype: str | None = None,
                  row_width: int | None = None) -> KVCache:
    """Zero-filled cache for ``num_layers`` layers (``cfg.num_layers`` for the target, N for MTP),
    heads merged (:class:`KVCache`); ``row_width``: lanes per row (default ``Nkv·D``, no padding;
    the engine passes :func:`cache_row_width`).

    Args:
      dtype: value dtype of an unquantised cache.
      kv_cache_dtype: ``None`` (values in ``dtype``), ``"int8"`` or ``"fp8_e4m3"`` (8-bit values
        and f32 scales, :mod:`jmtp.pallas.kv_quant`).

    Raises:
      ValueError: ``kv_cache_dtype`` not one of :data:`jmtp.pallas.kv_quant.KV_CACHE_DTYPES`.
    """
    kv_quant.check_kv_cache_dtype(kv_cache_dtype)
    if cfg.is_mla:
        # One latent "head" [c ; k_pe] per token; v is a zero-width placeholder (jmtp.model.mla).
        if kv_cache_dtype is not None:
            raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} is not supported with "
                             "attention_type='mla' (latent cache quantisation not implemented)")
        shape = (num_layers, num_blocks, block_size, row_width or cfg.kv_cache_head_dim)
        return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape[:-1] + (0,), dtype))
    shape = (num_layers, num_blocks, block_size, row_width or cfg.num_kv_heads * cfg.head_dim)
    if kv_cache_dtype is None:
        return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))
    q8 = kv_quant.storage_dtype(kv_cache_dtype)
    sshape = (num_layers, num_blocks, cfg.num_kv_heads, block_size)
    return KVCache(jnp.zeros(shape, q8), jnp.zeros(shape, q8),
                   jnp.zeros(sshape, kv_quant.SCALE_DTYPE), jnp.zeros(sshape, kv_quant.SCALE_DTYPE))


def init_model_cache(cfg: ModelConfig, num_blocks: int, block_size: int, dtype=jnp.float32,
                     num_slots: int = 1, window: int = 1, num_saved_states: int = 0,
                     **kw) -> KVCache:
    """The target's cache: :func:`init_kv_cache` over its full-attention layers
    (``cfg.num_kv_layers``) and, for a hybrid model, the recurrent state pool of ``num_slots``
    slots with ``window`` checkpoints each and ``num_saved_states`` block-boundary checkpoints
    for prefix caching (:func:`jmtp.model.gated_deltanet.init_linear_state`).
    ``kw``: :func:`init_kv_cache`'s ``kv_cache_dtype`` / ``row_width``."""
    cache = init_kv_cache(cfg, cfg.num_kv_layers, num_blocks, block_size, dtype, **kw)
    return cache._replace(linear=gdn.init_linear_state(cfg, num_slots, window, dtype,
                                                       num_saved_states))


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """RMSNorm (Zhang & Sennrich 2019) computed in fp32, returned in ``x.dtype``."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (y * w.astype(jnp.float32)).astype(x.dtype)


def rope_inv_freq(cfg: ModelConfig) -> jax.Array:
    """Inverse RoPE frequencies ``f32[R/2]`` (``R = cfg.rotary_dim``, the head dim unless
    ``partial_rotary_factor < 1``), with llama3 scaling when configured."""
    d = cfg.rotary_dim
    inv = 1.0 / (cfg.rope_theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    rs = cfg.rope_scaling
    if rs is None:
        return inv
    if rs.rope_type == "yarn":
        return _yarn_inv_freq(cfg, inv)
    low_wl = rs.original_max_position_embeddings / rs.low_freq_factor
    high_wl = rs.original_max_position_embeddings / rs.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = jnp.where(wavelen > low_wl, inv / rs.factor, inv)
    smooth = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / (
        rs.high_freq_factor - rs.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
    medium = (wavelen >= high_wl) & (wavelen <= low_wl)
    return jnp.where(medium, smoothed, scaled)


def _yarn_inv_freq(cfg: ModelConfig, inv: jax.Array) -> jax.Array:
    """YaRN inverse frequencies (Peng et al. 2023; HF ``_compute_yarn_parameters``): a linear ramp
    between extrapolated (``inv``) and interpolated (``inv / factor``) frequencies over the
    dimensions whose rotation count at the original context lies in ``[beta_slow, beta_fast]``."""
    rs, d, base = cfg.rope_scaling, cfg.rotary_dim, cfg.rope_theta

    def corr_dim(rot):
        return d * math.log(rs.original_max_position_embeddings / (rot * 2 * math.pi)) / (
            2 * math.log(base))

    low, high = corr_dim(rs.beta_fast), corr_dim(rs.beta_slow)
    if rs.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001
    ramp = jnp.clip((jnp.arange(d // 2, dtype=jnp.float32) - low) / (high - low), 0, 1)
    extrapolate = 1 - ramp
    return inv / rs.factor * (1 - extrapolate) + inv * extrapolate


def rope_attention_factor(cfg: ModelConfig) -> float:
    """Multiplier of RoPE's cos/sin: 1, or YaRN's attention factor (HF: given, else
    ``mscale(factor, mscale) / mscale(factor, mscale_all_dim)`` when both are set, else
    ``mscale(factor)`` with ``mscale(s, m) = 0.1 m ln s + 1`` for s > 1)."""
    rs = cfg.rope_scaling
    if rs is None or rs.rope_type != "yarn":
        return 1.0
    if rs.attention_factor is not None:
        return float(rs.attention_factor)
    ms = lambda s, m=1.0: 1.0 if s <= 1 else 0.1 * m * math.log(s) + 1.0
    if rs.mscale and rs.mscale_all_dim:
        return ms(rs.factor, rs.mscale) / ms(rs.factor, rs.mscale_all_dim)
    return ms(rs.factor)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """Rotary embedding (Su et al. 2021), HF "rotate_half" layout. ``x: f[T, heads, D]``."""
    ang = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]      # f[T, D/2]
    cos = jnp.cos(ang)[:, None, :]
    sin = jnp.sin(ang)[:, None, :]
    xf = x.astype(jnp.float32)
    x1, x2 = jnp.split(xf, 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def project_qkv(cfg: ModelConfig, p: dict, x: jax.Array, positions: jax.Array,
                h: jax.Array | None = None):
    """Attention inputs of a pre-norm block: ``x f[T, H]`` → ``q f[T, Nq, D]``, ``k, v f[T, Nkv, D]``
    (input RMSNorm, projections, Qwen2 biases, Qwen3 q/k-norm, RoPE at ``positions i32[T]``).
    ``h``: the normed rows when the caller has them already."""
    t = x.shape[0]
    if h is None:
        h = rms_norm(x, p["attn_norm"], cfg.rms_norm_eps)
    mm = functools.partial(invariant.matmul, cfg.batch_invariant)
    q, k, v = mm(h, p["wq"]), mm(h, p["wk"]), mm(h, p["wv"])
    if "bq" in p:
        q, k, v = q + p["bq"], k + p["bk"], v + p["bv"]
    q = q.reshape(t, cfg.num_heads, cfg.head_dim)
    k = k.reshape(t, cfg.num_kv_heads, cfg.head_dim)
    v = v.reshape(t, cfg.num_kv_heads, cfg.head_dim)
    if "q_norm" in p:
        q = rms_norm(q, p["q_norm"], cfg.rms_norm_eps)
        k = rms_norm(k, p["k_norm"], cfg.rms_norm_eps)
    inv_freq, af = rope_inv_freq(cfg), rope_attention_factor(cfg)
    # YaRN multiplies cos/sin (the rotary dims only) by its attention factor af
    rot = (lambda a: apply_rope(a, positions, inv_freq)) if af == 1.0 else (
        lambda a: apply_rope(a * af, positions, inv_freq))
    r = cfg.rotary_dim
    if r == cfg.head_dim:
        return rot(q), rot(k), v
    # Partial rotary (GLM-4.5, transformers modeling_glm4_moe.apply_rotary_pos_emb): rotate-half
    # RoPE on the first R dims of each head, the rest passed through.
    part = lambda a: jnp.concatenate([rot(a[..., :r]), a[..., r:]], -1)
    return part(q), part(k), v


def decoder_layer(
    cfg: ModelConfig,
    p: dict,                   # one layer's params (unstacked)
    x: jax.Array,              # f[T, H] residual stream
    positions: jax.Array,      # i32[T]
    meta: AttentionMetadata,
    pool: KVCache,             # k, v f[num_blocks, block_size, W] (+ scales f32[num_blocks,
                               #   Nkv, block_size]): the cache pool holding this layer's blocks
                               #   (``meta`` addresses them; see _layer_view)
    attention_impl: str | None = None,
    k_shift: jax.Array | None = None,  # f32[Nkv, D] subtracted from the keys of an int8 cache
) -> tuple[jax.Array, KVCache]:
    """Pre-norm Llama block: GQA attention over the paged cache (writing this step's K/V,
    quantised when the pool is) + the FFN (SwiGLU, or the MoE block when ``p`` holds one,
    :func:`jmtp.model.moe.ffn`). Returns ``(x, pool)``.

    With ``cfg.attention_type == "mla"`` the attention is DeepSeek's multi-head latent attention
    (:func:`jmtp.model.mla.mla_attention`, latent pool in ``pool.k``).

    ``k_shift f32[Nkv, D]`` (this layer's row of ``params["k_shift"]``, :mod:`jmtp.model.kv_shift`)
    is subtracted from the post-RoPE keys before an int8 cache stores them; other caches ignore
    it. Exact: it changes every score of a query by the same ``q·k_shift``, which softmax
    cancels."""
    t = x.shape[0]
    if cfg.is_mla:
        h = rms_norm(x, p["attn_norm"], cfg.rms_norm_eps)
        inv_freq, af = rope_inv_freq(cfg), rope_attention_factor(cfg)
        rope = ((lambda a, pos: apply_rope(a, pos, inv_freq)) if af == 1.0 else
                (lambda a, pos: apply_rope(a * af, pos, inv_freq)))
        attn, k = mla.mla_attention(cfg, p, h, positions, meta, pool.k, rope, attention_impl)
        x = x + attn
        return _mlp_block(cfg, p, x), pool._replace(k=k)
    h = rms_norm(x, p["attn_norm"], cfg.rms_norm_eps)
    q, k, v = project_qkv(cfg, p, x, positions, h)
    mm = functools.partial(invariant.matmul, cfg.batch_invariant)
    # An int8 cache stores K and V rotated (kv_quant.hadamard_rotation); the query is rotated
    # alike and the attention output rotated back, which leaves attention unchanged.
    # The rotation is applied in f32 (1/sqrt(n) is not exact in bf16 for every head dim).
    rot = kv_quant.rotation_for(pool.k.dtype, cfg.head_dim, jnp.float32)
    if rot is not None:
        if k_shift is not None:
            k = (k.astype(jnp.float32) - k_shift.astype(jnp.float32)).astype(k.dtype)
        q, k, v = (mm(a.astype(jnp.float32), rot).astype(a.dtype) for a in (q, k, v))
    slots = meta.slot_mapping
    if t == 1:
        # One row: XLA turns the scatter into a bounds-checked dynamic-update-slice that reads the
        # old slot first, and copy insertion then copies the whole (stacked) cache every layer.
        # A second, dropped row (slot -1) keeps it a scatter, which XLA updates in place.
        k, v = (jnp.concatenate([a, jnp.zeros_like(a)], 0) for a in (k, v))
        slots = jnp.concatenate([slots, jnp.full((1,), -1, slots.dtype)])
    if pool.quantized:
        pool = KVCache(*kv_quant.write_kv_quantized(*pool[:4], k, v, slots))
    else:
        pool = KVCache(*write_kv(pool.k, pool.v, k, v, slots))
    attn = ragged_paged_attention(
        q, pool.k, pool.v, meta.kv_lens, meta.block_tables, meta.cu_q_lens,
        sm_scale=1.0 / math.sqrt(cfg.head_dim), implementation=attention_impl,
        k_scale=pool.k_scale, v_scale=pool.v_scale,
        # batch-invariant: every sequence's rows in fixed tiles (jmtp.model.invariant)
        rows_per_seq=invariant.ROW_TILE if cfg.batch_invariant else meta.rows_per_seq,
        num_kv_heads=cfg.num_kv_heads, batch_invariant=cfg.batch_invariant)
    if rot is not None:
        attn = mm(attn.astype(jnp.float32), rot.T).astype(attn.dtype)
    attn = attn.reshape(t, cfg.q_size)
    if "wg" in p:    # gated attention (Qwen3-Next / Qwen3.5): sigmoid(h @ wg) per channel
        attn = attn * jax.nn.sigmoid(mm(h, p["wg"])).astype(attn.dtype)
    x = x + mm(attn, p["wo"])
    return _mlp_block(cfg, p, x), pool


def linear_decoder_layer(cfg: ModelConfig, p: dict, x: jax.Array, rows: "gdn.PackedRows",
                         conv_pool: jax.Array, rec_pool: jax.Array, current: jax.Array,
                         rule=None, layer: int = 0, chunk_rule=None):
    """Pre-norm hybrid block whose token mixer is gated DeltaNet
    (:func:`jmtp.model.gated_deltanet.linear_attention_packed` over linear layer ``layer`` of the
    flat state pools ``f[Ll·B, W, ...]``), then the FFN. Returns ``(x, conv_pool, rec_pool)``."""
    h = rms_norm(x, p["attn_norm"], cfg.rms_norm_eps)
    mix, conv_pool, rec_pool = gdn.linear_attention_packed(
        cfg, p, h, rows, conv_pool, rec_pool, current, rule, layer=layer, chunk_rule=chunk_rule)
    return _mlp_block(cfg, p, x + mix), conv_pool, rec_pool


def _mlp_block(cfg: ModelConfig, p: dict, x: jax.Array) -> jax.Array:
    """Second half of a pre-norm block: ``x + FFN(rms(x))`` (dense SwiGLU or MoE,
    :func:`jmtp.model.moe.ffn`)."""
    h = rms_norm(x, p["mlp_norm"], cfg.rms_norm_eps)
    return x + moe.ffn(cfg, p, h)


def _layer_view(meta: AttentionMetadata, cache: KVCache, i) -> AttentionMetadata:
    """Metadata addressing layer ``i`` of a stacked cache seen as one pool of ``L·num_blocks``
    blocks (:func:`_flat`): block ids and slots shifted by ``i·num_blocks``; padding slots stay -1.

    Attention and :func:`write_kv` then read and update the stacked cache in place. Slicing out
    ``cache.k[i]`` instead made XLA copy that layer's whole cache (all ``num_blocks``, used or not)
    for the scatter and again for the update, every layer of every step: on a 2-core CPU a batch-1
    decode step with ``num_blocks=1024`` took 2.8x as long as with the in-place view (704 vs 253 ms
    on a loaded machine; ``scripts/bench_roofline.py``)."""
    nb, bs = cache.k.shape[1], cache.k.shape[2]
    return dataclasses.replace(
        meta,
        slot_mapping=jnp.where(meta.slot_mapping >= 0, meta.slot_mapping + i * (nb * bs), -1),
        block_tables=meta.block_tables + i * nb)


def _flat(c: jax.Array) -> jax.Array:
    """``f[L, num_blocks, block_size, W]`` -> ``f[L·num_blocks, block_size, W]`` (a view;
    scales ``f32[L, num_blocks, Nkv, bs]`` likewise)."""
    return c.reshape((c.shape[0] * c.shape[1],) + c.shape[2:])


def _flat_cache(cache: KVCache) -> KVCache:
    """Every paged array of ``cache`` as one pool of ``L·num_blocks`` blocks (:func:`_flat`);
    the linear state is left out."""
    return KVCache(*(None if a is None else _flat(a) for a in cache[:4]))


def _unflat_cache(pool: KVCache, like: KVCache) -> KVCache:
    """Inverse of :func:`_flat_cache`: the pool's arrays back in ``like``'s shapes (and
    ``like``'s linear state)."""
    return KVCache(*(None if a is None else a.reshape(b.shape)
                     for a, b in zip(pool[:4], like[:4])), linear=like.linear)


def _run_layers(cfg, layers, x, positions, meta, cache: KVCache, attention_impl,
                k_shift: jax.Array | None = None):
    """Run the layers over the flat cache (:func:`_layer_view`), updated in place; layer ``i``
    gets ``k_shift[i]`` (``f32[L, Nkv, D]`` or None, see :func:`decoder_layer`).

    ``layers`` stacked (a dict of ``f[L, ...]``): one ``lax.scan``. ``layers`` a list of per-layer
    dicts (:func:`unstack_layers`): a Python loop (unrolled), so that no weight is sliced out of a
    stack inside the step (XLA:CPU copies each sliced weight before its dot), at the price of a
    compile several times as long."""
    pool = _flat_cache(cache)

    def layer(x, pool, i, p):
        return decoder_layer(cfg, p, x, positions, _layer_view(meta, cache, i), pool,
                             attention_impl, None if k_shift is None else k_shift[i])

    if cfg.is_hybrid:
        return _run_hybrid_layers(cfg, layers, x, positions, meta, cache, pool, layer)
    if isinstance(layers, (list, tuple)):
        for i, p in enumerate(layers):
            x, pool = layer(x, pool, i, p)
    else:
        def body(carry, inp):
            return layer(*carry, *inp), None

        n = jax.tree_util.tree_leaves(layers)[0].shape[0]
        (x, pool), _ = jax.lax.scan(body, (x, pool), (jnp.arange(n), layers))
    return x, _unflat_cache(pool, cache)


def _run_hybrid_layers(cfg, layers, x, positions, meta, cache: KVCache, pool, attention_layer):
    """A hybrid stack (unrolled): full-attention layer ``kv_layers[j]`` uses cache layer ``j``,
    linear-attention layer ``linear_layers[j]`` state layer ``j`` of ``cache.linear``."""
    lin = cache.linear
    if lin is None:
        raise ValueError("a hybrid model (linear-attention layers) needs KVCache.linear, the "
                         "recurrent state pool (jmtp.model.gated_deltanet.init_linear_state)")
    rows = gdn.packed_rows(meta.cu_q_lens, positions, lin.recurrent.shape[2])
    kv_index = {i: j for j, i in enumerate(cfg.kv_layers)}
    lin_index = {i: j for j, i in enumerate(cfg.linear_layers)}
    # Every linear layer's pool as one flat view [Ll·B, W, ...] (a reshape, free), as the KV
    # cache's flat view (_layer_view): layer j's slot b is entry j·B + b, so each layer updates
    # the pool in place instead of slicing out its layer and writing it back (two copies of the
    # layer's B·W checkpoints per layer and step).
    flat = lambda a: a.reshape((a.shape[0] * a.shape[1],) + a.shape[2:])  # noqa: E731
    conv, rec = flat(lin.conv), flat(lin.recurrent)
    for i, p in enumerate(layers):
        if i in kv_index:
            x, pool = attention_layer(x, pool, kv_index[i], p)
        else:
            x, conv, rec = linear_decoder_layer(cfg, p, x, rows, conv, rec, lin.current,
                                                meta.linear_rule, lin_index[i],
                                                meta.linear_chunk_rule)
    lin = lin._replace(conv=conv.reshape(lin.conv.shape), recurrent=rec.reshape(lin.recurrent.shape))
    return x, _unflat_cache(pool, cache._replace(linear=lin))


def forward(
    cfg: ModelConfig,
    params: dict,
    ids: jax.Array,            # i32[T] packed token ids (padding rows: any valid id)
    positions: jax.Array,      # i32[T]
    meta: AttentionMetadata,
    cache: KVCache,            # target cache, L layers
    attention_impl: str | None = None,
    pre_norm: bool = False,
) -> tuple[jax.Array, KVCache]:
    """Target forward over a ragged packed batch.

    Args:
      pre_norm: return the hidden states before the final norm (what a MiMo-layout MTP head takes,
        ``ModelConfig.mtp_takes_prenorm_hidden``; :func:`final_norm` then gives the logits' input).

    Returns:
      hidden: f[T, H] post-final-norm hidden states of every row (input to :func:`compute_logits`
        and to the MTP head), or the pre-norm ones with ``pre_norm``;
      cache: the cache with this step's K/V written at ``meta.slot_mapping``.
    """
    x = quant.embedding(params["embed"], ids, param_dtype(params))
    x, cache = _run_layers(cfg, params["layers"], x, positions, meta, cache, attention_impl,
                           params.get("k_shift"))
    return (x if pre_norm else final_norm(cfg, params, x)), cache


def final_norm(cfg: ModelConfig, params: dict, x: jax.Array) -> jax.Array:
    """The target's final RMSNorm of pre-norm hidden rows ``x f[T, H]`` (the LM head's input)."""
    return rms_norm(x, params["final_norm"], cfg.rms_norm_eps)


def compute_logits(params: dict, h: jax.Array, batch_invariant: bool = False) -> jax.Array:
    """LM head: ``f32[T, V]`` logits of post-norm hidden states ``h: f[T, H]`` (in row tiles
    with ``batch_invariant``, :mod:`jmtp.model.invariant`)."""
    if batch_invariant:
        return invariant.row_tiled(lambda t: compute_logits(params, t), h)
    if "lm_head" in params:
        w = params["lm_head"]
        if quant.is_quantized(w):    # int8 per output channel: (h @ values) · scales, in f32
            return quant.matmul(h, w, out_dtype=jnp.float32)
        return jnp.dot(h, w, preferred_element_type=jnp.float32).astype(jnp.float32)
    # Contract with the [V, H] table directly: ``h @ embed.T`` makes XLA:CPU materialise the
    # transposed table (a 113 MB copy per step for SmolLM2) when T = 1. An int8 table: the dot
    # with its values, times each row's scale (quant.logits_from_rows).
    return quant.logits_from_rows(h, params["embed"])


def mtp_forward(
    cfg: ModelConfig,
    params: dict,
    layer_idx: int | jax.Array,  # which MTP module (0..N-1)
    ids: jax.Array,              # i32[T] tokens x_{t+1}
    hidden: jax.Array,           # f[T, H] hidden h_t fed to the head
    positions: jax.Array,        # i32[T] MTP KV positions (= t)
    meta: AttentionMetadata,     # over the MTP cache
    cache: KVCache,              # MTP cache, N layers
    attention_impl: str | None = None,
) -> tuple[jax.Array, jax.Array, KVCache]:
    """One MTP module (the DeepSeek-V3 technical report's multi-token prediction / FastDeploy
    ``ernie4_5_mtp`` / MiMo-7B ``mtp_layers``):
    ``h' = Block(eh_proj([enorm(embed(x_{t+1})) ; hnorm(h_t)]))``, then the final norm.

    The MiMo layout (vLLM ``models/mimo_mtp.py`` ``MiMoMultiTokenPredictorLayer``) zeroes the
    embedding of the rows at MTP position 0 before ``enorm`` (its ``token_layernorm``); its
    ``input_proj`` takes ``[hnorm(h_t); enorm(e)]``, which the loader turns into this ``eh_proj``
    order by swapping the two row halves (exact), and ``h_t`` is the target's pre-norm state
    (``ModelConfig.mtp_takes_prenorm_hidden``: the caller's business).

    Returns ``(h_logits f[T,H], h_next f[T,H], cache)``: ``h_logits`` goes to the shared LM head;
    ``h_next`` is fed to the next recursive substep (pre-norm for the DeepSeek layout, post-norm for
    ERNIE and MiMo, ``ModelConfig.mtp_feeds_back_prenorm``).
    """
    m = params["mtp"]
    pick = lambda a: a[layer_idx]
    emb = quant.embedding(params["embed"], ids, param_dtype(params))
    if cfg.mtp_layout == "mimo":      # "masking inputs at position 0, as not needed by MTP"
        emb = jnp.where((positions == 0)[:, None], jnp.zeros_like(emb), emb)
    e = rms_norm(emb, pick(m["enorm"]), cfg.rms_norm_eps)
    hn = rms_norm(hidden.astype(e.dtype), pick(m["hnorm"]), cfg.rms_norm_eps)
    x = invariant.matmul(cfg.batch_invariant, jnp.concatenate([e, hn], axis=-1),
                         jax.tree_util.tree_map(pick, m["eh_proj"]))
    layer = jax.tree_util.tree_map(pick, m["layer"])
    x, pool = decoder_layer(cfg, layer, x, positions, _layer_view(meta, cache, layer_idx),
                            _flat_cache(cache), attention_impl)
    cache = _unflat_cache(pool, cache)
    h = rms_norm(x, pick(m["final_norm"]), cfg.rms_norm_eps)
    return h, (x if cfg.mtp_feeds_back_prenorm else h), cache


def unstack_layers(params: dict) -> dict:
    """``params`` with ``params["layers"]`` as a tuple of ``L`` per-layer dicts of separate arrays
    (the stacked ``f[L, ...]`` leaves split), which :func:`forward` runs as an unrolled loop.

    Leaves already split are returned as they are; ``jax.ShapeDtypeStruct`` leaves (abstract
    parameters) become per-layer ``ShapeDtypeStruct``s. The stacked form stays the canonical pytree
    (loaders, training, :func:`jmtp.model.params.check_params`)."""
    layers = params["layers"]
    if isinstance(layers, (list, tuple)):
        return params
    n = jax.tree_util.tree_leaves(layers)[0].shape[0]

    def take(a, i):   # an array, or a ShapeDtypeStruct (abstract params, jmtp.aot)
        if isinstance(a, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(a.shape[1:], a.dtype)
        return a[i]
    split = tuple(jax.tree_util.tree_map(lambda a, i=i: take(a, i), layers) for i in range(n))
    return {**params, "layers": split}
