"""int8 weight-only SmolLM2-135M-Instruct (the default model, ``LLM(quantization="int8")``, the
tied embedding in int8 per vocabulary row too): the bytes on the device against a hand count from
the config, every weight within half a
quantisation step, and the next-token choices of fp32 kept on evaluation prompts (greedy
generation over the whole evaluation split: ``scripts/eval_quant.py``, docs/quantization.md)."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jmtp.model import forward_logits
from jmtp.model.quant import dequantize
from jmtp.model.quant_params import param_bytes, quantize_params


def test_int8_smollm2_bytes_error_bound_and_next_token_agreement(smollm2, smollm2_tokenizer):
    cfg, params = smollm2
    qcfg, q = quantize_params(cfg, params, "int8")
    # hand count: per decoder block (30 target layers + the MTP layer) the 7 linears in int8 with
    # one f32 scale per output channel; the tied embedding (also the LM head) in int8 with one
    # f32 scale per vocabulary row; norms, eh_proj in f32
    h, i, qs, kv, v = (cfg.hidden_size, cfg.intermediate_size, cfg.q_size, cfg.kv_size,
                       cfg.vocab_size)
    assert cfg.tie_word_embeddings
    blocks = cfg.num_layers + cfg.num_mtp_layers
    linear = 2 * h * qs + 2 * h * kv + 3 * h * i
    scales = 2 * qs + 2 * kv + 2 * i + h
    f32_rest = (h + blocks * 2 * h                                          # norms
                + cfg.num_mtp_layers * (3 * h + 2 * h * h))                # MTP norms, eh_proj
    extra = sum(a.nbytes for k, a in params.items() if k in ("draft_vocab",))
    got = param_bytes(q)
    assert got["quantized_values"] == blocks * linear + v * h
    assert got["scales"] == 4 * (blocks * scales + v)
    assert got["unquantized"] == 4 * f32_rest + extra
    fp32 = 4 * (blocks * linear + v * h + f32_rest) + extra
    assert param_bytes(params)["total"] == fp32
    ratio = got["total"] / fp32
    assert abs(ratio - (blocks * (linear + 4 * scales) + v * (h + 4) + 4 * f32_rest + extra)
               / fp32) < 1e-12
    assert 0.25 < ratio < 0.27, ratio    # 1/4 plus scales, norms and the f32 eh_proj
    # every int8 weight within half a step of the fp32 one (a stacked target weight)
    w, wq = np.asarray(params["layers"]["w_down"]), q["layers"]["w_down"]
    step = np.asarray(wq.scale)
    assert np.all(np.abs(np.asarray(dequantize(wq)) - w) <= 0.5 * step + 1e-7)
    # teacher-forced next-token choices on chat-templated evaluation prompts
    from jmtp.train.prompts import encode_chat, load_prompts, split_prompts
    _, held_out = split_prompts(load_prompts(), 0.1, 0)
    agree = total = 0
    for p in held_out[:3]:
        ids = encode_chat(smollm2_tokenizer, p.text)
        ids = ids + [0] * (-len(ids) % 64)
        a = np.asarray(forward_logits(cfg, params, ids, block_size=64)).argmax(-1)
        b = np.asarray(forward_logits(qcfg, q, ids, block_size=64)).argmax(-1)
        agree, total = agree + int((a == b).sum()), total + len(ids)
    assert agree / total >= 0.95, agree / total
    assert qcfg.quantization.method == "int8" and jnp.dtype(wq.dtype) == jnp.int8
