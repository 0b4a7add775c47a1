"""Invalid requests raise jmtp.InvalidRequestError carrying the input it is about (``.field``),
which the OpenAI server turns into HTTP 400's ``param`` without reading the message."""
from __future__ import annotations

import pytest

import jmtp
from jmtp.runtime.serve.server import param_of
from tests.runtime.conftest import tiny_model

pytestmark = pytest.mark.xdist_group("request_errors")   # one worker builds the shared engines once


@pytest.mark.parametrize("kwargs,field", [
    (dict(max_tokens=0), "max_tokens"), (dict(temperature=-1.0), "temperature"),
    (dict(top_p=1.5), "top_p"), (dict(n=0), "n"), (dict(seed=2**63), "seed"),
    (dict(min_tokens=9, max_tokens=4), "min_tokens"), (dict(stop=[""]), "stop"),
    (dict(logprobs=-1), "logprobs"), (dict(temperature="hot"), "temperature"),
    # floats the device holds as f32 must stay finite there; an int past float64 is no number
    (dict(temperature=1e39), "temperature"), (dict(top_p=float("nan")), "top_p"),
    (dict(repetition_penalty=10**400), "repetition_penalty"),
])
def test_sampling_params_errors_name_their_field(kwargs, field):
    with pytest.raises(jmtp.InvalidRequestError) as ei:
        jmtp.SamplingParams(**kwargs)
    assert ei.value.field == field and isinstance(ei.value, ValueError)
    assert param_of(ei.value, "messages") == field


@pytest.fixture(scope="module")
def engine():
    cfg, params = tiny_model()
    return jmtp.LLM(model_config=cfg, params=params, max_num_seqs=1, max_model_len=32,
                    num_blocks=3, block_size=8, compilation_cache_dir=None,
                    max_logprobs=1).llm_engine


@pytest.mark.parametrize("prompt,sp,field", [
    ([], jmtp.SamplingParams(), "prompt"),                                   # empty
    (list(range(3, 35)), jmtp.SamplingParams(), "prompt"),                   # >= max_model_len
    ([3, 999], jmtp.SamplingParams(), "prompt"),                             # id >= vocab 64
    ([[3], [4]], jmtp.SamplingParams(), "prompt"),                           # not flat
    ("text", jmtp.SamplingParams(), "prompt"),                               # no tokenizer
    ([3, 4], jmtp.SamplingParams(max_tokens=30), "max_tokens"),              # 4 > 3 KV blocks
    ([3, 4], jmtp.SamplingParams(logprobs=2), "logprobs"),                   # > max_logprobs
    ([3, 4], jmtp.SamplingParams(stop_token_ids=(70,)), "stop_token_ids"),   # id >= vocab
    ([3, 4], jmtp.SamplingParams(bad_token_ids=(64,)), "bad_token_ids"),
    ([3, 4], jmtp.SamplingParams(stop="x"), "stop"),                         # no tokenizer
])
def test_engine_request_errors_name_their_field(engine, prompt, sp, field):
    with pytest.raises(jmtp.InvalidRequestError) as ei:
        engine.add_request("r", prompt, sp)
    assert ei.value.field == field, str(ei.value)
    assert not engine.has_unfinished_requests()          # nothing stays queued
    assert param_of(ei.value, "messages") == ("messages" if field == "prompt" else field)


def test_other_errors_fall_back_to_the_prompt_field():
    assert param_of(ValueError("SamplingParams.top_p=2: must be in (0, 1]"), "prompt") == "prompt"
    assert param_of(jmtp.InvalidRequestError("x"), "messages") == "messages"


def test_structured_schema_depth_is_bounded():
    """A JSON-schema constraint nested past MAX_SCHEMA_DEPTH is refused by name before any
    recursive check runs (a 100-level schema hit Python's recursion limit in jsonschema); at
    the limit it is accepted. JSON text nested past the parser's own limit is refused too."""
    from jmtp.core.checks import json_depth
    from jmtp.runtime.host.structured.params import MAX_SCHEMA_DEPTH

    def nested(levels):
        s = {"type": "string"}
        for _ in range(levels):
            s = {"type": "object", "properties": {"a": s}}
        return s

    assert json_depth(nested(31)) == 63 and json_depth(nested(32)) == 65
    assert json_depth([[]] * 3) == 2 and json_depth("x") == 0 and json_depth({}) == 1
    assert json_depth(nested(1000), limit=MAX_SCHEMA_DEPTH) == MAX_SCHEMA_DEPTH + 1
    jmtp.StructuredOutputsParams(json=nested(31))
    for bad in (nested(32), nested(1000), '{"properties": {"a": ' * 5000 + "{}" + "}}" * 5000):
        with pytest.raises(jmtp.InvalidRequestError, match="nested more than 64") as ei:
            jmtp.StructuredOutputsParams(json=bad)
        assert ei.value.field == "structured_outputs.json"
