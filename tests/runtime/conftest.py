"""Tiny random models and reference greedy decoding for engine tests."""
from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

from jmtp.model import ModelConfig, forward_logits, init_params
from jmtp.model.config import LinearAttentionConfig, MoEConfig

TINY = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                   num_kv_heads=2, head_dim=8, eos_token_ids=(1,), num_mtp_layers=1)
# A tiny MoE target in GLM-4.5's shape: dense first layer, then MoE layers (8 experts, top-3,
# sigmoid scores with correction bias, grouped top-k, shared expert), partial rotary, MoE MTP layer.
TINY_MOE = dict(num_layers=3, partial_rotary_factor=0.5, moe=MoEConfig(
    8, 3, 16, layers=(1, 2), mtp_moe=True, scoring="sigmoid", norm_topk_prob=True,
    score_bias=True, n_group=2, topk_group=1, routed_scaling_factor=1.5,
    shared_intermediate_size=16))

# A tiny hybrid target in Qwen3-Next's shape: gated-DeltaNet layers around a gated full-attention
# layer (jmtp.model.gated_deltanet), partial rotary; the MTP layer is full attention.
TINY_HYBRID = dict(num_layers=3, layer_types=("linear_attention", "full_attention",
                                              "linear_attention"),
                   linear=LinearAttentionConfig(2, 4, 8, 8, 4), attn_output_gate=True,
                   qk_norm=True, partial_rotary_factor=0.5, mtp_layout="qwen3_next")


@functools.lru_cache(maxsize=None)
def tiny_model(seed: int = 0, std: float = 0.3, **overrides):
    cfg = TINY.replace(**overrides)
    return cfg, init_params(cfg, jax.random.key(seed), std=std)


def reference_greedy(cfg, params, prompt, max_tokens, stop_ids=None, max_model_len=None):
    """Plain greedy decoding with the non-paged full forward: the independent reference."""
    stop_ids = set(cfg.eos_token_ids if stop_ids is None else stop_ids)
    ids, out = list(prompt), []
    while len(out) < max_tokens and (max_model_len is None or len(ids) < max_model_len):
        padded = ids + [0] * (-len(ids) % 64)  # causal: trailing padding changes nothing before it
        logits = np.asarray(forward_logits(cfg, params, padded, block_size=64))
        tok = int(np.argmax(logits[len(ids) - 1]))
        out.append(tok)
        ids.append(tok)
        if tok in stop_ids:
            break
    return out


@pytest.fixture(scope="session")
def tiny():
    return tiny_model()


def free_blocks(llm) -> int:
    """Free KV blocks over every data shard of an ``LLM`` or ``LLMEngine`` (public stats)."""
    return getattr(llm, "llm_engine", llm).get_stats()["num_free_blocks"]


def engine_of(llm):
    """The ``LLMEngine`` of an ``LLM`` (or the engine itself)."""
    return getattr(llm, "llm_engine", llm)


@pytest.fixture(scope="module")
def kept_engines():
    """A list whose engines stay alive until the module ends, so that later tests' fresh engines
    of the same configuration run on the step buckets these compiled, instead of compiling them
    again (jmtp.runtime.device.executables: a configuration's executables live while one of its engines
    does). Tests that share one this way carry one ``xdist_group`` mark, so they run on one
    worker; a test that counts its own compiles must not share a configuration with a kept one."""
    kept = []
    yield kept
    for llm in kept:
        llm.close()




@pytest.fixture(scope="module")
def client(server):
    """The official ``openai`` client of the module's ``server`` fixture (a base URL: each server
    test module starts its own ``jmtp serve``, tests/runtime/serve_process.py)."""
    openai = pytest.importorskip("openai")
    c = openai.OpenAI(base_url=server + "/v1", api_key="none", timeout=300, max_retries=0)
    yield c
    c.close()


@pytest.fixture(scope="module")
def model_id(client):
    """The one model the module's server serves, as ``/v1/models`` names it."""
    return client.models.list().data[0].id
