"""Structured outputs and tool calls in ``jmtp serve``, without a model: the request body →
``StructuredOutputsParams`` mapping (expected values written out here), HTTP 400s naming the
field, and the response shapes (``tool_calls``, streaming) through the app with a scripted engine
whose output text the test chooses, read by the official ``openai`` client. End to end against a
real server on SmolLM2, outputs checked with ``jsonschema``: test_server_e2e.py.
"""
from __future__ import annotations

import functools
import json
import re

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
jsonschema = pytest.importorskip("jsonschema")

from jmtp.core.errors import InvalidRequestError
from jmtp.runtime.host.structured.params import StructuredOutputsParams

WEATHER = {"type": "object",
           "properties": {"city": {"type": "string", "maxLength": 16},
                          "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 16}},
        "required": ["timezone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description":
                                           "Current weather in a city", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
CITY = {"type": "object",
        "properties": {"city": {"type": "string", "maxLength": 16},
                       "is_capital": {"type": "boolean"}},
        "required": ["city", "is_capital"], "additionalProperties": False}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


# ------------------------------------------------------------------ app with a scripted engine
TEMPLATE = ("{% if tools %}TOOLS={{ tools | tojson }}|{% endif %}"
            "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
            "{% for c in m.tool_calls or [] %}[call {{ c.id }} {{ c.function.name }} "
            "{{ c.function.arguments }}]{% endfor %}"
            "{% if m.tool_call_id %}[answers {{ m.tool_call_id }}]{% endif %}|{% endfor %}"
            "<assistant>")


@functools.lru_cache(maxsize=1)
def _tokenizer():
    """A byte-level tokenizer (one id per byte) with :data:`TEMPLATE` as its chat template."""
    from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers

    from jmtp.model.checkpoints.tokenizer import Tokenizer

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = HFTokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    return Tokenizer(backend, eos_token_ids=(0,), chat_template=TEMPLATE, source="bytes")


class ScriptedEngine:
    """The ``AsyncLLMEngine`` surface the server uses. Every request gets the text
    :attr:`reply` in :attr:`pieces` deltas, finishing with :attr:`finish`; :attr:`error` is
    raised by ``add_request`` instead. :attr:`calls` records ``(prompt text, SamplingParams)``."""

    is_dead, is_running, busy_seconds = False, True, 0.0
    stats = {"num_requests_in_flight": 0}

    def __init__(self):
        self.calls, self.reply, self.finish, self.pieces, self.error = [], "", "stop", 1, None
        self.stop_reason = None

    def compile_constraint(self, params):
        pass

    def start(self):
        pass

    def shutdown(self, timeout=None):
        pass

    async def abort(self, request_id):
        pass

    async def add_request(self, request_id, prompt, sp):
        if self.error is not None:
            raise self.error
        if isinstance(prompt, list):    # the server sends token ids: record the text
            prompt = _tokenizer().decode(prompt, skip_special_tokens=False)
        self.calls.append((prompt, sp))
        return self._outputs(request_id, sp)

    async def _outputs(self, request_id, sp):
        from jmtp.runtime.host.outputs import CompletionOutput, RequestOutput, SpecDecodeMetrics

        text, k = self.reply, self.pieces
        cuts = [len(text) * i // k for i in range(k + 1)]
        for i in range(k):
            delta, last = text[cuts[i]:cuts[i + 1]], i == k - 1
            outs = [CompletionOutput(j, text[:cuts[i + 1]], list(range(cuts[i + 1])),
                                     delta_text=delta, delta_token_ids=list(range(len(delta))),
                                     finish_reason=self.finish if last else None,
                                     stop_reason=self.stop_reason if last else None)
                    for j in range(sp.n)]
            yield RequestOutput(request_id, None, [1, 2, 3], outs, last, SpecDecodeMetrics())


@pytest.fixture(scope="module")
def app_client():
    """``(engine, http client, openai client)`` over the app with a :class:`ScriptedEngine`."""
    from fastapi.testclient import TestClient

    from jmtp.runtime.serve.server import ServerMetrics, build_app

    engine = ScriptedEngine()
    app = build_app(engine, _tokenizer(), model_name="m", max_model_len=4096,
                    metrics=ServerMetrics())
    with TestClient(app) as http:
        yield engine, http, openai.OpenAI(base_url="http://testserver/v1", api_key="none",
                                          http_client=http, max_retries=0)


@pytest.fixture
def scripted(app_client):
    engine, http, oai = app_client
    engine.calls.clear()
    engine.reply, engine.finish, engine.pieces, engine.error = "", "stop", 1, None
    engine.stop_reason = None
    return engine, http, oai


def post(http, path: str, body: dict):
    return http.post(path, json=dict({"model": "m", "max_tokens": 8}, **body))


def constraint_of(http, engine, path: str, body: dict):
    """The ``structured_outputs`` of the SamplingParams the engine got for ``body``."""
    r = post(http, path, body)
    assert r.status_code == 200, r.text
    return engine.calls[-1][1].structured_outputs


def error_of(http, path: str, body: dict) -> dict:
    r = post(http, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"], err
    return err


CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


@pytest.mark.parametrize("path,prompt", [(CHAT, {"messages": ASK}), (COMPLETIONS, {"prompt": "x"})])
def test_an_aborted_sample_is_an_error_not_a_stop(scripted, path, prompt, caplog):
    """A sample the engine ended with finish_reason="abort" (a structured output that reached a
    dead end or that a step broke) fails its request: HTTP 500 ``generation_aborted`` with the
    engine's reason, or an error event in a stream, and a server log line; never a "stop"."""
    engine, http, _ = scripted
    engine.reply, engine.finish, engine.pieces = '{"a": 1', "abort", 2
    engine.stop_reason = "structured output: token 7 is outside the constraint (x)"
    body = dict(prompt, response_format={"type": "json_object"})
    with caplog.at_level("ERROR", logger="jmtp"):
        r = post(http, path, body)
    assert r.status_code == 500, r.text
    err = r.json()["error"]
    assert err["type"] == "internal_error" and err["code"] == "generation_aborted"
    assert engine.stop_reason in err["message"]
    assert any(engine.stop_reason in rec.getMessage() for rec in caplog.records)
    r = post(http, path, dict(body, stream=True))
    assert r.status_code == 200
    events = [json.loads(line[6:]) for line in r.text.splitlines()
              if line.startswith("data: {")]
    assert all(c.get("finish_reason") in (None,) for e in events for c in e.get("choices", []))
    assert events[-1]["error"]["code"] == "generation_aborted", events
    assert r.text.rstrip().endswith("data: [DONE]")


# ------------------------------------------------------------------ request → constraint
@pytest.mark.parametrize("path,prompt", [(CHAT, {"messages": ASK}), (COMPLETIONS, {"prompt": "x"})])
@pytest.mark.parametrize("extra,expected", [
    ({}, None),
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, StructuredOutputsParams(json_object=True)),
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "city", "schema": CITY, "strict": True}}},
     StructuredOutputsParams(json=CITY)),
    ({"structured_outputs": {"regex": "[0-9]{3}"}}, StructuredOutputsParams(regex="[0-9]{3}")),
    ({"structured_outputs": {"choice": ["yes", "no"], "json_object": False,
                             "disable_any_whitespace": True}},
     StructuredOutputsParams(choice=("yes", "no"))),
    ({"structured_outputs": {"grammar": 'start: "a"+'}},
     StructuredOutputsParams(grammar='start: "a"+')),
    ({"guided_json": json.dumps(CITY)}, StructuredOutputsParams(json=CITY)),
    ({"guided_regex": "a|b"}, StructuredOutputsParams(regex="a|b")),
    ({"guided_choice": ["x", "y"]}, StructuredOutputsParams(choice=("x", "y"))),
    ({"guided_grammar": 'root ::= "a"'}, StructuredOutputsParams(grammar='root ::= "a"')),
])
def test_request_maps_to_structured_outputs(scripted, path, prompt, extra, expected):
    engine, http, _ = scripted
    got = constraint_of(http, engine, path, dict(prompt, **extra))
    assert got == expected
    if expected is not None:
        assert got.to_dict() == expected.to_dict()


def test_tool_choice_maps_to_schemas(scripted):
    engine, http, _ = scripted
    body = {"messages": ASK, "tools": TOOLS}
    # auto (the default with tools) and none: no constraint.
    assert constraint_of(http, engine, CHAT, body) is None
    assert constraint_of(http, engine, CHAT, dict(body, tool_choice="auto")) is None
    assert constraint_of(http, engine, CHAT, dict(body, tool_choice="none")) is None
    named = {"type": "function", "function": {"name": "get_time"}}
    assert constraint_of(http, engine, CHAT, dict(body, tool_choice=named)) == \
        StructuredOutputsParams(json=TIME)

    def call(name, params):
        return {"type": "object",
                "properties": {"name": {"const": name}, "parameters": params},
                "required": ["name", "parameters"], "additionalProperties": False}

    expected = {"type": "array", "minItems": 1,
                "items": {"anyOf": [call("get_weather", WEATHER), call("get_time", TIME)]}}
    assert constraint_of(http, engine, CHAT, dict(body, tool_choice="required")).json == expected
    one = constraint_of(http, engine, CHAT, dict(body, tool_choice="required",
                                                 parallel_tool_calls=False)).json
    assert one == dict(expected, maxItems=1)
    # A tool without parameters takes any object.
    bare = [{"type": "function", "function": {"name": "ping"}}]
    assert constraint_of(http, engine, CHAT, dict(body, tools=bare, tool_choice={
        "type": "function", "function": {"name": "ping"}})).json == {"type": "object"}


def test_required_schema_accepts_exactly_the_calls():
    """The "required" schema, checked by jsonschema: calls of the tools with valid arguments
    pass, anything else fails; a tool's local ``$ref`` still resolves inside it."""
    from jmtp.runtime.serve.server.tools import required_schema

    point = {"type": "object", "properties": {"at": {"$ref": "#/$defs/xy"}}, "required": ["at"],
             "$defs": {"xy": {"type": "array", "items": {"type": "number"}, "minItems": 2,
                              "maxItems": 2}}}
    schema = required_schema({"get_weather": WEATHER, "goto": point})
    ok = [[{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}],
          [{"name": "goto", "parameters": {"at": [1, 2.5]}},
           {"name": "get_weather", "parameters": {"city": "Rome", "unit": "fahrenheit"}}]]
    bad = [[], {"name": "goto", "parameters": {"at": [1, 2]}},
           [{"name": "get_time", "parameters": {"timezone": "UTC"}}],
           [{"name": "get_weather", "parameters": {"city": "Paris"}}],
           [{"name": "goto", "parameters": {"at": [1, "2"]}}],
           [{"name": "goto", "parameters": {"at": [1, 2]}, "extra": 1}],
           [{"name": "goto"}]]
    validator = jsonschema.Draft202012Validator(schema)
    for value in ok:
        validator.validate(value)
    for value in bad:
        assert not validator.is_valid(value), value
    assert point["properties"]["at"]["$ref"] == "#/$defs/xy"       # the input is not changed


def test_tools_and_tool_messages_reach_the_template(scripted):
    engine, http, _ = scripted
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C"}]
    r = post(http, CHAT, {"messages": history, "tools": TOOLS})
    assert r.status_code == 200, r.text
    prompt = engine.calls[-1][0]
    assert prompt.startswith("TOOLS=") and '"get_weather"' in prompt and '"maxLength": 16' in prompt
    assert '|<assistant>[call call_1 get_weather {"city": "Paris"}]|' in prompt
    assert "|<tool>21 C[answers call_1]|" in prompt
    r = post(http, CHAT, {"messages": ASK, "tools": TOOLS, "tool_choice": "none"})
    assert r.status_code == 200 and not engine.calls[-1][0].startswith("TOOLS=")


# ------------------------------------------------------------------ 400s
BAD_SCHEMA = {"type": "object", "properties": {"a": {"type": "nope"}}}


@pytest.mark.parametrize("path,body,param", [
    (COMPLETIONS, {"prompt": "x", "response_format": {"type": "xml"}}, "response_format"),
    (CHAT, {"messages": ASK, "response_format": {"type": "json_schema"}}, "response_format"),
    (CHAT, {"messages": ASK, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": BAD_SCHEMA}}}, "response_format"),
    (CHAT, {"messages": ASK, "response_format": {"json_schema": {}}}, "response_format"),
    (COMPLETIONS, {"prompt": "x", "structured_outputs": {"json": BAD_SCHEMA}},
     "structured_outputs.json"),
    (COMPLETIONS, {"prompt": "x", "structured_outputs": {"regex": "a(", "json": None}},
     "structured_outputs.regex"),
    (COMPLETIONS, {"prompt": "x", "structured_outputs": {}}, "structured_outputs"),
    (COMPLETIONS, {"prompt": "x", "structured_outputs": {"regex": "a", "choice": ["a"]}},
     "structured_outputs"),
    (COMPLETIONS, {"prompt": "x", "structured_outputs": {"structural_tag": "{}"}},
     "structured_outputs.structural_tag"),
    (COMPLETIONS, {"prompt": "x", "guided_json": BAD_SCHEMA}, "guided_json"),
    (COMPLETIONS, {"prompt": "x", "guided_json": "{not json"}, "guided_json"),
    (COMPLETIONS, {"prompt": "x", "guided_regex": "(", }, "guided_regex"),
    (COMPLETIONS, {"prompt": "x", "guided_choice": []}, "guided_choice"),
    # several constraints: the second one named
    (COMPLETIONS, {"prompt": "x", "response_format": {"type": "json_object"},
                   "guided_regex": "a"}, "guided_regex"),
    (CHAT, {"messages": ASK, "response_format": {"type": "json_object"}, "tools": TOOLS,
            "tool_choice": "required"}, "tools"),
    # tools
    (CHAT, {"messages": ASK, "tool_choice": "required"}, "tool_choice"),
    (CHAT, {"messages": ASK, "tools": TOOLS, "tool_choice": {
        "type": "function", "function": {"name": "get_news"}}}, "tool_choice"),
    (CHAT, {"messages": ASK, "tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    (CHAT, {"messages": ASK, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": BAD_SCHEMA}}]}, "tools"),
    (CHAT, {"messages": ASK, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": ["not", "a", "schema"]}}]}, "tools"),
    (CHAT, {"messages": ASK, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": True}}]}, "tools"),
    (CHAT, {"messages": ASK, "tools": [{"type": "retrieval"}]}, "tools"),
    (CHAT, {"messages": ASK, "tools": [{"type": "function", "function": {}}]}, "tools"),
    (CHAT, {"messages": ASK, "tools": [{"type": "function", "function": {"name": ""}}]}, "tools"),
    (CHAT, {"messages": ASK, "tools": TOOLS + TOOLS[:1]}, "tools"),
    (CHAT, {"messages": ASK + [{"role": "assistant", "tool_calls": [{"function": {
        "name": "f"}}]}]}, "messages"),
])
def test_bad_constraint_is_400_naming_the_field(scripted, path, body, param):
    engine, http, _ = scripted
    err = error_of(http, path, body)
    assert err["param"] == param, err
    assert not engine.calls                        # rejected before the request was added


def test_schema_errors_name_where(scripted):
    _, http, _ = scripted
    err = error_of(http, CHAT, {"messages": ASK, "tools": [TOOLS[0], {
        "type": "function", "function": {"name": "f", "parameters": BAD_SCHEMA}}]})
    assert "tools[1].function.parameters" in err["message"] and "properties/a/type" in \
        err["message"], err
    err = error_of(http, CHAT, {"messages": ASK, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": BAD_SCHEMA}}})
    assert err["message"].startswith("response_format: ") and "'nope'" in err["message"], err


@pytest.mark.parametrize("body,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": CITY}}},
     "response_format"),
    ({"tools": TOOLS, "tool_choice": "required"}, "tools"),
    ({"structured_outputs": {"json": CITY}}, "structured_outputs.json"),
    ({"guided_json": CITY}, "guided_json"),
])
def test_engine_grammar_errors_name_the_field_sent(scripted, body, param):
    """A grammar the engine's compiler rejects when the request is added (field
    ``structured_outputs.json``) is a 400 naming the request field it came from."""
    engine, http, _ = scripted
    engine.error = InvalidRequestError("the grammar engine rejects it", "structured_outputs.json")
    assert error_of(http, CHAT, dict({"messages": ASK}, **body))["param"] == param


# ------------------------------------------------------------------ responses
def test_required_tool_calls_response(scripted):
    engine, _, oai = scripted
    engine.reply = ('[{"name": "get_weather", "parameters": {"city": "Paris", "unit": '
                    '"celsius"}}, {"name": "get_time", "parameters": {"timezone": "CET"}}]')
    r = oai.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice="required")
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None and choice.message.role == "assistant"
    calls = choice.message.tool_calls
    assert [c.function.name for c in calls] == ["get_weather", "get_time"]
    assert [json.loads(c.function.arguments) for c in calls] == [
        {"city": "Paris", "unit": "celsius"}, {"timezone": "CET"}]
    assert all(c.type == "function" and re.fullmatch(r"call_[0-9a-f]{24}", c.id) for c in calls)
    assert calls[0].id != calls[1].id


def test_named_tool_call_response(scripted):
    engine, _, oai = scripted
    engine.reply = '{"city": "Paris", "unit": "celsius"}'
    r = oai.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice={
        "type": "function", "function": {"name": "get_weather"}})
    (call,) = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls"
    assert call.function.name == "get_weather"
    assert call.function.arguments == engine.reply


@pytest.mark.parametrize("finish", ["length", "stop"])
def test_unfinished_tool_call_stays_content(scripted, finish):
    """An output cut by max_tokens (or a stop string) is no call: its text is the content."""
    engine, _, oai = scripted
    engine.reply, engine.finish = '[{"name": "get_weather", "param', finish
    r = oai.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice="required")
    assert r.choices[0].finish_reason == finish
    assert r.choices[0].message.content == engine.reply and not r.choices[0].message.tool_calls


def test_auto_is_not_parsed(scripted):
    engine, _, oai = scripted
    engine.reply = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    r = oai.chat.completions.create(model="m", messages=ASK, tools=TOOLS)
    assert r.choices[0].message.content == engine.reply and not r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("n", [1, 2])
def test_streamed_tool_calls_come_whole_at_the_end(scripted, n):
    engine, _, oai = scripted
    engine.reply = '[{"name": "get_time", "parameters": {"timezone": "UTC"}}]'
    engine.pieces = 5
    chunks = list(oai.chat.completions.create(model="m", messages=ASK, tools=TOOLS, n=n,
                                              tool_choice="required", stream=True))
    for i in range(n):
        mine = [c for ch in chunks for c in ch.choices if c.index == i]
        assert mine[0].delta.role == "assistant"
        assert all(not c.delta.content for c in mine)            # no content streamed
        assert [c.finish_reason for c in mine] == [None] * (len(mine) - 1) + ["tool_calls"]
        calls = [tc for c in mine for tc in (c.delta.tool_calls or [])]
        assert len(calls) == 1 and calls[0].index == 0
        assert calls[0].function.name == "get_time"
        assert json.loads(calls[0].function.arguments) == {"timezone": "UTC"}
        assert calls[0].id.startswith("call_") and calls[0].type == "function"
        assert len(mine) == 2            # the role chunk and the call: nothing in between


def test_streamed_cut_tool_call_sends_its_text(scripted):
    engine, _, oai = scripted
    engine.reply, engine.finish, engine.pieces = '{"city": "Par', "length", 3
    chunks = list(oai.chat.completions.create(model="m", messages=ASK, tools=TOOLS, stream=True,
                                              tool_choice={"type": "function",
                                                           "function": {"name": "get_weather"}}))
    choices = [ch.choices[0] for ch in chunks if ch.choices]
    assert "".join(c.delta.content or "" for c in choices) == engine.reply
    assert choices[-1].finish_reason == "length" and not choices[-1].delta.tool_calls


def test_forbidden_tokens_logprobs_are_json_safe():
    """A constrained request's top logprobs include tokens the grammar forbids (-inf); the
    server sends vLLM's -9999.0 (JSON has no infinity; Starlette refuses NaN/inf)."""
    from jmtp.runtime.serve.server.serving import LOGPROB_FLOOR, OpenAIServing
    assert OpenAIServing._lp(float("-inf")) == LOGPROB_FLOOR == -9999.0
    assert OpenAIServing._lp(-1.5) == -1.5 and OpenAIServing._lp(None) is None
