"""Batch-invariant numerics (``ModelConfig.batch_invariant``): every row's result independent of
the other rows computed with it.

A compiler picks a matmul's algorithm by its shapes: XLA:CPU multiplies one row (``M = 1``) with a
matrix-vector kernel and several rows with a matrix-matrix kernel, whose sums run in another
order, so the same token's activations differ in their last bits between a one-row decode step
and a K+1-row verify window, or between a batch of 1 and of 8 (measured with jaxlib 0.10.2 on a
576x1536 SmolLM2 projection: every row of an M = 4, 8, 16 or 32 product differed from the same
row multiplied alone, in f32 and in bf16). Greedy speculative decoding is lossless only up to
those bits: a near-tie can flip (``docs/kvquant.md``: bf16 caches, 45 of 48 prompts equal).
Batch-invariant kernels remove the dependence by fixing the reduction order whatever the batch
(Thinking Machines' "Defeating Nondeterminism in LLM Inference", 2025; vLLM's batch-invariant
mode on GPUs). Here, in plain XLA:

* :func:`row_tiled` runs a row-wise function over tiles of :data:`ROW_TILE` rows (``lax.map``
  over the padded rows), so every matmul has the same shape, hence the same kernel and order,
  for any number of rows; within a tile, each row's result does not depend on its position or
  on the tile's other rows (checked bit for bit: ``tests/model/test_invariant.py``);
* attention (``"xla"``) visits each sequence's query rows :data:`ROW_TILE` at a time with its
  keys in fixed chunks of positions (``ragged_paged_attention_xla(rows_per_seq=ROW_TILE)``): a
  row's online softmax sees the same chunks in the same order, and a chunk holding none of its
  keys changes nothing (its scores are ``-inf``, so it multiplies by 1 and adds 0, exactly);
* norms, softmax and elementwise ops are per row already.

The price: a one-row matmul costs a ``ROW_TILE``-row one, and a long prefill runs as
``T / ROW_TILE`` matmuls instead of one (``scripts/bench_batch_invariant.py`` measures it).
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from jmtp.model import quant

#: Rows per tile of every batch-invariant matmul and attention query tile.
ROW_TILE = 8


def row_tiled(f: Callable[[jax.Array], jax.Array], x: jax.Array,
              tile: int = ROW_TILE) -> jax.Array:
    """``f`` over the rows of ``x f[T, ...]``, ``tile`` rows at a time: ``f`` maps
    ``[tile, ...] -> [tile, ...]`` row by row; padding rows (zeros) are dropped. Returns
    ``[T, ...]`` as ``f`` gives it."""
    t = x.shape[0]
    n = -(-t // tile)
    xp = jnp.pad(x, [(0, n * tile - t)] + [(0, 0)] * (x.ndim - 1))
    out = jax.lax.map(f, xp.reshape((n, tile) + x.shape[1:]))
    return out.reshape((n * tile,) + out.shape[2:])[:t]


def matmul(invariant: bool, x: jax.Array, w) -> jax.Array:
    """``x @ w`` (``x f[T, ..., K]``, ``w f[K, N]`` or an 8-bit
    :class:`~jmtp.model.quant.QuantizedWeight`: :func:`jmtp.model.quant.matmul`); with
    ``invariant`` in row tiles (:func:`row_tiled`)."""
    if not invariant:
        return quant.matmul(x, w)
    return row_tiled(lambda t: quant.matmul(t, w), x)


__all__ = ["ROW_TILE", "matmul", "row_tiled"]
