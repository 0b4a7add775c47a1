"""Device sampling: per-slot arrays, logits processing, randomness and drafting (traced code).

Split by job: :mod:`~jmtp.runtime.device.sampling.arrays` (the per-slot :class:`SamplingArrays`
pytree, its neutral rows, history updates, :data:`GREEDY_EPS`),
:mod:`~jmtp.runtime.device.sampling.processors` (penalties, stop / bad-word masks, min-p / top-k /
top-p and the target distribution shared by verification and drafting),
:mod:`~jmtp.runtime.device.sampling.rng` (position-keyed per-request random draws and inverse-CDF
sampling) and :mod:`~jmtp.runtime.device.sampling.draft` (draft-token sampling). This package
re-exports their public names. The host side lives in :mod:`jmtp.runtime.host.sampling_params`
(the user-facing :class:`~jmtp.runtime.host.sampling_params.SamplingParams`) and
:mod:`jmtp.runtime.host.sampling_rows` (a request's row of the arrays).
"""
from jmtp.runtime.device.sampling.arrays import GREEDY_EPS, SamplingArrays, update_history
from jmtp.runtime.device.sampling.draft import draft_sample
from jmtp.runtime.device.sampling.processors import (PAIRWISE_MAX_V, filter_logits, penalize,
                                                     safe_softmax, saturate, stop_mask,
                                                     target_probs, vocab_argmax, window_history)
from jmtp.runtime.device.sampling.rng import (NUM_PURPOSES, PURPOSE_ACCEPT, PURPOSE_DRAFT,
                                              PURPOSE_SAMPLE, request_keys, sample_from_probs,
                                              uniform_draws, uniform_from_keys)

__all__ = [
    "GREEDY_EPS", "NUM_PURPOSES", "PAIRWISE_MAX_V", "PURPOSE_ACCEPT", "PURPOSE_DRAFT",
    "PURPOSE_SAMPLE", "SamplingArrays", "draft_sample", "filter_logits", "penalize",
    "request_keys", "safe_softmax", "sample_from_probs", "saturate", "stop_mask", "target_probs",
    "uniform_draws", "uniform_from_keys", "update_history", "vocab_argmax", "window_history",
]
