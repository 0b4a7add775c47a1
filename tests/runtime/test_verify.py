"""verify(): properties (hypothesis + chex), speculative == sequential equivalence, p = 0 safety,
FastDeploy ``topp`` parity on hand-worked cases (its ``top_p_candidates`` + ``speculate_verify``),
bad values."""
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

from jmtp.runtime.device import sampling as smp, verify as vf
from jmtp.runtime.device.sampling import SamplingArrays
from jmtp.runtime.host import sampling_rows as rows
from jmtp.runtime.host.sampling_params import SamplingParams

B, K, V = 4, 3, 10
SHAPES = dict(max_stop=4, max_bad_words=2, max_bad_word_len=3)   # one SamplingArrays layout


def pack(params, batch_size=B, vocab_size=V, **kw):
    return rows.pack_sampling(params, batch_size, vocab_size, **SHAPES, **kw)

_spec = importlib.util.spec_from_file_location(
    "_jmtp_sampling_ref", pathlib.Path(__file__).with_name("test_sampling.py"))
ref = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ref)

_update = jax.jit(smp.update_history)

# Every verify configuration under test, computed by one jitted function: the shared work
# (penalties, target distribution, random draws) is compiled once, and shapes are the same
# (B, K, V) = (4, 3, 10) everywhere, so the whole file compiles verify only a few times.
VARIANTS = {
    "auto": dict(strategy="auto"),                      # greedy drafts: q = None (one-hot)
    "rejection": dict(strategy="rejection", use_q=True),
    "target_match": dict(strategy="target_match"),
    "greedy": dict(strategy="greedy"),
    "topp": dict(strategy="topp"),                      # C = 5, verify_window = 2
    "topp_w1": dict(strategy="topp", verify_window=1),
    "topp_c1": dict(strategy="topp", max_candidate_len=1),
    "topp_c2": dict(strategy="topp", max_candidate_len=2),
    "topp_c2_clamp": dict(strategy="topp", max_candidate_len=2, topp_clamp_candidate_len=True),
}
ALL = tuple(VARIANTS)


# Legitimate traces in this module: (u None | u given) x (K = 3) and one K = 0 variant. A
# retrace for new sampling-parameter *values* would exceed this and fail the test that caused it.
@functools.partial(jax.jit, static_argnames=("names",))
@chex.assert_max_traces(n=3)
def verify_all(logits, drafts, nd, q, a, ng, eos, u, names=ALL):
    out = {}
    for name in names:
        kw = dict(VARIANTS[name])
        use_q = kw.pop("use_q", False)
        out[name] = vf.verify(logits, drafts, nd, q if use_q else None, a, ng, eos,
                              num_logprobs=2, uniforms=u, **kw)
    return out


def run(logits, drafts, nd, sampling, ng, eos=(-1,), q=None, u=None, names=ALL):
    """All variants on a batch; ``q`` defaults to one-hot drafts, ``u`` to the per-request draws."""
    logits = jnp.asarray(logits, jnp.float32)
    Bx, W, Vx = logits.shape
    d = jnp.asarray(drafts, jnp.int32).reshape(Bx, W - 1)
    if q is None:
        q = jax.nn.one_hot(d, Vx, dtype=jnp.float32)
    return verify_all(logits, d, jnp.asarray(nd, jnp.int32), jnp.asarray(q, jnp.float32),
                      sampling, jnp.asarray(ng, jnp.int32), jnp.asarray(eos, jnp.int32),
                      None if u is None else jnp.asarray(u, jnp.float32), names=names)


def pad_batch(params, logits, drafts, nd, ng, **kw):
    """Pad a smaller batch to B rows with idle slots (same compilation for every test);
    returns the first five arguments of :func:`run`."""
    n = len(params)
    logits = np.concatenate([np.asarray(logits, np.float64),
                             np.zeros((B - n,) + np.shape(logits)[1:])])
    drafts = np.concatenate([np.asarray(drafts), np.full((B - n, K), -1)])
    a = pack(list(params) + [None] * (B - n), B, V, **kw)
    return logits, drafts, list(nd) + [0] * (B - n), a, list(ng) + [0] * (B - n)


# ----------------------------------------------------------------------------------------------
# properties


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
    a = pack(params, B, V, prompts=[list(rng.integers(0, V, 3))] * B)
    logits = rng.normal(size=(B, K + 1, V)) * 1.5
    nd = rng.integers(0, K + 1, B)
    nd[-1] = 0
    q = rng.dirichlet(np.ones(V), (B, K))
    drafts = np.array([[rng.choice(V, p=q[b, k]) for k in range(K)] for b in range(B)])
    drafts = np.where(np.arange(K)[None] < nd[:, None], drafts, -1)
    ng = rng.integers(0, 5, B)
    return a, logits, drafts, nd, q, ng


@settings(max_examples=20, deadline=None)
@given(batch_case())
def test_accept_num_range_shapes_and_prefix(case):
    a, logits, drafts, nd, q, ng = case
    res = run(logits, drafts, nd, a, ng, eos=[9], q=q)
    for name, r in res.items():
        chex.assert_shape(r.accept_tokens, (B, K + 1))
        chex.assert_shape(r.accept_num, (B,))
        chex.assert_type([r.accept_tokens, r.accept_num, r.top_logprob_ids], jnp.int32)
        chex.assert_shape([r.top_logprob_ids, r.top_logprobs], (B, K + 1, 2))
        chex.assert_type([r.logprobs, r.top_logprobs], jnp.float32)
        n = np.asarray(r.accept_num)
        toks = np.asarray(r.accept_tokens)
        assert np.all(n >= 1) and np.all(n <= nd + 1), name
        for b in range(B):
            assert np.all(toks[b, n[b]:] == -1) and np.all(toks[b, :n[b]] >= 0), name
            assert np.all(toks[b, :n[b] - 1] == drafts[b, :n[b] - 1]), name   # accepted prefix
            assert np.all(np.isfinite(np.asarray(r.logprobs)[b, :n[b]])), name
        # idle slot: greedy, no drafts -> the argmax of its raw logits
        assert n[-1] == 1 and toks[-1, 0] == np.argmax(logits[-1, 0]), name


@jax.jit
def _probs(lg, a, d, nd, ng):
    return smp.target_probs(smp.penalize(lg, a, d, nd, ng, jnp.array([-1])), a)


@settings(max_examples=10, deadline=None)
@given(batch_case())
def test_q_equal_p_accepts_every_draft(case):
    """Drafts sampled from the library's own p (row w given d_1..d_w) and q = p: all accepted."""
    a, logits, _, _, _, ng = case
    rng = np.random.default_rng(0)
    nd = np.array([K, K, K, 0])
    d = np.zeros((B, K), np.int64)
    for w in range(K):
        p = np.asarray(_probs(jnp.asarray(logits, jnp.float32), a, jnp.asarray(d, jnp.int32),
                              jnp.asarray(nd), jnp.asarray(ng)), np.float64)
        for b in range(B):
            d[b, w] = rng.choice(V, p=p[b, w] / p[b, w].sum())
    r = run(logits, d, nd, a, ng, q=np.asarray(p[:, :K], np.float32))["rejection"]
    np.testing.assert_array_equal(r.accept_num, nd + 1)
    np.testing.assert_array_equal(np.asarray(r.accept_tokens)[:3, :K], d[:3])


def _greedy_batch(seeds, nd=(3, 1, 0, 2)):
    rng = np.random.default_rng(5)
    params = [SamplingParams(temperature=0.0, repetition_penalty=1.3, seed=s) for s in seeds]
    a = pack(params, B, V, prompts=[[1, 2]] * B)
    logits = rng.normal(size=(B, K + 1, V))
    am = logits.argmax(-1)
    drafts = np.where(np.arange(K)[None] < np.array(nd)[:, None], am[:, :K], -1)
    drafts[0, 1] = (drafts[0, 1] + 1) % V                   # one wrong draft
    return a, logits, drafts, np.array(nd)


def test_greedy_rows_consume_no_randomness():
    a1, logits, drafts, nd = _greedy_batch([1, 2, 3, 4])
    a2, *_ = _greedy_batch([99, 98, 97, 96])
    ng = [0, 3, 5, 7]
    r1 = run(logits, drafts, nd, a1, ng)
    r2 = run(logits, drafts, nd, a2, ng)
    # poison every draw: greedy rows never read one (the topp rule included: its greedy rows
    # select the argmax for any draw)
    r3 = run(logits, drafts, nd, a1, ng, u=np.full((B, K + 1, 2), np.nan))
    for name in ("auto", "target_match", "topp", "greedy"):
        chex.assert_trees_all_equal(r1[name], r2[name], r3[name])
    assert list(np.asarray(r1["auto"].accept_num)) == [2, 2, 1, 3]


def test_sampled_row_independent_of_batch_mates():
    rng = np.random.default_rng(3)
    p_main = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, frequency_penalty=0.5)
    others = [SamplingParams(temperature=t, seed=int(s)) for t, s in
              zip([0.0, 2.0, 0.5], rng.integers(0, 1000, 3))]
    logits = rng.normal(size=(B, K + 1, V))
    drafts = rng.integers(0, V, (B, K))
    outs = []
    for pos in range(B):                            # the main request in each slot in turn
        params = others[:pos] + [p_main] + others[pos:]
        lg, dr = logits.copy(), drafts.copy()
        lg[pos], dr[pos] = logits[0], drafts[0]
        res = run(lg, dr, [K] * B, pack(params, B, V), [4] * B)
        outs.append({n: (np.asarray(r.accept_tokens)[pos], int(r.accept_num[pos]))
                     for n, r in res.items()})
    for o in outs[1:]:
        for name in ("auto", "target_match", "topp"):
            np.testing.assert_array_equal(o[name][0], outs[0][name][0])
            assert o[name][1] == outs[0][name][1]


def test_no_retrace_for_new_parameter_values():
    """New parameter values (temperature, top-p/k, penalties, min_tokens, stop / bad ids, seeds,
    prompts) are data: the jitted function is not traced again (``chex.assert_max_traces`` on
    ``verify_all``) and its cache does not grow."""
    rng = np.random.default_rng(0)
    args = lambda: (rng.normal(size=(B, K + 1, V)), rng.integers(0, V, (B, K)),  # noqa: E731
                    rng.integers(0, K + 1, B))
    run(*args(), pack([SamplingParams()] * B, B, V), [0] * B)
    size = verify_all._cache_size()
    for i, (t, tp, tk, rp, mt) in enumerate([(0.0, 1.0, 0, 1.0, 0), (0.7, 0.9, 3, 1.2, 2),
                                             (1.5, 0.5, 1, 0.9, 1)]):
        params = [SamplingParams(temperature=t, top_p=tp, top_k=tk, repetition_penalty=rp,
                                 frequency_penalty=0.1 * i, presence_penalty=-0.1 * i,
                                 min_tokens=mt, max_tokens=8, seed=i, stop_token_ids=(i,),
                                 bad_token_ids=(i + 1,))] * B
        a = pack(params, B, V, prompts=[[i, i + 2]] * B)
        lg, d, nd = args()
        jax.block_until_ready(run(lg, d, nd, a, rng.integers(0, 9, B), eos=[9]))
    assert verify_all._cache_size() == size


def test_no_speculation_k0():
    a = pack([SamplingParams(), SamplingParams(temperature=1.0, seed=2)], 2, V)
    lg = np.random.default_rng(0).normal(size=(2, 1, V))
    res = run(lg, np.zeros((2, 0)), [0, 0], a, [0, 0], names=("auto", "target_match", "topp"))
    assert set(res) == {"auto", "target_match", "topp"}
    for r in res.values():
        assert r.accept_tokens.shape == (2, 1) and list(np.asarray(r.accept_num)) == [1, 1]
        assert int(r.accept_tokens[0, 0]) == int(np.argmax(lg[0, 0]))


# ----------------------------------------------------------------------------------------------
# p = 0 is never emitted, also with extreme uniform draws


@pytest.mark.parametrize("u_raw", [0.0, float(np.nextafter(np.float32(1), np.float32(0)))])
def test_zero_probability_token_never_emitted(u_raw):
    """Token 0 is excluded from p (bad token; bad token + top-k; min_tokens with EOS = 0); every
    draft proposes it; every draw is forced to ``u_raw``: 0 exercises ``u <= p/q`` with p = 0
    (coin = 1 - u = 1) and ``cumsum >= u * total`` at index 0; 1 - 2**-24 the other extreme."""
    logits = np.zeros((B, K + 1, V))
    logits[:, :, 0] = 5.0                                   # token 0 would be the favourite
    logits[:, :, 3] = 1.0
    params = [SamplingParams(temperature=1.0, bad_token_ids=(0,), seed=1),
              SamplingParams(temperature=1.0, top_k=2, bad_token_ids=(0,), seed=2),
              SamplingParams(temperature=2.0, min_tokens=5, max_tokens=9, seed=3),
              SamplingParams(temperature=0.5, top_p=0.5, bad_token_ids=(0,), seed=4)]
    a = pack(params, B, V)
    drafts = np.zeros((B, K), np.int64)
    q = np.full((B, K, V), 0.02)
    q[:, :, 0] = 0.9                                        # q puts most mass on token 0 ...
    q[3, :, 0] = 0.0                                        # ... except a draft outside q
    q /= q.sum(-1, keepdims=True)
    res = run(logits, drafts, [K] * B, a, [0] * B, eos=[0], q=q,
              u=np.full((B, K + 1, 2), u_raw, np.float32))
    for name, r in res.items():
        toks = np.asarray(r.accept_tokens)
        assert np.all(np.asarray(r.accept_num) == 1), name
        assert np.all(toks[:, 0] > 0), name


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


@settings(max_examples=12, deadline=None)
@given(equivalence_case())
def test_speculative_greedy_equals_sequential_reference(case):
    """Three greedy requests (+ an idle slot) decoded speculatively -- drafts are the reference's
    own next tokens, some corrupted, 0..K per step -- emit exactly the tokens and logprobs of
    sequential non-speculative decoding with the same penalties, min_tokens, bad words, stops."""
    slots, wrong, seed = case
    rng = np.random.default_rng(seed + 1)
    eos = [V - 1]
    N = 12
    refs = [ref_greedy_decode(t, pr, p, eos, bw, N + K + 1) for p, pr, bw, t in slots]
    a = SamplingArrays.empty(B, V, **SHAPES)
    for b, (p, pr, bw, _) in enumerate(slots):
        a = rows.set_slot(a, b, p, pr, bad_words_ids=bw, request_seed=b)
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
        r = run(logits, drafts, nd, a, ng, eos=eos)["auto"]
        toks, num = np.asarray(r.accept_tokens), np.asarray(r.accept_num).copy()
        for b in range(len(slots)):
            if stopped[b] or ng[b] >= N:
                num[b] = 0
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
            np.testing.assert_array_equal(ids, np.argsort(-lref, kind="stable")[:2])
            np.testing.assert_allclose(tops, np.sort(lref)[::-1][:2], atol=1e-4)


def test_min_tokens_boundary_in_window_and_eos_truncation():
    """EOS is the raw argmax everywhere; min_tokens = 3, 2 tokens generated: row 0 masks EOS,
    rows >= 1 do not. With EOS drafted at row 1 the window stops right after it."""
    eos = 9
    lg = np.zeros((2, K + 1, V))
    lg[:, :, eos] = 5.0
    lg[:, :, 4] = 3.0
    params = [SamplingParams(min_tokens=3, max_tokens=9),
              SamplingParams(min_tokens=3, max_tokens=9, ignore_eos=True)]
    drafts = np.array([[4, eos, eos], [eos, eos, eos]])
    r = run(*pad_batch(params, lg, drafts, [3, 3], [2, 2]), eos=[eos])["auto"]
    assert list(np.asarray(r.accept_tokens)[0]) == [4, eos, -1, -1]
    assert int(r.accept_num[0]) == 2
    # ignore_eos: EOS is neither masked by min_tokens nor a stop: all accepted + the bonus
    assert list(np.asarray(r.accept_tokens)[1]) == [eos, eos, eos, eos]
    # one token generated: EOS masked at rows 0 and 1 -> the EOS draft at row 1 is rejected
    r = run(*pad_batch(params, lg, drafts, [3, 3], [1, 1]), eos=[eos])["auto"]
    assert list(np.asarray(r.accept_tokens)[0]) == [4, 4, -1, -1]


def test_stop_token_inside_accepted_drafts():
    lg = np.zeros((1, K + 1, V))
    lg[0, :, 2] = 1.0
    lg[0, 1, 7] = 2.0
    params = [SamplingParams(stop_token_ids=(7,)), SamplingParams()]
    r = run(*pad_batch(params, np.concatenate([lg, lg]), [[2, 7, 2], [2, 7, 2]], [3, 3],
                       [0, 0]))["auto"]
    assert list(np.asarray(r.accept_tokens)[0]) == [2, 7, -1, -1]
    assert list(np.asarray(r.accept_tokens)[1]) == [2, 7, 2, 2]      # 7 is no stop for slot 1


# ----------------------------------------------------------------------------------------------
# FastDeploy topp parity (``top_p_candidates`` + ``speculate_verify``), hand-worked

P_ROWS = {   # V = 10 distributions over ids 0..4; ids 5..9 share the remaining mass equally
    "a": [0.50, 0.20, 0.15, 0.10, 0.03],   # top_p 0.8 -> len 3 (cumsum 0.5, 0.7, 0.85)
    "b": [0.90, 0.04, 0.03, 0.02, 0.005],  # top_p 0.8 -> len 1
    "c": [0.30, 0.25, 0.20, 0.15, 0.05],   # top_p 0.8 -> len 4 (0.3, 0.55, 0.75, 0.9)
}
B_PERM = np.array([7, 1, 2, 3, 4, 5, 6, 0, 8, 9])   # row "b" with its top-1 moved to id 7


def _row(name, perm=None):
    p = np.zeros(V)
    p[:5] = P_ROWS[name]
    p[5:] = (1 - sum(P_ROWS[name])) / 5
    return np.log(p if perm is None else p[perm])


def topp_cases(cases, variant="topp", u_raw=0.5, eos=(-1,), top_p=0.8):
    """Run up to B hand-worked cases ``(rows, drafts)`` in one batch -> [(tokens, accept_num)]."""
    lg = np.zeros((B, K + 1, V))
    drafts = np.full((B, K), -1)
    nd = np.zeros(B, np.int64)
    for i, (rows, dr) in enumerate(cases):
        lg[i, :len(rows)] = rows
        drafts[i, :len(dr)] = dr
        nd[i] = len(dr)
    params = [SamplingParams(temperature=1.0, top_p=top_p, seed=0)] * len(cases)
    a = pack(params, B, V)
    r = run(lg, drafts, nd, a, [0] * B, eos=eos, u=np.full((B, K + 1, 2), u_raw))[variant]
    return [(list(np.asarray(r.accept_tokens)[i][:len(rows)]), int(r.accept_num[i]))
            for i, (rows, _) in enumerate(cases)]


def test_topp_candidate_lengths():
    probs = jnp.asarray(np.exp(np.stack([_row("a"), _row("b"), _row("c")]))[None], jnp.float32)
    ids, scores, ln = vf.topp_candidates(probs, jnp.array([0.8]), 5)
    assert list(np.asarray(ln)[0]) == [3, 1, 4]
    assert list(np.asarray(ids)[0, 0]) == [0, 1, 2, 3, 4]
    # FastDeploy's short candidate set: top-2 mass 0.7 < 0.8 -> 0; clamped -> C; top_p == 1 -> C
    ids, scores, ln = vf.topp_candidates(probs, jnp.array([0.8]), 2)
    assert list(np.asarray(ln)[0]) == [0, 1, 0]
    ids, scores, ln = vf.topp_candidates(probs, jnp.array([0.8]), 2, clamp=True)
    assert list(np.asarray(ln)[0]) == [2, 1, 2]
    ids, scores, ln = vf.topp_candidates(probs, jnp.array([1.0]), 2)
    assert list(np.asarray(ln)[0]) == [2, 2, 2]


def test_topp_nucleus_membership_and_bonus():
    rows = [_row("a"), _row("c"), _row("a")]
    cases = [(rows, [2, 4]),   # d1 = 2: 3rd candidate, inside len 3 -> accepted; d2 = 4: 5th of
                               # row "c" (len 4), not its 2nd -> rejected, correction from row 1
             (rows, [2, 3])]   # d2 = 3: 4th of "c" -> accepted; bonus from row 2
    # u = 1 - 0 = 1: threshold T* = min(sum of the first len scores, top_p) = 0.8 ->
    # row "c": first cumsum >= 0.8 is 0.9 -> id 3; row "a": 0.85 -> id 2
    assert topp_cases(cases, u_raw=0.0) == [([2, 3, -1], 2), ([2, 3, 2], 3)]
    # u = 0.5: threshold 0.4 -> row "c": cumsum 0.3, 0.55 -> id 1; row "a": 0.5 -> id 0
    assert topp_cases(cases, u_raw=0.5) == [([2, 1, -1], 2), ([2, 3, 0], 3)]


def test_topp_window_relaxation():
    rows = [_row("b"), _row("b", B_PERM), _row("b"), _row("a")]
    cases = [
        # d1 = 1: 2nd candidate of row 0 (len 1, so rejected by membership); d2 = 7 and d3 = 0
        # are the top-1 of rows 1 and 2 -> verify_window = 2 accepts all three; bonus from row 3
        (rows, [1, 7, 0]),
        # only one top-1 match after the top-2 draft -> no relaxation; correction from row 0
        (rows, [1, 7, 5]),
        # K = 2 <= verify_window: never triggers
        (rows[:3], [1, 7]),
        # d1 = 5 is not the 2nd candidate -> no relaxation
        (rows, [5, 7, 0]),
    ]
    assert topp_cases(cases) == [([1, 7, 0, 0], 4), ([0, -1, -1, -1], 1), ([0, -1, -1], 1),
                                 ([0, -1, -1, -1], 1)]
    # verify_window = 1: accepts d1, d2 and samples from row 2; C = 1: no 2nd candidate at all
    assert topp_cases(cases[1:2], variant="topp_w1") == [([1, 7, 0, -1], 3)]
    assert topp_cases(cases[:1], variant="topp_c1") == [([0, -1, -1, -1], 1)]


def test_topp_eos_inside_window_truncates():
    """FastDeploy reports accept_num = 3 for the window [1, EOS, 0] (it subtracts one for an EOS
    inside the window); jmtp stops at the EOS."""
    rows = [_row("b"), _row("b", B_PERM), _row("b"), _row("a")]
    got = topp_cases([(rows, [1, 7, 0]), (rows, [0, 7, 0])], eos=[7])
    # the second case accepts the EOS by plain membership: it stops there too (no bonus)
    assert got == [([1, 7, -1, -1], 2), ([0, 7, -1, -1], 2)]


def test_topp_q8_short_candidate_set():
    rows = [_row("a"), _row("a")]
    # C = 2, top_p 0.8: top-2 mass 0.7 -> len 0 -> even the argmax draft is rejected; the
    # correction is candidate 0 (the same token, emitted as a correction)
    assert topp_cases([(rows, [0])], variant="topp_c2") == [([0, -1], 1)]
    # clamped to C: d1 = 1 accepted; bonus with T* = min(0.7, 0.8), u = 1 -> id 1
    assert topp_cases([(rows, [1])], variant="topp_c2_clamp", u_raw=0.0) == [([1, 1], 2)]


def test_topp_greedy_rows_use_fd_rewrite():
    rows = np.stack([_row("c"), _row("b", B_PERM), _row("b"), _row("a")])
    a = pack([SamplingParams(temperature=0.0)], B, V)
    lg = np.concatenate([rows[None], np.zeros((B - 1, K + 1, V))])
    drafts = np.concatenate([[[0, 7, 1]], np.full((B - 1, K), -1)])
    r = run(lg, drafts, [3, 0, 0, 0], a, [0] * B, u=np.full((B, K + 1, 2), 0.3))["topp"]
    # top_p -> 1e-5: len 1 -> argmax matching: 0 and 7 accepted; 1 is the 2nd candidate of row
    # 2 but no drafts follow it (no relaxation); the correction is the argmax 0.
    assert list(np.asarray(r.accept_tokens)[0]) == [0, 7, 0, -1]


# ----------------------------------------------------------------------------------------------
# bad values


def test_bad_values_name_the_argument():
    a = pack([SamplingParams()], 1, V)
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
    with pytest.raises(ValueError, match="uniforms"):
        vf.verify(lg, d, one, None, a, one, one, uniforms=jnp.zeros((1, K + 1, 1)))
    with pytest.raises(ValueError, match="sampling"):
        vf.verify(jnp.zeros((1, K + 1, V + 2)), d, one, None, a, one, one)
    assert vf.check_strategy("topp") == "topp"


@settings(max_examples=10, deadline=None)
@given(st.integers(0, 2**31 - 1), st.booleans())
def test_all_greedy_shortcut_equals_the_sampled_path(seed, penalties):
    """An all-greedy batch skips the target distributions (``lax.cond`` in ``_rejection``) and,
    without penalties, the history counts (``penalize``): the result must equal what the full
    sampled path gives for the same greedy rows, and penalising with neutral values."""
    rng = np.random.default_rng(seed)
    extra = dict(repetition_penalty=1.3, presence_penalty=0.4) if penalties else {}
    params = [SamplingParams(temperature=0.0, seed=i, **extra) for i in range(B)]
    a = pack(params, B, V, prompts=[[1, 2]] * B)
    logits = jnp.asarray(rng.normal(size=(B, K + 1, V)), jnp.float32)
    d = jnp.asarray(np.where(rng.random((B, K)) < 0.5, logits.argmax(-1)[:, :K],
                             rng.integers(0, V, (B, K))), jnp.int32)
    nd = jnp.asarray(rng.integers(0, K + 1, B), jnp.int32)
    ng = jnp.asarray(rng.integers(0, 4, B), jnp.int32)
    eos = jnp.asarray([-1], jnp.int32)
    valid = jnp.arange(K)[None] < nd[:, None]
    pen = smp.penalize(logits, a, jnp.where(valid, d, 0), nd, ng, eos)
    u = jnp.zeros((B, K + 1, 2), jnp.float32)
    greedy = jnp.ones((B,), bool)
    fast = vf._rejection(pen, jnp.where(valid, d, 0), valid, nd, None, a, u, greedy)
    full = vf._rejection_sampled(pen, jnp.where(valid, d, 0), valid, nd, None, a, u, greedy)
    chex.assert_trees_all_equal(fast, full)
    if not penalties:     # neutral penalties: the skipped branch would give the logits unchanged
        np.testing.assert_array_equal(np.asarray(pen), np.asarray(logits))
