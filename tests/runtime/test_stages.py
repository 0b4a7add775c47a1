"""Each stage of the engine step (``jmtp.runtime.device.target_stages``, ``draft_stages``, ``slots``,
wired by ``jmtp.runtime.device.step``) on its own: hand-worked cases, numpy references, hypothesis
properties, and ``chex.assert_max_traces`` (a stage, and the whole step per bucket, trace once)."""
from __future__ import annotations

import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import HealthCheck, given, settings, strategies as st

from jmtp.model import forward_logits
from jmtp.model.llama import compute_logits, init_kv_cache, mtp_forward
from jmtp.model.metadata import packed_row_seq, ragged_batch
from jmtp.model.modules import LlamaForCausalLM
from jmtp.pallas import block_allocator as ba
from jmtp.pallas.block_allocator import BlockAllocatorState, blocks_needed
from jmtp.runtime.config import EngineConfig, SpeculativeConfig
from jmtp.runtime.device import draft_stages as drs, slots, step as stp, target_stages as tgs
from jmtp.runtime.device.buckets import StepBucket, step_buckets
from jmtp.runtime.device.spec import StepSpec
from jmtp.runtime.device.state import FINISH_LENGTH, FINISH_NONE, FINISH_STOP, init_state
from jmtp.runtime.host.llm import LLM, SamplingParams
from tests.runtime.conftest import tiny_model, engine_of

pytestmark = pytest.mark.compile_lazy   # about buckets: each step in its own (conftest.py)

B, K, M, BS, MAX_LEN = 3, 2, 2, 4, 32
EC = EngineConfig(max_num_seqs=B, max_model_len=MAX_LEN, block_size=BS, num_blocks=24,
                  max_num_batched_tokens=16, spec=SpeculativeConfig("mtp", K, M))
V = 64
TINY_CFG = tiny_model()[0]
PROPS = settings(max_examples=40, deadline=None, derandomize=True,
                 suppress_health_check=list(HealthCheck))


def i32(x):
    return jnp.asarray(x, jnp.int32)


def make_state(ec=EC, **fields):
    """Idle state of ``ec`` with ``fields`` replaced (lists become i32 / bool arrays)."""
    s = init_state(ec, V)
    conv = {k: (jnp.asarray(v, bool) if k in ("stop_flags", "paused") else i32(v))
            if isinstance(v, (list, tuple, np.ndarray)) else v for k, v in fields.items()}
    return dataclasses.replace(s, **conv)


def sched_of(slt, enc, nd, pre, dec, paused=(False,) * B):
    return tgs.Schedule(seq_lens_this_time=i32(slt), seq_lens_encoder=i32(enc),
                        num_drafts=i32(nd), prefilling=jnp.asarray(pre, bool),
                        decoding=jnp.asarray(dec, bool), paused=jnp.asarray(paused, bool))


# ------------------------------------------------------------------------------ schedule
def test_schedule_hand_case_and_traces_once():
    # slot 0: prompt 10, 4 prefilled, host offers 8 -> chunk 6 (what is left);
    # slot 1: decoding, window [7, 3, -1] -> 1 + 1 draft; slot 2: idle.
    s = make_state(prompt_lens=[10, 5, 0], seq_lens_decoder=[4, 6, 0],
                   stop_flags=[False, False, True],
                   draft_tokens=[[-1, -1, -1], [7, 3, -1], [-1, -1, -1]])
    fn = functools.partial(jax.jit(chex.assert_max_traces(tgs.schedule, n=1), static_argnums=0), EC)
    out = fn(s, i32([8, 8, 8]))
    chex.assert_shape([out.seq_lens_this_time, out.seq_lens_encoder, out.num_drafts], (B,))
    chex.assert_type([out.seq_lens_this_time, out.seq_lens_encoder, out.num_drafts], jnp.int32)
    chex.assert_type([out.prefilling, out.decoding, out.paused], bool)
    np.testing.assert_array_equal(out.seq_lens_this_time, [6, 2, 0])
    np.testing.assert_array_equal(out.seq_lens_encoder, [6, 0, 0])
    np.testing.assert_array_equal(out.num_drafts, [0, 1, 0])
    np.testing.assert_array_equal(out.prefilling, [True, False, False])
    np.testing.assert_array_equal(out.decoding, [False, True, False])
    assert not out.paused.any()
    # new data, same shapes: no retrace (assert_max_traces raises on a second trace)
    out = fn(dataclasses.replace(s, draft_tokens=i32([[-1] * 3, [7, 3, 4], [-1] * 3])),
             i32([2, 0, 0]))
    np.testing.assert_array_equal(out.seq_lens_this_time, [2, 3, 0])


# ------------------------------------------------------------------------ allocate_blocks
def test_allocate_blocks_hand_case():
    # N=6 blocks, stack [0..5] (5 on top, handed out first), no slot owns any.
    # slot 0: dec 0, slt 6 -> positions 0..5 + MTP overhang M-1=1 -> ceil(7/4) = 2 blocks
    # slot 1: dec 9, slt 3 -> ceil(13/4) = 4 blocks, only 4 left after slot 0 -> gets them
    # slot 2: dec 0, slt 1 -> ceil(2/4) = 1 block, none left -> paused, its row zeroed
    blocks = BlockAllocatorState.create(6, B, 5)
    sched = sched_of([6, 3, 1], [6, 0, 1], [0, 2, 0], [True, False, True],
                     [False, True, False])
    fn = functools.partial(jax.jit(chex.assert_max_traces(tgs.allocate_blocks, n=1), static_argnums=0), EC)
    new, out = fn(blocks, sched, i32([0, 9, 0]))
    np.testing.assert_array_equal(new.block_tables, [[5, 4, -1, -1, -1], [3, 2, 1, 0, -1],
                                                     [-1] * 5])
    np.testing.assert_array_equal(new.num_owned, [2, 4, 0])
    assert int(new.free_count) == 0
    np.testing.assert_array_equal(out.paused, [False, False, True])
    np.testing.assert_array_equal(out.seq_lens_this_time, [6, 3, 0])
    np.testing.assert_array_equal(out.seq_lens_encoder, [6, 0, 0])
    np.testing.assert_array_equal(out.prefilling, [True, False, False])
    np.testing.assert_array_equal(out.num_drafts, [0, 2, 0])
    # A step later: slot 0 (dec 4, slt 3: ceil(8/4) = 2) owns enough; slot 1 (dec 14, slt 3:
    # ceil(18/4) = 5) needs a 5th block and none is free: paused, nothing changes.
    new2, out2 = fn(new, sched_of([3, 3, 0], [0, 0, 0], [2, 2, 0], [False] * 3,
                                  [True, True, False]), i32([4, 14, 0]))
    np.testing.assert_array_equal(out2.paused, [False, True, False])
    np.testing.assert_array_equal(new2.block_tables, new.block_tables)
    np.testing.assert_array_equal(out2.seq_lens_this_time, [3, 0, 0])



def test_release_finished_and_release_slot_hand_case():
    # Slot 0 owns [5, 4], slot 1 owns [3, 2, 1, 0], stack empty (the state the hand case above
    # reaches). Slot 1 finishes: its blocks go back in table order, so its last block (0) is on
    # top; its row becomes -1. Then slot 0 is preempted: [5, 4] pushed after, 4 on top, and the
    # slot is marked idle.
    tables = i32([[5, 4, -1, -1, -1], [3, 2, 1, 0, -1], [-1] * 5])
    blocks = BlockAllocatorState(free_stack=i32([-1] * 6), free_count=jnp.int32(0),
                                 block_tables=tables, num_owned=i32([2, 4, 0]))
    state = dataclasses.replace(make_state(stop_flags=[False, False, True]), blocks=blocks)
    fn = jax.jit(chex.assert_max_traces(slots.release_finished, n=1), static_argnums=0)
    out = fn(EC, state, jnp.asarray([False, True, False]))
    assert int(out.free_count) == 4
    np.testing.assert_array_equal(out.free_stack[:4], [3, 2, 1, 0])
    np.testing.assert_array_equal(out.block_tables, [[5, 4, -1, -1, -1], [-1] * 5, [-1] * 5])
    np.testing.assert_array_equal(out.num_owned, [2, 0, 0])
    np.testing.assert_array_equal(out.stop_flags, [False, False, True])   # only blocks change
    out2 = slots.release_slot(EC, out, jnp.int32(0))
    assert int(out2.free_count) == 6
    np.testing.assert_array_equal(out2.free_stack, [3, 2, 1, 0, 5, 4])
    np.testing.assert_array_equal(out2.num_owned, [0, 0, 0])
    np.testing.assert_array_equal(out2.stop_flags, [True, False, True])

def test_blocks_needed_is_ceil():
    assert [blocks_needed(n, 4) for n in range(10)] == [0, 1, 1, 1, 1, 2, 2, 2, 2, 3]
    np.testing.assert_array_equal(blocks_needed(i32([0, 4, 5]), 4), [0, 1, 2])
    assert EC.pages_per_seq == -(-(MAX_LEN + K + M) // BS)


@PROPS
@given(data=st.data())
def test_allocate_blocks_properties(data):
    """No block owned twice, free + owned constant, paused slots unchanged and unscheduled,
    served slots own what their writes need."""
    n, p = data.draw(st.integers(1, 12), label="N"), 6
    # a valid state: hand out random disjoint blocks to the slots
    perm = list(np.random.default_rng(data.draw(st.integers(0, 2**16))).permutation(n))
    tables, owned = np.full((B, p), -1, np.int32), np.zeros(B, np.int32)
    for b in range(B):
        k = data.draw(st.integers(0, min(len(perm), 3)))
        tables[b, :k] = [perm.pop() for _ in range(k)]
        owned[b] = k
    fs = np.full(n, -1, np.int32)
    fs[:len(perm)] = perm
    blocks = BlockAllocatorState(i32(fs), i32(len(perm)), i32(tables), i32(owned))
    slt = data.draw(st.lists(st.integers(0, 5), min_size=B, max_size=B), label="slt")
    dec = data.draw(st.lists(st.integers(0, 12), min_size=B, max_size=B), label="dec")
    sched = sched_of(slt, [0] * B, [max(x - 1, 0) for x in slt], [False] * B,
                     [x > 0 for x in slt])
    new, out = tgs.allocate_blocks(EC, blocks, sched, i32(dec))
    ba.check_state(new.free_stack, new.free_count, new.block_tables, new.num_owned)
    assert int(new.free_count) + int(new.num_owned.sum()) == n
    for b in range(B):
        need = -(-(dec[b] + slt[b] + M - 1) // BS) if slt[b] else 0
        if out.paused[b]:
            assert slt[b] > 0 and int(out.seq_lens_this_time[b]) == 0
            np.testing.assert_array_equal(new.block_tables[b], tables[b])
        else:
            assert int(out.seq_lens_this_time[b]) == slt[b]
            assert int(new.num_owned[b]) >= need
            np.testing.assert_array_equal(new.block_tables[b, :owned[b]], tables[b, :owned[b]])


# -------------------------------------------------------------------------- target_forward
@pytest.fixture(scope="module")
def tiny():
    return tiny_model()


def _ref_logits(cfg, params, ids):
    padded = list(ids) + [0] * (-len(ids) % 64)
    return np.asarray(forward_logits(cfg, params, padded, block_size=64))[:len(ids)]


def _prefilled(cfg, params, prompts):
    """State + caches after a full prefill of ``prompts`` into slots 0.. (chunk = prompt)."""
    s = make_state(prompt_lens=[len(p) for p in prompts] + [0] * (B - len(prompts)),
                   stop_flags=[False] * len(prompts) + [True] * (B - len(prompts)))
    ids = np.zeros((B, EC.seq_buffer_len), np.int32)
    for b, p in enumerate(prompts):
        ids[b, :len(p)] = p
    s = dataclasses.replace(s, input_ids=i32(ids))
    sched = tgs.schedule(EC, s, i32([16] * B))
    blocks, sched = tgs.allocate_blocks(EC, s.blocks, sched, s.seq_lens_decoder)
    cache = init_kv_cache(cfg, cfg.num_layers, EC.num_blocks, BS)
    return s, sched, blocks, cache


def _target(hidden, cu_q_lens, logits, slots):
    """A TargetOutput holding window logits ``f32[A, K+1, V]`` one row per window position."""
    A, W, V = logits.shape
    return tgs.TargetOutput(hidden=hidden, cu_q_lens=cu_q_lens,
                            logit_rows=logits.reshape(A * W, V),
                            window_rows=jnp.arange(A * W, dtype=jnp.int32).reshape(A, W),
                            slots=slots, valid=jnp.ones((A,), bool))


def test_target_forward_matches_full_forward(tiny):
    cfg, params = tiny
    prompts = [[5, 6, 7, 8, 9], [3, 4, 11]]
    s, sched, blocks, cache = _prefilled(cfg, params, prompts)
    bucket = StepBucket(16, 2)
    model = LlamaForCausalLM.from_params(cfg, params)
    graphdef = nnx.split(model)[0]
    spec = StepSpec.build(graphdef, EC, bucket)
    fwd = jax.jit(chex.assert_max_traces(tgs.target_forward, n=1), static_argnums=0)
    out, cache = fwd(spec, model, s, sched, blocks.block_tables, cache)
    chex.assert_shape(out.hidden, (16, cfg.hidden_size))
    chex.assert_shape(out.window_logits(K + 1), (2, K + 1, cfg.vocab_size))
    np.testing.assert_array_equal(out.cu_q_lens, [0, 5, 8, 8])
    np.testing.assert_array_equal(out.slots, [0, 1])
    assert out.valid.all()
    for a, p in enumerate(prompts):       # a prefill chunk's last row, in every column
        for col in range(K + 1):
            chex.assert_trees_all_close(out.window_logits(K + 1)[a, col],
                                        _ref_logits(cfg, params, p)[-1], atol=1e-4, rtol=1e-4)
    # Next step: slot 1 verifies the window [last, d1, d2] on top of the cache just written.
    s2 = dataclasses.replace(s, seq_lens_decoder=i32([5, 3, 0]), step_idx=i32([1, 1, 0]),
                             stop_flags=jnp.asarray([True, False, True]),
                             draft_tokens=i32([[-1] * 3, [20, 21, 22], [-1] * 3]),
                             input_ids=s.input_ids.at[1, 3].set(20))
    sched2 = tgs.schedule(EC, s2, i32([0] * B))
    blocks2, sched2 = tgs.allocate_blocks(EC, blocks, sched2, s2.seq_lens_decoder)
    out2, _ = fwd(spec, model, s2, sched2, blocks2.block_tables, cache)
    np.testing.assert_array_equal(out2.slots, [1, B])
    np.testing.assert_array_equal(out2.valid, [True, False])
    ref = _ref_logits(cfg, params, [3, 4, 11, 20, 21, 22])[3:]
    chex.assert_trees_all_close(out2.window_logits(K + 1)[0], ref, atol=1e-4, rtol=1e-4)
    # The same window in a bucket with fewer rows than window rows (T=4 < A*(K+1)=6): the LM head
    # runs over the 4 packed rows and the window indexes into them.
    fwd_small = jax.jit(tgs.target_forward, static_argnums=0)
    out3, _ = fwd_small(spec.with_bucket(StepBucket(4, 2)), model, s2, sched2,
                        blocks2.block_tables, cache)
    chex.assert_shape(out3.logit_rows, (4, cfg.vocab_size))
    chex.assert_trees_all_close(out3.window_logits(K + 1)[0], ref, atol=1e-4, rtol=1e-4)


# ------------------------------------------------------------------------ speculate_verify
def _one_hot_logits(argmax_rows):
    """f32[A, W, V] logits whose row argmaxes are ``argmax_rows``."""
    a = np.asarray(argmax_rows)
    return jnp.asarray(np.eye(V, dtype=np.float32)[a] * 10.0)


def test_speculate_verify_hand_case(tiny):
    cfg, _ = tiny
    # slot 0 decodes the window [x, 5, 9]: target argmaxes 5, 7, 2 -> accept 5, reject 9,
    #   correction 7 -> tokens [5, 7], accept_num 2, 1 draft accepted;
    # slot 1 ends its prefill (dec 2 + chunk 3 = prompt 5): its first token is row 0's argmax 13;
    # slot 2 ends the prefill of a resumed request: it re-emits its resume token 42.
    s = make_state(prompt_lens=[4, 5, 3], seq_lens_decoder=[6, 2, 0], step_idx=[3, 0, 0],
                   stop_flags=[False, False, False],
                   draft_tokens=[[8, 5, 9], [-1, -1, -1], [42, -1, -1]])
    sched = sched_of([3, 3, 3], [0, 3, 3], [2, 0, 0], [False, True, True], [True, False, False])
    target = _target(jnp.zeros((16, 4)), i32([0, 3, 6, 9]),
                     _one_hot_logits([[5, 7, 2], [13, 13, 13], [30, 30, 30]]), i32([0, 1, 2]))
    fn = jax.jit(chex.assert_max_traces(tgs.speculate_verify, n=1), static_argnums=(0, 1))
    out = fn(cfg, EC, s, sched, target)
    chex.assert_shape(out.accept_tokens, (B, K + 1))
    chex.assert_type([out.accept_tokens, out.accept_num, out.num_accepted], jnp.int32)
    np.testing.assert_array_equal(out.accept_num, [2, 1, 1])
    np.testing.assert_array_equal(out.accept_tokens[0, :2], [5, 7])
    assert int(out.accept_tokens[1, 0]) == 13 and int(out.accept_tokens[2, 0]) == 42
    assert int(out.num_accepted[0]) == 1
    assert out.logprobs is None


# ---------------------------------------------------------- truncate_at_stop, speculate_update
def _np_truncate(tokens, num, step_idx, seq_len, stop_ids, min_tokens, max_dec, max_len):
    """Independent loop over the tokens of each row."""
    out_n, fin, why = [], [], []
    for b in range(len(num)):
        n, f, r = num[b], False, FINISH_NONE
        for w in range(num[b]):
            gen = step_idx[b] + w + 1
            if tokens[b][w] in [x for x in stop_ids[b] if x >= 0] and gen > min_tokens[b]:
                n, f, r = w + 1, True, FINISH_STOP
                break
            if gen >= max_dec[b] or seq_len[b] + w + 1 >= max_len:
                n, f, r = w + 1, True, FINISH_LENGTH
                break
        out_n.append(n), fin.append(f), why.append(r)
    return out_n, fin, why


@PROPS
@given(data=st.data())
def test_truncate_at_stop_matches_numpy(data):
    W = K + 1
    rows = st.lists(st.integers(0, 6), min_size=W, max_size=W)
    tokens = data.draw(st.lists(rows, min_size=B, max_size=B), label="tokens")
    num = data.draw(st.lists(st.integers(0, W), min_size=B, max_size=B), label="num")
    step_idx = data.draw(st.lists(st.integers(0, 10), min_size=B, max_size=B))
    seq_len = [x + 3 for x in step_idx]
    stop_ids = data.draw(st.lists(st.lists(st.integers(-1, 6), min_size=2, max_size=2),
                                  min_size=B, max_size=B), label="stop_ids")
    min_tokens = data.draw(st.lists(st.integers(0, 12), min_size=B, max_size=B))
    max_dec = data.draw(st.lists(st.integers(1, 14), min_size=B, max_size=B))
    n, fin, why = tgs.truncate_at_stop(i32(tokens), i32(num), i32(step_idx), i32(seq_len),
                                       i32(stop_ids), i32(min_tokens), i32(max_dec), 15)
    rn, rf, rw = _np_truncate(tokens, num, step_idx, seq_len, stop_ids, min_tokens, max_dec, 15)
    np.testing.assert_array_equal(n, rn)
    np.testing.assert_array_equal(fin, rf)
    np.testing.assert_array_equal(np.where(fin, why, FINISH_NONE), rw)


def test_speculate_update_hand_case():
    # slot 0 decodes: prompt 4, 3 generated, emits [5, 7]: input_ids[7:9] = 5, 7; dec 6 -> 8.
    # slot 1 emits [1, 9, 9] but 1 is a stop token: cut to [1], finished (stop), dec 6 -> 7.
    # slot 2 prefills a chunk of 3 (not the last): nothing emitted, dec 0 -> 3.
    sam = init_state(EC, V).sampling
    sam = dataclasses.replace(sam, stop_token_ids=sam.stop_token_ids.at[:, 0].set(1))
    s = make_state(prompt_lens=[4, 4, 8], seq_lens_decoder=[6, 6, 0], step_idx=[3, 3, 0],
                   stop_flags=[False] * 3, max_dec_len=[20, 20, 20], sampling=sam,
                   draft_tokens=[[4, 5, 9], [2, 1, 9], [-1] * 3])
    sched = sched_of([3, 3, 3], [0, 0, 3], [2, 2, 0], [False, False, True], [True, True, False])
    ver = tgs.Verified(accept_tokens=i32([[5, 7, 0], [1, 9, 9], [0, 0, 0]]),
                       accept_num=i32([2, 3, 0]), num_accepted=i32([1, 2, -1]))
    fn = functools.partial(jax.jit(chex.assert_max_traces(tgs.speculate_update, n=1), static_argnums=0), EC)
    new, done = fn(s, sched, ver, s.blocks)
    np.testing.assert_array_equal(done.tokens, [[5, 7, -1], [1, -1, -1], [-1, -1, -1]])
    np.testing.assert_array_equal(done.num_tokens, [2, 1, 0])
    np.testing.assert_array_equal(done.num_accepted, [1, 1, 0])
    np.testing.assert_array_equal(done.finished, [False, True, False])
    np.testing.assert_array_equal(done.finish_reason, [FINISH_NONE, FINISH_STOP, FINISH_NONE])
    np.testing.assert_array_equal(new.seq_lens_decoder, [8, 7, 3])
    np.testing.assert_array_equal(new.step_idx, [5, 4, 0])
    np.testing.assert_array_equal(new.input_ids[0, 7:9], [5, 7])
    assert int(new.input_ids[1, 7]) == 1
    np.testing.assert_array_equal(new.draft_tokens, [[7, -1, -1], [1, -1, -1], [-1, -1, -1]])
    np.testing.assert_array_equal(new.stop_flags, [False, True, False])
    # next window budget: slot 0 min(20 - 5 - 1, 32 - 9 - 1, K) = 2; finished / prefilling: 0
    np.testing.assert_array_equal(done.draft_budget, [2, 0, 0])


@PROPS
@given(data=st.data())
def test_speculate_update_properties(data):
    """Committed tokens are a prefix of the verified window, cut at the first stop;
    seq_lens_decoder and step_idx never decrease; tokens land in input_ids after the sequence."""
    W = K + 1
    toks = data.draw(st.lists(st.lists(st.integers(0, 8), min_size=W, max_size=W),
                              min_size=B, max_size=B), label="accept_tokens")
    acc = data.draw(st.lists(st.integers(1, W), min_size=B, max_size=B), label="accept_num")
    step_idx = data.draw(st.lists(st.integers(1, 10), min_size=B, max_size=B))
    max_dec = data.draw(st.lists(st.integers(2, 14), min_size=B, max_size=B))
    stop = data.draw(st.integers(0, 8), label="stop id")
    prompt = [4] * B
    sam = init_state(EC, V).sampling
    sam = dataclasses.replace(sam, stop_token_ids=sam.stop_token_ids.at[:, 0].set(stop))
    dec = [p + x - 1 for p, x in zip(prompt, step_idx)]
    s = make_state(prompt_lens=prompt, seq_lens_decoder=dec, step_idx=step_idx,
                   stop_flags=[False] * B, max_dec_len=max_dec, sampling=sam)
    sched = sched_of([W] * B, [0] * B, [K] * B, [False] * B, [True] * B)
    ver = tgs.Verified(accept_tokens=i32(toks), accept_num=i32(acc),
                       num_accepted=i32([a - 1 for a in acc]))
    new, done = tgs.speculate_update(EC, s, sched, ver, s.blocks)
    for b in range(B):
        n = int(done.num_tokens[b])
        assert 1 <= n <= acc[b]
        assert list(np.asarray(done.tokens[b, :n])) == toks[b][:n]          # a prefix
        assert (np.asarray(done.tokens[b, n:]) == -1).all()
        stops = [w for w in range(acc[b]) if toks[b][w] == stop]
        if stops and stops[0] < n - 1:
            raise AssertionError("committed past a stop token")
        if stops and stops[0] == n - 1:
            assert bool(done.finished[b])
        if not done.finished[b]:
            assert n == acc[b]
        assert int(new.seq_lens_decoder[b]) == dec[b] + n >= dec[b]
        assert int(new.step_idx[b]) == step_idx[b] + n
        seq_len = prompt[b] + step_idx[b]
        assert list(np.asarray(new.input_ids[b, seq_len:seq_len + n])) == toks[b][:n]


# ------------------------------------------------------- draft_model_preprocess, mtp_substep
def test_draft_model_preprocess_hand_case():
    # After the update: slot 0 decoded (dec_old 6, committed 2 -> positions 6, 7 read tokens
    # input_ids[7], input_ids[8]); slot 1 finished (no rows); slot 2 prefilled a chunk of 3 at
    # dec_old 0 (positions 0..2, tokens input_ids[1..3]).
    ids = np.zeros((B, EC.seq_buffer_len), np.int32)
    ids[0, :9] = [10, 11, 12, 13, 14, 15, 16, 17, 18]
    ids[2, :4] = [30, 31, 32, 33]
    s = make_state(prompt_lens=[4, 4, 8], seq_lens_decoder=[8, 7, 3], step_idx=[5, 4, 0],
                   seq_lens_encoder=[0, 0, 3], accept_num=[2, 1, 0], input_ids=ids,
                   stop_flags=[False, True, False])
    hidden = jnp.arange(16, dtype=jnp.float32)[:, None] * jnp.ones((1, 4))
    # the target's packed rows this step: slot 0 at rows 0..2, slot 1 at 3..5, slot 2 at 6..8
    target = _target(hidden, i32([0, 3, 6, 9]), jnp.zeros((3, K + 1, V)), i32([0, 1, 2]))
    ctx, batch = drs.draft_model_preprocess(TINY_CFG, EC, 16, s, i32([6, 6, 0]), target,
                                            i32([2, 0, 0]))
    np.testing.assert_array_equal(batch.ids[:5], [17, 18, 31, 32, 33])
    np.testing.assert_array_equal(batch.positions[:5], [6, 7, 0, 1, 2])
    np.testing.assert_array_equal(batch.hidden[:5, 0], [0, 1, 6, 7, 8])
    np.testing.assert_array_equal(batch.pick_rows, [1, 1, 4])   # last row of each slot
    np.testing.assert_array_equal(batch.active, [True, False, False])
    np.testing.assert_array_equal(ctx.start_pos, [8, 7, 3])
    np.testing.assert_array_equal(ctx.budget, [2, 0, 0])


def test_mtp_substep_picks_and_next_batch(tiny):
    """Substep s drafts argmax(compute_logits(MTP output)) at each active slot's pick row, and
    feeds (draft, own hidden) at position start_pos + s to substep s + 1 for slots whose budget
    allows it (hand-worked packing)."""
    cfg, params = tiny
    A, H = 3, cfg.hidden_size
    tables = i32([[0, 1, -1, -1, -1, -1, -1, -1, -1], [2, 3, -1, -1, -1, -1, -1, -1, -1],
                  [4, 5, -1, -1, -1, -1, -1, -1, -1]])
    ctx = drs.DraftContext(slots=i32([0, 1, 2]), budget=i32([2, 1, 2]), start_pos=i32([3, 5, 2]),
                           block_tables=tables, sampling=init_state(EC, V).sampling,
                           step_idx=i32([1, 1, 1]))
    rng = np.random.default_rng(0)
    h = jnp.asarray(rng.normal(size=(A, H)), jnp.float32)
    pos, meta = ragged_batch(i32([1, 1, 1]), i32([2, 4, 1]), tables, BS, A)
    batch = drs.MtpBatch(ids=i32([7, 8, 9]), hidden=h, positions=pos, meta=meta,
                         pick_rows=i32([0, 1, 2]), active=jnp.asarray([True, True, False]))
    cache = init_kv_cache(cfg, 1, EC.num_blocks, BS)
    fn = jax.jit(chex.assert_max_traces(drs.mtp_substep, n=1), static_argnums=(0, 1, 2))
    pick, nxt, _ = fn(EC, None, 0, LlamaForCausalLM.from_params(cfg, params), ctx, batch, cache)
    h_log, h_next, _ = mtp_forward(cfg, params, 0, batch.ids, h, pos, meta, cache, None)
    want = np.argmax(np.asarray(compute_logits(params, h_log)), axis=-1)
    np.testing.assert_array_equal(pick.tokens, [want[0], want[1], -1])
    assert pick.probs is None
    # substep 1: only slot 0 (budget 2 > 1, active) feeds a row: row 0, position 3 + 0 = 3
    np.testing.assert_array_equal(nxt.active, [True, False, False])
    assert int(nxt.ids[0]) == want[0] and int(nxt.positions[0]) == 3
    chex.assert_trees_all_close(nxt.hidden[0], h_next[0], atol=1e-4, rtol=1e-4)
    np.testing.assert_array_equal(nxt.meta.cu_q_lens, [0, 1, 1, 1])
    np.testing.assert_array_equal(nxt.pick_rows, [0, 1, 1])


# ------------------------------------------------------------------ draft_model_postprocess
def test_draft_model_postprocess_hand_case():
    prev = make_state(draft_tokens=[[1, 2, 3], [4, 5, -1], [6, -1, -1]],
                      actual_draft_token_num=[2, 1, 0])
    cur = make_state(draft_tokens=[[7, -1, -1], [8, -1, -1], [9, -1, -1]],
                     paused=[False, True, False])
    drafts = i32([[11, 12], [13, 14], [-1, 15]])
    fn = functools.partial(jax.jit(chex.assert_max_traces(drs.draft_model_postprocess, n=1), static_argnums=0), EC)
    out = fn(cur, prev, drafts, None, i32([1, 2, 2]))
    # slot 0: budget 1 keeps [11]; slot 1 paused keeps its old window; slot 2: prefix cut at -1
    np.testing.assert_array_equal(out.draft_tokens, [[7, 11, -1], [4, 5, -1], [9, -1, -1]])
    # the window's budget: slot 2 was allowed 2 and holds none (no match); slot 1 keeps its own
    np.testing.assert_array_equal(out.actual_draft_token_num, [1, 1, 2])


# -------------------------------------------------------------- the whole step: one trace
def test_engine_step_traces_once_per_bucket(tiny):
    cfg, params = tiny
    llm = LLM(model_config=cfg, params=params, speculative_config=SpeculativeConfig("mtp", 2, 2),
              max_num_seqs=3, max_model_len=MAX_LEN, block_size=4, max_num_batched_tokens=16)
    eng = llm.llm_engine
    ec = eng.engine_config
    buckets = step_buckets(ec)
    run = engine_of(eng).runner
    run.jitted_step = jax.jit(chex.assert_max_traces(stp.engine_step, n=len(buckets)),
                              static_argnums=0, donate_argnums=(2, 3))   # spec; state, caches
    for _ in range(2):                  # every bucket twice on the idle state
        for bucket in buckets:
            run.state, caches, _ = run.jitted_step(
                *run.step_args(bucket, limits=np.full((B,), K, np.int32)))
            run.cache, run.mtp_cache = caches.target, caches.mtp
    assert engine_of(eng).runner.jitted_step._cache_size() == len(buckets)
    rng = np.random.default_rng(1)      # traffic: any retrace would raise in assert_max_traces
    prompts = [list(rng.integers(2, 64, rng.integers(1, 20))) for _ in range(5)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=8), use_tqdm=False)
    assert all(1 <= len(o.token_ids) <= 8 for o in outs)
    assert engine_of(eng).runner.jitted_step._cache_size() == len(buckets)


def test_packed_row_seq_hand_case():
    # 3 sequences with 2, 0, 3 queries packed into 6 rows (the last is padding)
    seq, local = packed_row_seq(i32([0, 2, 2, 5]), 6)
    np.testing.assert_array_equal(seq, [0, 0, 2, 2, 2, 2])
    np.testing.assert_array_equal(local, [0, 1, 0, 1, 2, 3])
