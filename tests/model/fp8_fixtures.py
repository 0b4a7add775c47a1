"""Tiny block-scaled FP8 checkpoints in the published layout (DeepSeek-V3/R1, GLM-4.5-FP8), MTP
layer included, and their fp32 dequantised twins: the fixture generator of the 8-bit weight
tests (``tests/model/test_fp8_weights.py``).

The layout, as DeepSeek-V3's checkpoint and transformers' fine-grained FP8 store it:

* every linear weight of a decoder block (``*_proj.weight``, ``kv_a_proj_with_mqa.weight``,
  per-expert ``experts.{j}.{gate,up,down}_proj.weight``), the MTP layer's block included, is
  ``F8_E4M3 [out, in]`` with ``<name>_scale_inv`` ``F32 [ceil(out/b), ceil(in/b)]``: the absmax
  of the block over 448 (e4m3's largest value), so ``w ≈ q · scale_inv`` per block;
* embeddings, LM head, norms, routers (``mlp.gate.weight``), score-correction biases, attention
  biases and the MTP layer's ``eh_proj`` / ``enorm`` / ``hnorm`` / ``shared_head.norm`` stay
  unquantised (DeepSeek-V3 ships ``model.layers.61.eh_proj.weight`` in BF16);
* ``config.json`` carries ``quantization_config = {"quant_method": "fp8", "fmt": "e4m3",
  "activation_scheme": "dynamic", "weight_block_size": [b, b]}`` and the MTP layer is layer
  ``num_hidden_layers`` (``num_nextn_predict_layers: 1``); the tensors are sharded over two files
  with a ``model.safetensors.index.json``.

The quantiser here is the tests' own numpy code (not jmtp's). The twin (``deq/``) holds the
dequantised weights ``q · scale_inv`` in fp32 under the same names, without scales or
``quantization_config``: the fp32 reference the 8-bit forward is compared with.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import ml_dtypes
import numpy as np

FP8 = ml_dtypes.float8_e4m3fn
_LINEAR = re.compile(r"(_proj|_proj_with_mqa)\.weight$")

# The families' tiny configs: (transformers config class name, kwargs). Layer L (the donor's
# last) becomes the MTP layer; both families make it a MoE layer (first_k_dense_replace = 1).
FAMILIES = {
    "deepseek_v3": ("DeepseekV3Config", dict(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_attention_heads=4,
        num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, first_k_dense_replace=1, n_routed_experts=8,
        num_experts_per_tok=3, moe_intermediate_size=32, n_shared_experts=1, n_group=4,
        topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True, rope_interleave=True,
        max_position_embeddings=256, tie_word_embeddings=False)),
    "glm4_moe": ("Glm4MoeConfig", dict(
        vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, n_routed_experts=8,
        num_experts_per_tok=3, n_group=2, topk_group=1, n_shared_experts=1,
        first_k_dense_replace=1, routed_scaling_factor=1.8, attention_bias=True,
        use_qk_norm=True, partial_rotary_factor=0.5, tie_word_embeddings=False)),
}
NUM_LAYERS = 2


def quantize_fp8_blocks(w: np.ndarray, b: int) -> tuple[np.ndarray, np.ndarray]:
    """``(q f8_e4m3[M, N], scale_inv f32[ceil(M/b), ceil(N/b)])`` of ``w f32[M, N]``: per
    ``b × b`` block, ``scale = max|w| / 448`` and ``q = e4m3(w / scale)``."""
    m, n = w.shape
    gm, gn = -(-m // b), -(-n // b)
    padded = np.zeros((gm * b, gn * b), np.float32)
    padded[:m, :n] = w
    blocks = padded.reshape(gm, b, gn, b)
    scale = np.abs(blocks).max(axis=(1, 3)) / 448.0
    scale = np.where(scale > 0, scale, 1.0).astype(np.float32)
    q = (blocks / scale[:, None, :, None]).astype(FP8).reshape(gm * b, gn * b)[:m, :n]
    return np.ascontiguousarray(q), scale


def dequantize_fp8_blocks(q: np.ndarray, scale: np.ndarray, b: int) -> np.ndarray:
    m, n = q.shape
    return q.astype(np.float32) * np.repeat(np.repeat(scale, b, 0), b, 1)[:m, :n]


def _float_checkpoint(family: str, seed: int, tmp: Path) -> tuple[dict, dict]:
    """A random transformers model with ``NUM_LAYERS + 1`` layers saved and read back:
    ``(hf config dict, {name: f32 array})``."""
    import torch
    import transformers
    from safetensors.numpy import load_file

    transformers.logging.set_verbosity_error()
    cls, kw = FAMILIES[family]
    torch.manual_seed(seed)
    config = getattr(transformers, cls)(**kw, num_hidden_layers=NUM_LAYERS + 1)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if "inv_freq" in name:
                continue
            noise = torch.randn(p.shape, generator=g)
            scale = (0.05 if "e_score_correction_bias" in name else 0.5 if "embed" in name
                     else 0.08)
            p.copy_(1 + 0.2 * noise if "norm" in name else scale * noise)
    model.save_pretrained(tmp)
    tensors = {}
    for f in sorted(tmp.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    hf = json.loads((tmp / "config.json").read_text())
    return hf, {k: np.asarray(v, np.float32) for k, v in tensors.items()}


def _write_sharded(tensors: dict, out: Path) -> None:
    from safetensors.numpy import save_file
    out.mkdir(parents=True, exist_ok=True)
    names = sorted(tensors)
    weight_map = {}
    for k, part in enumerate((names[:len(names) // 2], names[len(names) // 2:])):
        fname = f"model-0000{k + 1}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, str(out / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in part})
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def write_fp8_checkpoint(root: Path, family: str = "deepseek_v3", block: int = 16,
                         seed: int = 0) -> dict:
    """Write ``root/fp8`` (the published FP8 layout, MTP layer ``model.layers.{L}``) and
    ``root/deq`` (its fp32 dequantised twin).

    Returns:
      ``{"fp8": path, "deq": path, "block": b, "quantized": {name: shape} of the FP8 tensors,
      "mtp_prefix": "model.layers.{L}."}``.
    """
    root = Path(root)
    hf, tensors = _float_checkpoint(family, seed, root / "src")
    rng = np.random.default_rng(seed + 1)
    h = hf["hidden_size"]
    p = f"model.layers.{NUM_LAYERS}."            # the donor's last layer is the MTP block
    for n in ("enorm", "hnorm", "shared_head.norm"):
        tensors[p + n + ".weight"] = (1 + 0.2 * rng.standard_normal(h)).astype(np.float32)
    tensors[p + "eh_proj.weight"] = (0.08 * rng.standard_normal((h, 2 * h))).astype(np.float32)
    hf.update(num_hidden_layers=NUM_LAYERS, num_nextn_predict_layers=1)
    fp8, deq, quantized = {}, {}, {}
    for name, w in tensors.items():
        if _LINEAR.search(name) and w.ndim == 2 and not name.endswith("eh_proj.weight"):
            q, s = quantize_fp8_blocks(w, block)
            fp8[name], fp8[name[:-len("weight")] + "weight_scale_inv"] = q, s
            deq[name] = dequantize_fp8_blocks(q, s, block)
            quantized[name] = w.shape
        else:
            fp8[name] = deq[name] = w
    _write_sharded(fp8, root / "fp8")
    _write_sharded(deq, root / "deq")
    (root / "deq" / "config.json").write_text(json.dumps(hf))
    hf["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                 "activation_scheme": "dynamic",
                                 "weight_block_size": [block, block]}
    (root / "fp8" / "config.json").write_text(json.dumps(hf))
    _write_tokenizer(root / "fp8", hf["vocab_size"])
    return {"fp8": root / "fp8", "deq": root / "deq", "block": block, "quantized": quantized,
            "mtp_prefix": p}


def _write_tokenizer(path: Path, vocab: int) -> None:
    """A word-level ``tokenizer.json`` over the ids (``LLM(path)`` loads one; the tests' prompts
    are token ids)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))


def read_all(directory: Path) -> tuple[dict, dict]:
    """``(config dict, {name: numpy array})`` of a checkpoint directory (every safetensors file;
    read through torch, since numpy has no float8 dtype: F8_E4M3 comes back as
    ``ml_dtypes.float8_e4m3fn``)."""
    import torch
    from safetensors import safe_open
    tensors = {}
    for f in sorted(Path(directory).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as sf:
            for name in sf.keys():
                t = sf.get_tensor(name)
                tensors[name] = (t.view(torch.uint8).numpy().view(FP8)
                                 if t.dtype == torch.float8_e4m3fn else t.numpy())
    return json.loads((Path(directory) / "config.json").read_text()), tensors


def rewrite(directory: Path, out: Path, tensors: dict | None = None, hf: dict | None = None):
    """A copy of checkpoint ``directory`` at ``out`` with ``tensors`` (one file) and ``hf``
    (config) replaced where given."""
    hf0, t0 = read_all(directory)
    from safetensors.numpy import save_file
    out.mkdir(parents=True, exist_ok=True)
    save_file(t0 if tensors is None else tensors, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf0 if hf is None else hf))
    return out
