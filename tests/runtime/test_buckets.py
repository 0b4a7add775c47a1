"""Step buckets: hand-worked token buckets, bucket choice and the device-side slot compaction."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jmtp.runtime.config import EngineConfig, SpeculativeConfig
from jmtp.runtime.device.buckets import (StepBucket, active_slots, choose_bucket, slot_buckets,
                                         step_buckets)
from tests.runtime.conftest import engine_of

pytestmark = pytest.mark.compile_lazy   # about buckets: each step in its own (conftest.py)

B8K3 = EngineConfig(max_num_seqs=8, spec=SpeculativeConfig("mtp", 3), max_num_batched_tokens=128)


def test_token_buckets_hand_worked():
    # W, 2W, 4W, ... below B*W, B*W, then powers of two from 8 above B*W with the midpoints
    # 48, 96, 192, ... between them, then the budget.
    buckets = lambda **kw: EngineConfig(**kw).token_buckets()
    assert buckets(max_num_seqs=1, max_num_batched_tokens=256) == (1, 8, 16, 32, 48, 64, 96, 128,
                                                                   192, 256)
    assert buckets(max_num_seqs=8, max_num_batched_tokens=256) == (1, 2, 4, 8, 16, 32, 48, 64, 96,
                                                                   128, 192, 256)
    assert B8K3.token_buckets() == (4, 8, 16, 32, 48, 64, 96, 128)
    assert buckets(max_num_seqs=16, spec=SpeculativeConfig("mtp", 3),
                   max_num_batched_tokens=100) == (4, 8, 16, 32, 64, 100)  # 48 <= B*W; 96 ~ 100
    assert buckets(max_num_seqs=1, max_num_batched_tokens=108) == (1, 8, 16, 32, 48, 64, 96, 108)
    assert buckets(max_num_seqs=1, max_num_batched_tokens=48) == (1, 8, 16, 32, 48)
    assert buckets(max_num_seqs=3, max_num_batched_tokens=20) == (1, 2, 3, 8, 16, 20)
    assert buckets(max_num_seqs=5, spec=SpeculativeConfig("custom", 1, drafter=len),
                   max_num_batched_tokens=10) == (2, 4, 8, 10)
    assert buckets(max_num_seqs=1, spec=SpeculativeConfig("mtp", 1),
                   max_num_batched_tokens=64) == (2, 8, 16, 32, 48, 64)


def test_choose_bucket_hand_worked():
    ec = B8K3
    assert slot_buckets(ec) == (1, 2, 4, 8)
    # Decode-only: A = next power of two of the slots, T = the smallest of A, 2A, 4A (= A*(K+1))
    # holding the rows each slot really drafted (1 + drafts).
    assert choose_bucket(ec, 1, 1, False) == StepBucket(1, 1)      # one slot, no drafts
    assert choose_bucket(ec, 2, 1, False) == StepBucket(2, 1)
    assert choose_bucket(ec, 3, 1, False) == StepBucket(4, 1)
    assert choose_bucket(ec, 4, 1, False) == StepBucket(4, 1)
    assert choose_bucket(ec, 8, 2, False) == StepBucket(8, 2)
    assert choose_bucket(ec, 3, 3, False) == StepBucket(4, 4)      # 3 slots, no drafts
    assert choose_bucket(ec, 5, 3, False) == StepBucket(8, 4)
    assert choose_bucket(ec, 12, 3, False) == StepBucket(16, 4)
    assert choose_bucket(ec, 8, 8, False) == StepBucket(8, 8)      # 8 slots, no drafts
    assert choose_bucket(ec, 20, 5, False) == StepBucket(32, 8)
    assert choose_bucket(ec, 32, 8, False) == StepBucket(32, 8)
    assert choose_bucket(ec, 0, 0, False) == StepBucket(1, 1)      # idle step: the smallest
    with pytest.raises(ValueError, match="decode windows"):
        choose_bucket(ec, 5, 1, False)
    # With a prefill chunk: A = B, T = the smallest token bucket >= rows.
    assert choose_bucket(ec, 3, 1, True) == StepBucket(4, 8)
    assert choose_bucket(ec, 4 + 37, 2, True) == StepBucket(48, 8)
    assert choose_bucket(ec, 4 + 50, 2, True) == StepBucket(64, 8)
    assert choose_bucket(ec, 97, 2, True) == StepBucket(128, 8)
    assert choose_bucket(ec, 128, 8, True) == StepBucket(128, 8)
    # B not a power of two: the slot buckets end at B.
    ec3 = EngineConfig(max_num_seqs=3, spec=SpeculativeConfig("mtp", 1), max_num_batched_tokens=16)
    assert slot_buckets(ec3) == (1, 2, 3)
    assert choose_bucket(ec3, 6, 3, False) == StepBucket(6, 3)
    assert choose_bucket(ec3, 3, 3, False) == StepBucket(3, 3)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        choose_bucket(ec, 129, 8, True)
    with pytest.raises(ValueError, match="num_slots"):
        choose_bucket(ec, 4, 9, False)


def test_step_buckets_list_every_choice():
    for ec in (B8K3, EngineConfig(max_num_seqs=3, max_num_batched_tokens=20),
               EngineConfig(max_num_seqs=1), EngineConfig(max_num_seqs=6, spec=SpeculativeConfig(
                   "mtp", 2), max_num_batched_tokens=40)):
        listed = set(step_buckets(ec))
        W, B = ec.window, ec.max_num_seqs
        chosen = set()
        for n_dec in range(B + 1):
            for n_pre in range(B + 1 - n_dec):
                if n_pre == 0:    # decode-only: 1..W rows per slot
                    for rows in range(n_dec, n_dec * W + 1):
                        chosen.add(choose_bucket(ec, rows, n_dec, False))
                else:             # any mix of windows and chunks up to the budget
                    for rows in range(n_dec + n_pre, ec.max_num_batched_tokens + 1):
                        chosen.add(choose_bucket(ec, rows, n_dec + n_pre, True))
        assert chosen == listed
    # Hand-worked: decode (A, T) for A in 1, 2, 4, 8 and T in A, 2A, 4A; prefill (T, 8) for the
    # token buckets 4..128 (48 and 96 included).
    S = StepBucket
    assert step_buckets(B8K3) == (S(1, 1), S(2, 1), S(2, 2), S(4, 1), S(4, 2), S(4, 4), S(4, 8),
                                  S(8, 2), S(8, 4), S(8, 8), S(16, 4), S(16, 8), S(32, 8), S(48, 8),
                                  S(64, 8), S(96, 8), S(128, 8))


def test_active_slots_compaction():
    active = jnp.asarray([False, True, False, False, False, True, True, False])
    slots, valid = active_slots(active, 4)
    np.testing.assert_array_equal(slots, [1, 5, 6, 8])
    np.testing.assert_array_equal(valid, [True, True, True, False])
    slots, valid = active_slots(jnp.zeros((3,), bool), 2)
    np.testing.assert_array_equal(slots, [3, 3])
    np.testing.assert_array_equal(valid, [False, False])
    slots, _ = active_slots(jnp.ones((3,), bool), 3)
    np.testing.assert_array_equal(slots, [0, 1, 2])


def _spy_buckets(llm):
    """Record the bucket of every step the host runs."""
    seen, real = [], engine_of(llm).runner.jitted_step

    def step(*a):
        seen.append(a[0].bucket)
        return real(*a)

    engine_of(llm).runner.jitted_step = step
    return seen


@pytest.mark.xdist_group("buckets_scattered")       # both cases on one worker: one compile
@pytest.mark.parametrize("sampled", [False, True])
def test_scattered_active_slots_match_a_narrow_engine(sampled, kept_engines):
    """Slots 1, 5, 6 of an 8-slot engine keep decoding while 0, 2, 3, 4 finished at their prefill
    and 7 stays idle: compacted into A = 4 rows (one padding row), their tokens equal the same
    requests' on a 3-slot engine (and greedy equals the non-paged reference)."""
    from jmtp.runtime.host.llm import LLM, SamplingParams
    from tests.runtime.conftest import reference_greedy, tiny_model, free_blocks
    cfg, params = tiny_model(0)
    spec = SpeculativeConfig("mtp", 2, 2)
    kw = dict(model_config=cfg, params=params, speculative_config=spec, max_model_len=64,
              block_size=4, max_num_batched_tokens=48)
    wide = LLM(max_num_seqs=8, **kw)             # fresh engines, the compiled buckets shared
    narrow = LLM(max_num_seqs=3, **kw)
    kept_engines += [wide, narrow]
    long_prompts = [[5, 6, 7], list(range(2, 20)), [9] * 7]

    def sp(i, n):
        return (SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.9, top_p=0.95,
                               seed=100 + i) if sampled else
                SamplingParams(max_tokens=n, ignore_eos=True))

    short = [[3, 4], [11], [12, 13, 14], [20]]
    prompts = [short[0], long_prompts[0], short[1], short[2], short[3], long_prompts[1],
               long_prompts[2]]
    sps = [sp(9, 1), sp(0, 20), sp(9, 1), sp(9, 1), sp(9, 1), sp(1, 20), sp(2, 20)]
    seen = _spy_buckets(wide)
    outs = wide.generate(prompts, sps, use_tqdm=False)
    assert StepBucket(12, 4) in seen and StepBucket(24, 8) not in seen, seen
    ref = narrow.generate(long_prompts, [sp(0, 20), sp(1, 20), sp(2, 20)], use_tqdm=False)
    got = [outs[1], outs[5], outs[6]]
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    assert all(len(o.token_ids) == 20 for o in got)
    if not sampled:
        assert [o.token_ids for o in got] == [reference_greedy(cfg, params, p, 20, stop_ids=())
                                              for p in long_prompts]
    assert free_blocks(wide) == wide.llm_engine.engine_config.num_blocks
