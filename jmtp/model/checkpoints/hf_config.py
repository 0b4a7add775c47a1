"""transformers ``config.json`` → :class:`ModelConfig`, driven by one table of architectures.

:data:`ARCHITECTURES` maps ``config.json`` ``architectures[0]`` to an :class:`HFArchitecture` row:
how its config fields map onto :class:`ModelConfig` (defaults transformers' config classes use when
a field is absent, features read from config fields, the MoE reader), and what the tensor reader
must know of it (interleaved RoPE rows). Every architecture uses transformers' Llama tensor names
(:mod:`jmtp.model.checkpoints.hf_blocks`); MTP tensors are found by their names, whatever the architecture
(:data:`jmtp.model.checkpoints.hf_loader.MTP_LAYOUTS`). Adding an architecture is a row here plus, only when
its config has a new shape, one reader function (a MoE reader such as :func:`_ernie_moe`).

The rows (transformers ``models/<name>/configuration_<name>.py`` and ``modeling_<name>.py``):

* ``LlamaForCausalLM`` (Llama 2/3, SmolLM2; optional ``attention_bias``; llama3 ``rope_scaling``),
* ``MistralForCausalLM`` without sliding window (same tensors as Llama),
* ``Qwen2ForCausalLM`` (q/k/v biases: Qwen2Attention's projections always carry them),
* ``MiMoForCausalLM`` (Xiaomi MiMo-7B, ``model_type: mimo``): a Qwen2 decoder (q/k/v biases)
  plus ``num_nextn_predict_layers`` MTP layers ``model.mtp_layers.{j}`` (the ``mimo`` MTP layout),
* ``Qwen3ForCausalLM`` (per-head ``q_norm``/``k_norm``, ``head_dim`` from the config),
* ``Ernie4_5ForCausalLM`` (dense ERNIE-4.5). ERNIE applies RoPE to *interleaved* pairs
  ``(2i, 2i+1)`` (transformers ``models/ernie4_5/modeling_ernie4_5.py``: ``rotate_half`` on
  ``x[..., 0::2] / x[..., 1::2]`` and ``repeat_interleave``d cos/sin), while jmtp uses the
  ``rotate_half`` layout on pairs ``(i, i + D/2)``. Attention scores are invariant under one
  permutation of the head dimension applied to both q and k, so the loader permutes the output
  rows of ``q_proj``/``k_proj`` (and their biases / q-k norms) per head with
  :func:`~jmtp.model.checkpoints.hf_blocks.deinterleave_rows`, after which the standard forward is exact.
  Embeddings are tied unless the config says otherwise.
* ``DeepseekV3ForCausalLM`` (multi-head latent attention, :mod:`jmtp.model.mla`; tensors
  ``self_attn.{q_a_proj,q_a_layernorm,q_b_proj | q_proj, kv_a_proj_with_mqa,kv_a_layernorm,
  kv_b_proj,o_proj}``). With ``rope_interleave`` (the default) the rotary columns of ``q_b_proj``
  (per head) and ``kv_a_proj_with_mqa`` are de-interleaved like ERNIE's. YaRN rope scaling
  (``rope_type: yarn``, DeepSeek-V3's own; any architecture) is supported. Block-scaled FP8
  checkpoints of any of these architectures (``F8_E4M3`` weights with ``<name>_scale_inv`` f32
  scales per ``weight_block_size`` block, ``quantization_config``; 128x128 in DeepSeek-V3) load
  8-bit (:mod:`jmtp.model.checkpoints.fp8_checkpoint`, :mod:`jmtp.model.quant`).
* Mixture-of-experts targets (:mod:`jmtp.model.moe`; ``ModelConfig.moe``):

  - ``Qwen3MoeForCausalLM``: softmax router, ``norm_topk_prob``, no shared experts; MoE layers
    are those not in ``mlp_only_layers`` with ``(i + 1) % decoder_sparse_step == 0``; q/k-norm.
  - ``Glm4MoeForCausalLM`` (GLM-4.5): sigmoid router with ``e_score_correction_bias``, grouped
    top-k, ``routed_scaling_factor``, ``n_shared_experts``; the first ``first_k_dense_replace``
    layers dense; attention with ``partial_rotary_factor`` (default 0.5), ``attention_bias``,
    ``use_qk_norm`` (transformers ``modeling_glm4_moe.py``). DeepSeek-V3's router is the same.
  - ``Ernie4_5_MoeForCausalLM``: softmax router, ``moe_statics.e_score_correction_bias`` for the
    choice, renormalised by ``max(sum, moe_norm_min)``, ``moe_num_shared_experts``; MoE layers
    ``moe_layer_start_index <= i <= moe_layer_end_index`` with ``(i + 1) % moe_layer_interval ==
    0``; interleaved RoPE as dense ERNIE-4.5.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

from jmtp.model.config import ModelConfig, MoEConfig, RopeScaling


@dataclasses.dataclass(frozen=True)
class ConfigFlag:
    """A feature read from a ``config.json`` field: ``bool(hf.get(field, default))``."""

    field: str
    default: bool

    def of(self, hf: dict) -> bool:
        return bool(hf.get(self.field, self.default))


def _flag(value: bool | ConfigFlag, hf: dict) -> bool:
    return value.of(hf) if isinstance(value, ConfigFlag) else bool(value)


#: ``(hf, need, num_layers, moe_intermediate_size) -> MoEConfig | None``: a MoE architecture's
#: routing from its ``config.json`` (``need(*keys)`` returns the first present key's value, else
#: raises ValueError naming the first key).
MoEReader = Callable[[dict, Callable, int, int], "MoEConfig | None"]


@dataclasses.dataclass(frozen=True)
class HFArchitecture:
    """One supported transformers architecture (a row of :data:`ARCHITECTURES`).

    Attributes:
      name: ``config.json`` ``architectures[0]`` (also ``ModelConfig.architecture``).
      attention_bias: q/k/v biases: the ``attention_bias`` field, whose default differs (Qwen2's
        attention always has them).
      qk_norm: per-head ``self_attn.{q,k}_norm`` (always, or from a config field).
      interleaved_rope: the checkpoint's q/k rows rotate interleaved pairs ``(2i, 2i+1)``: the
        loader de-interleaves them (always, or from a config field).
      tie_word_embeddings: the tie when ``config.json`` has no (or a null) ``tie_word_embeddings``.
      partial_rotary: the default ``partial_rotary_factor`` of an architecture whose RoPE may rotate
        part of a head; None: the field must be absent or 1.
      sliding_window_fields: config fields that, when truthy, ask for sliding-window attention
        (refused).
      mla: multi-head latent attention (:func:`_mla_config` reads its widths).
      moe: the MoE reader (None: a dense architecture).
    """

    name: str
    attention_bias: bool | ConfigFlag = ConfigFlag("attention_bias", False)
    qk_norm: bool | ConfigFlag = False
    interleaved_rope: bool | ConfigFlag = False
    tie_word_embeddings: bool = False
    partial_rotary: float | None = None
    sliding_window_fields: tuple[str, ...] = ("use_sliding_window",)
    mla: bool = False
    moe: MoEReader | None = None

    def uses_interleaved_rope(self, hf: dict) -> bool:
        return _flag(self.interleaved_rope, hf)


# ----------------------------------------------------------------------------------------------
# MoE readers (one per routing family)
# ----------------------------------------------------------------------------------------------

def _qwen3_moe(hf: dict, need, n: int, ie: int) -> MoEConfig:
    e, k = int(need("num_experts", "num_local_experts")), int(need("num_experts_per_tok"))
    step = int(hf.get("decoder_sparse_step") or 1)
    dense = set(hf.get("mlp_only_layers") or ())
    layers = tuple(i for i in range(n) if i not in dense and e > 0 and (i + 1) % step == 0)
    return MoEConfig(e, k, ie, layers=layers, scoring="softmax",
                     norm_topk_prob=bool(hf.get("norm_topk_prob", False)))


def _glm4_moe(hf: dict, need, n: int, ie: int) -> MoEConfig:
    # DeepSeek-V3's router is GLM-4.5's (transformers DeepseekV3TopkRouter / Glm4MoeTopkRouter)
    e, k = int(need("n_routed_experts", "num_local_experts")), int(need("num_experts_per_tok"))
    first = int(hf.get("first_k_dense_replace", 1))
    return MoEConfig(
        e, k, ie, layers=tuple(range(first, n)), mtp_moe=True, scoring="sigmoid",
        norm_topk_prob=bool(hf.get("norm_topk_prob", True)), score_bias=True,
        n_group=int(hf.get("n_group") or 1), topk_group=int(hf.get("topk_group") or 1),
        routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
        shared_intermediate_size=ie * int(hf.get("n_shared_experts") or 0))


def _deepseek_v3_moe(hf: dict, need, n: int, ie: int) -> MoEConfig | None:
    if not hf.get("n_routed_experts"):
        return None                                    # an all-dense DeepSeek config
    return _glm4_moe(hf, need, n, ie)


def _ernie_moe(hf: dict, need, n: int, ie: int) -> MoEConfig:
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
# The table
# ----------------------------------------------------------------------------------------------

_QWEN2_BIAS = ConfigFlag("attention_bias", True)   # Qwen2Attention's q/k/v always carry biases

ARCHITECTURES: dict[str, HFArchitecture] = {a.name: a for a in (
    HFArchitecture("LlamaForCausalLM"),
    HFArchitecture("MistralForCausalLM",
                   sliding_window_fields=("use_sliding_window", "sliding_window")),
    HFArchitecture("Qwen2ForCausalLM", attention_bias=_QWEN2_BIAS),
    HFArchitecture("Qwen3ForCausalLM", qk_norm=True),
    HFArchitecture("Ernie4_5ForCausalLM", interleaved_rope=True, tie_word_embeddings=True),
    HFArchitecture("Qwen3MoeForCausalLM", qk_norm=True, moe=_qwen3_moe),
    HFArchitecture("Ernie4_5_MoeForCausalLM", interleaved_rope=True, tie_word_embeddings=True,
                   moe=_ernie_moe),
    HFArchitecture("Glm4MoeForCausalLM", qk_norm=ConfigFlag("use_qk_norm", False),
                   partial_rotary=0.5, moe=_glm4_moe),   # transformers' Glm4MoeConfig default
    HFArchitecture("DeepseekV3ForCausalLM", mla=True,
                   interleaved_rope=ConfigFlag("rope_interleave", True), moe=_deepseek_v3_moe),
    HFArchitecture("MiMoForCausalLM", attention_bias=_QWEN2_BIAS),   # MiMo's decoder is Qwen2's
)}
#: The hybrid gated-DeltaNet family, loaded by :mod:`jmtp.model.checkpoints.hf_qwen3_next`.
HYBRID_ARCHITECTURES = ("Qwen3NextForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM",
                        "Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration")
SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES) + HYBRID_ARCHITECTURES


def architecture(hf: dict, where: str) -> HFArchitecture:
    """The row of ``config.json``'s ``architectures[0]``.

    Raises:
      ValueError: naming the field, for an architecture not in :data:`ARCHITECTURES`.
    """
    archs = hf.get("architectures") or []
    arch = archs[0] if archs else None
    row = ARCHITECTURES.get(arch) if isinstance(arch, str) else None
    if row is None:
        raise ValueError(
            f"{where}: unknown architecture {arch!r} (field 'architectures'); supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    return row


# ----------------------------------------------------------------------------------------------
# config.json -> ModelConfig
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
    row = architecture(hf, where)
    arch = row.name

    def need(key):
        if hf.get(key) is None:
            raise ValueError(f"{where}: missing required field {key!r}")
        return hf[key]

    h, nq = int(need("hidden_size")), int(need("num_attention_heads"))
    nkv = int(hf.get("num_key_value_heads") or nq)
    head_dim = int(hf.get("head_dim") or h // nq)
    if any(hf.get(k) for k in row.sliding_window_fields):
        raise ValueError(f"{where}: sliding-window attention (field 'use_sliding_window'/"
                         "'sliding_window') is not supported")
    if hf.get("mlp_bias"):
        raise ValueError(f"{where}: field 'mlp_bias' = true is not supported")
    if hf.get("use_bias"):
        raise ValueError(f"{where}: field 'use_bias' = true (biases on every Linear) is not supported")
    prf = (hf.get("rope_parameters") or {}).get("partial_rotary_factor",
                                                hf.get("partial_rotary_factor"))
    if row.partial_rotary is not None:
        prf = row.partial_rotary if prf is None else float(prf)
    elif prf is not None and float(prf) != 1.0:
        raise ValueError(f"{where}: field 'partial_rotary_factor' != 1 is not supported for "
                         f"{arch} (only GLM-4.5's partial rotary is)")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{where}: field 'hidden_act' = {hf.get('hidden_act')!r}; only 'silu' "
                         "(SwiGLU) is supported")
    mla_fields = {}
    if row.mla:
        mla_fields = _mla_config(hf, where, need)
        head_dim = mla_fields["qk_rope_head_dim"]
    theta, scaling = _rope_params(hf, where, allow_yarn=True)
    gen = generation_config or {}
    tie = hf.get("tie_word_embeddings")
    if tie is None:  # transformers' per-model defaults
        tie = row.tie_word_embeddings
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
        attention_bias=_flag(row.attention_bias, hf),
        qk_norm=_flag(row.qk_norm, hf),
        partial_rotary_factor=1.0 if prf is None else float(prf),
        moe=_moe_config(hf, row, where),
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


def _moe_config(hf: dict, row: HFArchitecture, where: str) -> MoEConfig | None:
    """:class:`MoEConfig` of a MoE architecture's config.json by its row's reader (None for dense
    ones); the MTP FFN kind (``mtp_moe``) is set later from the checkpoint's tensors."""
    if row.moe is None:
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
    return row.moe(hf, need, n, ie)
