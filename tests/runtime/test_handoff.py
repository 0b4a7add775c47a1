"""Prefill -> decode hand-off (jmtp.runtime.host.handoff): a request prefilled on one LLM and decoded on
another gives the tokens and the per-position acceptance of decoding it on one LLM."""
from __future__ import annotations

import dataclasses
import io
import json

import numpy as np
import pytest

from jmtp.runtime.config import SpeculativeConfig
from jmtp.runtime.host.handoff import HANDOFF_VERSION, RequestState
from jmtp.runtime.host.llm import LLM, SamplingParams
from tests.runtime.conftest import tiny_model, free_blocks

pytestmark = pytest.mark.xdist_group("handoff_engines")   # one worker builds the shared engines once

MAX_LEN = 48
PROMPTS = [[5, 6, 7, 8, 9], list(range(2, 15))]
GREEDY = SamplingParams(max_tokens=16)
# temperature 3 flattens target and draft distributions, so the random MTP head's sampled drafts
# are accepted at several positions (rejection sampling with the exact draft q)
SAMPLED = SamplingParams(max_tokens=16, temperature=3.0, seed=7)

_engines: dict = {}


@pytest.fixture(scope="module", autouse=True)
def _drop_engines():
    yield
    _engines.clear()


def make(k: int, *, seed: int = 0, **kw) -> LLM:
    cfg, params = tiny_model(seed)
    spec = SpeculativeConfig("mtp", k, k, draft_sampling=True)
    args = dict(max_num_seqs=1, max_model_len=MAX_LEN, block_size=4, max_num_batched_tokens=16)
    args.update(kw)
    return LLM(model_config=cfg, params=params, speculative_config=spec, **args)


def pair(k: int) -> tuple[LLM, LLM]:
    """(prefill LLM, decode LLM) for K = k: 1 slot and the default KV blocks vs 2 slots and 30
    blocks. The prefill LLM is also the one-LLM reference."""
    if k not in _engines:
        _engines[k] = (make(k), make(k, max_num_seqs=2, num_blocks=30))
    return _engines[k]


def _wire(states: list[RequestState]) -> list[RequestState]:
    """Through bytes, as across processes."""
    return [RequestState.from_bytes(s.to_bytes()) for s in states]


# K=2 went in session 21 (the suite's 30-minute budget): its path is K=3's with one draft fewer,
# and the int8 and scan/unrolled hand-offs below run K=2
@pytest.mark.parametrize("k", [1, 3])
def test_prefill_on_one_llm_decode_on_another(k):
    a, b = pair(k)
    total_b = b.llm_engine.engine_config.num_blocks
    for sp, name in ((GREEDY, "greedy"), (SAMPLED, "sampled")):
        ref = a.generate(PROMPTS, sp, use_tqdm=False)
        states = a.prefill(PROMPTS, sp)
        # nothing stays on the exporter
        assert free_blocks(a) == a.llm_engine.engine_config.num_blocks
        assert not a.llm_engine.has_unfinished_requests()
        for st, r in zip(states, ref):
            assert not st.finished and st.version == HANDOFF_VERSION
            assert st.output_token_ids == r.token_ids[:1]         # the prefill's first token
            assert st.num_pages > 0 and st.kv["mtp_k"].shape[1] == st.num_pages
            assert int(np.sum(st.row["draft_tokens"][1:] >= 0)) == k   # the first drafts
            assert st.row["draft_probs"].shape == (k, a.model_config.vocab_size)
        outs = b.import_request(_wire(states), use_tqdm=False)
        for r, o in zip(ref, outs):
            assert o.token_ids == r.token_ids, name
            assert o.finish_reason == r.finish_reason
            assert o.metrics.accepted_per_position == r.metrics.accepted_per_position, name
            assert o.metrics.num_draft_tokens == r.metrics.num_draft_tokens
            assert o.metrics.num_decode_steps == r.metrics.num_decode_steps
        if name == "sampled":    # the comparison covers accepted drafts
            assert sum(sum(r.metrics.accepted_per_position) for r in ref) > 0
        assert free_blocks(b) == total_b


@pytest.mark.parametrize("k", [1, 3])
def test_first_step_after_import_verifies_drafts(k):
    a, b = pair(k)
    ref = a.generate(PROMPTS[:1], SAMPLED, use_tqdm=False)[0]
    state = a.llm_engine.prefill_request("r1", PROMPTS[0], SAMPLED)      # the engine-level API
    assert state.request_id == "r1" and not a.llm_engine.has_unfinished_requests()
    engine = b.llm_engine
    engine.import_request(state)
    with pytest.raises(ValueError, match="already in use"):
        engine.import_request(state)
    outs = engine.step()
    if not outs and engine.async_scheduling:   # the first step's outputs come with the second
        outs = engine.step()
    (out,) = outs
    assert out.request_id == "r1"
    assert out.metrics.num_decode_steps == 1
    assert out.metrics.num_draft_tokens == k                  # the imported window, verified
    n = 1 + 1 + out.metrics.num_accepted_tokens               # first token + accepted + bonus
    assert out.token_ids == ref.token_ids[:n]
    while engine.has_unfinished_requests():
        for o in engine.step():
            out = o
    assert out.finished and out.token_ids == ref.token_ids


def test_request_finished_in_prefill_hands_off_finished():
    a, b = pair(1)
    sp = SamplingParams(max_tokens=1)
    ref = a.generate(PROMPTS, sp, use_tqdm=False)
    states = a.prefill(PROMPTS, sp)
    assert all(s.finished and s.num_pages == 0 and s.finish_reason == "length" for s in states)
    outs = b.import_request(_wire(states), use_tqdm=False)
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
    assert all(o.finish_reason == "length" for o in outs)


def test_states_from_two_exporters_and_abort_of_a_finished_import():
    """Two prefill LLMs number their requests alike (each starts at ``prefill-0-0``): one decode
    LLM takes states with equal ids (it names imports itself). A finished import that is aborted
    before the next step is never returned."""
    a, b = pair(1)
    states = a.prefill(PROMPTS[:1], GREEDY) + a.prefill(PROMPTS[1:], GREEDY)
    # as if from a second exporter: the same request_id
    states[1] = dataclasses.replace(states[1], request_id=states[0].request_id)
    outs = b.import_request(_wire(states), use_tqdm=False)
    ref = a.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
    (done,) = a.prefill(PROMPTS[:1], SamplingParams(max_tokens=1))
    eng = b.llm_engine
    eng.import_request(done, request_id="x")
    eng.abort_request("x")
    assert not eng.has_unfinished_requests() and eng.step() == []


def test_mismatched_states_are_refused():
    a, b = pair(3)
    (state,) = a.prefill(PROMPTS[:1], GREEDY)
    with pytest.raises(ValueError, match="version"):
        b.import_request(dataclasses.replace(state, version=HANDOFF_VERSION + 1))
    # an archive written by another layout version
    npz = np.load(io.BytesIO(state.to_bytes()))
    arrays = {k: npz[k] for k in npz.files}
    meta = json.loads(bytes(arrays["__meta__"]).decode())
    meta["version"] = HANDOFF_VERSION + 1
    arrays["__meta__"] = np.frombuffer(json.dumps(meta).encode(), np.uint8)
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    with pytest.raises(ValueError, match="version"):
        RequestState.from_bytes(buf.getvalue())
    with pytest.raises(ValueError, match="not a jmtp hand-off archive"):
        RequestState.from_bytes(b"not an archive")
    # a row without a field this engine's state has (a layout change without a version bump:
    # the row of version 1 lacked actual_draft_token_num) is refused before it is queued
    old_row = {k: v for k, v in state.row.items() if k != "actual_draft_token_num"}
    with pytest.raises(ValueError, match="lacks actual_draft_token_num"):
        b.import_request(dataclasses.replace(state, row=old_row))
    # another K, other weights, another block size: refused, naming what differs
    with pytest.raises(ValueError, match=r"spec\.k"):
        pair(1)[1].import_request(state)
    with pytest.raises(ValueError, match="params"):
        make(3, seed=1).import_request(state)
    with pytest.raises(ValueError, match=r"kv\.block_size"):
        make(3, block_size=8).import_request(state)
    # a max_model_len that would stop the request elsewhere
    long = SamplingParams(max_tokens=40)
    (st_long,) = a.prefill(PROMPTS[:1], long)
    with pytest.raises(ValueError, match="max_model_len"):
        make(3, max_model_len=32).import_request(st_long)
    with pytest.raises(TypeError):
        b.import_request(["state"])
    assert not b.llm_engine.has_unfinished_requests()
    a.llm_engine.add_request("busy", PROMPTS[0], GREEDY)
    with pytest.raises(RuntimeError, match="unfinished"):
        a.llm_engine.prefill_request("r2", PROMPTS[1], GREEDY)
    a.llm_engine.abort_request("busy")
    with pytest.raises(ValueError, match="n=1"):
        a.prefill(PROMPTS[:1], SamplingParams(n=2))
    assert not a.llm_engine.has_unfinished_requests()


def test_int8_cache_waiting_imports_and_preemption():
    """Quantised pages (values + scales) travel; a decode LLM with 2 slots and 16 blocks queues
    the third import and preempts imported requests (recomputed from their tokens), and the
    outputs still equal one-LLM decoding."""
    a = make(2, kv_cache_dtype="int8")
    b = make(2, kv_cache_dtype="int8", max_num_seqs=2, num_blocks=16)
    prompts = PROMPTS + [[3, 4] * 5]
    for sp in (SamplingParams(max_tokens=30, ignore_eos=True),
               SamplingParams(max_tokens=30, temperature=1.0, seed=3, ignore_eos=True)):
        ref = a.generate(prompts, sp, use_tqdm=False)
        states = _wire(a.prefill(prompts, sp))
        assert states[0].kv["target_k"].dtype == np.int8 and "target_k_scale" in states[0].kv
        preempted = b.llm_engine.get_stats()["num_preemptions"]
        outs = b.import_request(states, use_tqdm=False)
        assert b.llm_engine.get_stats()["num_preemptions"] > preempted
        for r, o in zip(ref, outs):
            assert o.token_ids == r.token_ids
        assert free_blocks(b) == 16


def test_failed_device_import_writes_nothing():
    """If the device allocator cannot give an imported request its blocks (the host believed it
    could: a bug, simulated here by emptying the device's free stack), ``import_slot`` must leave
    the state and both caches untouched: no row written, no page scattered (a stale block-table
    row of -1 must not wrap around to the last block)."""
    import jax
    import jax.numpy as jnp

    a, _ = pair(1)
    st = a.prefill(PROMPTS[:1], GREEDY)[0]
    eng = make(1, max_num_seqs=2, num_blocks=30).llm_engine
    eng.runner.state = dataclasses.replace(eng.runner.state, blocks=dataclasses.replace(
        eng.runner.state.blocks, free_count=jnp.int32(0)))
    before = jax.device_get((eng.runner.state, eng.runner.cache, eng.runner.mtp_cache))
    eng.import_request(st)
    with pytest.raises(RuntimeError, match="allocator"):
        eng.step()
    after = jax.device_get((eng.runner.state, eng.runner.cache, eng.runner.mtp_cache))
    for x, y in zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True):
        np.testing.assert_array_equal(x, y)


def test_hand_off_between_a_scan_and_an_unrolled_engine():
    """The layer loop is an implementation choice: a request prefilled on a ``layer_loop="scan"``
    engine (stacked weights, as on TPU/GPU) decodes on an unrolled one (per-layer weights, the
    CPU default) with the one-engine tokens; the weights' digest is the same for both layouts
    and differs for other weights."""
    from jmtp.runtime.host.handoff import compat_diff, params_digest
    a = make(2, layer_loop="scan")
    b = make(2, max_num_seqs=2, num_blocks=30, layer_loop="unrolled")
    assert (a.llm_engine.layer_loop, b.llm_engine.layer_loop) == ("scan", "unrolled")
    assert params_digest(a.llm_engine.runner.params) == params_digest(b.llm_engine.runner.params)
    assert params_digest(make(2, seed=1, layer_loop="unrolled").llm_engine.runner.params) != \
        params_digest(b.llm_engine.runner.params)
    ref = a.generate(PROMPTS, GREEDY, use_tqdm=False)
    states = a.prefill(PROMPTS, GREEDY)
    assert compat_diff(states[0].compat, b.llm_engine.handoff.compat()) == []
    outs = b.import_request(_wire(states), use_tqdm=False)
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
