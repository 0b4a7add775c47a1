"""A disk cache of converted GGUF checkpoints: dequantise and parse a file once, load it in a blink.

Loading a GGUF file costs seconds every run that have nothing to do with the weights' values:
``gguf.GGUFReader`` parses every metadata string one by one (SmolLM2's 49,152-token vocabulary and
its merges: ~3.7 s on a 2-core CPU), the quantised tensors are dequantised block by block (~2 s)
and the per-layer matrices are stacked (~1.7 s). The result depends only on the file's bytes, the
parameter dtype and jmtp's conversion code, so it is cached on disk after the first load:

* ``<cache>/<sha256 of the file>-<dtype>-<code digest>/``: ``params.safetensors`` (the
  parameter pytree's arrays), ``tree.json`` (the pytree's structure) and ``config.json`` (the
  :class:`~jmtp.model.config.ModelConfig`);
* ``<cache>/<sha256>-tokenizer-<code digest>/``: the tokenizer (``tokenizers`` JSON) and its
  chat template, special ids and names (``meta.json``).

The key is the SHA-256 of the file's content (0.06 s for SmolLM2's 94 MiB), so a file replaced in
place, renamed or copied elsewhere is never served stale weights, and a digest of the code that
converts it (every :mod:`jmtp.model` module, and the versions of jax, jaxlib, gguf and numpy:
:func:`code_digest`), so an entry written by other conversion code (another jmtp version, a
local edit, another jax) is never read; publishing an entry removes the entries of the same file
and kind written by other code. Warnings the conversion logs (e.g. unused tensors) appear on the
converting load only. Entries are written to a temporary folder and renamed into place, so
concurrent processes (pytest workers) never read half an entry; a cache that cannot be written
(read-only, disk full) only logs a warning, and a corrupt entry is converted again. The folder is
``$JMTP_WEIGHTS_CACHE_DIR``, else ``$XDG_CACHE_HOME/jmtp/weights``, else
``~/.cache/jmtp/weights``; ``JMTP_WEIGHTS_CACHE_DIR=off`` turns the cache off. An entry holds the
weights dequantised (SmolLM2 in f32: 0.5 GiB); remove the folder to reclaim the space.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
import shutil
import tempfile
import typing
from pathlib import Path
from typing import Any, Callable

import jax.numpy as jnp

from jmtp.model.config import ModelConfig

log = logging.getLogger(__name__)

#: Packages whose versions can change what a file converts to (dequantisation, the fresh MTP
#: head's random draw); hashed into every key with the source of every ``jmtp.model`` module.
VERSIONED_PACKAGES = ("jax", "jaxlib", "gguf", "numpy")
_OFF = ("", "0", "off", "none", "false")


def default_weights_cache_dir() -> str | None:
    """``$JMTP_WEIGHTS_CACHE_DIR`` (``off``, ``0``, ``none``, ``false`` or empty: None, no cache),
    else ``$XDG_CACHE_HOME/jmtp/weights``, else ``~/.cache/jmtp/weights``."""
    env = os.environ.get("JMTP_WEIGHTS_CACHE_DIR")
    if env is not None:
        return None if env.strip().lower() in _OFF else os.path.expanduser(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "jmtp", "weights")


@functools.lru_cache(maxsize=1)
def code_digest() -> str:
    """16 hex digits of SHA-256 over the source of every module of :mod:`jmtp.model` and the
    versions of :data:`VERSIONED_PACKAGES`: an entry written by other conversion code is never
    read."""
    import importlib.metadata

    h = hashlib.sha256()
    model_dir = Path(__file__).parents[1]       # jmtp/model, checkpoints/ included
    for f in sorted(model_dir.rglob("*.py")):
        h.update(f.relative_to(model_dir).as_posix().encode() + b"\0" + f.read_bytes())
    for name in VERSIONED_PACKAGES:
        try:
            h.update(f"{name}={importlib.metadata.version(name)}".encode())
        except importlib.metadata.PackageNotFoundError:
            h.update(f"{name}=none".encode())
    return h.hexdigest()[:16]


@functools.lru_cache(maxsize=8)
def _digest(path: str, mtime_ns: int, size: int) -> str:   # (mtime, size): the memo's key
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def file_digest(path: str | os.PathLike) -> str:
    """SHA-256 (hex) of the file's bytes; remembered per (path, mtime, size) in this process."""
    p = os.path.realpath(os.fspath(path))
    st = os.stat(p)
    return _digest(p, st.st_mtime_ns, st.st_size)


# ------------------------------------------------------------------ ModelConfig <-> JSON
def config_to_dict(cfg: ModelConfig) -> dict[str, Any]:
    """``cfg`` as plain JSON values (nested configs as dicts, tuples as lists)."""
    return dataclasses.asdict(cfg)


def _dataclass_of(hint):
    """The dataclass a field's type hint names (``RopeScaling | None`` -> ``RopeScaling``)."""
    if dataclasses.is_dataclass(hint):
        return hint
    return next((a for a in typing.get_args(hint) if dataclasses.is_dataclass(a)), None)


def _from_dict(cls, data: dict[str, Any]):
    hints = typing.get_type_hints(cls)
    kw = {}
    for f in dataclasses.fields(cls):
        if f.name not in data:
            continue
        v = data[f.name]
        if isinstance(v, dict):
            sub = _dataclass_of(hints[f.name])
            if sub is None:
                raise ValueError(f"{cls.__name__}.{f.name}: a dict for a field that is no "
                                 "dataclass")
            v = _from_dict(sub, v)
        elif isinstance(v, list):
            v = tuple(v)
        kw[f.name] = v
    return cls(**kw)


def config_from_dict(data: dict[str, Any]) -> ModelConfig:
    """The inverse of :func:`config_to_dict`.

    Raises:
      ValueError/TypeError: from :class:`ModelConfig`'s own checks on bad values.
    """
    return _from_dict(ModelConfig, data)


# ------------------------------------------------------------------ params <-> arrays + skeleton
def _split(tree, arrays: dict[str, Any]):
    """A JSON skeleton of ``tree`` (dicts, tuples, lists, None) whose array leaves are moved into
    ``arrays`` under the keys ``"0"``, ``"1"``, ... (the names in the safetensors file)."""
    if isinstance(tree, dict):
        return ["dict", {k: _split(v, arrays) for k, v in tree.items()}]
    if isinstance(tree, (tuple, list)):
        return [type(tree).__name__, [_split(v, arrays) for v in tree]]
    if tree is None:
        return ["none"]
    key = str(len(arrays))
    arrays[key] = tree
    return ["leaf", key]


def _join(skeleton, arrays: dict[str, Any]):
    """The inverse of :func:`_split`."""
    kind = skeleton[0]
    if kind == "dict":
        return {k: _join(v, arrays) for k, v in skeleton[1].items()}
    if kind in ("tuple", "list"):
        items = [_join(v, arrays) for v in skeleton[1]]
        return tuple(items) if kind == "tuple" else items
    if kind == "none":
        return None
    if kind == "leaf":
        return arrays[skeleton[1]]
    raise ValueError(f"unknown skeleton node {kind!r}")


def _publish(cache_dir: str, name: str, write: Callable[[Path], None]) -> None:
    """Write an entry into a temporary folder, then rename it into place (first writer wins), and
    remove the entries of the same file and kind that other conversion code wrote."""
    final = Path(cache_dir) / name
    if final.is_dir():
        return
    try:
        os.makedirs(cache_dir, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=cache_dir))
        try:
            write(tmp)
            os.replace(tmp, final)
        except OSError:
            if not final.is_dir():    # else another process published it first
                raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    except Exception as e:   # OSError, or the writer's own (e.g. safetensors') errors
        log.warning("weights cache %s: could not write %s (%s); loading stays uncached",
                    cache_dir, name, e)
        return
    stem = name.rsplit("-", 1)[0]            # <file digest>-<kind>
    for old in Path(cache_dir).glob(f"{stem}-*"):
        if old.name != name and old.is_dir():
            shutil.rmtree(old, ignore_errors=True)


def _cached(path, kind: str, make: Callable[[], Any], read: Callable[[Path], Any],
            write: Callable[[Path, Any], None], cache_dir: str | None) -> Any:
    """``read(entry)`` of the entry for ``path``'s bytes, ``kind`` and the conversion code when
    it exists and reads, else ``make()``, stored with ``write(folder, value)``."""
    if cache_dir == "auto":
        cache_dir = default_weights_cache_dir()
    if cache_dir is None:
        return make()
    name = f"{file_digest(path)}-{kind}-{code_digest()}"
    entry = Path(cache_dir) / name
    if entry.is_dir():
        try:
            value = read(entry)
            log.info("%s of %s from cache %s", kind, os.fspath(path), entry)
            return value
        except Exception as e:
            if isinstance(e, (OSError, MemoryError)) and not isinstance(e, FileNotFoundError):
                # the machine's trouble (permissions, memory), not the entry's: leave it
                log.warning("cache entry %s could not be read (%s): converting", entry, e)
                return make()
            # a corrupt entry: a missing file, bad JSON, safetensors' or tokenizers' errors
            log.warning("cache entry %s is unreadable (%s): converting again", entry, e)
            shutil.rmtree(entry, ignore_errors=True)
    value = make()
    _publish(cache_dir, name, lambda tmp: write(tmp, value))
    return value


def load_params_cached(path: str | os.PathLike, dtype, convert: Callable[[], tuple],
                       cache_dir: str | None = "auto") -> tuple[ModelConfig, dict]:
    """``convert()``'s ``(ModelConfig, params)`` for the checkpoint file ``path``, from the cache
    when an entry for the file's content and ``dtype`` exists, else converted and stored.

    Args:
      path: the checkpoint file (its SHA-256 is the key).
      dtype: the parameter dtype ``convert`` produces (part of the key).
      convert: loads the file without the cache (e.g. ``lambda: load_gguf(path, dtype)``).
      cache_dir: ``"auto"``: :func:`default_weights_cache_dir`; ``None``: no cache.

    Returns:
      ``(cfg, params)`` with params a nested dict of device arrays, equal to ``convert()``'s.
    """
    from safetensors.flax import load_file, save_file

    def read(entry: Path):
        cfg = config_from_dict(json.loads((entry / "config.json").read_text()))
        skeleton = json.loads((entry / "tree.json").read_text())
        return cfg, _join(skeleton, load_file(str(entry / "params.safetensors")))

    def write(tmp: Path, value) -> None:
        cfg, params = value
        arrays: dict[str, Any] = {}
        skeleton = _split(params, arrays)
        save_file(arrays, str(tmp / "params.safetensors"))
        (tmp / "tree.json").write_text(json.dumps(skeleton))
        (tmp / "config.json").write_text(json.dumps(config_to_dict(cfg)))

    return _cached(path, jnp.dtype(dtype).name, convert, read, write, cache_dir)


def load_tokenizer_cached(path: str | os.PathLike, build: Callable[[], Any],
                          cache_dir: str | None = "auto"):
    """``build()``'s :class:`~jmtp.model.checkpoints.tokenizer.Tokenizer` for the file ``path``, from the
    cache when an entry for the file's content exists, else built and stored (see
    :func:`load_params_cached` for ``cache_dir``)."""
    from tokenizers import Tokenizer as HFTokenizer

    from jmtp.model.checkpoints.tokenizer import Tokenizer

    def read(entry: Path):
        meta = json.loads((entry / "meta.json").read_text())
        return Tokenizer(HFTokenizer.from_file(str(entry / "tokenizer.json")),
                         eos_token_ids=meta["eos_token_ids"], bos_token_id=meta["bos_token_id"],
                         chat_template=meta["chat_template"],
                         special_tokens=meta["special_tokens"], source=os.fspath(path))

    def write(tmp: Path, tok) -> None:
        tok.backend.save(str(tmp / "tokenizer.json"))
        (tmp / "meta.json").write_text(json.dumps({
            "eos_token_ids": list(tok.eos_token_ids), "bos_token_id": tok.bos_token_id,
            "chat_template": tok.chat_template, "special_tokens": tok.special_tokens}))

    return _cached(path, "tokenizer", build, read, write, cache_dir)
