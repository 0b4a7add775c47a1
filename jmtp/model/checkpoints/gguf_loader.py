"""GGUF checkpoints (llama.cpp) → jmtp parameters, config and tokenizer data.

Reading uses the ``gguf`` package (``gguf.GGUFReader`` for the file, ``gguf.quants.dequantize``
for block formats); the metadata → :class:`ModelConfig` mapping (hyper-parameter keys, MoE routing
rules, MLA widths, rope scaling) is :mod:`jmtp.model.checkpoints.gguf_config`. Tensor facts used (GGUF spec in
ggml's ``docs/gguf.md``; llama.cpp ``convert_hf_to_gguf.py``; transformers
``modeling_gguf_pytorch_utils.py``):

* a tensor's GGUF dims are listed innermost first (``ne0`` = input features), so the row-major
  array ``GGUFReader`` exposes is ``[out, in]`` — the torch ``nn.Linear`` layout;
* for ``general.architecture == "llama"`` llama.cpp permutes the rows of ``attn_q``/``attn_k`` per
  head so that its interleaved ("normal") RoPE sees HF's rotate-half pairs; we undo it with
  :func:`jmtp.model.checkpoints.hf_loader.deinterleave_rows` (heads = ``head_count`` for q, ``head_count_kv``
  for k). ``qwen2``/``qwen3`` files use NEOX RoPE and are not permuted;
* a missing ``output.weight`` means the LM head is tied to ``token_embd.weight``;
* mixture-of-experts architectures (``qwen3moe``, ``deepseek2``, ``glm4moe``, ``ernie4_5-moe``):
  llama.cpp stacks each layer's experts into ``blk.N.ffn_{gate,up,down}_exps.weight`` (ne =
  ``{in, out, E}``, i.e. row-major ``[E, out, in]``; its ``--fuse-gate-up-exps`` is not defined
  for these architectures), exposed here as transformers' fused ``mlp.experts.gate_up_proj``
  (gate and up concatenated) / ``down_proj``; the router is ``ffn_gate_inp.weight``
  (``[E, H]``), shared experts ``ffn_{gate,up,down}_shexp``, the score-correction bias
  ``exp_probs_b.bias`` (``[E]``; ERNIE's ``[E, 1]``);
* ``deepseek2`` (DeepSeek-V3) multi-head latent attention: ``attn_q_a``, ``attn_q_a_norm``,
  ``attn_q_b`` (or ``attn_q``), ``attn_kv_a_mqa``, ``attn_kv_a_norm``, and ``kv_b_proj`` split by
  the converter into ``attn_k_b`` (ne ``{dn, C, N}``: per head ``W_UK`` transposed) and
  ``attn_v_b`` (ne ``{C, dv, N}``), rebuilt here as ``[N·(dn+dv), C]``; files written before
  that split hold ``attn_kv_b``. llama.cpp runs deepseek2 and ernie4_5-moe with interleaved RoPE
  on unpermuted HF weights, so their q/k rotary rows are de-interleaved as by the HF loader;
* ``glm4moe``: the ``nextn_predict_layers`` NextN (MTP) layers after the target's, whose
  ``blk.{N+j}.nextn.{eh_proj,enorm,hnorm,shared_head_norm}`` plus the layer's ordinary tensors
  become jmtp's DeepSeek-layout MTP module; the post-attention norm is
  ``post_attention_norm.weight`` (``ffn_norm`` elsewhere);
* the hybrid gated-DeltaNet family (``qwen3next``, ``qwen35``, ``qwen35moe``):
  :class:`jmtp.model.checkpoints.gguf_hybrid.HybridGGUFSource` undoes the converter's transforms and hands transformers' names to
  :func:`jmtp.model.checkpoints.hf_qwen3_next.build_hybrid_params`, so a file loads exactly as the
  checkpoint it was converted from (its MTP layer included).

Tensor types accepted: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K
(dequantized to fp32 on the host, then cast). Anything else raises ``ValueError`` naming the tensor
and type before any tensor is dequantized.
"""
from __future__ import annotations

import functools
import logging
import os
from typing import Any

import numpy as np

from jmtp.model.config import ModelConfig
from jmtp.model.checkpoints.gguf_config import (GGUF_ARCHITECTURES, GGUF_IGNORED, HYBRID_GGUF_ARCHITECTURES,
                                    SUPPORTED_GGUF_TYPES, gguf_config, gguf_metadata)
from jmtp.model.checkpoints.hf_loader import build_params, deinterleave_rows

__all__ = ["GGUF_ARCHITECTURES", "GGUFSource", "HYBRID_GGUF_ARCHITECTURES",
           "INTERLEAVED_GGUF_ARCHITECTURES", "SUPPORTED_GGUF_TYPES", "check_layer_tensors",
           "gguf_array", "gguf_config", "gguf_metadata", "gguf_tokenizer_data", "is_gguf",
           "load_gguf", "open_gguf"]

log = logging.getLogger(__name__)

# llama.cpp runs these with interleaved ("normal") RoPE on unpermuted HF weights (DeepSeek's own
# rope_interleave layout): the loader de-interleaves like the HF loader does.
INTERLEAVED_GGUF_ARCHITECTURES = ("deepseek2", "ernie4_5-moe")
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
        return sorted(n for n in self._tensors if n not in used and not GGUF_IGNORED.search(n))

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
    """Load a GGUF checkpoint into ``(ModelConfig, params)``: the MTP head from the file's NextN
    layers (``glm4moe``; the hybrid family's ``mtp.*`` layer), else a fresh one.

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
    if arch in HYBRID_GGUF_ARCHITECTURES:
        from jmtp.model.checkpoints.gguf_hybrid import load_hybrid
        return load_hybrid(reader, cfg, arch, where, nextn, dtype)
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
