"""Engine with a quantised KV cache (``kv_cache_dtype``): greedy MTP speculation stays token-identical
to greedy plain decoding on the same int8 cache (lossless relative to its own cache), both caches
are quantised, and their bytes match the hand-computed sizes."""
from __future__ import annotations

import jax.numpy as jnp
import pytest

from jmtp.runtime.config import SpeculativeConfig
from jmtp.runtime.host.llm import LLM, SamplingParams
from tests.runtime.conftest import tiny_model, free_blocks

pytestmark = pytest.mark.xdist_group("kvquant_engine")  # one worker runs the module-scoped fixture once

K = 3
BS, MAX_LEN, SEQS = 4, 64, 2
PROMPTS = [[5, 6, 7], [3], list(range(2, 30)), [9] * 11]


def _llm(k):
    cfg, params = tiny_model(0)
    return LLM(model_config=cfg, params=params, kv_cache_dtype="int8", max_num_seqs=SEQS,
               speculative_config=SpeculativeConfig("mtp", k) if k else None,
               max_model_len=MAX_LEN, block_size=BS, max_num_batched_tokens=16)


@pytest.fixture(scope="module")
def runs():
    """(plain LLM, its outputs, MTP K=3 LLM, its outputs), both on int8 caches: 4 prompts on 2
    slots (queueing), one prompt longer than the 16-token step budget (chunked prefill)."""
    sp = SamplingParams(max_tokens=20, ignore_eos=True)
    plain, spec = _llm(None), _llm(K)
    return (plain, plain.generate(PROMPTS, sp, use_tqdm=False),
            spec, spec.generate(PROMPTS, sp, use_tqdm=False))


def test_mtp_equals_plain_on_int8_cache(runs):
    plain, plain_outs, spec, spec_outs = runs
    for a, b in zip(plain_outs, spec_outs):
        assert b.token_ids == a.token_ids and len(a.token_ids) == 20
    m = [o.metrics for o in spec_outs]
    assert sum(x.num_draft_tokens for x in m) > 0          # the MTP head drafted (and was verified)
    for llm in (plain, spec):
        assert free_blocks(llm) == llm.llm_engine.engine_config.num_blocks
    # The int8 engines run with the calibrated key shift (jmtp.model.kv_shift) of their model.
    from flax import nnx

    from jmtp.model.kv_shift import calibrate_k_shift
    for llm in (plain, spec):
        model = nnx.merge(llm.llm_engine.runner.graphdef, llm.llm_engine.runner.params)
        want = calibrate_k_shift(llm.model_config, tiny_model(0)[1])
        assert model.k_shift is not None
        assert jnp.array_equal(model.k_shift[...], want)
    # Both caches hold int8 values with f32 scales, and decoding wrote them.
    for c in (spec.llm_engine.runner.cache, spec.llm_engine.runner.mtp_cache):
        assert c.k.dtype == c.v.dtype == jnp.int8 and c.k_scale.dtype == jnp.float32
        assert float(jnp.max(c.k_scale)) > 0 and float(jnp.max(c.v_scale)) > 0


def test_kv_cache_bytes_hand_computed(runs):
    """TINY: 2 layers (+1 MTP layer), Nkv 2, D 8; num_blocks = SEQS * pages_per_seq. int8 values:
    1 byte (a quarter of f32's 4), scales 4 bytes per slot per head, for K and V each."""
    _, _, spec, _ = runs
    cfg, ec = spec.model_config, spec.llm_engine.engine_config
    slots = ec.num_blocks * BS
    assert ec.num_blocks == SEQS * ec.pages_per_seq and ec.kv_cache_dtype == "int8"
    values = lambda layers: 2 * layers * slots * cfg.num_kv_heads * cfg.head_dim * 1  # noqa: E731
    scales = lambda layers: 2 * layers * slots * cfg.num_kv_heads * 4                 # noqa: E731
    got = spec.kv_cache_bytes()
    assert got == dict(target_values=values(2), target_scales=scales(2), mtp_values=values(1),
                       mtp_scales=scales(1), values=values(3), scales=scales(3),
                       linear_state=0, prefix_states=0, prefix_state_entry=0,
                       total=values(3) + scales(3))


def test_unknown_kv_cache_dtype_is_rejected_early():
    cfg, params = tiny_model(0)
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of \(None, 'int8', "
                                         r"'fp8_e4m3'\), got 'fp8'"):
        LLM(model_config=cfg, params=params, kv_cache_dtype="fp8")


@pytest.mark.parametrize("kv", ["int8", "fp8_e4m3"])
def test_quantized_forward_close_to_unquantized(kv):
    """A paged prefill and decode steps of the tiny model on a quantised cache give logits close to
    the f32 cache's. The int8 path rotates q, K, V (kv_quant.hadamard_rotation) and rotates the
    attention output back: a missing or wrong inverse would put the logits O(1) away, far outside
    the bound; the bound itself is a few int8 / fp8 steps of relative error."""
    import numpy as np

    from jmtp.model import forward, init_kv_cache, ragged_batch
    from jmtp.model.llama import compute_logits

    cfg, params = tiny_model(0, head_dim=16, num_heads=2)
    ids = np.random.default_rng(1).integers(2, cfg.vocab_size, 23).astype(np.int32)
    bs, pages = 4, 6
    tables = jnp.arange(pages, dtype=jnp.int32)[None]

    def run(kv_cache_dtype):
        cache = init_kv_cache(cfg, cfg.num_layers, pages, bs, jnp.float32, kv_cache_dtype)
        logits, done = [], 0
        for c in (17, 1, 1, 4):                     # prefill chunk, two decode rows, a window
            pos, meta = ragged_batch(jnp.array([c], jnp.int32), jnp.array([done], jnp.int32),
                                     tables, bs, c)
            h, cache = forward(cfg, params, jnp.asarray(ids[done:done + c]), pos, meta, cache)
            logits.append(np.asarray(compute_logits(params, h)))
            done += c
        return np.concatenate(logits)

    ref, got = run(None), run(kv)
    rel = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    assert rel < (0.03 if kv == "int8" else 0.15), rel     # measured 0.014 / 0.088; no inverse: 1.36
