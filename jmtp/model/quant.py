"""8-bit weights that stay 8-bit on the device: the quantised weight, its configuration and the
one set of matmul helpers every linear layer calls.

A :class:`QuantizedWeight` is a small pytree: ``value`` (``int8`` or ``float8_e4m3fn``,
``[..., K, N]``, jmtp's ``[in, out]`` layout) and ``scale`` (``f32[..., ceil(K/bk),
ceil(N/bn)]``), with the static block ``(bk, bn)``: weight ``w[..., i, j] = value[..., i, j] ·
scale[..., i // bk, j // bn]``. Leading axes (a layer stack, the routed experts) carry one scale
per entry. Two layouts are used:

* **block-scaled** (``bk, bn < K, N``): the FP8 checkpoints DeepSeek-V3/R1, GLM-4.5-FP8 and
  Qwen3-FP8 publish (transformers' fine-grained FP8: ``float8_e4m3fn`` weights and one f32
  ``weight_scale_inv`` per 128×128 block, DeepSeek's ``weight_dequant``: the stored "inverse"
  scale multiplies);
* **per output channel** (``bk = K``, ``bn = 1``): ``scale f32[..., 1, N]``, the int8
  weight-only scheme (``LLM(quantization="int8")``: symmetric, ``max|w| / 127`` per output
  channel), the natural choice where the matrix unit has no fp8 (TPU v5e / v6e).

Which parameters are 8-bit is static (:class:`QuantConfig`, part of
:class:`~jmtp.model.config.ModelConfig`): the decoder blocks' linear weights (attention
projections including MLA's, the dense MLP, routed and shared experts) of the target and of the
MTP layer, and with ``"int8"`` the token embedding (one scale per vocabulary row, block ``(1, H)``
of ``embed f[V, H]``: :func:`embedding` gathers rows, :func:`logits_from_rows` is the tied LM
head) and an untied LM head (per output channel); norms, routers, biases and, unless a
checkpoint ships it in fp8, the MTP ``eh_proj`` stay in the model dtype
(:mod:`jmtp.model.quant_params`).

The matmuls read the 8-bit values and the scales inside the step (no dequantised copy of the
parameters exists): :func:`matmul` (``x @ w``), :func:`expert_matmul` (every routed expert,
the dense MoE reference), :func:`ragged_dot` (sorted-by-expert grouped matmul) and
:func:`dequantize` (MLA's small ``wkv_b``, whose two halves are contracted on different axes).
With plain arrays they are exactly ``@`` / ``einsum`` / ``jax.lax.ragged_dot``, so an
unquantised model compiles to the same graph as before.

How the 8-bit product is formed (the operands are converted to the activation dtype, which is
exact: int8 and e4m3 values are bf16 values; the dot accumulates in f32):

* per output channel: ``(x @ value) · scale`` (the scale is constant along the contraction);
* block-scaled: per input block ``b``, ``p_b = x[:, b] @ value[b]`` (a batched dot over the
  ``K/bk`` blocks, f32), then ``Σ_b p_b · scale[b]``: DeepSeek's ``fp8_gemm`` order (partial
  products of a K block scaled before they are summed). Compiled for TPU v5e with libtpu
  (``jax.jit(...).lower().compile()`` on compile-only devices, ``docs/quantization.md``), both
  fuse into the dot: 0 bytes of temporaries for a 7168×18432 weight at 64 and 2048 rows, where
  dequantising first (``x @ (value · scale)``) materialised the 264 MiB bf16 weight.
* :func:`ragged_dot` (routed experts sorted by expert): XLA:TPU's ragged dot does not fuse the
  conversion of its right operand (a ragged dot of the whole converted int8 experts held them in
  bf16, 896 MiB for 32 DeepSeek-V3-sized experts, in the same measurement), so the input axis is
  walked in chunks (``lax.fori_loop`` over ragged dots of 128-512 columns: 1 MiB of
  temporaries), block-scaled products scaled per block, per-channel ones once at the end.

On CPU XLA has no fp8 dot at all; the same conversion to the activation dtype makes it run
(reading the 8-bit bytes from memory). GPU: XLA's dot emitters take the converted operand
likewise; no fp8 tensor-core path (W8A8) is used anywhere: activations stay in the model dtype.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

#: ``LLM(quantization=...)`` values (None: what the checkpoint has).
QUANT_METHODS = ("fp8", "int8")
#: Storage dtype of the 8-bit values.
STORAGE_DTYPES = {"fp8": jnp.float8_e4m3fn, "int8": jnp.int8}
#: Largest magnitude each storage dtype holds (e4m3fn: 448; int8 symmetric: 127).
QMAX = {"fp8": 448.0, "int8": 127.0}
SCALE_DTYPE = jnp.float32
#: Default ``weight_block_size`` (HF order ``[out, in]``) of ``quantization="fp8"`` on a float
#: checkpoint: the published FP8 checkpoints' 128×128.
DEFAULT_FP8_BLOCK = (128, 128)
#: The decoder-block weights that can be 8-bit (names of :func:`jmtp.model.schema.layer_shapes`).
QUANTIZABLE = ("wq", "wk", "wv", "wo", "wg", "wq_a", "wq_b", "wkv_a", "wkv_b",
               "w_gate", "w_up", "w_down", "experts_gate", "experts_up", "experts_down",
               "shared_gate", "shared_up", "shared_down")
#: MTP projections that may be 8-bit when a checkpoint ships them so (never quantised by jmtp).
MTP_PROJECTIONS = ("eh_proj",)
#: Top-level tables ``quantization="int8"`` makes 8-bit too: the token embedding ``embed f[V, H]``
#: (one scale per vocabulary row, block ``(1, H)``: a tied embedding's int8 table serves the
#: gather and the LM head, whose output channels are its rows) and an untied ``lm_head f[H, V]``
#: (per output channel). FP8 checkpoints keep them in BF16, as published.
EMBEDDINGS = ("embed", "lm_head")


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    """Which parameters are 8-bit and how (static: part of
    :class:`~jmtp.model.config.ModelConfig`, hence of the compiled graph).

    Attributes:
      method: ``"fp8"`` (``float8_e4m3fn`` values) or ``"int8"``.
      weight_block_size: ``(out, in)`` block of one scale, HF's order (``quantization_config
        .weight_block_size``); None: one scale per output channel (``bk = K``, ``bn = 1``).
      quantized: parameter paths in 8 bits, e.g. ``"layers.wq"`` (that weight of every target
        layer that has it), ``"mtp.layer.experts_up"``, ``"mtp.eh_proj"``; sorted.
      activation_scheme: the checkpoint's (``"dynamic"``/``"static"``; informational: jmtp keeps
        activations in the model dtype, weight-only).

    Raises:
      ValueError: an unknown method, a block that is not two positive integers, or a path that
        names no quantisable parameter.
    """

    method: str
    weight_block_size: tuple[int, int] | None = None
    quantized: tuple[str, ...] = ()
    activation_scheme: str = "dynamic"

    def __post_init__(self):
        if self.method not in QUANT_METHODS:
            raise ValueError(f"quantization must be one of {QUANT_METHODS} or None, got "
                             f"{self.method!r}")
        b = self.weight_block_size
        if b is not None:
            if (len(b) != 2 or not all(isinstance(x, (int, np.integer)) and x > 0 for x in b)):
                raise ValueError(f"weight_block_size must be two positive integers [out, in], "
                                 f"got {list(b)}")
            object.__setattr__(self, "weight_block_size", (int(b[0]), int(b[1])))
        for p in self.quantized:
            if p not in EMBEDDINGS and p.rsplit(".", 1)[-1] not in QUANTIZABLE + MTP_PROJECTIONS:
                raise ValueError(f"QuantConfig.quantized: {p!r} is not a quantisable parameter "
                                 f"(one of {EMBEDDINGS + QUANTIZABLE + MTP_PROJECTIONS})")
        object.__setattr__(self, "quantized", tuple(sorted(set(self.quantized))))

    @property
    def storage_dtype(self):
        return jnp.dtype(STORAGE_DTYPES[self.method])

    def covers(self, path: str) -> bool:
        """Whether parameter ``path`` (``"layers.wq"``, ``"mtp.layer.w_up"``, ``"mtp.eh_proj"``)
        is 8-bit."""
        return path in self.quantized

    def block(self, k: int, n: int) -> tuple[int, int]:
        """The ``(bk, bn)`` block, in jmtp's ``[in, out]`` order, of a ``[K, N]`` weight."""
        if self.weight_block_size is None:
            return k, 1
        bn, bk = self.weight_block_size
        return bk, bn

    def block_for(self, path: str, shape: tuple[int, ...]) -> tuple[int, int]:
        """The block of parameter ``path`` of ``shape``: one scale per vocabulary row
        ``(1, H)`` for the embedding ``embed f[V, H]`` (per output channel of the tied LM head),
        else :meth:`block` of its last two axes."""
        if path == "embed":
            return 1, shape[-1]
        return self.block(*shape[-2:])

    def describe(self) -> str:
        layout = ("per output channel" if self.weight_block_size is None
                  else "{}x{} blocks".format(*self.weight_block_size))
        return f"{self.method} ({layout})"


def scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    """``scale``'s shape for a value of ``shape [..., K, N]`` in ``block (bk, bn)``."""
    k, n = shape[-2:]
    return tuple(shape[:-2]) + (-(-k // block[0]), -(-n // block[1]))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
    """An 8-bit weight: ``value i8/f8[..., K, N]``, ``scale f32[..., ceil(K/bk), ceil(N/bn)]``,
    static ``block = (bk, bn)`` (module docstring). Leaves may also be ``jax.ShapeDtypeStruct``
    (abstract parameters) or ``nnx.Variable`` (inside a module)."""

    value: Any
    scale: Any
    block: tuple[int, int] = dataclasses.field(metadata=dict(static=True), default=(1, 1))

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.value.shape)

    @property
    def ndim(self) -> int:
        return len(self.value.shape)

    @property
    def dtype(self):
        """The storage dtype of the values."""
        return self.value.dtype

    def __getitem__(self, idx) -> "QuantizedWeight":
        """Index the leading (stack / expert) axes only: ``w[i]`` is entry ``i`` of a stack.

        Raises:
          IndexError: an index reaching the matrix axes."""
        n = len(idx) if isinstance(idx, tuple) else 1
        if n > self.ndim - 2 or (isinstance(idx, tuple) and Ellipsis in idx):
            raise IndexError(f"a QuantizedWeight of shape {self.shape} is indexed on its leading "
                             f"axes only, got {idx!r}")
        return QuantizedWeight(self.value[idx], self.scale[idx], self.block)

    @property
    def nbytes(self) -> int:
        """Bytes of the values and the scales."""
        return sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize
                   for a in (self.value, self.scale))


def is_quantized(w) -> bool:
    return isinstance(w, QuantizedWeight)


def quantize(w, method: str, block: tuple[int, int] | None = None) -> QuantizedWeight:
    """Quantise ``w f[..., K, N]`` (numpy or jax, concrete or traced) to ``method``'s 8 bits,
    symmetric, absmax per block: ``scale = max|w| / QMAX`` (1 where a block is all zero),
    ``value = w / scale`` rounded to the storage dtype (int8: to the nearest integer).

    Args:
      block: ``(bk, bn)`` in jmtp's ``[in, out]`` order; None: per output channel ``(K, 1)``.
    """
    a = jnp.asarray(w, jnp.float32)
    k, n = a.shape[-2:]
    bk, bn = (k, 1) if block is None else block
    gk, gn = -(-k // bk), -(-n // bn)
    pad = [(0, 0)] * (a.ndim - 2) + [(0, gk * bk - k), (0, gn * bn - n)]
    blocks = jnp.pad(a, pad).reshape(a.shape[:-2] + (gk, bk, gn, bn))
    amax = jnp.abs(blocks).max(axis=(-3, -1))                         # [..., gk, gn]
    scale = jnp.where(amax > 0, amax / QMAX[method], 1.0).astype(jnp.float32)
    q = blocks / scale[..., :, None, :, None]
    if method == "int8":
        q = jnp.clip(jnp.rint(q), -127, 127)
    q = q.reshape(a.shape[:-2] + (gk * bk, gn * bn))[..., :k, :n]
    return QuantizedWeight(q.astype(STORAGE_DTYPES[method]), scale, (bk, bn))


def _expand(scale, block: int, size: int, axis: int):
    """``scale`` repeated ``block`` times along ``axis`` and cut to ``size``."""
    if block == 1:
        return scale
    return jax.lax.slice_in_dim(jnp.repeat(scale, block, axis=axis), 0, size, axis=axis)


def dequantize(w, dtype=jnp.float32):
    """``value · scale`` in ``dtype`` (f32 products, then cast), the full weight; plain arrays are
    returned cast. Materialises the weight: used for MLA's ``wkv_b`` and the references."""
    if not is_quantized(w):
        return w.astype(dtype)
    k, n = w.shape[-2:]
    s = _expand(_expand(w.scale, w.block[0], k, -2), w.block[1], n, -1)
    return (w.value.astype(jnp.float32) * s).astype(dtype)


def matmul(x: jax.Array, w, out_dtype=None) -> jax.Array:
    """``x @ w`` for ``x f[..., K]`` and ``w`` an array ``f[K, N]`` or a 2-D
    :class:`QuantizedWeight` (module docstring); the result has ``out_dtype`` (default ``x``'s
    dtype; the products accumulate in f32 for a quantised ``w``).

    A block size that does not tile K (never so in the published checkpoints) falls back to
    ``x @ dequantize(w)``."""
    out_dtype = x.dtype if out_dtype is None else out_dtype
    if not is_quantized(w):
        return (x @ w).astype(out_dtype)
    k, n = w.shape
    bk, bn = w.block
    nk = -(-k // bk)
    if nk > 1 and k % bk:
        return (x @ dequantize(w, x.dtype)).astype(out_dtype)
    v = w.value.astype(x.dtype)
    if nk == 1:        # one scale per output column (block): scale the product
        y = jnp.dot(x, v, preferred_element_type=jnp.float32)
        return (y * _expand(w.scale[0], bn, n, -1)).astype(out_dtype)
    lead = x.shape[:-1]
    p = jnp.einsum("...bk,bkn->...bn", x.reshape(lead + (nk, bk)), v.reshape(nk, bk, n),
                   preferred_element_type=jnp.float32)
    return (p * _expand(w.scale, bn, n, -1)).sum(-2).astype(out_dtype)


def expert_matmul(x: jax.Array, w) -> jax.Array:
    """Every expert on its rows: ``x f[T, K]`` (the same rows for every expert) or ``f[E, T, K]``
    (rows per expert) times ``w f[E, K, N]`` (array or :class:`QuantizedWeight`) →
    ``f[E, T, N]`` in ``x``'s dtype (the dense MoE reference's einsums)."""
    shared = x.ndim == 2
    if not is_quantized(w):
        return jnp.einsum("th,ehi->eti" if shared else "eth,ehi->eti", x, w)
    e, k, n = w.shape
    bk, bn = w.block
    nk = -(-k // bk)
    if nk > 1 and k % bk:
        return expert_matmul(x, dequantize(w, x.dtype))
    bk = min(bk, k)
    xb = x.reshape(x.shape[:-1] + (nk, bk))
    v = w.value.astype(x.dtype).reshape(e, nk, bk, n)
    p = jnp.einsum("tbk,ebkn->etbn" if shared else "etbk,ebkn->etbn", xb, v,
                   preferred_element_type=jnp.float32)
    s = _expand(w.scale, bn, n, -1)[:, None]                       # f32[E, 1, nk, N]
    return (p * s).sum(-2).astype(x.dtype)


#: Input-axis chunks :func:`ragged_dot` tries (largest first) for per-channel experts.
RAGGED_CHUNKS = (512, 256, 128)


def ragged_dot(x: jax.Array, w, group_sizes: jax.Array) -> jax.Array:
    """``jax.lax.ragged_dot(x, w, group_sizes)``: rows ``x f[M, K]`` sorted by group, group ``e``
    (``group_sizes i32[E]`` rows, summing to M) times ``w f[E, K, N]`` (array or
    :class:`QuantizedWeight`) → ``f[M, N]`` in ``x``'s dtype.

    The input axis is walked in chunks (``lax.fori_loop``), each a ragged dot of the chunk's
    converted values accumulated in f32, so no converted copy of the experts exists (XLA:TPU does
    not fuse the conversion into a ragged dot, module docstring): block-scaled weights one block
    (``bk`` columns) at a time, each product scaled by its rows' experts' block scales;
    per-channel weights in chunks of :data:`RAGGED_CHUNKS`, the sum scaled once."""
    if not is_quantized(w):
        return jax.lax.ragged_dot(x, w, group_sizes)
    m = x.shape[0]
    e, k, n = w.shape
    bk, bn = w.block
    nk = -(-k // bk)
    if nk > 1 and k % bk:
        return jax.lax.ragged_dot(x, dequantize(w, x.dtype), group_sizes)
    rows = jnp.repeat(jnp.arange(e, dtype=jnp.int32), group_sizes, total_repeat_length=m)
    srow = w.scale[rows]                                           # f32[M, nk, N/bn]
    # one scale block along K (per channel): sum the chunks, scale once; else scale each block
    chunk = bk if nk > 1 else next((c for c in RAGGED_CHUNKS if k % c == 0 and c < k), k)

    def block(b, acc):
        xs = jax.lax.dynamic_slice_in_dim(x, b * chunk, chunk, axis=1)
        vs = jax.lax.dynamic_slice_in_dim(w.value, b * chunk, chunk, axis=1).astype(x.dtype)
        p = jax.lax.ragged_dot(xs, vs, group_sizes, preferred_element_type=jnp.float32)
        if nk == 1:
            return acc + p
        s = jax.lax.dynamic_index_in_dim(srow, b, axis=1, keepdims=False)   # f32[M, N/bn]
        return acc + p * _expand(s, bn, n, -1)

    acc = jax.lax.fori_loop(0, k // chunk, block, jnp.zeros((m, n), jnp.float32))
    if nk == 1:
        acc = acc * _expand(srow[:, 0], bn, n, -1)
    return acc.astype(x.dtype)


def embedding(table, ids: jax.Array, dtype) -> jax.Array:
    """Rows ``f[T, H]`` (``dtype``) of the embedding ``table``, an array ``f[V, H]`` or a
    per-row :class:`QuantizedWeight` (``value i8[V, H]``, ``scale f32[V, 1]``), for token ids
    ``ids i32[T]``: ``value[ids] · scale[ids]``, only the gathered rows dequantised."""
    if not is_quantized(table):
        return table[ids]
    return (table.value[ids].astype(jnp.float32) * table.scale[ids]).astype(dtype)


def logits_from_rows(h: jax.Array, table) -> jax.Array:
    """``f32[T, N]`` scores ``h @ table.T`` of hidden rows ``h f[T, H]`` against the rows of
    ``table`` (``f[N, H]``, the tied LM head, or a per-row :class:`QuantizedWeight`): the dot
    with the table's values (contracted on ``H`` directly, never a transposed copy), then, per
    output channel ``n``, times row ``n``'s scale (exact: the scale is constant along ``H``)."""
    dims = (((1,), (1,)), ((), ()))
    if not is_quantized(table):
        return jax.lax.dot_general(h, table, dims,
                                   preferred_element_type=jnp.float32).astype(jnp.float32)
    if table.block != (1, table.shape[-1]):
        raise ValueError(f"a quantised embedding table must have one scale per row, block "
                         f"(1, {table.shape[-1]}); got {table.block}")
    y = jax.lax.dot_general(h, table.value.astype(h.dtype), dims,
                            preferred_element_type=jnp.float32)
    return y * table.scale[:, 0]


def take_rows(table, ids):
    """Rows ``ids`` of an embedding table (array ``f[V, H]`` or per-row :class:`QuantizedWeight`,
    whose rows keep their values and scales)."""
    if not is_quantized(table):
        return table[ids]
    return QuantizedWeight(table.value[ids], table.scale[ids], table.block)


def param_dtype(params: dict):
    """The model's float dtype from its parameter dict: the embedding's, or the final norm's
    when the embedding is 8-bit (``quantization="int8"``)."""
    e = params["embed"]
    return params["final_norm"].dtype if is_quantized(e) else e.dtype


def check_quantized(cfg, params: dict, source: str = "params") -> None:
    """Raise ``ValueError`` naming the tensor when ``params``' 8-bit leaves disagree with
    ``cfg.quantization`` (``cfg`` a :class:`~jmtp.model.config.ModelConfig`): a covered weight
    in float (or an 8-bit one not covered), another storage dtype, block or scale shape."""
    q = cfg.quantization
    layers = params.get("layers", {})
    items = [(k, k, params[k]) for k in EMBEDDINGS if k in params]
    for i, d in enumerate(layers if isinstance(layers, (list, tuple)) else (layers,)):
        name = f"layers[{i}]" if isinstance(layers, (list, tuple)) else "layers"
        items += [(f"layers.{k}", f"{name}.{k}", v) for k, v in d.items()]
    if "mtp" in params:
        items += [(f"mtp.layer.{k}", f"mtp.layer.{k}", v)
                  for k, v in params["mtp"]["layer"].items()]
        items += [(f"mtp.{k}", f"mtp.{k}", params["mtp"][k]) for k in MTP_PROJECTIONS
                  if k in params["mtp"]]
    for path, name, v in items:
        covered = q is not None and q.covers(path)
        if covered != is_quantized(v):
            raise ValueError(
                f"{source}: tensor {name!r} is {'8-bit' if is_quantized(v) else 'a float array'} "
                f"but ModelConfig.quantization ({q.describe() if q else 'None'}) makes it "
                f"{'8-bit' if covered else 'float'}: the model's weights are quantised "
                "differently from its configuration")
        if not covered:
            continue
        blk = q.block_for(path, v.shape)
        if jnp.dtype(v.dtype) != q.storage_dtype or tuple(v.block) != blk:
            raise ValueError(f"{source}: tensor {name!r} is {jnp.dtype(v.dtype).name} in blocks "
                             f"{tuple(v.block)}, expected {q.storage_dtype.name} in {blk} "
                             f"({q.describe()})")
        if tuple(v.scale.shape) != scale_shape(v.shape, blk):
            raise ValueError(f"{source}: tensor {name!r} has scales of shape "
                             f"{tuple(v.scale.shape)}, expected {scale_shape(v.shape, blk)}")


def leaf_bytes(a) -> int:
    """Bytes of one array-like leaf (an array or a ``jax.ShapeDtypeStruct``)."""
    return int(math.prod(a.shape)) * np.dtype(a.dtype).itemsize


__all__ = ["QUANT_METHODS", "STORAGE_DTYPES", "QMAX", "SCALE_DTYPE", "DEFAULT_FP8_BLOCK",
           "QUANTIZABLE", "MTP_PROJECTIONS", "EMBEDDINGS", "QuantConfig", "QuantizedWeight",
           "is_quantized", "scale_shape", "quantize", "dequantize", "matmul", "expert_matmul",
           "ragged_dot", "embedding", "logits_from_rows", "take_rows", "param_dtype",
           "check_quantized",
           "leaf_bytes"]
