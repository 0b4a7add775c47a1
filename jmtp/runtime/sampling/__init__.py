"""Per-request sampling: parameters, per-slot arrays, logits processing, randomness and drafting.

Sampling is split by job: :mod:`~jmtp.runtime.sampling.params` (the user-facing
:class:`SamplingParams` and its validation), :mod:`~jmtp.runtime.sampling.arrays` (the per-slot
:class:`SamplingArrays` pytree, filling and clearing slots, history updates),
:mod:`~jmtp.runtime.sampling.processors` (penalties, stop / bad-word masks, min-p / top-k / top-p
and the target distribution shared by verification and drafting),
:mod:`~jmtp.runtime.sampling.rng` (position-keyed per-request random draws and inverse-CDF
sampling) and :mod:`~jmtp.runtime.sampling.draft` (draft-token sampling). This package re-exports
their public names, so ``from jmtp.runtime.sampling import SamplingParams`` keeps working.
"""
from jmtp.runtime.sampling.arrays import (SamplingArrays, clear_slot, make_row, pack_sampling,
                                          set_slot, update_history)
from jmtp.runtime.sampling.draft import draft_sample
from jmtp.runtime.sampling.params import GREEDY_EPS, PENALTY_LIMIT, SamplingParams
from jmtp.runtime.sampling.processors import (PAIRWISE_MAX_V, filter_logits, penalize,
                                              safe_softmax, saturate, stop_mask, target_probs,
                                              vocab_argmax, window_history)
from jmtp.runtime.sampling.rng import (NUM_PURPOSES, PURPOSE_ACCEPT, PURPOSE_DRAFT,
                                       PURPOSE_SAMPLE, request_keys, sample_from_probs,
                                       uniform_draws, uniform_from_keys)

__all__ = [
    "GREEDY_EPS", "NUM_PURPOSES", "PAIRWISE_MAX_V", "PENALTY_LIMIT", "PURPOSE_ACCEPT",
    "PURPOSE_DRAFT", "PURPOSE_SAMPLE", "SamplingArrays", "SamplingParams", "clear_slot",
    "draft_sample", "filter_logits", "make_row", "pack_sampling", "penalize", "request_keys",
    "safe_softmax", "sample_from_probs", "saturate", "set_slot", "stop_mask", "target_probs",
    "uniform_draws", "uniform_from_keys", "update_history", "vocab_argmax", "window_history",
]
