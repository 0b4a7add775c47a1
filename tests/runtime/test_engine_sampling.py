"""Sampling parameters through the whole engine: speculative == plain under the same parameters,
logprobs equal with and without speculation, sampled requests reproducible and batch-independent."""
from __future__ import annotations

import functools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from jmtp.runtime.config import SpeculativeConfig
from jmtp.runtime.host.llm import LLM, SamplingParams
from tests.engines import GROUPS, tiny_llm
from tests.runtime.conftest import tiny_model

# the 3-slot canonical shapes (tests/engines.py), shared with other modules in group tiny_plain
pytestmark = GROUPS["plain"]


@functools.lru_cache(maxsize=None)
def engine(k: int | None):
    """Plain decoding, or MTP with K = M = ``k`` (2 or 3): 3 slots, top-3 logprobs served."""
    return tiny_llm({None: "plain", 2: "mtp2_3slots", 3: "mtp3"}[k])


greedy_params = st.builds(
    SamplingParams,
    max_tokens=st.integers(1, 16),
    repetition_penalty=st.sampled_from([1.0, 1.3, 2.0]),
    frequency_penalty=st.sampled_from([0.0, 0.4, 1.5]),
    presence_penalty=st.sampled_from([0.0, -0.5, 1.0]),
    min_tokens=st.integers(0, 1),
    bad_token_ids=st.lists(st.integers(2, 63), max_size=3).map(tuple),
    stop_token_ids=st.lists(st.integers(2, 63), max_size=2).map(tuple),
    ignore_eos=st.booleans(),
)


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_penalties_min_tokens_bad_words_stops_speculative_equals_plain(data):
    n = data.draw(st.integers(1, 5))
    prompts = [data.draw(st.lists(st.integers(2, 63), min_size=1, max_size=20)) for _ in range(n)]
    sps = [data.draw(greedy_params) for _ in range(n)]
    sps = [sp if sp.min_tokens <= sp.max_tokens else SamplingParams(max_tokens=sp.max_tokens)
           for sp in sps]
    plain = engine(None).generate(prompts, sps, use_tqdm=False)
    spec = engine(3).generate(prompts, sps, use_tqdm=False)
    for a, b, sp in zip(plain, spec, sps):
        assert b.token_ids == a.token_ids
        assert b.finish_reason == a.finish_reason
        assert not set(b.token_ids) & set(sp.bad_token_ids)
        if b.finish_reason == "stop":
            assert b.token_ids[-1] in set(sp.stop_token_ids) | (
                set() if sp.ignore_eos else {1})
            assert len(b.token_ids) > sp.min_tokens or sp.min_tokens == 0


def test_penalties_change_the_output():
    """The parameters really reach the device: a strong repetition penalty changes greedy output."""
    prompt = [[9] * 12]
    base = engine(3).generate(prompt, SamplingParams(max_tokens=12, ignore_eos=True),
                              use_tqdm=False)[0].token_ids
    pen = engine(3).generate(prompt, SamplingParams(max_tokens=12, ignore_eos=True,
                                                    repetition_penalty=3.0,
                                                    frequency_penalty=2.0),
                             use_tqdm=False)[0].token_ids
    assert pen != base
    assert len(set(pen)) > len(set(base)) or max(np.bincount(pen)) < max(np.bincount(base))


def test_logprobs_with_speculation_equal_without():
    prompts = [[5, 6, 7], [3], list(range(2, 20))]
    sp = SamplingParams(max_tokens=10, logprobs=3, repetition_penalty=1.2)
    a = engine(None).generate(prompts, sp, use_tqdm=False)
    b = engine(3).generate(prompts, sp, use_tqdm=False)
    for x, y in zip(a, b):
        assert x.token_ids == y.token_ids
        assert len(x.logprobs) == len(x.token_ids) == len(y.logprobs)
        for dx, dy, tok in zip(x.logprobs, y.logprobs, x.token_ids):
            assert set(dx) == set(dy) and tok in dx
            for t in dx:
                assert abs(dx[t] - dy[t]) <= 1e-4
            # the greedy token is the most likely one after penalties
            assert dx[tok] == pytest.approx(max(dx.values()))


def test_sampled_requests_reproducible_and_batch_independent():
    sp = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=123, ignore_eos=True)
    alone = engine(2).generate([[5, 6, 7]], sp, use_tqdm=False)[0].token_ids
    others = SamplingParams(max_tokens=7, temperature=0.7, seed=9)
    mixed = engine(2).generate([[11, 12], [5, 6, 7], [3, 4, 5, 6]], [others, sp, others],
                               use_tqdm=False)[1].token_ids
    assert mixed == alone
    # Same seed without speculation: same distribution, and target_match reproduces it exactly.
    plain = engine(None).generate([[5, 6, 7]], sp, use_tqdm=False)[0].token_ids
    cfg, params = tiny_model(0)
    tm = LLM(model_config=cfg, params=params, max_num_seqs=3, max_model_len=64, block_size=4,
             max_num_batched_tokens=32,
             speculative_config=SpeculativeConfig("mtp", 2, 2, verify_strategy="target_match"))
    assert tm.generate([[5, 6, 7]], sp, use_tqdm=False)[0].token_ids == plain


def test_bad_sampling_values():
    for kw, field in [(dict(temperature=-1.0), "temperature"), (dict(top_p=0.0), "top_p"),
                      (dict(top_k=-2), "top_k"), (dict(min_tokens=5, max_tokens=2), "min_tokens")]:
        with pytest.raises(ValueError, match=field):
            SamplingParams(**kw)
    with pytest.raises(ValueError, match="verify_strategy"):
        SpeculativeConfig("mtp", 2, verify_strategy="typical")
    with pytest.raises(ValueError, match="max_logprobs"):
        engine(None).generate([[3]], SamplingParams(logprobs=5), use_tqdm=False)


def test_draft_sampling():
    """Sampled drafts: greedy requests stay exactly greedy; sampled requests are reproducible and
    independent of their batch mates (the distribution itself is checked in
    test_verify_distribution.py with the same verify and draft_sample functions)."""
    cfg, params = tiny_model(0)
    llm = LLM(model_config=cfg, params=params, max_num_seqs=3, max_model_len=64, block_size=4,
              max_num_batched_tokens=32,
              speculative_config=SpeculativeConfig("mtp", 2, 2, draft_sampling=True,
                                                   draft_temperature=1.5))
    prompts = [[5, 6, 7], [3], list(range(2, 20))]
    greedy = SamplingParams(max_tokens=10)
    assert ([o.token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
            == [o.token_ids for o in engine(None).generate(prompts, greedy, use_tqdm=False)])
    sp = SamplingParams(max_tokens=10, temperature=1.0, seed=5, ignore_eos=True)
    alone = llm.generate([[5, 6, 7]], sp, use_tqdm=False)[0]
    mixed = llm.generate([[9, 9], [5, 6, 7]], [SamplingParams(max_tokens=4, temperature=0.5,
                                                              seed=1), sp], use_tqdm=False)[1]
    assert mixed.token_ids == alone.token_ids and len(alone.token_ids) == 10
    with pytest.raises(ValueError, match="draft_sampling"):
        SpeculativeConfig("custom", 2, drafter=lambda s: None, draft_sampling=True)
