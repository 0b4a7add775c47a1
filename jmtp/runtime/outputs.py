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
    """

    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = dataclasses.field(default_factory=list)
    num_decode_steps: int = 0
    num_decode_tokens: int = 0

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


@dataclasses.dataclass
class RequestOutput:
    """The result of one request.

    Attributes:
      request_id: index of the prompt in the ``generate`` call.
      prompt: the prompt string (None for token-id prompts).
      prompt_token_ids: prompt ids.
      token_ids: generated ids (stop token included when it ended the request).
      text: detokenised ``token_ids`` ("" without a tokenizer).
      finish_reason: "stop" (stop/EOS token) or "length" (max_tokens or max_model_len).
      metrics: speculation counters.
      logprobs: with ``SamplingParams.logprobs=n``: per generated token, ``{token id: logprob}`` of
        the target's top-n plus the emitted token (log-softmax after penalties, before
        temperature); None otherwise.
    """

    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    metrics: SpecDecodeMetrics
    logprobs: list[dict[int, float]] | None = None
