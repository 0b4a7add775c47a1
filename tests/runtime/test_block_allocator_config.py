"""``EngineConfig.block_allocator``: validation, the step's allocator calls follow it, and the
issue-12 large configuration (``max_num_seqs=128, max_model_len=8192, block_size=16``) with the TPU
allocator selected runs in interpret mode: its state is over the kernel's SMEM budget, so the step
runs the reference allocator instead of failing at trace time."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from jmtp import LLMEngine
from jmtp.pallas import block_allocator as ba, block_allocator_kernel as bak
from jmtp.runtime.config import EngineConfig
from jmtp.runtime.device import slots, target_stages as tgs
from jmtp.runtime.device.state import init_state
from jmtp.runtime.host.llm import SamplingParams
from tests.runtime.conftest import reference_greedy, tiny_model

pytestmark = pytest.mark.compile_lazy   # about buckets: each step in its own (conftest.py)


def test_block_allocator_default_and_bad_values():
    assert EngineConfig().block_allocator == "auto"
    for value in ("auto", "reference", "pallas_tpu", "pallas_gpu"):
        assert EngineConfig(block_allocator=value).block_allocator == value
    for bad in ("cuda", "", None, "Reference"):
        with pytest.raises(ValueError, match=r"block_allocator must be one of \('auto', "
                                             r"'reference', 'pallas_tpu', 'pallas_gpu'\)"):
            EngineConfig(block_allocator=bad)
    cfg, params = tiny_model(0)
    with pytest.raises(ValueError, match="block_allocator"):
        LLMEngine(model_config=cfg, params=params, max_model_len=32, block_size=4,
                  block_allocator="cuda", compile="lazy")


@pytest.mark.parametrize("value,kernel", [("reference", False), ("pallas_tpu", True),
                                          ("pallas_gpu", True),
                                          ("auto", jax.default_backend() == "tpu")])
def test_step_allocator_calls_follow_engine_config(value, kernel):
    """Both allocator call sites of the step (top-up and release) trace the configured one."""
    ec = EngineConfig(max_num_seqs=2, max_model_len=32, block_size=4, num_blocks=16,
                      max_num_batched_tokens=16, block_allocator=value)
    state = init_state(ec, 64)
    sched = tgs.schedule(ec, state, jnp.zeros((2,), jnp.int32))
    top_up = jax.make_jaxpr(lambda b, s, d: tgs.allocate_blocks(ec, b, s, d))(
        state.blocks, sched, state.seq_lens_decoder)
    release = jax.make_jaxpr(lambda s, f: slots.release_finished(ec, s, f))(
        state, jnp.zeros((2,), bool))
    for jaxpr in (top_up, release):
        assert ("pallas_call" in str(jaxpr)) == kernel


def test_large_config_with_tpu_allocator_falls_back_and_runs(monkeypatch, caplog):
    """max_num_seqs=128, max_model_len=8192, block_size=16 (P=512 pages per slot) and the default
    num_blocks = 128 * 512: the TPU kernel would need 526,856 bytes of SMEM, over its 512 KiB
    budget. The engine builds, logs the fallback once, and generates the greedy reference."""
    monkeypatch.setattr(ba, "_warned_fallbacks", set())
    cfg, params = tiny_model(0, num_layers=1, num_kv_heads=1)      # small KV cache (65536 blocks)
    with caplog.at_level("WARNING", logger=ba.__name__):
        engine = LLMEngine(model_config=cfg, params=params, max_num_seqs=128, max_model_len=8192,
                           block_size=16, block_allocator="pallas_tpu", compile="lazy")
        ec = engine.engine_config
        assert (ec.block_allocator, ec.pages_per_seq, ec.num_blocks) == ("pallas_tpu", 512, 65536)
        need = bak.tpu_smem_bytes(ec.num_blocks, ec.max_num_seqs, ec.pages_per_seq)
        assert need == 526_856 > bak.tpu_smem_budget_bytes()
        prompt = [5, 6, 7]
        engine.add_request("r", prompt, SamplingParams(max_tokens=2))
        outs = []
        while engine.has_unfinished_requests():
            outs += engine.step()
    assert outs[-1].finished
    assert outs[-1].outputs[0].token_ids == reference_greedy(cfg, params, prompt, 2)
    assert int(engine.runner.state.blocks.free_count) == ec.num_blocks   # released in its last step
    msgs = [r.getMessage() for r in caplog.records if r.name == ba.__name__]
    assert len(msgs) == 1, msgs                                      # once, at the first trace
    assert "526856 bytes of SMEM" in msgs[0] and "max_num_seqs=128" in msgs[0]
    assert "'reference'" in msgs[0]
