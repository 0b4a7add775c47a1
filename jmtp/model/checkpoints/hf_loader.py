"""Hugging Face checkpoint directories (``config.json`` + ``*.safetensors``) → jmtp parameters.

The job is split by module: :mod:`jmtp.model.checkpoints.hf_config` maps ``config.json`` to
:class:`~jmtp.model.config.ModelConfig` through its table of architectures
(:data:`~jmtp.model.checkpoints.hf_config.ARCHITECTURES`, which lists what is supported);
:mod:`jmtp.model.checkpoints.safetensors_io` reads the tensors; :mod:`jmtp.model.checkpoints.hf_blocks` turns one decoder
layer's tensors into jmtp's layer dict; this module finds the MTP modules (:data:`MTP_LAYOUTS`),
assembles the parameter pytree (:func:`build_params`, also used by the GGUF loader) and loads a
directory (:func:`load_hf`).

Multi-token-prediction (MTP) tensors are picked up in three layouts, whatever the architecture
(the first two are the DeepSeek-V3 MTP layer and the weight names of FastDeploy's ERNIE-4.5 MTP
model, ``ernie4_5_mtp.py``):

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

Block-scaled FP8 checkpoints (``quantization_config``, :mod:`jmtp.model.checkpoints.fp8_checkpoint`) load
without dequantising: their FP8 weights become :class:`~jmtp.model.quant.QuantizedWeight` s and
``ModelConfig.quantization`` records which; every tensor, the MTP layer's included, is checked
against the config as it is read.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
from pathlib import Path
from typing import Iterable

import jax
import jax.numpy as jnp
import numpy as np

from jmtp.model.config import ModelConfig
from jmtp.model.checkpoints.fp8_checkpoint import CheckpointQuant, parse_quantization_config
from jmtp.model.checkpoints.hf_blocks import (TensorReader, deinterleave_rows, device_array, np_dtype,
                                  read_block, stack_layers)
from jmtp.model.checkpoints.hf_config import ARCHITECTURES, SUPPORTED_ARCHITECTURES, architecture, hf_config
from jmtp.model.params import check_params, init_mtp_params, mtp_moe_of_fresh_head
from jmtp.model.schema import layer_shapes, layers_stacked
from jmtp.model.checkpoints.safetensors_io import (SafetensorsFile, SafetensorsSource, TensorSource,
                                       dequantize_block_fp8)

__all__ = ["ARCHITECTURES", "MTP_LAYOUTS", "MTPLayout", "SUPPORTED_ARCHITECTURES",
           "SafetensorsFile", "SafetensorsSource", "TensorSource", "build_params",
           "deinterleave_rows", "dequantize_block_fp8", "detect_mtp", "hf_config", "load_hf"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class MTPLayout:
    """Where one MTP module's tensors live (a row of :data:`MTP_LAYOUTS`).

    Names are templates over ``p`` (the module's prefix from :func:`detect_mtp`) and ``top``
    (ERNIE's top-level prefix, ``"ernie."`` or ``"model."``).

    Attributes:
      enorm, hnorm: the norms of the embedding and of the previous hidden state, ``f[H]``.
      eh_proj: the projection of the two normed inputs, ``[H, 2H]`` torch (out, in).
      final_norm: the module's own final norm ``f[H]``; None: the target's final norm is copied.
      block: the prefix of the module's decoder block.
      eh_hidden_first: ``eh_proj``'s input is ``[hnorm(h); enorm(e)]``: its two input halves are
        swapped into jmtp's ``[enorm(e); hnorm(h)]``.
      paddle_from_eh_shape: the module may be stored Paddle-style (``[in, out]``): ``eh_proj``'s
        (never square) shape tells which, and the block follows it.
      count_is_config: the module count must equal ``num_nextn_predict_layers`` when announced.
    """

    enorm: str
    hnorm: str
    eh_proj: str
    final_norm: str | None
    block: str
    eh_hidden_first: bool = False
    paddle_from_eh_shape: bool = False
    count_is_config: bool = False


MTP_LAYOUTS: dict[str, MTPLayout] = {
    "deepseek": MTPLayout("{p}enorm.weight", "{p}hnorm.weight", "{p}eh_proj.weight",
                          "{p}shared_head.norm.weight", "{p}"),
    "ernie": MTPLayout("{top}mtp_emb_norm.{p}.weight", "{top}mtp_hidden_norm.{p}.weight",
                       "{top}mtp_linear_proj.{p}.weight", None, "{top}mtp_block.{p}.",
                       paddle_from_eh_shape=True),
    "mimo": MTPLayout("{p}token_layernorm.weight", "{p}hidden_layernorm.weight",
                      "{p}input_proj.weight", "{p}final_layernorm.weight", "{p}",
                      eh_hidden_first=True, count_is_config=True),
}


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



def _paddle_from_shape(rd: TensorReader, proj: str, h: int) -> bool:
    """Whether the (never square) MTP projection ``proj`` is stored Paddle-style: ``[2H, H]`` (in,
    out) → True, ``[H, 2H]`` (torch out, in) → False.

    Raises:
      ValueError: naming the tensor, for any other shape (or none).
    """
    shape = tuple(rd.src.shape(proj)) if rd.has(proj) else None
    if shape == (2 * h, h):
        return True
    if shape == (h, 2 * h):
        return False
    raise ValueError(f"{rd.where}: tensor {proj!r} has shape {shape}, expected "
                     f"{(2 * h, h)} (Paddle in→out) or {(h, 2 * h)} (torch out×in)")


def build_params(cfg: ModelConfig, src: TensorSource, where: str, dtype, *,
                 interleaved_rope: bool = False, num_mtp_hint: int = 0,
                 quant: CheckpointQuant | None = None) -> tuple[ModelConfig, dict]:
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
      quant: the checkpoint's FP8 ``quantization_config`` (its FP8 tensors arrive 8-bit from
        ``src`` and stay so; ``cfg.quantization`` is set from them).

    Returns:
      ``(cfg, params)`` with params checked by :func:`jmtp.model.params.check_params`.

    Raises:
      ValueError: naming the tensor and file for a missing tensor or a shape that disagrees with
        the config.
    """
    np_dt = np_dtype(dtype)
    rd = TensorReader(src, where)
    h, v = cfg.hidden_size, cfg.vocab_size
    params: dict = {
        "embed": jnp.asarray(np.asarray(rd.get("model.embed_tokens.weight", (v, h)), np_dt)),
        "final_norm": jnp.asarray(np.asarray(rd.get("model.norm.weight", (h,)), np_dt)),
    }
    if not cfg.tie_word_embeddings:
        params["lm_head"] = jnp.asarray(np.asarray(rd.get("lm_head.weight", (v, h)).T, np_dt))
    kinds = cfg.moe_layer_kinds
    blocks = [read_block(rd, f"model.layers.{i}.", cfg, paddle=False, interleaved=interleaved_rope,
                          moe=kinds[i]) for i in range(cfg.num_layers)]
    if layers_stacked(cfg):
        params["layers"] = stack_layers(blocks, cfg, np_dt, kinds[0])
    else:   # dense and MoE layers mixed: one dict per layer (jmtp.model.schema.layers_stacked)
        params["layers"] = tuple({k: device_array(b[k], np_dt, k) for k in layer_shapes(cfg, m)}
                                 for b, m in zip(blocks, kinds))
    del blocks

    layout, prefixes, top = detect_mtp(rd.names, cfg.num_layers, where)
    if layout is None:
        cfg = mtp_moe_of_fresh_head(cfg.replace(num_mtp_layers=1))
        params["mtp"] = init_mtp_params(cfg, params, jax.random.PRNGKey(0), jnp.dtype(dtype))
        log.info("no MTP weights in %s: initialised a fresh MTP head%s", where,
                 f" (config announces {num_mtp_hint} MTP layers)" if num_mtp_hint else "")
    else:
        n, lay = len(prefixes), MTP_LAYOUTS[layout]
        if lay.count_is_config and num_mtp_hint and n != num_mtp_hint:
            raise ValueError(f"{where}: config field 'num_nextn_predict_layers' = {num_mtp_hint} "
                             f"but the checkpoint holds MiMo MTP layers model.mtp_layers.0..{n - 1}"
                             + (f" (missing tensors under 'model.mtp_layers.{n}.')"
                                if num_mtp_hint > n else ""))
        cfg = cfg.replace(num_mtp_layers=n, mtp_layout=layout)
        block_prefix = [lay.block.format(p=p, top=top) for p in prefixes]
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
        for p in prefixes:
            proj = lay.eh_proj.format(p=p, top=top)
            paddle = _paddle_from_shape(rd, proj, h) if lay.paddle_from_eh_shape else False
            enorm.append(rd.get(lay.enorm.format(p=p, top=top), (h,)))
            hnorm.append(rd.get(lay.hnorm.format(p=p, top=top), (h,)))
            w = rd.linear(proj, 2 * h, h, paddle)                          # f[2H, H]
            eh.append(np.concatenate([w[h:], w[:h]]) if lay.eh_hidden_first else w)
            fnorm.append(rd.get(lay.final_norm.format(p=p, top=top), (h,)) if lay.final_norm
                         else np.asarray(params["final_norm"], np.float32))
            mblocks.append(read_block(rd, lay.block.format(p=p, top=top), cfg, paddle=paddle,
                                      interleaved=interleaved_rope, moe=mtp_moe))
        as_stack = lambda xs: device_array(np.stack(list(xs)), np_dt)   # noqa: E731
        params["mtp"] = {"enorm": as_stack(enorm), "hnorm": as_stack(hnorm), "eh_proj": as_stack(eh),
                         "final_norm": as_stack(fnorm),
                         "layer": stack_layers(mblocks, cfg, np_dt, mtp_moe)}
        log.info("loaded %d MTP module(s) (%s layout) from %s", n, layout, where)
    if quant is not None:
        from jmtp.model.quant_params import config_from_params
        cfg = config_from_params(cfg, params, "fp8", quant.weight_block_size,
                                 quant.activation_scheme)
        log.info("FP8 weights kept 8-bit: %s", ", ".join(cfg.quantization.quantized)
                 if cfg.quantization else "none")
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
    """Load a transformers checkpoint directory (architectures:
    :data:`jmtp.model.checkpoints.hf_config.ARCHITECTURES`; MTP layouts: :data:`MTP_LAYOUTS`).

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
    from jmtp.model.checkpoints import hf_qwen3_next as hybrid
    if (hf.get("architectures") or [None])[0] in hybrid.HYBRID_ARCHITECTURES:
        if (hf.get("quantization_config") or {}):
            raise ValueError(f"{cfg_path}: quantised hybrid checkpoints (field "
                             "'quantization_config') are not supported: the gated-DeltaNet "
                             "layers' fused projections are not read 8-bit yet (load the BF16 "
                             "checkpoint with quantization='int8' instead)")
        return hybrid.build_hybrid_params(hybrid.hybrid_config(hf, str(cfg_path), gen),
                                          SafetensorsSource(d), str(d), dtype)
    quant = parse_quantization_config(hf, str(cfg_path))
    cfg = hf_config(hf, str(cfg_path), gen)
    src = SafetensorsSource(d, quant=quant, num_layers=cfg.num_layers)
    interleaved = architecture(hf, str(cfg_path)).uses_interleaved_rope(hf)
    return build_params(cfg, src, str(d), dtype, interleaved_rope=interleaved,
                        num_mtp_hint=int(hf.get("num_nextn_predict_layers") or 0), quant=quant)
