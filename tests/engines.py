"""Canonical tiny test engines: engine shapes that tests in several modules share by name.

The suite's time is mostly XLA:CPU compiling step programs, one per engine configuration and
token bucket. Engines of one configuration share their compiled programs while one of them is
alive (``jmtp/runtime/device/executables.py``), and every test process keeps a persistent compilation
cache of its own (``tests/conftest.py``), so a second engine of a shape here, in any module that
runs in the same process, loads its programs instead of compiling them. Tests build a fresh
engine of a shape (no engine state or statistics carried from one test to the next) and vary
their requests, not the shape. A test keeps a shape of its own where it is about that shape
(preemption with few blocks, a bucket layout, a kernel's block size, a compile count).

Modules that share a shape carry the shape's ``xdist_group`` mark (:data:`GROUPS`), so one
worker compiles it once for all of them.
"""
from __future__ import annotations

import pytest

from jmtp.runtime.config import SpeculativeConfig
from jmtp.runtime.host.llm import LLM
from tests.runtime.conftest import tiny_model

#: shape name -> ``LLM`` keyword arguments (the model is a tiny one, :func:`tiny_llm`).
SHAPES = {
    # MTP K=2 M=2 on 2 slots, 64 positions in blocks of 4, a 32-token step budget: the 11-token
    # prompts of the engine-edge tests prefill in one step, two requests share a step.
    "mtp2": dict(speculative_config=SpeculativeConfig("mtp", 2, 2), max_num_seqs=2,
                 max_model_len=64, block_size=4, max_num_batched_tokens=32),
    # The 3-slot family: 3 slots (a fourth request waits, a third joins a running batch), 96
    # positions in blocks of 4, a 48-token step budget (a 40-token prompt prefills in one step),
    # top-3 logprobs served (requests that ask none are unaffected). Plain, MTP K=M=3, MTP K=M=2.
    "plain": dict(speculative_config=None, max_num_seqs=3, max_model_len=96, block_size=4,
                  max_num_batched_tokens=48, max_logprobs=3),
    "mtp3": dict(speculative_config=SpeculativeConfig("mtp", 3, 3), max_num_seqs=3,
                 max_model_len=96, block_size=4, max_num_batched_tokens=48, max_logprobs=3),
    "mtp2_3slots": dict(speculative_config=SpeculativeConfig("mtp", 2, 2), max_num_seqs=3,
                        max_model_len=96, block_size=4, max_num_batched_tokens=48,
                        max_logprobs=3),
}

#: shape name -> the xdist group of the tests that build it (one worker compiles it once)
GROUPS = {name: pytest.mark.xdist_group(f"tiny_{name}") for name in SHAPES}


def tiny_llm(shape: str, seed: int = 0, **llm_kwargs) -> LLM:
    """A new ``LLM`` of canonical shape ``shape`` over ``tiny_model(seed)`` (``TINY``).

    Args:
      shape: a key of :data:`SHAPES`.
      seed: the tiny model's parameter seed (parameters do not change the compiled programs).
      llm_kwargs: ``LLM`` options that leave the step programs as they are (``tokenizer``,
        ``async_scheduling``, ``compile``...); a shape option here raises.

    Raises:
      ValueError: ``llm_kwargs`` names an option the shape sets.
    """
    clash = set(llm_kwargs) & set(SHAPES[shape])
    if clash:
        raise ValueError(f"tiny_llm({shape!r}) sets {sorted(clash)}: add a shape instead")
    cfg, params = tiny_model(seed)
    return LLM(model_config=cfg, params=params, **SHAPES[shape], **llm_kwargs)


def tiny_engine(shape: str, seed: int = 0, **engine_kwargs):
    """A new ``LLMEngine`` of canonical shape ``shape`` over ``tiny_model(seed)``: the engine
    :func:`tiny_llm` wraps, for tests of the step-level API (``add_request``, ``step``,
    ``abort_request``). Arguments and errors as :func:`tiny_llm`."""
    from jmtp.runtime.host.llm_engine import LLMEngine
    clash = set(engine_kwargs) & set(SHAPES[shape])
    if clash:
        raise ValueError(f"tiny_engine({shape!r}) sets {sorted(clash)}: add a shape instead")
    cfg, params = tiny_model(seed)
    return LLMEngine(model_config=cfg, params=params, **SHAPES[shape], **engine_kwargs)
