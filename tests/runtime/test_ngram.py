"""n-gram drafting (``method="ngram"`` and the hybrid ``mtp_strategy="with_ngram"``): the jnp
matcher against a plain-Python reference of the rule, engine losslessness (greedy and in
distribution) and no recompiles."""
from __future__ import annotations

import dataclasses
import functools
import importlib.util
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from jmtp.runtime.config import SpeculativeConfig
from jmtp.runtime.device import sampling as smp, verify as vf
from jmtp.runtime.device.buckets import step_buckets
from jmtp.runtime.device.ngram import extend_with_ngram, ngram_match
from jmtp.runtime.host import sampling_rows as rows
from jmtp.runtime.host.llm import LLM, SamplingParams
from tests.engines import GROUPS, tiny_llm
from tests.runtime.conftest import tiny_model, free_blocks, engine_of

# the plain reference is shared with other modules (tests/engines.py); outputs, not buckets:
# each engine runs its steps in the fewest step programs (conftest.py)
pytestmark = GROUPS["plain"]

MAX_LEN = 96


# ---------------------------------------------------------------- the matcher vs a reference
def ref_match(hist: list[int], budget: int, max_n: int, min_n: int) -> list[int]:
    """The rule in plain Python: longest n first; earliest start; the tokens after the match."""
    L = len(hist)
    for n in range(max_n, min_n - 1, -1):
        if n > L - 1:
            continue
        pat = hist[L - n:]
        for i in range(0, L - n):          # i + n < L: a token follows the match
            if hist[i:i + n] == pat:
                return hist[i + n: i + n + budget]
    return []


def _run_match(hists, budgets, max_n, min_n, K, S):
    ids = np.full((len(hists), S), 7, np.int32)     # junk past the history must not matter
    for b, h in enumerate(hists):
        ids[b, :len(h)] = h
    lens = np.array([len(h) for h in hists], np.int32)
    d, c = ngram_match(jnp.asarray(ids), jnp.asarray(lens), jnp.asarray(budgets, jnp.int32),
                       max_n, min_n, K)
    return np.asarray(d), np.asarray(c)


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_ngram_match_equals_reference(data):
    max_n = data.draw(st.integers(1, 5), label="max_n")
    min_n = data.draw(st.integers(1, max_n), label="min_n")
    K = data.draw(st.integers(1, 5), label="K")
    B = data.draw(st.integers(1, 4), label="B")
    vocab = data.draw(st.integers(2, 6), label="vocab")    # small vocab: many matches
    hists = [data.draw(st.lists(st.integers(0, vocab - 1), min_size=0, max_size=30), label="hist")
             for _ in range(B)]
    budgets = [data.draw(st.integers(0, K), label="budget") for _ in range(B)]
    d, c = _run_match(hists, budgets, max_n, min_n, K, S=34)
    for b, h in enumerate(hists):
        want = ref_match(h, budgets[b], max_n, min_n)
        assert c[b] == len(want), (h, budgets[b])
        assert list(d[b, :c[b]]) == want
        assert np.all(d[b, c[b]:] == -1)


def test_ngram_match_hand_worked():
    # no match: all tokens distinct
    d, c = _run_match([[1, 2, 3, 4]], [3], 3, 1, 3, 8)
    assert c[0] == 0 and list(d[0]) == [-1, -1, -1]
    # match at the very start: [5, 6] recurs at the end; the tokens after the first one follow
    d, c = _run_match([[5, 6, 9, 8, 5, 6]], [3], 3, 1, 3, 8)
    assert list(d[0, :c[0]]) == [9, 8, 5]
    # several matches of the same length: the earliest wins (FastDeploy scans left to right)
    d, c = _run_match([[4, 1, 4, 2, 4, 3, 4]], [2], 2, 1, 2, 8)
    assert list(d[0, :c[0]]) == [1, 4]
    # a longer n-gram beats an earlier shorter one
    d, c = _run_match([[2, 9, 1, 2, 5, 1, 2]], [1], 2, 1, 1, 8)
    assert list(d[0, :c[0]]) == [5]
    # n larger than the history: skipped, shorter n still tried; history of 1: nothing
    d, c = _run_match([[3, 3], [3]], [2, 2], 5, 1, 2, 8)
    assert list(d[0, :c[0]]) == [3] and c[1] == 0
    # copied tokens stop at the end of the history
    d, c = _run_match([[1, 2, 1]], [3], 1, 1, 3, 8)
    assert list(d[0, :c[0]]) == [2, 1]


@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_extend_with_ngram_equals_reference(data):
    K = data.draw(st.integers(2, 4), label="K")
    max_n = data.draw(st.integers(2, 5), label="max_n")
    min_n = data.draw(st.integers(1, max_n), label="min_n")
    hist = data.draw(st.lists(st.integers(0, 3), min_size=1, max_size=20), label="hist")
    m = data.draw(st.integers(0, K), label="mtp_drafts")
    mtp = data.draw(st.lists(st.integers(0, 3), min_size=m, max_size=m), label="mtp")
    allowed = data.draw(st.integers(0, K), label="allowed")
    mtp = mtp[:allowed]
    S = len(hist) + K + 2
    ids = np.full((1, S), 9, np.int32)
    ids[0, :len(hist)] = hist
    drafts = np.full((1, K), -1, np.int32)
    drafts[0, :len(mtp)] = mtp
    out = np.asarray(extend_with_ngram(jnp.asarray(ids), jnp.array([len(hist)], jnp.int32),
                                       jnp.asarray(drafts), jnp.array([allowed], jnp.int32),
                                       max_n, min_n))[0]
    want = mtp + ref_match(hist + mtp, allowed - len(mtp), max_n, min_n)
    assert list(out[:len(want)]) == want
    assert np.all(out[len(want):] == -1)


def test_config_validation():
    with pytest.raises(ValueError, match="min_ngram_size"):
        SpeculativeConfig("ngram", 3, max_ngram_size=2, min_ngram_size=3)
    with pytest.raises(ValueError, match="max_ngram_size"):
        SpeculativeConfig("ngram", 3, max_ngram_size=0)
    with pytest.raises(ValueError, match="mtp_strategy"):
        SpeculativeConfig("ngram", 3, mtp_strategy="with_ngram")
    with pytest.raises(ValueError, match="mtp_strategy"):
        SpeculativeConfig("mtp", 3, 1, mtp_strategy="ngram_only")
    with pytest.raises(ValueError, match="speculation_policy"):
        SpeculativeConfig("ngram", 3, speculation_policy="adaptive")
    assert SpeculativeConfig("ngram", 3).ngram_sizes == (1, 5)
    assert SpeculativeConfig("mtp", 3, 1, mtp_strategy="with_ngram").ngram_sizes == (2, 5)
    assert SpeculativeConfig("mtp", 3, 3, mtp_strategy="with_ngram").ngram_sizes == (0, 0)
    assert SpeculativeConfig("mtp", 3, 1).ngram_sizes == (0, 0)


# ---------------------------------------------------------------- engine: greedy lossless
@functools.lru_cache(maxsize=None)
def engine(spec: SpeculativeConfig | None, batched_tokens: int = 16):
    """The speculative engines: 3 slots, a 16-token step budget (prompts up to 40 tokens prefill
    in chunks). Plain decoding, the reference, is the canonical 3-slot shape (tests/engines.py)."""
    if spec is None:
        return tiny_llm("plain")
    cfg, params = tiny_model(0)
    return LLM(model_config=cfg, params=params, speculative_config=spec, max_num_seqs=3,
               max_model_len=MAX_LEN, block_size=4, max_num_batched_tokens=batched_tokens)


# n-gram alone (fixed K), the hybrid (fixed), the hybrid under the dynamic policy. (K=1 and the
# dynamic policy with n-gram alone went: each engine costs ~1 min of compiling in the suite, and
# their paths are the K=3 ones with fewer drafts / the same policy.)
SPECS = [SpeculativeConfig("ngram", 3),
         SpeculativeConfig("mtp", 3, 1, mtp_strategy="with_ngram"),
         SpeculativeConfig("mtp", 3, 2, mtp_strategy="with_ngram", speculation_policy="dynamic")]


def _repetitive_prompt(data, label):
    """Prompts with repeats (so n-grams match) or random ones; up to 40 tokens (> the 16-token
    step budget: prefilled in chunks)."""
    unit = data.draw(st.lists(st.integers(2, 63), min_size=1, max_size=6), label=label + "_unit")
    reps = data.draw(st.integers(1, 7), label=label + "_reps")
    tail = data.draw(st.lists(st.integers(2, 63), max_size=6), label=label + "_tail")
    return (unit * reps + tail)[:40]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.method}-k{s.k}-m{s.num_model_steps}-"
                         f"{s.mtp_strategy}-{s.speculation_policy}")
@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_ngram_speculation_equals_plain(spec, data):
    n = data.draw(st.integers(1, 5), label="num_requests")   # more requests than the 3 slots
    prompts = [_repetitive_prompt(data, f"p{i}") for i in range(n)]
    sps = [SamplingParams(max_tokens=data.draw(st.integers(1, 24), label="max_tokens"))
           for _ in range(n)]
    plain = engine(None).generate(prompts, sps, use_tqdm=False)
    llm = engine(spec)
    outs = llm.generate(prompts, sps, use_tqdm=False)
    for a, b, sp in zip(plain, outs, sps):
        assert b.token_ids == a.token_ids
        assert b.finish_reason == a.finish_reason
        assert b.metrics.num_accepted_tokens <= b.metrics.num_draft_tokens
    assert free_blocks(llm) == llm.llm_engine.engine_config.num_blocks
    mtp_cache = llm.llm_engine.runner.mtp_cache
    assert mtp_cache is None if spec.method == "ngram" else mtp_cache is not None


def test_ngram_drafts_get_accepted():
    """n-gram drafts are really verified and accepted where the output repeats itself (this random
    model's greedy output repeats short n-grams: 4 of its drafts hit), output equal to plain."""
    cfg, params = tiny_model(1, std=1.0)
    sp = SamplingParams(max_tokens=40, ignore_eos=True)
    mk = lambda spec: LLM(model_config=cfg, params=params, speculative_config=spec, max_num_seqs=1,
                          max_model_len=MAX_LEN, block_size=4, max_num_batched_tokens=16)
    plain = mk(None).generate([[5, 6, 7, 8]], sp, use_tqdm=False)[0]
    out = mk(SpeculativeConfig("ngram", 3)).generate([[5, 6, 7, 8]], sp, use_tqdm=False)[0]
    assert out.token_ids == plain.token_ids
    assert out.metrics.num_accepted_tokens > 0
    assert out.metrics.mean_acceptance_length > 1.0
    assert out.metrics.num_decode_steps < 39


def test_ngram_needs_no_mtp_weights():
    cfg, params = tiny_model(0)
    no_mtp = {k: v for k, v in params.items() if k != "mtp"}
    llm = LLM(model_config=cfg.replace(num_mtp_layers=0), params=no_mtp,
              speculative_config=SpeculativeConfig("ngram", 2), max_num_seqs=2,
              max_model_len=MAX_LEN, block_size=4, max_num_batched_tokens=32)
    assert llm.llm_engine.engine_config.mtp_substeps == 0
    assert llm.llm_engine.runner.mtp_cache is None
    ref = engine(None).generate([[3, 4, 3, 4, 3]], SamplingParams(max_tokens=10), use_tqdm=False)
    out = llm.generate([[3, 4, 3, 4, 3]], SamplingParams(max_tokens=10), use_tqdm=False)
    assert out[0].token_ids == ref[0].token_ids


def test_no_recompiles_when_limits_change_and_windows_report_their_budget():
    """Random draft limits through the hybrid engine (K=3, M=2 MTP drafts extended by n-gram
    ones): no recompiles, greedy outputs unchanged, and each window records its budget
    (``actual_draft_token_num``: the step's limit capped by ``max_tokens`` / ``max_model_len``, 0
    for a slot that cannot draft), which the step verifying it reports as ``num_allowed``
    (``>= num_drafts``; more where the n-gram extension found nothing)."""
    # SPECS[-1]'s engine: its step executables are the ones test_ngram_speculation_equals_plain
    # compiled (when both run in one worker)
    llm = engine(SPECS[-1])
    rng = np.random.default_rng(0)
    batch = lambda n: [list(rng.integers(2, 64, rng.integers(1, 30))) for _ in range(n)]
    # Reference outputs first (jit caches of engine_step are shared between engines).
    work = [(batch(int(rng.integers(1, 5))), SamplingParams(max_tokens=int(rng.integers(1, 12))))
            for _ in range(4)]
    refs = [[o.token_ids for o in engine(None).generate(p, sp, use_tqdm=False)] for p, sp in work]
    ec = llm.llm_engine.engine_config
    run = engine_of(llm).runner
    for bucket in step_buckets(ec):   # warm every step shape on the idle state (a no-op step)
        run.state, caches, _ = run.jitted_step(*run.step_args(bucket))
        run.cache, run.mtp_cache = caches.target, caches.mtp
    compiled = engine_of(llm).runner.jitted_step._cache_size()
    seen = set()
    policy = llm.llm_engine.spec_policy
    orig = policy.draft_limits

    def varied(active):   # force every limit pattern through the step
        lim = np.where(active, rng.integers(0, 4, active.shape), 0).astype(np.int32)
        seen.update(lim.tolist())
        orig(active)
        return lim
    eng = llm.llm_engine
    steps, run_step = [], engine_of(eng).runner.run_step

    def recorded(bucket, chunks, limits):
        out = run_step(bucket, chunks, limits)
        st = jax.device_get(eng.runner.state)
        seq_len = st.prompt_lens + st.step_idx
        cap = np.clip(np.minimum(st.max_dec_len - st.step_idx - 1, MAX_LEN - seq_len - 1), 0, 3)
        decoding = ~st.stop_flags & (st.seq_lens_decoder >= st.prompt_lens)   # next step
        steps.append((out, st.actual_draft_token_num.copy(),
                      np.where(decoding & (st.accept_num > 0), np.minimum(limits, cap), 0),
                      decoding))
        return out
    policy.draft_limits, engine_of(eng).runner.run_step = varied, recorded
    try:
        for (prompts, sp), ref in zip(work, refs):
            assert [o.token_ids for o in llm.generate(prompts, sp, use_tqdm=False)] == ref
    finally:
        policy.draft_limits = orig      # the engine is shared (lru_cache)
        del engine_of(eng).runner.run_step
    assert seen == {0, 1, 2, 3}
    assert engine_of(llm).runner.jitted_step._cache_size() == compiled
    short, kept = 0, np.zeros_like(steps[0][1])
    for out, budget, want, _ in steps:      # a paused slot keeps its window and its budget
        np.testing.assert_array_equal(budget, np.where(out.paused, kept, want))
        kept = budget
    for (_, budget, _, decoding), (out, _, _, _) in zip(steps, steps[1:]):
        # the next step verifies each decoding slot's window (unless it pauses) and reports
        # its budget; the others report 0
        np.testing.assert_array_equal(out.num_allowed,
                                      np.where(decoding & ~out.paused, budget, 0))
        assert (out.num_drafts <= out.num_allowed).all()
        short += int(np.sum(out.num_allowed - out.num_drafts))
        # the M = 2 MTP drafts always come: only the n-gram's third position can stay empty
        assert (out.num_drafts >= np.minimum(out.num_allowed, 2)).all()
    assert short > 0


# ---------------------------------------------------------------- sampling: lossless in distribution
_spec = importlib.util.spec_from_file_location(
    "_jmtp_vd", pathlib.Path(__file__).with_name("test_verify_distribution.py"))
vd = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(vd)

PROMPT = [3, 1, 4, 1, 5, 2, 3, 1, 4, 0]     # ends with X0 = 0; repeats, so n-grams match
S_HIST = len(PROMPT) + 3 + 3 + 1


@functools.partial(jax.jit, static_argnames=("mode",))
def simulate_ngram(a, *, mode):
    """First 3 emitted tokens of the speculative loop with n-gram drafts from the prompt + the
    emitted history (K=3, n = 3..1). ``mode``: ``"none"`` (q = None: one-hot), ``"mixed"`` (draft
    1 sampled from the draft table with its q, drafts 2..3 n-gram with an all-zero q row, which
    verify must read as one-hot)."""
    T, D = jnp.asarray(vd.T_TABLE), jnp.asarray(vd.D_TABLE)
    B, K, V = a.temperature.shape[0], 3, vd.V
    eos = jnp.array([-1], jnp.int32)
    hist0 = jnp.broadcast_to(jnp.asarray(PROMPT + [0] * (S_HIST - len(PROMPT)), jnp.int32),
                             (B, S_HIST))

    def step(carry, _):
        a, hist, length, ng, out = carry
        last = jnp.take_along_axis(hist, (length - 1)[:, None], 1)[:, 0]
        if mode == "none":
            d, nd = ngram_match(hist, length, jnp.full((B,), K), 3, 1, K)
            q = None
        else:
            d1, q1 = smp.draft_sample(D[last], a, ng, draft_sampling=True, draft_temperature=1.0,
                                      draft_top_p=1.0, draft_top_k=0)
            first = jnp.full((B, K), -1, jnp.int32).at[:, 0].set(d1)
            d = extend_with_ngram(jnp.concatenate([hist, jnp.zeros((B, K), jnp.int32)], 1),
                                  length, first, jnp.full((B,), K), 3, 1)
            nd = jnp.sum(d >= 0, axis=1)
            q = jnp.zeros((B, K, V)).at[:, 0].set(q1)       # n-gram rows: all zero
            if mode == "mixed_wrong_q":     # negative control: n-gram rows given a uniform q
                q = jnp.full((B, K, V), 1.0 / V).at[:, 0].set(q1)
        inputs = jnp.concatenate([last[:, None], jnp.maximum(d, 0)], axis=1)
        r = vf.verify(T[inputs], d, nd, q, a, ng, eos, strategy="rejection")
        n = r.accept_num
        w = jnp.arange(K + 1)[None]
        keep = w < n[:, None]
        idx = jnp.where(keep & (ng[:, None] + w < 3), ng[:, None] + w, 3)
        out = out.at[jnp.arange(B)[:, None], idx].set(r.accept_tokens, mode="drop")
        hpos = jnp.where(keep, length[:, None] + w, S_HIST)
        hist = hist.at[jnp.arange(B)[:, None], hpos].set(r.accept_tokens, mode="drop")
        a = smp.update_history(a, r.accept_tokens, n)
        return (a, hist, length + n, ng + n, out), None

    init = (a, hist0, jnp.full((B,), len(PROMPT), jnp.int32), jnp.zeros((B,), jnp.int32),
            jnp.full((B, 3), -1, jnp.int32))
    (_, _, _, _, out), _ = jax.lax.scan(step, init, None, length=vd.STEPS)
    return out


@pytest.mark.parametrize("mode,name", [("none", "t0.6"), ("none", "t1.3_k3"),
                                       ("mixed", "t0.8_p0.9")])
def test_ngram_sampling_is_lossless(mode, name):
    params = vd.SETTINGS[name]
    N = vd.N
    a = rows.pack_sampling([params], 1, vd.V, prompts=[PROMPT])
    a = jax.tree.map(lambda x: x[np.zeros(N, int)], a)
    a = dataclasses.replace(a, seed=jnp.arange(N, dtype=jnp.uint32) * 7919 + 13)
    out = np.asarray(simulate_ngram(a, mode=mode))
    assert np.all(out >= 0)
    emp = np.bincount(out[:, 0] * 36 + out[:, 1] * 6 + out[:, 2], minlength=216) / N
    truth = vd.exact_joint(params).reshape(-1)   # no penalties: the prompt only fixes X0
    tv = 0.5 * float(np.abs(emp - truth).sum())
    assert tv < 0.01, f"{mode}/{name}: TV {tv:.4f} (expected {vd.expected_tv(truth, N):.4f})"
    assert emp[truth == 0].sum() == 0


def test_ngram_sampling_negative_control():
    """The check has power: deterministic n-gram drafts verified with a q other than one-hot."""
    params = vd.SETTINGS["t0.8_p0.9"]
    N = vd.N
    a = rows.pack_sampling([params], 1, vd.V, prompts=[PROMPT])
    a = jax.tree.map(lambda x: x[np.zeros(N, int)], a)
    a = dataclasses.replace(a, seed=jnp.arange(N, dtype=jnp.uint32) * 7919 + 13)
    out = np.asarray(simulate_ngram(a, mode="mixed_wrong_q"))
    emp = np.bincount(out[:, 0] * 36 + out[:, 1] * 6 + out[:, 2], minlength=216) / N
    tv = 0.5 * float(np.abs(emp - vd.exact_joint(params).reshape(-1)).sum())
    assert tv > 0.03, tv


def test_zero_q_row_means_one_hot():
    """verify with an all-zero q row for a present draft equals verify with q = None (one-hot)."""
    rng = np.random.default_rng(3)
    B, K, V = 64, 3, 6
    logits = jnp.asarray(rng.normal(size=(B, K + 1, V)) * 2, jnp.float32)
    d = jnp.asarray(rng.integers(0, V, (B, K)), jnp.int32)
    nd = jnp.full((B,), K, jnp.int32)
    a = rows.pack_sampling([SamplingParams(temperature=0.9)], 1, V, prompts=[[0]])
    a = jax.tree.map(lambda x: x[np.zeros(B, int)], a)
    a = dataclasses.replace(a, seed=jnp.arange(B, dtype=jnp.uint32))
    ng = jnp.zeros((B,), jnp.int32)
    eos = jnp.array([-1], jnp.int32)
    r0 = vf.verify(logits, d, nd, None, a, ng, eos)
    r1 = vf.verify(logits, d, nd, jnp.zeros((B, K, V)), a, ng, eos)
    np.testing.assert_array_equal(np.asarray(r0.accept_tokens), np.asarray(r1.accept_tokens))
    np.testing.assert_array_equal(np.asarray(r0.accept_num), np.asarray(r1.accept_num))
