"""The OpenAI wire format: request bodies, error bodies, finish reasons, server-sent events and
usage (OpenAI API reference, https://platform.openai.com/docs/api-reference; vLLM's extra sampling
fields ``top_k`` / ``min_p`` / ...).

Errors use OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``; :func:`param_of`
names the request field a jmtp error is about from the error's type, never its message.
"""
from __future__ import annotations

import json
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from jmtp.core.errors import InvalidRequestError


class _Base(BaseModel):
    # Clients send fields we do not use (user, logit_bias=None, ...): ignore them, as vLLM does.
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Base):
    include_usage: bool = False


class JsonSchemaFormat(_Base):
    """``response_format.json_schema``: ``{"name", "schema", "strict", "description"}``."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: str | None = None
    description: str | None = None
    schema_: Union[dict, bool, None] = Field(None, alias="schema")   # `schema` shadows pydantic
    strict: bool | None = None


class ResponseFormat(_Base):
    """OpenAI's ``response_format``: ``{"type": "text" | "json_object" | "json_schema"}``
    (the type is checked by :func:`jmtp.runtime.server.structured.request_constraint`, which
    names it in its error)."""

    type: str
    json_schema: JsonSchemaFormat | None = None


class _SamplingFields(_Base):
    """Fields shared by both endpoints (OpenAI, plus vLLM's extras top_k / min_p / ...), and the
    output constraints (OpenAI's ``response_format``; vLLM's ``structured_outputs`` and its older
    ``guided_*`` fields)."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: Union[str, list[str], None] = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: Union[dict, str, None] = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # jmtp: at most this many speculative drafts per step for the request (0: none; None: the
    # server's setting; above it: 400 naming the field)
    num_speculative_tokens: int | None = None


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions`` body."""

    prompt: Union[str, list[int], list[str], list[list[int]]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class TextPart(_Base):
    type: Literal["text"]
    text: str


class FunctionCall(_Base):
    name: str
    arguments: str


class ToolCall(_Base):
    """An assistant message's tool call (``{"id", "type": "function", "function"}``)."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Base):
    role: str
    content: Union[str, list[TextPart], None] = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None      # assistant turns that called tools
    tool_call_id: str | None = None               # role "tool": the call it answers


class FunctionDefinition(_Base):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: Union[dict, bool, None] = None     # a JSON schema; None: {"type": "object"}
    strict: bool | None = None


class Tool(_Base):
    """An OpenAI function tool: ``{"type": "function", "function": {"name", "description",
    "parameters"}}``."""

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Base):
    name: str


class NamedToolChoice(_Base):
    """``tool_choice={"type": "function", "function": {"name": ...}}``."""

    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions`` body."""

    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: bool | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


class BadRequest(Exception):
    """An invalid request field (HTTP 400 ``invalid_request_error``)."""

    def __init__(self, message: str, param: str | None, status: int = 400,
                 type_: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.type, self.code = message, param, status, type_, code


def error_body(message: str, type_: str, param: str | None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def param_of(err: Exception, prompt_field: str) -> str:
    """The request field a jmtp error is about: :attr:`InvalidRequestError.field
    <jmtp.core.errors.InvalidRequestError.field>` (its ``"prompt"`` is the request's
    ``prompt_field``), else the prompt field."""
    field = getattr(err, "field", None) if isinstance(err, InvalidRequestError) else None
    return prompt_field if field in (None, "prompt") else field


def finish_reason(reason) -> str | None:
    """OpenAI finish reasons: "stop" (EOS, stop id or stop string) and "length"."""
    return None if reason is None else ("length" if reason == "length" else "stop")


def sse(obj) -> str:
    """One server-sent event: ``data: {json}\\n\\n``."""
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class Usage:
    """Token counts of one response (OpenAI ``usage``), and jmtp's speculation counters of its
    requests (``usage["speculation"]``: ``num_draft_tokens``, ``num_accepted_tokens``,
    ``num_decode_steps``, ``max_drafts_per_step``; :class:`~jmtp.runtime.outputs.
    SpecDecodeMetrics`) once :meth:`add_metrics` saw any."""

    def __init__(self):
        self.prompt = 0
        self.completion = 0
        self.speculation: dict | None = None

    def add_metrics(self, m) -> None:
        """Add one finished request's :class:`~jmtp.runtime.outputs.SpecDecodeMetrics`."""
        s = self.speculation or dict(num_draft_tokens=0, num_accepted_tokens=0,
                                     num_decode_steps=0, max_drafts_per_step=0)
        s["num_draft_tokens"] += m.num_draft_tokens
        s["num_accepted_tokens"] += m.num_accepted_tokens
        s["num_decode_steps"] += m.num_decode_steps
        s["max_drafts_per_step"] = max(s["max_drafts_per_step"], m.max_drafts_per_step)
        self.speculation = s

    def as_dict(self) -> dict:
        out = {"prompt_tokens": self.prompt, "completion_tokens": self.completion,
               "total_tokens": self.prompt + self.completion}
        if self.speculation is not None:
            out["speculation"] = dict(self.speculation)
        return out
