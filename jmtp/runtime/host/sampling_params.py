"""User-facing sampling parameters of one request and their validation.

:class:`SamplingParams` is the vLLM-like, frozen description of how one request samples; it checks
every field on construction (raising a ``ValueError`` that names the field and its limit) and
normalises sequences to tuples and ``top_k=-1`` to 0. A request decodes greedily below the
temperature :data:`jmtp.runtime.device.sampling.arrays.GREEDY_EPS`, the constant the device's
per-slot rows are read with.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np

from jmtp.core.errors import InvalidRequestError
from jmtp.runtime.device.sampling.arrays import GREEDY_EPS
from jmtp.runtime.host.structured.params import StructuredOutputsParams

#: Limits for frequency / presence penalties (OpenAI / vLLM).
PENALTY_LIMIT = 2.0
#: Largest magnitude of a float field: the device holds them as f32 (a larger value would be inf).
FLOAT32_MAX = float(np.finfo(np.float32).max)


def _finite_f32(x) -> bool:
    try:
        x = float(x)
    except OverflowError:       # an int past float64's range
        return False
    return math.isfinite(x) and abs(x) <= FLOAT32_MAX


#: Largest magnitude of a ``logit_bias`` value (OpenAI: "values between -100 and 100").
LOGIT_BIAS_LIMIT = 100.0
#: Seeds are 64-bit signed ints (OpenAI's and vLLM's range); -1 means "no seed" (vLLM).
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1


def _field_error(field: str, value, limit: str) -> InvalidRequestError:
    return InvalidRequestError(f"SamplingParams.{field}={value!r}: must be {limit}", field)


def _logit_bias(value, is_int, is_num):
    """``logit_bias`` as a tuple of ``(id, bias)`` pairs sorted by id (None when empty)."""
    if value is None:
        return None
    limit = f"None or {{token id >= 0: bias in [-{LOGIT_BIAS_LIMIT:g}, {LOGIT_BIAS_LIMIT:g}]}}"
    try:
        pairs = list(value.items()) if isinstance(value, dict) else [tuple(p) for p in value]
    except TypeError:
        raise _field_error("logit_bias", value, limit) from None
    out = {}
    for pair in pairs:
        if len(pair) != 2:
            raise _field_error("logit_bias", value, limit)
        token, bias = pair
        if (not is_int(token) or token < 0 or not is_num(bias) or not math.isfinite(float(bias))
                or abs(float(bias)) > LOGIT_BIAS_LIMIT):
            raise _field_error("logit_bias", value, limit)
        if int(token) in out:
            raise _field_error("logit_bias", value, f"{limit} with each token id once")
        out[int(token)] = float(bias)
    return tuple(sorted(out.items())) or None


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """User-facing sampling parameters of one request (vLLM-like).

    Fields:
      max_tokens: int >= 1, maximum number of generated tokens (enforced by the engine).
      temperature: float >= 0; ``< GREEDY_EPS`` means greedy decoding.
      top_p: float in (0, 1]. top_k: int >= 0, or -1 (0 and -1 = off, stored as 0; values above
        the vocabulary are clamped).
      min_p: float in [0, 1].
      repetition_penalty: float > 0 (1 = off), HF semantics over prompt ∪ generated tokens.
      frequency_penalty, presence_penalty: float in [-2, 2], over generated tokens only.
      min_tokens: int in [0, max_tokens]; before that many tokens the stop ids and EOS are
        masked and no stop string ends the request (vLLM: a stop string counts only if it ends
        in the text of a token past the first ``min_tokens``).
      stop_token_ids: ids that end the request (the emitted stop token is kept in the output).
      bad_token_ids: ids that are never generated.
      bad_words: strings the engine tokenizes into id sequences and passes to
        :func:`jmtp.runtime.host.sampling_rows.set_slot` as ``bad_words_ids`` (single-token words
        are banned everywhere, multi-token words ban their last token after the rest of the
        sequence, HF semantics).
      ignore_eos: EOS neither stops the request nor is masked by ``min_tokens``.
      seed: None (the engine supplies a request seed) or a 64-bit int in [-2**63, 2**63);
        ``-1`` means None (vLLM's convention). Every bit counts: the request's random key is
        built from both 32-bit halves (:func:`jmtp.runtime.device.sampling.rng.request_keys`).
      logit_bias: None or ``{token id: bias}`` (a dict, or ``(id, bias)`` pairs), OpenAI's
        ``logit_bias``: each bias in [-100, 100] is added to the token's logit before penalties
        and filtering, in every verify-window row and in the drafter's logits (vLLM's order).
        Stored as a tuple of ``(id, bias)`` pairs sorted by id; at most the engine's
        ``max_logit_bias`` entries (checked when the request is added).
      skip_special_tokens: leave special tokens (EOS, chat-template markers) out of the output
        text (vLLM's switch, default True); their ids stay in ``token_ids``.
      prompt_logprobs: None or int >= 0: the top-n logprobs of every prompt token after the
        first (plus the token itself), from the target's prefill logits (vLLM's field); needs
        an engine with ``max_logprobs >= max(n, 1)``.
      logprobs: None or int >= 0: number of top logprobs returned per emitted token.
      n: int >= 1, independent samples of the prompt (distinct random streams; with ``seed``,
        sample 0 uses ``seed`` and sample i > 0 a seed derived from ``(seed, i)``).
      stop: None, a string or a sequence of non-empty strings; the engine ends a sample when its
        text contains one (checked after every token, also inside a multi-token verify step) and
        cuts the text before it (``finish_reason="stop"``, ``stop_reason`` = the string).
      include_stop_str_in_output: keep the matched stop string at the end of the text.
      structured_outputs: None or a
        :class:`~jmtp.runtime.host.structured.params.StructuredOutputsParams` (JSON schema, JSON
        object, regex, choice or grammar) the output must match; enforced per draft position
        inside the speculative step (:mod:`jmtp.runtime.host.structured`). Needs an engine with a
        tokenizer; ``min_tokens`` must then be 0. Once the constraint is complete only EOS is
        allowed (with ``ignore_eos`` the output continues with EOS tokens up to ``max_tokens``).
      num_speculative_tokens: None (the engine's speculation) or an int >= 0: at most this many
        drafts per step for this request (0: no speculation), whatever the method or the
        dynamic policy chooses; the engine refuses a cap above its K
        (``SpeculativeConfig.num_speculative_tokens``). A per-slot data input of the step: a
        mix of caps never recompiles.

    Raises:
      InvalidRequestError: (a ``ValueError``) naming the field (``.field``) and its limit for any
        out-of-range value.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    bad_token_ids: tuple[int, ...] = ()
    bad_words: tuple[str, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int | None = None
    n: int = 1
    stop: str | Sequence[str] | None = None
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputsParams | None = None
    logit_bias: dict[int, float] | tuple[tuple[int, float], ...] | None = None
    skip_special_tokens: bool = True
    prompt_logprobs: int | None = None
    num_speculative_tokens: int | None = None

    def __post_init__(self):
        stop = self.stop
        if stop is None:
            stop = ()
        elif isinstance(stop, str):
            stop = (stop,)
        elif isinstance(stop, bytes) or not isinstance(stop, Sequence) or not all(
                isinstance(text, str) and text for text in stop):
            raise _field_error("stop", self.stop, "None, a string or a list of non-empty strings")
        if any(not text for text in stop):
            raise _field_error("stop", self.stop, "None, a string or a list of non-empty strings")
        object.__setattr__(self, "stop", tuple(stop))
        if not isinstance(self.include_stop_str_in_output, (bool, np.bool_)):
            raise _field_error("include_stop_str_in_output", self.include_stop_str_in_output,
                               "a bool")
        for name in ("stop_token_ids", "bad_token_ids", "bad_words"):
            value = getattr(self, name)
            if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
                raise _field_error(name, value, "a sequence")
            object.__setattr__(self, name, tuple(value))

        def is_int(x):
            return isinstance(x, (int, np.integer)) and not isinstance(x, bool)

        def is_num(x):
            return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool)

        for name in ("max_tokens", "top_k", "min_tokens", "n"):
            if not is_int(getattr(self, name)):
                raise _field_error(name, getattr(self, name), "an int")
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty",
                     "presence_penalty"):
            value = getattr(self, name)
            if not is_num(value) or not _finite_f32(value):
                raise _field_error(name, value, "a finite number within float32's range")
        if self.max_tokens < 1:
            raise _field_error("max_tokens", self.max_tokens, ">= 1")
        if self.temperature < 0:
            raise _field_error("temperature", self.temperature, ">= 0")
        if not 0 < self.top_p <= 1:
            raise _field_error("top_p", self.top_p, "in (0, 1]")
        if self.top_k < -1:
            raise _field_error("top_k", self.top_k, ">= 1, or 0 / -1 (off)")
        if self.top_k == -1:            # vLLM / OpenAI clients send -1 for "off": one meaning, 0
            object.__setattr__(self, "top_k", 0)
        if self.n < 1:
            raise _field_error("n", self.n, ">= 1")
        if not 0 <= self.min_p <= 1:
            raise _field_error("min_p", self.min_p, "in [0, 1]")
        if self.repetition_penalty <= 0:
            raise _field_error("repetition_penalty", self.repetition_penalty, "> 0")
        for name in ("frequency_penalty", "presence_penalty"):
            if abs(getattr(self, name)) > PENALTY_LIMIT:
                raise _field_error(name, getattr(self, name),
                                   f"in [-{PENALTY_LIMIT}, {PENALTY_LIMIT}]")
        if self.min_tokens < 0:
            raise _field_error("min_tokens", self.min_tokens, ">= 0")
        if self.min_tokens > self.max_tokens:
            raise _field_error("min_tokens", self.min_tokens, f"<= max_tokens ({self.max_tokens})")
        for name in ("stop_token_ids", "bad_token_ids"):
            for token_id in getattr(self, name):
                if not is_int(token_id) or token_id < 0:
                    raise _field_error(name, getattr(self, name), "a tuple of token ids >= 0")
        for word in self.bad_words:
            if not isinstance(word, str) or not word:
                raise _field_error("bad_words", self.bad_words, "a tuple of non-empty strings")
        if not isinstance(self.ignore_eos, (bool, np.bool_)):
            raise _field_error("ignore_eos", self.ignore_eos, "a bool")
        if self.seed is not None and (not is_int(self.seed)
                                      or not SEED_MIN <= self.seed <= SEED_MAX):
            raise _field_error("seed", self.seed, "None or an int in [-2**63, 2**63)")
        if self.seed is not None and self.seed == -1:     # vLLM: -1 = no seed
            object.__setattr__(self, "seed", None)
        object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias, is_int, is_num))
        if not isinstance(self.skip_special_tokens, (bool, np.bool_)):
            raise _field_error("skip_special_tokens", self.skip_special_tokens, "a bool")
        if self.prompt_logprobs is not None and (not is_int(self.prompt_logprobs)
                                                 or self.prompt_logprobs < 0):
            raise _field_error("prompt_logprobs", self.prompt_logprobs, "None or an int >= 0")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs,
                                                                  StructuredOutputsParams):
            raise _field_error("structured_outputs", self.structured_outputs,
                               "None or a StructuredOutputsParams")
        if self.structured_outputs is not None and self.min_tokens:
            # the grammar decides where the output may end; banning EOS before min_tokens could
            # leave a complete constraint with no token allowed at all
            raise _field_error("min_tokens", self.min_tokens,
                               "0 with structured_outputs (the constraint decides where the "
                               "output ends)")
        if self.logprobs is not None and (not is_int(self.logprobs) or self.logprobs < 0):
            raise _field_error("logprobs", self.logprobs, "None or an int >= 0")
        if self.num_speculative_tokens is not None and (
                not is_int(self.num_speculative_tokens) or self.num_speculative_tokens < 0):
            raise _field_error("num_speculative_tokens", self.num_speculative_tokens,
                               "None or an int >= 0")

    @property
    def seed_halves(self) -> tuple[int, int]:
        """``(low, high)`` 32-bit halves of the seed's two's complement (``seed`` not None)."""
        u = int(self.seed) & (2**64 - 1)
        return u & 0xFFFFFFFF, u >> 32

    @property
    def greedy(self) -> bool:
        """True when the request decodes greedily (``temperature < GREEDY_EPS``)."""
        return self.temperature < GREEDY_EPS
