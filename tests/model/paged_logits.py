"""Shared check for loader tests: a model's logits through chunked prefill and paged decode."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jmtp.model import compute_logits, forward, init_kv_cache
from jmtp.model.metadata import ragged_batch

_fwd = jax.jit(forward, static_argnums=0)


def chunked_paged_logits(cfg, params, ids: list[int], *, prefill: int, chunk: int,
                         block_size: int = 4, width: int = 8, seed: int = 3,
                         row_width: int | None = None) -> np.ndarray:
    """``f32[len(ids), V]``: the first ``prefill`` tokens run as prefill chunks of ``chunk``
    tokens, the rest one token per step, through :func:`jmtp.model.forward` over a paged cache
    whose blocks are shuffled (``seed``) and poisoned with NaN (2 spare blocks beyond the
    sequence's). Each step is padded to ``width`` rows; ``row_width``: cache rows with padding
    lanes (:mod:`jmtp.pallas.kv_layout`)."""
    pages = -(-len(ids) // block_size)
    cache = init_kv_cache(cfg, cfg.num_layers, pages + 2, block_size, row_width=row_width)
    cache = type(cache)(jnp.full_like(cache.k, jnp.nan), jnp.full_like(cache.v, jnp.nan))
    tables = jnp.asarray(np.random.default_rng(seed).permutation(pages + 2)[:pages][None],
                         jnp.int32)
    steps = ([(s, min(s + chunk, prefill)) for s in range(0, prefill, chunk)]
             + [(t, t + 1) for t in range(prefill, len(ids))])
    got = []
    for a, b in steps:
        part = ids[a:b]
        pos, meta = ragged_batch(jnp.array([len(part)]), jnp.array([a]), tables, block_size, width)
        h, cache = _fwd(cfg, params, jnp.asarray(part + [0] * (width - len(part)), jnp.int32),
                        pos, meta, cache)
        got.append(np.asarray(compute_logits(params, h))[: len(part)])
    return np.concatenate(got)
