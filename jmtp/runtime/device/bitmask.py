"""The structured-output inputs of the jitted step: token bitmasks and draft overrides.

Both are data, so a batch with or without constrained requests runs the same compiled step:

* ``token_bitmask: i32[B, W, ceil(V/32)]``: row ``w`` of slot ``b`` allows token ``t`` iff bit
  ``t % 32`` of word ``t // 32`` is set (llguidance's and xgrammar's layout). All ones (-1) is
  "no constraint"; the step masks nothing, at run time, when every row is all ones.
* ``draft_override: i32[B, K]``: per window position, :data:`KEEP_DRAFT` (-2) keeps the
  proposer's draft, :data:`NO_DRAFT` (-1) cuts the window there, ``t >= 0`` makes ``t`` the draft
  with a one-hot draft distribution (a forced / jump-forward token). The host builds both
  (:mod:`jmtp.runtime.host.structured.grammar`); the sentinels and the row width live here, on the
  device side, and the host reads them from this module.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jmtp.runtime.device.sharding import uniform_any

#: Sentinels of the step's ``draft_override`` (``i32[B, K]``): keep the proposer's draft / no
#: draft at and past this position; a value ``>= 0`` is a forced draft with a one-hot q.
KEEP_DRAFT = -2
NO_DRAFT = -1


def bitmask_words(vocab_size: int) -> int:
    """Words of one token bitmask row: ``ceil(vocab_size / 32)`` (bit ``t % 32`` of word
    ``t // 32`` allows token ``t``)."""
    return (vocab_size + 31) // 32


__all__ = ["KEEP_DRAFT", "NO_DRAFT", "apply_token_bitmask", "bitmask_words", "neutral_inputs",
           "override_drafts", "unpack_bitmask"]


def unpack_bitmask(bitmask: jax.Array, vocab_size: int) -> jax.Array:
    """``bool[..., V]`` of ``bitmask i32[..., NW]`` (bit ``t % 32`` of word ``t // 32``)."""
    bits = jnp.right_shift(bitmask[..., :, None].astype(jnp.uint32),
                           jnp.arange(32, dtype=jnp.uint32)) & 1
    return bits.reshape(bitmask.shape[:-1] + (-1,))[..., :vocab_size].astype(bool)


def apply_token_bitmask(logits: jax.Array, bitmask: jax.Array | None) -> jax.Array:
    """``logits f[..., V]`` with ``-inf`` where ``bitmask i32[..., NW]`` clears the token's bit;
    the unpacking is skipped at run time when every word is -1 (no row constrained).

    Raises:
      ValueError: at trace time, if ``bitmask`` is not ``[..., ceil(V/32)]`` over the logits'
        leading shape.
    """
    if bitmask is None:
        return logits
    V = logits.shape[-1]
    want = logits.shape[:-1] + (bitmask_words(V),)
    if bitmask.shape != want:
        raise ValueError(f"token_bitmask: shape {bitmask.shape} != {want} (logits "
                         f"{logits.shape}, ceil(V/32) words per row)")

    def mask(x):
        return jnp.where(unpack_bitmask(bitmask, V), x, -jnp.inf).astype(x.dtype)

    return jax.lax.cond(uniform_any(bitmask != -1), mask, lambda x: x, logits)


def override_drafts(draft_tokens: jax.Array, draft_probs: jax.Array | None,
                    draft_override: jax.Array | None):
    """Apply the host's draft override to the pending windows.

    Args:
      draft_tokens: i32[B, K+1] ``[last token, d_1..d_K]`` (-1 past the drafts).
      draft_probs: f32[B, K, V] or None: the distribution each draft was sampled from.
      draft_override: i32[B, K] (module docstring) or None (nothing changes).

    Returns:
      ``(draft_tokens, draft_probs)``: forced positions hold their token with a one-hot
      distribution; a cut position and every one after it hold -1.
    """
    if draft_override is None or draft_tokens.shape[1] == 1:
        return draft_tokens, draft_probs
    drafts = draft_tokens[:, 1:]
    new = jnp.where(draft_override == KEEP_DRAFT, drafts, draft_override)
    cut = jnp.cumsum((new < 0).astype(jnp.int32), axis=1) > 0     # drafts stay a prefix
    new = jnp.where(cut, -1, new).astype(draft_tokens.dtype)
    if draft_probs is not None:
        forced = (draft_override >= 0) & ~cut
        one_hot = jax.nn.one_hot(jnp.maximum(new, 0), draft_probs.shape[-1],
                                 dtype=draft_probs.dtype)
        draft_probs = jnp.where(forced[..., None], one_hot, draft_probs)
    return draft_tokens.at[:, 1:].set(new), draft_probs


def neutral_inputs(batch: int, window: int, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Host arrays that constrain nothing: ``(i32[B, W, NW] all ones, i32[B, W-1] KEEP)``."""
    return (np.full((batch, window, bitmask_words(vocab_size)), -1, np.int32),
            np.full((batch, window - 1), KEEP_DRAFT, np.int32))
