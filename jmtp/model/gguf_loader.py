"""GGUF checkpoints (llama.cpp) → jmtp parameters, config and tokenizer data.

Reading uses the ``gguf`` package (``gguf.GGUFReader`` for the file, ``gguf.quants.dequantize``
for block formats). Facts used (GGUF spec in ggml's ``docs/gguf.md``; llama.cpp
``convert_hf_to_gguf.py``; transformers ``modeling_gguf_pytorch_utils.py``):

* a tensor's GGUF dims are listed innermost first (``ne0`` = input features), so the row-major
  array ``GGUFReader`` exposes is ``[out, in]`` — the torch ``nn.Linear`` layout;
* for ``general.architecture == "llama"`` llama.cpp permutes the rows of ``attn_q``/``attn_k`` per
  head so that its interleaved ("normal") RoPE sees HF's rotate-half pairs; we undo it with
  :func:`jmtp.model.hf_loader.deinterleave_rows` (heads = ``head_count`` for q, ``head_count_kv``
  for k). ``qwen2``/``qwen3`` files use NEOX RoPE and are not permuted;
* a missing ``output.weight`` means the LM head is tied to ``token_embd.weight``;
* hyper-parameters live under ``{arch}.*`` keys (``context_length``, ``embedding_length``,
  ``block_count``, ``feed_forward_length``, ``attention.head_count(_kv)``,
  ``attention.key_length``, ``rope.freq_base``, ``attention.layer_norm_rms_epsilon``,
  ``rope.dimension_count``, ``rope.scaling.*``, ``vocab_size``); Llama-3 style rope scaling is
  stored as a ``rope_freqs.weight`` tensor of per-frequency divisors, matched here against the
  llama3 formula.
* mixture-of-experts architectures (``qwen3moe``, ``deepseek2``, ``glm4moe``, ``ernie4_5-moe``):
  llama.cpp stacks each layer's experts into ``blk.N.ffn_{gate,up,down}_exps.weight`` (ne =
  ``{in, out, E}``, i.e. row-major ``[E, out, in]``; its ``--fuse-gate-up-exps`` is not defined
  for these architectures), exposed here as transformers' fused ``mlp.experts.gate_up_proj``
  (gate and up concatenated) / ``down_proj``; the router is ``ffn_gate_inp.weight``
  (``[E, H]``), shared experts ``ffn_{gate,up,down}_shexp``, the score-correction bias
  ``exp_probs_b.bias`` (``[E]``; ERNIE's ``[E, 1]``); hyper-parameters ``expert_count``,
  ``expert_used_count``, ``expert_feed_forward_length``, ``expert_shared_count``,
  ``expert_shared_feed_forward_length``, ``leading_dense_block_count``,
  ``interleave_moe_layer_step``, ``expert_weights_scale``, ``expert_weights_norm``,
  ``expert_gating_func`` (1 softmax, 2 sigmoid), ``expert_group_count``,
  ``expert_group_used_count``. Routing rules the file does not store are those of llama.cpp's
  per-architecture graph (``src/models/*.cpp``), listed in :func:`_moe_config`.
* ``deepseek2`` (DeepSeek-V3) multi-head latent attention: ``attn_q_a``, ``attn_q_a_norm``,
  ``attn_q_b`` (or ``attn_q``), ``attn_kv_a_mqa``, ``attn_kv_a_norm``, and ``kv_b_proj`` split by
  the converter into ``attn_k_b`` (ne ``{dn, C, N}``: per head ``W_UK`` transposed) and
  ``attn_v_b`` (ne ``{C, dv, N}``), rebuilt here as ``[N·(dn+dv), C]``; files written before
  that split hold ``attn_kv_b``. Keys ``attention.q_lora_rank``, ``attention.kv_lora_rank``,
  ``attention.key_length_mla`` / ``value_length_mla`` (older files: ``key_length`` /
  ``value_length``), ``rope.dimension_count`` (the rotary width); ``head_count_kv`` (1: MLA run as
  MQA) is ignored. llama.cpp runs deepseek2 and ernie4_5-moe with interleaved RoPE on unpermuted
  HF weights, so their q/k rotary rows are de-interleaved as by the HF loader. YaRN:
  ``rope.scaling.{type = yarn, factor, original_context_length, yarn_beta_fast, yarn_beta_slow,
  yarn_log_multiplier}`` (see :func:`_deepseek2_yarn`).
* ``glm4moe``: ``block_count`` includes the ``nextn_predict_layers`` NextN (MTP) layers, whose
  ``blk.{N+j}.nextn.{eh_proj,enorm,hnorm,shared_head_norm}`` plus the layer's ordinary tensors
  become jmtp's DeepSeek-layout MTP module; partial rotary (``rope.dimension_count`` < head dim);
  the post-attention norm is ``post_attention_norm.weight`` (``ffn_norm`` elsewhere).

Tensor types accepted: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K
(dequantized to fp32 on the host, then cast). Anything else raises ``ValueError`` naming the tensor
and type before any tensor is dequantized.
"""
from __future__ import annotations

import functools
import logging
import math
import os
import re
from typing import Any

import numpy as np

from jmtp.model.config import ModelConfig, MoEConfig, RopeScaling
from jmtp.model.hf_loader import build_params, deinterleave_rows

log = logging.getLogger(__name__)

SUPPORTED_GGUF_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K",
                        "Q3_K", "Q4_K", "Q5_K", "Q6_K")
# GGUF general.architecture -> (HF architecture, llama.cpp permuted q/k rows)
GGUF_ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", True),
    "qwen2": ("Qwen2ForCausalLM", False),
    "qwen3": ("Qwen3ForCausalLM", False),
    "qwen3moe": ("Qwen3MoeForCausalLM", False),
    "deepseek2": ("DeepseekV3ForCausalLM", False),
    "glm4moe": ("Glm4MoeForCausalLM", False),
    "ernie4_5-moe": ("Ernie4_5_MoeForCausalLM", False),
}
MOE_GGUF_ARCHITECTURES = ("qwen3moe", "deepseek2", "glm4moe", "ernie4_5-moe")
# architectures whose RoPE may rotate only the first rope.dimension_count dims of a head
PARTIAL_ROTARY_GGUF_ARCHITECTURES = ("glm4moe",)
# llama.cpp runs these with interleaved ("normal") RoPE on unpermuted HF weights (DeepSeek's own
# rope_interleave layout): the loader de-interleaves like the HF loader does.
INTERLEAVED_GGUF_ARCHITECTURES = ("deepseek2", "ernie4_5-moe")
# Metadata arrays read only on demand (large): see gguf_array().
_LAZY_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type",
                "tokenizer.ggml.scores")
# HF per-layer name suffix -> GGUF per-layer name suffix.
_LAYER_MAP = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.o_proj.bias": "attn_output.bias",   # refused by build_params (no output bias)
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    # multi-head latent attention (deepseek2)
    "self_attn.q_a_proj.weight": "attn_q_a.weight",
    "self_attn.q_a_layernorm.weight": "attn_q_a_norm.weight",
    "self_attn.q_b_proj.weight": "attn_q_b.weight",
    "self_attn.kv_a_proj_with_mqa.weight": "attn_kv_a_mqa.weight",
    "self_attn.kv_a_layernorm.weight": "attn_kv_a_norm.weight",
    "self_attn.kv_b_proj.weight": "attn_kv_b.weight",   # legacy files; new ones split it
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    # mixture of experts (llama.cpp stacks the experts: ffn_*_exps ne = {in, out, E})
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.gate.e_score_correction_bias": "exp_probs_b.bias",
    "mlp.experts.down_proj": "ffn_down_exps.weight",
    "mlp.shared_experts.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_experts.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_experts.down_proj.weight": "ffn_down_shexp.weight",
}
_KV_B = "kv_b"   # marker: MLA kv_b_proj rebuilt from attn_k_b / attn_v_b (see GGUFSource)
# HF per-layer names llama.cpp splits into several GGUF tensors, concatenated along an axis of the
# row-major (torch-layout) arrays: the experts' gate and up projections f[E, I, H] -> f[E, 2I, H]
# (transformers' fused ``mlp.experts.gate_up_proj`` = [gate; up]).
_LAYER_CONCAT = {
    "mlp.experts.gate_up_proj": (("ffn_gate_exps.weight", "ffn_up_exps.weight"), 1),
}
# per-architecture renames of _LAYER_MAP entries
_ARCH_LAYER_MAP = {
    "glm4moe": {"post_attention_layernorm.weight": "post_attention_norm.weight"},
}
# DeepSeek/GLM "NextN" MTP tensors of layer blk.{N+j} (after the target's N layers) -> HF suffix
_NEXTN_MAP = {
    "eh_proj.weight": "nextn.eh_proj.weight",
    "enorm.weight": "nextn.enorm.weight",
    "hnorm.weight": "nextn.hnorm.weight",
    "shared_head.norm.weight": "nextn.shared_head_norm.weight",
}
_GGUF_IGNORED = re.compile(
    r"^rope_freqs\.weight$|\.nextn\.(embed_tokens|shared_head_head)\.weight$")
_GLOBAL_MAP = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def is_gguf(path: str | os.PathLike) -> bool:
    """True if ``path`` is a regular file starting with the GGUF magic ``b"GGUF"``."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


@functools.lru_cache(maxsize=2)
def _open_cached(path: str, mtime_ns: int, size: int):
    import gguf

    try:
        return gguf.GGUFReader(path)
    except (ValueError, KeyError, IndexError) as e:
        raise ValueError(f"{path}: cannot read GGUF file ({e})") from None


def open_gguf(path: str | os.PathLike):
    """``gguf.GGUFReader`` of ``path`` (memory-mapped; cached for the last 2 files, because parsing
    the tokenizer arrays takes seconds).

    Raises:
      ValueError: naming the file if it is missing or not a readable GGUF file (e.g. an unknown
        tensor type id).
    """
    p = os.path.realpath(os.fspath(path))
    if not os.path.isfile(p):
        raise ValueError(f"{path}: GGUF file does not exist")
    st = os.stat(p)
    return _open_cached(p, st.st_mtime_ns, st.st_size)


def gguf_metadata(reader) -> dict[str, Any]:
    """Scalar and small-array metadata ``{key: value}`` (tokenizer vocab arrays excluded; see
    :func:`gguf_array`)."""
    out = {}
    for key, field in reader.fields.items():
        if key in _LAZY_ARRAYS or key.startswith("GGUF."):
            continue
        out[key] = field.contents()
    return out


def gguf_array(reader, key: str) -> list | np.ndarray | None:
    """A metadata array: ``list[str]`` for string arrays, ``np.ndarray`` for numeric ones, or None."""
    import gguf

    field = reader.fields.get(key)
    if field is None:
        return None
    if field.types[-1] == gguf.GGUFValueType.STRING:
        return [bytes(field.parts[i]).decode("utf-8", errors="surrogateescape") for i in field.data]
    if not field.data:
        return np.zeros((0,))
    return np.concatenate([field.parts[i] for i in field.data])


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


class GGUFSource:
    """The tensors of a GGUF file under HF names, dequantized to fp32 ``[out, in]`` on access,
    with llama.cpp's q/k row permutation undone when ``permuted``.

    MoE experts appear under transformers' fused names: ``mlp.experts.gate_up_proj f[E, 2I, H]``
    (``ffn_gate_exps`` and ``ffn_up_exps`` concatenated) and ``mlp.experts.down_proj f[E, H, I]``
    (``ffn_down_exps``); MLA's ``kv_b_proj`` is rebuilt from ``attn_k_b`` / ``attn_v_b``."""

    def __init__(self, reader, where: str, cfg: ModelConfig, permuted: bool, arch: str = "",
                 nextn: int = 0):
        self.where_ = where
        self.cfg = cfg
        self.permuted = permuted
        self._tensors = {t.name: t for t in reader.tensors}
        # HF name -> (GGUF names, concatenation axis of the row-major arrays)
        self._hf2gguf: dict[str, tuple[tuple[str, ...], int]] = {
            hf: ((g,), 0) for hf, g in _GLOBAL_MAP.items() if g in self._tensors}
        layer_map = {**_LAYER_MAP, **_ARCH_LAYER_MAP.get(arch, {})}
        for i in range(cfg.num_layers + nextn):
            if i >= cfg.num_layers:
                for hf_suffix, g_suffix in _NEXTN_MAP.items():
                    g = f"blk.{i}.{g_suffix}"
                    if g in self._tensors:
                        self._hf2gguf[f"model.layers.{i}.{hf_suffix}"] = ((g,), 0)
            for hf_suffix, g_suffix in layer_map.items():
                g = f"blk.{i}.{g_suffix}"
                if g in self._tensors:
                    self._hf2gguf[f"model.layers.{i}.{hf_suffix}"] = ((g,), 0)
            for hf_suffix, (g_suffixes, axis) in _LAYER_CONCAT.items():
                gs = tuple(f"blk.{i}.{g}" for g in g_suffixes)
                if all(g in self._tensors for g in gs):
                    self._hf2gguf[f"model.layers.{i}.{hf_suffix}"] = (gs, axis)
            kb, vb = f"blk.{i}.attn_k_b.weight", f"blk.{i}.attn_v_b.weight"
            if (kb in self._tensors and vb in self._tensors
                    and f"blk.{i}.attn_kv_b.weight" not in self._tensors):
                self._hf2gguf[f"model.layers.{i}.self_attn.kv_b_proj.weight"] = ((kb, vb), _KV_B)
        for t in reader.tensors:  # early, explicit error for block formats we do not decode
            if t.tensor_type.name not in SUPPORTED_GGUF_TYPES:
                raise ValueError(
                    f"{where}: tensor {t.name!r} has GGUF type {t.tensor_type.name}, which is not "
                    f"supported (supported: {', '.join(SUPPORTED_GGUF_TYPES)})")

    def names(self) -> set[str]:
        return set(self._hf2gguf)

    def unmapped(self) -> list[str]:
        """GGUF tensors no HF name reads (llama.cpp's derived ``rope_freqs`` and the NextN
        layers' duplicate ``embed_tokens`` / ``shared_head_head`` excepted)."""
        used = {g for gs, _ in self._hf2gguf.values() for g in gs}
        return sorted(n for n in self._tensors if n not in used and not _GGUF_IGNORED.search(n))

    def _shape1(self, g: str) -> tuple[int, ...]:
        return tuple(int(s) for s in reversed(self._tensors[g].shape.tolist()))

    def shape(self, name: str) -> tuple[int, ...]:
        gs, axis = self._hf2gguf[name]
        shapes = [self._shape1(g) for g in gs]
        if len(shapes) == 1:
            return shapes[0]
        if axis == _KV_B:   # k_b [N, C, dn], v_b [N, dv, C] -> kv_b [N * (dn + dv), C]
            (n, c, dn), (n2, dv, c2) = shapes
            if (n, c) != (n2, c2):
                raise ValueError(f"{self.where_}: tensors {gs[0]!r} {list(shapes[0])} and "
                                 f"{gs[1]!r} {list(shapes[1])} disagree on heads / kv_lora_rank")
            return (n * (dn + dv), c)
        for s in shapes[1:]:
            if s[:axis] + s[axis + 1:] != shapes[0][:axis] + shapes[0][axis + 1:]:
                raise ValueError(f"{self.where_}: tensors {', '.join(map(repr, gs))} have shapes "
                                 f"{shapes} that do not concatenate along axis {axis}")
        out = list(shapes[0])
        out[axis] = sum(s[axis] for s in shapes)
        return tuple(out)

    def where(self, name: str) -> str:
        gs, _ = self._hf2gguf[name]
        return f"{self.where_} (GGUF tensor {' + '.join(map(repr, gs))})"

    def _get1(self, g: str) -> np.ndarray:
        import gguf.quants

        t = self._tensors[g]
        kind = t.tensor_type.name
        if kind in ("F32", "F16"):
            w = np.asarray(t.data, np.float32)
        else:
            w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        return w.reshape(self._shape1(g))

    def get(self, name: str) -> np.ndarray:
        gs, axis = self._hf2gguf[name]
        if axis == _KV_B:
            k_b, v_b = self._get1(gs[0]), self._get1(gs[1])
            w = np.concatenate([k_b.transpose(0, 2, 1), v_b], 1).reshape(self.shape(name))
        elif len(gs) == 1:
            w = self._get1(gs[0])
        else:
            w = np.concatenate([self._get1(g) for g in gs], axis)
        if self.permuted and name.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
            w = deinterleave_rows(w, self.cfg.num_heads)
        elif self.permuted and name.endswith(("self_attn.k_proj.weight", "self_attn.k_proj.bias")):
            w = deinterleave_rows(w, self.cfg.num_kv_heads)
        return w


def check_layer_tensors(reader, cfg: ModelConfig, arch: str, where: str, nextn: int = 0) -> None:
    """GGUF-named presence checks for the tensors llama.cpp splits or stacks: an MLA layer has
    ``attn_kv_b`` or both ``attn_k_b`` and ``attn_v_b``; every MoE layer of ``cfg`` has its router
    and expert tensors, with ``{arch}.expert_count`` experts; dense layers have no router; each
    of the ``nextn`` NextN layers has its ``nextn.{eh_proj,enorm,hnorm,shared_head_norm}``.

    Raises:
      ValueError: naming the missing GGUF tensor, or the tensor and the metadata field whose
        expert count disagree.
    """
    tensors = {t.name: t for t in reader.tensors}
    for i in range(cfg.num_layers, cfg.num_layers + nextn):
        for g in _NEXTN_MAP.values():
            if f"blk.{i}.{g}" not in tensors:
                raise ValueError(f"{where}: missing tensor 'blk.{i}.{g}' (field "
                                 f"{arch}.nextn_predict_layers = {nextn} makes blk.{i} a NextN "
                                 "layer)")
    for i in range(cfg.num_layers if cfg.is_mla else 0):
        b = f"blk.{i}."
        if b + "attn_kv_b.weight" not in tensors:
            for n in ("attn_k_b.weight", "attn_v_b.weight"):
                if b + n not in tensors:
                    raise ValueError(f"{where}: missing tensor {b + n!r} (MLA layer {i} has no "
                                     f"{b}attn_kv_b.weight either)")
    if cfg.moe is None:
        return
    e = cfg.moe.num_experts
    for i in range(cfg.num_layers):
        b = f"blk.{i}."
        if not cfg.is_moe_layer(i):
            if b + "ffn_gate_inp.weight" in tensors:
                raise ValueError(f"{where}: tensor {b}ffn_gate_inp.weight makes layer {i} MoE but "
                                 f"the metadata makes it dense ({arch}.leading_dense_block_count)")
            continue
        need = ["ffn_gate_inp.weight", "ffn_gate_exps.weight", "ffn_up_exps.weight",
                "ffn_down_exps.weight"]
        if cfg.moe.score_bias:
            need.append("exp_probs_b.bias")
        elif b + "exp_probs_b.bias" in tensors:
            raise ValueError(f"{where}: tensor {b}exp_probs_b.bias present but the first MoE layer "
                             f"blk.{cfg.moe.layers[0]} has none")
        if cfg.moe.shared_intermediate_size:
            need += ["ffn_gate_shexp.weight", "ffn_up_shexp.weight", "ffn_down_shexp.weight"]
        for n in need:
            if b + n not in tensors:
                raise ValueError(f"{where}: missing tensor {b + n!r} (layer {i} is a MoE layer)")
            t = tensors[b + n]     # GGUF dims innermost first: experts last (ERNIE's bias: [E, 1])
            got = int(t.shape[0] if n == "exp_probs_b.bias" else t.shape[-1])
            if n.endswith(("_exps.weight", "gate_inp.weight", "probs_b.bias")) and got != e:
                raise ValueError(f"{where}: tensor {b + n!r} holds {got} experts but field "
                                 f"{arch}.expert_count = {e}")


def load_gguf(path: str | os.PathLike, dtype) -> tuple[ModelConfig, dict]:
    """Load a GGUF checkpoint into ``(ModelConfig, params)`` (fresh MTP head: GGUF files carry none).

    Raises:
      ValueError: naming the file/field/tensor for an unreadable file, unknown architecture,
        unsupported tensor type, missing tensor or shape mismatch.
    """
    where = os.fspath(path)
    reader = open_gguf(where)
    cfg, permuted = gguf_config(reader, where)
    meta = gguf_metadata(reader)
    arch = meta["general.architecture"]
    nextn = int(meta.get(f"{arch}.nextn_predict_layers", 0) or 0)
    check_layer_tensors(reader, cfg, arch, where, nextn)
    src = GGUFSource(reader, where, cfg, permuted, arch, nextn)
    unmapped = src.unmapped()
    if unmapped:
        log.warning("%s: %d GGUF tensor(s) not used, e.g. %s", where, len(unmapped),
                    ", ".join(unmapped[:5]))
    return build_params(cfg, src, where, dtype,
                        interleaved_rope=arch in INTERLEAVED_GGUF_ARCHITECTURES)


def gguf_tokenizer_data(path: str | os.PathLike) -> dict[str, Any]:
    """Tokenizer description stored in a GGUF file.

    Returns a dict with ``model`` (``tokenizer.ggml.model``, e.g. ``"gpt2"``), ``pre`` (pre-tokenizer
    name), ``tokens`` (list[str]), ``merges`` (list[str] | None), ``token_type`` (i32 array | None;
    1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte), ``bos_token_id``,
    ``eos_token_ids`` (tuple), ``add_bos`` / ``add_eos`` (bool), ``chat_template`` (str | None).

    Raises:
      ValueError: if the file has no ``tokenizer.ggml.tokens``.
    """
    where = os.fspath(path)
    reader = open_gguf(where)
    meta = gguf_metadata(reader)
    tokens = gguf_array(reader, "tokenizer.ggml.tokens")
    if tokens is None:
        raise ValueError(f"{where}: missing metadata field 'tokenizer.ggml.tokens'")
    tt = gguf_array(reader, "tokenizer.ggml.token_type")
    eos = [meta[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                             "tokenizer.ggml.eom_token_id") if k in meta]
    return {
        "model": meta.get("tokenizer.ggml.model"),
        "pre": meta.get("tokenizer.ggml.pre", "default"),
        "tokens": tokens,
        "merges": gguf_array(reader, "tokenizer.ggml.merges"),
        "token_type": None if tt is None else np.asarray(tt, np.int32),
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_ids": tuple(dict.fromkeys(int(e) for e in eos)),
        "add_bos": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "chat_template": meta.get("tokenizer.chat_template"),
    }
