"""Batch-invariant matmuls (jmtp/model/invariant.py): a row's product is bit-identical whatever
the other rows, their number and the row's place among them; XLA:CPU's plain matmul is not (what
the mode exists for; the control fails on a backend whose matmul happens to be invariant)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jmtp.model.invariant import ROW_TILE, matmul, row_tiled


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_row_tiled_matmul_is_batch_invariant(dtype):
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.standard_normal((96, 200)), dtype)
    x = jnp.asarray(rng.standard_normal((40, 96)), dtype)
    tiled = jax.jit(lambda x: matmul(True, x, w))
    plain = jax.jit(lambda x: matmul(False, x, w))
    alone = np.stack([np.asarray(tiled(x[i:i + 1]))[0] for i in range(12)])
    for start, count in ((0, 2), (0, 4), (0, ROW_TILE), (3, ROW_TILE + 1), (1, 16), (0, 40)):
        rows = np.asarray(tiled(x[start:start + count]))
        end = min(start + count, 12)
        # bit for bit, wherever the row sits among however many others
        assert (rows[:end - start] == alone[start:end]).all(), (start, count)
    single = np.stack([np.asarray(plain(x[i:i + 1]))[0] for i in range(12)])
    batched = np.asarray(plain(x[:12]))
    if jax.default_backend() == "cpu" and dtype == jnp.float32:
        # the control: one row takes another kernel (in bf16 the output's rounding can hide it
        # at these sizes; the engine's f32 accumulations do not)
        assert (batched != single).any()


def test_row_tiled_keeps_shapes_and_values():
    x = jnp.arange(3 * 5 * 2, dtype=jnp.float32).reshape(15, 2)
    out = row_tiled(lambda t: t * 2.0 + 1.0, x, tile=4)
    assert out.shape == (15, 2) and (np.asarray(out) == np.asarray(x) * 2 + 1).all()
    y = row_tiled(lambda t: t.sum(-1), jnp.ones((5, 3, 7)), tile=2)
    assert y.shape == (5, 3) and (np.asarray(y) == 7).all()
