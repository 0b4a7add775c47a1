"""transformers checkpoints of the hybrid gated-DeltaNet family: Qwen3-Next (``Qwen3NextForCausalLM``)
and Qwen3.5 text models, dense and MoE (``Qwen3_5ForCausalLM``, ``Qwen3_5MoeForCausalLM``, and the
``...ForConditionalGeneration`` checkpoints, whose text model is read and vision tower ignored),
with their MTP layer (``mtp.*``, which transformers does not load).

Conversions (all exact; :mod:`jmtp.model.gated_deltanet` gives the math):

* Zero-centred RMSNorms (``Qwen3NextRMSNorm``: ``rms(x) · (1 + w)``): every decoder, final, q/k
  and MTP norm is stored as ``1 + w`` so jmtp's ``rms(x) · w`` computes the same function. The
  gated norm of the linear layers (``linear_attn.norm``, ``rms(x) · w · silu(z)``) is not
  zero-centred and is kept as is.
* Gated attention: ``q_proj f[Nq·2D, H]`` holds per head the query then the output gate; split into
  ``wq`` and ``wg``.
* Qwen3-Next's fused ``in_proj_qkvz f[Hk·(2Dk + 2r·Dv), H]`` (per key head: q, k, then its
  ``r = Hv/Hk`` value heads and their z) and ``in_proj_ba f[Hk·2r, H]`` are regrouped into
  ``lin_q, lin_k, lin_v, lin_z, lin_b, lin_a``; Qwen3.5 stores ``in_proj_qkv`` (``[q; k; v]``),
  ``in_proj_z``, ``in_proj_b``, ``in_proj_a`` separately.
* ``conv1d.weight f[conv_dim, 1, Kc]`` (channels ``[q; k; v]``) becomes ``conv_q/k/v f[Kc, ·]``.
* The MTP layer (vLLM ``qwen3_next_mtp``): ``mtp.pre_fc_norm_embedding`` / ``pre_fc_norm_hidden``
  (jmtp ``enorm`` / ``hnorm``), ``mtp.fc f[H, 2H]`` over ``[embedding; hidden]`` (``eh_proj``),
  ``mtp.layers.{j}`` a full-attention decoder layer, ``mtp.norm`` (``final_norm``); the head takes
  the target's post-norm hidden and feeds its post-norm output back (``mtp_layout="qwen3_next"``).

Text-only positions make Qwen3.5's multimodal RoPE (``mrope_section``) the plain RoPE: every
section rotates by the same position.
"""
from __future__ import annotations

import logging
import re

import jax.numpy as jnp
import numpy as np

from jmtp.model.config import LinearAttentionConfig, ModelConfig, MoEConfig
from jmtp.model.checkpoints.hf_blocks import TensorReader, _read_swiglu, np_dtype, read_routed_experts
from jmtp.model.params import check_params
from jmtp.model.schema import layer_kinds, layer_shapes

log = logging.getLogger(__name__)

from jmtp.model.checkpoints.hf_config import HYBRID_ARCHITECTURES  # noqa: E402,F401


def text_config(hf: dict) -> dict:
    """The text model's fields: ``hf["text_config"]`` for the multimodal Qwen3.5 checkpoints (with
    the top-level ``architectures``), else ``hf``."""
    if "text_config" in hf and isinstance(hf["text_config"], dict):
        return {**hf["text_config"], "architectures": hf.get("architectures"),
                "tie_word_embeddings": hf.get("tie_word_embeddings",
                                              hf["text_config"].get("tie_word_embeddings"))}
    return hf


def hybrid_config(hf: dict, where: str, generation_config: dict | None = None) -> ModelConfig:
    """:class:`ModelConfig` of a Qwen3-Next / Qwen3.5 ``config.json``.

    Raises:
      ValueError: naming the field, for a missing required field or an unsupported feature."""
    from jmtp.model.checkpoints.hf_config import _eos_ids
    arch = hf["architectures"][0]
    t = text_config(hf)

    def need(key):
        if t.get(key) is None:
            raise ValueError(f"{where}: missing required field {key!r}")
        return t[key]

    n = int(need("num_hidden_layers"))
    types = t.get("layer_types")
    if types is None:
        interval = int(t.get("full_attention_interval") or 4)
        types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(n)]
    if t.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{where}: field 'hidden_act' = {t.get('hidden_act')!r}; only 'silu'")
    rope = dict(t.get("rope_parameters") or {})
    if rope.get("rope_type", "default") not in (None, "default"):
        raise ValueError(f"{where}: rope type {rope.get('rope_type')!r} (field "
                         "rope_parameters.rope_type) is not supported for the hybrid models")
    if t.get("rope_scaling"):
        raise ValueError(f"{where}: field 'rope_scaling' ({t['rope_scaling']}) is not supported "
                         "for the hybrid models (plain RoPE only; remove it, e.g. the long-context "
                         "YaRN recipe, to serve within max_position_embeddings)")
    # transformers' defaults of these fields differ between the Qwen3-Next and Qwen3.5 classes
    # and from jmtp's other architectures (head_dim 256, partial_rotary_factor 0.25): a config
    # must state them rather than have one guessed
    prf = rope.get("partial_rotary_factor", t.get("partial_rotary_factor"))
    if prf is None:
        raise ValueError(f"{where}: missing required field 'partial_rotary_factor' (top level or "
                         "in rope_parameters)")
    prf = float(prf)
    theta = float(rope.get("rope_theta", t.get("rope_theta", 10000.0)))
    moe = None
    e = int(t.get("num_experts") or 0)
    if e:
        step = int(t.get("decoder_sparse_step") or 1)
        dense = set(t.get("mlp_only_layers") or ())
        layers = tuple(i for i in range(n) if i not in dense and (i + 1) % step == 0)
        shared = int(t.get("shared_expert_intermediate_size") or 0)
        moe = MoEConfig(e, int(need("num_experts_per_tok")), int(need("moe_intermediate_size")),
                        layers=layers, mtp_moe=True, scoring="softmax",
                        norm_topk_prob=bool(t.get("norm_topk_prob", True)),
                        shared_intermediate_size=shared, shared_expert_gate=bool(shared))
    h, nq = int(need("hidden_size")), int(need("num_attention_heads"))
    gen = generation_config or {}
    tie = t.get("tie_word_embeddings")
    return ModelConfig(
        architecture=arch, vocab_size=int(need("vocab_size")), hidden_size=h,
        intermediate_size=int(t.get("intermediate_size") or t.get("moe_intermediate_size") or 1),
        num_layers=n, num_heads=nq, num_kv_heads=int(need("num_key_value_heads")),
        head_dim=int(need("head_dim")), rms_norm_eps=float(t.get("rms_norm_eps", 1e-6)),
        rope_theta=theta, tie_word_embeddings=bool(tie) if tie is not None else False,
        attention_bias=bool(t.get("attention_bias", False)), qk_norm=True,
        partial_rotary_factor=prf, moe=moe,
        max_position_embeddings=int(t.get("max_position_embeddings") or 2048),
        bos_token_id=t.get("bos_token_id"),
        eos_token_ids=_eos_ids(t.get("eos_token_id"), gen.get("eos_token_id")),
        layer_types=tuple(types),
        linear=LinearAttentionConfig(
            num_key_heads=int(need("linear_num_key_heads")),
            num_value_heads=int(need("linear_num_value_heads")),
            key_head_dim=int(need("linear_key_head_dim")),
            value_head_dim=int(need("linear_value_head_dim")),
            conv_kernel_dim=int(t.get("linear_conv_kernel_dim") or 4)),
        attn_output_gate=True, mtp_layout="qwen3_next",
        num_mtp_layers=int(t.get("mtp_num_hidden_layers") or t.get("num_nextn_predict_layers")
                           or 0))


def _norm(rd: TensorReader, name: str, n: int) -> np.ndarray:
    """A zero-centred RMSNorm weight as jmtp's multiplier ``1 + w`` (fp32)."""
    return 1.0 + np.asarray(rd.get(name, (n,)), np.float32)


def _attention(rd: TensorReader, p: str, cfg: ModelConfig) -> dict:
    h, nq, d, kv = cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.kv_size
    a = p + "self_attn."
    qg = rd.get(a + "q_proj.weight", (2 * nq * d, h)).reshape(nq, 2, d, h)
    out = {"wq": qg[:, 0].reshape(nq * d, h).T, "wg": qg[:, 1].reshape(nq * d, h).T,
           "wk": rd.get(a + "k_proj.weight", (kv, h)).T, "wv": rd.get(a + "v_proj.weight", (kv, h)).T,
           "wo": rd.get(a + "o_proj.weight", (h, nq * d)).T,
           "q_norm": _norm(rd, a + "q_norm.weight", d), "k_norm": _norm(rd, a + "k_norm.weight", d)}
    if cfg.attention_bias:
        b = rd.get(a + "q_proj.bias", (2 * nq * d,)).reshape(nq, 2, d)
        if np.any(b[:, 1]):
            raise ValueError(f"{rd.where}: a bias on the attention output gate ({a}q_proj.bias) "
                             "is not supported")
        out.update(bq=b[:, 0].reshape(-1), bk=rd.get(a + "k_proj.bias", (kv,)),
                   bv=rd.get(a + "v_proj.bias", (kv,)))
    return out


def _linear(rd: TensorReader, p: str, cfg: ModelConfig) -> dict:
    lc, h = cfg.linear, cfg.hidden_size
    hk, hv, dk, dv, kc = (lc.num_key_heads, lc.num_value_heads, lc.key_head_dim,
                          lc.value_head_dim, lc.conv_kernel_dim)
    r = hv // hk
    a = p + "linear_attn."
    out = {}
    if rd.has(a + "in_proj_qkvz.weight"):                      # Qwen3-Next, grouped per key head
        w = rd.get(a + "in_proj_qkvz.weight", (hk * (2 * dk + 2 * r * dv), h))
        w = w.reshape(hk, 2 * dk + 2 * r * dv, h)
        out["lin_q"] = w[:, :dk].reshape(hk * dk, h).T
        out["lin_k"] = w[:, dk:2 * dk].reshape(hk * dk, h).T
        out["lin_v"] = w[:, 2 * dk:2 * dk + r * dv].reshape(hv * dv, h).T
        out["lin_z"] = w[:, 2 * dk + r * dv:].reshape(hv * dv, h).T
        ba = rd.get(a + "in_proj_ba.weight", (hk * 2 * r, h)).reshape(hk, 2 * r, h)
        out["lin_b"] = ba[:, :r].reshape(hv, h).T
        out["lin_a"] = ba[:, r:].reshape(hv, h).T
    else:                                                      # Qwen3.5
        w = rd.get(a + "in_proj_qkv.weight", (lc.conv_dim, h))
        out["lin_q"], out["lin_k"] = w[:hk * dk].T, w[hk * dk:2 * hk * dk].T
        out["lin_v"] = w[2 * hk * dk:].T
        out["lin_z"] = rd.get(a + "in_proj_z.weight", (hv * dv, h)).T
        out["lin_b"] = rd.get(a + "in_proj_b.weight", (hv, h)).T
        out["lin_a"] = rd.get(a + "in_proj_a.weight", (hv, h)).T
    conv = rd.get(a + "conv1d.weight", (lc.conv_dim, 1, kc))[:, 0, :].T    # f[Kc, C]
    out["conv_q"], out["conv_k"] = conv[:, :hk * dk], conv[:, hk * dk:2 * hk * dk]
    out["conv_v"] = conv[:, 2 * hk * dk:]
    out["dt_bias"] = rd.get(a + "dt_bias", (hv,))
    out["a_log"] = rd.get(a + "A_log", (hv,))
    out["lin_norm"] = rd.get(a + "norm.weight", (dv,))
    out["lin_out"] = rd.get(a + "out_proj.weight", (h, hv * dv)).T
    return out


def _ffn(rd: TensorReader, p: str, cfg: ModelConfig, moe: bool) -> dict:
    h = cfg.hidden_size
    m = p + "mlp."
    if not moe:
        g, u, d = _read_swiglu(rd, m, h, cfg.intermediate_size, False)
        return {"w_gate": g, "w_up": u, "w_down": d}
    mc = cfg.moe
    e, i = mc.num_experts, mc.moe_intermediate_size
    out = {"router": rd.get(m + "gate.weight", (e, h)).T}
    out.update(read_routed_experts(rd, m, e, i, h))
    if mc.shared_intermediate_size:
        out["shared_gate"], out["shared_up"], out["shared_down"] = _read_swiglu(
            rd, m + "shared_expert.", h, mc.shared_intermediate_size, False)
        out["shared_expert_gate"] = rd.get(m + "shared_expert_gate.weight", (1, h)).T
    return out


def read_hybrid_block(rd: TensorReader, p: str, cfg: ModelConfig, moe: bool,
                      linear: bool) -> dict:
    """One decoder layer under ``p`` in jmtp names (:func:`jmtp.model.schema.layer_shapes`)."""
    h = cfg.hidden_size
    out = {"attn_norm": _norm(rd, p + "input_layernorm.weight", h),
           "mlp_norm": _norm(rd, p + "post_attention_layernorm.weight", h)}
    out.update(_linear(rd, p, cfg) if linear else _attention(rd, p, cfg))
    out.update(_ffn(rd, p, cfg, moe))
    return out


def _prefix(names) -> str:
    """``"model.language_model."`` (multimodal Qwen3.5 checkpoints) or ``"model."``."""
    return ("model.language_model." if any(n.startswith("model.language_model.") for n in names)
            else "model.")


def build_hybrid_params(cfg: ModelConfig, src, where: str, dtype) -> tuple[ModelConfig, dict]:
    """The jmtp parameter pytree of a hybrid checkpoint (layers unstacked: a tuple of per-layer
    dicts) with its MTP head when the checkpoint has ``mtp.*`` (else a fresh head, as for any
    checkpoint without MTP weights).

    Raises:
      ValueError: naming the tensor and file for a missing or mis-shaped tensor."""
    from jmtp.model.params import init_mtp_params
    import jax
    np_dt = np_dtype(dtype)
    rd = TensorReader(src, where)
    pre = _prefix(rd.names)
    h, v = cfg.hidden_size, cfg.vocab_size
    arr = lambda a: jnp.asarray(np.asarray(a, np_dt))   # noqa: E731
    params = {"embed": arr(rd.get(pre + "embed_tokens.weight", (v, h))),
              "final_norm": arr(_norm(rd, pre + "norm.weight", h))}
    if not cfg.tie_word_embeddings:
        params["lm_head"] = arr(rd.get("lm_head.weight", (v, h)).T)
    kinds = layer_kinds(cfg)
    params["layers"] = tuple(
        {k: arr(b[k]) for k in layer_shapes(cfg, *kind)}
        for b, kind in ((read_hybrid_block(rd, f"{pre}layers.{i}.", cfg, *kinds[i]), kinds[i])
                        for i in range(cfg.num_layers)))
    mtp_idx = sorted({int(m.group(1)) for n in rd.names
                      if (m := re.match(r"mtp\.layers\.(\d+)\.", n))})
    if mtp_idx:
        if mtp_idx != list(range(len(mtp_idx))):
            raise ValueError(f"{where}: MTP layers mtp.layers.{mtp_idx} must be numbered "
                             f"0..{len(mtp_idx) - 1}")
        n = len(mtp_idx)
        mtp_moe = rd.has("mtp.layers.0.mlp.gate.weight")
        if mtp_moe and cfg.moe is None:
            raise ValueError(f"{where}: the MTP layer mtp.layers.0.mlp is a MoE block but the "
                             "target config is dense")
        cfg = cfg.replace(num_mtp_layers=n, mtp_layout="qwen3_next",
                          moe=None if cfg.moe is None else cfg.moe.replace(mtp_moe=mtp_moe))
        blocks = [read_hybrid_block(rd, f"mtp.layers.{j}.", cfg, mtp_moe, False) for j in range(n)]
        shapes = layer_shapes(cfg, mtp_moe)
        stack = lambda xs: arr(np.stack([np.asarray(x, np.float32) for x in xs]))  # noqa: E731
        # Qwen3-Next ships one MTP layer with one set of fc / norms (vLLM repeats the layer for
        # every draft step); several layers share them.
        fc = rd.get("mtp.fc.weight", (h, 2 * h)).T
        params["mtp"] = {
            "enorm": stack([_norm(rd, "mtp.pre_fc_norm_embedding.weight", h)] * n),
            "hnorm": stack([_norm(rd, "mtp.pre_fc_norm_hidden.weight", h)] * n),
            "eh_proj": stack([fc] * n),
            "final_norm": stack([_norm(rd, "mtp.norm.weight", h)] * n),
            "layer": {k: stack([b[k] for b in blocks]) for k in shapes}}
        log.info("loaded %d MTP layer(s) (qwen3_next layout) from %s", n, where)
    else:
        from jmtp.model.params import mtp_moe_of_fresh_head
        cfg = mtp_moe_of_fresh_head(cfg.replace(num_mtp_layers=1))
        params["mtp"] = init_mtp_params(cfg, params, jax.random.PRNGKey(0), jnp.dtype(dtype))
        log.info("no MTP weights in %s: initialised a fresh MTP head", where)
    check_params(cfg, params, source=where)
    unused = sorted(n for n in rd.names - rd.used if not n.startswith(("model.visual.", "visual."))
                    and not (cfg.tie_word_embeddings and n == "lm_head.weight"))
    if unused:
        log.warning("%s: %d checkpoint tensor(s) not used, e.g. %s", where, len(unused),
                    ", ".join(unused[:5]))
    return cfg, params

