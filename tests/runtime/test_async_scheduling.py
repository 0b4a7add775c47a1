"""Asynchronous scheduling (``async_scheduling=True``) and per-request draft caps
(``SamplingParams.num_speculative_tokens``) on the host side, against the numpy device double
(``tests/runtime/fake_runner.py``): no XLA.

The oracle is the fake target's plain greedy decoding (:func:`~tests.runtime.fake_runner.
reference`); a stop string's cut is computed from the reference text here, independently of the
engine. The real-engine halves (every method, meshes, processes, the server) are in
``test_async_engine_real.py``.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from jmtp.core.errors import InvalidRequestError
from jmtp.runtime.host.llm_engine import LLMEngine
from jmtp.runtime.host.sampling_params import SamplingParams
from tests.runtime.fake_runner import FakeRunner, reference
from tests.runtime.test_host_logic import (TOK, Fake, accept_all, accept_none, drive, greedy,
                                           ref)


def make(async_scheduling: bool, tokenizer=None, **kw):
    run = Fake(**kw)
    return LLMEngine.from_runner(run, tokenizer=tokenizer,
                                 async_scheduling=async_scheduling), run


PROMPTS = [[(3 * i) % 60 + 2 for i in range(13)], [7, 7, 7], list(range(20, 31)), [44] * 9,
           [5, 6], [9, 8, 7, 6, 5, 4, 3], [30, 31, 32, 33]]


def _run(async_scheduling: bool, kw: dict, requests) -> tuple[dict, dict, LLMEngine, Fake]:
    eng, run = make(async_scheduling, **kw)
    for rid, p, sp in requests:
        eng.add_request(rid, p, sp)
    finals, streams = drive(eng, run)
    return finals, streams, eng, run


CONFIGS = {
    "default": dict(),
    "nospec": dict(k=0),
    "k3-accept-all": dict(k=3, accept=accept_all),
    "accept-none": dict(accept=accept_none),
    "dp2": dict(data_parallel_size=2),
    "prefix": dict(enable_prefix_caching=True),
    "one-slot": dict(max_num_seqs=1),
    "dynamic": dict(speculation_policy="dynamic"),
    # long outputs on few blocks: slots are preempted and resumed
    "pressure": dict(num_blocks=17),
    "pressure-prefix": dict(num_blocks=18, enable_prefix_caching=True),
    "pressure-prefix-dp2": dict(num_blocks=36, data_parallel_size=2, enable_prefix_caching=True),
}
LONG = [list(range(3, 3 + n)) for n in (7, 2, 9, 5, 11, 3, 7, 4)]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_async_outputs_equal_sync_and_reference(name):
    """Tokens and finish reasons equal the synchronous loop's and the reference (the streamed
    deltas concatenate to them: ``drive``), with chunked prefill, preemption, prefix caching,
    data shards and the dynamic policy; the device double checked every step's rows against its
    bucket, and every block ends free or cached."""
    kw = CONFIGS[name]
    if name.startswith("pressure"):
        requests = [(f"r{i}", p, greedy(30 + i, ignore_eos=True)) for i, p in enumerate(LONG)]
    else:
        requests = [(f"r{i}", p, greedy(6 + 3 * i, ignore_eos=bool(i % 2)))
                    for i, p in enumerate(PROMPTS)]
    sync, _, eng_s, _ = _run(False, kw, requests)
    fin, _, eng, run = _run(True, kw, requests)
    for rid, p, sp in requests:
        want = ref(p, sp.max_tokens, sp.ignore_eos)
        assert sync[rid].token_ids == want and fin[rid].token_ids == want, rid
        assert fin[rid].finish_reason == sync[rid].finish_reason, rid
    st = eng.get_stats()
    assert st["num_running"] == 0 and eng._inflight is None and eng.async_scheduling
    assert not eng_s.async_scheduling
    cached = st.get("num_cached_blocks", 0)
    assert st["num_free_blocks"] + cached == run.engine_config.num_blocks
    if name.startswith("pressure"):     # the async engine went through preemptions
        assert st["num_preemptions"] > 0


def _expected_stop(prompt, stop: str) -> tuple[list[int], str]:
    """The reference tokens up to (and with) the one whose text completes ``stop``, and the text
    before it: the stop-string cut computed from the oracle, not by the engine."""
    out = reference(prompt, 40, stop_ids=())
    for n in range(1, len(out) + 1):
        text = TOK.decode(out[:n])
        if stop in text:
            return out[:n], text[:text.find(stop)]
    return out, TOK.decode(out)


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_random_aborts_and_stops_inside_accepted_blocks_lose_no_request(data):
    """Requests with stop strings that complete inside a fully accepted window (K=3, every draft
    accepted: 4 tokens a step) and aborts at random steps, under block pressure so slots are
    preempted and re-admitted: every request that is not aborted ends exactly once with the
    reference cut at its stop; an aborted one gets no output after the abort; nothing stays in a
    slot or in flight and every block is free at the end."""
    eng, run = make(True, tokenizer=TOK, k=3, accept=accept_all, max_num_seqs=3,
                    num_blocks=data.draw(st.sampled_from([12, 40]), label="num_blocks"))
    n = data.draw(st.integers(3, 8), label="requests")
    expected, aborted, finals, after_abort = {}, set(), {}, []
    for i in range(n):
        p = [(data.draw(st.integers(2, 61)) + j * 5) % 60 + 2 for j in range(3 + i % 4)]
        full = TOK.decode(reference(p, 40, stop_ids=()))
        a = data.draw(st.integers(0, len(full) - 2), label="stop_start")
        stop = full[a:a + 2] if data.draw(st.booleans(), label="has_stop") else None
        rid = f"r{i}"
        eng.add_request(rid, p, greedy(24, ignore_eos=True, stop=stop))
        toks, text = _expected_stop(p, stop) if stop else (reference(p, 24, stop_ids=()), None)
        expected[rid] = (toks[:24], text)
    plan = {data.draw(st.integers(0, 30), label="abort_at"): f"r{data.draw(st.integers(0, n - 1))}"
            for _ in range(data.draw(st.integers(0, 3), label="aborts"))}
    for i in range(400):
        if not eng.has_unfinished_requests():
            break
        if i in plan and plan[i] not in finals:
            eng.abort_request(plan[i])
            aborted.add(plan[i])
        for o in eng.step():
            run.check_invariants()
            if o.request_id in aborted:
                after_abort.append(o.request_id)
            assert o.request_id not in finals, "output after the final one"
            if o.finished:
                finals[o.request_id] = o
    else:
        raise AssertionError("requests did not finish")
    assert not after_abort
    for rid, (toks, text) in expected.items():
        if rid in aborted:
            continue
        assert finals[rid].token_ids == toks, rid
        if text is not None and len(toks) < 24:
            assert finals[rid].text == text and finals[rid].finish_reason == "stop", rid
    assert eng._inflight is None and run.slots == [None] * 3
    assert run.free_counts == [run.engine_config.num_blocks]


# ---------------------------------------------------------------------------- per-request caps
class CapFake(Fake):
    """Records, per step, the draft limits the device got for each occupied slot and the
    drafts each window then held."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.windows: list[tuple[int, int, int]] = []     # (slot, limit, drafts proposed)

    def run_step(self, bucket, chunks, limits, guide=None):
        out = super().run_step(bucket, chunks, limits, guide)
        for b, s in enumerate(self.slots):
            if s is not None:
                self.windows.append((b, int(limits[b]), s.drafts))
        return out


@pytest.mark.parametrize("policy", ["fixed", "dynamic"])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_per_request_caps_bound_every_window(policy, async_scheduling):
    """A mix of caps None (K=3), 0, 1 and 3 in one engine: no window ever holds more drafts
    than its request's cap (recorded on the device double, and ``max_drafts_per_step`` of each
    request's metrics), cap 0 never drafts, and every output is the reference."""
    run = CapFake(k=3, accept=accept_all, max_num_seqs=4, speculation_policy=policy)
    eng = LLMEngine.from_runner(run, async_scheduling=async_scheduling)
    caps = {"none": None, "zero": 0, "one": 1, "three": 3, "zero2": 0, "one2": 1}
    prompts = {rid: [(7 * i + 3 * j) % 60 + 2 for j in range(4 + i)]
               for i, rid in enumerate(caps)}
    for rid, cap in caps.items():
        eng.add_request(rid, prompts[rid], greedy(14, ignore_eos=True,
                                                  num_speculative_tokens=cap))
    slot_cap = {}

    def on_step(i, outs):
        for b, s in enumerate(eng.scheduler.slots):
            if s is not None:
                slot_cap[(b, s.group.request_id)] = caps[s.group.request_id]
    finals, _ = drive(eng, run, on_step=on_step)
    for rid, cap in caps.items():
        m = finals[rid].metrics
        assert finals[rid].token_ids == ref(prompts[rid], 14, True)
        assert m.max_drafts_per_step <= (3 if cap is None else cap), rid
        if cap == 0:
            assert m.num_draft_tokens == 0, rid
        elif policy == "fixed":   # every draft accepted: the cap is reached
            assert m.max_drafts_per_step == (3 if cap is None else cap), rid
    assert max(d for _, _, d in run.windows) == 3


@pytest.mark.parametrize("value", [-1, 1.5, "2", True])
def test_num_speculative_tokens_must_be_none_or_an_int_at_least_zero(value):
    with pytest.raises(InvalidRequestError, match="num_speculative_tokens") as e:
        SamplingParams(num_speculative_tokens=value)
    assert e.value.field == "num_speculative_tokens"


@pytest.mark.parametrize("k,cap", [(2, 3), (0, 1)])
def test_a_cap_above_the_engines_k_is_refused_naming_the_limit(k, cap):
    eng, _ = make(True, k=k)
    with pytest.raises(InvalidRequestError, match=f"num_speculative_tokens={k}") as e:
        eng.add_request("a", [3, 4], greedy(4, num_speculative_tokens=cap))
    assert e.value.field == "num_speculative_tokens" and not eng.has_unfinished_requests()


# ---------------------------------------------------------------------------- timeline
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_timeline_records_every_step_in_order(async_scheduling, tmp_path):
    """Each step's host intervals are ordered (plan, dispatch, then its outputs' wait and
    taking), device intervals follow each other, the stats add them up, and the Chrome trace
    has a host and a device event per step."""
    eng, run = make(async_scheduling)
    eng.timeline.enable()
    for i, p in enumerate(PROMPTS[:4]):
        eng.add_request(f"r{i}", p, greedy(8, ignore_eos=True))
    drive(eng, run)
    steps = eng.timeline.steps
    assert len(steps) == eng.get_stats()["num_steps"] > 0
    assert [t.index for t in steps] == list(range(len(steps)))
    for t in steps:
        assert t.t_round <= t.t_dispatch0 <= t.t_dispatch1 <= t.t_fetch0 <= t.t_fetch1 <= t.t_done
        assert t.device_start <= t.device_end
        assert t.mode == ("async" if async_scheduling else "sync") or t.index == 0
    for a, b in zip(steps, steps[1:]):
        assert b.device_start >= a.device_end
        if async_scheduling and b.mode == "async":
            assert b.t_dispatch1 <= a.t_fetch0      # dispatched before a's outputs were read
    stats = eng.get_stats()
    assert stats["timeline_steps"] == len(steps)
    assert stats["device_idle_seconds"] == pytest.approx(
        sum(t.gap for t in steps if t.gap is not None))
    path = tmp_path / "trace.json"
    eng.timeline.write_chrome_trace(path)
    import json
    ev = json.loads(path.read_text())["traceEvents"]
    device = [e for e in ev if e.get("tid") == 2 and e.get("name", "").startswith("T=")]
    assert len(device) == len(steps)


def test_free_lower_bound_by_hand():
    from jmtp.runtime.host.inflight import StepRecord, drafts_bound, free_lower_bound
    rec = StepRecord(0, None, None, None, None, [], np.zeros(2), bounds=[3, 5], pushed=[1, 0],
                     overlapped=True, continued=True)
    # 10 free after the last step read; 1 pushed before the step in flight, which can take 3;
    # 2 pushed since: 10 + 1 - 3 + 2 = 10. Shard 1: 4 + 0 - 5 -> 0 (never negative).
    assert free_lower_bound([10, 4], [rec], [2, 0]) == [10, 0]
    # hand-off imports allocate at admission, after the step read back: 2 blocks imported before
    # the step in flight and 1 since are not in its free count: 10 + 1 - 3 - 2 + 2 - 1 = 7
    rec.taken = [2, 0]
    assert free_lower_bound([10, 4], [rec], [2, 0], [1, 0]) == [7, 0]
    # windows: a proposing slot's bound is max(min(limit, most), window before); others keep it
    got = drafts_bound(np.array([0, 2, 3, 1]), np.array([3, 1, 0, 3]),
                       np.array([True, True, True, False]), 2)
    assert got.tolist() == [2, 2, 3, 1]


def test_async_is_the_default_where_windows_are_bounded():
    from jmtp.runtime.config import EngineConfig, SpeculativeConfig
    from jmtp.runtime.host.inflight import default_async_scheduling
    on = [None, SpeculativeConfig("mtp", 3), SpeculativeConfig("mtp", 3, 3, mtp_strategy="with_ngram"),
          SpeculativeConfig("mtp", 3, speculation_policy="dynamic")]
    off = [SpeculativeConfig("ngram", 3), SpeculativeConfig("mtp", 3, 1, mtp_strategy="with_ngram")]
    for platform in ("gpu", "tpu", "cpu"):
        for spec, want in [(s, True) for s in on] + [(s, False) for s in off]:
            ec = EngineConfig(max_num_seqs=2, max_model_len=32, block_size=4, num_blocks=16,
                              spec=spec or SpeculativeConfig(method=None), platform=platform)
            # on CPU the host and the "device" share cores: off there whatever the method
            assert default_async_scheduling(ec) is (want and platform != "cpu"), (spec, platform)
    assert FakeRunner is not None
