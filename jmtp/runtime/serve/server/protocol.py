"""The OpenAI wire format: request bodies, error bodies, finish reasons, server-sent events and
usage (OpenAI API reference, https://platform.openai.com/docs/api-reference; vLLM's extra sampling
fields ``top_k`` / ``min_p`` / ...).

Request bodies are strict, as OpenAI's API is: an unknown field, an unknown message ``role`` or a
value of the wrong JSON type (``"n": "2"``, ``"stream": "yes"``) is refused, and every numeric
field carries its range, so the OpenAPI document the models generate states them.

Errors use OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``; :func:`param_of`
names the request field a jmtp error is about from the error's type, never its message.
"""
from __future__ import annotations

import json
import re
from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from jmtp.core.errors import InvalidRequestError
from jmtp.runtime.host.sampling_params import FLOAT32_MAX, LOGIT_BIAS_LIMIT, SEED_MAX, SEED_MIN


#: Largest int an engine array holds (i32): the static upper bound of the integer fields whose
#: real limit depends on the server (``request_models`` narrows them per server).
INT32_MAX = 2**31 - 1
#: Stop strings one request may send, and their length (each is searched for after every token).
MAX_STOP_STRINGS, MAX_STOP_CHARS = 16, 1024
#: Tools one chat request may send (OpenAI's limit).
MAX_TOOLS = 128
#: Message roles (OpenAI's, less the deprecated ``function``): any other role is refused.
ROLES = ("system", "developer", "user", "assistant", "tool")

Probability = Annotated[float, Field(ge=0, le=1)]
Penalty = Annotated[float, Field(ge=-2, le=2)]


class _Base(BaseModel):
    # Strict as OpenAI: an unknown field is refused (the server may log and drop them instead:
    # ServerOptions.ignore_unknown_fields), and no string or float is coerced to an int or bool.
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(_Base):
    include_usage: bool = False


class JsonSchemaFormat(_Base):
    """``response_format.json_schema``: ``{"name", "schema", "strict", "description"}``."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False,
                              populate_by_name=True)
    name: str | None = None
    description: str | None = None
    schema_: Union[dict, bool, None] = Field(None, alias="schema")   # `schema` shadows pydantic
    strict: bool | None = None


class ResponseFormat(_Base):
    """OpenAI's ``response_format``: ``{"type": "text" | "json_object" | "json_schema"}``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(_Base):
    """vLLM's ``structured_outputs`` object: one of ``json``, ``regex``, ``choice``, ``grammar``,
    ``json_object``. vLLM's layout options are accepted and have no effect (the JSON layout is
    fixed: ``jmtp.runtime.host.structured.params.JSON_OPTIONS``); ``structural_tag`` is refused."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False,
                              populate_by_name=True)
    json_: Union[dict, str, bool, None] = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: Union[dict, str, None] = None
    disable_fallback: bool | None = None
    disable_any_whitespace: bool | None = None
    disable_additional_properties: bool | None = None
    whitespace_pattern: str | None = None


class _SamplingFields(_Base):
    """Fields shared by both endpoints (OpenAI, plus vLLM's extras top_k / min_p / ...), and the
    output constraints (OpenAI's ``response_format``; vLLM's ``structured_outputs`` and its older
    ``guided_*`` fields). Ranges are the engine's (``SamplingParams``) and OpenAI's; the fields
    whose range depends on the server (``n``, ``max_tokens``, ``min_tokens``, token ids,
    logprobs) are narrowed per server by :func:`jmtp.runtime.serve.server.intake.request_models`."""

    model: str | None = None
    max_tokens: Annotated[int, Field(ge=1, le=INT32_MAX)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=-1, le=INT32_MAX)] | None = None
    min_p: Probability | None = None
    seed: Annotated[int, Field(ge=SEED_MIN, le=SEED_MAX)] | None = None
    stop: Union[Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)],
                Annotated[list[Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]],
                          Field(max_length=MAX_STOP_STRINGS)], None] = None
    stop_token_ids: list[Annotated[int, Field(ge=0, le=INT32_MAX)]] | None = None
    include_stop_str_in_output: bool = False
    n: Annotated[int, Field(ge=1, le=128)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: Annotated[float, Field(gt=0, le=FLOAT32_MAX)] | None = None
    min_tokens: Annotated[int, Field(ge=0, le=INT32_MAX)] | None = None
    ignore_eos: bool | None = None
    user: str | None = None     # OpenAI's end-user id: accepted, unused
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: Union[dict, str, bool, None] = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # OpenAI's logit_bias ({"token id": bias in [-100, 100]}) and vLLM's skip_special_tokens /
    # prompt_logprobs, honoured by the engine (SamplingParams; docs/serving.md's field table)
    logit_bias: dict[str, Annotated[float, Field(ge=-LOGIT_BIAS_LIMIT,
                                                 le=LOGIT_BIAS_LIMIT)]] | None = None
    skip_special_tokens: bool = True
    prompt_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    # jmtp: at most this many speculative drafts per step for the request (0: none; None: the
    # server's setting; above it: 400 naming the field)
    num_speculative_tokens: Annotated[int, Field(ge=0, le=INT32_MAX)] | None = None


TokenIds = list[Annotated[int, Field(ge=0, le=INT32_MAX)]]


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions`` body."""

    prompt: Union[str, Annotated[TokenIds, Field(min_length=1)], list[str],
                  list[Annotated[TokenIds, Field(min_length=1)]]]
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: Annotated[int, Field(ge=1, le=128)] | None = None


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
    role: Literal[ROLES]
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
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: bool | None = None
    max_completion_tokens: Annotated[int, Field(ge=1, le=INT32_MAX)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None


class BadRequest(Exception):
    """An invalid request field (HTTP 400 ``invalid_request_error``)."""

    def __init__(self, message: str, param: str | None, status: int = 400,
                 type_: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.type, self.code = message, param, status, type_, code


class GenerationAborted(BadRequest):
    """The engine ended a sample early with ``finish_reason="abort"`` (a structured-output
    constraint that reached a dead end or that a step broke): the request fails with HTTP 500
    ``internal_error``, code ``generation_aborted`` and the engine's reason, never a "stop"."""

    def __init__(self, reason):
        super().__init__(f"the engine ended the output early: {reason}", None, status=500,
                         type_="internal_error", code="generation_aborted")


def error_body(message: str, type_: str, param: str | None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def param_of(err: Exception, prompt_field: str) -> str:
    """The request field a jmtp error is about: :attr:`InvalidRequestError.field
    <jmtp.core.errors.InvalidRequestError.field>` (its ``"prompt"`` is the request's
    ``prompt_field``), else the prompt field."""
    field = getattr(err, "field", None) if isinstance(err, InvalidRequestError) else None
    return prompt_field if field in (None, "prompt") else field


def client_message(err: Exception, request_id: str | None = None) -> str:
    """A jmtp error's message as an HTTP client gets it: without the engine's ``request '<id>':``
    prefix (an internal id) and without the Python class names ``SamplingParams.`` /
    ``StructuredOutputsParams.`` in front of field names."""
    text = str(err)
    if request_id is not None:
        prefix = f"request {request_id!r}: "
        text = text[len(prefix):] if text.startswith(prefix) else text
    return _PY_NAMES.sub("", text)


_PY_NAMES = re.compile(r"\b(?:SamplingParams|StructuredOutputsParams)\.")


def finish_reason(reason) -> str | None:
    """OpenAI finish reasons: "stop" (EOS, stop id or stop string) and "length"."""
    return None if reason is None else ("length" if reason == "length" else "stop")


def sse(obj) -> str:
    """One server-sent event: ``data: {json}\\n\\n``."""
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class Usage:
    """Token counts of one response (OpenAI ``usage``), and jmtp's speculation counters of its
    requests (``usage["speculation"]``: ``num_draft_tokens``, ``num_accepted_tokens``,
    ``num_decode_steps``, ``max_drafts_per_step``; :class:`~jmtp.runtime.host.outputs.
    SpecDecodeMetrics`) once :meth:`add_metrics` saw any."""

    def __init__(self):
        self.prompt = 0
        self.completion = 0
        self.speculation: dict | None = None

    def add_metrics(self, m) -> None:
        """Add one finished request's :class:`~jmtp.runtime.host.outputs.SpecDecodeMetrics`."""
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
