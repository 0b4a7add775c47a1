"""End-to-end on the real default model: speculative greedy == plain greedy, token for token."""
from __future__ import annotations

import pytest

from jmtp.runtime.config import SpeculativeConfig
from jmtp.runtime.engine import LLM
from jmtp.runtime.sampling import SamplingParams

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


@pytest.fixture(scope="module")
def plain_outputs(smollm2, smollm2_tokenizer, smollm2_prompts):
    cfg, params = smollm2
    llm = LLM(model_config=cfg, params=params, tokenizer=smollm2_tokenizer, max_num_seqs=5,
              max_model_len=160, block_size=16, max_num_batched_tokens=64)
    return llm.generate(smollm2_prompts, SamplingParams(max_tokens=48, ignore_eos=True),
                        use_tqdm=False)


@pytest.mark.parametrize("k,m", [(1, 1), (2, 1), (2, 2), (3, 1), (3, 3)])
def test_smollm2_speculative_equals_plain(smollm2, smollm2_tokenizer, smollm2_prompts,
                                          plain_outputs, k, m):
    cfg, params = smollm2
    llm = LLM(model_config=cfg, params=params, tokenizer=smollm2_tokenizer,
              speculative_config=SpeculativeConfig("mtp", k, m), max_num_seqs=5,
              max_model_len=160, block_size=16, max_num_batched_tokens=64)
    outs = llm.generate(smollm2_prompts, SamplingParams(max_tokens=48, ignore_eos=True),
                        use_tqdm=False)
    for a, b in zip(plain_outputs, outs):
        assert len(a.token_ids) == 48
        assert b.token_ids == a.token_ids
        assert b.text == a.text
    assert "Paris" in plain_outputs[0].text
