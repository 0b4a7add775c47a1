"""The engine step's call: one static StepSpec and four pytrees, each device op declared once."""
from __future__ import annotations

import dataclasses
import inspect

import jax
import numpy as np
import pytest
from flax import nnx

from jmtp.model.modules import LlamaForCausalLM
from jmtp.pallas.ragged_paged_attention import AttentionBackend
from jmtp.runtime.config import EngineConfig
from jmtp.runtime.device import placement
from jmtp.runtime.device.buckets import StepBucket
from jmtp.runtime.device.spec import Caches, StepInputs, StepSpec
from jmtp.runtime.device.step import engine_step
from tests.runtime.conftest import tiny_model

pytestmark = pytest.mark.compile_lazy   # about buckets: each step in its own (conftest.py)


@pytest.fixture(scope="module")
def graphdef():
    cfg, params = tiny_model()
    return nnx.split(LlamaForCausalLM.from_params(cfg, params))[0]


def _ec(**kw):
    return EngineConfig(max_num_seqs=4, max_model_len=32, block_size=4, num_blocks=64,
                        platform="cpu", **kw)


def test_engine_step_takes_one_static_spec_and_four_pytrees():
    params = list(inspect.signature(engine_step).parameters)
    assert params == ["spec", "model_state", "state", "caches", "inputs"]
    step = placement.DEVICE_OPS["step"]
    assert step.static == ("spec",) and step.donate == ("state", "caches")


def test_spec_build_resolves_once_and_is_a_hashable_key(graphdef):
    ec = _ec()
    a = StepSpec.build(graphdef, ec, 8)                  # int T: A = max_num_seqs
    assert a.bucket == StepBucket(8, 4)
    assert a.attention == AttentionBackend("xla", "cpu")  # resolved for ec.platform, not the host
    b = StepSpec.build(graphdef, ec, StepBucket(8, 4), "xla")
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert a.with_bucket(StepBucket(4, 2)) != a
    assert a.drafter is ec.spec.drafter is None


def test_spec_refuses_a_bucket_or_backend_it_cannot_run(graphdef):
    ec = _ec()
    with pytest.raises(ValueError, match="num_slots=5"):
        StepSpec(graphdef, ec, StepBucket(8, 5), AttentionBackend("xla", "cpu"))
    with pytest.raises(ValueError, match="num_slots=0"):
        StepSpec.build(graphdef, ec, StepBucket(8, 0))
    with pytest.raises(ValueError, match="resolved AttentionBackend"):
        StepSpec(graphdef, ec, StepBucket(8, 4), "xla")
    with pytest.raises(ValueError, match="implementation must be one of"):
        StepSpec.build(graphdef, ec, 8, "no_such_kernel")


def test_caches_and_inputs_flatten_in_the_old_argument_order():
    """The leaves keep the order of the 13-argument call (cache, mtp_cache; chunk, limit,
    bitmask, override), so the lowered step program's parameters are in the same order."""
    x = [np.full((2,), i, np.int32) for i in range(4)]
    assert [int(v[0]) for v in jax.tree.leaves(StepInputs(*x))] == [0, 1, 2, 3]
    assert jax.tree.leaves(StepInputs(x[0])) == [x[0]]            # absent inputs: no leaf
    assert [int(v[0]) for v in jax.tree.leaves(Caches((x[0],), (x[1],)))] == [0, 1]
    assert [f.name for f in dataclasses.fields(Caches)] == ["target", "mtp"]


def test_every_device_op_is_declared_once_with_both_forms():
    ops = placement.DEVICE_OPS
    assert set(ops) == {"step", "insert", "release", "retire", "push_free", "import", "gather",
                        "slot_state"}
    for name, op in ops.items():
        assert callable(op.single), name
        if op.sharded is None:     # derived: data_parallel.one_shard_op from the table's fields
            assert op.pick in ("where", "cond") and (op.idle is not None) == (op.pick == "cond")
            assert 1 <= op.stacked <= len(op.outputs), name
        else:
            assert op.sharded.__module__.endswith("data_parallel"), name
        assert set(op.outputs) <= {"state", "target", "mtp", "caches", "rep"}, name


def test_host_options_are_not_part_of_the_step_key():
    """``EngineConfig.device_config`` sets the options only the host reads to their defaults,
    so an engine that differs from a live one only there (the dynamic policy, the suffix
    trees' knobs, ``with_suffix``) traces no step program of its own: it runs the programs the
    first engine compiled (counted by JAX's trace events) and, greedy, its output."""
    from jmtp.runtime.config import SpeculativeConfig
    from jmtp.runtime.host.llm import LLM, SamplingParams
    from tests.engines import SHAPES

    host = dict(mtp_strategy="with_suffix", speculation_policy="dynamic",
                suffix_decoding_max_tree_depth=8, suffix_decoding_min_token_prob=0.3)
    ec = _ec(spec=SpeculativeConfig("mtp", 2, 2, **host))
    assert ec.device_config() == _ec(spec=SpeculativeConfig("mtp", 2, 2))
    plain = _ec()
    assert plain.device_config() is plain          # nothing host-only to drop
    cfg, params = tiny_model()
    shape = dict(SHAPES["mtp2"])
    prompts, sp = [[5, 6, 7, 5, 6, 7, 5, 6]], SamplingParams(max_tokens=8, ignore_eos=True)
    first = LLM(model_config=cfg, params=params, **shape)
    want = first.generate(prompts, sp)[0].outputs[0].token_ids
    shape["speculative_config"] = SpeculativeConfig("mtp", 2, 2, **host)
    traced = []

    def listen(event, duration, **kw):
        if event == "/jax/core/compile/jaxpr_trace_duration":
            traced.append(kw.get("fun_name"))
    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        second = LLM(model_config=cfg, params=params, **shape)
        got = second.generate(prompts, sp)[0].outputs[0].token_ids
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    runs = [llm.llm_engine.runner for llm in (first, second)]
    assert got == want
    assert runs[1].shard_config == runs[0].shard_config
    assert traced.count("engine_step") == len(runs[1].compiled_buckets - runs[0].compiled_buckets)
    assert runs[1].compiled_buckets & runs[0].compiled_buckets      # something to share
