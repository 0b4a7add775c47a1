"""``jmtp serve`` end to end: the official ``openai`` client against a real server subprocess
(one server for the module, loopback only, killed in the fixture finalizer) on a tiny random
Llama with SmolLM2's tokenizer and chat template (``scripts/soak.py``'s ``tiny_model_dir``: steps
cost milliseconds, so the module's time goes to the serving paths, not to the model). The server
on the real SmolLM2 (the default ``--model``, its name, real text) is covered end to end by
tests/runtime/test_server_e2e.py.

References are derived independently of the server's code paths: offline ``LLM.generate`` on the
chat-templated prompt, the non-streaming text for the streamed one, the un-stopped text cut at the
stop string's first occurrence, the greedy n=1 text for each of n=2 greedy choices.
"""
from __future__ import annotations

import importlib.util
import json
import pathlib
import time

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client.parser")

from tests.runtime.serve_process import metrics, running_server  # noqa: E402

# one worker: one server for the module
pytestmark = pytest.mark.xdist_group("server")

ROOT = pathlib.Path(__file__).resolve().parents[2]
# MTP K=2 with a fresh (random) head: the random model has no MTP layer of its own; outputs are
# the target's either way (greedy is lossless). Such a head gets almost no draft accepted, so
# this module checks the speculative server's plumbing against offline references, not
# multi-token steps through HTTP: logprobs, stop strings, n and streaming with those are
# test_server_e2e.py's (SmolLM2, the shipped head), the speculation counters with hand-worked
# non-zero values test_server_metrics.py's.
# 2,048 positions: the disconnect tests ask for 2,000 tokens, which take the tiny model far longer
# than their client waits (~15 ms a token on the 2-core VM, about 30 s), so only an abort ends
# them early.
MAX_MODEL_LEN, LONG = 2048, 2000
ENGINE = dict(max_num_seqs=2, max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=64,
              layer_loop="scan")
SERVER_ARGS = ["--max-num-seqs", "2", "--max-model-len", str(MAX_MODEL_LEN),
               "--max-num-batched-tokens", "64",
               "--num-speculative-tokens", "2", "--mtp-head", "none", "--max-logprobs", "2",
               "--layer-loop", "scan"]
QUESTION = "What is the capital of France?"
COMPLETION_PROMPT = "The three primary colors are"
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def model_dir(smollm2_dir, tmp_path_factory) -> str:
    """The tiny random Llama's checkpoint folder (SmolLM2's vocabulary, tokenizer and chat
    template), written by ``scripts/soak.py``'s ``tiny_model_dir``."""
    spec = importlib.util.spec_from_file_location("jmtp_soak_script", ROOT / "scripts" / "soak.py")
    soak = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(soak)
    return soak.tiny_model_dir(str(tmp_path_factory.mktemp("tiny") / "tiny-smollm2-vocab"))


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    with running_server(SERVER_ARGS + ["--model", model_dir],
                        tmp_path_factory.mktemp("serve") / "server.log") as base:
        yield base


def wait_idle(base: str, timeout: float = 60) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(base)
        if (m[("jmtp_num_requests_running", ())] == 0 and m[("jmtp_num_requests_waiting", ())] == 0
                and m[("jmtp_kv_blocks_free", ())] == m[("jmtp_kv_blocks_total", ())]):
            return m
        if time.monotonic() > deadline:
            return m
        time.sleep(0.2)


@pytest.fixture(scope="module")
def offline(model_dir):
    """Offline greedy texts of the server's engine configuration (the independent reference):
    plain decoding (the server verifies K=2 drafts, nearly all rejected on this model) and
    ``max_logprobs`` 0, so the server's texts also show that serving logprobs does not change
    the tokens."""
    from jmtp.runtime.host.llm import LLM
    from jmtp.runtime.host.sampling_params import SamplingParams

    llm = LLM(model_dir, speculative_config=None, **ENGINE)
    chat = llm.tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}])
    outs = llm.generate([chat, COMPLETION_PROMPT], SamplingParams(max_tokens=MAX_TOKENS),
                        use_tqdm=False)
    texts = [o.outputs[0].text if hasattr(o, "outputs") else o.text for o in outs]
    return {"chat": texts[0], "completion": texts[1]}


def test_models_and_health(server, model_id, model_dir):
    assert model_id == pathlib.Path(model_dir).name       # a folder's model is named by it
    assert httpx.get(server + "/health").status_code == 200


def test_completion_and_chat_equal_offline(client, model_id, offline):
    r = client.completions.create(model=model_id, prompt=COMPLETION_PROMPT, max_tokens=MAX_TOKENS,
                                  temperature=0)
    assert r.choices[0].text == offline["completion"]
    assert r.usage.completion_tokens > 0
    c = client.chat.completions.create(model=model_id, temperature=0, max_tokens=MAX_TOKENS,
                                       messages=[{"role": "user", "content": QUESTION}])
    assert c.choices[0].message.role == "assistant"
    assert c.choices[0].message.content == offline["chat"]
    assert c.choices[0].finish_reason in ("stop", "length")


def test_streaming_deltas_equal_full_text(client, model_id):
    kw = dict(model=model_id, temperature=0, max_tokens=MAX_TOKENS)
    msgs = [{"role": "user", "content": QUESTION}]
    full = client.chat.completions.create(messages=msgs, **kw)
    chunks = list(client.chat.completions.create(messages=msgs, stream=True,
                                                 stream_options={"include_usage": True}, **kw))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == full.choices[0].message.content
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == \
        full.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert sum(1 for ch in chunks if ch.choices) > 2          # it really streamed

    comp = client.completions.create(prompt=COMPLETION_PROMPT, **kw)
    streamed = "".join(ch.choices[0].text
                       for ch in client.completions.create(prompt=COMPLETION_PROMPT, stream=True,
                                                           **kw))
    assert streamed == comp.choices[0].text


def test_stop_string_cuts_at_first_occurrence(client, model_id, offline):
    full = offline["completion"]
    words = full.split()
    assert len(words) >= 4, full
    stop = " " + words[2]                    # occurs in the middle of the greedy text
    assert stop in full, full
    expected = full[: full.index(stop)]
    for stream in (False, True):
        kw = dict(model=model_id, prompt=COMPLETION_PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                  stop=[stop, "never-generated-xyz"])
        if stream:
            chunks = list(client.completions.create(stream=True, **kw))
            text = "".join(ch.choices[0].text for ch in chunks)
            finish = [ch.choices[0].finish_reason for ch in chunks][-1]
        else:
            r = client.completions.create(**kw)
            text, finish = r.choices[0].text, r.choices[0].finish_reason
        assert text == expected
        assert finish == "stop"


def test_n2_greedy_and_sampled(client, model_id, offline):
    r = client.completions.create(model=model_id, prompt=COMPLETION_PROMPT, max_tokens=MAX_TOKENS,
                                  temperature=0, n=2)
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert [c.text for c in r.choices] == [offline["completion"]] * 2
    # Streamed: one finish per choice, each choice's deltas concatenate to the greedy text.
    texts, finishes = {0: "", 1: ""}, {0: [], 1: []}
    for ch in client.completions.create(model=model_id, prompt=COMPLETION_PROMPT, n=2,
                                        max_tokens=MAX_TOKENS, temperature=0, stream=True):
        for c in ch.choices:
            texts[c.index] += c.text
            if c.finish_reason is not None:
                finishes[c.index].append(c.finish_reason)
    assert texts == {0: offline["completion"], 1: offline["completion"]}
    assert finishes == {i: [r.choices[0].finish_reason] for i in (0, 1)}
    s = client.chat.completions.create(model=model_id, max_tokens=8, temperature=1.0, seed=3, n=2,
                                       messages=[{"role": "user", "content": QUESTION}])
    assert sorted(c.index for c in s.choices) == [0, 1]
    assert all(c.finish_reason in ("stop", "length") for c in s.choices)
    assert s.usage.completion_tokens >= 2
    # Seeded sampling is reproducible.
    s2 = client.chat.completions.create(model=model_id, max_tokens=8, temperature=1.0, seed=3, n=2,
                                        messages=[{"role": "user", "content": QUESTION}])
    assert [c.message.content for c in s2.choices] == [c.message.content for c in s.choices]


def test_logprobs(client, model_id, offline):
    r = client.completions.create(model=model_id, prompt=COMPLETION_PROMPT, max_tokens=MAX_TOKENS,
                                  temperature=0, logprobs=2)
    c = r.choices[0]
    assert c.text == offline["completion"]
    lp = c.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == r.usage.completion_tokens
    assert "".join(lp.tokens) == c.text
    for tok, val, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert val <= 0 and 1 <= len(top) <= 3
        assert val == pytest.approx(max(top.values()))   # greedy: the emitted token is the top-1
    ch = client.chat.completions.create(model=model_id, temperature=0, max_tokens=8,
                                        logprobs=True, top_logprobs=2,
                                        messages=[{"role": "user", "content": QUESTION}])
    content = ch.choices[0].logprobs.content
    assert len(content) == ch.usage.completion_tokens
    for item in content:
        assert len(item.top_logprobs) == 2
        assert item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob
        assert item.logprob == pytest.approx(item.top_logprobs[0].logprob)
    with pytest.raises(openai.BadRequestError) as ei:
        client.completions.create(model=model_id, prompt=COMPLETION_PROMPT, max_tokens=2,
                                  logprobs=5)                      # above --max-logprobs 2
    assert ei.value.body["param"] == "logprobs"


@pytest.mark.parametrize("field,kwargs", [
    ("temperature", dict(temperature=-1)),
    ("max_tokens", dict(max_tokens=0)),
    ("top_p", dict(top_p=1.5)),
    ("n", dict(n=0)),
    ("prompt", dict(prompt="hello " * (MAX_MODEL_LEN + 50))),   # longer than --max-model-len
    ("temperature", dict(temperature="hot")),          # wrong type: pydantic
])
def test_bad_field_is_400_naming_it(client, model_id, server, field, kwargs):
    kw = dict(model=model_id, prompt=COMPLETION_PROMPT, max_tokens=4)
    kw.update(kwargs)
    with pytest.raises(openai.BadRequestError) as ei:
        client.completions.create(**kw)
    err = ei.value.body
    assert ei.value.status_code == 400
    assert err["type"] == "invalid_request_error" and err["param"] == field, err
    assert err["message"] and err["code"] is None
    assert httpx.get(server + "/health").status_code == 200      # still serving


def test_bad_chat_requests(client, model_id, server):
    with pytest.raises(openai.BadRequestError) as ei:
        client.chat.completions.create(model=model_id, messages=[], max_tokens=4)
    assert ei.value.body["param"] == "messages"
    with pytest.raises(openai.BadRequestError) as ei:
        client.chat.completions.create(model=model_id, max_completion_tokens=0,
                                       messages=[{"role": "user", "content": QUESTION}])
    assert ei.value.body["param"] == "max_completion_tokens"
    with pytest.raises(openai.NotFoundError) as ei:
        client.chat.completions.create(model="gpt-4o", max_tokens=4,
                                       messages=[{"role": "user", "content": QUESTION}])
    assert ei.value.body["param"] == "model"
    r = httpx.post(server + "/v1/chat/completions", content=b"{not json",
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert httpx.get(server + "/health").status_code == 200


def test_disconnect_mid_stream_aborts_and_frees_blocks(server, model_id):
    start = wait_idle(server)
    ok_before = sum(v for (n, _), v in start.items() if n == "jmtp_request_success_total")
    body = {"model": model_id, "prompt": COMPLETION_PROMPT, "max_tokens": LONG, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=120) as c:
        with c.stream("POST", server + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            got = 0
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    json.loads(line[6:])
                    got += 1
                    if got == 2:
                        break                 # leave mid-stream: the connection closes
    end = wait_idle(server)
    assert end[("jmtp_kv_blocks_free", ())] == start[("jmtp_kv_blocks_free", ())] \
        == end[("jmtp_kv_blocks_total", ())]
    assert end[("jmtp_num_requests_running", ())] == 0
    # Aborted, not finished: no new finished completion, fewer tokens generated than asked for.
    assert sum(v for (n, _), v in end.items() if n == "jmtp_request_success_total") == ok_before
    gen = end[("jmtp_generation_tokens_total", ())] - start[("jmtp_generation_tokens_total", ())]
    assert 0 < gen < LONG


def test_disconnect_non_streaming_aborts(server, model_id):
    start = wait_idle(server)
    body = {"model": model_id, "prompt": COMPLETION_PROMPT, "max_tokens": LONG, "temperature": 0,
            "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):          # connected and sent; the answer never came
        httpx.post(server + "/v1/completions", json=body, timeout=1)
    end = wait_idle(server)
    assert end[("jmtp_kv_blocks_free", ())] == end[("jmtp_kv_blocks_total", ())]
    key = ("jmtp_requests_total", (("endpoint", "completions"),))
    assert end[key] - start.get(key, 0) == 1                          # it was admitted ...
    done = sum(v for (n, _), v in end.items() if n == "jmtp_request_success_total")
    assert done == sum(v for (n, _), v in start.items() if n == "jmtp_request_success_total")
    gen = end[("jmtp_generation_tokens_total", ())] - start[("jmtp_generation_tokens_total", ())]
    assert gen < LONG                                                 # ... and aborted


def test_metrics_parse_and_count(server, client, model_id):
    before = wait_idle(server)
    r = client.completions.create(model=model_id, prompt=COMPLETION_PROMPT, max_tokens=8,
                                  temperature=0)
    m = wait_idle(server)
    names = {n for n, _ in m}
    for fam in ("jmtp_requests_total", "jmtp_prompt_tokens_total", "jmtp_generation_tokens_total",
                "jmtp_num_requests_running", "jmtp_num_requests_waiting", "jmtp_kv_blocks_free",
                "jmtp_step_seconds_bucket", "jmtp_step_seconds_count",
                "jmtp_spec_decode_draft_tokens_total", "jmtp_spec_decode_accepted_tokens_total",
                "jmtp_spec_decode_accepted_per_position_total",
                "jmtp_spec_decode_mean_acceptance_length",
                # the process: garbage-collector pauses (timed from the app's start), RSS
                "jmtp_gc_pause_seconds_count", "python_gc_collections_total",
                "process_resident_memory_bytes"):
        assert fam in names, fam

    def delta(name, labels=()):
        return m.get((name, labels), 0) - before.get((name, labels), 0)

    assert delta("jmtp_requests_total", (("endpoint", "completions"),)) == 1
    assert delta("jmtp_prompt_tokens_total") == r.usage.prompt_tokens
    assert delta("jmtp_generation_tokens_total") == r.usage.completion_tokens
    assert delta("jmtp_request_success_total",
                 (("finish_reason", r.choices[0].finish_reason),)) == 1
    assert delta("jmtp_step_seconds_count") >= 1
    drafts = m[("jmtp_spec_decode_draft_tokens_total", ())]
    accepted = m[("jmtp_spec_decode_accepted_tokens_total", ())]
    per_pos = [m[("jmtp_spec_decode_accepted_per_position_total", (("position", str(i)),))]
               for i in (1, 2)]
    assert drafts > 0 and 0 <= accepted <= drafts
    assert sum(per_pos) == accepted and per_pos[0] >= per_pos[1]
    steps = m[("jmtp_spec_decode_steps_total", ())]
    assert m[("jmtp_spec_decode_mean_acceptance_length", ())] == pytest.approx(
        m[("jmtp_spec_decode_step_tokens_total", ())] / steps)
    assert 1.0 <= m[("jmtp_spec_decode_mean_acceptance_length", ())] <= 3.0
