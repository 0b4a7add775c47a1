"""verify(): properties (hypothesis + chex), speculative == sequential equivalence, p = 0 safety,
FastDeploy ``topp`` parity on hand-worked cases (fastdeploy_mtp_spec.md §5.3), bad values."""
from __future__ import annotations

import functools
import importlib.util
import pathlib

import chex
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings

from jmtp.runtime import sampling as smp
from jmtp.runtime import verify as vf
from jmtp.runtime.sampling import SamplingArrays, SamplingParams

_spec = importlib.util.spec_from_file_location(
    "_jmtp_sampling_ref", pathlib.Path(__file__).with_name("test_sampling.py"))
ref = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ref)

STATIC = ("strategy", "max_candidate_len", "verify_window", "num_logprobs", "logprobs_mode",
          "truncate_at_stop", "topp_clamp_candidate_len")
_verify = jax.jit(vf.verify, static_argnames=STATIC)
_update = jax.jit(smp.update_history)


def fresh_verify(**static):
    """A jitted verify with its own trace cache (a new partial object): tests that monkeypatch
    ``sampling._uniform`` must neither reuse nor leave behind a cached trace."""
    return jax.jit(functools.partial(vf.verify, **static))


def run(logits, drafts, nd, sampling, ng, eos=(-1,), q=None, **kw):
    return _verify(jnp.asarray(logits, jnp.float32), jnp.asarray(drafts, jnp.int32),
                   jnp.asarray(nd, jnp.int32), None if q is None else jnp.asarray(q, jnp.float32),
                   sampling, jnp.asarray(ng, jnp.int32), jnp.asarray(eos, jnp.int32), **kw)


# ----------------------------------------------------------------------------------------------
# properties

B, K, V = 4, 3, 10


@st.composite
def batch_case(draw):
    seed = draw(st.integers(0, 2**31))
    rng = np.random.default_rng(seed)
    params = []
    for _ in range(B - 1):
        params.append(SamplingParams(
            max_tokens=64, temperature=draw(st.sampled_from([0.0, 0.6, 1.0, 1.5])),
            top_p=draw(st.sampled_from([1.0, 0.8])), top_k=draw(st.sampled_from([0, 2, 5])),
            min_p=draw(st.sampled_from([0.0, 0.2])),
            repetition_penalty=draw(st.sampled_from([1.0, 1.2])),
            frequency_penalty=draw(st.sampled_from([0.0, 0.3])),
            min_tokens=draw(st.integers(0, 3)), seed=int(rng.integers(0, 2**32))))
    params.append(None)                                       # an idle slot
    a = smp.pack_sampling(params, B, V, prompts=[list(rng.integers(0, V, 3))] * B)
    logits = rng.normal(size=(B, K + 1, V)) * 1.5
    nd = rng.integers(0, K + 1, B)
    nd[-1] = 0
    drafts = np.where(np.arange(K)[None] < nd[:, None], rng.integers(0, V, (B, K)), -1)
    q = rng.dirichlet(np.ones(V), (B, K)) if draw(st.booleans()) else None
    if q is not None:                  # the drafts really come from q
        drafts = np.where(drafts >= 0, np.array([[rng.choice(V, p=q[b, k]) for k in range(K)]
                                                 for b in range(B)]), -1)
    ng = rng.integers(0, 5, B)
    strategy = draw(st.sampled_from(vf.STRATEGIES))
    return a, logits, drafts, nd, q, ng, strategy


@settings(max_examples=25, deadline=None)
@given(batch_case())
def test_accept_num_range_shapes_and_prefix(case):
    a, logits, drafts, nd, q, ng, strategy = case
    r = run(logits, drafts, nd, a, ng, eos=[9], q=q, strategy=strategy, num_logprobs=2)
    chex.assert_shape(r.accept_tokens, (B, K + 1))
    chex.assert_shape(r.accept_num, (B,))
    chex.assert_type([r.accept_tokens, r.accept_num, r.top_logprob_ids], jnp.int32)
    chex.assert_shape([r.top_logprob_ids, r.top_logprobs], (B, K + 1, 2))
    chex.assert_type([r.logprobs, r.top_logprobs], jnp.float32)
    n = np.asarray(r.accept_num)
    toks = np.asarray(r.accept_tokens)
    assert np.all(n >= 1) and np.all(n <= nd + 1)
    for b in range(B):
        assert np.all(toks[b, n[b]:] == -1) and np.all(toks[b, :n[b]] >= 0)
        assert np.all(toks[b, :n[b] - 1] == drafts[b, :n[b] - 1])     # accepted prefix
        assert np.all(np.isfinite(np.asarray(r.logprobs)[b, :n[b]]))
    # idle slot: greedy, no drafts -> the argmax of its raw logits
    assert n[-1] == 1 and toks[-1, 0] == np.argmax(logits[-1, 0])


@jax.jit
def _probs(lg, a, d, nd, ng):
    return smp.target_probs(smp.penalize(lg, a, d, nd, ng, jnp.array([-1])), a)


def _draft_from_p(a, logits, nd, ng, rng):
    """Drafts sampled sequentially from the library's own target p (row w depends on d_1..d_w)."""
    d = np.zeros((B, K), np.int64)
    for w in range(K):
        p = np.asarray(_probs(jnp.asarray(logits, jnp.float32), a, jnp.asarray(d, jnp.int32),
                              jnp.asarray(nd), jnp.asarray(ng)), np.float64)
        for b in range(B):
            pw = p[b, w] / p[b, w].sum()
            d[b, w] = rng.choice(V, p=pw)
    return d, np.asarray(p[:, :K], np.float32)


@settings(max_examples=10, deadline=None)
@given(batch_case())
def test_q_equal_p_accepts_every_draft(case):
    a, logits, _, _, _, ng, _ = case
    rng = np.random.default_rng(0)
    nd = np.array([K, K, K, 0])
    drafts, p = _draft_from_p(a, logits, nd, ng, rng)
    r = run(logits, drafts, nd, a, ng, q=p, strategy="rejection")
    np.testing.assert_array_equal(r.accept_num, nd + 1)
    np.testing.assert_array_equal(np.asarray(r.accept_tokens)[:3, :K], drafts[:3])


def _greedy_batch(seeds, nd=(3, 1, 0, 2)):
    rng = np.random.default_rng(5)
    params = [SamplingParams(temperature=0.0, repetition_penalty=1.3, seed=s) for s in seeds]
    a = smp.pack_sampling(params, B, V, prompts=[[1, 2]] * B)
    logits = rng.normal(size=(B, K + 1, V))
    am = logits.argmax(-1)
    drafts = np.where(np.arange(K)[None] < np.array(nd)[:, None], am[:, :K], -1)
    drafts[0, 1] = (drafts[0, 1] + 1) % V                   # one wrong draft
    return a, logits, drafts, np.array(nd)


@pytest.mark.parametrize("strategy", ["auto", "target_match", "topp"])
def test_greedy_rows_consume_no_randomness(strategy, monkeypatch):
    a1, logits, drafts, nd = _greedy_batch([1, 2, 3, 4])
    a2, *_ = _greedy_batch([99, 98, 97, 96])
    r1 = run(logits, drafts, nd, a1, [0, 3, 5, 7], strategy=strategy)
    r2 = run(logits, drafts, nd, a2, [0, 3, 5, 7], strategy=strategy)
    chex.assert_trees_all_equal(r1, r2)
    # poison the only source of randomness: greedy rows do not see it
    monkeypatch.setattr(smp, "_uniform", lambda keys: jnp.full(keys.shape, jnp.nan))
    r3 = fresh_verify(strategy=strategy)(
        jnp.asarray(logits, jnp.float32), jnp.asarray(drafts, jnp.int32), jnp.asarray(nd),
        None, a1, jnp.array([0, 3, 5, 7]), jnp.array([-1]))
    chex.assert_trees_all_equal(r1, r3)


@pytest.mark.parametrize("strategy", ["rejection", "target_match", "topp"])
def test_sampled_row_independent_of_batch_mates(strategy):
    rng = np.random.default_rng(3)
    p_main = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, frequency_penalty=0.5)
    others = [SamplingParams(temperature=t, seed=int(s)) for t, s in
              zip([0.0, 2.0, 0.5], rng.integers(0, 1000, 3))]
    logits = rng.normal(size=(B, K + 1, V))
    drafts = rng.integers(0, V, (B, K))
    outs = []
    for pos in range(B):                            # the main request in each slot in turn
        params = others[:pos] + [p_main] + others[pos:]
        lg = logits.copy()
        lg[pos] = logits[0]
        dr = drafts.copy()
        dr[pos] = drafts[0]
        r = run(lg, dr, [K] * B, smp.pack_sampling(params, B, V), [4] * B, strategy=strategy)
        outs.append((np.asarray(r.accept_tokens)[pos], int(r.accept_num[pos])))
    for o in outs[1:]:
        np.testing.assert_array_equal(o[0], outs[0][0])
        assert o[1] == outs[0][1]


def test_no_retrace_for_new_parameter_values():
    fn = chex.assert_max_traces(n=1)(
        lambda *args: vf.verify(*args, strategy="auto", num_logprobs=1))
    jf = jax.jit(fn)
    rng = np.random.default_rng(0)
    for i, (t, tp, tk, rp, mt) in enumerate([(0.0, 1.0, 0, 1.0, 0), (0.7, 0.9, 3, 1.2, 2),
                                             (1.5, 0.5, 1, 0.9, 1)]):
        params = [SamplingParams(temperature=t, top_p=tp, top_k=tk, repetition_penalty=rp,
                                 min_tokens=mt, max_tokens=8, seed=i, stop_token_ids=(i,),
                                 bad_token_ids=(i + 1,))] * B
        a = smp.pack_sampling(params, B, V)
        r = jf(jnp.asarray(rng.normal(size=(B, K + 1, V)), jnp.float32),
               jnp.asarray(rng.integers(0, V, (B, K)), jnp.int32),
               jnp.asarray(rng.integers(0, K + 1, B), jnp.int32), None, a,
               jnp.asarray(rng.integers(0, 9, B), jnp.int32), jnp.array([9], jnp.int32))
        jax.block_until_ready(r)


def test_no_speculation_k0():
    a = smp.pack_sampling([SamplingParams(), SamplingParams(temperature=1.0, seed=2)], 2, V)
    lg = np.random.default_rng(0).normal(size=(2, 1, V))
    for strategy in vf.STRATEGIES:
        r = run(lg, np.zeros((2, 0)), [0, 0], a, [0, 0], strategy=strategy)
        assert r.accept_tokens.shape == (2, 1) and list(np.asarray(r.accept_num)) == [1, 1]
        assert int(r.accept_tokens[0, 0]) == int(np.argmax(lg[0, 0]))


# ----------------------------------------------------------------------------------------------
# p = 0 is never emitted, also with extreme uniform draws


@pytest.mark.parametrize("u_raw", [0.0, float(np.nextafter(np.float32(1), np.float32(0)))])
@pytest.mark.parametrize("strategy,sampled_q", [("rejection", False), ("rejection", True),
                                                ("target_match", False), ("topp", False)])
def test_zero_probability_token_never_emitted(u_raw, strategy, sampled_q, monkeypatch):
    """Token 0 is excluded from p (bad token / top-k); the drafts propose it; every draw is forced
    to ``u_raw`` (0 exercises ``u <= p/q`` with p = 0 and ``cumsum >= u`` at index 0)."""
    monkeypatch.setattr(smp, "_uniform", lambda keys: jnp.full(keys.shape, u_raw, jnp.float32))
    Vs = 6
    logits = np.zeros((3, K + 1, Vs))
    logits[:, :, 0] = 5.0                                   # token 0 would be the favourite
    logits[:, :, 3] = 1.0
    params = [SamplingParams(temperature=1.0, bad_token_ids=(0,), seed=1),
              SamplingParams(temperature=1.0, top_k=2, bad_token_ids=(0,), seed=2),
              SamplingParams(temperature=2.0, min_tokens=5, max_tokens=9, seed=3)]  # EOS = 0
    a = smp.pack_sampling(params, 3, Vs)
    drafts = np.zeros((3, K), np.int64)
    q = None
    if sampled_q:
        q = np.full((3, K, Vs), 0.02)
        q[:, :, 0] = 0.9
        q /= q.sum(-1, keepdims=True)
    f = fresh_verify(strategy=strategy, max_candidate_len=3)
    r = f(jnp.asarray(logits, jnp.float32), jnp.asarray(drafts, jnp.int32), jnp.array([K] * 3),
          None if q is None else jnp.asarray(q, jnp.float32), a, jnp.zeros(3, jnp.int32),
          jnp.array([0]))
    toks = np.asarray(r.accept_tokens)
    assert np.all(np.asarray(r.accept_num) == 1)
    assert np.all(toks[:, 0] != 0) and np.all(toks[:, 0] >= 0)


# ----------------------------------------------------------------------------------------------
# speculative == sequential (greedy, with penalties, min_tokens, bad words, stop tokens)


def ref_greedy_decode(table, prompt, params, eos, bad_words, n):
    """Non-speculative greedy decoding with the sequential reference, ``table[pos]`` = logits."""
    out, lps = [], []
    for pos in range(n):
        pen = ref.ref_penalize(table[pos], prompt, out, params, eos, bad_words)
        out.append(int(np.argmax(pen)))
        lps.append(pen - np.log(np.sum(np.exp(pen - pen.max()))) - pen.max())
    return out, lps


@st.composite
def equivalence_case(draw):
    seed = draw(st.integers(0, 2**31))
    rng = np.random.default_rng(seed)
    slots = []
    for _ in range(3):
        stop = tuple(int(t) for t in rng.integers(0, V, draw(st.integers(0, 1))))
        params = SamplingParams(
            max_tokens=40, temperature=0.0,
            repetition_penalty=draw(st.sampled_from([1.0, 1.5, 0.7])),
            frequency_penalty=draw(st.sampled_from([0.0, 0.8, -0.5])),
            presence_penalty=draw(st.sampled_from([0.0, 0.6])),
            min_tokens=draw(st.integers(0, 6)), stop_token_ids=stop,
            bad_token_ids=tuple(int(t) for t in rng.integers(0, V, draw(st.integers(0, 1)))),
            ignore_eos=draw(st.booleans()))
        bad_words = [[int(t) for t in rng.integers(0, V, n)]
                     for n in draw(st.lists(st.integers(2, 3), max_size=2))]
        prompt = [int(t) for t in rng.integers(0, V, 4)]
        table = rng.normal(size=(24, V)) * 1.5
        slots.append((params, prompt, bad_words, table))
    wrong = draw(st.floats(0.0, 0.6))       # probability that a draft is corrupted
    return slots, wrong, seed


@settings(max_examples=20, deadline=None)
@given(equivalence_case())
def test_speculative_greedy_equals_sequential_reference(case):
    slots, wrong, seed = case
    rng = np.random.default_rng(seed + 1)
    eos = [V - 1]
    N = 12
    refs = [ref_greedy_decode(t, pr, p, eos, bw, N + K + 1) for p, pr, bw, t in slots]
    a = SamplingArrays.empty(B, V, max_stop=3, max_bad_words=2, max_bad_word_len=3)
    for b, (p, pr, bw, _) in enumerate(slots):
        a = smp.set_slot(a, b, p, pr, bad_words_ids=bw, request_seed=b)
    emitted = [[] for _ in slots]
    lps = [[] for _ in slots]
    stopped = [False] * len(slots)
    ng = np.zeros(B, np.int64)
    for _ in range(N):
        logits = np.zeros((B, K + 1, V))
        drafts = np.full((B, K), -1)
        nd = np.zeros(B, np.int64)
        for b, (p, pr, bw, table) in enumerate(slots):
            if stopped[b] or ng[b] >= N:
                continue
            nd[b] = rng.integers(0, K + 1)
            want = refs[b][0][ng[b]:ng[b] + K]
            drafts[b, :nd[b]] = [t if rng.random() >= wrong else (t + 1) % V
                                 for t in want[:nd[b]]]
            logits[b] = table[ng[b]:ng[b] + K + 1]
        r = run(logits, drafts, nd, a, ng, eos=eos, strategy="auto", num_logprobs=3)
        toks, num = np.asarray(r.accept_tokens), np.asarray(r.accept_num)
        for b in range(len(slots)):
            if stopped[b] or ng[b] >= N:
                continue
            new = list(toks[b, :num[b]])
            emitted[b] += new
            lps[b] += [(np.asarray(r.logprobs)[b, i], np.asarray(r.top_logprob_ids)[b, i],
                        np.asarray(r.top_logprobs)[b, i]) for i in range(num[b])]
            p = slots[b][0]
            stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos))
            stopped[b] = bool(stops & set(new))
        num[len(slots):] = 0
        a = _update(a, r.accept_tokens, jnp.asarray(num))
        ng = ng + num
    for b, (p, *_rest) in enumerate(slots):
        ref_toks, ref_lps = refs[b]
        stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos))
        cut = next((i + 1 for i, t in enumerate(ref_toks) if t in stops), len(ref_toks))
        got = emitted[b]
        assert got == ref_toks[:min(cut, len(got))], (b, got, ref_toks)
        assert len(got) == cut or len(got) >= N
        for i, (lp, ids, tops) in enumerate(lps[b]):
            lref = ref_lps[i]
            np.testing.assert_allclose(lp, lref[got[i]], atol=1e-4)
            np.testing.assert_array_equal(ids, np.argsort(-lref, kind="stable")[:3])
            np.testing.assert_allclose(tops, np.sort(lref)[::-1][:3], atol=1e-4)


def test_min_tokens_boundary_in_window_and_eos_truncation():
    """EOS is the raw argmax everywhere; min_tokens = 3, 2 tokens generated: row 0 masks EOS,
    rows >= 1 do not. With EOS drafted at row 1 the window stops right after it."""
    eos = 9
    lg = np.zeros((2, K + 1, V))
    lg[:, :, eos] = 5.0
    lg[:, :, 4] = 3.0
    params = [SamplingParams(min_tokens=3, max_tokens=9),
              SamplingParams(min_tokens=3, max_tokens=9, ignore_eos=True)]
    a = smp.pack_sampling(params, 2, V)
    drafts = np.array([[4, eos, eos], [4, eos, eos]])
    r = run(lg, drafts, [3, 3], a, [2, 2], eos=[eos])
    assert list(np.asarray(r.accept_tokens)[0]) == [4, eos, -1, -1]
    assert int(r.accept_num[0]) == 2
    # ignore_eos: EOS neither masked nor a stop, all drafts accepted + bonus
    assert list(np.asarray(r.accept_tokens)[1]) == [4, eos, eos, eos]
    # one more generated token earlier: row 0 may emit EOS only when num_generated >= 3
    r = run(lg, drafts, [3, 3], a, [1, 1], eos=[eos])
    assert list(np.asarray(r.accept_tokens)[0]) == [4, 4, -1, -1]


def test_stop_token_inside_accepted_drafts():
    lg = np.zeros((1, K + 1, V))
    lg[0, :, 2] = 1.0
    lg[0, 1, 7] = 2.0
    a = smp.pack_sampling([SamplingParams(stop_token_ids=(7,))], 1, V)
    r = run(lg, [[2, 7, 2]], [3], a, [0])
    assert list(np.asarray(r.accept_tokens)[0]) == [2, 7, -1, -1]
    r = run(lg, [[2, 7, 2]], [3], a, [0], truncate_at_stop=False)
    assert list(np.asarray(r.accept_tokens)[0]) == [2, 7, 2, 2]


# ----------------------------------------------------------------------------------------------
# FastDeploy topp parity (fastdeploy_mtp_spec.md §5.3), hand-worked

P_ROWS = {   # V = 10 distributions; ids 5..9 get the remaining mass equally
    "a": [0.50, 0.20, 0.15, 0.10, 0.03],   # top_p 0.8 -> len 3 (0.5, 0.7, 0.85)
    "b": [0.90, 0.04, 0.03, 0.02, 0.005],  # top_p 0.8 -> len 1
    "c": [0.30, 0.25, 0.20, 0.15, 0.05],   # top_p 0.8 -> len 4 (0.3, 0.55, 0.75, 0.9)
}


def _row(name, perm=None):
    p = np.full(V, 0.0)
    p[:5] = P_ROWS[name]
    p[5:] = (1 - sum(P_ROWS[name])) / 5
    if perm is not None:
        p = p[perm]
    return np.log(p)


def _topp(rows, drafts, nd=None, top_p=0.8, u_raw=0.5, monkeypatch=None, eos=(-1,), **kw):
    monkeypatch.setattr(smp, "_uniform", lambda keys: jnp.full(keys.shape, u_raw, jnp.float32))
    lg = np.stack([np.stack(rows)])
    a = smp.pack_sampling([SamplingParams(temperature=1.0, top_p=top_p, seed=0)], 1, V)
    nd = len(drafts) if nd is None else nd
    dr = np.full((1, len(rows) - 1), -1)
    dr[0, :len(drafts)] = drafts
    f = fresh_verify(strategy="topp", **kw)
    r = f(jnp.asarray(lg, jnp.float32), jnp.asarray(dr, jnp.int32), jnp.array([nd]), None, a,
          jnp.array([0]), jnp.asarray(eos, jnp.int32))
    return list(np.asarray(r.accept_tokens)[0]), int(r.accept_num[0])


def test_topp_candidate_lengths():
    probs = jnp.asarray(np.exp(np.stack([_row("a"), _row("b"), _row("c")]))[None], jnp.float32)
    ids, scores, ln = vf.topp_candidates(probs, jnp.array([0.8]), 5)
    assert list(np.asarray(ln)[0]) == [3, 1, 4]
    assert list(np.asarray(ids)[0, 0]) == [0, 1, 2, 3, 4]
    # Q8: top-2 mass 0.7 < 0.8 -> 0; clamped -> C; top_p == 1 -> C
    ids, scores, ln = vf.topp_candidates(probs, jnp.array([0.8]), 2)
    assert list(np.asarray(ln)[0]) == [0, 1, 0]
    ids, scores, ln = vf.topp_candidates(probs, jnp.array([0.8]), 2, clamp=True)
    assert list(np.asarray(ln)[0]) == [2, 1, 2]
    ids, scores, ln = vf.topp_candidates(probs, jnp.array([1.0]), 2)
    assert list(np.asarray(ln)[0]) == [2, 2, 2]


def test_topp_nucleus_membership_and_bonus(monkeypatch):
    # row0 "a": d1 = 2 (3rd candidate, inside len 3) accepted; row1 "c": d2 = 4 (5th, outside len
    # 4, not the 2nd candidate) rejected -> correction from row 1's candidates.
    rows = [_row("a"), _row("c"), _row("a")]
    # u_raw = 0 -> u = 1 -> threshold T* = min(0.9, 0.8) = 0.8 -> first cumsum >= 0.8: id 3
    assert _topp(rows, [2, 4], u_raw=0.0, monkeypatch=monkeypatch) == ([2, 3, -1], 2)
    # u_raw = 0.5 -> threshold 0.4 -> cumsum 0.3, 0.55: id 1
    assert _topp(rows, [2, 4], u_raw=0.5, monkeypatch=monkeypatch) == ([2, 1, -1], 2)
    # everything accepted: bonus from row 2 ("a", len 3, T* = 0.8); u_raw 0.5 -> 0.4 -> id 0
    assert _topp(rows, [2, 3], u_raw=0.5, monkeypatch=monkeypatch) == ([2, 3, 0], 3)


def test_topp_window_relaxation(monkeypatch):
    b_perm = np.array([7, 1, 2, 3, 4, 5, 6, 0, 8, 9])      # row "b" with top-1 id 7
    rows = [_row("b"), _row("b", b_perm), _row("b"), _row("a")]
    # d1 = 1: 2nd candidate of row 0 (len 1 -> rejected by membership); d2 = 7, d3 = 0: top-1 of
    # rows 1 and 2 -> the window (verify_window = 2) accepts all three; bonus from row 3.
    assert _topp(rows, [1, 7, 0], u_raw=0.5, monkeypatch=monkeypatch) == ([1, 7, 0, 0], 4)
    # only one top-1 match after the top-2 draft -> no relaxation; correction from row 0 = argmax
    assert _topp(rows, [1, 7, 5], u_raw=0.5, monkeypatch=monkeypatch) == ([0, -1, -1, -1], 1)
    # K <= verify_window: never triggers
    assert _topp(rows[:3], [1, 7], u_raw=0.5, monkeypatch=monkeypatch) == ([0, -1, -1], 1)
    # verify_window = 1 -> accepts d1, d2 and samples from row 2
    assert _topp(rows, [1, 7, 5], u_raw=0.5, monkeypatch=monkeypatch,
                 verify_window=1) == ([1, 7, 0, -1], 3)
    # C = 1: no 2nd candidate, no relaxation
    assert _topp(rows, [1, 7, 0], u_raw=0.5, monkeypatch=monkeypatch,
                 max_candidate_len=1) == ([0, -1, -1, -1], 1)


def test_topp_eos_inside_window_truncates(monkeypatch):
    """Q7: FastDeploy would report accept_num = 3 for [1, EOS, 0]; jmtp stops at the EOS."""
    b_perm = np.array([7, 1, 2, 3, 4, 5, 6, 0, 8, 9])
    rows = [_row("b"), _row("b", b_perm), _row("b"), _row("a")]
    assert _topp(rows, [1, 7, 0], u_raw=0.5, monkeypatch=monkeypatch, eos=[7]) == ([1, 7, -1, -1], 2)
    # an accepted EOS by plain membership stops too (no bonus)
    assert _topp(rows, [0, 7, 0], u_raw=0.5, monkeypatch=monkeypatch, eos=[7]) == ([0, 7, -1, -1], 2)


def test_topp_q8_short_candidate_set(monkeypatch):
    rows = [_row("a"), _row("a")]
    # C = 2, top_p 0.8: len 0 -> even the argmax draft is rejected, correction = candidate 0
    assert _topp(rows, [0], u_raw=0.5, monkeypatch=monkeypatch,
                 max_candidate_len=2) == ([0, -1], 1)
    # the same token, but via the correction; with the clamp the draft is accepted + bonus
    assert _topp(rows, [1], u_raw=0.0, monkeypatch=monkeypatch, max_candidate_len=2,
                 topp_clamp_candidate_len=True) == ([1, 1], 2)


def test_topp_greedy_rows_use_fd_rewrite(monkeypatch):
    monkeypatch.setattr(smp, "_uniform", lambda keys: jnp.full(keys.shape, 0.3, jnp.float32))
    b_perm = np.array([7, 1, 2, 3, 4, 5, 6, 0, 8, 9])
    rows = np.stack([_row("c"), _row("b", b_perm), _row("b"), _row("a")])[None]
    a = smp.pack_sampling([SamplingParams(temperature=0.0)], 1, V)
    f = fresh_verify(strategy="topp")
    r = f(jnp.asarray(rows, jnp.float32), jnp.array([[0, 7, 1]]), jnp.array([3]), None, a,
          jnp.array([0]), jnp.array([-1]))
    # top_p -> 1e-5: len 1 -> exact argmax matching (0, 7 accepted; 1 != argmax 0 of row 2, and
    # not relaxed: only 0 drafts left after it); the correction is the argmax 0.
    assert list(np.asarray(r.accept_tokens)[0]) == [0, 7, 0, -1]


# ----------------------------------------------------------------------------------------------
# bad values


def test_bad_values_name_the_argument():
    a = smp.pack_sampling([SamplingParams()], 1, V)
    lg = jnp.zeros((1, K + 1, V))
    d = jnp.zeros((1, K), jnp.int32)
    one = jnp.array([1])
    with pytest.raises(ValueError, match="strategy"):
        vf.verify(lg, d, one, None, a, one, one, strategy="typical")
    with pytest.raises(ValueError, match="logprobs_mode"):
        vf.verify(lg, d, one, None, a, one, one, logprobs_mode="sorted")
    with pytest.raises(ValueError, match="draft_tokens"):
        vf.verify(lg, d[:, :2], one, None, a, one, one)
    with pytest.raises(ValueError, match="draft_probs"):
        vf.verify(lg, d, one, jnp.zeros((1, K, V + 1)), a, one, one)
    with pytest.raises(ValueError, match="max_candidate_len"):
        vf.verify(lg, d, one, None, a, one, one, strategy="topp", max_candidate_len=V + 1)
    with pytest.raises(ValueError, match="sampling"):
        vf.verify(jnp.zeros((1, K + 1, V + 2)), d, one, None, a, one, one)
    assert vf.check_strategy("topp") == "topp"
