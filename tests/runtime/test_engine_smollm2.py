"""End-to-end on the real default model with the MTP head jmtp ships for it (trained, FR-Spec draft
vocabulary): speculative greedy == plain greedy, token for token."""
from __future__ import annotations

import pytest

from jmtp.runtime.config import SpeculativeConfig
from jmtp.runtime.host.llm import LLM
from jmtp.runtime.host.sampling_params import SamplingParams

pytestmark = pytest.mark.xdist_group("smollm2_engine")  # one worker runs the module-scoped fixture once

QUESTIONS = [
    "What is the capital of France?",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Explain in two sentences why the sky is blue.",
    "List three prime numbers greater than 100.",
    "Translate 'good morning' into Spanish and German.",
]


@pytest.fixture(scope="module")
def smollm2_prompts(smollm2_tokenizer):
    tok = smollm2_tokenizer
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]))
            for q in QUESTIONS]


# The plain reference runs the default layer loop (unrolled on XLA:CPU), the speculative engines
# run ``layer_loop="scan"``: the comparison then also crosses the two loops on the real model, and
# the speculative engines, which use many more step buckets than the plain one (their rows per step
# vary), compile about 3x faster (a K=1 engine's first generate here: 57 s scanned, 181 s unrolled).
@pytest.fixture(scope="module")
def plain_llm(smollm2, smollm2_tokenizer):
    cfg, params = smollm2
    return LLM(model_config=cfg, params=params, tokenizer=smollm2_tokenizer, max_num_seqs=5,
               max_model_len=160, block_size=16, max_num_batched_tokens=64, max_logprobs=2)


@pytest.fixture(scope="module")
def plain_outputs(plain_llm, smollm2_prompts):
    return plain_llm.generate(smollm2_prompts, SamplingParams(max_tokens=48, ignore_eos=True),
                              use_tqdm=False)


_LLMS = {}


def spec_llm(smollm2, tokenizer, k, m, draft_vocab_size=None):
    if (k, m, draft_vocab_size) not in _LLMS:
        cfg, params = smollm2
        _LLMS[(k, m, draft_vocab_size)] = LLM(
            model_config=cfg, params=params, tokenizer=tokenizer,
            speculative_config=SpeculativeConfig("mtp", k, m, draft_vocab_size=draft_vocab_size),
            max_num_seqs=5, max_model_len=160, block_size=16, max_num_batched_tokens=64,
            max_logprobs=2, layer_loop="scan")
    return _LLMS[(k, m, draft_vocab_size)]


# The real model at K=3 with three MTP steps and the head's FR-Spec draft vocabulary (None); the
# other (K, M) pairs, K=1 included, run on tiny models (test_engine_lossless, hypothesis). (The
# real-model K=1 case went in session 21: its engine cost ~1.5 minutes of the suite's 30.)
@pytest.mark.parametrize("k,m,draft_vocab_size", [(3, 3, None)])
def test_smollm2_speculative_equals_plain(smollm2, smollm2_tokenizer, smollm2_prompts,
                                          plain_outputs, k, m, draft_vocab_size):
    llm = spec_llm(smollm2, smollm2_tokenizer, k, m, draft_vocab_size)
    assert llm.llm_engine.draft_vocab_size == (0 if draft_vocab_size == 0
                                               else smollm2[0].draft_vocab_size)
    outs = llm.generate(smollm2_prompts, SamplingParams(max_tokens=48, ignore_eos=True),
                        use_tqdm=False)
    for a, b in zip(plain_outputs, outs):
        assert len(a.token_ids) == 48
        assert b.token_ids == a.token_ids
        assert b.text == a.text
    assert "Paris" in plain_outputs[0].text
    # The shipped head is trained: drafts do get accepted (an untrained head scores 1.00 here).
    accepted = sum(o.metrics.num_accepted_tokens for o in outs)
    steps = sum(o.metrics.num_decode_steps for o in outs)
    assert steps and accepted / steps > 0.1, (accepted, steps)


def test_smollm2_sampling_parameters_speculative_equals_plain(smollm2, smollm2_tokenizer,
                                                              smollm2_prompts, plain_llm):
    tok = smollm2_tokenizer
    sp = SamplingParams(max_tokens=32, repetition_penalty=1.3, frequency_penalty=0.3,
                        presence_penalty=0.2, min_tokens=4, bad_words=("Paris",),
                        stop_token_ids=tuple(tok.encode("!")), logprobs=2)
    a = plain_llm.generate(smollm2_prompts[:3], sp, use_tqdm=False)
    b = spec_llm(smollm2, tok, 3, 3).generate(smollm2_prompts[:3], sp, use_tqdm=False)
    for x, y in zip(a, b):
        assert y.token_ids == x.token_ids and y.finish_reason == x.finish_reason
        assert "Paris" not in y.text
        for dx, dy in zip(x.logprobs, y.logprobs):
            assert dx.keys() == dy.keys()
            assert max(abs(dx[t] - dy[t]) for t in dx) <= 1e-4
