"""Safetensors checkpoints read straight from the documented file format (huggingface/safetensors
README: 8-byte little-endian header length, JSON header, raw little-endian data) through
``np.memmap``, so bf16/fp8 tensors need no torch.

:class:`SafetensorsSource` is one checkpoint directory's tensors in HF naming and torch
(``[out, in]``) layout, the :class:`TensorSource` the HF loader (:mod:`jmtp.model.checkpoints.hf_loader`)
reads. Block-scaled FP8 weights (DeepSeek-V3/R1, GLM-4.5-FP8, Qwen3-FP8) come out 8-bit, as
:class:`~jmtp.model.checkpoints.fp8_checkpoint.QArray` s (values and their ``weight_scale_inv`` grid), each
tensor checked against the config's ``quantization_config``
(:func:`jmtp.model.checkpoints.fp8_checkpoint.check_tensor`); :func:`dequantize_block_fp8` is the numpy
dequantisation (``w · scale_inv`` per block) the tests compare with.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Protocol

import ml_dtypes
import numpy as np

from jmtp.model.checkpoints.fp8_checkpoint import CheckpointQuant, QArray, check_tensor


class TensorSource(Protocol):
    """Named checkpoint tensors in HF naming and HF (torch, ``[out, in]``) layout."""

    def names(self) -> set[str]: ...

    def shape(self, name: str) -> tuple[int, ...]: ...

    def get(self, name: str) -> np.ndarray: ...

    def where(self, name: str) -> str: ...


_ST_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
    "BOOL": np.bool_, "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
}
_FLOAT_ST_DTYPES = ("F64", "F32", "F16", "BF16")
_FP8_ST_DTYPES = ("F8_E4M3",)


def dequantize_block_fp8(w: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int] | None,
                         where: str) -> np.ndarray:
    """DeepSeek-V3 block-scaled fp8 -> f32: ``w[i, j] * scale_inv[i // bm, j // bn]``.

    ``w f8_e4m3[M, N]``, ``scale_inv f32[ceil(M/bm), ceil(N/bn)]`` with ``(bm, bn)`` the config's
    ``quantization_config.weight_block_size`` (DeepSeek's ``weight_dequant``: the stored
    "scale_inv" multiplies).

    Raises:
      ValueError: no block size configured, or a scale grid that does not fit ``w``.
    """
    if block is None:
        raise ValueError(f"{where} is fp8 with a _scale_inv but config.json has no "
                         "quantization_config.weight_block_size")
    bm, bn = block
    m, n = w.shape
    grid = (-(-m // bm), -(-n // bn))
    if tuple(scale_inv.shape) != grid:
        raise ValueError(f"{where}: scale_inv has shape {tuple(scale_inv.shape)}, expected {grid} "
                         f"for a [{m}, {n}] weight in {bm}x{bn} blocks")
    s = np.repeat(np.repeat(np.asarray(scale_inv, np.float32), bm, 0), bn, 1)[:m, :n]
    return w.astype(np.float32) * s


class SafetensorsFile:
    """Zero-copy reader of one ``.safetensors`` file (format: huggingface/safetensors README).

    Raises:
      ValueError: if the file is truncated, its header is not valid JSON, or a tensor's byte range
        does not match its dtype and shape.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = str(path)
        size = os.path.getsize(self.path)
        with open(self.path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ValueError(f"{self.path}: not a safetensors file (shorter than 8 bytes)")
            n = int.from_bytes(head, "little")
            if n > size - 8:
                raise ValueError(f"{self.path}: safetensors header length {n} exceeds the file size")
            try:
                header = json.loads(f.read(n))
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise ValueError(f"{self.path}: safetensors header is not valid JSON ({e})") from None
        header.pop("__metadata__", None)
        self._header = header
        self._offset = 8 + n
        self._mm = np.memmap(self.path, dtype=np.uint8, mode="r") if size > self._offset else None

    def names(self) -> list[str]:
        return list(self._header)

    def dtype_name(self, name: str) -> str:
        return self._header[name]["dtype"]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(int(s) for s in self._header[name]["shape"])

    def get(self, name: str) -> np.ndarray:
        info = self._header[name]
        dt = info["dtype"]
        if dt not in _ST_DTYPES:
            raise ValueError(f"{self.path}: tensor {name!r} has unsupported safetensors dtype {dt}")
        dtype = np.dtype(_ST_DTYPES[dt])
        shape = self.shape(name)
        begin, end = (int(x) for x in info["data_offsets"])
        count = math.prod(shape)
        if end - begin != count * dtype.itemsize:
            raise ValueError(
                f"{self.path}: tensor {name!r} spans {end - begin} bytes, expected "
                f"{count * dtype.itemsize} for {dt}{list(shape)}")
        if count == 0:
            return np.zeros(shape, dtype)
        raw = self._mm[self._offset + begin:self._offset + end]
        return raw.view(dtype).reshape(shape)


class SafetensorsSource:
    """All tensors of a checkpoint directory: ``model.safetensors.index.json`` (sharded) or every
    ``*.safetensors`` file, plus ``mtp/*.safetensors`` when that sub-directory exists.

    Args:
      quant: the checkpoint's ``quantization_config`` (None: no tensor may be FP8).
      num_layers: the target's ``num_hidden_layers`` (error messages call tensors of layers past
        it MTP layer tensors).

    Raises:
      ValueError: if no safetensors file is found, the index names a missing shard, or a tensor
        name appears in two files.
    """

    def __init__(self, directory: str | os.PathLike, quant: CheckpointQuant | None = None,
                 num_layers: int | None = None):
        self.quant, self.num_layers = quant, num_layers
        d = Path(directory)
        index = d / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text()).get("weight_map", {})
            files = sorted({d / f for f in weight_map.values()})
            for f in files:
                if not f.is_file():
                    raise ValueError(f"{index}: names shard {f.name} which does not exist")
        else:
            files = sorted(d.glob("*.safetensors"))
        if (d / "mtp").is_dir():
            files += sorted((d / "mtp").glob("*.safetensors"))
        if not files:
            raise ValueError(f"{d}: no *.safetensors files (only safetensors checkpoints are supported)")
        self._files: dict[str, SafetensorsFile] = {}
        for f in files:
            sf = SafetensorsFile(f)
            for name in sf.names():
                if name in self._files:
                    raise ValueError(
                        f"{d}: tensor {name!r} appears in both {self._files[name].path} and {sf.path}")
                self._files[name] = sf

    def names(self) -> set[str]:
        return set(self._files)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._files[name].shape(name)

    def is_mtp(self, name: str) -> bool:
        """Whether ``name`` belongs to an MTP layer (a layer index past ``num_layers``, or an
        ``mtp`` prefix)."""
        parts = name.split(".")
        if len(parts) > 2 and parts[1] == "layers" and parts[2].isdigit() and self.num_layers:
            return int(parts[2]) >= self.num_layers
        return name.startswith("mtp.") or ".mtp" in name

    def get(self, name: str) -> np.ndarray | QArray:
        """The tensor ``name``: a float array, or for an FP8 weight a :class:`QArray` with its
        ``weight_scale_inv``.

        Raises:
          ValueError: naming the tensor: its storage disagrees with ``quantization_config``
            (:func:`~jmtp.model.checkpoints.fp8_checkpoint.check_tensor`), an FP8 weight without (or a float
            one with) a ``_scale_inv``, a scale grid that does not fit the weight, an unsupported
            dtype.
        """
        sf = self._files[name]
        dt = sf.dtype_name(name)
        fp8 = dt in _FP8_ST_DTYPES
        check_tensor(name, fp8, dt, self.quant, sf.path, self.is_mtp(name))
        scale_name = name + "_scale_inv"
        if fp8:
            if scale_name not in self._files:
                raise ValueError(f"{sf.path}: tensor {name!r} is {dt} without its "
                                 f"{scale_name!r} (block-scaled FP8 needs one f32 scale per "
                                 f"{self.quant.weight_block_size} block)")
            sdt = self._files[scale_name].dtype_name(scale_name)
            if sdt not in _FLOAT_ST_DTYPES:
                raise ValueError(f"{self.where(scale_name)}: tensor {scale_name!r} must be a "
                                 f"float scale grid, got {sdt}")
            scale = np.asarray(self._files[scale_name].get(scale_name), np.float32)
            return QArray(sf.get(name), scale, self.quant.weight_block_size,
                          f"{sf.path}: tensor {name!r}")
        if scale_name in self._files:
            raise ValueError(f"{sf.path}: tensor {name!r} is {dt} but has a {scale_name!r}: a "
                             "scale without an FP8 weight")
        if dt not in _FLOAT_ST_DTYPES:
            raise ValueError(
                f"{sf.path}: tensor {name!r} has dtype {sf.dtype_name(name)}; only "
                f"{'/'.join(_FLOAT_ST_DTYPES)} weights are supported (quantized checkpoints are not)")
        return sf.get(name)

    def where(self, name: str) -> str:
        return self._files[name].path
