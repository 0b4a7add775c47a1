"""Greedy output with speculation is token-identical to greedy output without it."""
from __future__ import annotations

import functools

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from jmtp.runtime.config import SpeculativeConfig
from jmtp.runtime.host.llm import LLM, SamplingParams
from tests.engines import GROUPS, tiny_llm
from tests.runtime.conftest import reference_greedy, tiny_model, free_blocks

# the 3-slot canonical shapes (tests/engines.py): plain and K=M=3 are shared with other modules
pytestmark = GROUPS["plain"]

MAX_LEN = 96
CANONICAL = {(None, None): "plain", (3, 3): "mtp3"}


@functools.lru_cache(maxsize=None)
def engine(k: int | None, m: int | None, seed: int = 0):
    if (k, m) in CANONICAL:
        return tiny_llm(CANONICAL[k, m], seed)
    cfg, params = tiny_model(seed)       # K=1 and M<K: shapes of this module alone
    return LLM(model_config=cfg, params=params, speculative_config=SpeculativeConfig("mtp", k, m),
               max_num_seqs=3, max_model_len=MAX_LEN, block_size=4, max_num_batched_tokens=48)


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
    ec = engine(k, m).llm_engine.engine_config
    assert free_blocks(engine(k, m)) == ec.num_blocks



MOE_PROMPTS = [list(range(2, 40)), [5, 6, 7], [9] * 21, [30, 31, 32, 33, 34]]


@functools.lru_cache(maxsize=None)
def _moe_run(k: int | None, moe_backend: str | None = None):
    """Greedy tokens of the tiny MoE target (plain when ``k`` is None), whether a request was
    preempted, and the free blocks at the end."""
    from tests.runtime.conftest import TINY_MOE
    cfg, params = tiny_model(1, **TINY_MOE)
    llm = LLM(model_config=cfg, params=params,
              speculative_config=SpeculativeConfig("mtp", k, k) if k else None,
              max_num_seqs=4, max_model_len=MAX_LEN, block_size=4, num_blocks=20,
              max_num_batched_tokens=16, moe_backend=moe_backend)
    eng = llm.llm_engine
    outs = llm.generate(MOE_PROMPTS, SamplingParams(max_tokens=16, ignore_eos=True), use_tqdm=False)
    return ([o.token_ids for o in outs], eng.get_stats()["num_preemptions"] > 0,
            free_blocks(llm))


@pytest.mark.parametrize("k,moe_backend", [(1, "ragged"), (3, None)])
def test_moe_target_speculative_equals_plain_with_chunked_prefill_and_preemption(k, moe_backend):
    """A tiny MoE target (conftest.TINY_MOE: dense first layer, MoE layers, MoE MTP layer): greedy
    MTP speculation gives the plain engine's tokens and the non-paged reference's, with prompts
    longer than the 16-token step budget (chunked prefill) and too few KV blocks (20 of 4 tokens)
    for all requests at once (preemption). The plain engine runs the default experts ("auto":
    the dense reference on CPU), the K=1 engine the ragged_dot ones (``moe_backend``), so the two
    implementations also agree token for token."""
    from tests.runtime.conftest import TINY_MOE
    cfg, params = tiny_model(1, **TINY_MOE)
    with pytest.raises(ValueError, match="moe_backend"):
        LLM(model_config=cfg, params=params, moe_backend="megablox")
    plain, plain_preempted, plain_free = _moe_run(None)
    spec, spec_preempted, spec_free = _moe_run(k, moe_backend)
    assert plain_preempted and spec_preempted, "the block budget was meant to force preemption"
    assert plain_free == spec_free == 20
    assert spec == plain
    assert plain == [reference_greedy(cfg, params, p, 16, stop_ids=()) for p in MOE_PROMPTS]
