"""n-gram (prompt-lookup) drafting on device: FastDeploy's ``ngram_match`` op (its pure n-gram
proposer, ``NgramProposer``) and ``hybrid_mtp_ngram`` op (``mtp_strategy="with_ngram"``) as one
pure, vectorised jnp function.

Rule, per slot ``b`` with history ``h = ids[b, :length[b]]`` (prompt followed by generated tokens,
for the hybrid also followed by the MTP drafts):

* for ``n = max_n`` down to ``min_n``: the pattern is the last ``n`` tokens ``h[L-n:L]``; a match
  is an earlier occurrence ``h[i:i+n] == pattern`` with ``i + n < L`` (at least one token follows
  it, so the pattern never matches itself);
* the first ``n`` with any match wins, and among its matches the one that **starts earliest**
  (FastDeploy scans the prompt left to right, then the generated history left to right, and stops
  at the first hit: the earliest start position);
* the drafts are the tokens following the match, ``h[i+n : min(i+n+budget, L)]``.

Deliberate deviations from FastDeploy, each for a reason:

* prompt and generated tokens form one history, so a match may straddle the prompt's end and the
  copied tokens may run from the prompt into the generated tokens (FastDeploy scans the two
  buffers separately and never finds such a match; no reason to miss it);
* the pattern may include prompt tokens: FastDeploy skips ``n > step_idx``; here only
  ``n > L - 1`` is skipped, so right after the prefill the prompt's last tokens already match;
* the pure n-gram method really reads the prompt (FastDeploy's runner never fills the pure
  proposer's prompt buffer, so it matches generated tokens only);
* ``min_n`` is honoured by the pure method too (FastDeploy's pure proposer always goes down to 1;
  jmtp's default ``min_ngram_size`` for it is 1, so the default behaviour is the same);
* no token-budget throttle (FastDeploy's ``INFER_WITH_REFERENCE_TOKENUM_THRESHOLD``): the draft
  limits come from ``allowed`` / the dynamic speculation policy instead.

Cost: ``max_n`` elementwise compares over ``[B, Lbuf]`` plus one argmax per n; no gather of the
history beyond the pattern and the ``budget`` copied tokens.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def ngram_match(ids: jax.Array, length: jax.Array, budget: jax.Array, max_n: int, min_n: int,
                num_out: int) -> tuple[jax.Array, jax.Array]:
    """Propose up to ``budget`` drafts per slot by n-gram lookup in the slot's own history.

    Args:
      ids: i32[B, S] token buffer; positions ``[0, length)`` hold the history, the rest is ignored.
      length: i32[B] history length L (0 or 1: no match possible).
      budget: i32[B] drafts wanted per slot (clipped to ``[0, num_out]``).
      max_n, min_n: static n-gram sizes tried, longest first, ``1 <= min_n <= max_n``.
      num_out: static K, the width of the result.

    Returns:
      ``(drafts i32[B, K], count i32[B])``: the tokens following the winning match, ``-1`` past
      ``count`` (``count = 0`` when no n-gram matches or the budget is 0).

    Raises:
      ValueError: ``min_n``/``max_n`` out of order or below 1, or ``ids`` not 2-D.
    """
    if not 1 <= min_n <= max_n:
        raise ValueError(f"ngram_match: need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
    if ids.ndim != 2:
        raise ValueError(f"ngram_match: ids must be i32[B, S], got shape {ids.shape}")
    B, S = ids.shape
    length = length.astype(jnp.int32)
    e = jnp.arange(S, dtype=jnp.int32)[None, :]                       # candidate match END index
    # run[b, e] = j-th compare still equal for j < run: h[e - j] == h[L - 1 - j].
    still = jnp.ones((B, S), bool)
    found = jnp.zeros((B,), bool)
    best_end = jnp.zeros((B,), jnp.int32)
    best_n = jnp.zeros((B,), jnp.int32)
    matches = []
    for j in range(max_n):
        tail = jnp.take_along_axis(ids, jnp.clip(length - 1 - j, 0, S - 1)[:, None], axis=1)
        shifted = jnp.roll(ids, j, axis=1)                            # shifted[e] = ids[e - j]
        still = still & (shifted == tail) & (e - j >= 0)
        matches.append(still)
    for n in range(max_n, min_n - 1, -1):
        # Match h[e-n+1 .. e] with a following token (e <= L - 2), pattern of n tokens (n <= L - 1).
        cand = matches[n - 1] & (e <= length[:, None] - 2) & (n <= length[:, None] - 1)
        hit = jnp.any(cand, axis=1)
        end = jnp.argmax(cand, axis=1).astype(jnp.int32)              # earliest end = earliest start
        take = hit & ~found
        best_end = jnp.where(take, end, best_end)
        best_n = jnp.where(take, n, best_n)
        found = found | hit
    k = jnp.arange(num_out, dtype=jnp.int32)[None, :]
    src = best_end[:, None] + 1 + k
    budget = jnp.clip(budget.astype(jnp.int32), 0, num_out)
    count = jnp.where(found, jnp.minimum(budget, length - 1 - best_end), 0)
    drafts = jnp.take_along_axis(ids, jnp.clip(src, 0, S - 1), axis=1)
    drafts = jnp.where(k < count[:, None], drafts, -1).astype(jnp.int32)
    return drafts, count.astype(jnp.int32)


def extend_with_ngram(ids: jax.Array, length: jax.Array, drafts: jax.Array, allowed: jax.Array,
                      max_n: int, min_n: int) -> jax.Array:
    """Hybrid MTP + n-gram (``hybrid_mtp_ngram``): extend each slot's draft prefix up to
    ``allowed`` tokens with the tokens following an n-gram match of history + drafts.

    Args:
      ids: i32[B, S] token buffer, history in ``[0, length)``; ``S >= length + K`` for every slot.
      length: i32[B] committed history length.
      drafts: i32[B, K] the MTP drafts (a prefix; -1 past it).
      allowed: i32[B] total drafts allowed per slot (<= K).
      max_n, min_n: static n-gram sizes.

    Returns:
      i32[B, K]: the MTP drafts, then the n-gram tokens, ``-1`` past ``allowed``.
    """
    B, K = drafts.shape
    m = jnp.sum(jnp.cumprod((drafts >= 0).astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)
    k = jnp.arange(K, dtype=jnp.int32)[None, :]
    pos = jnp.where(k < m[:, None], length[:, None] + k, ids.shape[1])
    ext = ids.at[jnp.arange(B)[:, None], pos].set(drafts, mode="drop")
    more, count = ngram_match(ext, length + m, jnp.maximum(allowed - m, 0), max_n, min_n, K)
    # Place the n-gram tokens right after the m MTP drafts.
    src = jnp.clip(k - m[:, None], 0, K - 1)
    shifted = jnp.take_along_axis(more, src, axis=1)
    out = jnp.where(k < m[:, None], drafts, jnp.where(k < (m + count)[:, None], shifted, -1))
    return out.astype(jnp.int32)
