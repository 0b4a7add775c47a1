"""Greedy output with speculation is token-identical to greedy output without it."""
from __future__ import annotations

import functools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from jmtp.runtime.config import SpeculativeConfig
from jmtp.runtime.engine import LLM, SamplingParams
from tests.runtime.conftest import reference_greedy, tiny_model

MAX_LEN = 96


@functools.lru_cache(maxsize=None)
def engine(k: int | None, m: int | None, seed: int = 0):
    cfg, params = tiny_model(seed)
    spec = SpeculativeConfig("mtp", k, m) if k else None
    return LLM(model_config=cfg, params=params, speculative_config=spec, max_num_seqs=3,
               max_model_len=MAX_LEN, block_size=4, max_num_batched_tokens=48)


def test_plain_engine_matches_reference_greedy():
    cfg, params = tiny_model(0)
    prompts = [[5, 6, 7], [3], list(range(2, 42)), [9] * 17]
    outs = engine(None, None).generate(prompts, SamplingParams(max_tokens=12), use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert o.token_ids == reference_greedy(cfg, params, p, 12)
        assert o.prompt_token_ids == p


SPECS = [(1, 1), (3, 1), (3, 3)]   # K=1, M=K and M<K


@pytest.mark.parametrize("k,m", SPECS)
@settings(max_examples=10, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_speculative_equals_plain(k, m, data):
    n = data.draw(st.integers(1, 7), label="num_requests")   # more requests than the 3 slots
    prompts = [data.draw(st.lists(st.integers(2, 63), min_size=1, max_size=40), label="prompt")
               for _ in range(n)]
    sps = [SamplingParams(max_tokens=data.draw(st.integers(1, 20), label="max_tokens"))
           for _ in range(n)]
    plain = engine(None, None).generate(prompts, sps, use_tqdm=False)
    spec = engine(k, m).generate(prompts, sps, use_tqdm=False)
    for a, b, sp in zip(plain, spec, sps):
        assert b.token_ids == a.token_ids
        assert b.finish_reason == a.finish_reason
        assert len(b.token_ids) <= sp.max_tokens
        assert b.metrics.num_accepted_tokens <= b.metrics.num_draft_tokens
    ec = engine(k, m).engine_config
    assert engine(k, m)._free_count == ec.num_blocks
