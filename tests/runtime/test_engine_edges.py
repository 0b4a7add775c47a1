"""Engine behaviour with controlled drafters: oracle / null drafts, stops, limits, blocks, one graph."""
from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
import pytest

from jmtp.model.llama import KVCache
from jmtp.runtime.config import SpeculativeConfig
from jmtp.runtime.device.buckets import step_buckets
from jmtp.runtime.host.llm import LLM, SamplingParams
from tests.engines import GROUPS, tiny_llm
from tests.runtime.conftest import reference_greedy, tiny_model, free_blocks, engine_of

# Engines here run the suite's compile mode (tests/conftest.py: one step program, the largest
# bucket) except the one-graph tests, which are about buckets and say compile="lazy" themselves.

K = 3
MAX_LEN = 64


def oracle_drafter(references: list[list[int]], buf_len: int, b: int):
    """Drafts the reference continuation of the request in slot i (requests fill slots in order)."""
    table = np.full((b, buf_len + K + 1), 5, np.int32)
    for i, seq in enumerate(references):
        table[i, : len(seq)] = seq
    table = jnp.asarray(table)

    def drafter(state):
        seq_len = state.prompt_lens + state.step_idx
        idx = seq_len[:, None] + jnp.arange(K)[None]
        return jnp.take_along_axis(table, idx, axis=1)

    return drafter


def make_llm(drafter, **kw):
    cfg, params = tiny_model(kw.pop("seed", 0), **kw.pop("model_kw", {}))
    spec = SpeculativeConfig("custom", K, drafter=drafter)
    return cfg, params, LLM(model_config=cfg, params=params, speculative_config=spec,
                            max_num_seqs=kw.pop("max_num_seqs", 4), max_model_len=MAX_LEN,
                            block_size=kw.pop("block_size", 4), max_num_batched_tokens=16, **kw)


PROMPTS = [[5, 6, 7], [3], list(range(2, 30)), [9] * 11]


def _refs(cfg, params, prompts, n, **kw):
    return [reference_greedy(cfg, params, p, n, **kw) for p in prompts]


def test_oracle_drafts_accept_everything():
    cfg, params = tiny_model(0)
    # ignore EOS so every request runs its full length and each window is fully accepted
    outs_ref = _refs(cfg, params, PROMPTS, 21, stop_ids=())
    drafter = oracle_drafter([p + o for p, o in zip(PROMPTS, outs_ref)], MAX_LEN + K + 1, 4)
    _, _, llm = make_llm(drafter)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=21, ignore_eos=True), use_tqdm=False)
    for o, r in zip(outs, outs_ref):
        assert o.token_ids == r
        m = o.metrics
        # 1 token from prefill, then 5 steps of K+1 = 4 tokens.
        assert m.num_decode_steps == 5 and m.num_decode_tokens == 20
        assert m.accepted_per_position == [5, 5, 5]
        assert m.num_accepted_tokens == m.num_draft_tokens == 15
        assert m.mean_acceptance_length == K + 1


def test_null_drafts_accept_nothing():
    cfg, params = tiny_model(0)
    outs_ref = _refs(cfg, params, PROMPTS, 15, stop_ids=())
    used = {t for o in outs_ref for t in o}
    wrong = next(t for t in range(2, 64) if t not in used)
    _, _, llm = make_llm(lambda s: jnp.full((s.stop_flags.shape[0], K), wrong, jnp.int32))
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=15, ignore_eos=True), use_tqdm=False)
    for o, r in zip(outs, outs_ref):
        assert o.token_ids == r
        assert o.metrics.mean_acceptance_length == 1.0
        assert o.metrics.num_accepted_tokens == 0
        # Drafts never reach past max_tokens: with j tokens generated, at most 15 - j - 1 drafts.
        assert o.metrics.num_decode_steps == 14
        assert o.metrics.num_draft_tokens == sum(min(K, 15 - j - 1) for j in range(1, 15))


@pytest.mark.parametrize("eos_index,what", [(1, "draft 0"), (3, "draft K-1"), (4, "bonus")])
def test_eos_inside_window_ends_output_exactly(eos_index, what):
    """With all drafts accepted, step 1 emits generated tokens 1..4: d1, d2, d3 and the bonus."""
    cfg, params = tiny_model(0)
    prompt = None
    for cand in ([5, 6, 7], [9] * 11, list(range(2, 30)), [3], [11, 12], [40, 41, 42, 43]):
        out = reference_greedy(cfg, params, cand, 8, stop_ids=())
        if out[eos_index] not in out[:eos_index]:
            prompt = cand
            break
    assert prompt is not None, "no prompt with a fresh token at that index"
    eos = out[eos_index]
    full = prompt + out
    cfg2 = cfg.replace(eos_token_ids=(eos,))
    spec = SpeculativeConfig("custom", K, drafter=oracle_drafter([full], MAX_LEN + K + 1, 2))
    llm = LLM(model_config=cfg2, params=params, speculative_config=spec, max_num_seqs=2,
              max_model_len=MAX_LEN, block_size=4, max_num_batched_tokens=16)
    (o,) = llm.generate([prompt], SamplingParams(max_tokens=8), use_tqdm=False)
    assert o.token_ids == out[: eos_index + 1], what
    assert o.finish_reason == "stop"
    m = o.metrics
    assert m.num_decode_tokens == eos_index  # tokens after the prefill token, EOS included
    assert m.num_accepted_tokens == min(eos_index, K)  # only committed drafts count
    assert free_blocks(llm) == llm.llm_engine.engine_config.num_blocks


@functools.lru_cache(maxsize=None)
def _prompts_oracle():
    """The oracle drafter of PROMPTS' 30-token references: one function object, so the engines
    of test_max_tokens_never_exceeded have one configuration and share their compiled steps."""
    cfg, params = tiny_model(0)
    refs = _refs(cfg, params, PROMPTS, 30, stop_ids=())
    return oracle_drafter([p + o for p, o in zip(PROMPTS, refs)], MAX_LEN + K + 1, 4)


@pytest.mark.xdist_group("edges_max_tokens")
@pytest.mark.parametrize("max_tokens", [1, 2, K, K + 1, K + 2])
def test_max_tokens_never_exceeded(max_tokens, kept_engines):
    cfg, params = tiny_model(0)
    refs = _refs(cfg, params, PROMPTS, 30, stop_ids=())
    _, _, llm = make_llm(_prompts_oracle())      # a fresh engine, compiled steps shared
    kept_engines.append(llm)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                        use_tqdm=False)
    for o, r in zip(outs, refs):
        assert o.token_ids == r[:max_tokens]
        assert o.finish_reason == "length"


@pytest.mark.parametrize("room", [1, 2, K, K + 1])
def test_prompt_near_max_model_len_finishes_with_length(room):
    """A prompt leaving fewer than K+1 positions: generation stops at max_model_len exactly."""
    cfg, params = tiny_model(0)
    prompt = [int(x) for x in np.random.default_rng(room).integers(2, 64, MAX_LEN - room)]
    ref = reference_greedy(cfg, params, prompt, 50, stop_ids=(), max_model_len=MAX_LEN)
    assert len(ref) == room
    _, _, llm = make_llm(oracle_drafter([prompt + ref], MAX_LEN + K + 1, 4))
    (o,) = llm.generate([prompt], SamplingParams(max_tokens=50, ignore_eos=True), use_tqdm=False)
    assert o.token_ids == ref and o.finish_reason == "length"
    assert len(o.prompt_token_ids) + len(o.token_ids) == MAX_LEN


@GROUPS["mtp2"]            # the canonical MTP K=2 shape (tests/engines.py), compiled once
def test_one_token_prompt_with_mtp(tiny, kept_engines):
    cfg, params = tiny
    llm = tiny_llm("mtp2")
    kept_engines.append(llm)
    (o,) = llm.generate([[7]], SamplingParams(max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert o.token_ids == reference_greedy(cfg, params, [7], 6, stop_ids=())


@pytest.mark.xdist_group("edges_no_write")       # one configuration, compiled once
@pytest.mark.parametrize("offset", [K, 1])  # len % block_size in {block_size - K, block_size - 1}
def test_no_write_outside_own_blocks(offset, kept_engines):
    """Poison every block with NaN: only the request's own blocks are written, and the output is
    still exact (a NaN read would spread into the logits)."""
    bs = 8
    cfg, params = tiny_model(0)
    prompt = [int(x) for x in np.random.default_rng(offset).integers(2, 64, 2 * bs - offset)]
    ref = reference_greedy(cfg, params, prompt, 9, stop_ids=())
    llm = LLM(model_config=cfg, params=params, speculative_config=SpeculativeConfig("mtp", K, K),
              max_num_seqs=2, max_model_len=MAX_LEN, block_size=bs, max_num_batched_tokens=32)
    kept_engines.append(llm)                    # a fresh engine, compiled steps shared
    run = llm.llm_engine.runner
    nan = lambda c: KVCache(jnp.full_like(c.k, jnp.nan), jnp.full_like(c.v, jnp.nan))
    run.cache, run.mtp_cache = nan(run.cache), nan(run.mtp_cache)
    (o,) = llm.generate([prompt], SamplingParams(max_tokens=9, ignore_eos=True), use_tqdm=False)
    assert o.token_ids == ref
    final_len = len(prompt) + len(ref)
    # Blocks ever owned: at most those covering the last window (final_len + K + M overhang).
    max_owned = -(-(final_len + 2 * K) // bs)
    touched = ~np.all(np.isnan(np.asarray(run.cache.k)), axis=(0, 2, 3))
    touched_mtp = ~np.all(np.isnan(np.asarray(run.mtp_cache.k)), axis=(0, 2, 3))
    assert 0 < touched.sum() <= max_owned
    assert touched_mtp.sum() <= max_owned
    assert set(np.flatnonzero(touched_mtp)) <= set(np.flatnonzero(touched)) | set(
        np.flatnonzero(touched_mtp))
    assert free_blocks(llm) == llm.llm_engine.engine_config.num_blocks
    assert int(run.state.free_count) == llm.llm_engine.engine_config.num_blocks


def test_preemption_when_blocks_run_out(tiny):
    """Too few blocks for all requests at once: requests wait or are preempted, none is lost."""
    cfg, params = tiny
    prompts = [[5, 6, 7, 8, 9], [3, 4], [10] * 9, [20, 21, 22]]
    refs = _refs(cfg, params, prompts, 24, stop_ids=())
    llm = LLM(model_config=cfg, params=params, speculative_config=SpeculativeConfig("mtp", 2, 2),
              max_num_seqs=4, max_model_len=MAX_LEN, block_size=4, num_blocks=12,
              max_num_batched_tokens=32)
    preempted = []
    eng = llm.llm_engine
    real = eng.scheduler.victim
    eng.scheduler.victim = lambda shard: (preempted.append(b := real(shard)), b)[1]
    outs = llm.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True), use_tqdm=False)
    assert preempted, "the block budget was meant to force a preemption"
    assert [o.token_ids for o in outs] == refs
    assert free_blocks(llm) == 12


@pytest.mark.parametrize("model", ["dense", "moe"])
def test_one_graph_no_recompiles_and_no_callbacks(tiny, model):
    """Warm-up compiles exactly the buckets of ``step_buckets`` (each run once on the idle state);
    random traffic afterwards (prefills, 1..4 decoding slots, preemption-free) compiles nothing.
    ``moe``: the same on the tiny MoE target (conftest.TINY_MOE, its FFN chosen per layer), on 2
    slots (fewer buckets: its unrolled layers compile slowly)."""
    from tests.runtime.conftest import TINY_MOE
    cfg, params = tiny if model == "dense" else tiny_model(1, **TINY_MOE)
    slots = 4 if model == "dense" else 2
    # the synchronous loop: it sizes each window's rows exactly, so narrow buckets come up
    # (asynchronous scheduling plans a window's bound, the budget: test_async_engine_real.py)
    llm = LLM(model_config=cfg, params=params, speculative_config=SpeculativeConfig("mtp", 2, 2),
              max_num_seqs=slots, max_model_len=MAX_LEN, block_size=4, max_num_batched_tokens=32,
              async_scheduling=False, compile="lazy")
    ec = llm.llm_engine.engine_config
    rng = np.random.default_rng(0)
    batch = lambda n: [list(rng.integers(2, 64, rng.integers(1, 30))) for _ in range(n)]
    before = engine_of(llm).runner.jitted_step._cache_size()  # the jit cache is shared with other engines of the process
    run = engine_of(llm).runner
    for bucket in step_buckets(ec):   # idle state: every step is a no-op
        run.state, caches, _ = run.jitted_step(*run.step_args(bucket))
        run.cache, run.mtp_cache = caches.target, caches.mtp
    compiled = engine_of(llm).runner.jitted_step._cache_size()
    # 4 slots: decode (T, A): (1|2|3, 1), (2|4|6, 2), (4|8|12, 4); prefill (3|6|12|16|32, 4)
    assert compiled - before == len(step_buckets(ec))
    assert slots != 4 or len(step_buckets(ec)) == 13
    steps, seen = 0, set()
    real = engine_of(llm).runner.jitted_step
    engine_of(llm).runner.jitted_step = lambda *a: (seen.add(a[0].bucket), real(*a))[1]
    while steps < (100 if slots == 4 else 40):
        llm.generate(batch(int(rng.integers(1, 7))),
                     SamplingParams(max_tokens=int(rng.integers(1, 12))), use_tqdm=False)
        steps += llm.last_run_stats["steps"]
    assert real._cache_size() == compiled
    assert {b.num_slots for b in seen} >= {1, 2, 4} - {4 if slots == 2 else 0}, seen  # narrow ones
    hlo = real.lower(*run.step_args(step_buckets(ec)[0])).as_text()
    assert "callback" not in hlo.lower()


def test_bad_input_raises_before_running(tiny):
    cfg, params = tiny
    llm = tiny_llm("mtp2")
    calls = []
    engine_of(llm).runner.jitted_step = lambda *a: calls.append(a)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], use_tqdm=False)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([[3] * MAX_LEN], use_tqdm=False)
    with pytest.raises(ValueError, match="vocab_size"):
        llm.generate([[3, 999]], use_tqdm=False)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="num_model_steps"):
        SpeculativeConfig("mtp", 2, 3)
    with pytest.raises(ValueError, match="method"):
        SpeculativeConfig("eagle9", 2)
    with pytest.raises(ValueError):
        LLM("/nonexistent/model.gguf")
    with pytest.raises(ValueError, match="flat list of ints"):
        llm.generate([[3.7, 4.2]], use_tqdm=False)
    with pytest.raises(TypeError, match="SamplingParams"):
        llm.generate([[3, 4]], {"max_tokens": 3}, use_tqdm=False)
    with pytest.raises(ValueError, match="block_size"):
        LLM(model_config=cfg, params=params, block_size=0)
    with pytest.raises(ValueError, match="attention_backend"):
        LLM(model_config=cfg, params=params, attention_backend="cuda_magic")
    with pytest.raises(ValueError, match="eh_proj|embed|missing|shape"):
        LLM(model_config=cfg.replace(vocab_size=128), params=params)
    assert not calls  # nothing ran


@GROUPS["mtp2"]            # the canonical MTP K=2 shape (tests/engines.py), compiled once
@pytest.mark.parametrize("fail_in", ["insert", "release"])
def test_failing_device_call_loses_no_request(tiny, fail_in, kept_engines):
    """A device call that raises (the request insert while admitting, or the slot release while
    aborting) leaves the host's bookkeeping as it was: the error reaches the caller unchanged, the
    request can still be aborted or run, and no KV block leaks. (Before the fix the insert's
    failure left ``seq.slot`` set on an unrecorded slot, so the abort in ``LLM.generate`` died in
    ``list.remove`` and hid the real error.)"""
    cfg, params = tiny
    llm = tiny_llm("mtp2")
    kept_engines.append(llm)
    eng = llm.llm_engine
    real = getattr(eng.runner, fail_in)
    calls = []

    def fail_once(*a):
        calls.append(a)
        if len(calls) == 1:
            raise RuntimeError("injected device failure")
        return real(*a)

    setattr(eng.runner, fail_in, fail_once)
    sp = SamplingParams(max_tokens=6, ignore_eos=True)
    if fail_in == "insert":
        eng.add_request("a", [5, 6, 7], sp)
        with pytest.raises(RuntimeError, match="injected"):
            eng.step()
        sch = eng.scheduler
        assert len(eng.requests.waiting) == 1 and all(s is None for s in sch.slots)
        assert not sch.order
        assert eng.requests.waiting[0].slot is None
        # the request was not lost: the next step admits and runs it to the reference output
        outs = []
        while eng.has_unfinished_requests():
            outs += [o for o in eng.step() if o.finished]
        assert outs[0].outputs[0].token_ids == reference_greedy(cfg, params, [5, 6, 7], 6,
                                                                stop_ids=())
    else:
        eng.add_request("a", [5, 6, 7], sp)
        eng.step()                                    # admitted and prefilled: owns blocks
        b = eng.scheduler.order[0]
        with pytest.raises(RuntimeError, match="injected"):
            eng.abort_request("a")
        # the host still sees the slot occupied; the abort is retried and frees the blocks
        assert eng.scheduler.slots[b] is not None and eng.scheduler.order == [b]
        assert eng.has_unfinished_requests()
        eng.abort_request("a")
        assert not eng.has_unfinished_requests()
        assert all(s is None for s in eng.scheduler.slots)
    assert free_blocks(eng) == eng.engine_config.num_blocks
    assert int(eng.runner.state.free_count) == eng.engine_config.num_blocks
