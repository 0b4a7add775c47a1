"""The target's hidden states of many sequences at once (training data capture on any device).

:func:`dense_target_forward` runs the frozen target over ``[B, W]`` padded sequences with a
causal mask (no paged cache, no block tables): one batched, compute-bound call per bucket, the
way to capture hidden states on an accelerator (``scripts/train_mtp.py --capture dense``). The
one-sequence paged prefill (:func:`jmtp.train.data.target_hidden_states`) stays the reference it
is tested against (``tests/train/test_selfgen.py``).

It can also return the residual stream after chosen target layers (``feature_layers``): the
low/mid/high features EAGLE-3 (Li et al. 2025, arXiv 2503.01840) feeds its draft head.

:func:`capture_hidden` packs sequences of any lengths into a few ``[B, W]`` buckets (sorted by
length, ``W`` a power of two, ``B·W`` near ``batch_tokens``) and returns each sequence's rows.
"""
from __future__ import annotations

import functools
import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jmtp.model.config import ModelConfig
from jmtp.model.llama import final_norm, project_qkv, rms_norm
from jmtp.model.moe import ffn


def _check(cfg: ModelConfig) -> None:
    from jmtp.train.dense import check_trainable
    check_trainable(cfg, "dense_target_forward")
    if cfg.is_hybrid:
        raise ValueError("dense_target_forward: hybrid linear-attention targets are not supported "
                         "(capture their hidden states with one engine prefill per sequence, "
                         "train_mtp.py --capture prefill)")


def _layer(cfg: ModelConfig, p: dict, x: jax.Array, positions: jax.Array, mask: jax.Array):
    """One pre-norm block over ``x f[B, W, H]`` with dense attention under ``mask bool[B, W, W]``
    (the math of :func:`jmtp.model.llama.decoder_layer` without the paged cache)."""
    b, w, hdim = x.shape
    flat = x.reshape(b * w, hdim)
    h = rms_norm(flat, p["attn_norm"], cfg.rms_norm_eps)
    q, k, v = project_qkv(cfg, p, flat, positions.reshape(-1), h)
    g = cfg.num_heads // cfg.num_kv_heads
    qf = q.astype(jnp.float32).reshape(b, w, cfg.num_kv_heads, g, cfg.head_dim)
    kf = k.astype(jnp.float32).reshape(b, w, cfg.num_kv_heads, cfg.head_dim)
    vf = v.astype(jnp.float32).reshape(b, w, cfg.num_kv_heads, cfg.head_dim)
    s = jnp.einsum("bqkgd,bmkd->bkgqm", qf, kf) / math.sqrt(cfg.head_dim)
    s = jnp.where(mask[:, None, None], s, -jnp.inf)
    o = jnp.einsum("bkgqm,bmkd->bqkgd", jax.nn.softmax(s, axis=-1), vf)
    attn = o.reshape(b * w, cfg.q_size).astype(x.dtype)
    if "wg" in p:   # gated attention (Qwen3-Next / Qwen3.5)
        attn = attn * jax.nn.sigmoid(h @ p["wg"]).astype(attn.dtype)
    flat = flat + attn @ p["wo"]
    hm = rms_norm(flat, p["mlp_norm"], cfg.rms_norm_eps)
    return (flat + ffn(cfg, p, hm)).reshape(b, w, hdim)


@functools.partial(jax.jit, static_argnums=(0, 3))
def _forward(cfg: ModelConfig, params: dict, ids: jax.Array, feature_layers: tuple[int, ...],
             lens: jax.Array):
    b, w = ids.shape
    pos = jnp.broadcast_to(jnp.arange(w, dtype=jnp.int32), (b, w))
    j = jnp.arange(w)
    # causal, and keys of padding rows hidden; a padding query sees key 0 (finite, discarded)
    mask = (j[None, :, None] >= j[None, None, :]) & (j[None, None, :] < lens[:, None, None])
    mask = mask | (j[None, None, :] == 0)
    x = params["embed"][ids]
    layers = params["layers"]
    run = functools.partial(_layer, cfg, positions=pos, mask=mask)
    feats = []
    if isinstance(layers, (list, tuple)):
        for i, p in enumerate(layers):
            x = run(p, x)
            if i in feature_layers:
                feats.append(x)
    else:
        n = jax.tree_util.tree_leaves(layers)[0].shape[0]
        ends = sorted(set(feature_layers)) + [n - 1]
        start = 0
        for end in ends:                 # one scan per span between feature layers
            if end >= start:
                span = jax.tree_util.tree_map(lambda a, s=start, e=end: a[s:e + 1], layers)
                x, _ = jax.lax.scan(lambda c, p: (run(p, c), None), x, span)
                start = end + 1
            if end in feature_layers:
                feats.append(x)
    h = final_norm(cfg, params, x)
    return h, (jnp.stack(feats, axis=2) if feats else None)


def dense_target_forward(cfg: ModelConfig, params: dict, ids, lens=None,
                         feature_layers: Sequence[int] = ()):
    """The target over padded sequences at once.

    Args:
      ids: i32[B, W] token ids, each sequence left-aligned (padding: any valid id).
      lens: i32[B] real length of each row (default W); rows past it are padding.
      feature_layers: target layer indices (0-based) whose output residual stream (pre-norm,
        after the block) is also returned, in the order given (EAGLE-3's low/mid/high features).

    Returns:
      ``(h f[B, W, H], feats f[B, W, F, H] or None)``: the post-final-norm hidden states (what
      the LM head and the MTP head take; rows past ``lens`` are garbage) and the features.

    Raises:
      ValueError: an MLA, MiMo-layout or hybrid target, ids outside the vocabulary, a feature
        layer out of range, or ``lens`` not in ``[1, W]``.
    """
    _check(cfg)
    ids = jnp.asarray(ids, jnp.int32)
    if ids.ndim != 2:
        raise ValueError(f"ids must be i32[B, W], got shape {ids.shape}")
    b, w = ids.shape
    lens = jnp.full((b,), w, jnp.int32) if lens is None else jnp.asarray(lens, jnp.int32)
    if lens.shape != (b,):
        raise ValueError(f"lens must be i32[{b}], got shape {lens.shape}")
    try:
        lo, hi = int(jnp.min(lens)), int(jnp.max(lens))
    except jax.errors.ConcretizationTypeError:      # traced by a caller's jit: not checked
        lo, hi = 1, w
    if lo < 1 or hi > w:
        raise ValueError(f"lens must lie in [1, W={w}]")
    bad = [i for i in feature_layers if not 0 <= i < cfg.num_layers]
    if bad:
        raise ValueError(f"feature_layers {bad} outside [0, num_layers={cfg.num_layers})")
    return _forward(cfg, params, ids, tuple(int(i) for i in feature_layers), lens)


def _pow2(n: int, lo: int) -> int:
    w = lo
    while w < n:
        w *= 2
    return w


def capture_hidden(cfg: ModelConfig, params: dict, sequences: Sequence[Sequence[int]], *,
                   batch_tokens: int = 8192, min_width: int = 64,
                   feature_layers: Sequence[int] = (), dtype=np.float16, progress: bool = False):
    """Hidden states of every sequence, captured in ``[B, W]`` buckets.

    Sequences are sorted by length; each bucket has ``W`` = the next power of two (at least
    ``min_width``) of its longest sequence and ``B = max(1, batch_tokens // W)`` rows (the last
    one fewer, padded up to a power of two so few shapes compile).

    Returns:
      ``(hidden, feats)``: per sequence ``dtype[n_i, H]`` (post-norm) and, with
      ``feature_layers``, ``dtype[n_i, F, H]`` (else None).

    Raises:
      ValueError: an empty sequence, or as :func:`dense_target_forward`.
    """
    n = len(sequences)
    if any(len(s) == 0 for s in sequences):
        raise ValueError("every sequence needs at least one token")
    order = sorted(range(n), key=lambda i: len(sequences[i]))
    hidden: list = [None] * n
    feats: list | None = [None] * n if feature_layers else None
    i = 0
    bar = None
    if progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=n, desc="capture hidden states", unit="seq")
    while i < n:
        w = _pow2(len(sequences[order[i]]), min_width)
        rows = max(1, batch_tokens // w)
        take = [j for j in order[i:i + rows] if len(sequences[j]) <= w]
        if not take:                     # the next sequence needs a wider bucket
            take = [order[i]]
            w = _pow2(len(sequences[order[i]]), min_width)
        b = _pow2(len(take), 1)
        ids = np.zeros((b, w), np.int32)
        lens = np.ones((b,), np.int32)
        for r, j in enumerate(take):
            ids[r, :len(sequences[j])] = sequences[j]
            lens[r] = len(sequences[j])
        h, f = dense_target_forward(cfg, params, ids, lens, feature_layers)
        h = np.asarray(h.astype(jnp.float32))
        f = None if f is None else np.asarray(f.astype(jnp.float32))
        for r, j in enumerate(take):
            hidden[j] = h[r, :lens[r]].astype(dtype)
            if feats is not None:
                feats[j] = f[r, :lens[r]].astype(dtype)
        i += len(take)
        if bar is not None:
            bar.update(len(take))
    if bar is not None:
        bar.close()
    return hidden, feats
