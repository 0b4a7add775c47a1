"""Typed errors that carry what they are about, so no caller parses message text."""
from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request's input breaks a limit or a rule.

    A ``ValueError`` (callers that catch ``ValueError`` keep working) with :attr:`field`: the
    input it is about, a :class:`~jmtp.SamplingParams` field name (``"max_tokens"``,
    ``"stop_token_ids"``, ``"logprobs"``, ...) or ``"prompt"``. The OpenAI server answers it with
    HTTP 400 and ``param`` = the request field the client sent for it.

    Attributes:
      field: the input's name, or None when the error concerns no single input.
    """

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


class RequestFailedError(RuntimeError):
    """One request failed inside an engine step (its admission into a batch slot raised); the
    error names it, so the caller can abort that request alone and go on with the others.

    Attributes:
      request_id: the failed request's id. The original exception is ``__cause__``.
    """

    def __init__(self, message: str, request_id: str):
        super().__init__(message)
        self.request_id = request_id
