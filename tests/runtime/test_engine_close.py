"""``LLM.close()`` / ``with LLM(...)`` / collection release an engine's compiled executables and
the memory mappings XLA:CPU holds for them (jmtp/runtime/device/executables.py), so a process can build
engines one after another under the default ``vm.max_map_count``; the ``"auto"`` layer loop
degrades to the scan when the unrolled buckets would not fit (engine_args.fit_layer_loop).

The mappings are counted in ``/proc/self/maps``. Before engines released their executables,
deleting a tiny engine and collecting it left its ~7,500 mappings in place (measured), so these
tests fail on that code."""
from __future__ import annotations

import gc
import logging
import os

import pytest

import jmtp
from jmtp import SamplingParams, SpeculativeConfig
from jmtp.runtime.device.buckets import step_buckets
from jmtp.runtime.host import engine_args as ea
from jmtp.runtime.process import host_maps as hm

from tests.runtime.conftest import reference_greedy

pytestmark = [pytest.mark.compile_lazy,
              pytest.mark.skipif(not os.path.exists(hm.MAPS), reason="needs /proc/self/maps")]

#: The default vm.max_map_count of Linux (what a stock machine has).
DEFAULT_MAX_MAP_COUNT = 65530
PROMPTS = [[3, 4, 5, 6, 7], [9, 10, 11]]


def _maps() -> int:
    gc.collect()
    return hm.map_count()


def _llm(tiny, **kw):
    cfg, params = tiny
    kw = dict(dict(max_num_seqs=2, max_model_len=64, compile="lazy"), **kw)
    return jmtp.LLM(model_config=cfg, params=params, **kw)


def _run(llm, tiny):
    cfg, params = tiny
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=6), use_tqdm=False)
    for p, o in zip(PROMPTS, outs):     # the engine was right while it lived
        assert o.outputs[0].token_ids == reference_greedy(cfg, params, p, 6)


def test_engines_in_a_loop_release_their_mappings(tiny):
    """Engines of different configurations built, run and closed one after another: each one's
    mappings are released by close(), by leaving a ``with`` block and by garbage collection; the
    process stays far below the default limit; a closed engine refuses work."""
    with _llm(tiny, max_num_seqs=1) as warm:    # module-level jits compile once per process
        _run(warm, tiny)
    base = _maps()
    configs = [dict(), dict(speculative_config=SpeculativeConfig("mtp", 2))]
    peak = base
    for kw in configs:
        llm = _llm(tiny, **kw)
        _run(llm, tiny)
        held = _maps() - base
        peak = max(peak, base + held)
        assert held > 500, held          # the engine's executables are mapped while it lives
        llm.close()
        left = _maps() - base
        assert left < max(100, held // 10), (kw, held, left)
        with pytest.raises(RuntimeError, match="closed"):
            llm.generate(PROMPTS, SamplingParams(max_tokens=2), use_tqdm=False)
        with pytest.raises(RuntimeError, match="closed"):
            llm.llm_engine.step()
        llm.close()                      # idempotent
    # collected without close(): the same release
    llm = _llm(tiny, speculative_config=SpeculativeConfig("mtp", 2))
    _run(llm, tiny)
    held = _maps() - base
    del llm
    assert _maps() - base < max(100, held // 10)
    # a second engine of the same configuration shares the first one's executables; leaving
    # the block releases both
    with _llm(tiny) as a:
        _run(a, tiny)
        one = _maps() - base
        with _llm(tiny) as b:
            _run(b, tiny)
            assert _maps() - base - one < max(100, one // 10)
    assert _maps() - base < max(100, one // 10)
    assert peak < DEFAULT_MAX_MAP_COUNT - hm.RESERVE


def test_auto_layer_loop_degrades_to_the_scan_when_unrolled_would_not_fit(tiny, monkeypatch,
                                                                            caplog):
    """``layer_loop="auto"`` on one CPU device: unrolled when its buckets fit in the mappings left,
    the scan (with a warning naming the counts) when only that fits; an explicit choice stands."""
    cfg, _ = tiny
    cfg8 = cfg.replace(num_layers=8)
    from tests.runtime.conftest import tiny_model
    params8 = tiny_model(num_layers=8)[1]
    kw = dict(model_config=cfg8, params=params8, max_num_seqs=2, max_model_len=64,
              compile="lazy")
    ec = jmtp.LLM(**kw).llm_engine.engine_config
    n = len(step_buckets(ec))
    unrolled, scan = hm.engine_maps(n, 8, True), hm.engine_maps(n, 8, False)
    assert scan < unrolled
    monkeypatch.setattr(hm, "free_maps", lambda: unrolled)
    with jmtp.LLM(**kw) as llm:
        assert llm.llm_engine.layer_loop == "unrolled"
    monkeypatch.setattr(hm, "free_maps", lambda: unrolled - 1)
    with caplog.at_level(logging.WARNING, logger=ea.log.name):
        with jmtp.LLM(**kw) as llm:
            assert llm.llm_engine.layer_loop == "scan"
            outs = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=4), use_tqdm=False)
    assert outs[0].outputs[0].token_ids == reference_greedy(cfg8, params8, PROMPTS[0], 4)
    assert f"need ~{unrolled} memory mappings but only {unrolled - 1} are left" in caplog.text
    with jmtp.LLM(**kw, layer_loop="unrolled") as llm:      # the caller's choice stands
        assert llm.llm_engine.layer_loop == "unrolled"
