"""Key shift of int8 KV caches: subtract each layer's mean key before quantising.

Softmax is unchanged when every score of a query moves by the same amount, so for any vector
``μ`` per layer and KV head, attention over the keys ``k - μ`` equals attention over ``k``:
``q·(k_j - μ) = q·k_j - q·μ`` and ``q·μ`` does not depend on the key ``j``. The shift is applied
after RoPE (so it is position-independent) and needs no change in any attention implementation;
nothing is added back on read.

It matters for an int8 cache because SmolLM2's keys share a large common component: the mean
post-RoPE key of a layer and head has ~80 % of the keys' RMS norm (measured on 16 training prompts,
every layer 0.69-0.86). A per-token absmax scale spends its range on that common part; subtracting
it roughly halves the quantised part, and the teacher-forced KL of the int8 cache to the f32 cache
drops by a third (``docs/kvquant.md``, "candidates and the key shift"). This is SageAttention's
"smooth K" (Zhang et al. 2024, arXiv:2410.02367, which subtracts the mean key over the sequence);
here the mean is a per-model constant calibrated once, because the cache is written incrementally
and a token's stored code must not depend on later tokens.

Calibration (:func:`calibrate_k_shift`) is model-only: the mean key over a prefill of random
token ids. On SmolLM2 it points the same way as the mean over real chat prompts (cosine 0.95,
norm ratio 0.98) and gives about the same error reduction (teacher-forced KL 1.50e-4 against
1.31e-4, from 2.13e-4 unshifted), so no calibration text ships with jmtp. The free-running greedy
agreement with the f32 cache did not measurably change (~89-91 % either way: its run-to-run
spread between equally good quantisers is about as large as any difference, ``docs/kvquant.md``).

Engines that hand requests to each other (:mod:`jmtp.runtime.host.handoff`) must store keys with the
same shift; the parameter digest of their fingerprint covers ``params["k_shift"]``.

The shift is stored as ``params["k_shift"] f32[L, Nkv, D]`` (target layers; the MTP cache is
stored unshifted) and used only by int8 caches (:func:`jmtp.model.llama.decoder_layer`). For a
hybrid model (gated DeltaNet + full attention, ``ModelConfig.is_hybrid``) ``L`` counts the layers
that have a KV cache (``ModelConfig.kv_layers``, row ``j`` for cache layer ``j``): the linear
layers store no keys.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jmtp.model.config import ModelConfig

#: Calibration prefill: sequences x tokens of random ids (seeded).
CALIBRATION_SEQS, CALIBRATION_LEN, CALIBRATION_SEED = 4, 128, 0


def calibrate_k_shift(cfg: ModelConfig, params: dict, num_seqs: int = CALIBRATION_SEQS,
                      seq_len: int = CALIBRATION_LEN, seed: int = CALIBRATION_SEED,
                      block_size: int = 16) -> jax.Array:
    """Mean post-RoPE key of every layer with a KV cache and KV head: ``f32[L, Nkv, D]`` (``L``:
    ``cfg.num_kv_layers``, every layer of a model without linear-attention layers).

    ``num_seqs`` sequences of ``seq_len`` token ids drawn uniformly from the vocabulary
    (``np.random.default_rng(seed)``) run as one prefill of the target (positions
    ``0..seq_len-1``) into an unquantised f32 paged cache; the keys are read back from it (the
    values a cache would store) and averaged over all ``num_seqs * seq_len`` tokens.

    Raises:
      ValueError: ``cfg`` uses MLA attention (no per-head keys), or ``num_seqs`` / ``seq_len`` /
        ``block_size`` < 1.
    """
    from jmtp.model.llama import forward, init_model_cache
    from jmtp.model.metadata import ragged_batch

    if cfg.is_mla:
        raise ValueError("calibrate_k_shift: attention_type='mla' has no per-head key cache")
    for name, v in (("num_seqs", num_seqs), ("seq_len", seq_len), ("block_size", block_size)):
        if v < 1:
            raise ValueError(f"calibrate_k_shift: {name} must be >= 1, got {v}")
    ids = np.random.default_rng(seed).integers(0, cfg.vocab_size, num_seqs * seq_len)
    pages = -(-seq_len // block_size)
    tables = jnp.arange(num_seqs * pages, dtype=jnp.int32).reshape(num_seqs, pages)
    n = num_seqs * seq_len
    pos, meta = ragged_batch(jnp.full((num_seqs,), seq_len, jnp.int32),
                             jnp.zeros((num_seqs,), jnp.int32), tables, block_size, n)
    # (a hybrid model's linear layers run on a state pool of one slot per sequence)
    cache = init_model_cache(cfg, num_seqs * pages, block_size, jnp.float32, num_slots=num_seqs)
    core = {k: v for k, v in params.items() if k != "k_shift"}
    # a function object of this call's own: its executable is dropped when the call returns
    # (jitting the module-level forward would keep it, and its memory mappings, for good)
    _, cache = jax.jit(functools.partial(forward), static_argnums=0)(
        cfg, core, jnp.asarray(ids, jnp.int32), pos, meta, cache)
    # Block b of sequence s is s * pages + b: each sequence's slots are contiguous.
    k = cache.k.reshape(cfg.num_kv_layers, num_seqs, pages * block_size, cfg.num_kv_heads, -1)
    return jnp.mean(k[:, :, :seq_len].astype(jnp.float32), axis=(1, 2))


def with_k_shift(cfg: ModelConfig, params: dict, kv_cache_dtype: str | None) -> dict:
    """``params`` with ``"k_shift"`` (:func:`calibrate_k_shift`) added when ``kv_cache_dtype`` is
    ``"int8"`` and ``params`` has none (MLA models excepted: they have no int8 cache); otherwise
    ``params`` unchanged. A given ``params["k_shift"]`` must be ``f32[L, Nkv, D]`` (``L =
    cfg.num_kv_layers``).

    Raises:
      ValueError: a given ``params["k_shift"]`` of another shape.
    """
    if "k_shift" in params:
        want = (cfg.num_kv_layers, cfg.num_kv_heads, cfg.head_dim)
        if tuple(params["k_shift"].shape) != want:
            raise ValueError(f"params['k_shift'] must be f32{list(want)} (layers, kv heads, "
                             f"head dim), got {list(params['k_shift'].shape)}")
        return params
    if kv_cache_dtype != "int8" or cfg.is_mla:
        return params
    return {**params, "k_shift": calibrate_k_shift(cfg, params)}
