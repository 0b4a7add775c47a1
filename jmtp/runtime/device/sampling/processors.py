"""Logits processors: penalties, stop / bad-word masks and the filters that give the target
distribution.

This module turns raw target logits into the distribution a slot samples from, one row per output
position, with the slot's :class:`~jmtp.runtime.device.sampling.arrays.SamplingArrays` as data. The
order follows vLLM's V1 sampler (see :func:`penalize` and :func:`target_probs`):

0. **logit_bias** (OpenAI's): each slot's biases added to their tokens' logits (:func:`logit_bias`;
   the drafter's logits get them too);
1. **repetition penalty** over prompt ∪ generated tokens (HF ``RepetitionPenaltyLogitsProcessor``:
   ``logit / α`` if ``logit > 0`` else ``logit * α``);
2. **frequency / presence penalties** over generated tokens only (OpenAI / vLLM:
   ``logit -= frequency * count + presence * (count > 0)``). Penalties *saturate*
   (:func:`saturate`): a finite logit stays finite whatever ``α`` (``α`` may be as large as the
   float32 maximum, or so small that the CPU flushes it to 0), and a ``-inf`` one (a token a
   structured-output mask removed) stays ``-inf``: an overflow to ``-inf`` could leave a row with
   no finite logit, and ``-inf * 0`` is NaN, which argmax picks;
3. **min_tokens**: while ``num_generated + w < min_tokens`` the slot's stop ids (``stop_token_ids``
   ∪ the EOS ids unless ``ignore_eos``) get ``-inf`` (vLLM ``MinTokensLogitsProcessor``);
4. **bad words**: single-token bad words (``bad_token_mask``) and multi-token ones (the last token
   of a sequence whose prefix equals the most recent tokens; HF ``NoBadWordsLogitsProcessor``,
   the history *includes* the prompt) get ``-inf``.
   The result is the *penalized* logits: greedy rows take their argmax and, by default, logprobs are
   computed from them.
5. **temperature** (saturating likewise; ``temperature < GREEDY_EPS`` = greedy: argmax of the penalized logits, no
   randomness consumed), then **min-p** (keep ``p >= min_p * max p``), **top-k** (keep logits
   ``>=`` the k-th largest: ties at the boundary are kept), **top-p** (on the top-k-renormalised
   distribution, keep the smallest prefix of the descending, index-stable order whose mass reaches
   ``top_p``), then softmax → the target distribution ``p``.

In speculative verification, row ``w`` of a window sees the history *including the drafts*
``d_1..d_w`` before it, so the processed distribution equals the one non-speculative decoding would
use at that position (see :func:`penalize`).

Notation kept from the description above: ``z`` = temperature-scaled logits, ``p`` = a
probability row, ``k`` = the top-k count, ``w`` = the window row, ``B, W, K, V`` = shapes.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jmtp.runtime.device.sampling.arrays import GREEDY_EPS, SamplingArrays
from jmtp.runtime.device.sharding import model_axis_size, uniform_any


#: Largest finite float32: where penalties and temperature saturate.
FLOAT32_MAX = float(jnp.finfo(jnp.float32).max)


def saturate(values: jax.Array, logits: jax.Array) -> jax.Array:
    """``values`` (computed from ``logits``, same shape) clipped to ``[-FLOAT32_MAX,
    FLOAT32_MAX]`` where ``logits`` is finite, and ``logits`` itself elsewhere (``-inf``: a
    masked token; NaN stays NaN). Keeps the logits processors from turning a finite logit into
    ``±inf`` (overflow) or NaN (``-inf * 0``)."""
    return jnp.where(jnp.isfinite(logits), jnp.clip(values, -FLOAT32_MAX, FLOAT32_MAX), logits)


def stop_mask(sampling: SamplingArrays, eos_token_ids: jax.Array) -> jax.Array:
    """``bool[B, V]``: ids that stop the slot's request: its stop ids, plus ``eos_token_ids``
    (``i32[E]``, -1 entries ignored) unless ``ignore_eos``."""
    B, V = sampling.bad_token_mask.shape
    slots = jnp.arange(B)[:, None]
    stop_ids = sampling.stop_token_ids
    mask = jnp.zeros((B, V), bool).at[slots, jnp.where(stop_ids >= 0, stop_ids, V)].set(
        True, mode="drop")
    eos_ids = jnp.asarray(eos_token_ids, jnp.int32).reshape(-1)
    eos_mask = jnp.zeros((V,), bool).at[jnp.where(eos_ids >= 0, eos_ids, V)].set(True, mode="drop")
    return mask | (eos_mask[None, :] & ~sampling.ignore_eos[:, None])


def window_history(sampling: SamplingArrays, draft_tokens: jax.Array, num_drafts: jax.Array):
    """Generated-token counts seen by each window row: ``i32[B, K+1, V]``.

    Row ``w`` counts ``output_counts`` plus the drafts ``d_1..d_w`` (``draft_tokens[:, :w]``, only
    those below ``num_drafts``). Written as K elementwise terms (no one-hot / cumsum buffer), so
    XLA fuses it into the penalty computation.
    """
    B, K = draft_tokens.shape
    V = sampling.vocab_size
    vocab = jnp.arange(V, dtype=jnp.int32)[None, None, :]
    window_row = jnp.arange(K + 1, dtype=jnp.int32)[None, :, None]
    counts = jnp.broadcast_to(sampling.output_counts[:, None, :], (B, K + 1, V))
    for draft_idx in range(K):
        counted = ((window_row > draft_idx) & (draft_idx < num_drafts)[:, None, None]
                   & (vocab == draft_tokens[:, draft_idx, None, None]))
        counts = counts + counted.astype(jnp.int32)
    return counts


def _bad_word_ban(sampling: SamplingArrays, draft_tokens: jax.Array) -> jax.Array:
    """``bool[B, K+1, V]``: last tokens of multi-token bad words whose prefix matches the context
    (the last ``LW-1`` tokens of prompt + output + the drafts before the row)."""
    B, K = draft_tokens.shape
    V = sampling.vocab_size
    NW, LW = sampling.bad_word_seqs.shape[1:]
    if NW == 0 or LW < 2:
        return jnp.zeros((B, K + 1, V), bool)
    prefix_len = LW - 1
    context = jnp.concatenate([sampling.recent_tokens, draft_tokens], axis=1)  # [B, LW-1+K]
    window_idx = jnp.arange(K + 1)[:, None] + jnp.arange(prefix_len)[None, :]  # [K+1, LW-1]
    windows = context[:, window_idx]                                         # [B, K+1, LW-1]
    prefixes = sampling.bad_word_seqs[:, :, :prefix_len]                     # [B, NW, LW-1]
    last_tokens = sampling.bad_word_seqs[:, :, prefix_len]                   # [B, NW]
    prefix_ok = (prefixes[:, None] == -1) | (prefixes[:, None] == windows[:, :, None])
    matched = jnp.all(prefix_ok, axis=-1) & (last_tokens >= 0)[:, None, :]   # [B, K+1, NW]
    vocab = jnp.arange(V, dtype=jnp.int32)[None, None, :]
    ban = jnp.zeros((B, K + 1, V), bool)
    for word in range(NW):
        ban = ban | (matched[:, :, word, None] & (vocab == last_tokens[:, word, None, None]))
    return ban


def logit_bias(logits: jax.Array, sampling: SamplingArrays,
               vocab_ids: jax.Array | None = None) -> jax.Array:
    """``logits f[B, ..., N]`` plus each slot's ``logit_bias`` (OpenAI: "added to the logits
    generated by the model prior to sampling"), as ``f32``; skipped (``lax.cond``) when no slot
    has one. ``vocab_ids i32[N]``: the full-vocabulary id of each column (a draft vocabulary,
    FR-Spec); None: the columns are the vocabulary."""
    logits = logits.astype(jnp.float32)
    ids, values = sampling.logit_bias_ids, sampling.logit_bias_values        # [B, NB]
    if ids.shape[1] == 0:
        return logits
    B, V = ids.shape[0], sampling.vocab_size

    def add(x):
        dense = jnp.zeros((B, V), jnp.float32).at[jnp.arange(B)[:, None],
                                                  jnp.where(ids >= 0, ids, V)].add(
            values, mode="drop")
        if vocab_ids is not None:
            dense = dense[:, vocab_ids]
        return x + dense.reshape((B,) + (1,) * (x.ndim - 2) + (x.shape[-1],))

    return jax.lax.cond(uniform_any(ids >= 0), add, lambda x: x, logits)


def penalize(logits: jax.Array, sampling: SamplingArrays, draft_tokens: jax.Array,
             num_drafts: jax.Array, num_generated: jax.Array,
             eos_token_ids: jax.Array) -> jax.Array:
    """Penalties, min_tokens and bad words for every row of a verify window.

    Args:
      logits: f[B, W, V] target logits; row ``w`` = distribution after input ``w`` (W = K+1).
      sampling: :class:`SamplingArrays` of the B slots.
      draft_tokens: i32[B, K] drafts d_1..d_K (entries at or past ``num_drafts`` are ignored).
      num_drafts: i32[B]. num_generated: i32[B] tokens generated before this step.
      eos_token_ids: i32[E] model EOS ids (-1 entries ignored).
    Returns:
      f32[B, W, V] penalized logits (``-inf`` for masked ids). Row ``w`` uses the history
      prompt ∪ generated ∪ {d_1..d_w} and the min_tokens test ``num_generated + w < min_tokens``.
      The slot's ``logit_bias`` is added first (:func:`logit_bias`; vLLM applies it before the
      penalties).
    """
    logits = logit_bias(logits, sampling)
    B, W, V = logits.shape
    K = W - 1
    if draft_tokens.shape != (B, K):
        raise ValueError(f"draft_tokens: shape {draft_tokens.shape} != (B, K) = {(B, K)}")
    num_drafts = jnp.clip(num_drafts.astype(jnp.int32), 0, K)

    def apply_penalties(logits):
        counts = window_history(sampling, draft_tokens.astype(jnp.int32), num_drafts)  # [B,W,V]
        seen = counts > 0
        rep_penalty = sampling.repetition_penalty[:, None, None]
        in_history = seen | sampling.prompt_mask[:, None, :]
        rep_penalized = jnp.where(logits > 0, logits / rep_penalty, logits * rep_penalty)
        penalized = jnp.where(in_history, rep_penalized, logits)
        return saturate(penalized
                        - sampling.frequency_penalty[:, None, None] * counts.astype(jnp.float32)
                        - sampling.presence_penalty[:, None, None] * seen.astype(jnp.float32),
                        logits)

    # Skipped at run time when no row has a penalty (the result would equal the logits exactly:
    # x / 1, x * 1 and x - 0 are exact), which saves the [B, W, V] history counts.
    any_penalty = uniform_any((sampling.repetition_penalty != 1.0)
                              | (sampling.frequency_penalty != 0.0)
                              | (sampling.presence_penalty != 0.0))
    penalized = jax.lax.cond(any_penalty, apply_penalties, lambda x: x, logits)
    w = jnp.arange(W, dtype=jnp.int32)[None, :]
    too_early = (num_generated.astype(jnp.int32)[:, None] + w) < sampling.min_tokens[:, None]
    ban = (too_early[:, :, None] & stop_mask(sampling, eos_token_ids)[:, None, :])
    ban = ban | sampling.bad_token_mask[:, None, :] | _bad_word_ban(sampling, draft_tokens)
    return jnp.where(ban, -jnp.inf, penalized)


#: Smallest last-axis length :func:`vocab_argmax` splits into blocks (shorter rows: one argmax).
ARGMAX_SPLIT_MIN = 4096


def _argmax_block(n: int) -> int:
    """Block length of :func:`vocab_argmax` for rows of ``n`` entries: the largest divisor of
    ``n`` in [64, 1024] (0: none, the row is padded to a multiple of 512)."""
    for b in range(1024, 63, -1):
        if n % b == 0:
            return b
    return 0


def vocab_argmax(x: jax.Array) -> jax.Array:
    """``jnp.argmax(x, axis=-1)`` as ``i32[...]`` for long rows (a vocabulary): the same index
    (the first among ties; a NaN counts as the maximum, its first occurrence wins), computed in
    two levels: the maximum of each block of ~512-1024 entries, the first block holding the row's
    maximum, then the first maximum inside that block.

    XLA:CPU lowers ``jnp.argmax`` to a (value, index) reduction that it does not vectorise: over
    SmolLM2's 49,152 logits it takes 0.25 ms for one row, 1.04 ms for 8 and 3.90 ms for 32, where
    the two-level form takes 0.11 / 0.23 / 0.56 ms (a plain ``max`` reduction vectorises; the
    index search then touches one block per row). Rows shorter than :data:`ARGMAX_SPLIT_MIN`,
    non-float arrays, other backends than XLA:CPU (not measured there; GPU's and TPU's argmax
    reductions are parallel) and a vocabulary sharded over a tensor-parallel mesh axis (the
    blocks would need an all-gather of the logits) use ``jnp.argmax`` directly; so does a batch
    in which some row holds ``+inf`` or NaN (``lax.cond``), where the block maxima cannot tell
    the first NaN.

    Args:
      x: f[..., V] (V >= 1).
    Returns:
      i32[...]: per row, the index of its maximum.
    """
    n = x.shape[-1]
    if (n < ARGMAX_SPLIT_MIN or not jnp.issubdtype(x.dtype, jnp.floating)
            or model_axis_size() > 1):
        return jnp.argmax(x, axis=-1).astype(jnp.int32)
    # The two-level form helps XLA:CPU only: chosen when XLA lowers for CPU, so a program
    # compiled for TPU/GPU (even from a CPU host, jmtp.aot) keeps the plain argmax.
    return jax.lax.platform_dependent(
        x, cpu=_two_level_argmax, default=lambda x: jnp.argmax(x, axis=-1).astype(jnp.int32))


def _two_level_argmax(x: jax.Array) -> jax.Array:
    """:func:`vocab_argmax` for XLA:CPU (same result): block maxima, then the winning block."""
    n = x.shape[-1]
    b = _argmax_block(n)
    if b == 0:   # no divisor in range: pad with -inf, which never beats a real entry
        b = 512
        pad = [(0, 0)] * (x.ndim - 1) + [(0, -n % b)]
        x = jnp.pad(x, pad, constant_values=-jnp.inf)
    blocks = x.reshape(x.shape[:-1] + (x.shape[-1] // b, b))
    # XLA:CPU's vectorised max may drop a NaN: count it as +inf in the block maxima
    block_max = jnp.max(jnp.where(jnp.isnan(blocks), jnp.inf, blocks), axis=-1)  # [..., nb]

    def two_level(_):
        first = jnp.argmax(block_max, axis=-1)                                   # i[...]
        inside = jnp.take_along_axis(blocks, first[..., None, None], axis=-2)[..., 0, :]
        return (first * b + jnp.argmax(inside, axis=-1)).astype(jnp.int32)

    # A row holding +inf or NaN (a NaN must win over an earlier +inf): the exact argmax. Never
    # taken for finite logits (-inf entries, i.e. masked tokens, are fine).
    return jax.lax.cond(uniform_any(block_max == jnp.inf),
                        lambda _: jnp.argmax(x, axis=-1).astype(jnp.int32), two_level, None)


def safe_softmax(z: jax.Array) -> jax.Array:
    """Softmax over the last axis that gives an all-zero row (not NaN) when every entry is
    ``-inf``; callers test ``sum > 0`` to detect such a row."""
    row_max = jnp.max(z, axis=-1, keepdims=True)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    exp = jnp.exp(z - row_max)
    total = jnp.sum(exp, axis=-1, keepdims=True)
    return exp / jnp.where(total > 0, total, 1.0)


#: Up to this vocabulary size :func:`filter_logits` ranks by pairwise comparison instead of sorting.
PAIRWISE_MAX_V = 16


def _rank_filter(z, k, top_p):
    """top-k / top-p keep-mask from stable descending ranks computed pairwise (O(V^2), unrolled
    over V: only for tiny vocabularies, where it is much faster than a sort on CPU)."""
    V = z.shape[-1]
    token_ids = jnp.arange(V)[None, :]

    def ranks_before(j):                # does id j rank before each id i?
        z_j = z[:, j:j + 1]
        return (z_j > z) | ((z_j == z) & (j < token_ids))

    rank = sum(ranks_before(j).astype(jnp.int32) for j in range(V))                  # [N, V]
    kth_value = jnp.max(jnp.where(rank == (k - 1)[:, None], z, -jnp.inf), axis=-1, keepdims=True)
    keep_top_k = z >= kth_value
    p = safe_softmax(jnp.where(keep_top_k, z, -jnp.inf))
    mass_before = sum(jnp.where(ranks_before(j), p[:, j:j + 1], 0.0) for j in range(V))
    return keep_top_k & ((mass_before < top_p[:, None]) | (top_p[:, None] >= 1.0))


def _sort_filter(z, k, top_p):
    """Same keep-mask as :func:`_rank_filter` through one stable sort (large V)."""
    N, V = z.shape
    order = jnp.argsort(-z, axis=-1, stable=True)
    z_sorted = jnp.take_along_axis(z, order, axis=-1)
    kth_value = jnp.take_along_axis(z_sorted, (k - 1)[:, None], axis=-1)
    keep_top_k = z_sorted >= kth_value
    p_sorted = safe_softmax(jnp.where(keep_top_k, z_sorted, -jnp.inf))
    mass_before = jnp.concatenate(
        [jnp.zeros((N, 1), p_sorted.dtype), jnp.cumsum(p_sorted, axis=-1)[:, :-1]], -1)
    keep_sorted = keep_top_k & ((mass_before < top_p[:, None]) | (top_p[:, None] >= 1.0))
    # the kept ids are a prefix of the sorted order: map back through its last element
    num_kept = jnp.maximum(jnp.sum(keep_sorted, axis=-1), 1)[:, None]
    last_kept_value = jnp.take_along_axis(z_sorted, num_kept - 1, axis=-1)
    last_kept_id = jnp.take_along_axis(order, num_kept - 1, axis=-1)
    return (z > last_kept_value) | ((z == last_kept_value)
                                    & (jnp.arange(V)[None, :] <= last_kept_id))


def filter_logits(z: jax.Array, top_k: jax.Array, top_p: jax.Array, min_p: jax.Array,
                  method: str = "auto") -> jax.Array:
    """min-p, then top-k, then top-p on temperature-scaled logits ``z f32[N, V]`` (params ``[N]``).

    Returns ``z`` with removed ids set to ``-inf``. min-p removes ids with ``p < min_p * max p``.
    top-k keeps every id ``>=`` the k-th largest value (0 = off; ties at the k-th value are kept).
    top-p keeps, in the descending order with ties broken by lower id, each id whose preceding
    mass (after top-k renormalisation) is ``< top_p`` (``top_p >= 1`` = off): the smallest prefix
    reaching ``top_p``. All of it is skipped (``lax.cond``) when no row uses min-p, top-k or top-p.

    ``method`` (static): ``"sort"`` (one stable sort), ``"pairwise"`` (O(V^2) ranks, faster for
    tiny vocabularies) or ``"auto"`` (pairwise when ``V <= PAIRWISE_MAX_V``); same result.
    """
    N, V = z.shape
    if method not in ("auto", "sort", "pairwise"):
        raise ValueError(f"method={method!r}: must be 'auto', 'sort' or 'pairwise'")
    pairwise = method == "pairwise" or (method == "auto" and V <= PAIRWISE_MAX_V)
    k = jnp.where((top_k > 0) & (top_k < V), top_k, V).astype(jnp.int32)     # V = top-k off
    any_row_filters = uniform_any((k < V) | (top_p < 1.0) | (min_p > 0.0))

    def apply_filters(z):
        z = jnp.where(z == 0, 0.0, z)      # -0.0 == +0.0 must also tie in the sort order
        p = safe_softmax(z)
        z = jnp.where(p < min_p[:, None] * jnp.max(p, axis=-1, keepdims=True), -jnp.inf, z)
        keep = (_rank_filter if pairwise else _sort_filter)(z, k, top_p)
        return jnp.where(keep, z, -jnp.inf)

    return jax.lax.cond(any_row_filters, apply_filters, lambda z: z, z)


def target_probs(penalized: jax.Array, sampling: SamplingArrays) -> jax.Array:
    """The target distribution ``p f32[B, W, V]`` from penalized logits ``f32[B, W, V]``.

    Sampled rows: softmax of the temperature-scaled logits after min-p, top-k and top-p. Greedy rows
    (``temperature < GREEDY_EPS``): one-hot of the argmax of the penalized logits.
    """
    B, W, V = penalized.shape
    greedy = sampling.temperature < GREEDY_EPS
    temperature = jnp.where(greedy, 1.0, sampling.temperature)
    z = saturate(penalized / temperature[:, None, None], penalized)
    repeat_per_window_row = lambda a: jnp.repeat(a, W)  # noqa: E731  params for the [B*W] rows
    z_filtered = filter_logits(
        z.reshape(B * W, V), repeat_per_window_row(sampling.top_k),
        repeat_per_window_row(sampling.top_p),
        repeat_per_window_row(sampling.min_p)).reshape(B, W, V)
    p = safe_softmax(z_filtered)
    argmax_one_hot = jax.nn.one_hot(vocab_argmax(penalized), V, dtype=jnp.float32)
    has_mass = jnp.sum(p, axis=-1, keepdims=True) > 0
    p = jnp.where(has_mass, p, argmax_one_hot)
    return jnp.where(greedy[:, None, None], argmax_one_hot, p)
