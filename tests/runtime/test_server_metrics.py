"""The server's Prometheus metrics from engine stats (no model, no server process)."""
from __future__ import annotations

import pytest

prom_parser = pytest.importorskip("prometheus_client.parser")
pytest.importorskip("fastapi")


def samples(metrics) -> dict:
    out = {}
    for fam in prom_parser.text_string_to_metric_families(metrics.render().decode()):
        for s in fam.samples:
            out[s.name] = s.value
    return out


def test_dynamic_policy_counters_follow_the_engine_stats():
    """Counters advance by the change of the engine's cumulative stats between steps; stats
    without the policy's keys (a fixed-K engine) leave them at 0."""
    from jmtp.runtime.serve.server import ServerMetrics

    m = ServerMetrics()
    m.on_step({}, [], None)
    got = samples(m)
    assert got["jmtp_spec_policy_plans_total"] == 0 and got["jmtp_spec_policy_holds_total"] == 0
    m.on_step(dict(spec_policy_plans=3, spec_policy_drafting_plans=2, spec_policy_holds=0,
                   spec_policy_host_seconds=0.5), [], None)
    m.on_step(dict(spec_policy_plans=7, spec_policy_drafting_plans=2, spec_policy_holds=1,
                   spec_policy_host_seconds=0.75), [], None)
    got = samples(m)
    assert got["jmtp_spec_policy_plans_total"] == 7
    assert got["jmtp_spec_policy_drafting_plans_total"] == 2
    assert got["jmtp_spec_policy_holds_total"] == 1
    assert got["jmtp_spec_policy_host_seconds_total"] == pytest.approx(0.75)


def test_preemptions_and_queue_times_follow_the_engine_stats():
    """``jmtp_num_preemptions_total`` follows the engine's cumulative ``num_preemptions``;
    ``jmtp_request_queue_seconds`` observes each queue time the async engine reports once."""
    from jmtp.runtime.serve.server import ServerMetrics

    m = ServerMetrics()
    m.on_step(dict(num_preemptions=0, queue_seconds=[0.5, 2.0]), [], 0.01)
    m.on_step(dict(num_preemptions=2, queue_seconds=[]), [], 0.01)
    m.on_step(dict(num_preemptions=3, queue_seconds=[7.0]), [], None)
    got = samples(m)
    assert got["jmtp_num_preemptions_total"] == 3
    assert got["jmtp_request_queue_seconds_count"] == 3
    assert got["jmtp_request_queue_seconds_sum"] == pytest.approx(9.5)


def test_speculation_counters_follow_the_engine_stats():
    """The speculation families advance by the change of the engine's cumulative stats, each
    draft position on its own label; the mean acceptance length is tokens over decode steps.
    (test_server.py's tiny random model accepts almost no draft, so its server check of these
    counters sees zeros; here they are non-zero and hand-worked.)"""
    from jmtp.runtime.serve.server import ServerMetrics

    m = ServerMetrics()
    m.on_step(dict(num_draft_tokens=6, num_accepted_tokens=4, accepted_per_position=[3, 1],
                   num_decode_steps=3, num_decode_tokens=7), [], 0.01)
    m.on_step(dict(num_draft_tokens=10, num_accepted_tokens=7, accepted_per_position=[5, 2],
                   num_decode_steps=5, num_decode_tokens=12), [], 0.01)
    got = {}
    for fam in prom_parser.text_string_to_metric_families(m.render().decode()):
        for s in fam.samples:
            got[(s.name, tuple(sorted(s.labels.items())))] = s.value
    assert got[("jmtp_spec_decode_draft_tokens_total", ())] == 10
    assert got[("jmtp_spec_decode_accepted_tokens_total", ())] == 7
    assert [got[("jmtp_spec_decode_accepted_per_position_total", (("position", p),))]
            for p in ("1", "2")] == [5, 2]
    assert got[("jmtp_spec_decode_steps_total", ())] == 5
    assert got[("jmtp_spec_decode_step_tokens_total", ())] == 12
    assert got[("jmtp_spec_decode_mean_acceptance_length", ())] == pytest.approx(12 / 5)


def labelled(metrics) -> dict:
    """``{(sample name, labels tuple): value}`` of ``metrics``' rendered text."""
    out = {}
    for fam in prom_parser.text_string_to_metric_families(metrics.render().decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_gc_pauses_are_timed_only_while_watched():
    """Two full collections while watched are two generation-2 observations (their sum the
    time they took, under the wall time around them); collections before ``watch_gc`` and after
    ``unwatch_gc`` are not timed, a second ``watch_gc`` adds no second hook, and the hook is
    gone afterwards. prometheus_client's process and ``python_gc_*`` samples are exported."""
    import gc
    import sys
    import time

    from jmtp.runtime.serve.server import ServerMetrics

    m = ServerMetrics()
    hooks = len(gc.callbacks)
    gc.collect()
    full = (("generation", "2"),)
    assert labelled(m).get(("jmtp_gc_pause_seconds_count", full), 0) == 0
    m.watch_gc()
    m.watch_gc()
    assert len(gc.callbacks) == hooks + 1
    try:
        t0 = time.perf_counter()
        gc.collect()
        gc.collect()
        wall = time.perf_counter() - t0
    finally:
        m.unwatch_gc()
    assert len(gc.callbacks) == hooks
    gc.collect()
    got = labelled(m)
    assert got[("jmtp_gc_pause_seconds_count", full)] == 2
    assert 0 < got[("jmtp_gc_pause_seconds_sum", full)] <= wall
    assert got[("python_gc_collections_total", full)] >= 3
    if sys.platform == "linux":
        assert got[("process_resident_memory_bytes", ())] > 0
        assert got[("process_open_fds", ())] > 0


def test_gc_hook_goes_with_its_metrics_and_ignores_an_unseen_start():
    """A collection whose start the hook did not see (it was added mid-collection) is not timed
    (a pause measured from nothing would be the process's uptime); metrics collected without
    ``unwatch_gc`` take their hook with them."""
    import gc

    from jmtp.runtime.serve.server import ServerMetrics

    hooks = len(gc.callbacks)
    m = ServerMetrics()
    m.watch_gc()
    hook = gc.callbacks[-1]
    hook("stop", {"generation": 2})                    # its start unseen
    assert labelled(m).get(("jmtp_gc_pause_seconds_count", (("generation", "2"),)), 0) == 0
    hook("start", {"generation": 1})
    hook("stop", {"generation": 1})
    hook("stop", {"generation": 1})                    # a second stop: no second pause
    assert labelled(m)[("jmtp_gc_pause_seconds_count", (("generation", "1"),))] == 1
    del m
    gc.collect()
    assert len(gc.callbacks) == hooks and hook not in gc.callbacks
