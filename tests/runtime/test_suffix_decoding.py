"""Suffix decoding through the engine (``jmtp/runtime/host/suffix_decoding.py``).

The host wiring runs over the numpy double of the runner (``tests/runtime/fake_runner.py``: a
``draft_override`` window's drafts are accepted where they equal the fake target's tokens), so
outputs are checked against the fake's plain greedy decoding and every override against the
device's draft caps, without XLA. The tiny random model then checks that greedy output with
suffix drafts (and with the MTP hybrid) is plain decoding's, and that a seeded sampled request
verified with ``target_match`` samples plain decoding's tokens."""
from __future__ import annotations

import functools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from jmtp.runtime.config import SpeculativeConfig
from jmtp.runtime.device.bitmask import KEEP_DRAFT
from jmtp.runtime.host.llm import LLM, SamplingParams
from jmtp.runtime.host.llm_engine import LLMEngine
from jmtp.runtime.host.suffix_tree import SuffixDraft
from tests.runtime.conftest import free_blocks, reference_greedy, tiny_model
from tests.runtime.fake_runner import FakeRunner, reference
from tests.runtime.test_host_logic import drive

# one worker builds the shared engines once; outputs, not buckets: each engine runs its steps
# in the fewest step programs (conftest.py)
pytestmark = pytest.mark.xdist_group("suffix_engines")

SUFFIX = SpeculativeConfig("suffix", 3)
HYBRID = SpeculativeConfig("mtp", 3, 1, mtp_strategy="with_suffix")
PROMPT = [5, 6, 7, 8]


def fake_engine(spec, **kw):
    runner = FakeRunner(spec=spec, **kw)
    return LLMEngine.from_runner(runner), runner


def record_calls(runner):
    """Wrap ``runner.run_step``: the list of ``(limits, override or None)`` it is given."""
    calls, run = [], runner.run_step

    def recorded(bucket, chunks, limits, guide=None):
        calls.append((np.array(limits), None if guide is None else np.array(guide[1])))
        return run(bucket, chunks, limits, guide)
    runner.run_step = recorded
    return calls


# ---------------------------------------------------------------- host wiring (no XLA)
def test_a_repeated_request_drafts_the_earlier_output():
    """r1 repeats r0's prompt after r0 finished: its drafts come from r0's output in the
    global tree, are accepted, and it needs a fraction of r0's steps; r2 (another prompt,
    alongside) stays exact. All outputs equal plain greedy decoding."""
    eng, runner = fake_engine(SUFFIX, max_num_seqs=2, max_model_len=64)
    eng.add_request("r0", PROMPT, SamplingParams(max_tokens=30, ignore_eos=True))
    first, _ = drive(eng, runner)
    eng.add_request("r1", PROMPT, SamplingParams(max_tokens=30, ignore_eos=True))
    eng.add_request("r2", [9, 3, 4], SamplingParams(max_tokens=30, ignore_eos=True))
    finals, _ = drive(eng, runner)
    want = reference(PROMPT, 30, stop_ids=())
    assert first["r0"].outputs[0].token_ids == want == finals["r1"].outputs[0].token_ids
    assert finals["r2"].outputs[0].token_ids == reference([9, 3, 4], 30, stop_ids=())
    m0, m1 = first["r0"].metrics, finals["r1"].metrics
    # after its first token: one draft (a 1-token match, which may pick another continuation of
    # that token: the fake's vocabulary is small), then K=3 drafts and a bonus per step
    assert m1.num_decode_steps <= 2 + -(-(30 - 3) // 4) < m0.num_decode_steps
    assert m1.num_accepted_tokens >= 0.75 * m1.num_draft_tokens
    stats = eng.get_stats()
    assert stats["suffix_running_requests"] == 0 and stats["suffix_cached_requests"] == 3
    assert stats["suffix_draft_tokens"] == stats["num_draft_tokens"]
    assert stats["suffix_host_seconds"] > 0


DYNAMIC = SpeculativeConfig("suffix", 3, speculation_policy="dynamic")


def _draft(*probs):
    return SuffixDraft(tuple(range(10, 10 + len(probs))), probs, float(sum(probs)), 4)


def test_dynamic_policy_cuts_to_the_best_rate_by_hand():
    """Two decoding slots (buckets of 2, 4 and 8 rows at 1.0, 1.2 and 3.0 s), drafts rated
    [0.9, 0.8, 0.1] and [0.5]. Ranked 0.9, 0.8, 0.5, 0.1, the prefixes of r tokens give
    (2 + gains) / price: r=0 2/1.0 = 2.0, r=1 2.9/1.2 = 2.42, r=2 3.7/1.2 = 3.08, r=3 4.2/3.0 =
    1.4, r=4 4.3/3.0 = 1.43, so slot 0 keeps two drafts and slot 5 none. With every bucket at
    the same price (or nothing timed yet) nothing is cut."""
    from jmtp.runtime.device.buckets import StepBucket
    from jmtp.runtime.host.suffix_decoding import SuffixDecoding

    def bucket_of(rows, n):
        assert n == 2
        return StepBucket(min(t for t in (2, 4, 8) if t >= rows), 2)

    sd = SuffixDecoding(DYNAMIC, 8, bucket_of)
    drafts = {0: _draft(0.9, 0.8, 0.1), 5: _draft(0.5)}
    assert sd.cut(drafts) == drafts and sd.num_cut == 0          # nothing timed: no cut
    sd.costs.seed({StepBucket(2, 2): 1.0, StepBucket(4, 2): 1.2, StepBucket(8, 2): 3.0})
    cut = sd.cut(drafts)
    assert cut[0].token_ids == (10, 11) and cut[0].probs == (0.9, 0.8)
    assert cut[0].score == pytest.approx(1.7) and cut[5].token_ids == () and sd.num_cut == 2
    flat = SuffixDecoding(DYNAMIC, 8, bucket_of)
    flat.costs.seed({StepBucket(t, 2): 1.0 for t in (2, 4, 8)})
    assert flat.cut(drafts) == drafts
    with pytest.raises(ValueError, match="bucket_of"):
        SuffixDecoding(DYNAMIC, 8)


def test_dynamic_policy_calibrates_the_trees_probabilities_by_hand():
    """Before any verification a draft is worth the trees' probabilities. Two tokens rated
    0.15 and 0.12 (both in the bin [0.1, 0.2)) verified with one accepted: that bin holds 2
    trials and 1 success, so 0.15 becomes (1 + 8·0.15) / (2 + 8) = 0.22; a token after it
    rated 0.95 (an empty bin: its own 0.95) is held to 0.22, as acceptance cannot rise along
    a draft."""
    import types

    from jmtp.runtime.device.buckets import StepBucket
    from jmtp.runtime.host.suffix_decoding import SuffixDecoding
    sd = SuffixDecoding(DYNAMIC, 2, lambda rows, n: StepBucket(4, 2))
    np.testing.assert_allclose(sd.calibrated((0.6, 0.15)), [0.6, 0.15])
    sd.draft = lambda seq, limit: _draft(0.15, 0.12)     # the trees' draft for slot 1
    seq = types.SimpleNamespace(prefilling=False, output_ids=[3], prompt_ids=[2],
                                params=SamplingParams(max_tokens=20))
    override, _ = sd.prepare([None, seq], np.zeros((2,), np.int32), None, 64)
    assert list(override[1, :2]) == [10, 11]   # nothing timed yet: no cut
    sd.observe(StepBucket(4, 2), 0.1, True, np.array([0, 1]))
    np.testing.assert_allclose(sd.calibrated((0.15, 0.95)), [0.22, 0.22])
    np.testing.assert_allclose(sd.calibrated((0.6,)), [0.6])


@pytest.mark.parametrize("price", ["rows", "flat"])
def test_dynamic_policy_in_the_engine_stays_exact(price):
    """The engine under the dynamic suffix policy, its cost table seeded with step times: a
    step priced by its rows (drafting never pays at these acceptance rates) cuts every draft,
    one price for every bucket keeps them all; either way the output is plain decoding's, and
    the live steps are recorded into the table."""
    from jmtp.runtime.device.buckets import step_buckets
    eng, runner = fake_engine(DYNAMIC, max_num_seqs=2, max_model_len=64)
    eng.suffix.costs.seed({bk: float(bk.num_tokens) if price == "rows" else 1.0
                           for bk in step_buckets(runner.shard_config)})
    for rid in ("r0", "r1"):
        eng.add_request(rid, PROMPT, SamplingParams(max_tokens=30, ignore_eos=True))
        finals, _ = drive(eng, runner)
        assert finals[rid].outputs[0].token_ids == reference(PROMPT, 30, stop_ids=())
    stats = eng.get_stats()
    if price == "rows":
        assert stats["suffix_cut_tokens"] > 0 and stats["num_draft_tokens"] == 0
    else:
        assert stats["suffix_cut_tokens"] == 0 and stats["num_draft_tokens"] > 0
    assert eng.suffix.costs.step_seconds and eng.suffix.num_observed > 0


@pytest.mark.parametrize("spec", [SUFFIX, HYBRID], ids=["suffix", "mtp-with-suffix"])
def test_async_scheduling_reads_every_step_before_drafting(spec):
    """``async_scheduling=True`` (the default is off for suffix decoding): the host drafts need
    each step's tokens, so the engine reads the step in flight first; a repeated request still
    drafts from the earlier output (in a fraction of its steps) and outputs stay exact."""
    runner = FakeRunner(spec=spec, max_num_seqs=2, max_model_len=64)
    eng = LLMEngine.from_runner(runner, async_scheduling=None)
    assert not eng.async_scheduling          # the default for suffix decoding
    eng.async_scheduling = True
    eng.add_request("r0", PROMPT, SamplingParams(max_tokens=30, ignore_eos=True))
    first, _ = drive(eng, runner)
    eng.add_request("r1", PROMPT, SamplingParams(max_tokens=30, ignore_eos=True))
    finals, _ = drive(eng, runner)
    want = reference(PROMPT, 30, stop_ids=())
    assert first["r0"].outputs[0].token_ids == want == finals["r1"].outputs[0].token_ids
    assert finals["r1"].metrics.num_decode_steps <= 2 + -(-(30 - 3) // 4)
    assert eng.get_stats()["suffix_draft_tokens"] > 0


@pytest.mark.parametrize("max_tokens,max_model_len", [(1, 64), (2, 64), (5, 64), (30, 16),
                                                      (30, 12)])
def test_drafts_respect_max_tokens_and_max_model_len(max_tokens, max_model_len):
    """Suffix windows never pass ``max_tokens`` or ``max_model_len`` (the fake asserts each
    override against the device's caps); outputs stay exact."""
    eng, runner = fake_engine(SUFFIX, max_num_seqs=3, max_model_len=max_model_len)
    for i in range(4):    # the same prompt: long suffix matches from the first request on
        eng.add_request(f"r{i}", PROMPT, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    finals, _ = drive(eng, runner)
    want = reference(PROMPT, max_tokens, stop_ids=(), max_model_len=max_model_len)
    assert all(f.outputs[0].token_ids == want for f in finals.values())
    assert eng.get_stats()["suffix_running_requests"] == 0


def test_preemption_abort_and_eviction_keep_outputs_and_bounds():
    """Too few KV blocks (preemption: the sample's trees are rebuilt on re-admission), an abort
    in flight, and a global tree of 2 outputs at most: outputs exact, bounds kept."""
    spec = SpeculativeConfig("suffix", 3, suffix_decoding_max_cached_requests=2)
    eng, runner = fake_engine(spec, max_num_seqs=3, max_model_len=48, num_blocks=14)
    prompts = {f"r{i}": [PROMPT, [9, 3, 4]][i % 2] for i in range(6)}
    for rid, p in prompts.items():
        eng.add_request(rid, p, SamplingParams(max_tokens=24, ignore_eos=True))
    outs = []
    for _ in range(3):
        outs += eng.step()
    eng.abort_request("r1")
    finals, _ = drive(eng, runner, prior=outs)
    stats = eng.get_stats()
    assert stats["num_preemptions"] > 0
    assert set(finals) == set(prompts) - {"r1"}
    for rid, f in finals.items():
        assert f.outputs[0].token_ids == reference(prompts[rid], 24, stop_ids=()), rid
    assert stats["suffix_running_requests"] == 0
    assert stats["suffix_cached_requests"] <= 2 and stats["suffix_evicted_requests"] >= 4
    assert stats["num_accepted_tokens"] > 0


def test_hybrid_rests_the_mtp_head_while_following_a_match():
    """MTP K=3, M=1 with suffix windows: a slot drafts from the trees where the match scores at
    least M, and the step after gives its MTP a limit of 0; the window after such a step is the
    host's again (no MTP drafts came). Outputs exact; both drafters drafted."""
    eng, runner = fake_engine(HYBRID, max_num_seqs=2, max_model_len=64)
    calls = record_calls(runner)
    eng.add_request("r0", PROMPT, SamplingParams(max_tokens=30, ignore_eos=True))
    drive(eng, runner)
    eng.add_request("r1", PROMPT, SamplingParams(max_tokens=30, ignore_eos=True))
    eng.add_request("r2", [9, 3, 4], SamplingParams(max_tokens=20, ignore_eos=True))
    finals, _ = drive(eng, runner)
    assert finals["r1"].outputs[0].token_ids == reference(PROMPT, 30, stop_ids=())
    assert finals["r2"].outputs[0].token_ids == reference([9, 3, 4], 20, stop_ids=())
    rested = 0
    for (limits, _), (_, override) in zip(calls, calls[1:]):
        for b in np.flatnonzero(limits == 0):
            if override is not None and (override[b] != KEEP_DRAFT).any():
                rested += 1
            else:            # a limit of 0 for a slot without a window (prefill, finished)
                assert override is None or (override[b] == KEEP_DRAFT).all()
    assert rested >= 3
    stats = eng.get_stats()
    assert stats["suffix_windows"] > 0 and stats["suffix_mtp_windows"] > 0
    assert finals["r1"].metrics.num_decode_steps < 15


HYBRID_DYNAMIC = SpeculativeConfig("mtp", 3, 2, mtp_strategy="with_suffix",
                                   speculation_policy="dynamic")


@pytest.mark.parametrize("mtp", ["never-accepted", "always-accepted"])
def test_dynamic_hybrid_drafts_with_the_mtp_head_only_where_it_pays(mtp):
    """MTP K=3, M=2 with suffix windows under the dynamic policy, each step taking 5 ms + 2 ms
    per token row of its bucket + 2 ms per MTP substep. An MTP head whose drafts are never
    accepted is planned out (limits 0 but for the policy's probes), one whose drafts are always
    accepted drafts in most MTP windows (one draft for each of two slots: 4 tokens in 15 ms
    against 2 in 9 ms); the policy counts the MTP windows alone (never accepted: not one
    success, though the suffix drafts are accepted); outputs are plain decoding's either way."""
    import time

    from jmtp.runtime.device.buckets import step_buckets
    accept = (lambda slot, step, d: 0) if mtp == "never-accepted" else (lambda slot, step, d: d)
    eng, runner = fake_engine(HYBRID_DYNAMIC, max_num_seqs=2, max_model_len=64, accept=accept)
    eng.spec_policy.seed_costs({bk: 0.005 + 0.002 * bk.num_tokens
                                for bk in step_buckets(runner.shard_config)})
    run = runner.run_step

    def timed(bucket, chunks, limits, guide=None):
        time.sleep(0.005 + 0.002 * bucket.num_tokens + 0.002 * int(np.max(limits)))
        return run(bucket, chunks, limits, guide)
    runner.run_step = timed
    calls = record_calls(runner)
    prompts = {"r0": PROMPT, "r1": PROMPT, "r2": [9, 3, 4], "r3": [9, 3, 4], "r4": [2, 7]}
    for rid, p in prompts.items():
        eng.add_request(rid, p, SamplingParams(max_tokens=30, ignore_eos=True))
    finals, _ = drive(eng, runner)
    for rid, p in prompts.items():
        assert finals[rid].outputs[0].token_ids == reference(p, 30, stop_ids=()), rid
    stats, pol = eng.get_stats(), eng.spec_policy
    mtp_steps = sum(bool(limits.any()) for limits, _ in calls)
    assert stats["suffix_windows"] > 0 and pol.trials.sum() > 0
    if mtp == "never-accepted":
        assert pol.succ.sum() == 0
        assert mtp_steps <= len(calls) // 4      # probes only (one per 16 planned steps)
    else:
        np.testing.assert_allclose(pol.succ, pol.trials)
        assert mtp_steps >= len(calls) // 3
        assert stats["suffix_mtp_windows"] > 0


def test_dynamic_hybrid_weighs_the_head_against_the_suffix_draft_by_hand():
    """One slot, K = 3 and M = 2, the head's gains 1/2, 1/4 (a_i = 1/2); a step costs 1.0 s at
    1 row + 0.1 s per further row, and proposing at depth d 0.15 s per MTP substep. The window's
    suffix draft is rated (0.4, 0.2), worth 0.6 tokens: less than the 2 pending MTP drafts'
    0.75, so the window keeps the head's drafts. Against drafting nothing the head pays (0: 1/1.0
    = 1.0, 1: 1.5/1.25 = 1.2, 2: 1.75/1.5 = 1.17 tok/s: one draft), but
    the suffix draft in each later window is worth 1.6/1.2 = 1.33 tok/s: the head rests. With
    free substeps the head's 2 drafts give 1.75/1.2 = 1.46 tok/s, more than 1.33: it drafts 2."""
    import types

    from tests.runtime.test_spec_policy import by_rows, policy

    from jmtp.runtime.host.suffix_decoding import SuffixDecoding
    seq = types.SimpleNamespace(prefilling=False, output_ids=[3], prompt_ids=[2],
                                params=SamplingParams(max_tokens=20))
    for substep, want in ((0.15, 0), (0.0, 2)):
        p = policy(1, 3, list(range(1, 9)), prior_weight=0.0, halflife=1e9)
        p.trials[0], p.succ[0] = [8, 4, 2], [4, 2, 1]
        p.step_seconds = by_rows({t: 1.0 + 0.1 * (t - 1) for t in range(1, 9)})
        p.draft_seconds = {(0, d): substep * d for d in (1, 2, 3)}
        sd = SuffixDecoding(HYBRID_DYNAMIC, 1, mtp_policy=p)
        sd.draft = lambda seq, limit: _draft(0.4, 0.2)
        override, _ = sd.prepare([seq], np.array([2], np.int32), np.array([[7, 8, -1]]), 64)
        assert override is None                        # the window keeps the head's drafts
        limits = sd.mtp_limits(sd.plan_mtp(np.array([True]), np.array([3], np.int32)))
        assert limits.tolist() == [want], substep
        assert sd.mtp_off.tolist() == [want == 0] and sd.num_mtp_rested == int(want == 0)


def test_dynamic_hybrid_weighs_each_slot_and_still_probes_the_head_by_hand():
    """Two slots, K = 3, M = 2; a step costs 1.0 s at 2 rows + 0.1 s per further row and 0.05 s
    per MTP substep. Slot 0's head accepts 0.9 (gains 0.9, 0.81), its suffix draft is worth
    0.2; slot 1's head accepts 0.35 (gains 0.35, 0.1225), its suffix draft 0.45. Both windows
    keep the head's 2 pending drafts. With the head for both the best plan is limits (2, 1):
    4.06 tokens / 1.4 s = 2.90 tok/s. Slot 1 (the smaller margin of the head over its suffix
    draft) moved to its suffix draft: (2, 0) over a base of 0.45 tokens and 1 row, 4.16 / 1.4 =
    2.97: it rests. Slot 0 moved too: 2.65 / 1.2 = 2.21: it keeps the head. (Weighing all
    slots at once would keep the head for both: 2.90 against 2.21.)

    With probes every 2 planned steps, the one-slot case of the test above rests the head
    twice, then probes it (one draft), then rests it twice again."""
    import types

    from tests.runtime.test_spec_policy import by_rows, policy

    from jmtp.runtime.host.suffix_decoding import SuffixDecoding

    def slots(n):
        return [types.SimpleNamespace(prefilling=False, output_ids=[3], prompt_ids=[2],
                                      params=SamplingParams(max_tokens=20)) for _ in range(n)]
    p = policy(2, 3, list(range(2, 12)), prior_weight=0.0, halflife=1e9)
    p.trials[:2], p.succ[:2] = [[10, 9, 1], [20, 7, 1]], [[9, 8.1, 0], [7, 2.45, 0]]
    p.step_seconds = by_rows({t: 1.0 + 0.1 * (t - 2) for t in range(2, 12)})
    p.draft_seconds = {(0, d): 0.05 * d for d in (1, 2, 3)}
    sd = SuffixDecoding(HYBRID_DYNAMIC, 2, mtp_policy=p)
    seqs = slots(2)
    worth = {id(seqs[0]): _draft(0.2), id(seqs[1]): _draft(0.45)}
    sd.draft = lambda seq, limit: worth[id(seq)]
    override, _ = sd.prepare(seqs, np.array([2, 2], np.int32), np.array([[7, 8, -1]] * 2), 64)
    assert override is None
    limits = sd.mtp_limits(sd.plan_mtp(np.array([True, True]), np.array([3, 3], np.int32)))
    assert limits.tolist() == [2, 0] and sd.mtp_off.tolist() == [False, True]
    assert sd.num_mtp_rested == 1

    p = policy(1, 3, list(range(1, 9)), prior_weight=0.0, halflife=1e9, probe_every=2)
    p.trials[0], p.succ[0] = [8, 4, 2], [4, 2, 1]
    p.step_seconds = by_rows({t: 1.0 + 0.1 * (t - 1) for t in range(1, 9)})
    p.draft_seconds = {(0, d): 0.15 * d for d in (1, 2, 3)}
    sd = SuffixDecoding(HYBRID_DYNAMIC, 1, mtp_policy=p)
    sd.draft = lambda seq, limit: _draft(0.4, 0.2)
    seq, got = slots(1), []
    for _ in range(6):
        sd.prepare(seq, np.array([2], np.int32), np.array([[7, 8, -1]]), 64)
        got.append(int(sd.mtp_limits(sd.plan_mtp(np.array([True]), np.array([3])))[0]))
    assert got == [0, 0, 1, 0, 0, 1]


def test_config_names_the_field():
    for kw, field in [(dict(suffix_decoding_max_tree_depth=1), "max_tree_depth"),
                      (dict(suffix_decoding_max_cached_requests=-1), "max_cached_requests"),
                      (dict(suffix_decoding_corpus_tokens=0), "corpus_tokens"),
                      (dict(suffix_decoding_max_spec_factor=-0.5), "max_spec_factor"),
                      (dict(suffix_decoding_min_token_prob=1.5), "min_token_prob"),
                      (dict(mtp_strategy="with_suffix"), "mtp_strategy")]:
        with pytest.raises(ValueError, match=field):
            SpeculativeConfig("suffix", 3, **kw)
    assert SpeculativeConfig("mtp", 3, 1, mtp_strategy="with_suffix",
                             speculation_policy="dynamic").uses_suffix
    assert SpeculativeConfig("suffix", 5).uses_suffix and HYBRID.uses_suffix
    assert not SpeculativeConfig("ngram", 3).uses_suffix
    assert HYBRID.ngram_sizes == (0, 0)


# ---------------------------------------------------------------- the tiny model (XLA)
MAX_LEN = 96


@functools.lru_cache(maxsize=None)
def engine(spec: SpeculativeConfig | None):
    cfg, params = tiny_model(1, std=1.0)     # its greedy output repeats itself now and then
    return LLM(model_config=cfg, params=params, speculative_config=spec, max_num_seqs=3,
               max_model_len=MAX_LEN, block_size=4, max_num_batched_tokens=16)


def _prompt(data, label):
    unit = data.draw(st.lists(st.integers(2, 63), min_size=1, max_size=6), label=label + "_unit")
    reps = data.draw(st.integers(1, 5), label=label + "_reps")
    return (unit * reps)[:30]


@pytest.mark.parametrize("spec", [SUFFIX, HYBRID], ids=["suffix", "mtp-with-suffix"])
@settings(max_examples=4, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_greedy_equals_plain_decoding(spec, data):
    """More requests than slots, prompts past the 16-token step budget (chunked prefill), some
    repeated (so later ones draft from earlier outputs): the non-paged reference's tokens."""
    cfg, params = tiny_model(1, std=1.0)
    uniq = [_prompt(data, f"p{i}") for i in range(data.draw(st.integers(1, 3), label="n"))]
    prompts = [uniq[data.draw(st.integers(0, len(uniq) - 1), label=f"pick{i}")]
               for i in range(4)]
    sps = [SamplingParams(max_tokens=data.draw(st.integers(1, 24), label="max_tokens"),
                          ignore_eos=True) for _ in prompts]
    llm = engine(spec)
    outs = llm.generate(prompts, sps, use_tqdm=False)
    for p, o, sp in zip(prompts, outs, sps):
        assert o.token_ids == reference_greedy(cfg, params, p, sp.max_tokens, stop_ids=())
        assert o.metrics.num_accepted_tokens <= o.metrics.num_draft_tokens
    assert free_blocks(llm) == llm.llm_engine.engine_config.num_blocks
    assert (llm.llm_engine.runner.mtp_cache is None) == (spec.method == "suffix")


def test_drafts_from_the_global_tree_are_accepted():
    """A prompt seen before: its greedy output is drafted from the earlier one and accepted. (An
    engine of its own: the shared one's global tree holds other tests' outputs, whose drafts the
    target may reject, so the counts below would depend on the test order.)"""
    llm = engine.__wrapped__(SUFFIX)
    sp = SamplingParams(max_tokens=24, ignore_eos=True)
    first = llm.generate([[7, 9, 11]], sp, use_tqdm=False)[0]
    again = llm.generate([[7, 9, 11]], sp, use_tqdm=False)[0]
    assert again.token_ids == first.token_ids
    assert again.metrics.num_accepted_tokens == again.metrics.num_draft_tokens >= 15
    assert again.metrics.mean_acceptance_length > 2.5


def test_seeded_sampling_with_target_match_equals_plain():
    """``verify_strategy="target_match"`` draws each row's token as plain decoding does, so a
    seeded sampled request with suffix drafts (from an identical earlier request, here) samples
    plain decoding's tokens."""
    cfg, params = tiny_model(1, std=1.0)
    mk = lambda spec: LLM(model_config=cfg, params=params, speculative_config=spec,
                          max_num_seqs=2, max_model_len=64, block_size=4,
                          max_num_batched_tokens=8)
    sp = SamplingParams(max_tokens=16, temperature=0.8, seed=11, ignore_eos=True)
    plain = mk(None).generate([[7, 9, 11]], sp, use_tqdm=False)[0].token_ids
    llm = mk(SpeculativeConfig("suffix", 3, verify_strategy="target_match"))
    outs = [llm.generate([[7, 9, 11]], sp, use_tqdm=False)[0] for _ in range(2)]
    assert [o.token_ids for o in outs] == [plain, plain]
    assert outs[1].metrics.num_accepted_tokens > 0


def test_constrained_requests_with_suffix_drafts_equal_the_masked_reference():
    """Structured outputs and suffix drafts share the step's ``draft_override``: the grammar
    masks are built over the suffix drafts and its forced tokens win. Repeated constraints and
    prompts (so the trees draft), greedy: constrained greedy decoding's tokens."""
    import jax.numpy as jnp

    from jmtp.runtime.host.structured import StructuredOutputsParams as SOP
    from tests.runtime.structured_fixtures import (SCHEMA, VOCAB_SIZE,
                                                   reference_constrained_greedy, tiny_tokenizer)
    cfg, params = tiny_model(0, vocab_size=VOCAB_SIZE)
    llm = LLM(model_config=cfg, params=params, tokenizer=tiny_tokenizer(), speculative_config=SUFFIX,
              max_num_seqs=3, max_model_len=96, block_size=8, max_num_batched_tokens=16,
              dtype=jnp.float32)
    tok = tiny_tokenizer()
    prompts = ["ab", "hello", "ab"]
    for sop in (SOP(json=SCHEMA), SOP(regex=r"(ab|ba)+c[0-9]{3}"), SOP(json=SCHEMA)):
        outs = llm.generate(prompts, SamplingParams(max_tokens=40, structured_outputs=sop),
                            use_tqdm=False)
        for p, o in zip(prompts, outs):
            assert o.outputs[0].token_ids == reference_constrained_greedy(
                cfg, params, sop, tok.encode(p), 40), (sop.kind, p)
    stats = llm.llm_engine.get_stats()
    assert stats["suffix_draft_tokens"] > 0 and stats["structured_forced_drafts"] > 0
    assert stats["num_accepted_tokens"] > 0
