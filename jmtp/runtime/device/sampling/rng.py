"""Position-based, per-request randomness and inverse-CDF token draws.

Every random draw of a request is keyed by the request's seed, the output position it belongs to
and its purpose: the key of output position ``n`` of the request in slot ``b`` for purpose ``π``
is ``fold_in(key(seed[b]), n * NUM_PURPOSES + π)`` (:func:`request_keys`), so a request's tokens
depend neither on its batch mates nor on how many drafts earlier steps accepted.
:func:`uniform_draws` turns those keys into uniforms in [0, 1) and :func:`sample_from_probs`
turns a uniform into a token of a (possibly unnormalised) distribution.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jmtp.runtime.device.sampling.processors import vocab_argmax

#: RNG purposes folded into the per-position key (:func:`request_keys`).
PURPOSE_ACCEPT = 0   # acceptance coin of a draft (rejection sampling)
PURPOSE_SAMPLE = 1   # a token sampled from the target (bonus / correction / target_match / topp)
PURPOSE_DRAFT = 2    # a draft token sampled from the proposer's distribution

#: Number of RNG purposes: the key data folded in is ``position * NUM_PURPOSES + purpose``.
NUM_PURPOSES = 4


def seed_keys(seed: jax.Array, seed_hi: jax.Array | None = None) -> jax.Array:
    """Typed PRNG keys ``key[B]`` of 64-bit request seeds: ``key(lo)`` for a seed in
    ``[0, 2**32)`` (``seed_hi == 0``), else ``fold_in(key(lo), hi)``, so every bit of the seed
    counts and the streams of 32-bit seeds are those they always were.

    Args:
      seed: u32[B] the seeds' low 32 bits. seed_hi: u32[B] their high 32 bits (None: 0).
    """
    keys = jax.vmap(jax.random.key)(seed.astype(jnp.uint32))
    if seed_hi is None:
        return keys
    hi = seed_hi.astype(jnp.uint32)
    wide = jax.vmap(jax.random.fold_in)(keys, hi)
    data = jnp.where((hi == 0).reshape(hi.shape + (1,) * (jax.random.key_data(keys).ndim - 1)),
                     jax.random.key_data(keys), jax.random.key_data(wide))
    return jax.random.wrap_key_data(data, impl=jax.random.key_impl(keys))


def request_keys(seed: jax.Array, positions: jax.Array, purpose,
                 seed_hi: jax.Array | None = None) -> jax.Array:
    """Typed PRNG keys ``key[positions.shape]``: ``fold_in(K(seed[b]), n * NUM_PURPOSES + π)``,
    ``K`` = :func:`seed_keys`.

    One key per (request seed, output position ``n``, purpose ``π``); the pair is packed into one
    ``fold_in`` (injective for positions below 2**29), which is the nested
    ``fold_in(fold_in(key, n), π)`` scheme with one hash instead of two.

    Args:
      seed: u32[B] request seeds (their low 32 bits). seed_hi: u32[B] the high 32 bits, or None.
      positions: i32[B, ...] output positions (0 = the first generated token).
      purpose: a ``PURPOSE_*`` constant, or an int array broadcastable to ``positions``.
    """
    key_data = (positions.astype(jnp.uint32) * jnp.uint32(NUM_PURPOSES)
                + jnp.asarray(purpose, jnp.uint32))
    seed_keys_ = seed_keys(seed, seed_hi)
    flat_data = key_data.reshape(key_data.shape[0], -1)
    keys = jax.vmap(lambda seed_key, row_data: jax.vmap(
        lambda datum: jax.random.fold_in(seed_key, datum))(row_data))(seed_keys_, flat_data)
    return keys.reshape(key_data.shape)


def uniform_from_keys(keys: jax.Array) -> jax.Array:
    """One uniform draw in [0, 1) per typed PRNG key: ``f32[keys.shape]``."""
    flat_keys = keys.reshape(-1)
    u = jax.vmap(lambda key: jax.random.uniform(key, (), jnp.float32))(flat_keys)
    return u.reshape(keys.shape)


def uniform_draws(seed: jax.Array, positions: jax.Array, purpose,
                  seed_hi: jax.Array | None = None) -> jax.Array:
    """``f32[...]`` in [0, 1), one per (request, position, purpose); see :func:`request_keys`.

    Call it once per jitted function with every (position, purpose) needed: each call site
    compiles its own hash.
    """
    return uniform_from_keys(request_keys(seed, positions, purpose, seed_hi))


def sample_from_probs(probs: jax.Array, u: jax.Array) -> jax.Array:
    """Inverse-CDF sampling of ``i32[...]`` from ``probs f32[..., V]`` (unnormalised) and ``u``.

    ``u`` (``f32[...]``) must be in [0, 1).

    Returns the first token whose cumulative mass exceeds ``u * total``, restricted to tokens with
    positive mass, so a zero-probability token is never returned, also for ``u == 0`` (and rounding
    in the cumulative sum cannot select one). If ``total == 0`` the argmax (token 0) is returned.
    """
    probs = jnp.maximum(probs, 0.0)
    cumulative = jnp.cumsum(probs, axis=-1)
    total = cumulative[..., -1]
    threshold = (u * total)[..., None]
    positive = probs > 0
    past_threshold = (cumulative > threshold) & positive
    V = probs.shape[-1]
    # first / last True index as integer min / max reductions: XLA:CPU vectorises those, not the
    # (value, index) reduction of jnp.argmax (see vocab_argmax), and a vocabulary sharded over a
    # mesh axis reduces them with one all-reduce
    index = jax.lax.broadcasted_iota(jnp.int32, probs.shape, probs.ndim - 1)
    first_past = jnp.min(jnp.where(past_threshold, index, V), axis=-1)
    last_positive = jnp.max(jnp.where(positive, index, -1), axis=-1)
    token = jnp.where(first_past < V, first_past, last_positive)
    return jnp.where(total > 0, token, vocab_argmax(probs)).astype(jnp.int32)
