"""The memory-map budget (jmtp/runtime/process/host_maps.py): XLA:CPU maps every compiled kernel on its own
and aborts the process past ``vm.max_map_count``; jmtp refuses the compile before that, with a
MapLimitError. Fake counters for the arithmetic, a tiny lazy engine for the engine path."""
from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jmtp
from jmtp.runtime.device.buckets import step_buckets
from jmtp.runtime.process import compile as jc, host_maps as hm

from tests.runtime.conftest import reference_greedy, tiny_model, engine_of

pytestmark = pytest.mark.compile_lazy   # about buckets: each step in its own (conftest.py)

LINUX = os.path.exists(hm.MAPS)


class _FakeMaps:
    """A process whose mappings grow by ``per`` with every compile (``compile()`` below)."""

    def __init__(self, base: int, per: int):
        self.used, self.per, self.compiled = base, per, 0

    def count(self) -> int:
        return self.used

    def lower(self, *args):          # stands for a jitted function: lower(...).compile()
        return self

    def compile(self):
        self.compiled += 1
        self.used += self.per


def test_budget_arithmetic():
    fake = _FakeMaps(5000, 1000)
    budget = hm.MapBudget("step bucket", limit=10000, count=fake.count)
    budget.check("first")            # nothing measured: 5000 in use leave room, so no refusal
    budget.start(); fake.compile(); budget.stop()
    assert budget.added == [1000] and budget.per_compile == 1000 and budget.need(2) == 2000
    # Hand-worked: 6000 in use + 1000 <= 10000 - 2048 = 7952 fits; + 2 x 1000 = 8000 does not.
    budget.check("T=8,A=1", remaining=1)
    with pytest.raises(hm.MapLimitError, match=r"2 more step buckets needs ~2000 more memory "
                       r"mappings \(1000-1000 per step bucket, measured\): 6000 are in use and "
                       r"vm.max_map_count is 10000"):
        budget.check("T=8,A=1", remaining=2)
    # A compile that added nothing (JAX reused an executable it held) does not count as a size;
    # the next compile is judged by the largest one measured, the ones after it by the smallest.
    budget.start(); budget.stop()
    budget.start(); fake.used += 700; budget.stop()
    assert budget.added == [1000, 0, 700] and budget.per_compile == 700
    assert budget.need(1) == 1000 and budget.need(3) == 1000 + 2 * 700


def test_budget_boundary():
    """Exactly at the reserve fits; one mapping more does not."""
    fake = _FakeMaps(5000, 1000)
    budget = hm.MapBudget("step bucket", limit=9048, count=fake.count)
    budget.start(); fake.compile(); budget.stop()          # 6000 in use, 1000 per compile
    budget.check("a")                                       # 6000 + 1000 == 9048 - 2048
    budget.limit = 9047
    with pytest.raises(hm.MapLimitError, match="step bucket a needs ~1000"):
        budget.check("a")


def test_budget_refuses_without_a_measurement_when_the_reserve_is_used():
    fake = _FakeMaps(8000, 0)
    budget = hm.MapBudget("step bucket", limit=10000, count=fake.count)   # 8000 > 10000 - 2048
    with pytest.raises(hm.MapLimitError, match=r"~0 more memory mappings \(none measured yet\)"
                       r": 8000 are in use"):
        budget.check("T=1,A=1")


def test_no_limit_checks_nothing():
    fake = _FakeMaps(10 ** 9, 10 ** 6)
    budget = hm.MapBudget("step bucket", limit=None, count=fake.count)
    budget.start(); fake.compile(); budget.stop()
    budget.check("x", remaining=10 ** 6)
    assert budget.added == []


def test_compile_ahead_stops_before_the_bucket_that_would_not_fit():
    fake = _FakeMaps(5000, 1000)
    budget = hm.MapBudget("step bucket", limit=10000, count=fake.count)
    with pytest.raises(hm.MapLimitError, match="compiling 3 more step buckets"):
        jc.compile_ahead(fake, [()] * 4, labels=["a", "b", "c", "d"], progress=False,
                         budget=budget)
    assert fake.compiled == 1       # refused after measuring the first, before the second
    fake2 = _FakeMaps(5000, 900)    # 5900 + 2 x 900 = 7700 <= 7952: all three fit
    times = jc.compile_ahead(fake2, [()] * 3, labels="abc", progress=False,
                             budget=hm.MapBudget("step bucket", limit=10000, count=fake2.count))
    assert fake2.compiled == 3 and set(times) == set("abc")


@pytest.mark.skipif(not LINUX, reason="needs /proc")
def test_xla_cpu_maps_compiled_code():
    """The premise: compiling adds mappings and they stay while the executable lives (if a
    future XLA stops doing this, the budget is moot and this test says so)."""
    assert hm.map_limit() and hm.map_limit() > 0
    before = hm.map_count()
    compiled = [jax.jit(lambda x, i=i: jnp.tanh(x * i) @ x.T + i).lower(
        jax.ShapeDtypeStruct((8, 8), jnp.float32)).compile() for i in range(8)]
    assert hm.map_count() - before >= 8
    del compiled


@pytest.mark.skipif(not LINUX, reason="needs /proc")
def test_lazy_engine_refuses_a_new_bucket_and_keeps_serving():
    cfg, params = tiny_model()
    # max_model_len=46: an engine no other test builds, so its buckets really compile here
    llm = jmtp.LLM(model_config=cfg, params=params, max_num_seqs=1, max_model_len=46,
                   max_num_batched_tokens=32, compile="lazy", compilation_cache_dir=None)
    engine = llm.llm_engine
    short = [3, 4, 5, 6, 7]
    assert llm.generate([short], jmtp.SamplingParams(max_tokens=3))[0].token_ids == \
        reference_greedy(cfg, params, short, 3)
    compiled = set(engine_of(engine).compiled_buckets)
    assert compiled and set(step_buckets(engine.engine_config)) - compiled
    assert engine_of(engine).runner.map_budget.per_compile > 0
    # As if the process were at its limit: no room for one more compile.
    engine_of(engine).runner.map_budget.limit = hm.map_count() + hm.RESERVE
    long = list(np.arange(20) % 50 + 3)        # a 20-token prompt: a prefill bucket not yet used
    engine.add_request("long", long, jmtp.SamplingParams(max_tokens=2))
    with pytest.raises(hm.MapLimitError, match=r"step bucket T=\d+,A=1 needs"):
        engine.step()
    assert engine_of(engine).compiled_buckets == compiled
    engine.abort_request("long")
    assert not engine.has_unfinished_requests()
    # The compiled buckets still serve, exactly.
    assert llm.generate([short], jmtp.SamplingParams(max_tokens=4))[0].token_ids == \
        reference_greedy(cfg, params, short, 4)


@pytest.mark.skipif(not LINUX, reason="needs /proc")
def test_eager_engine_stops_after_the_first_bucket(monkeypatch):
    """At construction the buckets still to compile must fit after the first one is measured."""
    cfg, params = tiny_model()
    # The limit as the engine's budget reads it: 64 mappings of room above the reserve (for
    # what the engine allocates before its first compile), less than one tiny bucket adds.
    monkeypatch.setattr(hm, "map_limit", lambda: hm.map_count() + hm.RESERVE + 64)
    compiled = []
    real = jc.compile_ahead

    def spy(fn, arg_lists, **kw):
        compiled.append(len(arg_lists))
        return real(fn, arg_lists, **kw)

    monkeypatch.setattr(jc, "compile_ahead", spy)
    with pytest.raises(hm.MapLimitError, match=r"compiling 3 more step buckets"):
        # max_model_len=42: an engine no other test builds; 4 step buckets (T = 1, 8, 16, 32)
        jmtp.LLM(model_config=cfg, params=params, max_num_seqs=1, max_model_len=42,
                 max_num_batched_tokens=32, compile="eager", compilation_cache_dir=None)
    assert compiled == [4]


@pytest.mark.skipif(not LINUX, reason="needs /proc")
def test_a_tiny_bucket_adds_more_than_the_eager_tests_room():
    """The premise of the test above: one tiny step bucket adds more than 64 mappings."""
    cfg, params = tiny_model()
    # max_model_len=38: an engine no other test builds
    llm = jmtp.LLM(model_config=cfg, params=params, max_num_seqs=1, max_model_len=38,
                   max_num_batched_tokens=8, compile="eager", compilation_cache_dir=None)
    assert min(llm.llm_engine.runner.map_budget.added) > 64
