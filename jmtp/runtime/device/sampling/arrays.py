"""Per-slot sampling state: the :class:`SamplingArrays` pytree (the host fills it:
:mod:`jmtp.runtime.host.sampling_rows`).

:class:`SamplingArrays` holds every request's
:class:`~jmtp.runtime.host.sampling_params.SamplingParams` as fixed-shape per-slot arrays
(leading dim ``B`` = batch slots), plus per-slot history (prompt-token mask, counts of generated tokens, the
last few tokens for multi-token bad words). Sampling parameters are *data*: a jitted step never
recompiles when a value changes. Idle / padding slots hold neutral values (greedy, no penalties,
nothing banned) and :func:`set_slot` / :func:`clear_slot` rewrite *every* array of a slot, so
nothing leaks from a previous occupant or from padding into real rows.
:func:`~jmtp.runtime.host.sampling_rows.make_row` builds one slot's values on the host,
:func:`~jmtp.runtime.host.sampling_rows.pack_sampling` a whole batch, and :func:`update_history`
adds the tokens a step emitted.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

#: Rows with ``temperature < GREEDY_EPS`` are greedy (vLLM's ``_SAMPLING_EPS``); the device
#: processors and :meth:`SamplingParams.is_greedy <jmtp.runtime.host.sampling_params.SamplingParams.is_greedy>`
#: read the same constant.
GREEDY_EPS = 1e-5


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingArrays:
    """Per-slot sampling state (a pytree; every field is data). ``B`` slots, vocabulary ``V``.

    Attributes:
      temperature: f32[B] (0 = greedy).  top_p: f32[B].  top_k: i32[B] (0 = off).  min_p: f32[B].
      repetition_penalty, frequency_penalty, presence_penalty: f32[B].
      min_tokens: i32[B].  ignore_eos: bool[B].
      stop_token_ids: i32[B, S] stop ids of the slot (-1 padded); includes the per-request EOS ids
        given to :func:`set_slot` unless ``ignore_eos``.
      bad_token_mask: bool[B, V] single-token bad words / ``bad_token_ids``.
      bad_word_seqs: i32[B, NW, LW] multi-token bad words, right-aligned, -1 left padding.
      recent_tokens: i32[B, LW-1] the last ``LW-1`` tokens of prompt + output (-1 where the history
        is shorter), for multi-token bad words.
      seed: u32[B] the low 32 bits of the request's RNG seed, seed_hi: u32[B] the high 32 bits
        (0 for seeds in [0, 2**32); see :func:`jmtp.runtime.device.sampling.rng.request_keys`).
      logit_bias_ids: i32[B, NB] token ids of the slot's ``logit_bias`` (-1 padded);
        logit_bias_values: f32[B, NB] their biases, added to the logits before penalties.
      rng_offset: i32[B] tokens the request generated before its current admission (non-zero
        after a preemption): added to the per-admission ``step_idx`` to give the output position
        of every random draw, so a re-admitted request continues its random stream.
      prompt_mask: bool[B, V] token occurs in the prompt (repetition penalty).
      output_counts: i32[B, V] occurrences of each token among the generated tokens.
      logprobs: i32[B] requested number of top logprobs (-1 = none); informational for the engine.
      prompt_logprobs: i32[B] requested top prompt logprobs (-1 = none): the step computes
        prompt logprobs while such a slot prefills (:mod:`jmtp.runtime.device.prompt_logprobs`).
    """

    temperature: jax.Array
    top_p: jax.Array
    top_k: jax.Array
    min_p: jax.Array
    repetition_penalty: jax.Array
    frequency_penalty: jax.Array
    presence_penalty: jax.Array
    min_tokens: jax.Array
    ignore_eos: jax.Array
    stop_token_ids: jax.Array
    bad_token_mask: jax.Array
    bad_word_seqs: jax.Array
    recent_tokens: jax.Array
    seed: jax.Array
    seed_hi: jax.Array
    logit_bias_ids: jax.Array
    logit_bias_values: jax.Array
    rng_offset: jax.Array
    prompt_mask: jax.Array
    output_counts: jax.Array
    logprobs: jax.Array
    prompt_logprobs: jax.Array

    @property
    def batch_size(self) -> int:
        return self.temperature.shape[0]

    @property
    def vocab_size(self) -> int:
        return self.bad_token_mask.shape[-1]

    @staticmethod
    def empty(batch_size: int, vocab_size: int, max_stop: int = 4, max_bad_words: int = 0,
              max_bad_word_len: int = 1, max_logit_bias: int = 0, *,
              as_numpy: bool = False) -> "SamplingArrays":
        """All-neutral arrays for ``batch_size`` slots (greedy, no penalties, nothing banned).

        Args:
          batch_size, vocab_size: B, V >= 1.
          max_stop: S >= 1, capacity for stop ids (+ per-request EOS ids) per slot.
          max_bad_words: NW >= 0, capacity for multi-token bad words per slot.
          max_bad_word_len: LW >= 1, longest multi-token bad word.
          max_logit_bias: NB >= 0, capacity for ``logit_bias`` entries per slot.
          as_numpy: return numpy arrays (host-side packing) instead of jax arrays.
        Raises:
          ValueError naming the argument when a size is out of range.
        """
        for name, value, minimum in (("batch_size", batch_size, 1), ("vocab_size", vocab_size, 1),
                                     ("max_stop", max_stop, 1), ("max_bad_words", max_bad_words, 0),
                                     ("max_bad_word_len", max_bad_word_len, 1),
                                     ("max_logit_bias", max_logit_bias, 0)):
            if int(value) < minimum:
                raise ValueError(f"SamplingArrays.empty: {name}={value} must be >= {minimum}")
        B, V = int(batch_size), int(vocab_size)
        row = neutral_row(V, max_stop, max_bad_words, max_bad_word_len, max_logit_bias)
        fields = {name: np.repeat(value[None], B, axis=0) for name, value in row.items()}
        arrays = SamplingArrays(**fields)
        return arrays if as_numpy else jax.tree.map(jnp.asarray, arrays)


def neutral_row(V: int, S: int, NW: int, LW: int, NB: int = 0) -> dict[str, np.ndarray]:
    """One idle slot's values; ``V, S, NW, LW, NB`` as in :class:`SamplingArrays`."""
    return dict(
        temperature=np.float32(0.0), top_p=np.float32(1.0), top_k=np.int32(0),
        min_p=np.float32(0.0), repetition_penalty=np.float32(1.0),
        frequency_penalty=np.float32(0.0), presence_penalty=np.float32(0.0),
        min_tokens=np.int32(0), ignore_eos=np.bool_(False),
        stop_token_ids=np.full((S,), -1, np.int32), bad_token_mask=np.zeros((V,), bool),
        bad_word_seqs=np.full((NW, LW), -1, np.int32),
        recent_tokens=np.full((LW - 1,), -1, np.int32),
        seed=np.uint32(0), seed_hi=np.uint32(0), logit_bias_ids=np.full((NB,), -1, np.int32),
        logit_bias_values=np.zeros((NB,), np.float32), rng_offset=np.int32(0), prompt_mask=np.zeros((V,), bool),
        output_counts=np.zeros((V,), np.int32),
        logprobs=np.int32(-1), prompt_logprobs=np.int32(-1))


def update_history(sampling: SamplingArrays, accept_tokens: jax.Array,
                   accept_num: jax.Array) -> SamplingArrays:
    """Add emitted tokens to ``output_counts`` and ``recent_tokens``.

    Args:
      accept_tokens: i32[B, N] emitted tokens (entries at or past ``accept_num`` or < 0 ignored).
      accept_num: i32[B] tokens emitted per slot this step (0 = none).
    Returns:
      the updated :class:`SamplingArrays` (all other fields unchanged).
    """
    B, N = accept_tokens.shape
    V = sampling.vocab_size
    tokens = accept_tokens.astype(jnp.int32)
    num_emitted = jnp.clip(accept_num.astype(jnp.int32), 0, N)
    valid = (jnp.arange(N)[None, :] < num_emitted[:, None]) & (tokens >= 0) & (tokens < V)
    counts = sampling.output_counts.at[jnp.arange(B)[:, None], jnp.where(valid, tokens, V)].add(
        1, mode="drop")
    num_recent = sampling.recent_tokens.shape[1]                                # LW - 1
    recent = sampling.recent_tokens
    if num_recent > 0:
        history = jnp.concatenate([recent, jnp.where(valid, tokens, -1)], axis=1)  # [B, LW-1+N]
        keep_idx = num_emitted[:, None] + jnp.arange(num_recent)[None, :]
        recent = jnp.take_along_axis(history, keep_idx, axis=1)
    return dataclasses.replace(sampling, output_counts=counts, recent_tokens=recent)
