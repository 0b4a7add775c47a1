"""Block-scaled FP8 checkpoints in the published layout (tiny DeepSeek-V3 and GLM-4.5, MTP layer
included, written by ``tests/model/fp8_fixtures.py``) load and run 8-bit:

* the logits of the target and of the MTP layer are within 1e-3 (relative to the largest logit)
  of jmtp's fp32 forward over the fp32 checkpoint of the dequantised weights (a separate,
  unquantised load), over a prefill and paged decode steps;
* the parameters on the device take one byte per quantised weight plus one f32 per scale block,
  counted from the arrays, and what ``jmtp compile`` plans from the config alone is the same;
* every bad configuration, and an MTP layer quantised differently from what the config says, is
  a ``ValueError`` naming the tensor (or the field);
* an engine with MTP speculation over the FP8 weights gives the greedy output of plain decoding.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jmtp.model import forward_logits, init_kv_cache, load_checkpoint, mtp_forward, ragged_batch
from jmtp.model.llama import compute_logits
from jmtp.model.quant import dequantize, is_quantized
from jmtp.model.quant_params import param_bytes, quantize_params
from tests.model.fp8_fixtures import FP8, read_all, rewrite, write_fp8_checkpoint

pytest.importorskip("torch")
pytest.importorskip("transformers")

pytestmark = pytest.mark.xdist_group("fp8_weights")


@pytest.fixture(scope="module", params=["deepseek_v3", "glm4_moe"])
def ckpt(request, tmp_path_factory):
    info = write_fp8_checkpoint(tmp_path_factory.mktemp(request.param), request.param)
    cfg, params = load_checkpoint(info["fp8"], dtype=jnp.float32)
    rcfg, ref = load_checkpoint(info["deq"], dtype=jnp.float32)
    return request.param, info, (cfg, params), (rcfg, ref)


def _rel(got, want) -> float:
    return float(np.abs(np.asarray(got) - np.asarray(want)).max() / np.abs(np.asarray(want)).max())


def test_weights_stay_8bit_with_the_files_values(ckpt):
    """Every FP8 tensor is a QuantizedWeight holding the file's e4m3 values and scales (target and
    MTP block); eh_proj, norms, router, embeddings and LM head stay float; the config records it."""
    family, info, (cfg, params), _ = ckpt
    q = cfg.quantization
    assert q.method == "fp8" and q.weight_block_size == (16, 16)
    assert cfg.num_mtp_layers == 1 and cfg.mtp_is_moe
    assert {"layers.w_gate", "layers.experts_up", "mtp.layer.experts_down",
            "mtp.layer.shared_up"} <= set(q.quantized)
    assert not is_quantized(params["mtp"]["eh_proj"]) and not is_quantized(params["lm_head"])
    assert not is_quantized(params["layers"][1]["router"])
    _, files = read_all(info["fp8"])
    p = info["mtp_prefix"]
    w = params["mtp"]["layer"]["experts_down"]
    assert w.dtype == jnp.float8_e4m3fn and w.scale.dtype == jnp.float32
    name = p + "mlp.experts.5.down_proj.weight"
    np.testing.assert_array_equal(np.asarray(w.value[0, 5]).view(np.uint8),
                                  files[name].T.view(np.uint8))
    np.testing.assert_array_equal(np.asarray(w.scale[0, 5]), files[name + "_scale_inv"].T)
    attn = "wkv_b" if family == "deepseek_v3" else "wq"
    proj = "self_attn.kv_b_proj.weight" if family == "deepseek_v3" else "self_attn.q_proj.weight"
    _, deq_files = read_all(info["deq"])
    np.testing.assert_array_equal(np.asarray(dequantize(params["layers"][0][attn])),
                                  deq_files["model.layers.0." + proj].T)


def test_logits_match_fp32_forward_over_dequantised_weights(ckpt):
    """Target logits over one prefill: 8-bit in the step vs the fp32 twin, within 1e-3."""
    _, _, (cfg, params), (rcfg, ref) = ckpt
    ids = np.random.default_rng(1).integers(0, cfg.vocab_size, size=23).tolist()
    got, want = forward_logits(cfg, params, ids), forward_logits(rcfg, ref, ids)
    assert _rel(got, want) <= 1e-3
    # LLM(quantization="int8") on the FP8 checkpoint: every FP8 weight dequantised and
    # requantised per output channel (one int8 rounding more: a bound, not an equality)
    icfg, iparams = quantize_params(cfg, params, "int8")
    assert icfg.quantization.method == "int8" and iparams["layers"][1]["experts_up"].block[1] == 1
    assert _rel(forward_logits(icfg, iparams, ids), want) <= 2e-2


@pytest.mark.parametrize("implementation", ["dense", "ragged"])
def test_mtp_layer_matches_fp32_forward(ckpt, implementation):
    """The MTP layer (MoE block, 8-bit experts and attention) over a 5-row prefill then one-row
    decode steps on a paged MTP cache, with both routed-expert implementations: its logits and
    fed-back hidden within 1e-3 of the fp32 twin's."""
    family, _, (cfg, params), (rcfg, ref) = ckpt
    if family == "glm4_moe" and implementation == "dense":
        pytest.skip("GLM-4.5 runs the ragged experts here (the dense ones: DeepSeek-V3)")
    moe = lambda c: c.replace(moe=c.moe.replace(implementation=implementation))  # noqa: E731
    cfg, rcfg = moe(cfg), moe(rcfg)
    rng = np.random.default_rng(2)
    T, bs = 8, 4
    ids = rng.integers(0, cfg.vocab_size, size=T).astype(np.int32)
    hidden = rng.standard_normal((T, cfg.hidden_size)).astype(np.float32)
    tables = jnp.asarray([[3, 1, 0]], jnp.int32)
    run = jax.jit(mtp_forward, static_argnums=0)
    outs = []
    for c, p in ((cfg, params), (rcfg, ref)):
        cache, done, logits, xs = init_kv_cache(c, 1, 4, bs), 0, [], []
        for chunk in (5, 1, 1, 1):
            pos, meta = ragged_batch(jnp.array([chunk]), jnp.array([done]), tables, bs, 2 + chunk)
            pad = lambda a: np.pad(a, [(0, 2)] + [(0, 0)] * (a.ndim - 1))  # noqa: E731
            h, x, cache = run(c, p, 0, jnp.asarray(pad(ids[done:done + chunk])),
                              jnp.asarray(pad(hidden[done:done + chunk])), pos, meta, cache)
            logits.append(np.asarray(compute_logits(p, h))[:chunk])
            xs.append(np.asarray(x)[:chunk])
            done += chunk
        outs.append((np.concatenate(logits), np.concatenate(xs)))
    assert _rel(outs[0][0], outs[1][0]) <= 1e-3
    assert _rel(outs[0][1], outs[1][1]) <= 1e-3


def test_parameter_bytes_are_one_per_weight_plus_scales(ckpt):
    """From the device arrays: 8-bit values = one byte per quantised weight of the file, scales =
    4 bytes per block, everything else as the fp32 twin holds it; ``jmtp compile``'s abstract
    parameters (config.json alone) have the same bytes."""
    from jmtp.model.checkpoints.loader import load_config
    from jmtp.runtime.host.engine_args import abstract_params
    _, info, (cfg, params), (_, ref) = ckpt
    _, files = read_all(info["fp8"])
    n_weights = sum(int(np.prod(s)) for s in info["quantized"].values())
    n_scales = sum(files[n[:-len("weight")] + "weight_scale_inv"].size for n in info["quantized"])
    got = param_bytes(params)
    assert got["quantized_elements"] == n_weights and got["quantized_values"] == n_weights
    assert got["scales"] == 4 * n_scales
    fp32 = param_bytes(ref)
    assert fp32["quantized_values"] == 0
    assert got["unquantized"] == fp32["total"] - 4 * n_weights
    planned = abstract_params(load_config(info["fp8"] / "config.json"), jnp.float32, True, None)
    assert param_bytes(planned) == got


BAD = {
    # the MTP layer's experts stored in BF16/F32 while the config quantises every block
    "mtp_expert_unquantized": lambda t, hf, p: (
        t.__setitem__(p + "mlp.experts.3.up_proj.weight",
                      t[p + "mlp.experts.3.up_proj.weight"].astype(np.float32) * 0.01)
        or t.pop(p + "mlp.experts.3.up_proj.weight_scale_inv"),
        "mlp.experts.3.up_proj.weight' .*MTP layer.*quantised differently"),
    "missing_scale": lambda t, hf, p: (
        t.pop("model.layers.0.mlp.down_proj.weight_scale_inv"),
        "model.layers.0.mlp.down_proj.weight.*without its"),
    "scale_grid": lambda t, hf, p: (
        t.__setitem__("model.layers.1.mlp.shared_experts.gate_proj.weight_scale_inv",
                      np.ones((1, 1), np.float32)),
        "shared_experts.gate_proj.weight.*weight_scale_inv has shape"),
    "fp8_router": lambda t, hf, p: (
        t.__setitem__("model.layers.1.mlp.gate.weight",
                      t["model.layers.1.mlp.gate.weight"].astype(FP8)),
        "model.layers.1.mlp.gate.weight.*not a linear weight"),
    "not_converted_but_fp8": lambda t, hf, p: (
        hf["quantization_config"].__setitem__("modules_to_not_convert", ["mlp.shared_experts"]),
        "shared_experts.*modules_to_not_convert"),
    "no_quantization_config": lambda t, hf, p: (
        hf.pop("quantization_config"), "F8_E4M3.*no quantization_config.weight_block_size"),
    "quant_method": lambda t, hf, p: (
        hf["quantization_config"].__setitem__("quant_method", "gptq"), "quant_method is 'gptq'"),
    "block_size": lambda t, hf, p: (
        hf["quantization_config"].__setitem__("weight_block_size", [128]), "weight_block_size"),
    "fmt": lambda t, hf, p: (
        hf["quantization_config"].__setitem__("fmt", "e5m2"), "fmt is 'e5m2'"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_quantisation_is_a_value_error_naming_the_tensor(ckpt, case, tmp_path):
    family, info, _, _ = ckpt
    if family != "deepseek_v3":
        pytest.skip("one family is enough for the error paths")
    hf, tensors = read_all(info["fp8"])
    _, pattern = BAD[case](tensors, hf, info["mtp_prefix"])
    bad = rewrite(info["fp8"], tmp_path / case, tensors, hf)
    with pytest.raises(ValueError, match=pattern):
        load_checkpoint(bad, dtype=jnp.float32)


def test_params_quantised_unlike_the_config_are_refused(ckpt):
    """Given parameters (LLM(params=...)) whose MTP block is float while the config says 8-bit,
    or the reverse, are refused naming the tensor, before anything runs."""
    from jmtp.model import check_params
    from jmtp.model.modules import LlamaForCausalLM
    family, _, (cfg, params), (_, ref) = ckpt
    if family != "deepseek_v3":
        pytest.skip("one family is enough for the error paths")
    mixed = dict(params, mtp=ref["mtp"])
    with pytest.raises(ValueError, match="mtp.layer.\\w+' is a float array .*makes it 8-bit"):
        check_params(cfg, mixed)
    with pytest.raises(ValueError, match="a float weight given where"):
        LlamaForCausalLM.from_params(cfg, mixed)


def test_engine_mtp_greedy_equals_plain_greedy_over_fp8_weights(ckpt):
    """Speculation stays lossless with 8-bit weights: ``LLM(path)`` of the FP8 checkpoint with MTP
    K=2 (the 8-bit MTP layer drafting) gives plain greedy decoding over the same 8-bit weights
    (the non-paged full forward, tests/runtime/conftest.py), and reports their bytes."""
    from jmtp import LLM, SamplingParams, SpeculativeConfig
    from tests.runtime.conftest import reference_greedy
    family, info, (cfg, params), _ = ckpt
    if family != "deepseek_v3":
        pytest.skip("the engine runs the DeepSeek-V3 fixture (MLA + MoE + MTP)")
    prompt = [5, 9, 17, 33, 2, 70, 100, 3, 3, 41]
    llm = LLM(str(info["fp8"]), speculative_config=SpeculativeConfig("mtp", 2), max_num_seqs=1,
              max_model_len=32, block_size=4, dtype=jnp.float32,
              max_num_batched_tokens=16, layer_loop="scan")
    out = llm.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert out[0].outputs[0].token_ids == reference_greedy(cfg, params, prompt, 8, stop_ids=())
    assert out[0].metrics.num_draft_tokens > 0
    assert llm.param_bytes() == param_bytes(params)
