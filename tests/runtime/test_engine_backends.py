"""The engine stays lossless with every attention backend: the jnp reference, and the Pallas kernels
(interpret mode on CPU); the default (``xla`` on CPU) runs in every other engine test."""
from __future__ import annotations

import pytest

from jmtp.runtime.config import SpeculativeConfig
from jmtp.runtime.host.llm import LLM, SamplingParams
from tests.runtime.conftest import reference_greedy, tiny_model


@pytest.mark.parametrize("backend", ["reference", "pallas_tpu", "pallas_gpu"])
def test_lossless_with_kernel_backend(backend):
    cfg, params = tiny_model(0)
    prompts = [[5, 6, 7], list(range(2, 14))]
    llm = LLM(model_config=cfg, params=params, speculative_config=SpeculativeConfig("mtp", 2, 2),
              max_num_seqs=2, max_model_len=32, block_size=8, max_num_batched_tokens=16,
              attention_backend=backend)
    outs = llm.generate(prompts, SamplingParams(max_tokens=5, ignore_eos=True), use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert o.token_ids == reference_greedy(cfg, params, p, 5, stop_ids=())
