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

Tensor types accepted: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K
(dequantized to fp32 on the host, then cast). Anything else raises ``ValueError`` naming the tensor
and type before any tensor is dequantized.
"""
from __future__ import annotations

import functools
import logging
import math
import os
from typing import Any

import numpy as np

from jmtp.model.config import ModelConfig, RopeScaling
from jmtp.model.hf_loader import build_params, deinterleave_rows

log = logging.getLogger(__name__)

SUPPORTED_GGUF_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K",
                        "Q3_K", "Q4_K", "Q5_K", "Q6_K")
# GGUF general.architecture -> (HF architecture, llama.cpp permuted q/k rows)
GGUF_ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", True),
    "qwen2": ("Qwen2ForCausalLM", False),
    "qwen3": ("Qwen3ForCausalLM", False),
}
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
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
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
    head_dim = int(meta.get(f"{arch}.attention.key_length", h // nq))
    rot = int(meta.get(f"{arch}.rope.dimension_count", head_dim))
    if rot != head_dim:
        raise ValueError(f"{where}: field {arch}.rope.dimension_count = {rot} != head_dim "
                         f"{head_dim}: partial rotary embeddings are not supported")
    theta = float(meta.get(f"{arch}.rope.freq_base", 10000.0))
    stype = meta.get(f"{arch}.rope.scaling.type", "none")
    if stype not in ("none", None) and float(meta.get(f"{arch}.rope.scaling.factor", 1.0)) != 1.0:
        raise ValueError(f"{where}: field {arch}.rope.scaling.type = {stype!r} is not supported "
                         "(only llama3 scaling via rope_freqs.weight)")
    scaling = None
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
    cfg = ModelConfig(
        architecture=hf_arch,
        vocab_size=vocab,
        hidden_size=h,
        intermediate_size=int(need("feed_forward_length")),
        num_layers=int(need("block_count")),
        num_heads=nq,
        num_kv_heads=nkv,
        head_dim=head_dim,
        rms_norm_eps=float(meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=theta,
        rope_scaling=scaling,
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        qk_norm="blk.0.attn_q_norm.weight" in names,
        max_position_embeddings=int(meta.get(f"{arch}.context_length", 2048)),
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(int(e) for e in eos)),
    )
    return cfg, permuted


class GGUFSource:
    """The tensors of a GGUF file under HF names, dequantized to fp32 ``[out, in]`` on access,
    with llama.cpp's q/k row permutation undone when ``permuted``."""

    def __init__(self, reader, where: str, cfg: ModelConfig, permuted: bool):
        self.where_ = where
        self.cfg = cfg
        self.permuted = permuted
        self._tensors = {t.name: t for t in reader.tensors}
        self._hf2gguf = {hf: g for hf, g in _GLOBAL_MAP.items() if g in self._tensors}
        for i in range(cfg.num_layers):
            for hf_suffix, g_suffix in _LAYER_MAP.items():
                g = f"blk.{i}.{g_suffix}"
                if g in self._tensors:
                    self._hf2gguf[f"model.layers.{i}.{hf_suffix}"] = g
        for t in reader.tensors:  # early, explicit error for block formats we do not decode
            if t.tensor_type.name not in SUPPORTED_GGUF_TYPES:
                raise ValueError(
                    f"{where}: tensor {t.name!r} has GGUF type {t.tensor_type.name}, which is not "
                    f"supported (supported: {', '.join(SUPPORTED_GGUF_TYPES)})")

    def names(self) -> set[str]:
        return set(self._hf2gguf)

    def shape(self, name: str) -> tuple[int, ...]:
        t = self._tensors[self._hf2gguf[name]]
        return tuple(int(s) for s in reversed(t.shape.tolist()))

    def where(self, name: str) -> str:
        return f"{self.where_} (GGUF tensor {self._hf2gguf[name]!r})"

    def get(self, name: str) -> np.ndarray:
        import gguf.quants

        t = self._tensors[self._hf2gguf[name]]
        kind = t.tensor_type.name
        if kind in ("F32", "F16"):
            w = np.asarray(t.data, np.float32)
        else:
            w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        w = w.reshape(self.shape(name))
        if self.permuted and name.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
            w = deinterleave_rows(w, self.cfg.num_heads)
        elif self.permuted and name.endswith(("self_attn.k_proj.weight", "self_attn.k_proj.bias")):
            w = deinterleave_rows(w, self.cfg.num_kv_heads)
        return w


def load_gguf(path: str | os.PathLike, dtype) -> tuple[ModelConfig, dict]:
    """Load a GGUF checkpoint into ``(ModelConfig, params)`` (fresh MTP head: GGUF files carry none).

    Raises:
      ValueError: naming the file/field/tensor for an unreadable file, unknown architecture,
        unsupported tensor type, missing tensor or shape mismatch.
    """
    where = os.fspath(path)
    reader = open_gguf(where)
    cfg, permuted = gguf_config(reader, where)
    src = GGUFSource(reader, where, cfg, permuted)
    return build_params(cfg, src, where, dtype)


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
