"""Request outputs and speculative-decoding metrics (vLLM ``RequestOutput`` shape)."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class SpecDecodeMetrics:
    """Per-request speculation counters (FastDeploy/vLLM metric names).

    Attributes:
      num_draft_tokens: drafts verified.
      num_accepted_tokens: drafts accepted and committed (tokens cut by a stop are not counted).
      accepted_per_position: K counts; entry k = steps whose draft k+1 was accepted.
      num_decode_steps: verify steps (steps that committed tokens after the prefill).
      num_decode_tokens: tokens committed by those steps.
      max_drafts_per_step: the most drafts verified in one of those steps (at most the
        request's ``SamplingParams.num_speculative_tokens``).
    """

    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = dataclasses.field(default_factory=list)
    num_decode_steps: int = 0
    num_decode_tokens: int = 0
    max_drafts_per_step: int = 0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens committed per verify step (1.0 = no draft ever accepted; K+1 at best)."""
        return self.num_decode_tokens / self.num_decode_steps if self.num_decode_steps else 0.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted (``spec_decode_draft_acceptance_rate``)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    def merge(self, other: "SpecDecodeMetrics") -> None:
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        if len(self.accepted_per_position) < len(other.accepted_per_position):
            self.accepted_per_position += [0] * (
                len(other.accepted_per_position) - len(self.accepted_per_position))
        for i, c in enumerate(other.accepted_per_position):
            self.accepted_per_position[i] += c
        self.num_decode_steps += other.num_decode_steps
        self.num_decode_tokens += other.num_decode_tokens
        self.max_drafts_per_step = max(self.max_drafts_per_step, other.max_drafts_per_step)


@dataclasses.dataclass
class CompletionOutput:
    """One generated sequence of a request (vLLM ``CompletionOutput`` shape).

    Attributes:
      index: 0..n-1, the sample's index among the request's ``SamplingParams.n`` samples.
      text: the text so far (cumulative; cut before a matched stop string unless
        ``include_stop_str_in_output``; never ends in a broken multi-byte character).
      token_ids: generated ids so far (cumulative; the stop token, or the token that completed a
        stop string, included; nothing after a stop).
      delta_text / delta_token_ids: what is new since the previous :class:`RequestOutput` of this
        request (the deltas of all outputs concatenate exactly to ``text`` / ``token_ids``).
      finish_reason: None while running, "stop" (stop/EOS token or stop string) or "length".
      stop_reason: the stop string matched, or the ``stop_token_ids`` id that ended the sample
        (None for EOS, "length" and running samples).
      logprobs: with ``SamplingParams.logprobs=n``: cumulative, one ``{token id: logprob}`` per id
        of ``token_ids``; None otherwise.
    """

    index: int
    text: str
    token_ids: list[int]
    delta_text: str = ""
    delta_token_ids: list[int] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[dict[int, float]] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestOutput:
    """The output of one request (vLLM ``RequestOutput`` shape); incremental from ``LLMEngine.step``.

    Attributes:
      request_id: the engine request id (str); ``LLM.generate`` / ``LLM.chat`` return the index
        of the prompt in the call (int).
      prompt: the prompt string (None for token-id prompts).
      prompt_token_ids: prompt ids.
      outputs: one :class:`CompletionOutput` per sample (``SamplingParams.n``), index order.
      finished: every sample has finished.
      metrics: speculation counters, summed over the samples.
      prompt_logprobs: with ``SamplingParams.prompt_logprobs=n`` (vLLM's field): one entry per
        prompt token, None for the first and ``{token id: logprob}`` (the top n and the token
        itself, the model's raw logprobs) for the others, once the prompt is prefilled; None
        otherwise.

    ``token_ids``, ``text``, ``finish_reason``, ``stop_reason`` and ``logprobs`` are read-only
    shortcuts of ``outputs[0]``.
    """

    request_id: str | int
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: SpecDecodeMetrics
    prompt_logprobs: list[dict[int, float] | None] | None = None

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def stop_reason(self) -> int | str | None:
        return self.outputs[0].stop_reason

    @property
    def logprobs(self) -> list[dict[int, float]] | None:
        return self.outputs[0].logprobs
