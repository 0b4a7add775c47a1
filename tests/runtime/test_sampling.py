"""SamplingParams / SamplingArrays and the logits processors, against a float64 numpy reference.

The ``ref_*`` functions below are the independent sequential reference (one position at a time,
explicit Python loops over the history) used by test_verify.py and test_verify_distribution.py too.
"""
from __future__ import annotations

import dataclasses

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings

from jmtp.runtime.device import sampling as smp
from jmtp.runtime.device.sampling import SamplingArrays
from jmtp.runtime.host import sampling_rows as rows
from jmtp.runtime.host.sampling_params import SamplingParams

# ----------------------------------------------------------------------------------------------
# numpy reference (float64), one output position at a time


def ref_penalize(logits, prompt, generated, params: SamplingParams, eos_ids=(), bad_words_ids=(),
                 extra_stop=()):
    """Penalized logits f64[V] for the next token after ``prompt + generated``."""
    x = np.asarray(logits, np.float64).copy()
    V = x.shape[0]
    counts = np.zeros(V)
    for t in generated:
        counts[t] += 1
    rep = params.repetition_penalty
    for t in set(prompt) | set(generated):
        x[t] = x[t] / rep if x[t] > 0 else x[t] * rep
    for t in range(V):
        x[t] -= params.frequency_penalty * counts[t] + params.presence_penalty * (counts[t] > 0)
    if len(generated) < params.min_tokens:
        stops = list(params.stop_token_ids) + list(extra_stop)
        if not params.ignore_eos:
            stops += list(eos_ids)
        for t in stops:
            x[t] = -np.inf
    for t in params.bad_token_ids:
        x[t] = -np.inf
    hist = list(prompt) + list(generated)
    for seq in bad_words_ids:
        seq = list(seq)
        tail = hist[len(hist) - len(seq) + 1:] if len(hist) >= len(seq) - 1 else None
        if len(seq) == 1 or tail == seq[:-1]:
            x[seq[-1]] = -np.inf
    return x


def _np_softmax(z):
    z = np.asarray(z, np.float64)
    m = np.max(z)
    e = np.exp(z - m)
    return e / e.sum()


def ref_probs(pen, temperature, top_p=1.0, top_k=0, min_p=0.0):
    """Target distribution f64[V] from penalized logits (temperature, min-p, top-k, top-p)."""
    pen = np.asarray(pen, np.float64)
    V = pen.shape[0]
    if temperature < 1e-5:
        out = np.zeros(V)
        out[int(np.argmax(pen))] = 1.0
        return out
    z = pen / temperature
    p = _np_softmax(z)
    z = np.where(p < min_p * p.max(), -np.inf, z)
    k = top_k if 0 < top_k < V else V
    order = np.argsort(-z, kind="stable")
    zs = z[order]
    keep = zs >= zs[k - 1]
    ps = _np_softmax(np.where(keep, zs, -np.inf))
    mass_before = 0.0
    for r in range(V):
        if keep[r] and not (mass_before < top_p or top_p >= 1.0):
            keep[r] = False
        mass_before += ps[r]
    full = np.zeros(V, bool)
    full[order] = keep
    return _np_softmax(np.where(full, z, -np.inf))


def ref_params_probs(logits, prompt, generated, params, eos_ids=(), bad_words_ids=()):
    pen = ref_penalize(logits, prompt, generated, params, eos_ids, bad_words_ids)
    return ref_probs(pen, params.temperature, params.top_p, params.top_k, params.min_p)


# ----------------------------------------------------------------------------------------------
# SamplingParams validation

BAD_VALUES = [
    ("temperature", -0.1), ("temperature", float("nan")), ("top_p", 0.0), ("top_p", 1.5),
    ("top_k", -2), ("min_p", -0.1), ("min_p", 1.1), ("max_tokens", 0),
    ("repetition_penalty", 0.0), ("frequency_penalty", 2.5), ("presence_penalty", -3.0),
    ("min_tokens", -1), ("logprobs", -1), ("seed", 2**63), ("seed", -(2**63) - 1),
    ("seed", 1.5), ("logit_bias", {5: 100.5}), ("logit_bias", {-1: 1.0}),
    ("logit_bias", {5: float("nan")}), ("logit_bias", {"5": 1.0}), ("logit_bias", "x"),
    ("logit_bias", [(5, 1.0), (5, 2.0)]), ("skip_special_tokens", "yes"),
    ("prompt_logprobs", -1), ("prompt_logprobs", 1.5),
    ("stop_token_ids", (-3,)), ("bad_token_ids", (1.5,)), ("bad_words", ("",)),
    ("ignore_eos", "yes"), ("stop_token_ids", "12"), ("n", 0), ("n", 1.5), ("stop", [""]),
    ("stop", [3]), ("stop", b"x"), ("include_stop_str_in_output", "yes"),
]


def test_top_k_minus_one_is_off_and_stop_normalised():
    # vLLM / OpenAI clients send top_k=-1 for "off": the same parameters as top_k=0.
    assert SamplingParams(top_k=-1) == SamplingParams(top_k=0)
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(stop="\n").stop == ("\n",)
    assert SamplingParams(stop=["a", "bc"]).stop == ("a", "bc")
    assert SamplingParams(stop=None).stop == ()


@pytest.mark.parametrize("field,value", BAD_VALUES)
def test_params_bad_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_seed_and_logit_bias_conventions():
    """vLLM: seed=-1 means no seed; seeds are 64-bit (OpenAI's int64). logit_bias: OpenAI's
    {token: bias in [-100, 100]}, stored as sorted (id, bias) pairs; {} is no bias."""
    assert SamplingParams(seed=-1).seed is None
    assert SamplingParams(seed=-2).seed == -2 and SamplingParams(seed=2**63 - 1).seed == 2**63 - 1
    assert SamplingParams(seed=-2).seed_halves == (2**32 - 2, 2**32 - 1)
    assert SamplingParams(seed=2**32 + 5).seed_halves == (5, 1)
    p = SamplingParams(logit_bias={9: -100, 3: 100.0, 4: 0.5})
    assert p.logit_bias == ((3, 100.0), (4, 0.5), (9, -100.0))
    assert SamplingParams(logit_bias=[[9, -100], [3, 100]]).logit_bias == ((3, 100.0), (9, -100.0))
    assert SamplingParams(logit_bias={}).logit_bias is None
    assert SamplingParams().skip_special_tokens and SamplingParams().prompt_logprobs is None


def test_params_min_tokens_above_max_tokens():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)
    SamplingParams(max_tokens=4, min_tokens=4)


def test_params_good_values_and_tuples():
    p = SamplingParams(temperature=0.7, top_p=0.9, top_k=5, min_p=0.1, repetition_penalty=1.2,
                       frequency_penalty=-2, presence_penalty=2, stop_token_ids=[3, 4],
                       bad_token_ids=[1], bad_words=["foo"], seed=7, logprobs=0)
    assert p.stop_token_ids == (3, 4) and p.bad_token_ids == (1,) and p.bad_words == ("foo",)
    assert not p.greedy and SamplingParams().greedy


# ----------------------------------------------------------------------------------------------
# SamplingArrays construction, slots and padding


FULL = SamplingParams(temperature=0.8, top_p=0.7, top_k=3, min_p=0.05, repetition_penalty=1.3,
                      frequency_penalty=0.4, presence_penalty=0.2, min_tokens=2,
                      stop_token_ids=(5,), bad_token_ids=(6,), ignore_eos=False, seed=11,
                      logprobs=3)


def _tree_equal(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(np.array_equal(np.asarray(x), np.asarray(y))
                                      for x, y in zip(la, lb))


def test_empty_is_neutral_and_shapes():
    a = SamplingArrays.empty(3, 10, max_stop=2, max_bad_words=2, max_bad_word_len=3)
    assert a.batch_size == 3 and a.vocab_size == 10
    assert a.stop_token_ids.shape == (3, 2) and a.bad_word_seqs.shape == (3, 2, 3)
    assert a.recent_tokens.shape == (3, 2) and a.seed.dtype == jnp.uint32
    assert a.output_counts.dtype == jnp.int32 and a.prompt_mask.dtype == jnp.bool_
    np.testing.assert_array_equal(a.temperature, 0.0)
    np.testing.assert_array_equal(a.repetition_penalty, 1.0)
    assert not np.any(a.bad_token_mask) and np.all(np.asarray(a.stop_token_ids) == -1)
    with pytest.raises(ValueError, match="max_stop"):
        SamplingArrays.empty(2, 10, max_stop=0)


@pytest.mark.parametrize("as_numpy", [False, True])
def test_set_slot_rewrites_everything_and_clear_restores_neutral(as_numpy):
    B, V = 3, 12
    base = SamplingArrays.empty(B, V, max_stop=3, max_bad_words=1, max_bad_word_len=2,
                                as_numpy=as_numpy)
    a = rows.set_slot(base, 1, FULL, [1, 2, 2, 9], eos_ids=[11], request_seed=3,
                     bad_words_ids=[[4], [7, 8]])
    a = smp.update_history(jax.tree.map(jnp.asarray, a), jnp.array([[0, 0], [3, 3], [0, 0]]),
                           jnp.array([0, 2, 0]))
    r = jax.tree.map(lambda x: np.asarray(x)[1], a)
    assert r.temperature == np.float32(0.8) and r.top_k == 3 and r.seed == 11 and r.logprobs == 3
    assert list(r.stop_token_ids) == [5, 11, -1]
    assert r.bad_token_mask[6] and r.bad_token_mask[4] and r.bad_token_mask.sum() == 2
    assert list(r.bad_word_seqs[0]) == [7, 8] and list(r.recent_tokens) == [3]
    assert r.prompt_mask[[1, 2, 9]].all() and r.prompt_mask.sum() == 3 and r.output_counts[3] == 2
    # rows 0 and 2 untouched
    for s in (0, 2):
        assert _tree_equal(jax.tree.map(lambda x: np.asarray(x)[s], a),
                           jax.tree.map(lambda x: np.asarray(x)[s], base))
    # a new occupant with default params: nothing of the previous one survives
    b = rows.set_slot(a, 1, SamplingParams(), [], request_seed=0)
    assert _tree_equal(b, jax.tree.map(jnp.asarray, base))
    c = rows.clear_slot(a, 1)
    assert _tree_equal(c, jax.tree.map(jnp.asarray, base))


def test_set_slot_errors_name_the_argument():
    a = SamplingArrays.empty(2, 8, max_stop=2)
    with pytest.raises(ValueError, match="slot"):
        rows.set_slot(a, 2, SamplingParams(), [])
    with pytest.raises(ValueError, match="prompt_ids"):
        rows.set_slot(a, 0, SamplingParams(), [8])
    with pytest.raises(ValueError, match="stop_token_ids"):
        rows.set_slot(a, 0, SamplingParams(stop_token_ids=(1, 2)), [], eos_ids=[3])
    rows.set_slot(a, 0, SamplingParams(stop_token_ids=(1, 2), ignore_eos=True), [], eos_ids=[3])
    with pytest.raises(ValueError, match="bad_token_ids"):
        rows.set_slot(a, 0, SamplingParams(bad_token_ids=(9,)), [])
    with pytest.raises(ValueError, match="bad_words_ids"):
        rows.set_slot(a, 0, SamplingParams(), [], bad_words_ids=[[1, 2]])  # no capacity
    with pytest.raises(ValueError, match="vocab_size"):
        rows.set_slot(a, 0, SamplingParams(), [], vocab_size=9)
    with pytest.raises(ValueError, match="params"):
        rows.pack_sampling([SamplingParams()] * 3, 2, 8)


def test_seed_defaults():
    a = rows.pack_sampling([SamplingParams(seed=5), SamplingParams()], 2, 8, seeds=[1, 9])
    assert list(np.asarray(a.seed)) == [5, 9]


# ----------------------------------------------------------------------------------------------
# penalize / target_probs vs the reference


PV, PK, PG = 12, 3, 5     # fixed shapes: one compilation for every hypothesis example


@st.composite
def processing_case(draw):
    V, K = PV, PK
    seed = draw(st.integers(0, 2**31))
    rng = np.random.default_rng(seed)
    nd = draw(st.integers(0, K))
    prompt = [int(t) for t in rng.integers(0, V, draw(st.integers(0, 5)))]
    generated = [int(t) for t in rng.integers(0, V, draw(st.integers(0, PG)))]
    drafts = [int(t) for t in rng.integers(0, V, K)]
    bad_words = [[int(t) for t in rng.integers(0, V, n)]
                 for n in draw(st.lists(st.integers(1, 3), max_size=3))]
    params = SamplingParams(
        max_tokens=64,
        temperature=draw(st.sampled_from([0.0, 0.5, 1.0, 1.7])),
        top_p=draw(st.sampled_from([1.0, 0.9, 0.5])),
        top_k=draw(st.sampled_from([0, 1, 3, 20])),
        min_p=draw(st.sampled_from([0.0, 0.1])),
        repetition_penalty=draw(st.sampled_from([1.0, 1.3, 0.8])),
        frequency_penalty=draw(st.sampled_from([0.0, 0.5, -0.4])),
        presence_penalty=draw(st.sampled_from([0.0, 0.7, -0.3])),
        min_tokens=draw(st.integers(0, 8)),
        stop_token_ids=tuple(int(t) for t in rng.integers(0, V, draw(st.integers(0, 2)))),
        bad_token_ids=tuple(int(t) for t in rng.integers(0, V, draw(st.integers(0, 2)))),
        ignore_eos=draw(st.booleans()), seed=int(rng.integers(0, 2**32)))
    eos = [int(rng.integers(0, V))]
    logits = (rng.normal(size=(K + 1, V)) * 2).astype(np.float32)
    return V, K, nd, prompt, generated, drafts, bad_words, params, eos, logits


_update = jax.jit(smp.update_history)


def arrays_with_history(B, V, slot_params, *, max_stop=4, max_bad_words=3, LW=3, G=PG):
    """SamplingArrays for ``B`` slots from ``[(params, prompt, generated, bad_words, eos)]``
    (missing slots idle); the generated tokens are added with update_history (padded to G)."""
    a = SamplingArrays.empty(B, V, max_stop=max_stop, max_bad_words=max_bad_words,
                             max_bad_word_len=LW)
    toks = np.zeros((B, G), np.int32)
    nums = np.zeros((B,), np.int32)
    for b, (params, prompt, generated, bad_words, eos) in enumerate(slot_params):
        a = rows.set_slot(a, b, params, prompt, bad_words_ids=bad_words, eos_ids=eos,
                         request_seed=b)
        toks[b, :len(generated)] = generated
        nums[b] = len(generated)
    return _update(a, jnp.asarray(toks), jnp.asarray(nums))


@jax.jit
def _process(lg, a, d, nd, ng, eos):
    pen = smp.penalize(lg, a, d, nd, ng, eos)
    return pen, smp.target_probs(pen, a)


@settings(max_examples=20, deadline=None)
@given(processing_case())
def test_penalize_and_target_probs_match_sequential_reference(case):
    V, K, nd, prompt, generated, drafts, bad_words, params, eos, logits = case
    a = arrays_with_history(2, V, [(params, prompt, generated, bad_words, ())])
    lg = jnp.asarray(np.stack([logits, logits]))
    d = jnp.asarray([drafts, drafts], jnp.int32)
    ng = jnp.array([len(generated), 0])
    pen, p = _process(lg, a, d, jnp.array([nd, 0]), ng, jnp.asarray(eos))
    for w in range(nd + 1):
        hist = generated + drafts[:w]
        ref = ref_penalize(logits[w], prompt, hist, params, eos, bad_words)
        got = np.asarray(pen[0, w], np.float64)
        np.testing.assert_array_equal(np.isinf(got), np.isinf(ref))
        fin = np.isfinite(ref)
        np.testing.assert_allclose(got[fin], ref[fin], rtol=1e-5, atol=1e-5)
        if np.isfinite(ref).any():
            pr = ref_probs(ref, params.temperature, params.top_p, params.top_k, params.min_p)
            np.testing.assert_allclose(np.asarray(p[0, w]), pr, atol=2e-5)
    # the idle slot 1 is neutral: untouched logits, greedy one-hot
    np.testing.assert_array_equal(np.asarray(pen[1]), np.asarray(lg[1]))
    np.testing.assert_array_equal(np.asarray(p[1]).argmax(-1), np.asarray(lg[1]).argmax(-1))


def test_min_tokens_boundary_and_ignore_eos():
    V = 8
    eos = jnp.array([7])
    lg = jnp.zeros((2, 4, V))
    params = [SamplingParams(min_tokens=4, stop_token_ids=(3,), max_tokens=9),
              SamplingParams(min_tokens=4, stop_token_ids=(3,), max_tokens=9, ignore_eos=True)]
    a = rows.pack_sampling(params, 2, V)
    pen = np.asarray(jax.jit(smp.penalize)(lg, a, jnp.zeros((2, 3), jnp.int32),
                                           jnp.array([3, 3]), jnp.array([2, 2]), eos))
    # num_generated + w < 4  <=>  w < 2
    assert np.all(np.isinf(pen[0, :2, [3, 7]])) and np.all(np.isfinite(pen[0, 2:, [3, 7]]))
    assert np.all(np.isinf(pen[1, :2, 3])) and np.all(np.isfinite(pen[1, :, 7]))


def test_filter_ties_and_top_p_one():
    z = jnp.asarray([[1.0, 2.0, 2.0, 0.0, -1e4]])
    f = jax.jit(smp.filter_logits)
    one = lambda k, p, m: np.asarray(f(z, jnp.array([k], jnp.int32),  # noqa: E731
                                       jnp.array([p], jnp.float32), jnp.array([m], jnp.float32)))[0]
    assert np.isfinite(one(2, 1.0, 0.0)).sum() == 2       # the two tied maxima
    assert np.isfinite(one(1, 1.0, 0.0)).sum() == 2       # ties at the k-th value are kept
    assert np.isfinite(one(0, 1.0, 0.0)).sum() == 5       # top_p = 1 keeps even p ~ 0
    kept = one(0, 0.3, 0.0)                               # first of the tied pair (lower id) only
    assert list(np.isfinite(kept)) == [False, True, False, False, False]
    assert list(np.isfinite(one(0, 1.0, 0.5))) == [False, True, True, False, False]


def test_filter_sort_and_pairwise_agree_with_reference():
    """Both top-k/top-p implementations (sort for large V, pairwise ranks for tiny V) keep the
    same ids as the reference, ties included (integer-valued logits make ties frequent)."""
    N, V = 48, 24
    rng = np.random.default_rng(7)
    z = np.round(rng.normal(size=(N, V)) * 2)                     # many exact ties
    top_k = rng.choice([0, 1, 3, 7, 30], N).astype(np.int32)
    top_p = rng.choice([1.0, 0.93, 0.55, 0.27], N).astype(np.float32)   # off exact tie sums
    min_p = rng.choice([0.0, 0.0, 0.05], N).astype(np.float32)
    args = (jnp.asarray(z, jnp.float32), jnp.asarray(top_k), jnp.asarray(top_p),
            jnp.asarray(min_p))
    f = jax.jit(smp.filter_logits, static_argnames=("method",))
    kept_sort = np.isfinite(np.asarray(f(*args, method="sort")))
    kept_pair = np.isfinite(np.asarray(f(*args, method="pairwise")))
    np.testing.assert_array_equal(kept_sort, kept_pair)
    for n in range(N):
        ref = ref_probs(z[n], 1.0, float(top_p[n]), int(top_k[n]), float(min_p[n])) > 0
        np.testing.assert_array_equal(kept_sort[n], ref, err_msg=str(n))


def test_sample_from_probs_never_picks_zero_mass():
    probs = jnp.asarray([[0.0, 0.0, 0.5, 0.0, 0.5, 0.0]] * 3)
    u = jnp.asarray([0.0, np.nextafter(np.float32(1), np.float32(0)), 0.5])
    assert list(np.asarray(smp.sample_from_probs(probs, u))) == [2, 4, 4]
    assert int(smp.sample_from_probs(jnp.zeros((1, 4)), jnp.zeros((1,)))[0]) == 0
    # a running sum equal to u * total (2 of 4) does not exceed it: the next token with mass
    assert int(smp.sample_from_probs(jnp.asarray([[1.0, 1.0, 0.0, 2.0]]), jnp.asarray([0.5]))[0]) == 3
    # the total overflows to inf, so no running sum exceeds u * total: the last token with mass
    assert int(smp.sample_from_probs(jnp.asarray([[0.0, 3e38, 3e38, 0.0]]), jnp.asarray([0.5]))[0]) == 2
    # a NaN row takes the argmax: the first NaN
    nan = float("nan")
    assert int(smp.sample_from_probs(jnp.asarray([[0.0, nan, 1.0, nan]]), jnp.asarray([0.3]))[0]) == 1


def test_sample_from_probs_never_picks_zero_mass_under_rounding():
    # masses spanning ~40 orders of magnitude between zeros: float32 running sums round (XLA:CPU's
    # cumsum even steps down), and a threshold can fall on a zero-mass position
    rng = np.random.default_rng(3)
    probs = np.where(rng.random((32, 5000)) < 0.5, 0.0, np.exp(rng.normal(size=(32, 5000)) * 10))
    probs = jnp.asarray(probs, jnp.float32)
    us = [np.full((32,), u, np.float32) for u in (0.0, 0.25, 0.5, 0.999)]
    # thresholds just past the rise of the running sum (as XLA computes it) at a zero-mass token
    p, cum = np.asarray(probs), np.asarray(jnp.cumsum(probs, axis=-1))
    rises = [np.flatnonzero((p[r, 1:] == 0) & (cum[r, 1:] > cum[r, :-1])) + 1 for r in range(32)]
    for j in range(4):
        u = np.float32(rng.random(32))
        for r, at in enumerate(rises):
            if len(at):
                i = at[j % len(at)]
                u[r] = np.nextafter(cum[r, i - 1], np.float32(np.inf)) / cum[r, -1]
        us.append(u)
    for u in us:
        tokens = np.asarray(smp.sample_from_probs(probs, jnp.asarray(u)))
        assert (p[np.arange(32), tokens] > 0).all(), u


def ref_sample_from_probs(probs, u):
    """Inverse CDF, one row at a time: the first positive-mass token whose running sum exceeds
    ``u * total``; the argmax when the row has no mass."""
    p = np.maximum(np.asarray(probs, np.float64), 0.0)
    total = p.sum()
    if not total > 0:
        return int(np.argmax(p))
    running = 0.0
    for i, mass in enumerate(p):
        running += mass
        if mass > 0 and running > u * total:
            return i
    return int(np.flatnonzero(p)[-1])


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_sample_from_probs_matches_the_sequential_inverse_cdf(data):
    # integer masses and u on a 1/8 grid: every running sum and threshold is exact in float32,
    # so the reference's float64 arithmetic makes the same comparisons
    V = data.draw(st.sampled_from([3, 17, 4096, 5000]), "V")
    rows = data.draw(st.integers(1, 4), "rows")
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31 - 1), "seed"))
    density = data.draw(st.sampled_from([0.002, 0.05, 0.5, 1.0]), "density")
    probs = np.where(rng.random((rows, V)) < density, rng.integers(-1, 3, (rows, V)), 0)
    probs = probs.astype(np.float32)
    u = (rng.integers(0, 8, rows) / 8).astype(np.float32)   # often a running sum equals u*total
    got = np.asarray(jax.jit(smp.sample_from_probs)(jnp.asarray(probs), jnp.asarray(u)))
    assert got.dtype == np.int32
    assert list(got) == [ref_sample_from_probs(probs[r], u[r]) for r in range(rows)]


# ----------------------------------------------------------------------------------------------
# draft sampling, keys, history


_draft = jax.jit(smp.draft_sample, static_argnames=("draft_sampling",))


def test_draft_sample_greedy_and_sampled():
    V, B = 8, 4
    rng = np.random.default_rng(1)
    lg = jnp.asarray(rng.normal(size=(B, V)), jnp.float32)
    a = rows.pack_sampling([SamplingParams(temperature=1.0, seed=s) for s in range(3)] + [None],
                          B, V)
    tok, q = _draft(lg, a)
    assert q is None and list(np.asarray(tok)) == list(np.asarray(lg).argmax(-1))
    with pytest.raises(ValueError, match="positions"):
        smp.draft_sample(lg, a, draft_sampling=True)
    pos = jnp.zeros(B, jnp.int32)
    tok, q = _draft(lg, a, pos, draft_sampling=True, draft_temperature=0.7, draft_top_k=3)
    for b in range(B):
        ref = ref_probs(np.asarray(lg[b]), 0.7, 1.0, 3)
        np.testing.assert_allclose(np.asarray(q[b]), ref, atol=1e-6)
        assert ref[int(tok[b])] > 0
    # request's own temperature: slot 3 (idle, greedy) drafts its argmax with a one-hot q
    tok, q = _draft(lg, a, pos, draft_sampling=True, draft_temperature=None, draft_top_k=None)
    assert int(tok[3]) == int(np.argmax(lg[3])) and float(q[3].max()) == 1.0


def test_draft_sample_empirical_distribution_and_batch_independence():
    V, N = 6, 8000
    lg = jnp.asarray(np.log([0.05, 0.1, 0.15, 0.2, 0.2, 0.3]), jnp.float32)
    lgs = jnp.broadcast_to(lg, (N, V))
    a = rows.pack_sampling([SamplingParams(temperature=1.0, seed=s) for s in range(N)], N, V)
    pos = jnp.asarray(np.arange(N) % 5, jnp.int32)
    tok, _ = _draft(lgs, a, pos, draft_sampling=True)
    freq = np.bincount(np.asarray(tok), minlength=V) / N
    assert 0.5 * np.abs(freq - np.exp(np.asarray(lg))).sum() < 0.03
    # the same requests in other slots (rolled batch): each draws the same token
    roll = lambda x: jnp.roll(x, 3, axis=0)  # noqa: E731
    tok2, _ = _draft(lgs, jax.tree.map(roll, a), roll(pos), draft_sampling=True)
    np.testing.assert_array_equal(np.asarray(tok2), np.roll(np.asarray(tok), 3))


def test_request_keys_depend_only_on_seed_position_purpose():
    u1 = smp.uniform_draws(jnp.array([1, 2, 1], jnp.uint32), jnp.array([5, 5, 5]), 0)
    u2 = smp.uniform_draws(jnp.array([1], jnp.uint32), jnp.array([5]), 0)
    u3 = smp.uniform_draws(jnp.array([1], jnp.uint32), jnp.array([5]), 1)
    assert float(u1[0]) == float(u1[2]) == float(u2[0]) != float(u1[1])
    assert float(u3[0]) != float(u2[0])


def test_update_history_counts_and_recent():
    a = SamplingArrays.empty(2, 6, max_bad_words=1, max_bad_word_len=4)
    a = smp.update_history(a, jnp.array([[1, 2, 2, -1], [3, 4, 5, 0]]), jnp.array([3, 1]))
    a = smp.update_history(a, jnp.array([[5, 0, 0, 0], [4, 4, 0, 0]]), jnp.array([1, 2]))
    np.testing.assert_array_equal(a.output_counts, [[0, 1, 2, 0, 0, 1], [0, 0, 0, 1, 2, 0]])
    np.testing.assert_array_equal(a.recent_tokens, [[2, 2, 5], [3, 4, 4]])


def test_dataclass_is_a_pytree_of_data():
    a = SamplingArrays.empty(2, 5)
    leaves, tree = jax.tree.flatten(a)
    assert len(leaves) == len(dataclasses.fields(SamplingArrays))
    b = jax.jit(lambda x: x)(a)
    assert _tree_equal(a, b)


# ------------------------------------------------------------------------------ vocab_argmax
@pytest.mark.parametrize("shape", [(3, 49152), (2, 3, 8192), (2, 4099), (1, 5000), (4, 100),
                                   (2, 4096)])
def test_vocab_argmax_equals_argmax_with_ties_nan_and_inf(shape):
    """The two-level argmax gives ``np.argmax``'s index: the first maximum among ties, the first
    NaN when a row has one (also after a +inf), the first +inf, 0 for an all -inf row; for
    block-divisible vocabularies (49,152 = 48 x 1024), a prime one (4,099: padded) and short rows
    (plain argmax)."""
    rng = np.random.default_rng(sum(shape))
    x = rng.standard_normal(shape).astype(np.float32)
    flat = x.reshape(-1, shape[-1])
    v = shape[-1]
    flat[0, [v // 3, v - 1]] = 50.0                      # tie across blocks: first one wins
    if flat.shape[0] > 1:
        flat[1, :] = -np.inf                             # all -inf: index 0
    if flat.shape[0] > 2:
        flat[2, [7, v // 2]] = np.nan                    # NaN counts as the maximum
    if flat.shape[0] > 4:
        flat[3, [v - 2, 9]] = np.inf                     # +inf: its first occurrence
        flat[4, [v // 2, v - 1]] = [np.inf, np.nan]      # NaN wins over an earlier +inf
    want = np.argmax(flat, -1)
    assert want[0] == v // 3
    got = np.asarray(jax.jit(smp.vocab_argmax)(jnp.asarray(flat.reshape(shape))))
    assert got.dtype == np.int32 and got.shape == shape[:-1]
    np.testing.assert_array_equal(got.reshape(-1), want)
    # bf16 logits (TPU/GPU): the same as jnp.argmax on the same array
    xb = jnp.asarray(flat, jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(smp.vocab_argmax(xb)),
                                  np.asarray(jnp.argmax(xb, -1)))


@settings(max_examples=25, deadline=None)
@given(st.integers(4096, 20000), st.integers(0, 2**31 - 1))
def test_vocab_argmax_property_random_lengths(v, seed):
    """Any row length (divisible by a block size or padded): equal to ``np.argmax``, also with
    many exact ties (values drawn from a few integers)."""
    rng = np.random.default_rng(seed)
    x = rng.integers(-3, 4, (2, v)).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(smp.vocab_argmax(jnp.asarray(x))), np.argmax(x, -1))
