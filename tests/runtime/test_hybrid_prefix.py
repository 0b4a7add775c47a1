"""Exact prefix caching on hybrid gated-DeltaNet targets (tiny random Qwen3-Next and Qwen3.5-MoE
transformers checkpoints with an ``mtp.*`` layer): multi-turn conversations over a shared system
prompt give transformers' greedy tokens with the cache on (MTP K = 1, 2, 3; chunked prefill; a
pool small enough to preempt), seeded sampled tokens equal to the engine without the cache, the
hit rate and the state cache's bytes reported and bounded; a hit whose state was evicted falls
back to the longest boundary that still has one; the captured states equal a plain prefill's;
the host rule of :func:`boundary_captured` by hand; :class:`StateCache` bookkeeping."""
from __future__ import annotations

import functools
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from jmtp import LLMEngine
from jmtp.model.checkpoints.hf_loader import load_hf
from jmtp.model.state_checkpoints import boundary_captured
from jmtp.runtime.config import SpeculativeConfig
from jmtp.runtime.host.llm import SamplingParams
from jmtp.runtime.host.prefix_states import StateCache, longest_with_state

torch = pytest.importorskip("torch")
torch.set_num_threads(1)
pytest.importorskip("transformers")
from tests.model import hybrid_fixtures as hx  # noqa: E402

pytestmark = pytest.mark.xdist_group("hybrid_prefix")

BS = 4
MAX_TOKENS = 8
ARGS = dict(max_num_seqs=2, max_model_len=64, block_size=BS, max_num_batched_tokens=8,
            dtype="float32", compilation_cache_dir=None,
            enable_prefix_caching=True, max_cached_states=4)
MAX_CACHED = 4
_rng = np.random.default_rng(7)
_r = lambda n: [int(x) for x in _rng.integers(2, hx.V, n)]  # noqa: E731
SYSTEM = _r(18)                     # not a block multiple
# Three conversations of three user turns over one system prompt; run two at a time, so the
# first turns run concurrently and later ones find what earlier turns cached.
CHATS = [[SYSTEM + _r(5), _r(3), _r(4)], [SYSTEM + _r(7), _r(2), _r(5)],
         [SYSTEM[:16] + _r(9), _r(4), _r(2)]]


@functools.lru_cache(maxsize=None)
def _checkpoint(kind: str, tmp: str):
    model = hx.hf_model(kind)
    path = hx.save_checkpoint(model, Path(tmp) / kind, hx.mtp_tensors(model))
    cfg, params = load_hf(path, jnp.float32)
    return model, cfg, params


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return str(tmp_path_factory.mktemp("hybrid_prefix"))


@functools.lru_cache(maxsize=None)
def greedy_ref(kind: str, prompt: tuple, tmp: str) -> list[int]:
    """transformers' greedy continuation: the independent reference."""
    model = _checkpoint(kind, tmp)[0]
    ids, out = list(prompt), []
    with torch.no_grad():
        for _ in range(MAX_TOKENS):
            tok = int(model(torch.tensor([ids])).logits[0, -1].argmax())
            out.append(tok)
            ids.append(tok)
    return out


@functools.lru_cache(maxsize=None)
def engine(kind: str, k: int, tmp: str, caching: bool = True, **kw) -> LLMEngine:
    """One engine per configuration, shared by the tests (each costs its step compiles)."""
    _, cfg, params = _checkpoint(kind, tmp)
    return LLMEngine(model_config=cfg, params=params, num_blocks=18,
                     speculative_config=SpeculativeConfig("mtp", k, k),
                     **{**ARGS, "enable_prefix_caching": caching, **kw})


def run_chats(eng, chats, sp, after_turn=None, concurrent=2, tag=""):
    """Each conversation turn by turn (turn t+1's prompt: turn t's prompt + its output + the new
    user tokens), ``concurrent`` conversations at a time. Returns ``{(chat, turn): (prompt,
    tokens)}``."""
    out, hist = {}, {c: [] for c in range(len(chats))}
    for group in range(0, len(chats), concurrent):
        cs = range(group, min(group + concurrent, len(chats)))
        for turn in range(max(len(chats[c]) for c in cs)):
            prompts = {}
            for c in cs:
                if turn < len(chats[c]):
                    prompts[c] = hist[c] + chats[c][turn]
                    eng.add_request(f"{tag}{c}-{turn}", prompts[c], sp(c, turn))
            while eng.has_unfinished_requests():
                for o in eng.step():
                    if o.finished:
                        c, t = map(int, o.request_id[len(tag):].split("-"))
                        out[(c, t)] = (prompts[c], o.outputs[0].token_ids)
                        hist[c] = prompts[c] + o.outputs[0].token_ids
            if after_turn is not None:
                after_turn(turn)
    return out


def greedy(c, t):
    return SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)


def check_stats(eng):
    """The cache's numbers add up; returns ``get_stats()``."""
    s = eng.get_stats()
    assert s["prefix_cache_hit_tokens"] > 0
    assert s["prefix_cache_hit_rate"] == pytest.approx(
        s["prefix_cache_hit_tokens"] / s["prefix_cache_queried_tokens"])
    kvb = eng.kv_cache_bytes()
    # bounded: the cached states fit the entries allocated with the engine (one per slot plus
    # max_cached_states), and the device bytes count them
    assert 0 < s["prefix_state_cache_bytes"] <= s["prefix_state_cache_capacity_bytes"]
    assert s["prefix_state_cache_capacity_bytes"] == kvb["prefix_states"]
    ec, cfg = eng.engine_config, eng.model_config
    lc = cfg.linear         # one entry: every linear layer's conv and delta-rule state, fp32
    entry = len(cfg.linear_layers) * 4 * ((lc.conv_kernel_dim - 1) * lc.conv_dim
                                          + lc.num_value_heads * lc.key_head_dim
                                          * lc.value_head_dim)
    assert kvb["prefix_state_entry"] == entry
    assert kvb["prefix_states"] == (ec.max_num_seqs + MAX_CACHED) * entry
    assert s["num_cached_states"] <= ec.num_state_checkpoints - ec.max_num_seqs + (
        ec.max_num_seqs - s["num_running"])
    assert s["num_free_blocks"] + s["num_cached_blocks"] == ec.num_blocks
    return s


# K = 1, 2, 3 over the two models (each engine costs its step compiles)
@pytest.mark.parametrize("kind,k", [("qwen3_next", 2), ("qwen3_next", 3), ("qwen3_5_moe", 1)])
def test_multi_turn_greedy_equals_transformers(tmp, kind, k):
    """Three-turn conversations over a shared system prompt, two at a time, 8-token prefill
    chunks, 18 KV blocks for 2 slots of up to 64 tokens (preemptions): every turn's tokens are transformers'
    greedy continuation of its whole prompt (the engine without the cache gives these too,
    ``test_hybrid_engine.py``), later turns hit the cache (state checkpoints included), and the
    cache's numbers add up."""
    eng = engine(kind, k, tmp)
    res = run_chats(eng, CHATS, greedy)
    for (c, t), (prompt, toks) in sorted(res.items()):
        assert toks == greedy_ref(kind, tuple(prompt), tmp), (c, t)
    s = check_stats(eng)
    assert s["num_draft_tokens"] > 0 and s["num_cached_states"] > 0
    # the third turns of two conversations outgrow the 18 blocks: recompute preemption
    assert s["num_preemptions"] > 0


def test_seeded_sampling_equals_the_engine_without_the_cache(tmp):
    """Seeded sampled conversations (MTP K=2, draft tokens verified by rejection sampling): the
    same tokens with the cache on and off, so the drafts and the random stream are the same."""
    def sp(c, t):
        return SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=10 * c + t,
                              ignore_eos=True)
    on = run_chats(engine("qwen3_next", 2, tmp), CHATS, sp, tag="s")
    off = run_chats(engine("qwen3_next", 2, tmp, caching=False), CHATS, sp, tag="s")
    assert on == off
    assert len({tuple(v[1]) for v in on.values()}) > 1


def test_evicted_state_falls_back_to_the_longest_boundary_with_one(tmp):
    """After each turn of two new conversations, the most recent cached state is evicted
    (an older one is touched first, so it survives): the next turn's KV match reaches further
    than any state, the request recomputes from the longest boundary that still has a state
    (counted in ``state_fallback_tokens``), and its tokens are still transformers'."""
    eng = engine("qwen3_next", 2, tmp)
    st = eng.prefix_caches.states[0]
    chats = [[SYSTEM[:10] + _r(11), _r(5), _r(3)], [_r(20), _r(6), _r(2)]]
    before = eng.get_stats()

    def evict_newest(turn):
        older = st.cached_entries()[:-1]
        keys = [k for k, e in st._cached.items() if e in older]      # noqa: SLF001 (LRU order)
        for key in keys:
            st.get(key)                       # touch the older ones: the newest is now LRU
        st.evict(1)

    res = run_chats(eng, chats, greedy, after_turn=evict_newest, tag="e")
    for (c, t), (prompt, toks) in sorted(res.items()):
        assert toks == greedy_ref("qwen3_next", tuple(prompt), tmp), (c, t)
    after = eng.get_stats()
    assert after["num_state_fallbacks"] > before["num_state_fallbacks"]
    assert after["state_fallback_tokens"] > before["state_fallback_tokens"]
    assert after["prefix_cache_hit_tokens"] > before["prefix_cache_hit_tokens"]


@pytest.mark.parametrize("n", [21, 23])
def test_next_turn_resumes_at_the_prompts_last_block_boundary(tmp, n):
    """A first turn whose reply crosses no further block boundary (``n``-token prompt, 2-token
    reply, 8-token prefill chunks, block 4, K=2: the last chunk ``16..n`` is longer than the
    window and runs past boundary 20): the second turn (prompt + reply + 3 user tokens) hits
    the prefix cache up to the first prompt's last block boundary, ``n // 4 * 4 = 20`` tokens,
    not only to the last chunk end on a boundary (16), and both turns give transformers'
    greedy tokens."""
    eng = engine("qwen3_next", 2, tmp)
    sp = SamplingParams(max_tokens=2, ignore_eos=True)

    def generate(rid, ids):
        eng.add_request(rid, ids, sp)
        while eng.has_unfinished_requests():
            for o in eng.step():
                if o.finished:
                    out = o.outputs[0].token_ids
        return out

    prompt = _r(n)
    toks = generate(f"b{n}-0", prompt)
    assert toks == greedy_ref("qwen3_next", tuple(prompt), tmp)[:2]
    second = prompt + toks + _r(3)
    hits = eng.get_stats()["prefix_cache_hit_tokens"]
    toks2 = generate(f"b{n}-1", second)
    assert eng.get_stats()["prefix_cache_hit_tokens"] - hits == n // BS * BS
    assert toks2 == greedy_ref("qwen3_next", tuple(second), tmp)[:2]


def test_captured_states_equal_a_plain_prefill(tmp):
    """Every cached state entry whose key lies on the token chain of a conversation equals
    (5e-5) the linear layers' state after prefilling that chain's prefix in one piece (the paged
    forward into a fresh pool), convolution and delta-rule state alike."""
    import jax

    from jmtp.model.llama import forward, init_model_cache
    from jmtp.model.metadata import ragged_batch
    eng = engine("qwen3_next", 2, tmp)
    res = run_chats(eng, CHATS[:2], greedy, tag="c")
    _, cfg, params = _checkpoint("qwen3_next", tmp)
    saved = eng.runner.cache.linear.saved
    st, pc = eng.prefix_caches.states[0], eng.prefix_caches.caches[0]
    fwd = jax.jit(forward, static_argnums=0)
    checked = set()
    for prompt, toks in res.values():
        chain = prompt + toks
        for n, key in enumerate(pc.keys(chain, len(chain) // BS), 1):
            e = st.get(key)
            if e < 0 or key in checked or len(checked) == 3:   # (each n compiles a forward)
                continue
            checked.add(key)
            ids = chain[:n * BS]
            cache = init_model_cache(cfg, n, BS, num_slots=1, window=1)
            pos, meta = ragged_batch(jnp.asarray([n * BS]), jnp.asarray([0]),
                                     jnp.arange(n, dtype=jnp.int32)[None], BS, n * BS)
            _, cache = fwd(cfg, params, jnp.asarray(ids, jnp.int32), pos, meta, cache)
            np.testing.assert_allclose(np.asarray(saved.recurrent[:, e]),
                                       np.asarray(cache.linear.recurrent[:, 0, 0]), atol=5e-5)
            np.testing.assert_allclose(np.asarray(saved.conv[:, e]),
                                       np.asarray(cache.linear.conv[:, 0, 0]), atol=5e-5)
    assert len(checked) >= 2


def test_boundary_captured_hand_worked():
    """W = 3, block size 4: a verify window of 3 rows at positions 6..8 committing 2 crosses
    boundary 8 (the state after position 7, row 1, checkpoint 1); committing 1 crosses none; a
    long prefill chunk 0..9 captures nothing (boundary 8 lies inside it), one ending on 8 does
    (checkpoint 2); a short chunk of 2 rows at 7..8 crosses 8 at row 0 (checkpoint 1); a
    finished slot captures nothing."""
    p0 = np.array([6, 6, 0, 0, 7, 6])
    q = np.array([3, 3, 10, 8, 2, 3])
    valid = np.array([2, 1, 10, 8, 2, 3])
    pre = np.array([False, False, True, True, True, False])
    fin = np.array([False, False, False, False, False, True])
    b, ck, ok = boundary_captured(p0, q, valid, pre, fin, 4, 3)
    assert ok.tolist() == [True, False, False, True, True, False]
    assert b[ok].tolist() == [8, 8, 8] and ck[ok].tolist() == [1, 2, 1]


def test_capture_chunk_hand_worked():
    """Block 4, window 3, a 23-token context: a chunk of 8 from 16 ends on the context's last
    boundary 20; one that ends on or before it, or a short chunk (<= the window, its rows keep
    their states), is not cut; a branch point at 12 cuts first; a dense slot (no capture entry)
    is never cut."""
    from jmtp.runtime.host.requests import Sequence
    from jmtp.runtime.host.scheduler import capture_chunk
    seq = Sequence(None, 0, SamplingParams(), None, context_ids=list(range(23)), state_entry=0)
    assert capture_chunk(seq, 7, 7, 4, 3) == 4          # 16..23 -> 16..20
    assert capture_chunk(seq, 15, 8, 4, 3) == 8         # 8..16: ends before 20
    assert capture_chunk(seq, 3, 3, 4, 3) == 3          # 20..23: crosses nothing
    assert capture_chunk(seq, 5, 3, 4, 3) == 3          # 18..21: short, row 1 keeps 20
    seq.state_target = 12
    assert capture_chunk(seq, 15, 8, 4, 3) == 4         # 8..16 -> 8..12 (branch point)
    seq.state_entry = -1
    assert capture_chunk(seq, 7, 7, 4, 3) == 7


def test_state_cache_lru_and_invariants():
    """Entries are free, held by a slot or cached: ``take`` prefers a free one, then evicts the
    least recently used cached one; ``put`` of a key already cached frees the entry;
    ``longest_with_state`` finds the longest prefix whose last key has a state."""
    st = StateCache(3, 10)
    a, b = st.take(), st.take()
    st.put(a, b"x")
    st.put(b, b"y")
    assert len(st) == 2 and st.cached_bytes == 20 and len(st.free) == 1
    st.get(b"x")                     # y is now least recently used
    c, d = st.take(), st.take()      # the free one, then y evicted
    assert d == b and b"y" not in st and st.num_evicted == 1
    st.put(c, b"x")                  # x already cached: c is freed
    assert st.free == [c] and len(st) == 1
    st.drop(d)
    assert sorted(st.free + st.cached_entries()) == [0, 1, 2]
    assert longest_with_state(st, [b"q", b"x", b"z"]) == 2
    assert longest_with_state(st, [b"z"]) == 0
    with pytest.raises(RuntimeError, match="held by a slot"):
        full = StateCache(1, 1)
        full.take()
        full.take()
