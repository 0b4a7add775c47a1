"""The engine on a tiny DeepSeek-V3 target (multi-head latent attention) with its MTP layer, loaded
from a transformers ``save_pretrained`` checkpoint plus DeepSeek-layout MTP tensors: greedy
speculative decoding (K = 1, 3) is token-identical to plain greedy decoding, through chunked
prefill and preemption, and plain greedy equals the non-paged reference."""
from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest

from jmtp.model import load_checkpoint
from jmtp.runtime.config import SpeculativeConfig
from jmtp.runtime.host.llm import LLM, SamplingParams
from tests.runtime.conftest import reference_greedy

pytestmark = pytest.mark.xdist_group("deepseek_engine")   # one worker builds the shared engines once

torch = pytest.importorskip("torch")
torch.set_num_threads(1)
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    from safetensors.numpy import save_file
    from tests.model.test_deepseek_v3 import CASES, _mtp_tensors, _save
    path = tmp_path_factory.mktemp("dsv3")
    _save(path, seed=11, **CASES["q_lora_interleaved_yarn"])
    hf = json.loads((path / "config.json").read_text())
    hf["num_nextn_predict_layers"] = 1
    (path / "config.json").write_text(json.dumps(hf))
    save_file(_mtp_tensors(np.random.default_rng(3), hf, hf["num_hidden_layers"]),
              str(path / "mtp.safetensors"))
    cfg, params = load_checkpoint(path, dtype=jnp.float32)
    assert cfg.is_mla and cfg.num_mtp_layers == 1 and cfg.mtp_layout == "deepseek"
    return cfg, params


PROMPTS = [list(range(3, 33)), [5, 6, 7], [9] * 13]
MAX_TOKENS = 16


def _run(cfg, params, k, num_blocks):
    spec = SpeculativeConfig("mtp", k, k) if k else None
    llm = LLM(model_config=cfg, params=params, speculative_config=spec, max_num_seqs=3,
              max_model_len=64, block_size=4, num_blocks=num_blocks, max_num_batched_tokens=16)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False)
    st = llm.llm_engine.get_stats()
    assert st["num_free_blocks"] == st["num_blocks"]
    return [o.token_ids for o in outs], st["num_preemptions"], outs


@pytest.fixture(scope="module")
def plain(deepseek):
    return _run(*deepseek, None, None)[0]


def test_plain_greedy_equals_reference(deepseek, plain):
    cfg, params = deepseek
    for p, t in zip(PROMPTS, plain):
        assert t == reference_greedy(cfg, params, p, MAX_TOKENS, stop_ids=())


@pytest.mark.parametrize("k", [1, 3])
def test_speculative_equals_plain_with_chunked_prefill_and_preemption(deepseek, plain, k):
    cfg, params = deepseek
    spec, n_preempt, outs = _run(cfg, params, k, 14)
    assert n_preempt > 0, "the block budget was meant to force a preemption"
    assert spec == plain
    assert sum(o.metrics.num_draft_tokens for o in outs) > 0
