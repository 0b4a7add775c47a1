"""Asynchronous scheduling on the real engine (tiny random models): outputs identical with
``async_scheduling`` on and off for every method, and per-request caps without recompiling.
(With the dynamic policy only greedy requests: see :func:`mix`.)

One engine per method (MTP, n-gram, hybrid MTP + n-gram, the dynamic policy), with prefix
caching on and few KV blocks (requests are preempted and resumed), serves one mix twice, the
synchronous loop first: greedy, seeded sampled (``n=2`` too), a stop string, a structured-output
constraint (the engine reads the step in flight and runs those steps synchronously) and a
repeated prompt (prefix-cache hits). Every token, text and finish reason must be equal, and the
asynchronous run must really have dispatched steps ahead (its timeline). The (2, 2) mesh and the
2-process job are checked in ``test_sharding.py`` / ``test_multiprocess.py`` (their workers run
both loops), the server in ``test_serve_multiprocess.py``.
"""
from __future__ import annotations

import functools

import jax.numpy as jnp
import pytest

from jmtp import LLM, SamplingParams, SpeculativeConfig
from jmtp.runtime.host.structured import StructuredOutputsParams as SOP

from conftest import tiny_model
from structured_fixtures import VOCAB_SIZE, tiny_tokenizer

pytestmark = [pytest.mark.compile_lazy, pytest.mark.xdist_group("async_engine_real")]

# (plain decoding: the fake-runner tests, and the (2, 2) mesh and 2-process workers, K=0)
SPECS = {"mtp3": SpeculativeConfig("mtp", 3),
         "ngram3": SpeculativeConfig("ngram", 3),
         "hybrid3.1": SpeculativeConfig("mtp", 3, 1, mtp_strategy="with_ngram"),
         "dynamic-mtp3": SpeculativeConfig("mtp", 3, speculation_policy="dynamic")}


@functools.lru_cache(maxsize=None)
def engine(method: str) -> LLM:
    cfg, params = tiny_model(0, vocab_size=VOCAB_SIZE)
    return LLM(model_config=cfg, params=params, tokenizer=tiny_tokenizer(),
               speculative_config=SPECS[method], max_num_seqs=2, max_model_len=48,
               block_size=4, num_blocks=9, max_num_batched_tokens=8,
               enable_prefix_caching=True, compile="lazy", layer_loop="scan",
               dtype=jnp.float32)


PROMPTS = ["ab ab ab", "hello there", "name: age", "zz zz", "ab ab ab"]


def mix(greedy_only: bool = False) -> list[SamplingParams]:
    """Greedy (a long one: preemption), seeded sampled with ``n=2``, a structured-output
    constraint, a stop string, seeded sampled; ``greedy_only``: every request greedy (the
    dynamic policy's draft limits follow its timings, and a sampled token depends on the drafts
    it was verified against: its seeded outputs differ between any two runs, synchronous ones
    too)."""
    t = (lambda x: 0.0) if greedy_only else (lambda x: x)
    return [SamplingParams(max_tokens=20, ignore_eos=True),
            SamplingParams(max_tokens=12, temperature=t(0.8), seed=7, n=2, ignore_eos=True),
            SamplingParams(max_tokens=12, structured_outputs=SOP(json_object=True)),
            SamplingParams(max_tokens=10, stop=["a", "e"]),
            SamplingParams(max_tokens=10, temperature=t(0.7), seed=3)]


def _answers(outs) -> list:
    return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in o.outputs]
            for o in outs]


@pytest.mark.parametrize("method", list(SPECS))
def test_async_scheduling_outputs_equal_the_synchronous_loop(method):
    llm = engine(method)
    eng = llm.llm_engine
    eng.async_scheduling = False
    requests = mix(greedy_only=method.startswith("dynamic"))
    sync = _answers(llm.generate(PROMPTS, requests, use_tqdm=False))
    eng.async_scheduling = True
    eng.timeline.clear()
    eng.timeline.enable()
    try:
        got = _answers(llm.generate(PROMPTS, requests, use_tqdm=False))
    finally:
        eng.timeline.disable()
    assert got == sync
    steps = eng.timeline.steps
    assert sum(t.mode == "async" for t in steps) > len(steps) // 2
    assert any(t.mode == "sync" for t in steps)       # the constrained request's steps
    st = eng.get_stats()
    assert st["num_preemptions"] > 0 and st["prefix_cache_hit_tokens"] > 0
    assert st["num_free_blocks"] + st["num_cached_blocks"] == eng.engine_config.num_blocks


def test_per_request_caps_run_in_the_compiled_buckets():
    """Caps 0, 1 and K in one batch: greedy tokens equal the uncapped ones, each request's
    drafts per step stay within its cap, and no step compiles anything the uncapped run did not
    need beyond its own buckets (one executable per bucket run: the cap is a data input). The
    jit cache is shared with the live engines of the same device configuration (this module's
    dynamic-policy engine: ``EngineConfig.device_config``), so what these runs add is counted."""
    llm = engine("mtp3")
    eng = llm.llm_engine
    run = eng.runner
    before, compiled = run.jitted_step._cache_size(), run.compiled_buckets
    prompts = PROMPTS[:4]
    free = llm.generate(prompts, SamplingParams(max_tokens=12), use_tqdm=False)
    caps = [0, 1, 3, None]
    capped = llm.generate(prompts, [SamplingParams(max_tokens=12, num_speculative_tokens=c)
                                    for c in caps], use_tqdm=False)
    for a, b, cap in zip(free, capped, caps):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        assert b.metrics.max_drafts_per_step <= (3 if cap is None else cap)
        if cap == 0:
            assert b.metrics.num_draft_tokens == 0
    assert capped[2].metrics.max_drafts_per_step == 3
    assert run.jitted_step._cache_size() - before == len(run.compiled_buckets - compiled)
