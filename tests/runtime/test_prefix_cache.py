"""Prefix caching with MTP (``LLMEngine(enable_prefix_caching=True)``): greedy outputs, MTP drafts
and acceptance identical with the cache on and off over multi-turn chats that share prefixes;
the hash chain; a hypothesis lifecycle test of the host-side cache against the device allocator
(reference counts back to zero, no block lost or held twice, cached blocks never written)."""
from __future__ import annotations

import hashlib

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from jmtp import LLMEngine
from jmtp.runtime.config import SpeculativeConfig
from jmtp.runtime.host.llm import SamplingParams
from jmtp.runtime.host.prefix_cache import PrefixCache, block_keys
from tests.runtime.conftest import reference_greedy, tiny_model, engine_of

pytestmark = pytest.mark.xdist_group("prefix_cache")   # one worker builds the shared engines once

BS = 4
MAX_LEN = 96
VOCAB = 12      # a small vocabulary: the random MTP head's drafts are sometimes accepted
MTP3 = SpeculativeConfig("mtp", 3, 3)


def _engine(spec, caching, **kw):
    cfg, params = tiny_model(0, vocab_size=VOCAB)
    kw.setdefault("max_num_seqs", 2)
    kw.setdefault("max_num_batched_tokens", 16)
    return LLMEngine(model_config=cfg, params=params, speculative_config=spec,
                     max_model_len=MAX_LEN, block_size=BS,
                     compilation_cache_dir=None, enable_prefix_caching=caching, **kw)


def _chats(seed=0):
    """Three two-turn chats over one shared 'system prompt' (17 tokens: not a block multiple)
    and one chat whose system prompt ends on a block boundary (16 tokens)."""
    rng = np.random.default_rng(seed)
    r = lambda n: [int(x) for x in rng.integers(2, VOCAB, n)]
    system = r(17)
    chats = [[system + r(n) for n in (3, 6)], [system + r(5), r(4)], [system[:16] + r(7), r(2)]]
    return chats


def _run_chats(engine, chats, max_tokens=10, record_windows=False):
    """Run every chat turn by turn (turn t+1's prompt = turn t's prompt + its output + new user
    tokens); the chats' turns run concurrently. Returns ({(chat, turn): tokens}, windows) where
    windows[(chat, turn)] lists the draft window the slot held after each of its decode steps."""
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    results, windows = {}, {}
    history = {c: [] for c in range(len(chats))}
    for turn in range(max(len(c) for c in chats)):
        for c, chat in enumerate(chats):
            if turn < len(chat):
                prompt = history[c] + chat[turn]
                engine.add_request(f"{c}-{turn}", prompt, sp)
                history[c] = prompt
        while engine.has_unfinished_requests():
            outs = engine.step()
            if record_windows:
                dt = np.asarray(engine.runner.state.draft_tokens)
                for b, seq in enumerate(engine_of(engine).scheduler.slots):
                    if seq is not None and seq.prefilled >= len(seq.context_ids):
                        windows.setdefault(seq.group.request_id, []).append(dt[b].tolist())
            for o in outs:
                if o.finished:
                    c, t = map(int, o.request_id.split("-"))
                    results[(c, t)] = o.outputs[0].token_ids
                    history[c] = history[c] + o.outputs[0].token_ids
    return results, windows


def _assert_reference_tokens(results, chats, max_tokens=10):
    """Each turn's tokens (``_run_chats``' results) equal the full-forward reference's greedy
    continuation of that turn's prompt (earlier turns' prompts and outputs + its new tokens)."""
    cfg, params = tiny_model(0, vocab_size=VOCAB)
    hist = {}
    for (c, t) in sorted(results):
        prompt = hist.get(c, []) + chats[c][t]
        ref = reference_greedy(cfg, params, prompt, max_tokens, stop_ids=())
        assert results[(c, t)] == ref, (c, t)
        hist[c] = prompt + ref


@pytest.mark.parametrize("spec", [None, MTP3], ids=["plain", "mtp3"])
def test_greedy_identical_with_and_without_prefix_caching(spec):
    """Multi-turn chats sharing prefixes: the same greedy tokens (and the independent
    full-forward reference's) with the cache on and off; with MTP also the same drafts in every
    decode window and the same acceptance counts; a nonzero hit rate."""
    chats = _chats()
    off, on = _engine(spec, False), _engine(spec, True)
    res_off, win_off = _run_chats(off, chats, record_windows=True)
    res_on, win_on = _run_chats(on, chats, record_windows=True)
    assert res_on == res_off
    _assert_reference_tokens(res_off, chats)
    st_off, st_on = off.get_stats(), on.get_stats()
    for key in ("num_draft_tokens", "num_accepted_tokens", "accepted_per_position",
                "num_decode_steps", "num_decode_tokens"):
        assert st_on[key] == st_off[key], key
    if spec is not None:
        assert win_on == win_off     # the MTP cache it read gave the same drafts everywhere
        assert st_on["num_accepted_tokens"] > 0
    assert st_on["prefix_cache_hit_tokens"] > 0
    assert st_on["prefix_cache_hit_rate"] == pytest.approx(
        st_on["prefix_cache_hit_tokens"] / st_on["prefix_cache_queried_tokens"])
    assert st_on["num_steps"] < st_off["num_steps"]     # cached prefixes are not prefilled again


def test_block_keys_hash_chain():
    """Keys are sha256 chains over whole blocks (checked against hashlib directly); a block's key
    depends on every earlier token and, with an MTP cache, on the token after the block."""
    toks = list(range(10, 23))            # 13 tokens, block size 4
    k = block_keys(toks, 4, 10, with_next_token=False)
    assert len(k) == 3
    h0 = hashlib.sha256(b"jmtp-prefix-v1")
    h0.update(np.asarray(toks[:4], np.int64).tobytes())
    h1 = hashlib.sha256(h0.digest())
    h1.update(np.asarray(toks[4:8], np.int64).tobytes())
    assert k[:2] == [h0.digest(), h1.digest()]
    k_next = block_keys(toks, 4, 10, with_next_token=True)
    assert len(k_next) == 3 and k_next[0] != k[0]
    assert len(block_keys(toks[:12], 4, 10, with_next_token=True)) == 2   # block 2 lacks its next
    changed = toks[:1] + [99] + toks[2:]
    assert all(a != b for a, b in zip(block_keys(changed, 4, 10, False), k))
    after = toks[:8] + [99] + toks[9:]     # first token of block 2 changes
    ka = block_keys(after, 4, 10, False)
    assert ka[:2] == k[:2] and ka[2] != k[2]
    kna = block_keys(after, 4, 10, True)
    assert kna[0] == k_next[0] and kna[1] != k_next[1]    # block 1's MTP entry 7 pairs token 8


def test_match_leaves_one_position_and_release_counts():
    pc = PrefixCache(4, 16, with_next_token=False)
    toks = list(range(2, 14))             # 12 tokens: 3 full blocks
    keys = pc.keys(toks, 3)
    pc.insert(keys, [5, 6, 7])
    assert pc.num_evictable == 3
    mk, ids = pc.match(toks)               # 12 tokens: at most 2 blocks (11 // 4), one computed
    assert ids == [5, 6]
    pc.acquire(mk, len(toks))
    assert pc.num_evictable == 1 and pc.ref_count(5) == 1
    assert pc.evict(3) == [7]              # referenced blocks are never evicted
    pc.release(mk)
    assert pc.ref_count(5) == 0
    assert pc.evict(1) == [6]              # the deepest block goes first
    with pytest.raises(ValueError, match="not held"):
        pc.release(mk)
    assert pc.hit_rate == pytest.approx(8 / 12)


# ------------------------------------------------------------------- lifecycle (hypothesis)
def _block_contents(engine, ids):
    out = {}
    run = engine.runner
    caches = [run.cache] + ([run.mtp_cache] if run.mtp_cache is not None else [])
    arrs = [(np.asarray(c.k), np.asarray(c.v)) for c in caches]
    for i in ids:
        out[i] = [(k[:, i].copy(), v[:, i].copy()) for k, v in arrs]
    return out


def _check_invariants(engine, snapshots):
    pc = engine.prefix_caches.caches[0]
    s = jax.device_get(engine.runner.state)
    fs, fc = np.asarray(s.blocks.free_stack), int(s.blocks.free_count)
    bt, no = np.asarray(s.blocks.block_tables), np.asarray(s.blocks.num_owned)
    cached = pc.cached_ids()
    # every block exactly once among the free stack, the owned tables and the cache
    ids = np.concatenate([fs[:fc], bt[np.arange(bt.shape[1])[None] < no[:, None]],
                          np.asarray(cached, np.int64)])
    assert np.array_equal(np.sort(ids), np.arange(engine.engine_config.num_blocks))
    # reference counts: one per running slot that reads the block
    refs = {}
    ns, shared = np.asarray(s.num_shared), np.asarray(s.shared_tables)
    for b, seq in enumerate(engine_of(engine).scheduler.slots):
        if seq is None:
            continue
        assert ns[b] == len(seq.prefix_keys)
        for blk in shared[b, :ns[b]]:
            refs[int(blk)] = refs.get(int(blk), 0) + 1
    for blk in cached:
        assert pc.ref_count(blk) == refs.get(blk, 0)
    # cached blocks (shared or not) are never written: contents as when they were cached
    now = _block_contents(engine, cached)
    for blk in cached:
        if blk not in snapshots:
            snapshots[blk] = now[blk]
        for (k0, v0), (k1, v1) in zip(snapshots[blk], now[blk]):
            assert np.array_equal(k0, k1) and np.array_equal(v0, v1), f"block {blk} written"
    for blk in list(snapshots):
        if blk not in cached:
            del snapshots[blk]


@pytest.fixture(scope="module")
def lifecycle_engine():
    # 40 blocks of 4 for 2 slots of up to 96 positions: the cache must evict to keep going.
    return _engine(MTP3, True, num_blocks=56)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_lifecycle_refcounts_no_leak_no_write(lifecycle_engine, data):
    """Random requests over a few shared prefixes, random lengths and aborts, on an engine with
    few blocks: after every step each block id is exactly once free, owned or cached, every
    cached block's reference count equals the slots reading it, and its target and MTP KV are
    bit-identical to when it was cached; when idle all counts are zero and evicting everything
    gives every block back to the free stack."""
    engine = lifecycle_engine
    pc = engine.prefix_caches.caches[0]
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16), label="seed"))
    bases = [[int(x) for x in rng.integers(2, VOCAB, n)] for n in (9, 12, 20)]
    snapshots: dict = {}
    n_req = data.draw(st.integers(2, 6), label="requests")
    for i in range(n_req):
        base = bases[data.draw(st.integers(0, 2), label="base")]
        cut = data.draw(st.integers(1, len(base)), label="cut")
        prompt = base[:cut] + [int(x) for x in rng.integers(2, VOCAB, data.draw(
            st.integers(0, 9), label="suffix"))]
        engine.add_request(f"r{i}", prompt, SamplingParams(
            max_tokens=data.draw(st.integers(1, 12), label="max_tokens"), ignore_eos=True))
    abort_at = data.draw(st.integers(0, 30), label="abort_at")
    step = 0
    while engine.has_unfinished_requests():
        engine.step()
        step += 1
        if step == abort_at:
            engine.abort_request(f"r{n_req - 1}")
        _check_invariants(engine, snapshots)
    _check_invariants(engine, snapshots)
    assert all(pc.ref_count(b) == 0 for b in pc.cached_ids())
    assert pc.num_evictable == len(pc)
    assert engine.get_stats()["num_free_blocks"] + len(pc) == engine.engine_config.num_blocks
    if data.draw(st.booleans(), label="evict_all"):
        engine.prefix_caches.ensure_free(engine.runner, 0, engine.engine_config.num_blocks)
        assert len(pc) == 0
        assert int(engine.runner.state.free_count) == engine.engine_config.num_blocks


def test_eviction_under_block_pressure(lifecycle_engine):
    """Long requests with distinct prompts, two at a time, on a pool the cache alone would fill:
    the cache evicts (LRU) instead of pausing or preempting, and the outputs stay the full-forward
    reference's."""
    engine = lifecycle_engine
    pc = engine.prefix_caches.caches[0]
    cfg, params = tiny_model(0, vocab_size=VOCAB)
    rng = np.random.default_rng(7)
    prompts = [[int(x) for x in rng.integers(2, VOCAB, 60)] for _ in range(4)]
    evicted, preempted = pc.num_evicted, engine.get_stats()["num_preemptions"]
    sp = SamplingParams(max_tokens=20, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"e{i}", p, sp)
    outs, snapshots = {}, {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o.outputs[0].token_ids
        _check_invariants(engine, snapshots)
    for i, p in enumerate(prompts):
        assert outs[f"e{i}"] == reference_greedy(cfg, params, p, 20, stop_ids=())
    assert pc.num_evicted > evicted
    assert engine.get_stats()["num_preemptions"] == preempted


def test_failing_insert_takes_no_reference(lifecycle_engine):
    """A request insert that raises while the request matches cached blocks leaves every
    reference count at zero; the retried admission reads the cache and gives the reference
    output."""
    engine = lifecycle_engine
    pc = engine.prefix_caches.caches[0]
    cfg, params = tiny_model(0, vocab_size=VOCAB)
    prompt = [int(x) for x in np.random.default_rng(3).integers(2, VOCAB, 30)]
    sp = SamplingParams(max_tokens=5, ignore_eos=True)
    engine.add_request("warm", prompt, sp)
    while engine.has_unfinished_requests():
        engine.step()
    assert pc.match(prompt + [2])[1]            # the prompt's blocks are cached
    real, calls = engine_of(engine).runner.insert, []

    def fail_once(*a):
        calls.append(a)
        if len(calls) == 1:
            raise RuntimeError("injected device failure")
        return real(*a)

    engine_of(engine).runner.insert = fail_once
    try:
        engine.add_request("again", prompt + [2], sp)
        with pytest.raises(RuntimeError, match="injected"):
            engine.step()
        assert all(pc.ref_count(b) == 0 for b in pc.cached_ids())
        hits = pc.num_hit_tokens
        outs = []
        while engine.has_unfinished_requests():
            outs += [o for o in engine.step() if o.finished]
    finally:
        engine_of(engine).runner.insert = real
    assert pc.num_hit_tokens > hits
    assert outs[0].outputs[0].token_ids == reference_greedy(cfg, params, prompt + [2], 5,
                                                            stop_ids=())
    _check_invariants(engine, {})


def test_prefix_caching_on_a_mesh_of_one_device():
    """A one-device mesh is one device: prefix caching is accepted there (it was refused for any
    ``mesh`` argument) and a shared prefix is served from the cache with the reference's tokens."""
    from jmtp.runtime.device.sharding import make_mesh
    engine = _engine(MTP3, True, mesh=make_mesh(1, 1))
    chats = _chats()[:2]
    res, _ = _run_chats(engine, chats)
    _assert_reference_tokens(res, chats)
    assert engine.get_stats()["prefix_cache_hit_tokens"] > 0


def test_handoff_refused_with_prefix_caching():
    """A request whose sequence starts with shared cached blocks cannot be exported yet: the
    hand-off calls raise before anything runs."""
    cfg, params = tiny_model(0)
    engine = LLMEngine(model_config=cfg, params=params, max_model_len=32, block_size=4,
                       max_num_seqs=2, compilation_cache_dir=None,
                       enable_prefix_caching=True)
    for call in (lambda: engine.prefill_request("a", [3, 4, 5]),
                 lambda: engine.add_prefill_request("a", [3, 4, 5])):
        with pytest.raises(ValueError, match="enable_prefix_caching"):
            call()
    assert not engine.has_unfinished_requests()
