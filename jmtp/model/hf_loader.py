"""Hugging Face checkpoint directories (``config.json`` + ``*.safetensors``) → jmtp parameters.

Supported architectures (``config.json`` ``architectures[0]``):

* ``LlamaForCausalLM`` (Llama 2/3, SmolLM2; optional ``attention_bias``; llama3 ``rope_scaling``),
* ``MistralForCausalLM`` without sliding window (same tensors as Llama),
* ``Qwen2ForCausalLM`` (q/k/v biases),
* ``MiMoForCausalLM`` (Xiaomi MiMo-7B, ``model_type: mimo``): a Qwen2 decoder (q/k/v biases)
  plus ``num_nextn_predict_layers`` MTP layers ``model.mtp_layers.{j}`` (the ``mimo`` MTP layout
  below),
* ``Qwen3ForCausalLM`` (per-head ``q_norm``/``k_norm``, ``head_dim`` from the config),
* ``Ernie4_5ForCausalLM`` (dense ERNIE-4.5). ERNIE applies RoPE to *interleaved* pairs
  ``(2i, 2i+1)`` (transformers ``models/ernie4_5/modeling_ernie4_5.py``: ``rotate_half`` on
  ``x[..., 0::2] / x[..., 1::2]`` and ``repeat_interleave``d cos/sin), while jmtp uses the
  ``rotate_half`` layout on pairs ``(i, i + D/2)``. Attention scores are invariant under one
  permutation of the head dimension applied to both q and k, so the loader permutes the output
  rows of ``q_proj``/``k_proj`` (and their biases / q-k norms) per head with
  :func:`deinterleave_rows`, after which the standard forward is exact.
* ``DeepseekV3ForCausalLM`` (multi-head latent attention, :mod:`jmtp.model.mla`; tensors
  ``self_attn.{q_a_proj,q_a_layernorm,q_b_proj | q_proj, kv_a_proj_with_mqa,kv_a_layernorm,
  kv_b_proj,o_proj}``). With ``rope_interleave`` (the default) the rotary columns of ``q_b_proj``
  (per head) and ``kv_a_proj_with_mqa`` are de-interleaved like ERNIE's. YaRN rope scaling
  (``rope_type: yarn``, DeepSeek-V3's own; any architecture) is supported. DeepSeek-V3's fp8 checkpoints
  (``F8_E4M3`` weights with ``<name>_scale_inv`` f32 scales per ``weight_block_size`` block
  (``quantization_config``, 128x128 in DeepSeek-V3)) are dequantised at load (``w * scale``).
* Mixture-of-experts targets (:mod:`jmtp.model.moe`; ``ModelConfig.moe``):

  - ``Qwen3MoeForCausalLM``: softmax router, ``norm_topk_prob``, no shared experts; MoE layers
    are those not in ``mlp_only_layers`` with ``(i + 1) % decoder_sparse_step == 0``; q/k-norm.
  - ``Glm4MoeForCausalLM`` (GLM-4.5): sigmoid router with ``e_score_correction_bias``, grouped
    top-k, ``routed_scaling_factor``, ``n_shared_experts``; the first ``first_k_dense_replace``
    layers dense; attention with ``partial_rotary_factor`` (default 0.5), ``attention_bias``,
    ``use_qk_norm`` (transformers ``modeling_glm4_moe.py``).
  - ``Ernie4_5_MoeForCausalLM``: softmax router, ``moe_statics.e_score_correction_bias`` for the
    choice, renormalised by ``max(sum, moe_norm_min)``, ``moe_num_shared_experts``; MoE layers
    ``moe_layer_start_index <= i <= moe_layer_end_index`` with ``(i + 1) % moe_layer_interval ==
    0``; interleaved RoPE as dense ERNIE-4.5.

  Experts are read from per-expert tensors ``mlp.experts.{e}.{gate,up,down}_proj.weight`` (hub
  and ``save_pretrained`` layout; ERNIE also a fused ``up_gate_proj``), or from the fused
  ``mlp.experts.gate_up_proj f[E, 2I, H]`` / ``mlp.experts.down_proj f[E, H, I]``; the router
  from ``mlp.gate.weight f[E, H]``. An MTP block's FFN kind (MoE for GLM-4.5, dense for ERNIE's
  ``mtp_block``) is taken from its tensors (``mlp.gate.weight`` present or not) and recorded as
  ``ModelConfig.moe.mtp_moe``.

Multi-token-prediction (MTP) tensors are picked up in three layouts (the first two are the
DeepSeek-V3 MTP layer and the weight names of FastDeploy's ERNIE-4.5 MTP model,
``ernie4_5_mtp.py``):

* ``deepseek`` (DeepSeek-V3 / GLM-4.5 "NextN"): ``model.layers.{N+j}.{enorm,hnorm,eh_proj,
  shared_head.norm,input_layernorm,post_attention_layernorm,self_attn.*,mlp.*}`` for MTP module
  ``j`` where ``N = num_hidden_layers``; ``eh_proj`` is a torch Linear ``[H, 2H]`` (out, in) whose
  input is ``[enorm(embed(x)); hnorm(h)]``; the module's own final norm is ``shared_head.norm``.
* ``ernie`` (ERNIE-4.5 MTP): ``{ernie|model}.mtp_emb_norm.{j}``, ``.mtp_hidden_norm.{j}``,
  ``.mtp_linear_proj.{j}`` and ``.mtp_block.{j}.*``. Paddle checkpoints store Linear weights
  ``[in, out]``, torch ports ``[out, in]``; the (never square) ``mtp_linear_proj`` tells which
  (``[2H, H]`` → Paddle, ``[H, 2H]`` → torch) and the rest of the module follows the same
  convention. The block may use fused ``qkv_proj`` (``[q; k; v]`` along the output axis) and
  ``up_gate_proj`` (``[gate; up]`` along the output axis, as FastDeploy's ``swiglu`` splits it) or
  split projections. There is no MTP final norm: the target's final norm is copied.
* ``mimo`` (MiMo-7B): ``model.mtp_layers.{j}.{token_layernorm,hidden_layernorm,input_proj,
  final_layernorm}.weight`` and, under the *same* prefix (no ``mtp_block.`` in the checkpoint;
  vLLM and SGLang insert it when renaming), the Qwen2 block's ``input_layernorm``,
  ``post_attention_layernorm``, ``self_attn.{q,k,v}_proj.{weight,bias}``, ``self_attn.o_proj``,
  ``mlp.{gate,up,down}_proj``. ``token_layernorm`` → ``enorm``, ``hidden_layernorm`` →
  ``hnorm``, ``final_layernorm`` → the module's own final norm. ``input_proj`` is a torch Linear
  ``[H, 2H]`` over ``[hidden_layernorm(h); token_layernorm(e)]`` (hidden first, the reverse of
  DeepSeek's ``eh_proj``), so the loader swaps the two halves of its input rows to get jmtp's
  ``eh_proj`` over ``[enorm(e); hnorm(h)]``. Sources, facts only: vLLM
  ``vllm/model_executor/models/mimo_mtp.py`` / ``mimo.py``, SGLang
  ``python/sglang/srt/models/mimo_mtp.py``, the hub's ``modeling_mimo.py`` (``MiMoMTPLayers``);
  details in :mod:`jmtp.model.llama` ``mtp_forward`` and ``docs/mimo.md``.

A checkpoint without MTP tensors gets a fresh head from :func:`jmtp.model.params.init_mtp_params`.
MTP tensors are also looked for in an ``mtp/`` sub-directory (where ERNIE ships them).

Safetensors files are read by :class:`SafetensorsFile` straight from the documented file format
(8-byte little-endian header length, JSON header, raw little-endian data) through ``np.memmap``,
so bf16/fp8 tensors need no torch.
"""
from __future__ import annotations

import json
import logging
import math
import os
import re
from pathlib import Path
from typing import Iterable, Protocol

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jmtp.model.config import ModelConfig, MoEConfig, RopeScaling
from jmtp.model.params import (check_params, init_mtp_params, layer_shapes, layers_stacked,
                               mtp_moe_of_fresh_head)

log = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
    "Ernie4_5ForCausalLM", "Qwen3MoeForCausalLM", "Ernie4_5_MoeForCausalLM", "Glm4MoeForCausalLM",
    "DeepseekV3ForCausalLM", "MiMoForCausalLM",
)
# Qwen2Attention's q/k/v projections always carry biases (MiMo's decoder is Qwen2's).
QKV_BIAS_ARCHITECTURES = ("Qwen2ForCausalLM", "MiMoForCausalLM")
INTERLEAVED_ROPE_ARCHITECTURES = ("Ernie4_5ForCausalLM", "Ernie4_5_MoeForCausalLM")
MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM", "Ernie4_5_MoeForCausalLM", "Glm4MoeForCausalLM",
                     "DeepseekV3ForCausalLM")
MLA_ARCHITECTURES = ("DeepseekV3ForCausalLM",)


# ----------------------------------------------------------------------------------------------
# Tensor sources
# ----------------------------------------------------------------------------------------------

class TensorSource(Protocol):
    """Named checkpoint tensors in HF naming and HF (torch, ``[out, in]``) layout."""

    def names(self) -> set[str]: ...

    def shape(self, name: str) -> tuple[int, ...]: ...

    def get(self, name: str) -> np.ndarray: ...

    def where(self, name: str) -> str: ...


_ST_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
    "BOOL": np.bool_, "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
}
_FLOAT_ST_DTYPES = ("F64", "F32", "F16", "BF16")
_FP8_ST_DTYPES = ("F8_E4M3",)


def dequantize_block_fp8(w: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int] | None,
                         where: str) -> np.ndarray:
    """DeepSeek-V3 block-scaled fp8 -> f32: ``w[i, j] * scale_inv[i // bm, j // bn]``.

    ``w f8_e4m3[M, N]``, ``scale_inv f32[ceil(M/bm), ceil(N/bn)]`` with ``(bm, bn)`` the config's
    ``quantization_config.weight_block_size`` (DeepSeek's ``weight_dequant``: the stored
    "scale_inv" multiplies).

    Raises:
      ValueError: no block size configured, or a scale grid that does not fit ``w``.
    """
    if block is None:
        raise ValueError(f"{where} is fp8 with a _scale_inv but config.json has no "
                         "quantization_config.weight_block_size")
    bm, bn = block
    m, n = w.shape
    grid = (-(-m // bm), -(-n // bn))
    if tuple(scale_inv.shape) != grid:
        raise ValueError(f"{where}: scale_inv has shape {tuple(scale_inv.shape)}, expected {grid} "
                         f"for a [{m}, {n}] weight in {bm}x{bn} blocks")
    s = np.repeat(np.repeat(np.asarray(scale_inv, np.float32), bm, 0), bn, 1)[:m, :n]
    return w.astype(np.float32) * s


class SafetensorsFile:
    """Zero-copy reader of one ``.safetensors`` file (format: huggingface/safetensors README).

    Raises:
      ValueError: if the file is truncated, its header is not valid JSON, or a tensor's byte range
        does not match its dtype and shape.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = str(path)
        size = os.path.getsize(self.path)
        with open(self.path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ValueError(f"{self.path}: not a safetensors file (shorter than 8 bytes)")
            n = int.from_bytes(head, "little")
            if n > size - 8:
                raise ValueError(f"{self.path}: safetensors header length {n} exceeds the file size")
            try:
                header = json.loads(f.read(n))
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise ValueError(f"{self.path}: safetensors header is not valid JSON ({e})") from None
        header.pop("__metadata__", None)
        self._header = header
        self._offset = 8 + n
        self._mm = np.memmap(self.path, dtype=np.uint8, mode="r") if size > self._offset else None

    def names(self) -> list[str]:
        return list(self._header)

    def dtype_name(self, name: str) -> str:
        return self._header[name]["dtype"]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(int(s) for s in self._header[name]["shape"])

    def get(self, name: str) -> np.ndarray:
        info = self._header[name]
        dt = info["dtype"]
        if dt not in _ST_DTYPES:
            raise ValueError(f"{self.path}: tensor {name!r} has unsupported safetensors dtype {dt}")
        dtype = np.dtype(_ST_DTYPES[dt])
        shape = self.shape(name)
        begin, end = (int(x) for x in info["data_offsets"])
        count = math.prod(shape)
        if end - begin != count * dtype.itemsize:
            raise ValueError(
                f"{self.path}: tensor {name!r} spans {end - begin} bytes, expected "
                f"{count * dtype.itemsize} for {dt}{list(shape)}")
        if count == 0:
            return np.zeros(shape, dtype)
        raw = self._mm[self._offset + begin:self._offset + end]
        return raw.view(dtype).reshape(shape)


class SafetensorsSource:
    """All tensors of a checkpoint directory: ``model.safetensors.index.json`` (sharded) or every
    ``*.safetensors`` file, plus ``mtp/*.safetensors`` when that sub-directory exists.

    Raises:
      ValueError: if no safetensors file is found, the index names a missing shard, or a tensor
        name appears in two files.
    """

    def __init__(self, directory: str | os.PathLike, weight_block_size: tuple[int, int] | None = None):
        self.weight_block_size = weight_block_size
        d = Path(directory)
        index = d / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text()).get("weight_map", {})
            files = sorted({d / f for f in weight_map.values()})
            for f in files:
                if not f.is_file():
                    raise ValueError(f"{index}: names shard {f.name} which does not exist")
        else:
            files = sorted(d.glob("*.safetensors"))
        if (d / "mtp").is_dir():
            files += sorted((d / "mtp").glob("*.safetensors"))
        if not files:
            raise ValueError(f"{d}: no *.safetensors files (only safetensors checkpoints are supported)")
        self._files: dict[str, SafetensorsFile] = {}
        for f in files:
            sf = SafetensorsFile(f)
            for name in sf.names():
                if name in self._files:
                    raise ValueError(
                        f"{d}: tensor {name!r} appears in both {self._files[name].path} and {sf.path}")
                self._files[name] = sf

    def names(self) -> set[str]:
        return set(self._files)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._files[name].shape(name)

    def get(self, name: str) -> np.ndarray:
        sf = self._files[name]
        if sf.dtype_name(name) in _FP8_ST_DTYPES and name + "_scale_inv" in self._files:
            return dequantize_block_fp8(sf.get(name), self.get(name + "_scale_inv"),
                                        self.weight_block_size, f"{sf.path}: tensor {name!r}")
        if sf.dtype_name(name) not in _FLOAT_ST_DTYPES:
            raise ValueError(
                f"{sf.path}: tensor {name!r} has dtype {sf.dtype_name(name)}; only "
                f"{'/'.join(_FLOAT_ST_DTYPES)} weights are supported (quantized checkpoints are not)")
        return sf.get(name)

    def where(self, name: str) -> str:
        return self._files[name].path


# ----------------------------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------------------------

def _rope_params(hf: dict, where: str,
                 allow_yarn: bool = False) -> tuple[float, RopeScaling | None]:
    """(rope_theta, RopeScaling|None) from a transformers 4.x (``rope_theta`` + ``rope_scaling``) or
    5.x (``rope_parameters``) config."""
    params = dict(hf.get("rope_parameters") or {})
    legacy = hf.get("rope_scaling") or {}
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    spec = params if params.get("rope_type", params.get("type")) not in (None, "default") else legacy
    rope_type = spec.get("rope_type", spec.get("type", "default")) if spec else "default"
    if rope_type in (None, "default"):
        return float(theta), None
    if rope_type == "yarn" and allow_yarn:
        try:
            scaling = RopeScaling(
                factor=float(spec.get("factor") or 1.0), low_freq_factor=0.0, high_freq_factor=0.0,
                original_max_position_embeddings=int(spec["original_max_position_embeddings"]),
                rope_type="yarn", beta_fast=float(spec.get("beta_fast") or 32),
                beta_slow=float(spec.get("beta_slow") or 1), mscale=float(spec.get("mscale") or 0),
                mscale_all_dim=float(spec.get("mscale_all_dim") or 0),
                attention_factor=(None if spec.get("attention_factor") is None
                                  else float(spec["attention_factor"])),
                truncate=bool(spec.get("truncate", True)))
        except KeyError as e:
            raise ValueError(f"{where}: yarn rope scaling lacks field {e.args[0]!r}") from None
        return float(theta), scaling
    if rope_type != "llama3":
        raise ValueError(
            f"{where}: rope scaling type {rope_type!r} (field rope_parameters/rope_scaling.rope_type) "
            "is not supported; only 'default', 'llama3' and 'yarn' are")
    try:
        scaling = RopeScaling(
            factor=float(spec["factor"]), low_freq_factor=float(spec["low_freq_factor"]),
            high_freq_factor=float(spec["high_freq_factor"]),
            original_max_position_embeddings=int(spec["original_max_position_embeddings"]))
    except KeyError as e:
        raise ValueError(f"{where}: llama3 rope scaling lacks field {e.args[0]!r}") from None
    return float(theta), scaling


def _eos_ids(*values) -> tuple[int, ...]:
    out: list[int] = []
    for v in values:
        if v is None:
            continue
        for i in (v if isinstance(v, (list, tuple)) else [v]):
            if i is not None and int(i) not in out:
                out.append(int(i))
    return tuple(out)


def hf_config(hf: dict, where: str, generation_config: dict | None = None) -> ModelConfig:
    """:class:`ModelConfig` of a transformers ``config.json`` dict (MTP fields left at defaults).

    Raises:
      ValueError: naming the field, for an unknown architecture, a missing required field, or a
        feature jmtp's forward does not implement (sliding window, MLP/output biases, partial
        rotary, rope scaling other than llama3 and yarn).
    """
    archs = hf.get("architectures") or []
    arch = archs[0] if archs else None
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"{where}: unknown architecture {arch!r} (field 'architectures'); supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}")

    def need(key):
        if hf.get(key) is None:
            raise ValueError(f"{where}: missing required field {key!r}")
        return hf[key]

    h, nq = int(need("hidden_size")), int(need("num_attention_heads"))
    nkv = int(hf.get("num_key_value_heads") or nq)
    head_dim = int(hf.get("head_dim") or h // nq)
    if hf.get("use_sliding_window") or (arch == "MistralForCausalLM" and hf.get("sliding_window")):
        raise ValueError(f"{where}: sliding-window attention (field 'use_sliding_window'/"
                         "'sliding_window') is not supported")
    if hf.get("mlp_bias"):
        raise ValueError(f"{where}: field 'mlp_bias' = true is not supported")
    if hf.get("use_bias"):
        raise ValueError(f"{where}: field 'use_bias' = true (biases on every Linear) is not supported")
    prf = (hf.get("rope_parameters") or {}).get("partial_rotary_factor",
                                                hf.get("partial_rotary_factor"))
    if arch == "Glm4MoeForCausalLM":
        prf = 0.5 if prf is None else float(prf)   # transformers' Glm4MoeConfig default
    elif prf is not None and float(prf) != 1.0:
        raise ValueError(f"{where}: field 'partial_rotary_factor' != 1 is not supported for "
                         f"{arch} (only GLM-4.5's partial rotary is)")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{where}: field 'hidden_act' = {hf.get('hidden_act')!r}; only 'silu' "
                         "(SwiGLU) is supported")
    mla_fields = {}
    if arch in MLA_ARCHITECTURES:
        mla_fields = _mla_config(hf, where, need)
        head_dim = mla_fields["qk_rope_head_dim"]
    theta, scaling = _rope_params(hf, where, allow_yarn=True)
    gen = generation_config or {}
    tie = hf.get("tie_word_embeddings")
    if tie is None:  # transformers' per-model defaults
        tie = arch in ("Ernie4_5ForCausalLM", "Ernie4_5_MoeForCausalLM")
    return ModelConfig(
        architecture=arch,
        vocab_size=int(need("vocab_size")),
        hidden_size=h,
        intermediate_size=int(need("intermediate_size")),
        num_layers=int(need("num_hidden_layers")),
        num_heads=nq,
        num_kv_heads=nkv,
        head_dim=head_dim,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        tie_word_embeddings=bool(tie),
        attention_bias=bool(hf.get("attention_bias", arch in QKV_BIAS_ARCHITECTURES)),
        qk_norm=(arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
                 or (arch == "Glm4MoeForCausalLM" and bool(hf.get("use_qk_norm")))),
        partial_rotary_factor=1.0 if prf is None else float(prf),
        moe=_moe_config(hf, arch, where),
        max_position_embeddings=int(hf.get("max_position_embeddings") or 2048),
        bos_token_id=next((b for b in (hf.get("bos_token_id"), gen.get("bos_token_id"))
                           if b is not None), None),
        eos_token_ids=_eos_ids(hf.get("eos_token_id"), gen.get("eos_token_id")),
        **mla_fields,
    )


def _mla_config(hf: dict, where: str, need) -> dict:
    """ModelConfig MLA fields of a DeepSeek-V3 ``config.json`` (ValueError naming the field for
    what jmtp does not implement)."""
    if hf.get("attention_bias"):
        raise ValueError(f"{where}: field 'attention_bias' = true is not supported for MLA")
    q_lora = hf.get("q_lora_rank")
    return dict(attention_type="mla", q_lora_rank=None if q_lora is None else int(q_lora),
                kv_lora_rank=int(need("kv_lora_rank")),
                qk_nope_head_dim=int(need("qk_nope_head_dim")),
                qk_rope_head_dim=int(need("qk_rope_head_dim")), v_head_dim=int(need("v_head_dim")))


def _moe_config(hf: dict, arch: str, where: str) -> MoEConfig | None:
    """:class:`MoEConfig` of a MoE architecture's config.json (None for dense ones); the MTP
    FFN kind (``mtp_moe``) is set later from the checkpoint's tensors."""
    if arch not in MOE_ARCHITECTURES:
        return None

    def need(*keys):
        for k in keys:
            if hf.get(k) is not None:
                v = hf[k]
                if isinstance(v, (list, tuple)):
                    raise ValueError(f"{where}: field {k!r} is a list (multimodal MoE); only one "
                                     "expert group is supported")
                return v
        raise ValueError(f"{where}: missing required field {keys[0]!r}")

    n = int(need("num_hidden_layers"))
    ie = int(need("moe_intermediate_size"))
    if arch == "Qwen3MoeForCausalLM":
        e, k = int(need("num_experts", "num_local_experts")), int(need("num_experts_per_tok"))
        step = int(hf.get("decoder_sparse_step") or 1)
        dense = set(hf.get("mlp_only_layers") or ())
        layers = tuple(i for i in range(n) if i not in dense and e > 0 and (i + 1) % step == 0)
        return MoEConfig(e, k, ie, layers=layers, scoring="softmax",
                         norm_topk_prob=bool(hf.get("norm_topk_prob", False)))
    if arch in ("Glm4MoeForCausalLM", "DeepseekV3ForCausalLM"):
        # DeepSeek-V3's router is GLM-4.5's (transformers DeepseekV3TopkRouter / Glm4MoeTopkRouter)
        if arch == "DeepseekV3ForCausalLM" and not hf.get("n_routed_experts"):
            return None                                    # an all-dense DeepSeek config
        e, k = int(need("n_routed_experts", "num_local_experts")), int(need("num_experts_per_tok"))
        first = int(hf.get("first_k_dense_replace", 1))
        return MoEConfig(
            e, k, ie, layers=tuple(range(first, n)), mtp_moe=True, scoring="sigmoid",
            norm_topk_prob=bool(hf.get("norm_topk_prob", True)), score_bias=True,
            n_group=int(hf.get("n_group") or 1), topk_group=int(hf.get("topk_group") or 1),
            routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
            shared_intermediate_size=ie * int(hf.get("n_shared_experts") or 0))
    # Ernie4_5_MoeForCausalLM
    e, k = int(need("moe_num_experts", "num_experts")), int(need("moe_k", "num_experts_per_tok"))
    start = int(hf.get("moe_layer_start_index", 1))
    end = hf.get("moe_layer_end_index", -1)
    end = n - 1 if end is None or int(end) == -1 else int(end)
    interval = int(hf.get("moe_layer_interval") or 1)
    layers = tuple(i for i in range(n) if (i + 1) % interval == 0 and start <= i <= end)
    return MoEConfig(e, k, ie, layers=layers, scoring="softmax", norm_topk_prob=True,
                     norm_min=float(hf.get("moe_norm_min") or 1e-12), score_bias=True,
                     shared_intermediate_size=ie * int(hf.get("moe_num_shared_experts") or 0))


# ----------------------------------------------------------------------------------------------
# Building the parameter pytree from HF-named tensors
# ----------------------------------------------------------------------------------------------

def deinterleave_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Reorder the output rows of a per-head projection from interleaved RoPE pairs ``(2i, 2i+1)``
    to rotate-half pairs ``(i, i + D/2)``: ``new[h, j*D/2 + i] = old[h, 2i + j]``.

    ``w: f[num_heads*D, ...]`` (torch layout, rows = outputs; also biases ``f[num_heads*D]`` and
    per-head norm weights ``f[D]`` with ``num_heads=1``). The same map undoes llama.cpp's
    ``convert_hf_to_gguf.py`` permutation of ``wq``/``wk`` (its ``permute`` does the inverse),
    matching transformers' ``LlamaTensorProcessor._reverse_permute_weights``.
    """
    rows = w.shape[0]
    if rows % (2 * num_heads):
        raise ValueError(f"cannot de-interleave {rows} rows into {num_heads} heads of even size")
    d2 = rows // num_heads // 2
    return w.reshape(num_heads, d2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class _Reader:
    """Fetches HF-named tensors with shape checks whose errors name the tensor and its file."""

    def __init__(self, src: TensorSource, where: str):
        self.src, self.where, self.names = src, where, src.names()
        self.used: set[str] = set()

    def has(self, name: str) -> bool:
        return name in self.names

    def get(self, name: str, shape: tuple[int, ...] | None = None) -> np.ndarray:
        self.used.add(name)
        if name not in self.names:
            raise ValueError(f"{self.where}: missing tensor {name!r}"
                             + (f" (expected shape {shape})" if shape else ""))
        if shape is not None and tuple(self.src.shape(name)) != tuple(shape):
            raise ValueError(
                f"{self.src.where(name)}: tensor {name!r} has shape {tuple(self.src.shape(name))}, "
                f"expected {tuple(shape)} from the config")
        return self.src.get(name)

    def linear(self, name: str, n_in: int, n_out: int, paddle: bool) -> np.ndarray:
        """``f[in, out]`` from a torch ``[out, in]`` or Paddle ``[in, out]`` weight."""
        if paddle:
            return self.get(name, (n_in, n_out))
        return self.get(name, (n_out, n_in)).T


def _read_swiglu(rd: _Reader, p: str, h: int, i: int, paddle: bool) -> tuple:
    """``(gate f[H, I], up f[H, I], down f[I, H])`` of a SwiGLU under ``p`` (``p + "gate_proj"``
    ... or a fused ``up_gate_proj`` = ``[gate; up]`` along the output axis)."""
    if rd.has(p + "up_gate_proj.weight"):
        w = rd.linear(p + "up_gate_proj.weight", h, 2 * i, paddle)
        gate, up = w[:, :i], w[:, i:]
    else:
        gate = rd.linear(p + "gate_proj.weight", h, i, paddle)
        up = rd.linear(p + "up_proj.weight", h, i, paddle)
    return gate, up, rd.linear(p + "down_proj.weight", i, h, paddle)


def _read_moe(rd: _Reader, p: str, cfg: ModelConfig, paddle: bool) -> dict[str, np.ndarray]:
    """One MoE FFN (:mod:`jmtp.model.moe` names) from the tensors under ``p`` (``...mlp.``)."""
    m, h = cfg.moe, cfg.hidden_size
    e, i = m.num_experts, m.moe_intermediate_size
    out = {"router": rd.linear(p + "gate.weight", h, e, paddle)}
    if m.score_bias:
        for name in ("gate.e_score_correction_bias", "moe_statics.e_score_correction_bias"):
            if rd.has(p + name):
                out["router_bias"] = np.asarray(rd.get(p + name), np.float32).reshape(-1)
                break
        else:
            raise ValueError(f"{rd.where}: missing tensor {p}gate.e_score_correction_bias (or "
                             f"{p}moe_statics.e_score_correction_bias)")
        if out["router_bias"].shape != (e,):
            raise ValueError(f"{rd.where}: {p} score-correction bias has {out['router_bias'].size} "
                             f"entries, expected num_experts = {e}")
    if rd.has(p + "experts.gate_up_proj"):        # transformers v5 in-memory layout
        gu = rd.get(p + "experts.gate_up_proj", (e, 2 * i, h))
        out["experts_gate"] = gu[:, :i].transpose(0, 2, 1)
        out["experts_up"] = gu[:, i:].transpose(0, 2, 1)
        out["experts_down"] = rd.get(p + "experts.down_proj", (e, h, i)).transpose(0, 2, 1)
    else:
        g, u, d = zip(*(_read_swiglu(rd, f"{p}experts.{j}.", h, i, paddle) for j in range(e)))
        out["experts_gate"], out["experts_up"], out["experts_down"] = (np.stack(g), np.stack(u),
                                                                       np.stack(d))
    if m.shared_intermediate_size:
        out["shared_gate"], out["shared_up"], out["shared_down"] = _read_swiglu(
            rd, p + "shared_experts.", h, m.shared_intermediate_size, paddle)
    elif any(n.startswith(p + "shared_experts.") for n in rd.names):
        raise ValueError(f"{rd.where}: checkpoint has {p}shared_experts.* but the config has no "
                         "shared experts")
    return out


def _read_block(rd: _Reader, prefix: str, cfg: ModelConfig, *, paddle: bool,
                interleaved: bool, moe: bool = False) -> dict[str, np.ndarray]:
    """One decoder layer (jmtp names, ``[in, out]`` weights) from HF-named tensors under ``prefix``.

    Accepts split (``q_proj/k_proj/v_proj``, ``gate_proj/up_proj``) or fused (``qkv_proj`` =
    ``[q; k; v]``, ``up_gate_proj`` = ``[gate; up]`` along the output axis) projections. With
    ``moe`` the FFN is read as ``cfg.moe``'s MoE block (:func:`_read_moe`).
    """
    h, i, q, kv, d = cfg.hidden_size, cfg.intermediate_size, cfg.q_size, cfg.kv_size, cfg.head_dim
    p = prefix
    out = {
        "attn_norm": rd.get(p + "input_layernorm.weight", (h,)),
        "mlp_norm": rd.get(p + "post_attention_layernorm.weight", (h,)),
    }
    if cfg.is_mla:
        out.update(_read_mla_attention(rd, p, cfg, interleaved=interleaved))
        out.update(_read_ffn(rd, p, cfg, paddle, moe))
        return out
    if rd.has(p + "self_attn.qkv_proj.weight"):
        w = rd.linear(p + "self_attn.qkv_proj.weight", h, q + 2 * kv, paddle)
        out["wq"], out["wk"], out["wv"] = w[:, :q], w[:, q:q + kv], w[:, q + kv:]
        if rd.has(p + "self_attn.qkv_proj.bias"):
            b = rd.get(p + "self_attn.qkv_proj.bias", (q + 2 * kv,))
            out["bq"], out["bk"], out["bv"] = b[:q], b[q:q + kv], b[q + kv:]
    else:
        out["wq"] = rd.linear(p + "self_attn.q_proj.weight", h, q, paddle)
        out["wk"] = rd.linear(p + "self_attn.k_proj.weight", h, kv, paddle)
        out["wv"] = rd.linear(p + "self_attn.v_proj.weight", h, kv, paddle)
        if rd.has(p + "self_attn.q_proj.bias"):
            out["bq"] = rd.get(p + "self_attn.q_proj.bias", (q,))
            out["bk"] = rd.get(p + "self_attn.k_proj.bias", (kv,))
            out["bv"] = rd.get(p + "self_attn.v_proj.bias", (kv,))
    if cfg.attention_bias and "bq" not in out:
        raise ValueError(f"{rd.where}: config has attention biases but {p}self_attn.q_proj.bias "
                         "is missing")
    if not cfg.attention_bias and "bq" in out:
        raise ValueError(f"{rd.where}: checkpoint has q/k/v biases under {p}self_attn but the "
                         "config has attention_bias = false")
    out["wo"] = rd.linear(p + "self_attn.o_proj.weight", q, h, paddle)
    for extra in ("self_attn.o_proj.bias", "mlp.down_proj.bias", "mlp.gate_proj.bias",
                  "mlp.up_proj.bias", "mlp.up_gate_proj.bias"):
        if rd.has(p + extra):
            raise ValueError(f"{rd.src.where(p + extra)}: tensor {p + extra!r} is not supported "
                             "(jmtp's block has no output/MLP biases)")
    out.update(_read_ffn(rd, p, cfg, paddle, moe))
    if cfg.qk_norm:
        out["q_norm"] = rd.get(p + "self_attn.q_norm.weight", (d,))
        out["k_norm"] = rd.get(p + "self_attn.k_norm.weight", (d,))
    if interleaved:
        out["wq"] = deinterleave_rows(out["wq"].T, cfg.num_heads).T
        out["wk"] = deinterleave_rows(out["wk"].T, cfg.num_kv_heads).T
        if "bq" in out:
            out["bq"] = deinterleave_rows(out["bq"], cfg.num_heads)
            out["bk"] = deinterleave_rows(out["bk"], cfg.num_kv_heads)
        if "q_norm" in out:
            out["q_norm"] = deinterleave_rows(out["q_norm"], 1)
            out["k_norm"] = deinterleave_rows(out["k_norm"], 1)
    return out


def _read_ffn(rd: _Reader, p: str, cfg: ModelConfig, paddle: bool,
              moe: bool) -> dict[str, np.ndarray]:
    """The FFN of the block under ``p``: ``cfg.moe``'s MoE block (:func:`_read_moe`) when
    ``moe``, else the dense SwiGLU ``w_gate, w_up f[H, I]``, ``w_down f[I, H]``."""
    if moe:
        return _read_moe(rd, p + "mlp.", cfg, paddle)
    if rd.has(p + "mlp.gate.weight"):
        raise ValueError(f"{rd.where}: {p}mlp is a MoE block (mlp.gate.weight) but the "
                         "config makes this layer dense")
    out = {}
    out["w_gate"], out["w_up"], out["w_down"] = _read_swiglu(
        rd, p + "mlp.", cfg.hidden_size, cfg.intermediate_size, paddle)
    return out


def _deinterleave_tail(w: np.ndarray, groups: int, tail: int) -> np.ndarray:
    """``w f[groups*(lead+tail), ...]`` (torch rows = outputs) with the last ``tail`` rows of every
    group de-interleaved (:func:`deinterleave_rows` on them, one head)."""
    g = w.reshape(groups, -1, *w.shape[1:]).copy()
    lead = g.shape[1] - tail
    for j in range(groups):
        g[j, lead:] = deinterleave_rows(g[j, lead:], 1)
    return g.reshape(w.shape)


def _read_mla_attention(rd: _Reader, p: str, cfg: ModelConfig, *,
                        interleaved: bool) -> dict[str, np.ndarray]:
    """DeepSeek-V3 MLA tensors under ``p + "self_attn."`` in jmtp names and ``[in, out]`` layout
    (:func:`jmtp.model.mla.layer_shapes`). ``interleaved`` (HF ``rope_interleave``): the rotary
    output rows of the query and ``kv_a_proj_with_mqa`` are de-interleaved per head."""
    h, nq, c = cfg.hidden_size, cfg.num_heads, cfg.kv_lora_rank
    dn, dr, dv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    a = p + "self_attn."
    for extra in ("q_a_proj.bias", "kv_a_proj_with_mqa.bias", "o_proj.bias"):
        if rd.has(a + extra):
            raise ValueError(f"{rd.src.where(a + extra)}: tensor {a + extra!r} is not supported "
                             "(MLA without attention biases only)")
    fix = (lambda w, groups: _deinterleave_tail(w, groups, dr)) if interleaved else (lambda w, g: w)
    out = {}
    if cfg.q_lora_rank is None:
        out["wq"] = fix(rd.get(a + "q_proj.weight", (nq * (dn + dr), h)), nq).T
    else:
        r = cfg.q_lora_rank
        out["wq_a"] = rd.get(a + "q_a_proj.weight", (r, h)).T
        out["q_a_norm"] = rd.get(a + "q_a_layernorm.weight", (r,))
        out["wq_b"] = fix(rd.get(a + "q_b_proj.weight", (nq * (dn + dr), r)), nq).T
    out["wkv_a"] = fix(rd.get(a + "kv_a_proj_with_mqa.weight", (c + dr, h)), 1).T
    out["kv_a_norm"] = rd.get(a + "kv_a_layernorm.weight", (c,))
    out["wkv_b"] = rd.get(a + "kv_b_proj.weight", (nq * (dn + dv), c)).T
    out["wo"] = rd.get(a + "o_proj.weight", (h, nq * dv)).T
    return out


def _stack(blocks: list[dict[str, np.ndarray]], cfg: ModelConfig, dtype,
           moe: bool = False) -> dict[str, jax.Array]:
    """Stack per-layer tensors on a new leading axis, converting once to ``dtype`` (the MoE
    score-correction bias stays f32)."""
    shapes = layer_shapes(cfg, moe)
    out = {}
    for name, shape in shapes.items():
        buf = np.empty((len(blocks),) + shape, np.float32 if name == "router_bias" else dtype)
        for j, b in enumerate(blocks):
            buf[j] = b[name]
        out[name] = jnp.asarray(buf)
    return out


def _np_dtype(dtype) -> np.dtype:
    return np.dtype(jnp.dtype(dtype))


def detect_mtp(names: Iterable[str], num_layers: int, where: str) -> tuple[str | None, list, str]:
    """Find MTP modules among checkpoint tensor names.

    Returns ``(layout, prefixes, extra)``: ``layout`` is ``"deepseek"``, ``"ernie"``, ``"mimo"``
    or ``None``;
    ``prefixes[j]`` the name prefix of module ``j``; ``extra`` the ERNIE top-level prefix
    (``"ernie."`` or ``"model."``).

    Raises:
      ValueError: if two layouts are present or module indices are not contiguous from N (or 0).
    """
    names = list(names)
    mi = sorted({int(m.group(1)) for n in names
                 if (m := re.match(r"model\.mtp_layers\.(\d+)\.", n))})
    ds = sorted({int(m.group(1)) for n in names
                 if (m := re.match(r"model\.layers\.(\d+)\.(enorm|hnorm|eh_proj)\.weight$", n))
                 and int(m.group(1)) >= num_layers})
    er = {}
    for n in names:
        m = re.match(r"(ernie|model)\.mtp_emb_norm\.(\d+)\.weight$", n)
        if m:
            er.setdefault(m.group(1), set()).add(int(m.group(2)))
    found = [k for k, v in (("DeepSeek (model.layers.N.eh_proj)", ds),
                            ("ERNIE (mtp_linear_proj)", er), ("MiMo (model.mtp_layers)", mi)) if v]
    if len(found) > 1:
        raise ValueError(f"{where}: checkpoint holds MTP tensors in both the {found[0]} and the "
                         f"{found[1]} layouts")
    if mi:
        if mi != list(range(len(mi))):
            raise ValueError(f"{where}: MiMo MTP layers model.mtp_layers.{mi} must be numbered "
                             f"0..{len(mi) - 1}")
        return "mimo", [f"model.mtp_layers.{j}." for j in mi], ""
    if ds:
        if ds != list(range(num_layers, num_layers + len(ds))):
            raise ValueError(f"{where}: DeepSeek-style MTP layers {ds} must be numbered "
                             f"{num_layers}..{num_layers + len(ds) - 1} "
                             f"(num_hidden_layers = {num_layers})")
        return "deepseek", [f"model.layers.{k}." for k in ds], ""
    if er:
        if len(er) > 1:
            raise ValueError(f"{where}: ERNIE MTP tensors under both 'ernie.' and 'model.' prefixes")
        (top, idx), = er.items()
        idx = sorted(idx)
        if idx != list(range(len(idx))):
            raise ValueError(f"{where}: ERNIE MTP modules {idx} must be numbered 0..{len(idx) - 1}")
        return "ernie", [str(j) for j in idx], top + "."
    return None, [], ""


def build_params(cfg: ModelConfig, src: TensorSource, where: str, dtype, *,
                 interleaved_rope: bool = False, num_mtp_hint: int = 0) -> tuple[ModelConfig, dict]:
    """Assemble the jmtp parameter pytree (see :mod:`jmtp.model.llama`) from HF-named tensors.

    Args:
      cfg: target config (``num_mtp_layers``/``mtp_layout`` are filled in here).
      src: tensors in HF naming and torch layout (``model.embed_tokens.weight`` ...).
      where: checkpoint path for messages.
      dtype: parameter dtype (e.g. ``jnp.float32``).
      interleaved_rope: the checkpoint's attention uses interleaved RoPE pairs (ERNIE): permute
        q/k rows (:func:`deinterleave_rows`).
      num_mtp_hint: MTP modules announced by the config (the log message; for the MiMo layout it
        must equal the layers found).

    Returns:
      ``(cfg, params)`` with params checked by :func:`jmtp.model.params.check_params`.

    Raises:
      ValueError: naming the tensor and file for a missing tensor or a shape that disagrees with
        the config.
    """
    np_dt = _np_dtype(dtype)
    rd = _Reader(src, where)
    h, v = cfg.hidden_size, cfg.vocab_size
    params: dict = {
        "embed": jnp.asarray(np.asarray(rd.get("model.embed_tokens.weight", (v, h)), np_dt)),
        "final_norm": jnp.asarray(np.asarray(rd.get("model.norm.weight", (h,)), np_dt)),
    }
    if not cfg.tie_word_embeddings:
        params["lm_head"] = jnp.asarray(np.asarray(rd.get("lm_head.weight", (v, h)).T, np_dt))
    kinds = cfg.moe_layer_kinds
    blocks = [_read_block(rd, f"model.layers.{i}.", cfg, paddle=False, interleaved=interleaved_rope,
                          moe=kinds[i]) for i in range(cfg.num_layers)]
    if layers_stacked(cfg):
        params["layers"] = _stack(blocks, cfg, np_dt, kinds[0])
    else:   # dense and MoE layers mixed: one dict per layer (jmtp.model.params.layers_stacked)
        params["layers"] = tuple(
            {k: jnp.asarray(np.asarray(b[k], np.float32 if k == "router_bias" else np_dt))
             for k in layer_shapes(cfg, m)} for b, m in zip(blocks, kinds))
    del blocks

    layout, prefixes, top = detect_mtp(rd.names, cfg.num_layers, where)
    if layout is None:
        cfg = mtp_moe_of_fresh_head(cfg.replace(num_mtp_layers=1))
        params["mtp"] = init_mtp_params(cfg, params, jax.random.PRNGKey(0), jnp.dtype(dtype))
        log.info("no MTP weights in %s: initialised a fresh MTP head%s", where,
                 f" (config announces {num_mtp_hint} MTP layers)" if num_mtp_hint else "")
    else:
        n = len(prefixes)
        if layout == "mimo" and num_mtp_hint and n != num_mtp_hint:
            raise ValueError(f"{where}: config field 'num_nextn_predict_layers' = {num_mtp_hint} "
                             f"but the checkpoint holds MiMo MTP layers model.mtp_layers.0..{n - 1}"
                             + (f" (missing tensors under 'model.mtp_layers.{n}.')"
                                if num_mtp_hint > n else ""))
        cfg = cfg.replace(num_mtp_layers=n, mtp_layout=layout)
        block_prefix = [f"{top}mtp_block.{p}." if layout == "ernie" else p for p in prefixes]
        mtp_kinds = {rd.has(bp + "mlp.gate.weight") for bp in block_prefix}
        if len(mtp_kinds) > 1:
            raise ValueError(f"{where}: some MTP blocks are MoE (mlp.gate.weight) and some dense")
        mtp_moe = mtp_kinds.pop()
        if mtp_moe and cfg.moe is None:
            raise ValueError(f"{where}: the MTP block {block_prefix[0]}mlp is a MoE block but the "
                             "target config is dense")
        if cfg.moe is not None:
            cfg = cfg.replace(moe=cfg.moe.replace(mtp_moe=mtp_moe))
        enorm, hnorm, eh, fnorm, mblocks = [], [], [], [], []
        for j, p in enumerate(prefixes):
            if layout == "deepseek":
                enorm.append(rd.get(p + "enorm.weight", (h,)))
                hnorm.append(rd.get(p + "hnorm.weight", (h,)))
                eh.append(rd.linear(p + "eh_proj.weight", 2 * h, h, paddle=False))
                fnorm.append(rd.get(p + "shared_head.norm.weight", (h,)))
                mblocks.append(_read_block(rd, p, cfg, paddle=False, interleaved=interleaved_rope,
                                           moe=mtp_moe))
            elif layout == "mimo":
                enorm.append(rd.get(p + "token_layernorm.weight", (h,)))
                hnorm.append(rd.get(p + "hidden_layernorm.weight", (h,)))
                w = rd.linear(p + "input_proj.weight", 2 * h, h, paddle=False)  # f[2H, H]
                eh.append(np.concatenate([w[h:], w[:h]]))   # [hidden; embed] -> [embed; hidden]
                fnorm.append(rd.get(p + "final_layernorm.weight", (h,)))
                mblocks.append(_read_block(rd, p, cfg, paddle=False, interleaved=interleaved_rope,
                                           moe=mtp_moe))
            else:
                proj = f"{top}mtp_linear_proj.{p}.weight"
                shape = tuple(src.shape(proj)) if rd.has(proj) else None
                if shape == (2 * h, h):
                    paddle = True
                elif shape == (h, 2 * h):
                    paddle = False
                else:
                    raise ValueError(f"{where}: tensor {proj!r} has shape {shape}, expected "
                                     f"{(2 * h, h)} (Paddle in→out) or {(h, 2 * h)} (torch out×in)")
                enorm.append(rd.get(f"{top}mtp_emb_norm.{p}.weight", (h,)))
                hnorm.append(rd.get(f"{top}mtp_hidden_norm.{p}.weight", (h,)))
                eh.append(rd.linear(proj, 2 * h, h, paddle))
                fnorm.append(np.asarray(params["final_norm"], np.float32))
                mblocks.append(_read_block(rd, f"{top}mtp_block.{p}.", cfg, paddle=paddle,
                                           interleaved=interleaved_rope, moe=mtp_moe))
        as_stack = lambda xs: jnp.asarray(np.stack([np.asarray(x, np_dt) for x in xs]))
        params["mtp"] = {"enorm": as_stack(enorm), "hnorm": as_stack(hnorm), "eh_proj": as_stack(eh),
                         "final_norm": as_stack(fnorm),
                         "layer": _stack(mblocks, cfg, np_dt, mtp_moe)}
        log.info("loaded %d MTP module(s) (%s layout) from %s", n, layout, where)
    check_params(cfg, params, source=where)
    unused = sorted(name for name in rd.names - rd.used if not _IGNORED.search(name)
                    and not (cfg.tie_word_embeddings and name == "lm_head.weight"))
    if unused:
        log.warning("%s: %d checkpoint tensor(s) not used, e.g. %s", where, len(unused),
                    ", ".join(unused[:5]))
    return cfg, params


# Tensors a checkpoint may carry that jmtp derives or aliases instead of loading.
_IGNORED = re.compile(r"rotary_emb\.inv_freq$|_scale_inv$|\.(embed_tokens|shared_head\.head)\.weight$"
                      r"|^rope_freqs\.weight$")


def load_hf(path: str | os.PathLike, dtype) -> tuple[ModelConfig, dict]:
    """Load a transformers checkpoint directory. See the module docstring for what is supported.

    Raises:
      ValueError: if ``config.json`` is missing or unreadable, the architecture is unknown, or a
        tensor is missing / mis-shaped / of an unsupported dtype (message names the field/tensor).
    """
    d = Path(path)
    cfg_path = d / "config.json"
    if not cfg_path.is_file():
        raise ValueError(f"{d}: not a checkpoint directory (missing config.json)")
    try:
        hf = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{cfg_path}: invalid JSON ({e})") from None
    gen_path = d / "generation_config.json"
    gen = json.loads(gen_path.read_text()) if gen_path.is_file() else None
    cfg = hf_config(hf, str(cfg_path), gen)
    block = (hf.get("quantization_config") or {}).get("weight_block_size")
    src = SafetensorsSource(d, weight_block_size=tuple(int(b) for b in block) if block else None)
    interleaved = cfg.architecture in INTERLEAVED_ROPE_ARCHITECTURES or (
        cfg.architecture in MLA_ARCHITECTURES and hf.get("rope_interleave", True))
    return build_params(cfg, src, str(d), dtype, interleaved_rope=bool(interleaved),
                        num_mtp_hint=int(hf.get("num_nextn_predict_layers") or 0))
