"""AsyncLLMEngine in-process on a tiny random model: continuous batching gives the reference greedy
tokens, abort frees blocks, a failing request or step does not stop the loop, idle means no steps,
shutdown ends streams."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest

import jmtp
from jmtp.runtime.host.sampling_params import SamplingParams
from jmtp.runtime.serve.async_engine import AsyncLLMEngine, EngineDeadError

from tests.engines import GROUPS, tiny_llm
from tests.runtime.conftest import reference_greedy

# the canonical MTP K=2 shape's group (tests/engines.py): one worker compiles it for this module
# and test_engine_edges.py
pytestmark = GROUPS["mtp2"]

PROMPTS = [[5, 9, 13, 2, 7], [3, 3, 8], [11, 4, 6, 10, 12, 14, 2], [7, 2, 30, 31]]


class CountingEngine:
    """Forwards to a real LLMEngine, counts ``step`` calls, can make one step raise, and can make
    ``get_stats`` slow (``stats_delay`` seconds) to widen any window between a stream getting its
    item and the stats snapshot."""

    def __init__(self, engine):
        self.engine = engine
        self.steps = 0
        self.fail_next_step = False
        self.stats_delay = 0.0
        self.fail_stats_when_done = False
        self.lock = threading.Lock()

    def get_stats(self):
        time.sleep(self.stats_delay)
        if self.fail_stats_when_done and not self.engine.has_unfinished_requests():
            self.fail_stats_when_done = False
            raise RuntimeError("injected get_stats failure")
        return self.engine.get_stats()

    def step(self):
        with self.lock:
            self.steps += 1
            if self.fail_next_step:
                self.fail_next_step = False
                raise RuntimeError("injected step failure")
        return self.engine.step()

    def __getattr__(self, name):
        return getattr(self.engine, name)


@pytest.fixture(scope="module")
def llm(tiny):
    return tiny_llm("mtp2")         # over tiny_model(0), the ``tiny`` the tests compare with


@pytest.fixture()
def aengine(llm):
    counting = CountingEngine(llm.llm_engine)
    seen = []
    eng = AsyncLLMEngine(counting, on_step=lambda stats, outs, dt: seen.append(dict(stats)))
    eng.counting, eng.seen = counting, seen
    yield eng
    eng.shutdown()
    assert not eng.is_running


def run(coro, timeout=300):
    return asyncio.run(asyncio.wait_for(coro, timeout))


async def all_blocks_free(eng, timeout=240.0):
    """Wait until the engine thread has processed the abort (it does so between steps, and a step
    may be compiling a new bucket on a loaded CI machine: a fixed few seconds was flaky)."""
    deadline = time.monotonic() + timeout
    while eng.stats["num_free_blocks"] != eng.stats["num_blocks"]:
        assert time.monotonic() < deadline, f"blocks not freed within {timeout} s: {eng.stats}"
        await asyncio.sleep(0.01)


async def collect(eng, rid, prompt, sp):
    outs = [o async for o in eng.generate(rid, prompt, sp)]
    assert outs[-1].finished and all(not o.finished for o in outs[:-1])
    return outs


def test_continuous_batching_matches_reference(aengine, tiny):
    cfg, params = tiny
    sp = SamplingParams(max_tokens=12, ignore_eos=True)

    async def with_late_joiners():
        # "a" starts alone; "b".."d" arrive while it runs and join the batch (2 slots).
        task_a = asyncio.ensure_future(collect(aengine, "a", PROMPTS[0], sp))
        while not aengine.seen or aengine.seen[-1]["num_running"] == 0:
            await asyncio.sleep(0.01)
        others = [asyncio.ensure_future(collect(aengine, r, p, sp))
                  for r, p in zip("bcd", PROMPTS[1:])]
        return await asyncio.gather(task_a, *others)

    results = run(with_late_joiners())
    for prompt, outs in zip(PROMPTS, results):
        final = outs[-1].outputs[0]
        assert final.token_ids == reference_greedy(cfg, params, prompt, 12, stop_ids=())
        # Deltas concatenate to the final ids.
        assert sum((o.outputs[0].delta_token_ids for o in outs), []) == final.token_ids
    assert max(s["num_running"] for s in aengine.seen) == 2     # the late requests joined
    st = aengine.stats
    assert st["num_free_blocks"] == st["num_blocks"]


def test_abort_frees_blocks_and_stream_ends(aengine):
    sp = SamplingParams(max_tokens=40, ignore_eos=True)

    async def main():
        stream = await aengine.add_request("long", PROMPTS[2], sp)
        first = await stream.__anext__()
        assert not first.finished
        await aengine.abort("long")
        rest = [o async for o in stream]     # ends without a finished output
        await all_blocks_free(aengine)
        return rest

    rest = run(main())
    assert all(not o.finished for o in rest)
    assert aengine.stats["num_free_blocks"] == aengine.stats["num_blocks"]
    assert aengine.stats["num_running"] == 0 and aengine.stats["num_waiting"] == 0


def test_leaving_the_stream_aborts(aengine):
    sp = SamplingParams(max_tokens=40, ignore_eos=True)

    async def main():
        async for out in aengine.generate("gone", PROMPTS[1], sp):
            break                                  # the consumer walks away
        await all_blocks_free(aengine)

    run(main())
    assert aengine.stats["num_free_blocks"] == aengine.stats["num_blocks"]
    assert aengine.stats["num_requests_in_flight"] == 0


def test_failing_request_does_not_stop_the_loop(aengine, tiny):
    cfg, params = tiny
    sp = SamplingParams(max_tokens=5, ignore_eos=True)

    async def main():
        with pytest.raises(ValueError):
            await aengine.add_request("bad", [cfg.vocab_size + 3], sp)   # id out of range
        with pytest.raises(ValueError):
            await aengine.add_request("long", [2] * 64, sp)              # >= max_model_len
        # A step that raises fails the in-flight requests only.
        s1 = await aengine.add_request("x", PROMPTS[0], sp)
        aengine.counting.fail_next_step = True
        with pytest.raises(RuntimeError, match="injected"):
            async for _ in s1:
                pass
        return await collect(aengine, "y", PROMPTS[1], sp)

    outs = run(main())
    assert outs[-1].outputs[0].token_ids == reference_greedy(cfg, params, PROMPTS[1], 5,
                                                             stop_ids=())
    assert not aengine.is_dead
    assert aengine.stats["num_free_blocks"] == aengine.stats["num_blocks"]


def test_stats_are_current_when_a_stream_gets_its_item(aengine, tiny):
    """CI (stop 22) saw 32 of 34 blocks free right after a request's final output: outputs were
    handed to the streams before the stats snapshot. With a slow ``get_stats`` that ordering
    fails every time; the snapshot now comes first, for finished outputs, aborts and failed
    steps alike."""
    cfg, params = tiny
    sp = SamplingParams(max_tokens=5, ignore_eos=True)
    aengine.counting.stats_delay = 0.3

    async def main():
        outs = await collect(aengine, "done", PROMPTS[0], sp)
        after_finish = dict(aengine.stats)
        stream = await aengine.add_request("cut", PROMPTS[2], SamplingParams(max_tokens=40,
                                                                             ignore_eos=True))
        await stream.__anext__()
        await aengine.abort("cut")
        _ = [o async for o in stream]
        after_abort = dict(aengine.stats)
        s3 = await aengine.add_request("boom", PROMPTS[1], sp)
        aengine.counting.fail_next_step = True
        with pytest.raises(RuntimeError, match="injected"):
            async for _ in s3:
                pass
        return outs, after_finish, after_abort, dict(aengine.stats)

    try:
        outs, *snaps = run(main())
    finally:
        aengine.counting.stats_delay = 0.0
    assert outs[-1].outputs[0].token_ids == reference_greedy(cfg, params, PROMPTS[0], 5,
                                                             stop_ids=())
    for st in snaps:
        assert st["num_free_blocks"] == st["num_blocks"], st
        assert st["num_running"] == 0 and st["num_requests_in_flight"] == 0, st


def test_final_output_reaches_the_stream_even_if_stats_fail(llm, tiny):
    """The finished request leaves the stream table before the stats snapshot; if taking it
    raises (the engine thread then dies), the request must still get its final output rather
    than wait forever."""
    cfg, params = tiny
    counting = CountingEngine(llm.llm_engine)
    eng = AsyncLLMEngine(counting)
    sp = SamplingParams(max_tokens=3, ignore_eos=True)

    async def main():
        stream = await eng.add_request("s", PROMPTS[0], sp)
        counting.fail_stats_when_done = True
        return [o async for o in stream]

    try:
        outs = run(main(), timeout=120)
    finally:
        eng.shutdown()
    assert outs[-1].finished
    assert outs[-1].outputs[0].token_ids == reference_greedy(cfg, params, PROMPTS[0], 3,
                                                             stop_ids=())
    assert eng.is_dead


def test_duplicate_request_id_rejected(aengine):
    sp = SamplingParams(max_tokens=20, ignore_eos=True)

    async def main():
        s = await aengine.add_request("dup", PROMPTS[0], sp)
        with pytest.raises(ValueError, match="already in flight"):
            await aengine.add_request("dup", PROMPTS[1], sp)
        return [o async for o in s]

    assert run(main())[-1].finished


def test_idle_loop_does_not_step(aengine):
    async def main():
        await collect(aengine, "warm", PROMPTS[0], SamplingParams(max_tokens=2))
        await asyncio.sleep(0.1)
        n = aengine.counting.steps
        await asyncio.sleep(0.5)
        return aengine.counting.steps - n

    assert run(main()) == 0


def test_shutdown_ends_streams_and_rejects_new_requests(llm):
    eng = AsyncLLMEngine(llm.llm_engine)
    sp = SamplingParams(max_tokens=60, ignore_eos=True)

    async def main():
        stream = await eng.add_request("s", PROMPTS[0], sp)
        await stream.__anext__()
        await asyncio.get_running_loop().run_in_executor(None, eng.shutdown)
        with pytest.raises(EngineDeadError):
            async for _ in stream:
                pass
        with pytest.raises(EngineDeadError):
            await eng.add_request("t", PROMPTS[1], sp)

    run(main())
    assert not eng.is_running and eng.is_dead
    assert not llm.llm_engine.has_unfinished_requests()


def test_failed_admission_fails_that_request_alone(llm, tiny, monkeypatch):
    """A request whose admission into a slot raises inside ``step()`` gets the error on its own
    stream (``RequestFailedError`` naming it); the request running next to it completes with
    the reference tokens and the engine goes on."""
    cfg, params = tiny
    bad_prompt = [31, 32, 33]
    runner = llm.llm_engine.runner
    insert = runner.insert

    def failing_insert(b, ids, *args, **kw):
        if [int(t) for t in ids[:3]] == bad_prompt:
            raise RuntimeError("injected insert failure")
        return insert(b, ids, *args, **kw)

    monkeypatch.setattr(runner, "insert", failing_insert)
    eng = AsyncLLMEngine(llm.llm_engine)
    sp = SamplingParams(max_tokens=12, ignore_eos=True)

    async def main():
        good = asyncio.ensure_future(collect(eng, "good", PROMPTS[1], sp))
        bad = await eng.add_request("bad", bad_prompt, sp)
        with pytest.raises(jmtp.RequestFailedError) as ei:
            async for _ in bad:
                pass
        assert ei.value.request_id == "bad"
        assert isinstance(ei.value.__cause__, RuntimeError)
        return await good, await collect(eng, "after", PROMPTS[0], sp)

    try:
        good, after = run(main())
    finally:
        eng.shutdown()
    assert good[-1].outputs[0].token_ids == reference_greedy(cfg, params, PROMPTS[1], 12,
                                                             stop_ids=())
    assert after[-1].outputs[0].token_ids == reference_greedy(cfg, params, PROMPTS[0], 12,
                                                              stop_ids=())
    st = llm.llm_engine.get_stats()
    assert st["num_free_blocks"] == st["num_blocks"] and not llm.llm_engine.has_unfinished_requests()


def test_huge_max_tokens_run_to_the_end_of_the_context(llm, tiny):
    """``max_tokens`` / ``min_tokens`` far past int32 (an OverflowError in the device insert
    that failed every request in flight) run to ``max_model_len``, as any budget past it does:
    the device gets the budget capped at the context."""
    cfg, params = tiny
    sp = SamplingParams(max_tokens=2**40, min_tokens=2**33, ignore_eos=True)
    out = llm.generate([PROMPTS[0]], sp, use_tqdm=False)[0]
    ref = reference_greedy(cfg, params, PROMPTS[0], 10**6, stop_ids=(), max_model_len=64)
    assert len(ref) == 64 - len(PROMPTS[0])
    assert out.outputs[0].token_ids == ref and out.outputs[0].finish_reason == "length"


class BlockingEngine(CountingEngine):
    """A CountingEngine whose steps wait while :attr:`gate` is clear."""

    def __init__(self, engine):
        super().__init__(engine)
        self.gate = threading.Event()
        self.gate.set()

    def step(self):
        self.gate.wait()
        return super().step()


def test_busy_seconds_and_health_follow_a_stuck_step(llm):
    """``busy_seconds`` grows while the engine thread is stuck in a step and is 0 when idle;
    ``/health`` answers 503 ``engine_stalled`` past ``engine_stall_seconds``, 200 once the step
    is over, and 503 ``engine_dead`` after shutdown."""
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from jmtp.runtime.serve.server import ServerMetrics, ServerOptions, build_app

    blocking = BlockingEngine(llm.llm_engine)
    eng = AsyncLLMEngine(blocking, start=False)
    app = build_app(eng, None, model_name="m", max_model_len=64, metrics=ServerMetrics(),
                    vocab_size=64, options=ServerOptions(engine_stall_seconds=0.3))
    sp = SamplingParams(max_tokens=4, ignore_eos=True)

    async def main(http):
        assert (await asyncio.to_thread(http.get, "/health")).json()["status"] == "ok"
        assert eng.busy_seconds == 0.0
        blocking.gate.clear()
        stream = await eng.add_request("stuck", PROMPTS[0], sp)
        await asyncio.sleep(0.6)
        busy = eng.busy_seconds
        stalled = await asyncio.to_thread(http.get, "/health")
        blocking.gate.set()
        outs = [o async for o in stream]
        while eng.busy_seconds > 0:
            await asyncio.sleep(0.01)
        return busy, stalled, outs, await asyncio.to_thread(http.get, "/health")

    with TestClient(app) as http:
        busy, stalled, outs, after = run(main(http), timeout=120)
    assert busy > 0.3 and outs[-1].finished
    assert stalled.status_code == 503 and stalled.json()["error"]["code"] == "engine_stalled"
    assert after.status_code == 200 and after.json()["status"] == "ok"
    r = TestClient(app).get("/health")      # the lifespan ended: the engine was shut down
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"


def test_queue_times_reach_the_observer(llm):
    """Each request's queue time (arrival to admission) is reported once, in the stats of the
    pass that admitted it; with 2 slots the third request waits for one. (The schedule of
    test_continuous_batching_matches_reference: its step buckets are compiled already.)"""
    seen, running = [], []

    def observe(st, outs, dt):
        seen.extend(st["queue_seconds"])
        running.append(st["num_running"])

    eng = AsyncLLMEngine(llm.llm_engine, on_step=observe)
    sp = SamplingParams(max_tokens=12, ignore_eos=True)

    async def main():
        first = asyncio.ensure_future(collect(eng, "q0", PROMPTS[0], sp))
        while not running or running[-1] == 0:
            await asyncio.sleep(0.01)
        return await asyncio.gather(first, *(collect(eng, f"q{i}", PROMPTS[i], sp)
                                             for i in (1, 2, 3)))

    try:
        run(main())
    finally:
        eng.shutdown()
    assert len(seen) == 4 and all(w >= 0 for w in seen)
    assert max(seen) > 10 * min(seen)       # a late one waited for a slot to free
