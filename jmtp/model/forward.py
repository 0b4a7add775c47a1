"""Convenience entry points around the paged forward (checking a model, tests, training data)."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jmtp.model.config import ModelConfig
from jmtp.model.llama import compute_logits, forward, init_model_cache, param_dtype
from jmtp.model.metadata import ragged_batch


@functools.partial(jax.jit, static_argnums=(0, 3))
def _prefill_hidden(cfg: ModelConfig, params, ids, block_size: int):
    t = ids.shape[0]
    pages = -(-t // block_size)
    cache = init_model_cache(cfg, pages, block_size, param_dtype(params))
    tables = jnp.arange(pages, dtype=jnp.int32)[None]
    positions, meta = ragged_batch(jnp.array([t], jnp.int32), jnp.zeros((1,), jnp.int32), tables,
                                   block_size, t)
    h, _ = forward(cfg, params, ids, positions, meta, cache)
    return h


def forward_hidden(cfg: ModelConfig, params: dict, token_ids, block_size: int = 16) -> jax.Array:
    """Post-norm hidden states ``f[T, H]`` of one sequence run as a single prefill.

    Raises:
      ValueError: if ``token_ids`` is empty or holds ids outside ``[0, vocab_size)``.
    """
    ids = np.asarray(token_ids, dtype=np.int32).reshape(-1)
    if ids.size == 0:
        raise ValueError("token_ids must hold at least one token")
    if ids.min() < 0 or ids.max() >= cfg.vocab_size:
        raise ValueError(f"token_ids must lie in [0, vocab_size={cfg.vocab_size})")
    return _prefill_hidden(cfg, params, jnp.asarray(ids), block_size)


def forward_logits(cfg: ModelConfig, params: dict, token_ids, block_size: int = 16) -> jax.Array:
    """Logits ``f32[T, V]`` of one sequence (what a user calls to check a loaded model).

    Raises:
      ValueError: as :func:`forward_hidden`.
    """
    return compute_logits(params, forward_hidden(cfg, params, token_ids, block_size))
