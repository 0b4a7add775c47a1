"""8-bit weights in the engine (``LLM(quantization=...)``): a tiny MoE target (GLM-4.5-shaped,
MoE MTP layer) in int8 keeps MTP speculation lossless against plain greedy decoding over the same
int8 weights, reports their bytes from the arrays, plans the same bytes abstractly (what ``jmtp
compile`` reads), and refuses an unknown method naming the argument."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jmtp import LLM, SamplingParams, SpeculativeConfig
from jmtp.model.quant_params import param_bytes, quantize_params
from jmtp.runtime.host.engine_args import EngineArgs
from tests.runtime.conftest import TINY_MOE, reference_greedy, tiny_model


def _expected_bytes(cfg, params) -> dict:
    """Hand count: every decoder-block linear (target and MTP) one byte per weight plus one f32
    scale per output channel; the embedding one byte per weight plus one f32 scale per vocabulary
    row, an untied LM head one plus one per output channel (also a vocabulary entry); everything
    else f32."""
    linear = {"wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "experts_gate", "experts_up",
              "experts_down", "shared_gate", "shared_up", "shared_down"}
    values = scales = other = 0
    dicts = list(params["layers"]) + [params["mtp"]["layer"]]
    for d in dicts:
        for k, a in d.items():
            if k in linear:
                values += a.size
                scales += 4 * int(np.prod(a.shape[:-2])) * a.shape[-1]
            else:
                other += a.nbytes
    for k in ("embed", "lm_head"):
        if k in params:
            values += params[k].size
            scales += 4 * cfg.vocab_size
    other += sum(a.nbytes for k, a in params.items() if k not in ("layers", "mtp", "embed",
                                                                  "lm_head"))
    other += sum(a.nbytes for k, a in params["mtp"].items() if k != "layer")
    return dict(quantized_values=values, scales=scales, unquantized=other,
                total=values + scales + other, quantized_elements=values)


def test_int8_moe_engine_is_lossless_and_reports_8bit_bytes():
    cfg, params = tiny_model(seed=3, **TINY_MOE)
    qcfg, qparams = quantize_params(cfg, params, "int8")
    want_bytes = _expected_bytes(cfg, params)
    assert param_bytes(qparams) == want_bytes
    llm = LLM(model_config=cfg, params=params, quantization="int8", tokenizer=None,
              speculative_config=SpeculativeConfig("mtp", 2), max_num_seqs=1, max_model_len=48,
              block_size=4, dtype=jnp.float32, max_num_batched_tokens=8,
              layer_loop="scan")
    assert llm.model_config.quantization == qcfg.quantization
    prompts = [[3, 17, 5, 40, 22, 9], [60, 2, 2, 31]]
    outs = llm.generate(prompts, SamplingParams(max_tokens=10, ignore_eos=True), use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == reference_greedy(qcfg, qparams, p, 10, stop_ids=())
    assert llm.param_bytes() == want_bytes
    mem = llm.llm_engine.memory_per_device()
    assert mem["params"][1] == want_bytes["total"]
    # what jmtp compile plans for the same model from its config alone
    abstract = EngineArgs(model_config=cfg, quantization="int8", abstract=True,
                          speculative_config=SpeculativeConfig("mtp", 2), max_num_seqs=1,
                          max_model_len=48, block_size=4, dtype=jnp.float32,
                          devices=jax.devices()[:1]).build().runner
    assert abstract.param_bytes() == want_bytes


def test_unknown_quantization_is_refused_naming_it():
    with pytest.raises(ValueError, match="quantization must be one of \\('fp8', 'int8'\\)"):
        EngineArgs(quantization="int4").build()
