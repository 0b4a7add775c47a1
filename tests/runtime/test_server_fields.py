"""Every request field of ``/v1/completions`` and ``/v1/chat/completions`` the docs' field table
(docs/serving.md) calls honoured does what it says, through the official ``openai`` client; the
ones it calls refused get a 400 naming them.

The server runs in process (FastAPI's ``TestClient`` as the client's transport) on a tiny random
model with SmolLM2's vocabulary and tokenizer: its text is noise, but every field's effect is
exact and checked against an independent reference (the full forward's logits, with the bias
added for ``logit_bias``), and ``logit_bias`` forces the special tokens the other fields act on.
"""
from __future__ import annotations

import numpy as np
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

import jmtp  # noqa: E402
from jmtp import SpeculativeConfig
from jmtp.model import forward_logits

from tests.runtime.conftest import tiny_model  # noqa: E402
from tests.runtime.test_request_fields import biased_greedy  # noqa: E402

pytestmark = pytest.mark.xdist_group("server_fields")   # one worker builds the server once

PROMPT = [31, 4096, 77, 1500, 9, 23000, 640]
FILE_SEP = 5            # SmolLM2's special token "<file_sep>" (not EOS)


@pytest.fixture(scope="module")
def setup(smollm2_tokenizer):
    from jmtp.runtime.serve.async_engine import AsyncLLMEngine
    from jmtp.runtime.serve.server.app import build_app
    from jmtp.runtime.serve.server.metrics import ServerMetrics

    cfg, params = tiny_model(vocab_size=49152, eos_token_ids=(2,))
    llm = jmtp.LLM(model_config=cfg, params=params, tokenizer=smollm2_tokenizer, max_num_seqs=2,
                   max_model_len=96, max_logprobs=2,
                   speculative_config=SpeculativeConfig("mtp", 2))
    metrics = ServerMetrics()
    engine = AsyncLLMEngine.from_llm(llm, on_step=metrics.on_step, start=False)
    app = build_app(engine, smollm2_tokenizer, model_name="tiny", max_model_len=96,
                    metrics=metrics, max_logprobs=2)
    with TestClient(app) as http:
        client = openai.OpenAI(base_url="http://testserver/v1", api_key="none",
                               http_client=http, max_retries=0)
        yield client, cfg, params, smollm2_tokenizer
    llm.close()


def _complete(client, **kw):
    kw = dict(dict(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0), **kw)
    return client.completions.create(**kw)


def _bad(client, param, create=None, **kw):
    with pytest.raises(openai.BadRequestError) as ei:
        (create or _complete)(client, **kw)
    assert ei.value.status_code == 400 and ei.value.body["param"] == param, ei.value.body
    return ei.value.body


def test_logit_bias(setup):
    """-100 on the greedy first token removes it; the output is the biased greedy reference."""
    client, cfg, params, tok = setup
    plain = np.asarray(forward_logits(cfg, params, PROMPT))[-1].argmax()
    bias = {int(plain): -100.0, 17: 3.0}
    want = biased_greedy(cfg, params, PROMPT, 4, bias)
    assert want[0] != plain
    r = _complete(client, logit_bias={str(t): v for t, v in bias.items()})
    assert r.choices[0].text == tok.decode(want)
    assert _complete(client).choices[0].text != r.choices[0].text
    chat = client.chat.completions.create(model="tiny", max_tokens=3, temperature=0,
                                          logit_bias={str(FILE_SEP): 100},
                                          messages=[{"role": "user", "content": "hi"}])
    assert chat.usage.completion_tokens == 3 and chat.choices[0].message.content == ""
    _bad(client, "logit_bias", logit_bias={"7": 100.5})
    _bad(client, "logit_bias", logit_bias={"seven": 1})
    _bad(client, "logit_bias", logit_bias={"49152": 1})       # outside the vocabulary


def test_seed(setup):
    """Seeded sampling is reproducible for any int64 seed; -1 is vLLM's "no seed"; a seed
    outside int64 is refused naming it."""
    client = setup[0]
    a = _complete(client, temperature=1.0, seed=2**40 + 9, max_tokens=8)
    b = _complete(client, temperature=1.0, seed=2**40 + 9, max_tokens=8)
    c = _complete(client, temperature=1.0, seed=9, max_tokens=8)
    assert a.choices[0].text == b.choices[0].text != c.choices[0].text
    assert _complete(client, temperature=1.0, seed=-1).usage.completion_tokens == 4
    _bad(client, "seed", seed=2**63)


def test_min_tokens_skip_special_tokens_and_special_stop_strings(setup):
    """``logit_bias`` +100 forces "<file_sep>", a special token: skip_special_tokens (default)
    leaves its text out, False keeps it; the stop string "<file_sep>" matches the token at the
    first one, and with min_tokens=3 at the fourth (vLLM: no stop before min_tokens)."""
    client = setup[0]
    force = {"logit_bias": {str(FILE_SEP): 100}}
    r = _complete(client, max_tokens=3, extra_body=force)
    assert r.choices[0].text == "" and r.usage.completion_tokens == 3
    r = _complete(client, max_tokens=3, extra_body=dict(force, skip_special_tokens=False))
    assert r.choices[0].text == "<file_sep>" * 3
    r = _complete(client, max_tokens=10, stop=["<file_sep>"], extra_body=force)
    assert r.usage.completion_tokens == 1 and r.choices[0].finish_reason == "stop"
    assert r.choices[0].model_extra["stop_reason"] == "<file_sep>"
    r = _complete(client, max_tokens=10, stop=["<file_sep>"], extra_body=dict(force, min_tokens=3))
    assert r.usage.completion_tokens == 4 and r.choices[0].finish_reason == "stop"
    _bad(client, "min_tokens", max_tokens=4, extra_body={"min_tokens": 5})


def test_prompt_logprobs(setup):
    """vLLM's ``prompt_logprobs``: None, then each prompt token's logprob (and the row's top-1)
    from the model's logits; completions per choice, chat at the top level."""
    client, cfg, params, tok = setup
    logits = np.asarray(forward_logits(cfg, params, PROMPT), np.float64)
    lp = logits - logits.max(-1, keepdims=True)
    lp -= np.log(np.exp(lp).sum(-1, keepdims=True))
    r = _complete(client, max_tokens=2, extra_body={"prompt_logprobs": 1})
    plp = r.choices[0].model_extra["prompt_logprobs"]
    assert len(plp) == len(PROMPT) and plp[0] is None
    for q in range(1, len(PROMPT)):
        entry = plp[q][str(PROMPT[q])]
        assert entry["logprob"] == pytest.approx(lp[q - 1, PROMPT[q]], abs=2e-4)
        assert entry["decoded_token"] == tok.decode([PROMPT[q]], skip_special_tokens=False)
        assert str(int(lp[q - 1].argmax())) in plp[q]
    chat = client.chat.completions.create(model="tiny", max_tokens=2, temperature=0,
                                          messages=[{"role": "user", "content": "hi"}],
                                          extra_body={"prompt_logprobs": 0})
    assert chat.model_extra["prompt_logprobs"][0] is None
    assert all(len(d) == 1 for d in chat.model_extra["prompt_logprobs"][1:])
    _bad(client, "prompt_logprobs", extra_body={"prompt_logprobs": 3})   # > --max-logprobs 2


def test_streamed_text_offsets_equal_the_full_response(setup):
    """A long stop string holds text back while streaming; the streamed ``text_offset`` still
    equal the non-streamed ones (both count the tokens' strings)."""
    client = setup[0]
    kw = dict(max_tokens=10, logprobs=1, stop=["never appears in this text at all"])
    full = _complete(client, **kw).choices[0].logprobs
    offsets, tokens = [], []
    for chunk in _complete(client, stream=True, **kw):
        for c in chunk.choices:
            if c.logprobs is not None:
                offsets += c.logprobs.text_offset
                tokens += c.logprobs.tokens
    assert tokens == full.tokens and offsets == full.text_offset


@pytest.mark.parametrize("field,value", [("echo", True), ("suffix", "end"), ("best_of", 3)])
def test_completion_fields_refused_by_name(setup, field, value):
    _bad(setup[0], field, **{field: value})


def test_ignored_fields_change_nothing(setup):
    """OpenAI's ``user`` (an end-user id for abuse monitoring) does not change the output."""
    client = setup[0]
    assert _complete(client, user="someone").choices[0].text == _complete(client).choices[0].text
