"""GGUF checkpoints of the hybrid gated-DeltaNet family (llama.cpp's ``qwen3next``, ``qwen35``,
``qwen35moe``): the tensors under transformers' names with every transform of llama.cpp's converter
undone (:class:`HybridGGUFSource`), their checks, and the load through
:func:`jmtp.model.checkpoints.hf_qwen3_next.build_hybrid_params`. :func:`jmtp.model.checkpoints.gguf_loader.load_gguf`
dispatches here; the facts shared with the other GGUF architectures are in
:mod:`jmtp.model.checkpoints.gguf_loader` and :mod:`jmtp.model.checkpoints.gguf_config`."""
from __future__ import annotations

import functools
import logging
from typing import Any

import numpy as np

from jmtp.model.config import ModelConfig
from jmtp.model.checkpoints.gguf_config import GGUF_IGNORED, SUPPORTED_GGUF_TYPES

__all__ = ["HybridGGUFSource", "check_hybrid_tensors", "load_hybrid"]

log = logging.getLogger(__name__)



def _untile(w: np.ndarray, axis: int, hk: int, r: int, d: int) -> np.ndarray:
    """Undo the Qwen3.5 converter's value-head reordering along ``axis`` (``Hv·d`` entries): it
    stores head ``(j, g)`` (the ``j``-th value head of key head ``g``) at ``j·Hk + g``
    ("tiled", for ggml's broadcast) where transformers has it at ``g·r + j`` ("grouped")."""
    shape = w.shape
    w = w.reshape(shape[:axis] + (r, hk, d) + shape[axis + 1:])
    return np.swapaxes(w, axis, axis + 1).reshape(shape)


class HybridGGUFSource:
    """The tensors of a ``qwen3next`` / ``qwen35`` / ``qwen35moe`` GGUF file under transformers'
    names and layouts (``model.layers.{i}.linear_attn.in_proj_qkv.weight`` ..., ``mtp.*``), with
    every transform of llama.cpp's converter (``convert_hf_to_gguf.py``: ``Qwen3NextModel``,
    ``_LinearAttentionVReorderBase``, ``_QwenMtpMixin``) undone, for
    :func:`jmtp.model.checkpoints.hf_qwen3_next.build_hybrid_params`:

    * zero-centred RMSNorms (decoder ``attn_norm`` / ``post_attention_norm``, ``attn_q_norm`` /
      ``attn_k_norm``, ``output_norm``, the MTP ``nextn.enorm`` / ``hnorm`` /
      ``shared_head_norm``) are stored as ``1 + w``: ``w`` is given back (the builder adds the 1
      again); the gated ``ssm_norm`` is stored as is;
    * ``ssm_a`` holds ``-exp(A_log)``: ``A_log = log(-ssm_a)``; ``ssm_dt.bias`` is ``dt_bias``;
      ``ssm_conv1d`` ``[conv_dim, Kc]`` is ``conv1d.weight`` without its middle axis;
    * Qwen3-Next: ``attn_qkv`` (``[q; k; v]`` over all heads, regrouped from
      ``in_proj_qkvz``) and ``attn_gate`` (``z``) are in transformers' head order;
      ``ssm_ba`` is ``in_proj_ba`` (per key head its ``r`` betas then ``r`` alphas), split into
      ``in_proj_b`` / ``in_proj_a``; files from before the regrouping hold ``ssm_in`` =
      ``in_proj_qkvz``;
    * Qwen3.5: ``attn_qkv`` / ``attn_gate`` / ``ssm_beta`` / ``ssm_alpha`` / ``ssm_dt`` /
      ``ssm_a`` / the value channels of ``ssm_conv1d`` / the input columns of ``ssm_out`` hold
      the value heads "tiled" (:func:`_untile`) when ``Hv != Hk``;
    * full attention: ``attn_q`` is the gated ``q_proj`` (per head query then gate, untouched);
      a ``--fuse-qkv`` file's ``attn_qkv`` in a full-attention layer is ``[q_proj; k; v]``;
    * MoE: ``ffn_gate_inp`` (router), ``ffn_{gate,up,down}_exps`` (or ``--fuse-gate-up-exps``'
      ``ffn_gate_up_exps`` = ``[gate; up]``) stacked ``[E, out, in]``, the shared expert
      ``ffn_{gate,up,down}_shexp`` and its gate ``ffn_gate_inp_shexp``;
    * MTP: ``blk.{N+j}`` is ``mtp.layers.{j}``; ``blk.{N}.nextn.eh_proj`` is ``mtp.fc``
      (``[H, 2H]`` over ``[embedding; hidden]``), ``nextn.enorm`` / ``hnorm`` /
      ``shared_head_norm`` are ``mtp.pre_fc_norm_embedding`` / ``pre_fc_norm_hidden`` /
      ``norm`` (llama.cpp uses ``output_norm`` when ``shared_head_norm`` is absent; so does this
      source).
    """

    def __init__(self, reader, where: str, cfg: ModelConfig, arch: str, nextn: int):
        self.where_ = where
        self._tensors = {t.name: t for t in reader.tensors}
        for t in reader.tensors:  # early, explicit error for block formats we do not decode
            if t.tensor_type.name not in SUPPORTED_GGUF_TYPES:
                raise ValueError(
                    f"{where}: tensor {t.name!r} has GGUF type {t.tensor_type.name}, which is not "
                    f"supported (supported: {', '.join(SUPPORTED_GGUF_TYPES)})")
        # HF name -> (GGUF names, transform of their row-major arrays, shape of the result from
        # theirs; None: the transform keeps the single tensor's shape)
        self._map: dict[str, tuple[tuple[str, ...], Any, Any]] = {}
        lc, n = cfg.linear, cfg.num_layers
        hk, hv, kd = lc.num_key_heads, lc.num_value_heads, lc.key_dim
        r, dv = hv // hk, lc.value_head_dim
        tiled = arch != "qwen3next" and hv != hk
        untile = ((lambda w, axis, d: _untile(w, axis, hk, r, d)) if tiled
                  else (lambda w, axis, d: w))
        t = self._tensors

        def add(hf, gs, fn=lambda a: a[0], shape=None):
            gs = (gs,) if isinstance(gs, str) else tuple(gs)
            if all(g in t for g in gs):
                self._map[hf] = (gs, fn, shape)

        def norm(hf, g):                      # stored 1 + w
            add(hf, g, lambda a: a[0] - np.float32(1))

        add("model.embed_tokens.weight", "token_embd.weight")
        norm("model.norm.weight", "output_norm.weight")
        add("lm_head.weight", "output.weight")
        q_rows, kv = 2 * cfg.num_heads * cfg.head_dim, cfg.kv_size
        for i in range(n + nextn):
            b = f"blk.{i}."
            p = f"model.layers.{i}." if i < n else f"mtp.layers.{i - n}."
            norm(p + "input_layernorm.weight", b + "attn_norm.weight")
            norm(p + "post_attention_layernorm.weight", b + "post_attention_norm.weight")
            if i < n and cfg.layer_type(i) == "linear_attention":
                a = p + "linear_attn."
                if b + "attn_qkv.weight" in t or arch != "qwen3next":
                    add(a + "in_proj_qkv.weight", b + "attn_qkv.weight", lambda x: np.concatenate(
                        [x[0][:2 * kd], untile(x[0][2 * kd:], 0, dv)]))
                    add(a + "in_proj_z.weight", b + "attn_gate.weight",
                        lambda x: untile(x[0], 0, dv))
                    if arch == "qwen3next":   # per key head [b (r); a (r)]
                        half = lambda s: (s[0][0] // 2,) + s[0][1:]  # noqa: E731
                        add(a + "in_proj_b.weight", b + "ssm_ba.weight", lambda x: x[0].reshape(
                            hk, 2 * r, -1)[:, :r].reshape(hv, -1), half)
                        add(a + "in_proj_a.weight", b + "ssm_ba.weight", lambda x: x[0].reshape(
                            hk, 2 * r, -1)[:, r:].reshape(hv, -1), half)
                    else:
                        add(a + "in_proj_b.weight", b + "ssm_beta.weight",
                            lambda x: untile(x[0], 0, 1))
                        add(a + "in_proj_a.weight", b + "ssm_alpha.weight",
                            lambda x: untile(x[0], 0, 1))
                else:                         # legacy Qwen3-Next files: the fused projections
                    add(a + "in_proj_qkvz.weight", b + "ssm_in.weight")
                    add(a + "in_proj_ba.weight", b + "ssm_ba.weight")
                add(a + "conv1d.weight", b + "ssm_conv1d.weight", lambda x: np.concatenate(
                    [x[0][:2 * kd], untile(x[0][2 * kd:], 0, dv)])[:, None, :],
                    lambda s: (s[0][0], 1) + s[0][1:])
                add(a + "dt_bias", b + "ssm_dt.bias", lambda x: untile(x[0], 0, 1))
                add(a + "A_log", b + "ssm_a", functools.partial(self._a_log, b + "ssm_a", untile))
                add(a + "norm.weight", b + "ssm_norm.weight")
                add(a + "out_proj.weight", b + "ssm_out.weight", lambda x: untile(x[0], 1, dv))
            else:
                a = p + "self_attn."
                for kind in ("weight", "bias"):
                    if b + f"attn_qkv.{kind}" in t and b + f"attn_q.{kind}" not in t:
                        for proj, lo, hi in (("q", 0, q_rows), ("k", q_rows, q_rows + kv),
                                             ("v", q_rows + kv, q_rows + 2 * kv)):
                            add(f"{a}{proj}_proj.{kind}", b + f"attn_qkv.{kind}",
                                lambda x, lo=lo, hi=hi: x[0][lo:hi],
                                lambda s, lo=lo, hi=hi: (min(hi, s[0][0]) - lo,) + s[0][1:])
                    else:
                        for proj in ("q", "k", "v"):
                            add(f"{a}{proj}_proj.{kind}", b + f"attn_{proj}.{kind}")
                add(a + "o_proj.weight", b + "attn_output.weight")
                norm(a + "q_norm.weight", b + "attn_q_norm.weight")
                norm(a + "k_norm.weight", b + "attn_k_norm.weight")
            m = p + "mlp."
            for proj in ("gate", "up", "down"):
                add(f"{m}{proj}_proj.weight", f"{b}ffn_{proj}.weight")
                add(f"{m}shared_expert.{proj}_proj.weight", f"{b}ffn_{proj}_shexp.weight")
            add(m + "gate.weight", b + "ffn_gate_inp.weight")
            add(m + "shared_expert_gate.weight", b + "ffn_gate_inp_shexp.weight",
                lambda x: x[0].reshape(1, -1), lambda s: (1, int(np.prod(s[0]))))
            if b + "ffn_gate_up_exps.weight" in t:
                add(m + "experts.gate_up_proj", b + "ffn_gate_up_exps.weight")
            else:
                add(m + "experts.gate_up_proj",
                    (b + "ffn_gate_exps.weight", b + "ffn_up_exps.weight"),
                    lambda x: np.concatenate(x, 1),
                    lambda s: (s[0][0], s[0][1] + s[1][1]) + s[0][2:])
            add(m + "experts.down_proj", b + "ffn_down_exps.weight")
        if nextn:
            b = f"blk.{n}.nextn."
            add("mtp.fc.weight", b + "eh_proj.weight")
            norm("mtp.pre_fc_norm_embedding.weight", b + "enorm.weight")
            norm("mtp.pre_fc_norm_hidden.weight", b + "hnorm.weight")
            norm("mtp.norm.weight", b + "shared_head_norm.weight" if b + "shared_head_norm.weight"
                 in t else "output_norm.weight")

    def _a_log(self, g: str, untile, x) -> np.ndarray:
        a = x[0]
        if not np.all(a < 0):
            raise ValueError(f"{self.where_}: tensor {g!r} must hold -exp(A_log) < 0 for every "
                             f"value head, got {a.tolist()}")
        return untile(np.log(-a.astype(np.float64)).astype(np.float32), 0, 1)

    def names(self) -> set[str]:
        return set(self._map)

    def unmapped(self) -> list[str]:
        """GGUF tensors no HF name reads (the NextN layers' optional ``embed_tokens`` /
        ``shared_head_head``, which jmtp's MTP head shares with the target, excepted)."""
        used = {g for gs, _, _ in self._map.values() for g in gs}
        return sorted(n for n in self._tensors if n not in used and not GGUF_IGNORED.search(n))

    def _shape1(self, g: str) -> tuple[int, ...]:
        return tuple(int(s) for s in reversed(self._tensors[g].shape.tolist()))

    def shape(self, name: str) -> tuple[int, ...]:
        gs, _, shape = self._map[name]
        shapes = [self._shape1(g) for g in gs]
        return shapes[0] if shape is None else tuple(shape(shapes))

    def where(self, name: str) -> str:
        gs, _, _ = self._map[name]
        return f"{self.where_} (GGUF tensor {' + '.join(map(repr, gs))})"

    def _get1(self, g: str) -> np.ndarray:
        import gguf.quants

        t = self._tensors[g]
        if t.tensor_type.name in ("F32", "F16"):
            w = np.asarray(t.data, np.float32)
        else:
            w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        return w.reshape(self._shape1(g))

    def get(self, name: str) -> np.ndarray:
        gs, fn, _ = self._map[name]
        return np.ascontiguousarray(fn([self._get1(g) for g in gs]), np.float32)


def check_hybrid_tensors(reader, cfg: ModelConfig, arch: str, where: str, nextn: int) -> None:
    """GGUF-named presence checks of a hybrid file (before any tensor is read): every layer's
    norms; a linear layer's ``ssm_*`` tensors and projections (``attn_qkv`` + ``attn_gate``, or
    a legacy Qwen3-Next ``ssm_in``; ``ssm_ba`` for Qwen3-Next, ``ssm_beta`` + ``ssm_alpha`` for
    Qwen3.5); a full-attention layer's (or MTP layer's) ``attn_q/k/v`` (or a fused ``attn_qkv``),
    ``attn_output``, q/k norms; the FFN: for ``qwen3next`` / ``qwen35moe`` every target layer is
    MoE (router, experts, shared expert and its gate; the expert count matching
    ``{arch}.expert_count``), for ``qwen35`` dense; the first MTP layer's ``nextn.eh_proj``,
    ``nextn.enorm``, ``nextn.hnorm``.

    Raises:
      ValueError: naming the missing GGUF tensor and the layer that needs it, or the tensor and
        the metadata field whose expert count disagree.
    """
    t = {x.name: x for x in reader.tensors}
    n = cfg.num_layers

    def need(g: str, why: str) -> None:
        if g not in t:
            raise ValueError(f"{where}: missing tensor {g!r} ({why})")

    need("output_norm.weight", "the final norm")
    for i in range(n + nextn):
        b = f"blk.{i}."
        linear = i < n and cfg.layer_type(i) == "linear_attention"
        what = (f"blk.{i} is the MTP layer {i - n} (field {arch}.nextn_predict_layers = {nextn})"
                if i >= n else f"layer {i} is a {'linear' if linear else 'full'}-attention layer")
        names = ["attn_norm.weight", "post_attention_norm.weight"]
        if linear:
            if arch == "qwen3next" and b + "attn_qkv.weight" not in t and b + "ssm_in.weight" in t:
                names += ["ssm_in.weight"]                       # legacy fused in_proj_qkvz
            else:
                names += ["attn_qkv.weight", "attn_gate.weight"]
            names += (["ssm_ba.weight"] if arch == "qwen3next"
                      else ["ssm_beta.weight", "ssm_alpha.weight"])
            names += ["ssm_conv1d.weight", "ssm_dt.bias", "ssm_a", "ssm_norm.weight",
                      "ssm_out.weight"]
        else:
            if b + "ssm_a" in t:
                raise ValueError(
                    f"{where}: tensor '{b}ssm_a' makes blk.{i} a linear-attention layer but "
                    + (f"the metadata (field {arch}.attention.recurrent_layers, else "
                       f"{arch}.full_attention_interval) makes it full attention" if i < n
                       else f"it is an MTP layer (field {arch}.nextn_predict_layers = {nextn})"))
            names += ([] if b + "attn_qkv.weight" in t else
                      ["attn_q.weight", "attn_k.weight", "attn_v.weight"])
            names += ["attn_output.weight", "attn_q_norm.weight", "attn_k_norm.weight"]
            if b + "attn_output.bias" in t:
                raise ValueError(f"{where}: tensor '{b}attn_output.bias' is not supported (the "
                                 "hybrid models' attention output projection has no bias)")
        moe = cfg.moe is not None and (i < n or b + "ffn_gate_inp.weight" in t)
        if moe:
            what_ffn = f"layer {i} is a MoE layer" if i < n else what
            ffn = ["ffn_gate_inp.weight"]
            ffn += (["ffn_gate_up_exps.weight"] if b + "ffn_gate_up_exps.weight" in t
                    else ["ffn_gate_exps.weight", "ffn_up_exps.weight"])
            ffn += ["ffn_down_exps.weight", "ffn_gate_shexp.weight", "ffn_up_shexp.weight",
                    "ffn_down_shexp.weight", "ffn_gate_inp_shexp.weight"]
            for g in ffn:
                need(b + g, what_ffn)
            e = cfg.moe.num_experts
            for g in ffn[:-4]:       # GGUF dims innermost first: experts last
                got = int(t[b + g].shape[-1])
                if got != e:
                    raise ValueError(f"{where}: tensor {b + g!r} holds {got} experts but field "
                                     f"{arch}.expert_count = {e}")
        else:
            names += ["ffn_gate.weight", "ffn_up.weight", "ffn_down.weight"]
        if i == n:
            names += ["nextn.eh_proj.weight", "nextn.enorm.weight", "nextn.hnorm.weight"]
        for g in names:
            need(b + g, what)


def load_hybrid(reader, cfg: ModelConfig, arch: str, where: str, nextn: int, dtype):
    from jmtp.model.checkpoints.hf_qwen3_next import build_hybrid_params

    check_hybrid_tensors(reader, cfg, arch, where, nextn)
    src = HybridGGUFSource(reader, where, cfg, arch, nextn)
    unmapped = src.unmapped()
    if unmapped:
        log.warning("%s: %d GGUF tensor(s) not used, e.g. %s", where, len(unmapped),
                    ", ".join(unmapped[:5]))
    return build_hybrid_params(cfg, src, where, dtype)
