"""``LLM(batch_invariant=True)`` (jmtp/model/invariant.py): a request's logits are bit-identical
alone and among 7 batch mates of other lengths, in one-row decode steps and in MTP verify windows,
with its prompt prefilled whole or in chunks; in bf16 and with an int8 KV cache. So greedy MTP
output equals plain output and a request's tokens (sampled ones too) never depend on its batch
mates. The control: the default mode's logprobs do differ between the same runs (bf16, CPU).

Bits are compared through the engine's logprobs (log-softmax of the window logits, per row):
equal floats, not a tolerance."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jmtp
from jmtp import SamplingParams, SpeculativeConfig

# one worker builds the engines once; rows computed in different buckets: each step in its own
pytestmark = [pytest.mark.compile_lazy, pytest.mark.xdist_group("batch_invariant")]

RNG = np.random.default_rng(0)
PROMPTS = [[int(t) for t in RNG.integers(2, 64, n)] for n in (5, 31, 9, 22, 3, 12, 17, 7)]
GREEDY = SamplingParams(max_tokens=14, logprobs=2, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=14, logprobs=2, ignore_eos=True, temperature=0.9, seed=11)


def _run(llm, prompts, sp):
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs)
            for o in llm.generate(prompts, sp, use_tqdm=False)]


@pytest.fixture(scope="module")
def runs():
    """``{(kv_cache_dtype, batch_invariant, engine): {name: [(tokens, logprobs)]}}`` over a tiny
    bf16 model: each prompt of interest alone and all 8 prompts together, plain and MTP K=3;
    a 32-row step budget prefills the long prompts in chunks when batched."""
    from tests.runtime.conftest import tiny_model
    cfg, params = tiny_model(std=0.5)
    params = jax.tree.map(lambda a: a.astype(jnp.bfloat16) if a.dtype == jnp.float32 else a,
                          params)
    out = {}
    for kv, bi in ((None, True), ("int8", True), (None, False)):
        # the int8 engines scan their layers (the others unroll them, the CPU default): both
        # loops are covered, and the scan compiles faster
        kw = dict(model_config=cfg, params=params, dtype="bfloat16", max_num_seqs=8,
                  max_model_len=80, max_num_batched_tokens=32, max_logprobs=2, compile="lazy",
                  kv_cache_dtype=kv, batch_invariant=bi,
                  layer_loop="scan" if kv == "int8" else "auto")
        engines = {"plain": jmtp.LLM(**kw)}
        if bi:
            engines["mtp"] = jmtp.LLM(speculative_config=SpeculativeConfig("mtp", 3), **kw)
        for name, llm in engines.items():
            r = dict(alone=[_run(llm, [p], GREEDY)[0] for p in PROMPTS[:2]],
                     batch=_run(llm, PROMPTS, GREEDY))
            if bi:
                r.update(sampled_alone=_run(llm, PROMPTS[1:2], SAMPLED),
                         sampled_batch=_run(llm, PROMPTS, SAMPLED))
            out[kv, bi, name] = r
            llm.close()
    return out


@pytest.mark.parametrize("kv", [None, "int8"])
def test_rows_are_bit_identical_alone_batched_and_speculative(runs, kv):
    plain, mtp = runs[kv, True, "plain"], runs[kv, True, "mtp"]
    for i in range(2):          # alone vs among 7 batch mates (chunked prefill): same bits
        assert plain["alone"][i] == plain["batch"][i]
        assert mtp["alone"][i] == mtp["batch"][i]
    # greedy MTP (verify windows of 4 rows) == plain decoding (one-row steps), bit for bit
    assert mtp["batch"] == plain["batch"]
    # a seeded sampled request: the same tokens and logprobs alone and among batch mates
    # (drafts, verification and the random stream all independent of the batch)
    assert mtp["sampled_alone"][0] == mtp["sampled_batch"][1]
    assert plain["sampled_alone"][0] == plain["sampled_batch"][1]


def test_default_mode_is_not_batch_invariant(runs):
    """The control for the test above: without the mode, the same request's logprobs differ
    alone and batched (XLA:CPU picks another matmul kernel by the row count)."""
    if jax.default_backend() != "cpu":
        pytest.skip("measured on XLA:CPU")
    r = runs[None, False, "plain"]
    assert any(r["alone"][i][1] != r["batch"][i][1] for i in range(2))


def test_batch_invariant_refuses_what_it_does_not_cover(tiny):
    cfg, params = tiny
    with pytest.raises(ValueError, match="attention_backend='xla'"):
        jmtp.LLM(model_config=cfg, params=params, batch_invariant=True,
                 attention_backend="reference", compile="lazy")
    with pytest.raises(ValueError, match="MLA attention"):
        mla = cfg.replace(attention_type="mla", q_lora_rank=None, kv_lora_rank=16,
                          qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8)
        from jmtp.model import init_params
        jmtp.LLM(model_config=mla, params=init_params(mla, jax.random.key(0)),
                 batch_invariant=True, compile="lazy")
