"""Draft sampling: pick each slot's next draft token from the proposer's logits.

:func:`draft_sample` drafts greedily by default; with ``draft_sampling`` it samples from the
proposer's temperature / top-p / top-k filtered distribution (request values or draft-side
overrides), using the request's position-keyed randomness
(:data:`~jmtp.runtime.device.sampling.rng.PURPOSE_DRAFT`), and returns that exact distribution ``q`` for
the verifier. No penalties are applied to drafts. ``q`` is the draft distribution of the
speculative-sampling papers (``p`` is the target's).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jmtp.runtime.device.sampling.arrays import GREEDY_EPS, SamplingArrays
from jmtp.runtime.device.sampling.processors import filter_logits, safe_softmax, vocab_argmax
from jmtp.runtime.device.sampling.rng import (PURPOSE_DRAFT, sample_from_probs, uniform_draws,
                                              uniform_from_keys)


def draft_sample(logits: jax.Array, sampling: SamplingArrays, positions: jax.Array | None = None,
                 *, draft_sampling: bool = False, draft_temperature: float | None = None,
                 draft_top_p: float | None = None, draft_top_k: int | None = None,
                 key: jax.Array | None = None) -> tuple[jax.Array, jax.Array | None]:
    """Pick one draft token per slot from the proposer's logits.

    Args:
      logits: f[B, V] proposer logits for the next draft of each slot.
      sampling: the slots' :class:`SamplingArrays` (seed, and temperature/top-p/top-k defaults).
      positions: i32[B] output position of the token being drafted (``num_generated`` of the step
        being drafted for + draft index, counted from the current admission: ``sampling.rng_offset``
        is added); required with ``draft_sampling`` unless ``key`` is given.
      draft_sampling: static. False (default): greedy drafts, returns ``(argmax, None)`` -- the
        verifier then treats q as one-hot. True: sample with the draft temperature / top-p /
        top-k and return the exact distribution sampled from.
      draft_temperature, draft_top_p, draft_top_k: draft-side overrides (the analog of FastDeploy's
        ``FD_SPECULATE_SAMPLING_TOP_P/TOP_K``); None = the request's own value. Rows whose
        (effective) temperature is ``< GREEDY_EPS`` draft greedily (q one-hot).
      key: optional PRNG key replacing the per-request seeds (rows then use
        ``fold_in(key, row)`` and the position; outputs depend on the row index).
    Returns:
      ``(tokens i32[B], q f32[B, V] | None)``. No penalties are applied to drafts: q is exactly the
      distribution the token was sampled from (what :func:`jmtp.runtime.device.verify.verify` needs).
    Raises:
      ValueError if ``draft_sampling`` and neither ``positions`` nor ``key`` is given.
    """
    logits = logits.astype(jnp.float32)
    B, V = logits.shape
    if not draft_sampling:
        return vocab_argmax(logits), None
    if positions is None and key is None:
        raise ValueError("draft_sample: positions (i32[B]) or key is required with draft_sampling")

    def per_row(override, default, dtype):
        if override is None:
            return default.astype(dtype)
        return jnp.broadcast_to(jnp.asarray(override, dtype), (B,))

    temperature = per_row(draft_temperature, sampling.temperature, jnp.float32)
    top_p = per_row(draft_top_p, sampling.top_p, jnp.float32)
    top_k = per_row(draft_top_k, sampling.top_k, jnp.int32)
    greedy = temperature < GREEDY_EPS
    z = logits / jnp.where(greedy, 1.0, temperature)[:, None]
    q_filtered = safe_softmax(filter_logits(z, top_k, top_p, jnp.zeros((B,), jnp.float32)))
    argmax_one_hot = jax.nn.one_hot(vocab_argmax(logits), V, dtype=jnp.float32)
    q = jnp.where(greedy[:, None] | (jnp.sum(q_filtered, -1, keepdims=True) <= 0),
                  argmax_one_hot, q_filtered)
    draft_positions = (jnp.zeros((B,), jnp.int32) if positions is None
                       else positions.astype(jnp.int32))
    if key is None:
        u = uniform_draws(sampling.seed, draft_positions + sampling.rng_offset, PURPOSE_DRAFT,
                          sampling.seed_hi)
    else:
        row_keys = jax.vmap(lambda row, position: jax.random.fold_in(jax.random.fold_in(
            jax.random.fold_in(key, row), position), PURPOSE_DRAFT))(
                jnp.arange(B, dtype=jnp.uint32), draft_positions.astype(jnp.uint32))
        u = uniform_from_keys(row_keys)
    tokens = sample_from_probs(q, u)
    return tokens, q
