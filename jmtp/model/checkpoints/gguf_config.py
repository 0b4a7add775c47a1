"""GGUF metadata (llama.cpp) → :class:`ModelConfig`.

Facts used (GGUF spec in ggml's ``docs/gguf.md``; llama.cpp ``convert_hf_to_gguf.py`` and its
per-architecture graphs ``src/models/*.cpp``; transformers ``modeling_gguf_pytorch_utils.py``):

* hyper-parameters live under ``{arch}.*`` keys (``context_length``, ``embedding_length``,
  ``block_count``, ``feed_forward_length``, ``attention.head_count(_kv)``,
  ``attention.key_length``, ``rope.freq_base``, ``attention.layer_norm_rms_epsilon``,
  ``rope.dimension_count``, ``rope.scaling.*``, ``vocab_size``); Llama-3 style rope scaling is
  stored as a ``rope_freqs.weight`` tensor of per-frequency divisors, matched here against the
  llama3 formula;
* a missing ``output.weight`` means the LM head is tied to ``token_embd.weight``; q/k biases and
  q/k norms are read off the first layer's tensors;
* mixture-of-experts architectures (``qwen3moe``, ``deepseek2``, ``glm4moe``, ``ernie4_5-moe``):
  hyper-parameters ``expert_count``, ``expert_used_count``, ``expert_feed_forward_length``,
  ``expert_shared_count``, ``expert_shared_feed_forward_length``, ``leading_dense_block_count``,
  ``interleave_moe_layer_step``, ``expert_weights_scale``, ``expert_weights_norm``,
  ``expert_gating_func`` (1 softmax, 2 sigmoid), ``expert_group_count``,
  ``expert_group_used_count``. Routing rules the file does not store are those of llama.cpp's
  per-architecture graph, listed in :func:`_moe_config`;
* ``deepseek2`` (DeepSeek-V3) multi-head latent attention: keys ``attention.q_lora_rank``,
  ``attention.kv_lora_rank``, ``attention.key_length_mla`` / ``value_length_mla`` (older files:
  ``key_length`` / ``value_length``), ``rope.dimension_count`` (the rotary width);
  ``head_count_kv`` (1: MLA run as MQA) is ignored. YaRN: ``rope.scaling.{type = yarn, factor,
  original_context_length, yarn_beta_fast, yarn_beta_slow, yarn_log_multiplier}`` (see
  :func:`_deepseek2_yarn`);
* ``glm4moe``: ``block_count`` includes the ``nextn_predict_layers`` NextN (MTP) layers; partial
  rotary (``rope.dimension_count`` < head dim).
* the hybrid gated-DeltaNet family ``qwen3next`` (Qwen3-Next), ``qwen35`` (Qwen3.5) and
  ``qwen35moe`` (Qwen3.5-MoE): :func:`hybrid_gguf_config` (``ssm.*`` keys for the linear layers,
  ``attention.recurrent_layers`` / ``full_attention_interval`` for the layer pattern,
  ``nextn_predict_layers`` MTP layers counted in ``block_count``, llama.cpp's MoE rules).

The tensors themselves are read by :mod:`jmtp.model.checkpoints.gguf_loader`.
"""
from __future__ import annotations

import math
import re
from typing import Any

import numpy as np

from jmtp.model.config import LinearAttentionConfig, ModelConfig, MoEConfig, RopeScaling

#: GGUF tensor types the loaders read (dequantized to fp32 on the host, then cast).
SUPPORTED_GGUF_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K",
                        "Q3_K", "Q4_K", "Q5_K", "Q6_K")
#: Tensors a GGUF file may hold that no jmtp parameter takes (not reported as unused).
GGUF_IGNORED = re.compile(
    r"^rope_freqs\.weight$|\.nextn\.(embed_tokens|shared_head_head)\.weight$")

# GGUF general.architecture -> (HF architecture, llama.cpp permuted q/k rows)
GGUF_ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", True),
    "qwen2": ("Qwen2ForCausalLM", False),
    "qwen3": ("Qwen3ForCausalLM", False),
    "qwen3moe": ("Qwen3MoeForCausalLM", False),
    "deepseek2": ("DeepseekV3ForCausalLM", False),
    "glm4moe": ("Glm4MoeForCausalLM", False),
    "ernie4_5-moe": ("Ernie4_5_MoeForCausalLM", False),
    "qwen3next": ("Qwen3NextForCausalLM", False),
    "qwen35": ("Qwen3_5ForCausalLM", False),
    "qwen35moe": ("Qwen3_5MoeForCausalLM", False),
}
# The hybrid gated-DeltaNet architectures (hybrid_gguf_config; tensors read by
# jmtp.model.checkpoints.gguf_hybrid.HybridGGUFSource into jmtp.model.checkpoints.hf_qwen3_next's builder), and those of
# them whose every layer is MoE with a gated shared expert.
HYBRID_GGUF_ARCHITECTURES = ("qwen3next", "qwen35", "qwen35moe")
HYBRID_MOE_GGUF_ARCHITECTURES = ("qwen3next", "qwen35moe")
MOE_GGUF_ARCHITECTURES = ("qwen3moe", "deepseek2", "glm4moe", "ernie4_5-moe")
# architectures whose RoPE may rotate only the first rope.dimension_count dims of a head
PARTIAL_ROTARY_GGUF_ARCHITECTURES = ("glm4moe",)
# Metadata arrays read only on demand (large): see jmtp.model.checkpoints.gguf_loader.gguf_array().
_LAZY_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type",
                "tokenizer.ggml.scores")


def gguf_metadata(reader) -> dict[str, Any]:
    """Scalar and small-array metadata ``{key: value}`` (tokenizer vocab arrays excluded; see
    :func:`jmtp.model.checkpoints.gguf_loader.gguf_array`)."""
    out = {}
    for key, field in reader.fields.items():
        if key in _LAZY_ARRAYS or key.startswith("GGUF."):
            continue
        out[key] = field.contents()
    return out


def _rope_scaling_from_freqs(freqs: np.ndarray, theta: float, head_dim: int, where: str) -> RopeScaling:
    """Recover llama3 :class:`RopeScaling` from llama.cpp's ``rope_freqs.weight`` (the divisor of
    every inverse frequency). ``factor`` is the largest divisor; the band edges and original
    context are searched among the values Llama 3.x releases use."""
    freqs = np.asarray(freqs, np.float64)
    if np.allclose(freqs, 1.0):
        return None
    inv = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    factor = float(freqs.max())
    for orig in (8192, 4096, 2048, 16384, 32768, 131072):
        for low, high in ((1.0, 4.0), (1.0, 2.0), (2.0, 4.0), (1.0, 8.0)):
            wl = 2 * math.pi / inv
            smooth = (orig / wl - low) / (high - low)
            div = np.where(wl < orig / high, 1.0,
                           np.where(wl > orig / low, factor, 1.0 / ((1 - smooth) / factor + smooth)))
            if np.allclose(div, freqs, rtol=1e-4, atol=1e-5):
                return RopeScaling(factor, low, high, orig)
    raise ValueError(f"{where}: tensor 'rope_freqs.weight' holds frequency factors that do not "
                     "follow the llama3 rope-scaling formula; unsupported")


def gguf_config(reader, where: str) -> tuple[ModelConfig, bool]:
    """``(ModelConfig, permuted_qk)`` from GGUF metadata.

    Raises:
      ValueError: naming the key for an unknown ``general.architecture``, a missing hyper-parameter,
        partial rotary (``rope.dimension_count != head_dim``) or an unsupported rope scaling type.
    """
    meta = gguf_metadata(reader)
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"{where}: unknown architecture {arch!r} (field general.architecture); "
                         f"supported: {', '.join(GGUF_ARCHITECTURES)}")
    hf_arch, permuted = GGUF_ARCHITECTURES[arch]
    if arch in HYBRID_GGUF_ARCHITECTURES:
        return hybrid_gguf_config(reader, meta, where), permuted
    names = {t.name for t in reader.tensors}

    def need(key):
        k = f"{arch}.{key}"
        if k not in meta:
            raise ValueError(f"{where}: missing metadata field {k!r}")
        return meta[k]

    h = int(need("embedding_length"))
    nq = int(need("attention.head_count"))
    nkv = int(meta.get(f"{arch}.attention.head_count_kv", nq))
    mla = _mla_fields(meta, arch, need, where) if arch == "deepseek2" else {}
    if mla:
        nkv = nq    # llama.cpp writes head_count_kv = 1 (MLA run as MQA); jmtp's config is HF's
        head_dim = mla["qk_rope_head_dim"]
    else:
        head_dim = int(meta.get(f"{arch}.attention.key_length", h // nq))
    rot = int(meta.get(f"{arch}.rope.dimension_count", head_dim))
    if rot != head_dim and not (arch in PARTIAL_ROTARY_GGUF_ARCHITECTURES and 0 < rot < head_dim):
        raise ValueError(f"{where}: field {arch}.rope.dimension_count = {rot} != head_dim "
                         f"{head_dim}: partial rotary embeddings are not supported")
    theta = float(meta.get(f"{arch}.rope.freq_base", 10000.0))
    stype = meta.get(f"{arch}.rope.scaling.type", "none")
    scaling = None
    if stype == "yarn" and arch == "deepseek2":
        scaling = _deepseek2_yarn(meta, arch, need)
    elif stype not in ("none", None) and float(meta.get(f"{arch}.rope.scaling.factor", 1.0)) != 1.0:
        raise ValueError(f"{where}: field {arch}.rope.scaling.type = {stype!r} is not supported "
                         "(only llama3 scaling via rope_freqs.weight, and yarn for deepseek2)")
    if "rope_freqs.weight" in names:
        t = next(t for t in reader.tensors if t.name == "rope_freqs.weight")
        scaling = _rope_scaling_from_freqs(np.asarray(t.data, np.float32).reshape(-1), theta,
                                           head_dim, where)
    embd = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embd is None:
        raise ValueError(f"{where}: missing tensor 'token_embd.weight'")
    vocab = int(meta.get(f"{arch}.vocab_size", int(embd.shape[1])))
    eos = [meta[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                             "tokenizer.ggml.eom_token_id") if k in meta]
    nextn = int(meta.get(f"{arch}.nextn_predict_layers", 0) or 0)
    num_layers = int(need("block_count")) - nextn     # block_count includes the NextN layers
    if num_layers < 1:
        raise ValueError(f"{where}: field {arch}.block_count = {num_layers + nextn} leaves no "
                         f"target layer after {arch}.nextn_predict_layers = {nextn}")
    cfg = ModelConfig(
        architecture=hf_arch,
        vocab_size=vocab,
        hidden_size=h,
        intermediate_size=int(meta.get(f"{arch}.feed_forward_length") or (
            need("expert_feed_forward_length") if arch in MOE_GGUF_ARCHITECTURES
            else need("feed_forward_length"))),
        num_layers=num_layers,
        num_heads=nq,
        num_kv_heads=nkv,
        head_dim=head_dim,
        rms_norm_eps=float(meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=theta,
        rope_scaling=scaling,
        partial_rotary_factor=rot / head_dim,
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        qk_norm="blk.0.attn_q_norm.weight" in names,
        max_position_embeddings=int(meta.get(f"{arch}.context_length", 2048)),
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(int(e) for e in eos)),
        moe=_moe_config(meta, arch, num_layers, need, where, names),
        **mla,
    )
    return cfg, permuted


def _mla_fields(meta: dict, arch: str, need, where: str) -> dict:
    """ModelConfig MLA fields from deepseek2 metadata: ``attention.q_lora_rank`` (absent = one
    ``attn_q``), ``attention.kv_lora_rank``, ``rope.dimension_count`` (qk_rope_head_dim),
    ``attention.key_length_mla`` / ``value_length_mla`` (per-head q/k and v widths; files written
    before those keys existed hold them in ``key_length`` / ``value_length``)."""
    dr = int(need("rope.dimension_count"))
    if f"{arch}.attention.key_length_mla" in meta:
        dk, dv = int(need("attention.key_length_mla")), int(need("attention.value_length_mla"))
    else:
        dk, dv = int(need("attention.key_length")), int(need("attention.value_length"))
    if dk <= dr:
        raise ValueError(f"{where}: field {arch}.attention.key_length_mla = {dk} must exceed "
                         f"{arch}.rope.dimension_count = {dr} (no non-rotary query part)")
    q_lora = int(meta.get(f"{arch}.attention.q_lora_rank", 0) or 0)
    return dict(attention_type="mla", q_lora_rank=q_lora or None,
                kv_lora_rank=int(need("attention.kv_lora_rank")), qk_nope_head_dim=dk - dr,
                qk_rope_head_dim=dr, v_head_dim=dv)


def _deepseek2_yarn(meta: dict, arch: str, need) -> RopeScaling:
    """DeepSeek's YaRN from ``rope.scaling.{factor, original_context_length, yarn_beta_fast,
    yarn_beta_slow, yarn_log_multiplier, yarn_attn_factor}``. llama.cpp's converter stores
    ``0.1 · mscale_all_dim`` as ``yarn_log_multiplier`` and does not store ``mscale``; it is taken
    equal to ``mscale_all_dim`` (DeepSeek-V3/R1 ship 1.0 for both; then transformers' cos/sin
    factor ``get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)`` is 1)."""
    p = f"{arch}.rope.scaling."
    # llama.cpp undoes the 0.1 in f32 ("rope_yarn_log_mul /= 0.1f"): 1.0 comes back as exactly 1.0
    m_all = float(np.float32(meta.get(p + "yarn_log_multiplier", 0.0)) / np.float32(0.1))
    attn = meta.get(p + "yarn_attn_factor")
    return RopeScaling(
        factor=float(need("rope.scaling.factor")), low_freq_factor=0.0, high_freq_factor=0.0,
        original_max_position_embeddings=int(need("rope.scaling.original_context_length")),
        rope_type="yarn", beta_fast=float(meta.get(p + "yarn_beta_fast", 32.0)),
        beta_slow=float(meta.get(p + "yarn_beta_slow", 1.0)), mscale=m_all, mscale_all_dim=m_all,
        attention_factor=None if attn is None else float(attn))


def _moe_config(meta: dict, arch: str, num_layers: int, need, where: str,
                names: set[str]) -> MoEConfig | None:
    """:class:`MoEConfig` from ``{arch}.expert_*`` metadata (None for dense architectures), with
    llama.cpp's per-architecture rules for what the file does not say:

    * ``qwen3moe``: every layer MoE, softmax router, top-k weights renormalised (the graph passes
      ``norm_w = true``; the converter writes no ``expert_weights_norm``), no shared experts.
      transformers' ``norm_topk_prob = false`` / ``mlp_only_layers`` / ``decoder_sparse_step``
      are not representable.
    * ``deepseek2`` / ``glm4moe``: layers from ``leading_dense_block_count`` on are MoE; sigmoid
      router (``expert_gating_func`` 2; absent = softmax for deepseek2, i.e. DeepSeek-V2, which
      is refused; sigmoid for glm4moe), ``exp_probs_b`` for the choice only, grouped top-k by the
      sum of each group's top-2 scores, ``expert_weights_norm`` (absent = false),
      ``expert_weights_scale`` (absent = 1), ``expert_shared_count`` shared experts of
      ``expert_feed_forward_length`` each.
    * ``ernie4_5-moe``: layer i is MoE iff ``i >= leading_dense_block_count`` and ``(i + 1) %
      interleave_moe_layer_step == 0`` (HF's ``moe_layer_end_index`` is not stored); softmax
      router, ``exp_probs_b`` for the choice, renormalised; shared experts of
      ``expert_shared_feed_forward_length``.

    Raises:
      ValueError: naming the field for a missing key, ``expert_used_count`` outside
        ``[1, expert_count]``, an unsupported gating function or shared experts on qwen3moe.
    """
    if arch not in MOE_GGUF_ARCHITECTURES:
        return None
    if arch == "ernie4_5-moe":
        # llama.cpp's ernie4-5-moe graph: MoE iff i >= leading_dense_block_count and
        # (i + 1) % interleave_moe_layer_step == 0 (HF's moe_layer_end_index is not stored: the
        # MoE layers run to the end); softmax router, exp_probs_b for the choice only, top-k
        # weights renormalised; shared experts of width expert_shared_feed_forward_length.
        e, k = int(need("expert_count")), int(need("expert_used_count"))
        if not 1 <= k <= e:
            raise ValueError(f"{where}: field {arch}.expert_used_count = {k} must lie in "
                             f"[1, {arch}.expert_count = {e}]")
        step = int(need("interleave_moe_layer_step"))
        if step < 1:
            raise ValueError(f"{where}: field {arch}.interleave_moe_layer_step = {step} must be "
                             ">= 1")
        first = int(meta.get(f"{arch}.leading_dense_block_count", 0))
        layers = tuple(i for i in range(first, num_layers) if (i + 1) % step == 0)
        return MoEConfig(
            e, k, int(need("expert_feed_forward_length")), layers=layers, scoring="softmax",
            norm_topk_prob=True, norm_min=1e-12,
            score_bias=bool(layers) and f"blk.{layers[0]}.exp_probs_b.bias" in names,
            shared_intermediate_size=int(meta.get(f"{arch}.expert_shared_feed_forward_length", 0)))
    if arch == "deepseek2" and f"{arch}.expert_count" not in meta:
        return None                                            # an all-dense DeepSeek
    e, k = int(need("expert_count")), int(need("expert_used_count"))
    ie = int(need("expert_feed_forward_length"))
    if not 1 <= k <= e:
        raise ValueError(f"{where}: field {arch}.expert_used_count = {k} must lie in "
                         f"[1, {arch}.expert_count = {e}]")
    if arch == "qwen3moe":
        if int(meta.get(f"{arch}.expert_shared_count", 0) or 0):
            raise ValueError(f"{where}: field {arch}.expert_shared_count > 0 is not supported "
                             "for qwen3moe (llama.cpp's graph has no shared experts)")
        return MoEConfig(e, k, ie, layers=tuple(range(num_layers)), scoring="softmax",
                         norm_topk_prob=True)
    # deepseek2 / glm4moe (DeepSeek-V3's router = transformers' DeepseekV3TopkRouter =
    # Glm4MoeTopkRouter). llama.cpp's default gating when the key is absent: softmax for deepseek2
    # (DeepSeek-V2 files), sigmoid for glm4moe.
    gating = int(meta.get(f"{arch}.expert_gating_func", 2 if arch == "glm4moe" else 1))
    if gating != 2:
        raise ValueError(f"{where}: field {arch}.expert_gating_func = {gating} (absent means 1 = "
                         "softmax for deepseek2, DeepSeek-V2's router) is not supported; only 2 = "
                         "sigmoid (DeepSeek-V3, GLM-4.5) is")
    first = int(meta.get(f"{arch}.leading_dense_block_count", 0))
    if not 0 <= first <= num_layers:
        raise ValueError(f"{where}: field {arch}.leading_dense_block_count = {first} outside "
                         f"[0, {arch}.block_count = {num_layers}]")
    return MoEConfig(
        e, k, ie, layers=tuple(range(first, num_layers)), mtp_moe=True, scoring="sigmoid",
        norm_topk_prob=bool(meta.get(f"{arch}.expert_weights_norm", False)),
        score_bias=f"blk.{first}.exp_probs_b.bias" in names,
        n_group=int(meta.get(f"{arch}.expert_group_count", 1) or 1),
        topk_group=int(meta.get(f"{arch}.expert_group_used_count", 1) or 1),
        routed_scaling_factor=float(meta.get(f"{arch}.expert_weights_scale", 1.0) or 1.0),
        shared_intermediate_size=ie * int(meta.get(f"{arch}.expert_shared_count", 0) or 0))


def hybrid_gguf_config(reader, meta: dict[str, Any], where: str) -> ModelConfig:
    """:class:`ModelConfig` of a ``qwen3next`` / ``qwen35`` / ``qwen35moe`` file, the same as
    :func:`jmtp.model.checkpoints.hf_qwen3_next.hybrid_config` gives for the transformers checkpoint it was
    converted from (llama.cpp ``convert_hf_to_gguf.py``, classes ``Qwen3NextModel``,
    ``Qwen3_5TextModel``, ``Qwen3_5MoeTextModel``; graphs ``src/models/qwen3next.cpp``,
    ``qwen35.cpp``, ``qwen35moe.cpp``):

    * ``block_count`` counts the ``nextn_predict_layers`` MTP layers (the converter writes HF's
      ``mtp.layers.{j}`` as ``blk.{N+j}``);
    * layer pattern: ``attention.recurrent_layers`` (one bool per block, MTP blocks false; the
      converter writes it from HF's ``layer_types``), else llama.cpp's rule: layer ``i`` is full
      attention iff ``(i + 1) % full_attention_interval == 0`` (absent: 4);
    * linear layers: ``ssm.group_count`` key heads, ``ssm.time_step_rank`` value heads,
      ``ssm.state_size`` key head dim, ``ssm.inner_size / time_step_rank`` value head dim,
      ``ssm.conv_kernel``;
    * full attention: gated (``attn_q`` holds query and gate), q/k norms, partial rotary
      ``rope.dimension_count / attention.key_length`` (Qwen3.5's multimodal
      ``rope.dimension_sections`` rotate every section by the same position for text);
    * ``qwen3next`` / ``qwen35moe``: every layer MoE (llama.cpp's graphs have no dense layer), a
      softmax router whose top-k weights are renormalised, a shared expert of
      ``expert_shared_feed_forward_length`` (absent: ``feed_forward_length``, llama.cpp's
      fallback) scaled by ``sigmoid(ffn_gate_inp_shexp · x)``.

    Raises:
      ValueError: naming the field for a missing or inconsistent key, rope scaling, or an expert
        weight scale (``expert_weights_scale``) other than 1.
    """
    arch = meta["general.architecture"]
    names = {t.name for t in reader.tensors}

    def need(key):
        k = f"{arch}.{key}"
        if meta.get(k) is None:
            raise ValueError(f"{where}: missing metadata field {k!r}")
        return meta[k]

    nextn = int(meta.get(f"{arch}.nextn_predict_layers", 0) or 0)
    total = int(need("block_count"))
    n = total - nextn
    if n < 1:
        raise ValueError(f"{where}: field {arch}.block_count = {total} leaves no target layer "
                         f"after {arch}.nextn_predict_layers = {nextn}")
    h, nq = int(need("embedding_length")), int(need("attention.head_count"))
    nkv = int(meta.get(f"{arch}.attention.head_count_kv", nq))
    head_dim = int(meta.get(f"{arch}.attention.key_length", h // nq))
    vlen = int(meta.get(f"{arch}.attention.value_length", head_dim))
    if vlen != head_dim:
        raise ValueError(f"{where}: field {arch}.attention.value_length = {vlen} != "
                         f"{arch}.attention.key_length = {head_dim}: unsupported")
    rot = int(meta.get(f"{arch}.rope.dimension_count", head_dim))
    if not 0 < rot <= head_dim or rot % 2:
        raise ValueError(f"{where}: field {arch}.rope.dimension_count = {rot} must be even and lie "
                         f"in (0, head_dim = {head_dim}]")
    stype = meta.get(f"{arch}.rope.scaling.type", "none")
    if stype not in ("none", None) or "rope_freqs.weight" in names:
        raise ValueError(f"{where}: field {arch}.rope.scaling.type = {stype!r} (or a "
                         "rope_freqs.weight tensor): rope scaling is not supported for the hybrid "
                         "models")
    # layer pattern
    rec = meta.get(f"{arch}.attention.recurrent_layers")
    if rec is not None:
        if not isinstance(rec, (list, tuple, np.ndarray)):
            rec = [rec] * total                            # one value for every block
        rec = [bool(x) for x in rec]
        if len(rec) != total:
            raise ValueError(f"{where}: field {arch}.attention.recurrent_layers has {len(rec)} "
                             f"entries, expected {arch}.block_count = {total}")
        if any(rec[n:]):
            raise ValueError(f"{where}: field {arch}.attention.recurrent_layers marks an MTP layer "
                             f"(blk.{n + rec[n:].index(True)}) recurrent; MTP layers are full "
                             "attention")
        types = ["linear_attention" if r else "full_attention" for r in rec[:n]]
    else:
        interval = int(meta.get(f"{arch}.full_attention_interval", 4) or 4)
        types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(n)]
    if "full_attention" not in types:
        raise ValueError(f"{where}: fields {arch}.attention.recurrent_layers / "
                         f"{arch}.full_attention_interval leave no full-attention layer")
    hk, hv = int(need("ssm.group_count")), int(need("ssm.time_step_rank"))
    inner, dk = int(need("ssm.inner_size")), int(need("ssm.state_size"))
    if hk < 1 or hv % hk or inner % hv:
        raise ValueError(f"{where}: fields {arch}.ssm.time_step_rank = {hv} (value heads) must "
                         f"be a multiple of {arch}.ssm.group_count = {hk} (key heads) and divide "
                         f"{arch}.ssm.inner_size = {inner}")
    linear = LinearAttentionConfig(num_key_heads=hk, num_value_heads=hv, key_head_dim=dk,
                                   value_head_dim=inner // hv,
                                   conv_kernel_dim=int(need("ssm.conv_kernel")))
    moe = None
    ff = meta.get(f"{arch}.feed_forward_length")
    if arch in HYBRID_MOE_GGUF_ARCHITECTURES:
        e, k = int(need("expert_count")), int(need("expert_used_count"))
        if not 1 <= k <= e:
            raise ValueError(f"{where}: field {arch}.expert_used_count = {k} must lie in "
                             f"[1, {arch}.expert_count = {e}]")
        scale = float(meta.get(f"{arch}.expert_weights_scale", 0.0) or 0.0)
        if scale not in (0.0, 1.0):
            raise ValueError(f"{where}: field {arch}.expert_weights_scale = {scale} is not "
                             "supported for the hybrid models (only 1)")
        shared = int(meta.get(f"{arch}.expert_shared_feed_forward_length") or ff or 0)
        if shared < 1:
            raise ValueError(f"{where}: missing metadata field "
                             f"'{arch}.expert_shared_feed_forward_length' (nor "
                             f"{arch}.feed_forward_length): the shared expert's width")
        moe = MoEConfig(e, k, int(need("expert_feed_forward_length")), layers=tuple(range(n)),
                        mtp_moe=True, scoring="softmax", norm_topk_prob=True,
                        shared_intermediate_size=shared, shared_expert_gate=True)
        inter = int(ff or moe.moe_intermediate_size)
    else:
        inter = int(need("feed_forward_length"))
    first_full = types.index("full_attention")
    embd = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embd is None:
        raise ValueError(f"{where}: missing tensor 'token_embd.weight'")
    eos = [meta[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                             "tokenizer.ggml.eom_token_id") if k in meta]
    return ModelConfig(
        architecture=GGUF_ARCHITECTURES[arch][0],
        vocab_size=int(meta.get(f"{arch}.vocab_size", int(embd.shape[1]))),
        hidden_size=h, intermediate_size=inter, num_layers=n, num_heads=nq, num_kv_heads=nkv,
        head_dim=head_dim,
        rms_norm_eps=float(meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        tie_word_embeddings="output.weight" not in names,
        attention_bias=f"blk.{first_full}.attn_q.bias" in names
        or f"blk.{first_full}.attn_qkv.bias" in names,
        qk_norm=True, partial_rotary_factor=rot / head_dim, moe=moe,
        max_position_embeddings=int(meta.get(f"{arch}.context_length", 2048)),
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(int(e) for e in eos)),
        layer_types=tuple(types), linear=linear, attn_output_gate=True, mtp_layout="qwen3_next",
        num_mtp_layers=nextn)
