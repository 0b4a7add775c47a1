"""Host side of the per-slot sampling arrays: a request's :class:`SamplingParams` as one row of
:class:`~jmtp.runtime.device.sampling.arrays.SamplingArrays` (numpy), and the helpers that write
rows into a whole ``SamplingArrays`` (:func:`set_slot`, :func:`clear_slot`, :func:`pack_sampling`).

The engine sends :func:`make_row`'s row to the device with the slot's insert
(:meth:`jmtp.runtime.device.runner.DeviceRunner.insert`); :func:`set_slot` / :func:`clear_slot` /
:func:`pack_sampling` build or rewrite whole arrays (tests, benchmarks, ahead-of-time compiles).
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jmtp.core.errors import InvalidRequestError
from jmtp.runtime.device.sampling.arrays import SamplingArrays, neutral_row
from jmtp.runtime.host.sampling_params import SamplingParams


def make_row(params: SamplingParams, prompt_ids: Sequence[int], vocab_size: int, *,
             max_stop: int, max_bad_words: int = 0, max_bad_word_len: int = 1,
             max_logit_bias: int = 0, eos_ids: Sequence[int] = (),
             request_seed: int | None = None,
             bad_words_ids: Sequence[Sequence[int]] = ()) -> dict[str, np.ndarray]:
    """Host-side (numpy) values of one slot for ``params`` (shapes of one row of SamplingArrays).

    Args:
      params: the request's :class:`SamplingParams`.
      prompt_ids: the prompt token ids (for the repetition penalty and multi-token bad words).
      vocab_size: V. max_stop, max_bad_words, max_bad_word_len, max_logit_bias: S, NW, LW, NB of
        the target arrays.
      eos_ids: per-request EOS ids, added to the slot's stop ids unless ``params.ignore_eos``.
      request_seed: used when ``params.seed`` is None; when both are None a random seed is drawn.
      bad_words_ids: ``params.bad_words`` tokenized by the engine; length-1 sequences are banned
        everywhere, longer ones go to ``bad_word_seqs``.
    Raises:
      ValueError naming the argument when an id is outside [0, V) or a capacity is exceeded.
    """
    V = int(vocab_size)
    row = neutral_row(V, max_stop, max_bad_words, max_bad_word_len, max_logit_bias)
    prompt = np.asarray(list(prompt_ids), dtype=np.int64).reshape(-1)
    if prompt.size and (prompt.min() < 0 or prompt.max() >= V):
        raise InvalidRequestError(f"prompt_ids: token ids must be in [0, {V})", "prompt")
    stops = list(dict.fromkeys(list(params.stop_token_ids)
                               + ([] if params.ignore_eos else [int(e) for e in eos_ids])))
    if any(token_id >= V or token_id < 0 for token_id in stops):
        raise InvalidRequestError(f"stop_token_ids / eos_ids: ids must be in [0, {V}), got {stops}",
                                  "stop_token_ids")
    if len(stops) > max_stop:
        raise InvalidRequestError(f"stop_token_ids: {len(stops)} stop ids (incl. EOS) exceed "
                                  f"max_stop={max_stop}", "stop_token_ids")
    if any(token_id >= V for token_id in params.bad_token_ids):
        raise InvalidRequestError(f"bad_token_ids: ids must be < vocab_size={V}", "bad_token_ids")
    multi_token_words = []
    row["bad_token_mask"][list(params.bad_token_ids)] = True
    for word in bad_words_ids:
        word = [int(token_id) for token_id in word]
        if not word or any(token_id < 0 or token_id >= V for token_id in word):
            raise InvalidRequestError(f"bad_words_ids: each sequence must be non-empty with ids in "
                                      f"[0, {V})", "bad_words")
        if len(word) == 1:
            row["bad_token_mask"][word[0]] = True
        else:
            multi_token_words.append(word)
    if len(multi_token_words) > max_bad_words:
        raise InvalidRequestError(f"bad_words_ids: {len(multi_token_words)} multi-token bad words "
                                  f"exceed max_bad_words={max_bad_words}", "bad_words")
    for word_idx, word in enumerate(multi_token_words):
        if len(word) > max_bad_word_len:
            raise InvalidRequestError(f"bad_words_ids: a bad word of {len(word)} tokens exceeds "
                                      f"max_bad_word_len={max_bad_word_len}", "bad_words")
        row["bad_word_seqs"][word_idx, max_bad_word_len - len(word):] = word
    seed = params.seed if params.seed is not None else request_seed
    if seed is None:
        seed = int(np.random.default_rng().integers(0, 2**32))
    if not -(2**63) <= int(seed) < 2**63:
        raise InvalidRequestError(f"request_seed={seed} must be in [-2**63, 2**63)", "seed")
    seed_u64 = int(seed) & (2**64 - 1)
    bias = params.logit_bias or ()
    if len(bias) > max_logit_bias:
        raise InvalidRequestError(f"logit_bias: {len(bias)} entries exceed max_logit_bias="
                                  f"{max_logit_bias}", "logit_bias")
    if any(token_id >= V for token_id, _ in bias):
        raise InvalidRequestError(f"logit_bias: token ids must be < vocab_size={V}", "logit_bias")
    for i, (token_id, value) in enumerate(bias):
        row["logit_bias_ids"][i], row["logit_bias_values"][i] = token_id, value
    if max_bad_word_len > 1 and prompt.size:
        prompt_tail = prompt[-(max_bad_word_len - 1):]
        row["recent_tokens"][max_bad_word_len - 1 - prompt_tail.size:] = prompt_tail
    row["stop_token_ids"][: len(stops)] = stops
    row["prompt_mask"][prompt] = True
    row.update(
        temperature=np.float32(params.temperature), top_p=np.float32(params.top_p),
        top_k=np.int32(min(params.top_k, V)), min_p=np.float32(params.min_p),
        repetition_penalty=np.float32(params.repetition_penalty),
        frequency_penalty=np.float32(params.frequency_penalty),
        presence_penalty=np.float32(params.presence_penalty),
        min_tokens=np.int32(params.min_tokens), ignore_eos=np.bool_(params.ignore_eos),
        seed=np.uint32(seed_u64 & 0xFFFFFFFF), seed_hi=np.uint32(seed_u64 >> 32),
        logprobs=np.int32(-1 if params.logprobs is None else params.logprobs),
        prompt_logprobs=np.int32(-1 if params.prompt_logprobs is None
                                 else params.prompt_logprobs))
    return row


def _capacities(arrays: SamplingArrays) -> tuple[int, int, int, int, int]:
    """``(V, S, NW, LW, NB)`` of ``arrays`` (see :class:`SamplingArrays`)."""
    return (arrays.vocab_size, arrays.stop_token_ids.shape[1], arrays.bad_word_seqs.shape[1],
            arrays.bad_word_seqs.shape[2], arrays.logit_bias_ids.shape[1])


@jax.jit
def _write_row(arrays: SamplingArrays, slot, row: dict) -> SamplingArrays:
    return dataclasses.replace(arrays, **{name: getattr(arrays, name).at[slot].set(value)
                                          for name, value in row.items()})


def _put_row(arrays: SamplingArrays, slot: int, row: dict) -> SamplingArrays:
    B = arrays.batch_size
    if not 0 <= int(slot) < B:
        raise ValueError(f"slot={slot} must be in [0, {B})")
    if isinstance(arrays.temperature, np.ndarray):
        fields = {}
        for name, value in row.items():
            column = getattr(arrays, name).copy()
            column[int(slot)] = value
            fields[name] = column
        return dataclasses.replace(arrays, **fields)
    return _write_row(arrays, jnp.int32(slot), row)


def set_slot(arrays: SamplingArrays, slot: int, params: SamplingParams, prompt_ids: Sequence[int],
             vocab_size: int | None = None, eos_ids: Sequence[int] = (),
             request_seed: int | None = None,
             bad_words_ids: Sequence[Sequence[int]] = ()) -> SamplingArrays:
    """Return ``arrays`` with every field of ``slot`` rewritten for a new request.

    The output counts are reset, the prompt mask rebuilt: nothing of the previous occupant
    survives. Works on numpy- or jax-backed arrays (jax: one jitted scatter, no retrace per slot).
    Arguments as in :func:`make_row`; ``vocab_size`` defaults to (and must equal) ``arrays``'s V.
    Raises:
      ValueError naming the argument (slot out of range, ids out of range, capacity exceeded).
    """
    V, S, NW, LW, NB = _capacities(arrays)
    if vocab_size is not None and int(vocab_size) != V:
        raise ValueError(f"vocab_size={vocab_size} != the arrays' vocabulary size {V}")
    row = make_row(params, prompt_ids, V, max_stop=S, max_bad_words=NW, max_bad_word_len=LW,
                   max_logit_bias=NB, eos_ids=eos_ids, request_seed=request_seed, bad_words_ids=bad_words_ids)
    return _put_row(arrays, slot, row)


def clear_slot(arrays: SamplingArrays, slot: int) -> SamplingArrays:
    """Return ``arrays`` with ``slot`` reset to neutral values (idle / padding slot)."""
    return _put_row(arrays, slot, neutral_row(*_capacities(arrays)))


def pack_sampling(params: Sequence[SamplingParams | None], batch_size: int, vocab_size: int, *,
                  prompts: Sequence[Sequence[int]] | None = None, max_stop: int = 4,
                  max_bad_words: int = 0, max_bad_word_len: int = 1, max_logit_bias: int = 0,
                  eos_ids: Sequence[int] = (), seeds: Sequence[int | None] | None = None,
                  bad_words_ids: Sequence[Sequence[Sequence[int]]] | None = None,
                  as_numpy: bool = False) -> SamplingArrays:
    """Build :class:`SamplingArrays` for ``batch_size`` slots from a list of params (None = idle).

    ``params[i]`` fills slot ``i`` (``len(params) <= batch_size``; the rest are idle), with
    ``prompts[i]``, ``seeds[i]`` (request seed) and ``bad_words_ids[i]`` when given.
    Raises:
      ValueError naming the argument when there are more params than slots.
    """
    if len(params) > batch_size:
        raise ValueError(f"params: {len(params)} requests exceed batch_size={batch_size}")
    arrays = SamplingArrays.empty(batch_size, vocab_size, max_stop, max_bad_words,
                                  max_bad_word_len, max_logit_bias, as_numpy=True)
    fields = {f.name: getattr(arrays, f.name).copy() for f in dataclasses.fields(arrays)}
    for slot, slot_params in enumerate(params):
        if slot_params is None:
            continue
        row = make_row(slot_params, prompts[slot] if prompts is not None else (), vocab_size,
                       max_stop=max_stop, max_bad_words=max_bad_words,
                       max_bad_word_len=max_bad_word_len, max_logit_bias=max_logit_bias,
                       eos_ids=eos_ids, request_seed=seeds[slot] if seeds is not None else 0,
                       bad_words_ids=bad_words_ids[slot] if bad_words_ids is not None else ())
        for name, value in row.items():
            fields[name][slot] = value
    arrays = SamplingArrays(**fields)
    return arrays if as_numpy else jax.tree.map(jnp.asarray, arrays)
