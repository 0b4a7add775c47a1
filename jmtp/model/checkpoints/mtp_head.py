"""MTP head files: the trained ``params["mtp"]`` of a target as one small safetensors file.

A head file (``jmtp-mtp-head-v1``) holds the MTP module's tensors under flat names (``mtp.enorm``,
``mtp.layer.wq``, ...), optionally the FR-Spec token ranking ``draft_vocab i32[V]`` (token ids by
descending frequency in the head's training data), and string metadata: format, hidden/vocab size,
MTP layout, the draft vocabulary size the head was trained for, training facts. Written by
:mod:`jmtp.train` (``scripts/train_mtp.py``); read by :func:`jmtp.model.checkpoints.loader.load_checkpoint`, which
attaches the head shipped in ``jmtp/data`` to the default model, as a dict by :func:`load_mtp_head`
and as an :class:`~jmtp.model.modules.MTPHead` module by :func:`load_mtp_head_module`.
"""
from __future__ import annotations

import os

import jax.numpy as jnp
import numpy as np

from jmtp.model.config import ModelConfig

HEAD_FORMAT = "jmtp-mtp-head-v1"
DRAFT_VOCAB_TENSOR = "draft_vocab"


def _flatten(tree: dict, prefix: str) -> dict:
    out = {}
    for k, v in tree.items():
        name = f"{prefix}.{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, name))
        else:
            out[name] = v
    return out


def export_mtp_head(path: str, mtp, cfg: ModelConfig, dtype=jnp.bfloat16,
                    metadata: dict | None = None, draft_vocab: np.ndarray | None = None,
                    draft_vocab_size: int = 0) -> None:
    """Write ``params["mtp"]`` as safetensors with flat names (``mtp.enorm``, ``mtp.layer.wq``, ...).

    ``mtp`` is the dict (``enorm, hnorm, final_norm f[N, H]``, ``eh_proj f[N, 2H, H]``, ``layer``
    the stacked layer dict) or an :class:`~jmtp.model.modules.MTPHead` (its :meth:`to_params`;
    the file is the same either way).

    Stored in ``dtype`` (bf16 by default: a SmolLM2-135M head is ~8.5 MB). The safetensors metadata
    records the format, hidden size, vocabulary size and MTP layout so that :func:`load_mtp_head`
    callers can check the head fits their model.

    Args:
      draft_vocab: optional ``i32[V]`` token ranking (most frequent first) stored beside the head.
      draft_vocab_size: the FR-Spec vocabulary size the head was trained for (metadata; needs
        ``draft_vocab``), the default ``ModelConfig.draft_vocab_size`` when the head is attached.

    Raises:
      ValueError: ``draft_vocab_size`` > 0 without a ``draft_vocab`` that long.
    """
    from safetensors.flax import save_file

    if draft_vocab_size and (draft_vocab is None or len(draft_vocab) < draft_vocab_size):
        raise ValueError(f"draft_vocab_size={draft_vocab_size} needs a draft_vocab ranking at least "
                         "that long")
    if hasattr(mtp, "to_params"):          # an MTPHead module
        mtp = mtp.to_params()
    tensors = {k: jnp.asarray(v).astype(dtype) for k, v in _flatten(mtp, "mtp").items()}
    if draft_vocab is not None:
        tensors[DRAFT_VOCAB_TENSOR] = jnp.asarray(np.asarray(draft_vocab, np.int32))
    meta = {"format": HEAD_FORMAT, "hidden_size": str(cfg.hidden_size),
            "vocab_size": str(cfg.vocab_size), "mtp_layout": cfg.mtp_layout,
            "num_mtp_layers": str(int(mtp["enorm"].shape[0])),
            "draft_vocab_size": str(int(draft_vocab_size))}
    meta.update({k: str(v) for k, v in (metadata or {}).items()})
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    save_file(tensors, path, metadata=meta)


def load_mtp_head(path: str, dtype=None) -> dict:
    """Load a head written by :func:`export_mtp_head`; returns the ``params["mtp"]`` subtree.

    Args:
      dtype: cast every tensor to this dtype (default: as stored).

    Raises:
      FileNotFoundError: no file at ``path``.
      ValueError: a tensor name outside ``mtp.*`` or a missing ``mtp.enorm``/``mtp.layer.*``.
    """
    from safetensors.flax import load_file

    if not os.path.exists(path):
        raise FileNotFoundError(f"no MTP head at {path}")
    flat = load_file(path)
    tree: dict = {}
    for name, arr in flat.items():
        if name == DRAFT_VOCAB_TENSOR:
            continue
        parts = name.split(".")
        if parts[0] != "mtp" or len(parts) < 2:
            raise ValueError(f"{path}: tensor {name!r} is not an MTP head tensor (mtp.*)")
        node = tree
        for p in parts[1:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = arr.astype(dtype) if dtype is not None else arr
    for need in ("enorm", "hnorm", "eh_proj", "final_norm", "layer"):
        if need not in tree:
            raise ValueError(f"{path}: missing tensor group 'mtp.{need}'")
    return tree


def head_metadata(path: str) -> dict:
    """The string metadata of a head file (format, hidden_size, vocab_size, mtp_layout, ...)."""
    from safetensors import safe_open

    with safe_open(path, framework="numpy") as f:
        return dict(f.metadata() or {})


def save_token_freq(path: str, ids: np.ndarray, counts: np.ndarray) -> None:
    """Save an FR-Spec frequency table (``ids i32[V]`` by descending ``counts i64[V]``)."""
    from safetensors.numpy import save_file

    save_file({"ids": np.asarray(ids, np.int32), "counts": np.asarray(counts, np.int64)}, path,
              metadata={"format": "jmtp-token-freq-v1"})


def load_draft_vocab(path: str, n: int) -> np.ndarray:
    """The ``n`` most frequent token ids (``i32[n]``, most frequent first) of a saved frequency table.

    Raises:
      ValueError: if ``n`` is not in ``[1, V]``.
    """
    from safetensors.numpy import load_file

    ids = load_file(path)["ids"]
    if not 1 <= n <= len(ids):
        raise ValueError(f"draft vocabulary size must lie in [1, {len(ids)}], got {n}")
    return ids[:n].astype(np.int32)


def load_draft_ranking(path: str) -> np.ndarray | None:
    """The ``draft_vocab i32[V]`` token ranking stored in a head file, or None if it has none."""
    from safetensors import safe_open

    with safe_open(path, framework="numpy") as f:
        if DRAFT_VOCAB_TENSOR not in f.keys():
            return None
        return np.asarray(f.get_tensor(DRAFT_VOCAB_TENSOR), np.int32)


def check_head_fits(cfg: ModelConfig, path: str) -> dict:
    """The head file's metadata (:func:`head_metadata`) after checking it was written for a model
    like ``cfg``.

    Raises:
      FileNotFoundError: no file at ``path``.
      ValueError: the head's hidden size, vocabulary size or MTP layout differ from ``cfg``.
    """
    if not os.path.exists(path):
        raise FileNotFoundError(f"no MTP head at {path}")
    meta = head_metadata(path)
    for key, want in (("hidden_size", str(cfg.hidden_size)), ("vocab_size", str(cfg.vocab_size)),
                      ("mtp_layout", cfg.mtp_layout)):
        if meta.get(key, want) != want:
            raise ValueError(f"{path}: MTP head has {key}={meta.get(key)}, the model {want}")
    return meta


def load_mtp_head_module(path: str, cfg: ModelConfig, dtype=None):
    """Load a head written by :func:`export_mtp_head` into an
    :class:`~jmtp.model.modules.MTPHead` of ``cfg`` (the module form of :func:`load_mtp_head`).

    The module's Params carry their logical axes (:mod:`jmtp.model.axes`): ``enorm, hnorm,
    final_norm f[N, H]``, ``eh_proj f[N, 2H, H]``, ``layer.*`` stacked ``f[N, ...]``, with N the
    file's number of MTP modules. ``head.to_params()`` equals ``load_mtp_head(path, dtype)``.
    The file's token ranking (if any) is not part of the module: see :func:`load_draft_ranking`.

    Args:
      dtype: cast every tensor to this dtype (default: as stored, bf16 for exported heads).

    Raises:
      FileNotFoundError: no file at ``path``.
      ValueError: the head was written for another hidden size, vocabulary size or MTP layout;
        a tensor outside ``mtp.*``, missing, of the wrong shape for ``cfg``, or one ``cfg`` has no
        place for (e.g. attention biases the model lacks).
    """
    from jmtp.model.modules import MTPHead

    check_head_fits(cfg, path)
    return MTPHead.from_params(cfg, load_mtp_head(path, dtype))


def attach_mtp_head(cfg: ModelConfig, params: dict, path: str) -> tuple[ModelConfig, dict]:
    """``(cfg, params)`` with the head file at ``path`` as ``params["mtp"]`` (in the dtype of
    ``params["embed"]``), its token ranking as ``params["draft_vocab"]`` and
    ``cfg.num_mtp_layers`` / ``cfg.draft_vocab_size`` from the file.

    Raises:
      FileNotFoundError: no file at ``path``.
      ValueError: the head's hidden size, vocabulary size or MTP layout differ from ``cfg``, or
        its block is MoE (``layer.router``) for a dense model. For a MoE model the block's FFN
        kind is the file's (``cfg.moe.mtp_moe``).
    """
    meta = check_head_fits(cfg, path)
    from jmtp.model.llama import param_dtype
    mtp = load_mtp_head(path, dtype=param_dtype(params))
    ranking = load_draft_ranking(path)
    params = dict(params, mtp=mtp)
    if ranking is not None:
        params["draft_vocab"] = ranking
    n = int(meta.get("draft_vocab_size", "0")) if ranking is not None else 0
    moe_head = "router" in mtp["layer"]          # the head's block has a MoE FFN
    if moe_head and cfg.moe is None:
        raise ValueError(f"{path}: the MTP head's block is a MoE block but the model is dense")
    if cfg.moe is not None:
        cfg = cfg.replace(moe=cfg.moe.replace(mtp_moe=moe_head))
    return cfg.replace(num_mtp_layers=int(mtp["enorm"].shape[0]), draft_vocab_size=n), params
