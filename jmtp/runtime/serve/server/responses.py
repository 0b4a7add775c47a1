"""Response bodies of ``jmtp serve`` as pydantic models: they document every endpoint's answers in
the OpenAPI document (``/openapi.json``), so schemathesis and client generators check and read
them. The handlers build the same shapes as dicts (``serving.py``); the models forbid extra keys,
so a field the server sends but does not document fails the schema check of the tests."""
from __future__ import annotations

from typing import Literal, Union

from pydantic import BaseModel, ConfigDict


class _Out(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ErrorDetail(_Out):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(_Out):
    """Every error, whatever its status (OpenAI's shape)."""

    error: ErrorDetail


class SpeculationUsage(_Out):
    """jmtp's speculation counters of a response's requests (``usage.speculation``)."""
    num_draft_tokens: int
    num_accepted_tokens: int
    num_decode_steps: int
    max_drafts_per_step: int


class Usage(_Out):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    speculation: Union[SpeculationUsage, None] = None


class CompletionLogprobs(_Out):
    tokens: list[str]
    token_logprobs: list[Union[float, None]]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class PromptLogprob(_Out):
    """One token's entry of vLLM's ``prompt_logprobs``."""
    logprob: float | None
    rank: None
    decoded_token: str


#: vLLM's ``prompt_logprobs``: per prompt token None (the first) or ``{"<id>": PromptLogprob}``.
PromptLogprobs = Union[list[Union[dict[str, PromptLogprob], None]], None]


class CompletionChoice(_Out):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: Literal["stop", "length"] | None
    stop_reason: Union[int, str, None]
    prompt_logprobs: PromptLogprobs = None


class CompletionResponse(_Out):
    """``POST /v1/completions`` without ``stream`` (with it: ``text/event-stream`` chunks of the
    same shape, ``"object": "text_completion"``, deltas as ``text``, then ``data: [DONE]``)."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class TopLogprob(_Out):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(_Out):
    token: str
    logprob: float | None
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Out):
    content: list[TokenLogprob]


class ToolCallFunction(_Out):
    name: str
    arguments: str


class ResponseToolCall(_Out):
    id: str
    type: Literal["function"]
    function: ToolCallFunction


class AssistantMessage(_Out):
    role: Literal["assistant"]
    content: str | None
    tool_calls: list[ResponseToolCall] | None = None


class ChatChoice(_Out):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: Literal["stop", "length", "tool_calls"] | None
    stop_reason: Union[int, str, None]


class ChatCompletionResponse(_Out):
    """``POST /v1/chat/completions`` without ``stream`` (with it: ``text/event-stream`` chunks,
    ``"object": "chat.completion.chunk"``, ``delta`` instead of ``message``, then
    ``data: [DONE]``)."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobs = None


class CompletionChunk(_Out):
    """One ``data:`` event of a streamed ``/v1/completions`` (the last one, with
    ``stream_options.include_usage``, has no choices and the usage)."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ToolCallDelta(ResponseToolCall):
    index: int


class ChatDelta(_Out):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(_Out):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: Literal["stop", "length", "tool_calls"] | None
    stop_reason: Union[int, str, None]
    prompt_logprobs: PromptLogprobs = None


class ChatCompletionChunk(_Out):
    """One ``data:`` event of a streamed ``/v1/chat/completions``."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


def event_stream_doc(chunk: str) -> dict:
    """The ``text/event-stream`` content of a streamed response: each event's ``data`` is a
    ``chunk`` (a component schema name) or an :class:`ErrorResponse` as JSON, and the last one
    is ``[DONE]``."""
    return {"text/event-stream": {"schema": {
        "type": "object", "required": ["data"],
        "properties": {"data": {
            "type": "string", "if": {"const": "[DONE]"},
            "else": {"contentMediaType": "application/json", "contentSchema": {"anyOf": [
                {"$ref": f"#/components/schemas/{chunk}"},
                {"$ref": "#/components/schemas/ErrorResponse"}]}}}}}}}


#: Models the OpenAPI document lists that no route returns directly (stream events).
STREAM_MODELS = (CompletionChunk, ChatCompletionChunk)


class ModelCard(_Out):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int


class ModelList(_Out):
    object: Literal["list"]
    data: list[ModelCard]


class Health(_Out):
    """``GET /health`` while the engine thread serves (else 503 with an :class:`ErrorResponse`,
    ``code`` ``"engine_dead"`` or ``"engine_stalled"``)."""

    status: Literal["ok"]
    busy_seconds: float
    requests_in_flight: int


#: Documented error responses of the generation endpoints.
GENERATION_ERRORS = {
    400: {"model": ErrorResponse, "description": "A malformed body, an unknown or invalid "
          "field (``param`` names it)"},
    404: {"model": ErrorResponse, "description": "``model`` is not the served model"},
    413: {"model": ErrorResponse, "description": "The body is larger than the server's limit"},
    500: {"model": ErrorResponse, "description": "An internal error (this request only)"},
    503: {"model": ErrorResponse, "description": "The engine is not running"},
}
