"""Dense (unpaged) MTP forward for training, with packed segments and recursive "training-time test".

Inference runs the MTP module through :func:`jmtp.model.llama.mtp_forward` over a paged cache. For
training the whole sequence is known in advance, so the same module can run over ``[B, W]`` packed
rows with a plain attention mask instead of a cache. This module reuses the model's building blocks
(:func:`~jmtp.model.llama.rms_norm`, :func:`~jmtp.model.llama.apply_rope`,
:func:`~jmtp.model.llama.rope_inv_freq`) and the parameter layout of ``params["mtp"]``; the test
``tests/train/test_train_mtp.py`` checks it row for row against ``mtp_forward`` (pass 1) and against a
step-by-step emulation of recursive drafting through ``mtp_forward`` (passes >= 2).

Why not ``mtp_forward`` itself: the jnp reference of ragged paged attention costs ``O(T * S * Lk)``
(every query against every sequence of the batch), i.e. ``B`` times a dense causal attention, and the
recursive passes need a mask no paged cache can express (below).

Row convention (FastDeploy's one-position-shifted MTP cache): MTP row ``p`` of a sequence sees the
target's post-norm hidden state ``h_p`` and the token ``x_{p+1}``; its output predicts ``x_{p+2}``;
its RoPE position is ``p``.

Recursive passes (one MTP layer reused for draft substeps ``s >= 1``, which pair the embedding of
draft ``d_s`` with the module's own previous output): in pass ``i`` (1-based) row ``p`` plays the
draft substep ``i-1`` whose chain started at row ``r = p - i + 1``: its token is ``x_{p+1}`` (the
previous draft, assumed correct), its hidden input is the module's own output ``h_next`` of pass
``i-1`` at row ``p-1``, and it attends to

* the pass-1 keys of rows ``j <= r`` (the MTP cache entries written from target hidden states), and
* the pass-``m`` key of row ``r + m - 1`` for ``m = 2..i`` (the entries written by earlier substeps).

This is exactly what the paged cache holds at inference after the target's verify step (the MTP
cache is rewritten from the target's hidden states over the committed positions), i.e. the
"training-time test" of EAGLE-3 (Li et al. 2025, arXiv 2503.01840) for a chain draft. Pass ``i`` row
``p`` is *valid* when ``r`` lies in the same segment.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jmtp.model.config import ModelConfig
from jmtp.model.llama import project_qkv, rms_norm, rope_inv_freq
from jmtp.model.moe import ffn


def _qkv(cfg: ModelConfig, p: dict, x: jax.Array, positions: jax.Array, inv_freq=None):
    """q ``f[B,W,Nq,D]``, k/v ``f[B,W,Nkv,D]``: :func:`jmtp.model.llama.project_qkv` on ``[B, W]``."""
    b, w, h = x.shape
    q, k, v = project_qkv(cfg, p, x.reshape(b * w, h), positions.reshape(b * w))
    return (q.reshape(b, w, cfg.num_heads, cfg.head_dim),
            k.reshape(b, w, cfg.num_kv_heads, cfg.head_dim),
            v.reshape(b, w, cfg.num_kv_heads, cfg.head_dim))


def _attend(cfg: ModelConfig, q, k, v, mask):
    """Masked softmax attention in fp32. ``q f[B,W,Nq,D]``, ``k,v f[B,M,Nkv,D]``, ``mask bool[B,W,M]``.

    Every query row must have at least one allowed key (guaranteed by :func:`_pass_mask`).
    """
    b, w, nq, d = q.shape
    g = nq // cfg.num_kv_heads
    qf = q.astype(jnp.float32).reshape(b, w, cfg.num_kv_heads, g, d)
    s = jnp.einsum("bwkgd,bmkd->bkgwm", qf, k.astype(jnp.float32)) / math.sqrt(d)
    s = jnp.where(mask[:, None, None], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("bkgwm,bmkd->bwkgd", p, v.astype(jnp.float32))
    return o.reshape(b, w, nq * d).astype(q.dtype)


def _pass_mask(segment_ids: jax.Array, i: int) -> jax.Array:
    """``bool[B, W, i*W]``: which keys (pass-major, ``[pass1 rows; pass2 rows; ...]``) row p of pass i sees."""
    b, w = segment_ids.shape
    p = jnp.arange(w)[:, None]
    j = jnp.arange(w)[None, :]
    same = segment_ids[:, :, None] == segment_ids[:, None, :]              # bool[B, W, W]
    blocks = [same & (j <= p - i + 1)]                                     # pass-1 keys
    for m in range(2, i + 1):
        blocks.append(same & (j == p - i + m))
    mask = jnp.concatenate(blocks, axis=-1)
    # A row always sees its own key (last block, j == p): keeps padding rows finite.
    own = jnp.zeros((w, i * w), bool).at[jnp.arange(w), (i - 1) * w + jnp.arange(w)].set(True)
    return mask | own[None]


def check_trainable(cfg: ModelConfig, where: str) -> None:
    """Refuse, early, targets whose MTP heads ``jmtp.train`` cannot train.

    Raises:
      ValueError: the MiMo MTP layout (``cfg.mtp_layout == "mimo"``: its head takes the target's
        pre-norm hidden state and zeroes position 0's embedding, which the training data path
        does not provide), an MLA target (``cfg.attention_type == "mla"``) or an 8-bit MTP
        head (``cfg.quantization`` covering ``mtp.*``).
    """
    if cfg.mtp_layout == "mimo":
        raise ValueError(f"{where}: MTP training for ModelConfig.mtp_layout='mimo' is not "
                         "implemented (the head takes the target's pre-norm hidden state)")
    if cfg.is_mla:
        raise ValueError(f"{where}: MTP training on a multi-head latent attention target "
                         "(ModelConfig.attention_type='mla') is not implemented")
    q = cfg.quantization
    if q is not None and any(p.startswith("mtp.") for p in q.quantized):
        raise ValueError(f"{where}: the MTP head holds 8-bit weights ({q.describe()}); training "
                         "needs a float head (load without quantization, or attach a float head "
                         "file)")


def dense_mtp_forward(
    cfg: ModelConfig,
    params: dict,
    ids: jax.Array,            # i32[B, W]   token x_{p+1} of each row
    hidden: jax.Array,         # f[B, W, H]  target post-norm hidden h_p of each row
    positions: jax.Array,      # i32[B, W]   RoPE position p of each row
    segment_ids: jax.Array,    # i32[B, W]   packed sequence id of each row (-1: padding)
    num_passes: int = 1,
    layer_idx: int = 0,
) -> list[tuple[jax.Array, jax.Array, jax.Array]]:
    """Run MTP module ``layer_idx`` over packed rows, ``num_passes`` recursive passes (module docstring).

    Rows of one segment must be contiguous and in position order; segments never attend to each other.

    Returns:
      one ``(h_logits f[B,W,H], h_next f[B,W,H], valid bool[B,W])`` per pass: ``h_logits`` is the LM
      head input (post MTP final norm), ``h_next`` what the next substep is fed (pre-norm for the
      "deepseek" layout, post-norm for "ernie", as ``mtp_forward``), ``valid`` whether the row's draft
      chain starts inside its segment (always true for real rows of pass 1).

    Raises:
      ValueError: on mismatched shapes, ``num_passes < 1``, or an MLA target
        (``cfg.attention_type == "mla"``: training an MTP head on DeepSeek-style latent attention
        is not implemented), or the MiMo MTP layout (``cfg.mtp_layout == "mimo"``: its head takes
        the target's pre-norm hidden state and zeroes position 0's embedding, which the training
        data path does not provide).
    """
    check_trainable(cfg, "dense_mtp_forward")
    if num_passes < 1:
        raise ValueError(f"num_passes must be >= 1, got {num_passes}")
    b, w = ids.shape
    if hidden.shape != (b, w, cfg.hidden_size):
        raise ValueError(f"hidden must be f[B={b}, W={w}, H={cfg.hidden_size}], got {hidden.shape}")
    if positions.shape != (b, w) or segment_ids.shape != (b, w):
        raise ValueError(
            f"positions and segment_ids must be i32[{b}, {w}], got {positions.shape} and "
            f"{segment_ids.shape}")
    m = params["mtp"]
    pick = lambda a: a[layer_idx]
    layer = jax.tree_util.tree_map(pick, m["layer"])
    inv_freq = rope_inv_freq(cfg)
    e = rms_norm(params["embed"][ids], pick(m["enorm"]), cfg.rms_norm_eps)
    real = segment_ids >= 0
    # prev_same[b, p]: row p-1 exists and belongs to the same segment as row p.
    prev_same = jnp.concatenate(
        [jnp.zeros((b, 1), bool), (segment_ids[:, 1:] == segment_ids[:, :-1]) & real[:, 1:]], axis=1)

    outs = []
    ks, vs = [], []
    h_in = hidden
    valid = real
    for i in range(1, num_passes + 1):
        if i > 1:
            prev = outs[-1][1]
            h_in = jnp.concatenate([jnp.zeros_like(prev[:, :1]), prev[:, :-1]], axis=1)
            valid = _shift_valid(outs[-1][2], prev_same)
        hn = rms_norm(h_in.astype(e.dtype), pick(m["hnorm"]), cfg.rms_norm_eps)
        x = jnp.concatenate([e, hn], axis=-1) @ pick(m["eh_proj"])
        q, k, v = _qkv(cfg, layer, x, positions, inv_freq)
        ks.append(k)
        vs.append(v)
        attn = _attend(cfg, q, jnp.concatenate(ks, axis=1), jnp.concatenate(vs, axis=1),
                       _pass_mask(segment_ids, i))
        if "wg" in layer:   # gated attention (Qwen3-Next / Qwen3.5 MTP layer), as decoder_layer
            hg = rms_norm(x, layer["attn_norm"], cfg.rms_norm_eps)
            attn = attn * jax.nn.sigmoid(hg @ layer["wg"]).astype(attn.dtype)
        x = x + attn @ layer["wo"]
        hm = rms_norm(x, layer["mlp_norm"], cfg.rms_norm_eps)
        x = x + ffn(cfg, layer, hm.reshape(-1, hm.shape[-1])).reshape(hm.shape)  # dense or MoE
        h = rms_norm(x, pick(m["final_norm"]), cfg.rms_norm_eps)
        outs.append((h, x if cfg.mtp_feeds_back_prenorm else h, valid))
    return outs


def _shift_valid(prev_valid: jax.Array, prev_same: jax.Array) -> jax.Array:
    """Pass-i validity of row p: pass-(i-1) row p-1 was valid and lies in p's segment."""
    b = prev_valid.shape[0]
    shifted = jnp.concatenate([jnp.zeros((b, 1), bool), prev_valid[:, :-1]], axis=1)
    return shifted & prev_same
