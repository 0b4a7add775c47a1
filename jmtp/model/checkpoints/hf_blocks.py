"""One decoder layer's HF-named tensors → jmtp's layer dict (names of
:func:`jmtp.model.schema.layer_shapes`, ``[in, out]`` weights), and the layers stacked.

Every supported architecture uses transformers' Llama tensor names under a layer prefix
(``input_layernorm``, ``post_attention_layernorm``, ``self_attn.{q,k,v,o}_proj``,
``mlp.{gate,up,down}_proj``), with per-architecture additions read when present or when the config
asks for them: q/k/v biases, ``self_attn.{q,k}_norm``, fused ``qkv_proj`` / ``up_gate_proj``
(``[q; k; v]`` / ``[gate; up]`` along the output axis, as FastDeploy's ERNIE-4.5 MTP block and
``swiglu`` split them), mixture-of-experts FFNs (:func:`_read_moe`) and DeepSeek-V3's multi-head
latent attention (:func:`_read_mla_attention`). Torch Linear weights are ``[out, in]``, Paddle ones
``[in, out]`` (``paddle``). Checkpoints whose attention uses interleaved RoPE pairs get their q/k
output rows permuted (:func:`deinterleave_rows`), after which jmtp's rotate-half forward is exact.
A block-scaled FP8 tensor arrives as a :class:`~jmtp.model.checkpoints.fp8_checkpoint.QArray` and goes
through the same transposes, slices, row permutations and stacks (the permutations stay inside
the scale blocks) to the device as a :class:`~jmtp.model.quant.QuantizedWeight`
(:func:`device_array`).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jmtp.model.config import ModelConfig
from jmtp.model.checkpoints.fp8_checkpoint import QArray, is_qarray, to_quantized
from jmtp.model.schema import layer_shapes, leaf_dtype
from jmtp.model.checkpoints.safetensors_io import TensorSource


def deinterleave_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Reorder the output rows of a per-head projection from interleaved RoPE pairs ``(2i, 2i+1)``
    to rotate-half pairs ``(i, i + D/2)``: ``new[h, j*D/2 + i] = old[h, 2i + j]``.

    ``w: f[num_heads*D, ...]`` (torch layout, rows = outputs; also biases ``f[num_heads*D]`` and
    per-head norm weights ``f[D]`` with ``num_heads=1``). The same map undoes llama.cpp's
    ``convert_hf_to_gguf.py`` permutation of ``wq``/``wk`` (its ``permute`` does the inverse),
    matching transformers' ``LlamaTensorProcessor._reverse_permute_weights``.
    """
    return w[deinterleave_perm(w.shape[0], num_heads)]


def deinterleave_perm(rows: int, num_heads: int) -> np.ndarray:
    """The row order of :func:`deinterleave_rows`: ``new[r] = old[perm[r]]``."""
    if rows % (2 * num_heads):
        raise ValueError(f"cannot de-interleave {rows} rows into {num_heads} heads of even size")
    d2 = rows // num_heads // 2
    return np.arange(rows).reshape(num_heads, d2, 2).swapaxes(1, 2).reshape(rows)


class TensorReader:
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


def _read_swiglu(rd: TensorReader, p: str, h: int, i: int, paddle: bool) -> tuple:
    """``(gate f[H, I], up f[H, I], down f[I, H])`` of a SwiGLU under ``p`` (``p + "gate_proj"``
    ... or a fused ``up_gate_proj`` = ``[gate; up]`` along the output axis)."""
    if rd.has(p + "up_gate_proj.weight"):
        w = rd.linear(p + "up_gate_proj.weight", h, 2 * i, paddle)
        gate, up = w[:, :i], w[:, i:]
    else:
        gate = rd.linear(p + "gate_proj.weight", h, i, paddle)
        up = rd.linear(p + "up_proj.weight", h, i, paddle)
    return gate, up, rd.linear(p + "down_proj.weight", i, h, paddle)


def read_routed_experts(rd: TensorReader, p: str, e: int, i: int, h: int,
                        paddle: bool = False) -> dict[str, np.ndarray]:
    """The E routed experts under ``p`` (``...mlp.``) as ``experts_gate, experts_up f[E, H, I]``,
    ``experts_down f[E, I, H]``: transformers v5's fused ``experts.gate_up_proj f[E, 2I, H]`` /
    ``experts.down_proj f[E, H, I]``, or per-expert ``experts.{j}.{gate,up,down}_proj``."""
    if rd.has(p + "experts.gate_up_proj"):        # transformers v5 in-memory layout
        gu = rd.get(p + "experts.gate_up_proj", (e, 2 * i, h))
        return {"experts_gate": gu[:, :i].transpose(0, 2, 1),
                "experts_up": gu[:, i:].transpose(0, 2, 1),
                "experts_down": rd.get(p + "experts.down_proj", (e, h, i)).transpose(0, 2, 1)}
    g, u, d = zip(*(_read_swiglu(rd, f"{p}experts.{j}.", h, i, paddle) for j in range(e)))
    return {"experts_gate": np.stack(g), "experts_up": np.stack(u), "experts_down": np.stack(d)}


def _read_moe(rd: TensorReader, p: str, cfg: ModelConfig, paddle: bool) -> dict[str, np.ndarray]:
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
    out.update(read_routed_experts(rd, p, e, i, h, paddle))
    if m.shared_intermediate_size:
        out["shared_gate"], out["shared_up"], out["shared_down"] = _read_swiglu(
            rd, p + "shared_experts.", h, m.shared_intermediate_size, paddle)
    elif any(n.startswith(p + "shared_experts.") for n in rd.names):
        raise ValueError(f"{rd.where}: checkpoint has {p}shared_experts.* but the config has no "
                         "shared experts")
    return out


def read_block(rd: TensorReader, prefix: str, cfg: ModelConfig, *, paddle: bool,
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


def _read_ffn(rd: TensorReader, p: str, cfg: ModelConfig, paddle: bool,
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
    per = w.shape[0] // groups
    perm = np.arange(w.shape[0]).reshape(groups, per)
    perm[:, per - tail:] = perm[:, per - tail:][:, deinterleave_perm(tail, 1)]
    return w[perm.reshape(-1)]


def _read_mla_attention(rd: TensorReader, p: str, cfg: ModelConfig, *,
                        interleaved: bool) -> dict[str, np.ndarray]:
    """DeepSeek-V3 MLA tensors under ``p + "self_attn."`` in jmtp names and ``[in, out]`` layout
    (:func:`jmtp.model.schema.attention_shapes`). ``interleaved`` (HF ``rope_interleave``): the rotary
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


def stack_layers(blocks: list[dict[str, np.ndarray]], cfg: ModelConfig, dtype,
           moe: bool = False) -> dict[str, jax.Array]:
    """Stack per-layer tensors on a new leading axis, converting once to ``dtype`` (the MoE
    score-correction bias stays f32; 8-bit tensors stay 8-bit, :func:`device_array`).

    Raises:
      ValueError: a tensor 8-bit in some layers and float in others."""
    shapes = layer_shapes(cfg, moe)
    out = {}
    for name, shape in shapes.items():
        if any(is_qarray(b[name]) for b in blocks):
            out[name] = device_array(np.stack([b[name] for b in blocks]), dtype, name)
            continue
        buf = np.empty((len(blocks),) + shape, leaf_dtype(name, dtype))
        for j, b in enumerate(blocks):
            buf[j] = b[name]
        out[name] = jnp.asarray(buf)
    return out


def device_array(x, dtype, name: str = ""):
    """A loaded tensor on the device: a float array in ``dtype`` (the MoE score-correction bias
    in f32), or a :class:`~jmtp.model.checkpoints.fp8_checkpoint.QArray` as an 8-bit
    :class:`~jmtp.model.quant.QuantizedWeight` (its values and scales as they are)."""
    if isinstance(x, QArray):
        return to_quantized(x)
    return jnp.asarray(np.asarray(x, leaf_dtype(name, dtype)))


def np_dtype(dtype) -> np.dtype:
    return np.dtype(jnp.dtype(dtype))
