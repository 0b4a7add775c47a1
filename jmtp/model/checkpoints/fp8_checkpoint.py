"""Block-scaled FP8 checkpoints read without dequantising: ``config.json``'s
``quantization_config``, the host-side 8-bit array the loaders rearrange, and the rules that
check every tensor against the config.

The format is transformers' fine-grained FP8 (``FineGrainedFP8Config``), in which DeepSeek-V3/R1,
GLM-4.5-FP8 and Qwen3's FP8 checkpoints are published: ``quantization_config = {"quant_method":
"fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic", "fmt": "e4m3",
["modules_to_not_convert": [...]]}``; each quantised Linear stores ``<name>.weight`` as
``F8_E4M3 [out, in]`` and ``<name>.weight_scale_inv`` as ``F32 [ceil(out/bo), ceil(in/bi)]``
(the scale that multiplies: DeepSeek's ``weight_dequant``). Embeddings, the LM head, norms,
routers (``mlp.gate``), biases and the MTP ``eh_proj`` are BF16 in those checkpoints (DeepSeek-V3's
``model.layers.61.eh_proj.weight`` included).

:class:`QArray` is one such tensor on the host (numpy ``float8_e4m3fn`` values and their scale
grid) supporting exactly the layout operations the HF readers apply (transpose, block-aligned
slices, row permutations inside blocks, ``np.stack`` / ``np.concatenate``), so the readers of
:mod:`jmtp.model.checkpoints.hf_blocks` work unchanged and the weight reaches the device as a
:class:`~jmtp.model.quant.QuantizedWeight`. Converting it to a float array raises: nothing
dequantises by accident.

:func:`expected_fp8` says, from the tensor's name and the config, whether a tensor must be
FP8, must not be, or may be either (the MTP projection); :class:`SafetensorsSource` applies it to
every tensor it hands out, so a checkpoint whose MTP layer is quantised differently from what its
config says fails at load with the tensor's name (the public bug reports: an FP8 draft layer
loaded as if it were BF16 gives acceptance 0 without any error).
"""
from __future__ import annotations

import dataclasses
import re

import ml_dtypes
import numpy as np

#: ``quantization_config.quant_method`` values read (others raise, naming the field).
SUPPORTED_QUANT_METHODS = ("fp8",)
FP8_DTYPE = np.dtype(ml_dtypes.float8_e4m3fn)


@dataclasses.dataclass(frozen=True)
class CheckpointQuant:
    """A checkpoint's ``quantization_config`` (fine-grained FP8), checked.

    Attributes:
      weight_block_size: ``(out, in)`` rows and columns of one scale.
      activation_scheme: ``"dynamic"`` or ``"static"`` (jmtp keeps activations in the model dtype).
      modules_to_not_convert: module names left in BF16; an entry matches a module whose dotted
        name contains it on name boundaries (``"mlp.gate"`` matches ``model.layers.3.mlp.gate``,
        not ``...mlp.gate_proj``).
    """

    weight_block_size: tuple[int, int]
    activation_scheme: str = "dynamic"
    modules_to_not_convert: tuple[str, ...] = ()

    def not_converted(self, module: str) -> bool:
        padded = f".{module}."
        return any(m and f".{m.strip('.')}." in padded for m in self.modules_to_not_convert)


def parse_quantization_config(hf: dict, where: str) -> CheckpointQuant | None:
    """``hf["quantization_config"]`` (None when absent or empty) as a :class:`CheckpointQuant`.

    Raises:
      ValueError: naming the field: a ``quant_method`` other than ``"fp8"`` (GPTQ, AWQ,
        compressed-tensors, bitsandbytes: not read), a missing or malformed
        ``weight_block_size`` (per-tensor FP8 is not read), an ``activation_scheme`` other than
        dynamic/static, ``fmt`` other than ``e4m3``, ``scale_fmt`` other than ``float``, or a
        ``modules_to_not_convert`` that is not a list of strings.
    """
    qc = hf.get("quantization_config")
    if not qc:
        return None
    f = f"{where}: quantization_config"
    if not isinstance(qc, dict):
        raise ValueError(f"{f} must be an object, got {type(qc).__name__}")
    method = qc.get("quant_method")
    if method not in SUPPORTED_QUANT_METHODS:
        raise ValueError(f"{f}.quant_method is {method!r}; jmtp reads block-scaled FP8 "
                         f"checkpoints (quant_method 'fp8' with weight_block_size) only")
    block = qc.get("weight_block_size")
    if (not isinstance(block, (list, tuple)) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise ValueError(f"{f}.weight_block_size must be two positive integers [out, in] (one "
                         f"f32 weight_scale_inv per block; per-tensor FP8 is not read), got "
                         f"{block!r}")
    scheme = str(qc.get("activation_scheme", "dynamic")).lower()
    if scheme not in ("dynamic", "static"):
        raise ValueError(f"{f}.activation_scheme must be 'dynamic' or 'static', got {scheme!r}")
    if qc.get("fmt", "e4m3") != "e4m3":
        raise ValueError(f"{f}.fmt is {qc.get('fmt')!r}; only 'e4m3' (float8_e4m3fn) is read")
    if qc.get("scale_fmt", "float") != "float":
        raise ValueError(f"{f}.scale_fmt is {qc.get('scale_fmt')!r}; only 'float' (f32 "
                         "weight_scale_inv) is read")
    skip = qc.get("modules_to_not_convert", qc.get("ignored_layers")) or []
    if not isinstance(skip, (list, tuple)) or not all(isinstance(s, str) for s in skip):
        raise ValueError(f"{f}.modules_to_not_convert must be a list of module names, got "
                         f"{skip!r}")
    return CheckpointQuant((block[0], block[1]), scheme, tuple(skip))


# Tensors that are linear weights of a decoder block (quantised in the published checkpoints):
# transformers' ``*_proj.weight`` names and the fused expert tensors. The MTP layer's input
# projection is matched first (either kind).
_LINEAR = re.compile(r"(_proj|_proj_with_mqa)\.weight$|\.experts\.(gate_up_proj|down_proj)$")
_MTP_PROJECTION = re.compile(r"\.eh_proj\.weight$|mtp_linear_proj\.\d+\.weight$|"
                             r"mtp_layers\.\d+\.input_proj\.weight$|^mtp\.fc\.weight$")


def expected_fp8(name: str, q: CheckpointQuant | None) -> bool | None:
    """Whether tensor ``name`` must be FP8 (True), must not be (False) or may be either (None:
    the MTP input projection, BF16 in DeepSeek-V3 but legitimately FP8 elsewhere)."""
    if q is None:
        return False
    if _MTP_PROJECTION.search(name):
        return False if q.not_converted(name.rsplit(".", 1)[0]) else None
    if _LINEAR.search(name) and "lm_head" not in name:
        return not q.not_converted(name.rsplit(".", 1)[0])
    return False


def check_tensor(name: str, is_fp8: bool, dtype_name: str, q: CheckpointQuant | None,
                 path: str, is_mtp: bool = False) -> None:
    """Raise ``ValueError`` naming ``name`` (in file ``path``) when its storage disagrees with the
    checkpoint's quantization config (:func:`expected_fp8`)."""
    want = expected_fp8(name, q)
    if want is None or want == is_fp8:
        return
    where = f"{path}: tensor {name!r}"
    layer = " (an MTP layer tensor)" if is_mtp else ""
    if q is None:
        raise ValueError(f"{where} is {dtype_name} (block-scaled FP8) but config.json has no "
                         "quantization_config.weight_block_size")
    if is_fp8:
        why = ("is listed in quantization_config.modules_to_not_convert"
               if q.not_converted(name.rsplit(".", 1)[0])
               else "is not a linear weight of a decoder block (norms, embeddings, the LM head "
                    "and routers stay unquantised)")
        raise ValueError(f"{where}{layer} is {dtype_name} but {why}")
    raise ValueError(f"{where}{layer} is {dtype_name}, but quantization_config (fp8, "
                     f"{q.weight_block_size[0]}x{q.weight_block_size[1]} blocks) quantises the "
                     "linear weights of every decoder block, the MTP layer's included: the "
                     "checkpoint is quantised differently from what its config says (list the "
                     "module in modules_to_not_convert if that is intended)")


class QArray:
    """A block-scaled 8-bit tensor on the host: ``value [..., M, N]`` (numpy ``float8_e4m3fn``),
    ``scale f32[..., ceil(M/bm), ceil(N/bn)]``, ``block = (bm, bn)`` for the last two axes (one
    scale per entry of any leading axis).

    Supports the layout operations of the HF readers: ``.T`` / ``transpose`` (leading axes kept,
    the last two swapped or not), indexing (basic indices on leading axes; slices on the block
    axes that start on a block boundary and end on one or at the axis end; an integer array on a
    block axis that keeps every element inside its block), ``np.stack`` (a new leading axis) and
    ``np.concatenate`` (along a block axis, every part but the last a whole number of blocks).
    ``np.asarray`` raises.

    Raises:
      ValueError: an operation that would move elements across scale blocks.
    """

    __array_priority__ = 100

    def __init__(self, value: np.ndarray, scale: np.ndarray, block: tuple[int, int],
                 where: str = "tensor"):
        self.value, self.scale, self.block, self.where = value, scale, tuple(block), where
        want = value.shape[:-2] + tuple(-(-s // b) for s, b in zip(value.shape[-2:], block))
        if tuple(scale.shape) != want:
            raise ValueError(f"{where}: weight_scale_inv has shape {tuple(scale.shape)}, "
                             f"expected {want} for a {list(value.shape[-2:])} weight in "
                             f"{block[0]}x{block[1]} blocks")

    shape = property(lambda self: tuple(self.value.shape))
    ndim = property(lambda self: self.value.ndim)
    dtype = property(lambda self: self.value.dtype)

    def __array__(self, dtype=None, copy=None):
        raise ValueError(f"{self.where}: an 8-bit block-scaled tensor cannot become a float "
                         "array here (jmtp keeps FP8 weights 8-bit; this layout operation is "
                         "not supported for it)")

    def _new(self, value, scale, block):
        return QArray(value, scale, block, self.where)

    @property
    def T(self) -> "QArray":
        if self.ndim != 2:
            raise ValueError(f"{self.where}: .T of a {self.ndim}-D QArray")
        return self.transpose(1, 0)

    def transpose(self, *axes) -> "QArray":
        n = self.ndim
        axes = tuple(axes[0]) if len(axes) == 1 and isinstance(axes[0], (tuple, list)) else axes
        if tuple(axes[:-2]) != tuple(range(n - 2)) or sorted(axes[-2:]) != [n - 2, n - 1]:
            raise ValueError(f"{self.where}: transpose {axes} moves a leading axis")
        swap = axes[-2] == n - 1
        block = self.block[::-1] if swap else self.block
        return self._new(self.value.transpose(axes), self.scale.transpose(axes), block)

    def __getitem__(self, idx) -> "QArray":
        idx = idx if isinstance(idx, tuple) else (idx,)
        if any(i is Ellipsis or i is None for i in idx):
            raise ValueError(f"{self.where}: index {idx} not supported on a QArray")
        idx = idx + (slice(None),) * (self.ndim - len(idx))
        lead = self.ndim - 2
        v_idx, s_idx, block = list(idx[:lead]), list(idx[:lead]), self.block
        for ax, i in enumerate(idx[lead:]):
            size, b = self.value.shape[lead + ax], self.block[ax]
            v_idx.append(i)
            s_idx.append(self._block_index(i, size, b))
        return self._new(self.value[tuple(v_idx)], self.scale[tuple(s_idx)], block)

    def _block_index(self, i, size: int, b: int):
        """The scale index for value index ``i`` along a block axis of ``size`` in blocks of
        ``b`` (raises when ``i`` breaks blocks)."""
        if isinstance(i, slice):
            start, stop, step = i.indices(size)
            if step != 1 or start % b or (stop % b and stop != size):
                raise ValueError(f"{self.where}: slice [{start}:{stop}] of an axis of {size} in "
                                 f"blocks of {b} is not block-aligned")
            return slice(start // b, -(-stop // b))
        idx = np.asarray(i)
        if idx.ndim != 1 or not np.issubdtype(idx.dtype, np.integer):
            raise ValueError(f"{self.where}: index {i!r} not supported on a QArray axis")
        idx = np.where(idx < 0, idx + size, idx)
        dest = np.arange(len(idx))
        if len(idx) != size or np.any(idx // b != dest // b):
            raise ValueError(f"{self.where}: a permutation that moves elements across the "
                             f"{b}-wide scale blocks (block-scaled weights cannot be "
                             "rearranged so)")
        return slice(None)

    def __array_function__(self, func, types, args, kwargs):
        if func is np.stack:
            parts, axis = args[0], kwargs.get("axis", args[1] if len(args) > 1 else 0)
            if axis != 0:
                raise ValueError(f"{self.where}: np.stack of QArrays along axis {axis}")
            blocks = {p.block for p in parts if isinstance(p, QArray)}
            if len(blocks) != 1 or not all(isinstance(p, QArray) for p in parts):
                raise ValueError(f"{self.where}: np.stack mixes FP8 and float tensors, or "
                                 "block sizes (some experts quantised, some not?)")
            return self._new(np.stack([p.value for p in parts]),
                             np.stack([p.scale for p in parts]), parts[0].block)
        if func is np.concatenate:
            parts, axis = args[0], kwargs.get("axis", args[1] if len(args) > 1 else 0)
            if not all(isinstance(p, QArray) for p in parts) or len({p.block for p in parts}) > 1:
                raise ValueError(f"{self.where}: np.concatenate mixes FP8 and float tensors")
            axis = axis % self.ndim
            lead = self.ndim - 2
            if axis >= lead:
                b = parts[0].block[axis - lead]
                if any(p.shape[axis] % b for p in parts[:-1]):
                    raise ValueError(f"{self.where}: concatenation not on {b}-wide block "
                                     "boundaries")
            return self._new(np.concatenate([p.value for p in parts], axis),
                             np.concatenate([p.scale for p in parts], axis), parts[0].block)
        raise ValueError(f"{self.where}: numpy {func.__name__} is not supported on an 8-bit "
                         "block-scaled tensor")


def is_qarray(x) -> bool:
    return isinstance(x, QArray)


def to_quantized(x: QArray):
    """The device :class:`~jmtp.model.quant.QuantizedWeight` of a host ``QArray`` (values and
    scales as they are; the block in the array's current axis order)."""
    import jax.numpy as jnp

    from jmtp.model.quant import QuantizedWeight
    return QuantizedWeight(jnp.asarray(np.ascontiguousarray(x.value)),
                           jnp.asarray(np.ascontiguousarray(x.scale, np.float32)),
                           (int(x.block[0]), int(x.block[1])))


__all__ = ["SUPPORTED_QUANT_METHODS", "FP8_DTYPE", "CheckpointQuant", "parse_quantization_config",
           "expected_fp8", "check_tensor", "QArray", "is_qarray", "to_quantized"]
