"""The engine's host logic against the fake runner (``tests/runtime/fake_runner.py``): no XLA.

``LLMEngine.from_runner(FakeRunner(...))`` runs the real request table, scheduler, prefix
caches and hand-off checks over a numpy simulation of the device whose greedy output is
:func:`~tests.runtime.fake_runner.reference`. Every expected value below comes from that oracle
or is counted by hand in the test's comments (block sizes, token budgets, steps), never from the
engine itself. An autouse fixture fails any test during which JAX traces or compiles anything.
"""
from __future__ import annotations

import collections
import dataclasses
import types

import jax
import numpy as np
import pytest

from jmtp.core.errors import InvalidRequestError
from jmtp.runtime.config import SpeculativeConfig
from jmtp.runtime.device.buckets import StepBucket
from jmtp.runtime.host.llm_engine import LLMEngine
from jmtp.runtime.host.requests import Sequence, sample_seed
from jmtp.runtime.host.sampling_params import SamplingParams
from jmtp.runtime.host.scheduler import Scheduler, reuse_bucket
from tests.runtime.fake_runner import FakeRunner, reference

SB = StepBucket


# ---------------------------------------------------------------------------- no XLA compile
class XlaCompileError(AssertionError):
    """JAX traced or compiled something during a host-logic test."""


_COMPILE_EVENTS: list[str] = []


def _on_duration_event(event: str, duration: float, **kwargs) -> None:
    # jaxpr tracing, lowering and backend compiles all report '/jax/core/compile/...' durations
    # (an eager jnp op compiles too); raising here puts the traceback at the call that compiled
    if event.startswith("/jax/core/compile/"):
        _COMPILE_EVENTS.append(event)
        raise XlaCompileError(f"JAX compiled during a host-logic test ({event})")


@pytest.fixture(scope="module", autouse=True)
def _compile_listener():
    jax.monitoring.register_event_duration_secs_listener(_on_duration_event)
    yield
    jax.monitoring.unregister_event_duration_listener(_on_duration_event)


@pytest.fixture(autouse=True)
def no_xla_compile(_compile_listener):
    """Fails the test if JAX compiled anything while it ran (also when the raise above was
    swallowed somewhere)."""
    before = len(_COMPILE_EVENTS)
    yield
    assert len(_COMPILE_EVENTS) == before, f"XLA compiled: {_COMPILE_EVENTS[before:]}"


# ---------------------------------------------------------------------------- helpers
def accept_all(slot, step, drafts):
    return drafts


def accept_none(slot, step, drafts):
    return 0


def accept_one(slot, step, drafts):
    return 1


def accept_step_mod3(slot, step, drafts):
    return step % 3


class Fake(FakeRunner):
    """The fake runner, recording what the host inserts and checking the prefix-cache contract:
    a cached block is kept only if its target (and MTP) entries are valid, and a slot may read a
    cached (pinned) block only if that block holds the KV of the slot's own first tokens, with
    an MTP cache the token after the block included (the MTP entry of its last position pairs
    with it)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.inserted: list[dict] = []
        self.content: dict[tuple[int, int], tuple] = {}   # (shard, block id) -> tokens
        self.shared_ids: dict[int, list[int]] = {}
        self.mtp_valid: dict[int, int] = {}

    def insert(self, b, ids, prompt_len, remaining, row, resume_token, shared_ids=()):
        ctx = [int(t) for t in ids[:prompt_len]]
        d, bs = self.shard(b), self.engine_config.block_size
        extra = self.mtp_cache is not None
        assert len(shared_ids) * bs < prompt_len, "a prompt position must be left to compute"
        for i, blk in enumerate(shared_ids):
            blk = int(blk)
            assert blk in self.pinned[d], ("slot reads a block that is not cached", b, blk)
            assert self.content[(d, blk)] == tuple(ctx[:(i + 1) * bs + extra]), (
                "a shared block holds other tokens", b, i)
        self.inserted.append(dict(b=b, ids=ctx, remaining=int(remaining),
                                  resume=int(resume_token), seed=int(row["seed"]),
                                  rng_offset=int(row["rng_offset"]),
                                  min_tokens=int(row["min_tokens"]),
                                  shared=[int(x) for x in shared_ids]))
        super().insert(b, ids, prompt_len, remaining, row, resume_token, shared_ids)
        self.shared_ids[b] = [int(x) for x in shared_ids]
        self.mtp_valid[b] = self.slots[b].computed

    def run_step(self, bucket, chunks, limits, guide=None):
        before = {b: s.computed for b, s in enumerate(self.slots) if s is not None}
        out = super().run_step(bucket, chunks, limits, guide)
        for b, s in enumerate(self.slots):
            if s is not None and b in before and not out.paused[b]:
                # the MTP does not run in a slot's last step
                self.mtp_valid[b] = before[b] if out.finished[b] else s.computed
        return out

    def retire(self, b, keep):
        s, d, bs = self.slots[b], self.shard(b), self.engine_config.block_size
        extra = self.mtp_cache is not None
        valid = min(s.computed, self.mtp_valid[b]) if extra else s.computed
        for j, blk in enumerate(s.owned):
            if j < len(keep) and keep[j]:
                i = len(self.shared_ids[b]) + j           # the block's index in the sequence
                assert (i + 1) * bs <= valid, ("caching a block whose KV is not all valid", b,
                                               i, s.computed, self.mtp_valid[b])
                assert len(s.seq) >= (i + 1) * bs + extra
                self.content[(d, blk)] = tuple(s.seq[:(i + 1) * bs + extra])
        return super().retire(b, keep)


def make(tokenizer=None, compile_mode="lazy", seed=0, **kw):
    runner = Fake(**kw)
    return LLMEngine.from_runner(runner, tokenizer=tokenizer, compile_mode=compile_mode,
                                 seed=seed), runner


def check_prefix_bookkeeping(engine, runner):
    """Host caches and device pins agree: every cached id is pinned on its shard and back."""
    if engine.prefix_caches is None:
        return
    for d, pc in enumerate(engine.prefix_caches.caches):
        assert sorted(pc.cached_ids()) == sorted(runner.pinned[d])


def step(engine, runner, prior: list | None = None):
    """One engine step, then the runner's block invariants and the prefix bookkeeping; its
    outputs are appended to ``prior`` (to hand to :func:`drive` later)."""
    outs = engine.step()
    runner.check_invariants()
    check_prefix_bookkeeping(engine, runner)
    if prior is not None:
        prior.extend(outs)
    return outs


def drive(engine, runner, max_steps=2000, on_step=None, prior=()):
    """Step until nothing is unfinished, checking invariants after every step and that the
    streamed deltas (``prior``: outputs of steps taken before) concatenate to the final outputs.
    Returns ``({rid: final RequestOutput}, {rid: [RequestOutput, ...]})``."""
    finals, streams = {}, collections.defaultdict(list)
    for o in prior:
        streams[o.request_id].append(o)
        if o.finished:
            finals[o.request_id] = o
    for i in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        outs = step(engine, runner)
        for o in outs:
            assert o.request_id not in finals, "output after the final one"
            streams[o.request_id].append(o)
            if o.finished:
                finals[o.request_id] = o
        if on_step is not None:
            on_step(i + 1, outs)
    else:
        raise AssertionError("requests did not finish")
    for rid, outs in streams.items():
        for idx in range(len(outs[-1].outputs)):
            ids = [t for o in outs for t in o.outputs[idx].delta_token_ids]
            text = "".join(o.outputs[idx].delta_text for o in outs)
            assert ids == outs[-1].outputs[idx].token_ids, rid
            assert text == outs[-1].outputs[idx].text, rid
    return finals, dict(streams)


def greedy(max_tokens, **kw):
    return SamplingParams(max_tokens=max_tokens, **kw)


def ref(prompt, max_tokens, ignore_eos=False, stop=(), **kw):
    return reference(prompt, max_tokens, stop_ids=tuple(stop) + (() if ignore_eos else (1,)),
                     **kw)


def find_prompt(pred, length=3, start=2):
    """The first prompt ``[(7a + 3j) % 62 + 2 for j < length]``, ``a = start, start + 1, ...``
    (a deterministic search), for which ``pred`` holds."""
    for a in range(start, 10_000):
        p = [(a * 7 + j * 3) % 62 + 2 for j in range(length)]
        if pred(p):
            return p
    raise AssertionError("no prompt found")


# A prompt whose greedy output hits EOS (id 1) at index 4..8, and none before.
EOS_PROMPT = find_prompt(lambda p: 1 in reference(p, 12, stop_ids=())[4:9]
                         and 1 not in reference(p, 12, stop_ids=())[:4])
EOS_AT = reference(EOS_PROMPT, 12, stop_ids=()).index(1)


class CharTokenizer:
    """Token ``t`` is the two characters ``"ABCDEFGH"[t // 8] + "abcdefgh"[t % 8]``; EOS (1) is
    special and decodes to "" (``skip_special_tokens``). Spaces are ignored by ``encode``."""

    @staticmethod
    def piece(t: int, skip_special_tokens: bool = True) -> str:
        if t == 1:
            return "" if skip_special_tokens else "<eos>"
        return "ABCDEFGH"[t // 8] + "abcdefgh"[t % 8]

    def encode(self, text: str) -> list[int]:
        s = text.replace(" ", "")
        return [("ABCDEFGH".index(s[i]) * 8 + "abcdefgh".index(s[i + 1]))
                for i in range(0, len(s), 2)]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(self.piece(int(t), skip_special_tokens) for t in ids)


TOK = CharTokenizer()


def seq(n, start=0):
    """A Sequence for scheduler unit tests: context of ``n`` tokens, nothing prefilled."""
    return Sequence(group=None, index=0, params=SamplingParams(), detok=None,
                    context_ids=[(start + i) % 60 + 2 for i in range(n)])


# ============================================================================ scheduler units
def _scheduler(dp=1, max_num_seqs=4, **kw):
    r = FakeRunner(data_parallel_size=dp, max_num_seqs=max_num_seqs, **kw)
    return Scheduler(r.engine_config, r.shard_config, dp)


# busy: {slot: paused}; a new sequence of 4 tokens needs blocks_needed(4 + M=2, 4) = 2 blocks.
@pytest.mark.parametrize("busy,free,hold,expected", [
    ({}, [10, 10], [False, False], 0),                     # all equal: lowest shard, lowest slot
    ({0: False}, [10, 10], [False, False], 2),             # fewest occupied
    ({0: False, 2: False}, [5, 9], [False, False], 3),     # tie: most free blocks
    ({0: False, 2: False}, [9, 5], [False, False], 1),
    ({0: False, 2: False}, [7, 7], [False, False], 1),     # tie: lowest index
    ({0: False}, [30, 2], [False, False], 2),              # fewest occupied beats more free
    ({0: False}, [30, 1], [False, False], 2),              # an idle shard takes it regardless
    ({0: False, 2: False}, [1, 30], [False, True], None),  # shard 0 short, shard 1 held
    ({0: True, 2: False, 3: False}, [30, 30], [False, False], None),  # paused slot blocks shard 0
    ({2: False}, [30, 30], [True, False], 0),              # hold on an empty shard is lifted
    ({0: False, 2: False}, [30, 30], [True, False], 3),    # held shard skipped
])
def test_admission_shard_choice(busy, free, hold, expected):
    sch = _scheduler(dp=2)
    for b, paused in busy.items():
        sch.occupy(b, seq(4))
        sch.paused[b] = paused
    sch.hold = list(hold)
    waiting = collections.deque([seq(4)])
    admitted = []
    sch.admit_waiting(waiting, free, lambda b, s: (admitted.append(b), sch.occupy(b, s)))
    assert admitted == ([] if expected is None else [expected])
    assert len(waiting) == (1 if expected is None else 0)


def test_admission_is_fifo_and_stops_at_the_first_that_does_not_fit():
    sch = _scheduler()
    sch.occupy(0, seq(4))
    # big: blocks_needed(min(20, 12) + 2, 4) = 4 > 3 free; small (2 blocks) must not overtake it
    big, small = seq(20), seq(4)
    waiting = collections.deque([big, small])
    sch.admit_waiting(waiting, [3], lambda b, s: sch.occupy(b, s))
    assert list(waiting) == [big, small] and sch.num_running == 1
    waiting = collections.deque([seq(4), seq(4), seq(4), seq(4)])
    order = []
    sch2 = _scheduler()
    sch2.admit_waiting(waiting, [100], lambda b, s: (order.append((b, s)), sch2.occupy(b, s)))
    assert [b for b, _ in order] == [0, 1, 2, 3] and not waiting
    # the free count goes down by each admission's need: 5 blocks take two 2-block sequences
    sch3 = _scheduler()
    sch3.occupy(0, seq(4))
    waiting = collections.deque([seq(4), seq(4), seq(4)])
    sch3.admit_waiting(waiting, [5], lambda b, s: sch3.occupy(b, s))
    assert sch3.num_running == 3 and len(waiting) == 1


def test_admission_failure_leaves_the_sequence_first_in_line():
    sch = _scheduler()
    s = seq(4)
    waiting = collections.deque([s])

    def fail(b, q):
        raise RuntimeError("device insert failed")
    with pytest.raises(RuntimeError):
        sch.admit_waiting(waiting, [10], fail)
    assert list(waiting) == [s] and sch.num_running == 0


# slot specs: None (idle), ("d", drafts) decoding, ("p", prompt tokens left) prefilling.
# Fake defaults: B=4, K=2 (W=3), budget max(8, 4*3) = 12; token buckets (3, 6, 12).
@pytest.mark.parametrize("slots,chunks,bucket", [
    ([("d", 2)], [0, 0, 0, 0], SB(3, 1)),
    ([("d", 0)], [0, 0, 0, 0], SB(1, 1)),
    ([("d", 2), ("d", 1)], [0, 0, 0, 0], SB(6, 2)),             # 5 rows over A=2
    ([("d", 0), ("d", 0), ("d", 0)], [0, 0, 0, 0], SB(4, 4)),   # 3 rows, A rounds up to 4
    ([("d", 2)] * 4, [0, 0, 0, 0], SB(12, 4)),
    ([("p", 5)], [5, 0, 0, 0], SB(6, 4)),
    ([("p", 30)], [12, 0, 0, 0], SB(12, 4)),                    # chunked: the whole budget
    ([("d", 2), ("p", 10), ("p", 5), ("d", 0)], [0, 8, 0, 0], SB(12, 4)),  # decode rows first
    ([("p", 7), ("p", 7), ("d", 2), None], [7, 2, 0, 0], SB(12, 4)),       # chunks in slot order
    ([("p", 2), ("p", 1)], [2, 1, 0, 0], SB(3, 4)),
])
def test_plan_token_budget_and_bucket(slots, chunks, bucket):
    sch = _scheduler()
    _fill(sch, slots)
    got, bk = sch.plan()
    assert got.tolist() == chunks and bk == bucket


def _fill(sch, slots):
    nd = np.zeros((len(sch.slots),), np.int32)
    for b, spec in enumerate(slots):
        if spec is None:
            continue
        kind, n = spec
        s = seq(n if kind == "p" else 4)
        s.prefilled = 0 if kind == "p" else 4
        sch.occupy(b, s)
        nd[b] = n if kind == "d" else 0
    sch.next_drafts = nd


@pytest.mark.parametrize("slots,chunks,bucket", [
    # shard 0 rows 6 over 2 slots, shard 1 one row: the busiest picks (6, 2) for both
    ([("d", 2), ("d", 2), ("d", 0), None], [0, 0, 0, 0], SB(6, 2)),
    # shard 1 prefills 12 of 20 (its own budget 24/2): a prefill bucket, A = 2 slots per shard
    ([("d", 2), None, ("p", 20), None], [0, 0, 12, 0], SB(12, 2)),
])
def test_plan_data_parallel_busiest_shard_picks(slots, chunks, bucket):
    sch = _scheduler(dp=2)
    _fill(sch, slots)
    got, bk = sch.plan()
    assert got.tolist() == chunks and bk == bucket


def test_block_bound_by_hand():
    sch = _scheduler()
    _fill(sch, [("d", 2), ("p", 5)])
    chunks, _ = sch.plan()
    # per slot blocks_needed(rows + M - 1, 4) + 1: the 3-row window 1 + 1 = 2, the 5-token
    # chunk 2 + 1 = 3
    assert sch.block_bound(chunks, 0) == 5


@pytest.mark.parametrize("dp,occupied,paused,tokens,starved", [
    (1, [0, 1], [True, True], [0, 0], [0]),
    (1, [0, 1], [True, False], [0, 1], []),
    (2, [0, 2, 3], [False, False, True, True], [1, 0, 0, 0], [1]),
    (2, [0, 2], [True, False, True, False], [0, 0, 0, 0], [0, 1]),
])
def test_after_step_names_starved_shards(dp, occupied, paused, tokens, starved):
    sch = _scheduler(dp=dp)
    for b in occupied:
        s = seq(4)
        s.prefilled = 4
        sch.occupy(b, s)
    out = types.SimpleNamespace(num_next_drafts=np.zeros(4, np.int32), paused=np.array(paused),
                                num_tokens=np.array(tokens, np.int32))
    assert sch.after_step(out, np.zeros(4, np.int32)) == starved


def test_victim_is_the_newest_admission_of_its_shard():
    sch = _scheduler(dp=2)
    for b in (0, 2, 1, 3):
        sch.occupy(b, seq(4))
    assert sch.victim(0) == 1 and sch.victim(1) == 3
    sch.vacate(1)
    assert sch.victim(0) == 0


@pytest.mark.parametrize("bucket,compiled,expected", [
    (SB(3, 1), set(), SB(3, 1)),
    (SB(3, 1), {SB(3, 1), SB(6, 2)}, SB(3, 1)),          # compiled itself
    (SB(3, 1), {SB(6, 2)}, SB(6, 2)),                    # 2x in T and A
    (SB(3, 1), {SB(6, 4)}, SB(3, 1)),                    # A 4x: too big
    (SB(3, 1), {SB(12, 4)}, SB(3, 1)),
    (SB(2, 1), {SB(3, 1)}, SB(3, 1)),
    (SB(1, 1), {SB(3, 1)}, SB(1, 1)),                    # T 3x
    (SB(4, 2), {SB(8, 4), SB(6, 2)}, SB(6, 2)),          # the smallest that fits
    (SB(6, 4), {SB(12, 4)}, SB(12, 4)),
    (SB(4, 4), {SB(2, 4), SB(12, 4)}, SB(4, 4)),         # never smaller
])
def test_reuse_bucket(bucket, compiled, expected):
    assert reuse_bucket(bucket, compiled) == expected


@pytest.mark.parametrize("bucket,compiled,fewest,lazy", [
    (SB(3, 1), {SB(6, 4)}, SB(6, 4), SB(3, 1)),          # A 4x: held, so reused
    (SB(1, 1), {SB(3, 1), SB(48, 3)}, SB(3, 1), SB(1, 1)),   # the smallest that holds it
    (SB(1, 1), {SB(48, 3)}, SB(48, 3), SB(1, 1)),        # T 48x
    (SB(4, 4), {SB(2, 4), SB(12, 2)}, SB(4, 4), SB(4, 4)),   # never smaller in T or A
    (SB(3, 1), set(), SB(3, 1), SB(3, 1)),
])
def test_reuse_bucket_without_bound(bucket, compiled, fewest, lazy):
    """``compile="fewest"`` (``max_ratio=inf``): any compiled bucket that holds the step;
    ``"lazy"`` (the default bound, 2x) on the same cases (hand-worked)."""
    assert reuse_bucket(bucket, compiled, float("inf")) == fewest
    assert reuse_bucket(bucket, compiled) == lazy


# ============================================================================ engine: admission
def test_admission_fifo_into_slots():
    eng, run = make()
    prior = []
    for i in range(6):
        eng.add_request(f"r{i}", [3 + i, 4, 5], greedy(4, ignore_eos=True))
    step(eng, run, prior)
    assert [s.group.request_id for s in eng.scheduler.slots] == ["r0", "r1", "r2", "r3"]
    assert eng.get_stats()["num_waiting"] == 2 and eng.get_stats()["num_running"] == 4
    finals, _ = drive(eng, run, prior=prior)
    assert all(finals[f"r{i}"].token_ids == ref([3 + i, 4, 5], 4, True) for i in range(6))


def test_data_parallel_admission_spreads_over_shards_by_hand():
    # dp=2: 2 slots and 34 blocks per shard. r0 (10 tokens) needs blocks_needed(12, 4) = 3, the
    # others (2 tokens) 1: r0 -> shard 0, r1 -> shard 1 (fewest occupied), r2 -> shard 1 (tie,
    # 33 > 31 free), r3 -> shard 0 (fewest occupied).
    eng, run = make(data_parallel_size=2)
    prior = []
    prompts = [list(range(5, 15)), [7, 8], [9, 10], [11, 12]]
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, greedy(6, ignore_eos=True))
    step(eng, run, prior)
    assert [d["b"] for d in run.inserted] == [0, 2, 3, 1]
    finals, _ = drive(eng, run, prior=prior)
    for i, p in enumerate(prompts):
        assert finals[f"r{i}"].token_ids == ref(p, 6, True)


def test_paused_slot_blocks_admission_into_its_shard():
    # B=3, bs=4, K=M=2, 9 blocks, budget 9, nothing accepted. r0 (4 tokens) prefills in step 1
    # (2 blocks); r1 (24 tokens) joins in step 2 and prefills 6 tokens a step after r0's 3-row
    # window: r1 owns 2, 4, 5 blocks after steps 2-4 and r0 3 from step 3 (free 5, 2, 1); in
    # step 5 r1's last chunk needs blocks_needed(24 + 1, 4) = 7 (2 more): paused, r0 goes on.
    eng, run = make(max_num_seqs=3, num_blocks=9, max_model_len=32, accept=accept_none)
    prior = []
    eng.add_request("r0", [3, 4, 5, 6], greedy(20, ignore_eos=True))
    step(eng, run, prior)
    eng.add_request("r1", list(range(10, 34)), greedy(2, ignore_eos=True))
    for _ in range(4):
        step(eng, run, prior)
    assert eng.scheduler.paused == [False, True, False] and run.free_counts == [1]
    # r2 needs blocks_needed(1 + 2, 4) = 1 block, 1 is free and slot 2 idles: still not admitted
    eng.add_request("r2", [40], greedy(1, ignore_eos=True))
    step(eng, run, prior)
    assert eng.scheduler.slots[2] is None and eng.get_stats()["num_waiting"] == 1
    finals, _ = drive(eng, run, prior=prior)
    assert finals["r0"].token_ids == ref([3, 4, 5, 6], 20, True)
    assert finals["r1"].token_ids == ref(list(range(10, 34)), 2, True)
    assert finals["r2"].token_ids == ref([40], 1, True)


# ============================================================================ preemption
class PreemptionTrace:
    """B=2, bs=4, K=M=2, max_model_len=32, 10 blocks, no draft ever accepted (1 token a step).

    r0, r1: 4-token prompts, max_tokens 20; r2: 4 tokens, max_tokens 3 (waits: no idle slot).
    Step 1 prefills both (2 blocks each). A slot at c cached positions verifies 3 rows and needs
    blocks_needed(c + 3 + 1, 4): 3 blocks from c=5, 4 from c=9, 5 from c=13 (free 0), 6 at c=17,
    which both reach in step 15 (step s starts at c = s + 2): both pause, r1 (newest) is
    preempted with 14 tokens and re-queued before r2; its shard holds admissions. r0 takes one of
    the 5 freed blocks and finishes its 20 tokens in step 21 (steps 16-21 emit tokens 15-20). In
    step 22 r1 (context 4 + 13 tokens, resume token = its 14th) and r2 are admitted; r1
    prefills 8 + 8 + 1 tokens (budget 8) and r2 its 4 in step 24: r2 finishes in step 26 (3
    tokens), r1 in step 30 (7 more tokens: steps 24-30). One preemption in all."""

    def __init__(self):
        self.eng, self.run = make(max_num_seqs=2, num_blocks=10, max_model_len=32,
                                  accept=accept_none, max_logprobs=1)
        self.prompts = {"r0": [3, 4, 5, 6], "r1": [7, 8, 9, 10], "r2": [11, 12, 13, 14]}
        self.eng.add_request("r0", self.prompts["r0"], greedy(20, ignore_eos=True))
        self.eng.add_request("r1", self.prompts["r1"], greedy(20, ignore_eos=True, logprobs=1))
        self.eng.add_request("r2", self.prompts["r2"], greedy(3, ignore_eos=True))
        self.log = []
        seen = {}

        def on_step(i, outs):
            st = self.eng.get_stats()
            seen.update({o.request_id: len(o.token_ids) for o in outs})
            self.log.append(dict(step=i, preemptions=st["num_preemptions"],
                                 running=st["num_running"], waiting=st["num_waiting"],
                                 finished=[o.request_id for o in outs if o.finished],
                                 hold=list(self.eng.scheduler.hold), seen=dict(seen),
                                 waiting_ids=[s.group.request_id for s in
                                              self.eng.requests.waiting]))
        self.finals, self.streams = drive(self.eng, self.run, on_step=on_step)


@pytest.fixture(scope="module")
def trace():
    return PreemptionTrace()


def test_preemption_happens_in_the_hand_counted_step(trace):
    first = next(e for e in trace.log if e["preemptions"])
    assert first["step"] == 15 and first["waiting_ids"] == ["r1", "r2"]
    assert trace.eng.get_stats()["num_preemptions"] == 1
    assert first["seen"] == {"r0": 14, "r1": 14} and first["hold"] == [True]


def test_preempted_shard_holds_admission_until_a_request_ends(trace):
    for e in trace.log[15:20]:         # steps 16..20: slot 1 idles, r1 and r2 wait
        assert (e["running"], e["waiting"], e["hold"]) == (1, 2, [True]), e
    e = trace.log[20]                  # step 21: r0 ends, the hold with it
    assert (e["finished"], e["running"], e["waiting"], e["hold"]) == (["r0"], 0, 2, [False])
    assert trace.log[21]["running"] == 2 and trace.log[21]["waiting"] == 0   # step 22


def test_preempted_request_resumes_where_it_stopped(trace):
    r1 = ref(trace.prompts["r1"], 20, True)
    resumed = [d for d in trace.run.inserted if d["ids"][:4] == trace.prompts["r1"]][1]
    assert resumed["ids"] == trace.prompts["r1"] + r1[:13]
    assert (resumed["resume"], resumed["remaining"], resumed["rng_offset"]) == (r1[13], 7, 13)
    assert [e["step"] for e in trace.log if e["finished"]] == [21, 26, 30]
    assert [e["finished"] for e in trace.log if e["finished"]] == [["r0"], ["r2"], ["r1"]]
    for rid, p in trace.prompts.items():
        assert trace.finals[rid].token_ids == ref(p, 3 if rid == "r2" else 20, True)
        assert trace.finals[rid].finish_reason == "length"
    # one logprobs entry per token, the re-emitted resume token not doubled
    assert len(trace.finals["r1"].logprobs) == 20
    assert trace.eng.get_stats()["num_free_blocks"] == 10


@pytest.mark.parametrize("kw", [
    dict(num_blocks=17),
    dict(num_blocks=17, k=0),
    dict(num_blocks=36, data_parallel_size=2),
    dict(num_blocks=18, enable_prefix_caching=True),
    dict(num_blocks=36, data_parallel_size=2, enable_prefix_caching=True),
], ids=["dp1", "dp1-nospec", "dp2", "dp1-prefix", "dp2-prefix"])
def test_preemption_under_block_pressure_keeps_outputs(kw):
    eng, run = make(max_num_seqs=4, **kw)
    prompts = [list(range(3, 3 + n)) for n in (7, 2, 9, 5, 11, 3, 7, 4)]
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, greedy(30 + i, ignore_eos=True))
    finals, _ = drive(eng, run)
    assert eng.get_stats()["num_preemptions"] > 0
    for i, p in enumerate(prompts):
        assert finals[f"r{i}"].token_ids == ref(p, 30 + i, True), i
    assert eng.get_stats()["num_running"] == 0


# ============================================================================ budget, buckets
@pytest.mark.parametrize("mode,buckets", [
    # 30 prompt tokens, budget 12: chunks 12, 12, 6 -> (12,4) (12,4) (6,4); the lazy engine runs
    # the last chunk in the compiled (12, 4) (within 2x). Then 3-row windows until 2 tokens are
    # left (1 draft: (2,1), reused as (3,1) when lazy) and a 1-row window at the end.
    ("eager", [SB(12, 4)] * 2 + [SB(6, 4)] + [SB(3, 1)] * 7 + [SB(2, 1), SB(1, 1)]),
    ("lazy", [SB(12, 4)] * 3 + [SB(3, 1)] * 8 + [SB(1, 1)]),
])
def test_chunked_prefill_and_bucket_choice(mode, buckets):
    eng, run = make(compile_mode=mode, accept=accept_none)
    p = [(5 * i) % 60 + 2 for i in range(30)]
    eng.add_request("a", p, greedy(10, ignore_eos=True))
    prior = []
    outs = [step(eng, run, prior) for _ in range(3)]
    assert [len(o) for o in outs] == [0, 0, 1] and outs[2][0].token_ids == ref(p, 1, True)
    finals, _ = drive(eng, run, prior=prior)
    assert run.buckets_run == buckets
    assert finals["a"].token_ids == ref(p, 10, True)


@pytest.mark.parametrize("mode,policy,expected", [
    ("lazy", "fixed", SB(6, 2)), ("eager", "fixed", SB(3, 1)), ("lazy", "dynamic", SB(3, 1)),
])
def test_bucket_to_run_reuses_only_when_lazy_and_fixed(mode, policy, expected):
    eng, run = make(compile_mode=mode, speculation_policy=policy)
    run.compile_buckets([SB(6, 2)])
    assert eng.bucket_to_run(SB(3, 1)) == expected
    assert eng.bucket_to_run(SB(6, 2)) == SB(6, 2)


def test_dynamic_policy_runs_planned_buckets_and_keeps_outputs():
    eng, run = make(speculation_policy="dynamic")
    run.compile_buckets([SB(12, 4)])
    p = [9, 8, 7, 6, 5]
    eng.add_request("a", p, greedy(12, ignore_eos=True))
    finals, _ = drive(eng, run)
    assert run.buckets_run[0] == SB(6, 4)         # not the compiled (12, 4)
    assert finals["a"].token_ids == ref(p, 12, True)
    assert "spec_policy_plans" in eng.get_stats()


def test_max_model_len_ends_a_request_with_length():
    eng, run = make(max_model_len=16)
    p = list(range(3, 13))
    eng.add_request("a", p, greedy(20, ignore_eos=True))   # 10 + 20 > 16: 6 tokens
    finals, _ = drive(eng, run)
    assert finals["a"].token_ids == ref(p, 20, True, max_model_len=16)
    assert len(finals["a"].token_ids) == 6 and finals["a"].finish_reason == "length"


# ============================================================================ end to end
@pytest.mark.parametrize("kw", [
    dict(), dict(k=0), dict(k=3), dict(accept=accept_all), dict(data_parallel_size=2),
    dict(enable_prefix_caching=True), dict(enable_prefix_caching=True, data_parallel_size=2),
    dict(max_num_seqs=1), dict(block_size=8),
], ids=["default", "nospec", "k3", "accept-all", "dp2", "prefix", "prefix-dp2", "one-slot",
        "bs8"])
def test_outputs_equal_reference(kw):
    eng, run = make(**kw)
    base = [(3 * i) % 60 + 2 for i in range(13)]
    prompts = [base, base[:5], [7, 7, 7], base + [9, 9], base, [44] * 9, base[:9] + [5, 6],
               [2, 3]]
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, greedy(5 + 2 * i, ignore_eos=bool(i % 2)))
    finals, _ = drive(eng, run)
    for i, p in enumerate(prompts):
        assert finals[f"r{i}"].token_ids == ref(p, 5 + 2 * i, bool(i % 2)), i
        assert finals[f"r{i}"].prompt_token_ids == p
    assert eng.get_stats()["num_unfinished_requests"] == 0
    assert eng.step() == []


# ============================================================================ validation
@pytest.mark.parametrize("prompt,sp,field", [
    ([], SamplingParams(), "prompt"),                                     # empty
    (list(range(2, 66)), SamplingParams(), "prompt"),                     # 64 >= max_model_len
    ([3, 64], SamplingParams(), "prompt"),                                # id >= vocab 64
    ([3, -1], SamplingParams(), "prompt"),                                # negative id
    ([[3], [4]], SamplingParams(), "prompt"),                             # not flat
    ([3.5, 4.0], SamplingParams(), "prompt"),                             # not ints
    ("AbCd", SamplingParams(), "prompt"),                                 # str, no tokenizer
    ([3, 4], SamplingParams(stop="x"), "stop"),                           # no tokenizer
    ([3, 4], SamplingParams(bad_words=("AbCd",)), "bad_words"),           # no tokenizer
    ([3, 4], SamplingParams(max_tokens=30), "max_tokens"),                # 9 > 8 blocks
    ([3, 4], SamplingParams(logprobs=0), "logprobs"),                     # max_logprobs=0
    ([3, 4], SamplingParams(stop_token_ids=(70,)), "stop_token_ids"),     # id >= vocab
    ([3, 4], SamplingParams(stop_token_ids=tuple(range(2, 10))), "stop_token_ids"),  # 8 + EOS
    ([3, 4], SamplingParams(bad_token_ids=(64,)), "bad_token_ids"),
])
def test_invalid_requests_name_their_field(prompt, sp, field):
    # 8 blocks of 4: blocks_needed(min(2 + 30, 64) + K + M = 36, 4) = 9 > 8; 2 + 22 -> 28: 7 fit
    eng, run = make(num_blocks=8)
    with pytest.raises(InvalidRequestError) as ei:
        eng.add_request("r", prompt, sp)
    assert ei.value.field == field, str(ei.value)
    assert isinstance(ei.value, ValueError)
    assert not eng.has_unfinished_requests() and eng.get_stats()["num_waiting"] == 0
    eng.add_request("r", [3, 4], SamplingParams(max_tokens=22))   # the id is still free
    assert eng.get_num_unfinished_requests() == 1


@pytest.mark.parametrize("sp,field", [
    (SamplingParams(logprobs=3), "logprobs"),
    (SamplingParams(bad_words=("AbCa", "AbCb", "AbCc", "AbCd", "AbCe")), "bad_words"),  # 5 > 4
    (SamplingParams(bad_words=("AbCaDaEa" + "Fa",)), "bad_words"),        # 5 tokens > 4
])
def test_invalid_requests_with_a_tokenizer(sp, field):
    eng, run = make(tokenizer=TOK, max_logprobs=2)
    with pytest.raises(InvalidRequestError) as ei:
        eng.add_request("r", "AcAd", sp)
    assert ei.value.field == field
    assert not eng.has_unfinished_requests()


def test_duplicate_and_type_errors():
    eng, run = make()
    eng.add_request("a", [3, 4], greedy(2))
    with pytest.raises(InvalidRequestError) as ei:
        eng.add_request("a", [5, 6], greedy(2))
    assert ei.value.field == "request_id"
    with pytest.raises(TypeError):
        eng.add_request(5, [3, 4], greedy(2))
    with pytest.raises(TypeError):
        eng.add_request("b", [3, 4], {"max_tokens": 2})
    assert eng.get_num_unfinished_requests() == 1 and eng.get_stats()["num_waiting"] == 1
    finals, _ = drive(eng, run)
    assert list(finals) == ["a"]
    eng.add_request("a", [5, 6], greedy(2))        # free again once finished
    finals, _ = drive(eng, run)
    assert finals["a"].token_ids == ref([5, 6], 2)


# ============================================================================ stop conditions
def test_eos_stops_and_ignore_eos_continues():
    eng, run = make()
    eng.add_request("eos", EOS_PROMPT, greedy(12))
    eng.add_request("ign", EOS_PROMPT, greedy(12, ignore_eos=True))
    finals, _ = drive(eng, run)
    assert finals["eos"].token_ids == reference(EOS_PROMPT, 12, stop_ids=())[:EOS_AT + 1]
    assert (finals["eos"].finish_reason, finals["eos"].stop_reason) == ("stop", None)
    assert finals["ign"].token_ids == reference(EOS_PROMPT, 12, stop_ids=())
    assert (finals["ign"].finish_reason, finals["ign"].stop_reason) == ("length", None)


@pytest.mark.parametrize("index", [0, 2, 3])
def test_stop_token_ids(index):
    out = reference(EOS_PROMPT, 12, stop_ids=())
    stop = out[index]
    eng, run = make(accept=accept_all)
    eng.add_request("a", EOS_PROMPT, greedy(12, stop_token_ids=(stop,)))
    finals, _ = drive(eng, run)
    expected = reference(EOS_PROMPT, 12, stop_ids=(1, stop))
    assert finals["a"].token_ids == expected and expected[-1] == stop
    assert (finals["a"].finish_reason, finals["a"].stop_reason) == ("stop", stop)


def test_stop_token_id_that_is_eos_is_the_stop_reason():
    eng, run = make()
    eng.add_request("a", EOS_PROMPT, greedy(12, stop_token_ids=(1,)))
    finals, _ = drive(eng, run)
    assert finals["a"].token_ids[-1] == 1 and finals["a"].stop_reason == 1


def test_min_tokens_defers_eos():
    eng, run = make()
    eng.add_request("a", EOS_PROMPT, greedy(12, min_tokens=EOS_AT + 2))
    finals, _ = drive(eng, run)
    expected = reference(EOS_PROMPT, 12, stop_ids=(1,), min_tokens=EOS_AT + 2)
    assert finals["a"].token_ids == expected and len(expected) > EOS_AT + 1


@pytest.mark.parametrize("max_tokens", [1, 2, 7])
def test_max_tokens_finishes_with_length(max_tokens):
    eng, run = make(accept=accept_all)
    eng.add_request("a", [5, 6, 7], greedy(max_tokens, ignore_eos=True))
    finals, _ = drive(eng, run)
    assert finals["a"].token_ids == ref([5, 6, 7], max_tokens, True)
    assert (finals["a"].finish_reason, finals["a"].stop_reason) == ("length", None)


def _stop_case(i):
    """A prompt whose full-acceptance output's text first contains the 3-character string
    ending at token ``i`` (its last character of token i-1 + token i) exactly there."""
    def ok(p):
        out = reference(p, 30, stop_ids=())
        if 1 in out[:i + 2]:
            return False
        text = TOK.decode(out)
        end = 2 * (i + 1)
        s = text[end - 3:end] if i else text[:2]
        return text.find(s) == end - len(s)
    p = find_prompt(ok, length=4)
    out = reference(p, 30, stop_ids=())
    text = TOK.decode(out)
    s = text[2 * i - 1:2 * i + 2] if i else text[:2]
    return p, out, text, s


# With every draft accepted (K=2) the prefill emits token 0 and each step 3 tokens: 1-3, 4-6.
# Expected speculation counters (steps, tokens, drafts, accepted) up to the stop at token i:
# the window cut by the stop counts min(2, tokens kept) accepted drafts.
@pytest.mark.parametrize("i,metrics", [
    (0, (0, 0, 0, 0)),          # inside the prefill's token
    (2, (1, 2, 2, 2)),          # inside window 1-3: token 3 dropped
    (4, (2, 4, 4, 3)),          # spans windows 1-3 | 4-6: 5, 6 dropped
    (5, (2, 5, 4, 4)),          # inside window 4-6
])
@pytest.mark.parametrize("include", [False, True])
def test_stop_string_cuts_inside_a_multi_token_step(i, metrics, include):
    p, out, text, s = _stop_case(i)
    eng, run = make(tokenizer=TOK, accept=accept_all)
    eng.add_request("a", p, greedy(30, ignore_eos=True, stop=[s, "ZZ"],
                                   include_stop_str_in_output=include))
    finals, _ = drive(eng, run)
    f = finals["a"]
    j = text.find(s)
    assert f.token_ids == out[:i + 1]
    assert f.text == (text[:j + len(s)] if include else text[:j])
    assert (f.finish_reason, f.stop_reason) == ("stop", s)
    m = f.metrics
    assert (m.num_decode_steps, m.num_decode_tokens, m.num_draft_tokens,
            m.num_accepted_tokens) == metrics
    assert run.slots == [None] * 4 and run.free_counts == [run.engine_config.num_blocks]


def test_stop_string_text_is_held_back_while_streaming():
    # "Hh" cannot occur (token 63 never comes here: checked); with a 2-character stop the last
    # character of the text is held back until the request ends
    p = find_prompt(lambda p: 63 not in reference(p, 20, stop_ids=()), length=4)
    out = reference(p, 20, stop_ids=())
    eng, run = make(tokenizer=TOK, accept=accept_one)
    eng.add_request("a", p, greedy(20, ignore_eos=True, stop="Hh"))
    finals, streams = drive(eng, run)
    seen = 0
    for o in streams["a"][:-1]:
        full = TOK.decode(o.token_ids)
        assert o.text == full[:max(len(full) - 1, seen)] and not o.finished
        seen = len(o.text)
    assert finals["a"].text == TOK.decode(out) and finals["a"].finish_reason == "length"
    assert finals["a"].stop_reason is None


def test_string_prompt_with_a_stop_string_inside_does_not_stop():
    # "Hh" is token 63 only (a piece never ends in a capital); the prompt holds it, the output
    # (checked) does not: only output text is searched
    ids = find_prompt(lambda p: 63 not in reference(p[:1] + [63] + p[1:], 8, stop_ids=()))
    ids = ids[:1] + [63] + ids[1:]
    text = TOK.decode(ids)
    eng, run = make(tokenizer=TOK)
    eng.add_request("a", text, greedy(8, ignore_eos=True, stop="Hh"))
    finals, _ = drive(eng, run)
    f = finals["a"]
    assert f.prompt == text and f.prompt_token_ids == ids and "Hh" in text
    assert f.token_ids == reference(ids, 8, stop_ids=()) and f.finish_reason == "length"
    assert f.text == TOK.decode(f.token_ids)


def test_text_equals_decode_and_deltas_concatenate():
    # 45 tokens: past the detokenizer's 32-token window, which then slides
    eng, run = make(tokenizer=TOK, data_parallel_size=2)
    prompts = [[3, 4, 5], EOS_PROMPT, [60, 61, 62, 63]]
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, greedy(45, ignore_eos=i != 1))
    finals, streams = drive(eng, run)
    for i, p in enumerate(prompts):
        assert finals[f"r{i}"].token_ids == ref(p, 45, i != 1)
        assert finals[f"r{i}"].text == TOK.decode(ref(p, 45, i != 1))
        assert len(streams[f"r{i}"]) > 1


# ============================================================================ n > 1
def test_n_samples_get_their_seeds_and_slots():
    eng, run = make()
    eng.add_request("a", [5, 6, 7], greedy(6, n=3, seed=7, ignore_eos=True))
    finals, streams = drive(eng, run)
    seeds = [d["seed"] for d in run.inserted]
    assert seeds == [sample_seed(7, i) for i in range(3)] and seeds[0] == 7
    assert len(set(seeds)) == 3 and [d["b"] for d in run.inserted] == [0, 1, 2]
    f = finals["a"]
    assert [o.index for o in f.outputs] == [0, 1, 2]
    assert all(o.token_ids == ref([5, 6, 7], 6, True) for o in f.outputs)
    m = f.metrics         # summed over the samples: 5 decode tokens each
    assert m.num_decode_tokens == 15


def test_unseeded_samples_draw_from_the_engine_seed():
    eng, run = make(seed=5)
    eng.add_request("a", [5, 6, 7], greedy(2, n=2))
    eng.add_request("b", [5, 6, 7], greedy(2))
    drive(eng, run)
    rng = np.random.default_rng(5)
    assert [d["seed"] for d in run.inserted] == [int(rng.integers(0, 2**32)) for _ in range(3)]


def test_n_samples_queue_when_slots_run_out():
    eng, run = make(max_num_seqs=2)
    prior = []
    eng.add_request("a", [5, 6, 7], greedy(4, n=3, ignore_eos=True))
    step(eng, run, prior)
    assert eng.get_stats()["num_running"] == 2 and eng.get_stats()["num_waiting"] == 1
    finals, _ = drive(eng, run, prior=prior)
    assert len(finals["a"].outputs) == 3 and finals["a"].finished


# ============================================================================ abort
def test_abort_waiting_request():
    eng, run = make(max_num_seqs=2)
    prior = []
    for r in "abc":
        eng.add_request(r, [5, 6, 7], greedy(5, ignore_eos=True))
    step(eng, run, prior)
    eng.abort_request("c")
    assert eng.get_stats()["num_waiting"] == 0
    finals, streams = drive(eng, run, prior=prior)
    assert set(streams) == {"a", "b"} and set(finals) == {"a", "b"}


@pytest.mark.parametrize("prefix", [False, True])
def test_abort_running_request_frees_its_blocks(prefix):
    eng, run = make(enable_prefix_caching=prefix)
    prior = []
    eng.add_request("a", list(range(3, 12)), greedy(20, ignore_eos=True))
    eng.add_request("b", [5, 6, 7], greedy(20, ignore_eos=True))
    for _ in range(3):
        step(eng, run, prior)
    owned = len(run.slots[0].owned)
    free = run.free_counts[0]
    eng.abort_request("a")
    assert owned > 0 and run.free_counts[0] == free + owned and run.slots[0] is None
    run.check_invariants()
    check_prefix_bookkeeping(eng, run)
    finals, streams = drive(eng, run, prior=prior)
    assert set(finals) == {"b"}
    assert finals["b"].token_ids == ref([5, 6, 7], 20, True)
    assert run.free_counts[0] + sum(map(len, run.pinned)) == run.engine_config.num_blocks
    if prefix:
        assert eng.get_stats()["num_evictable_blocks"] == eng.get_stats()["num_cached_blocks"]


def test_abort_list_form_unknown_ids_and_mid_prefill():
    eng, run = make()
    eng.add_request("long", [(7 * i) % 60 + 2 for i in range(30)], greedy(5))   # 3 chunks
    eng.add_request("x", [5, 6], greedy(5))
    eng.step()
    # chunks in slot order: "long" takes the whole budget of 12, "x" waits for the next step
    assert run.slots[0].computed == 12 and run.slots[1].computed == 0
    eng.abort_request("nope")
    eng.abort_request([])
    eng.abort_request(["long", "x", "nope"])
    assert not eng.has_unfinished_requests() and eng.get_stats()["num_running"] == 0
    assert run.free_counts == [run.engine_config.num_blocks] and eng.step() == []
    eng.add_request("x", [5, 6], greedy(3))        # the id can be used again
    finals, _ = drive(eng, run)
    assert finals["x"].token_ids == ref([5, 6], 3)


def test_abort_request_with_samples_running_and_waiting():
    eng, run = make(max_num_seqs=1)
    eng.add_request("a", [5, 6], greedy(6, n=2))
    eng.step()
    assert eng.get_stats()["num_running"] == 1 and eng.get_stats()["num_waiting"] == 1
    eng.abort_request("a")
    assert not eng.has_unfinished_requests() and eng.get_stats()["num_waiting"] == 0
    assert run.free_counts == [run.engine_config.num_blocks]


def test_abort_of_a_preempted_request():
    eng, run = make(max_num_seqs=2, num_blocks=10, max_model_len=32, accept=accept_none)
    prior = []
    eng.add_request("r0", [3, 4, 5, 6], greedy(20, ignore_eos=True))
    eng.add_request("r1", [7, 8, 9, 10], greedy(20, ignore_eos=True))
    for _ in range(15):
        step(eng, run, prior)
    assert eng.get_stats()["num_preemptions"] == 1
    eng.abort_request("r1")                        # waiting after its preemption
    finals, _ = drive(eng, run, prior=prior)
    assert set(finals) == {"r0"} and finals["r0"].token_ids == ref([3, 4, 5, 6], 20, True)


# ============================================================================ metrics
# One request, prompt 5, max_tokens 10, K=2. The prefill emits token 1; each later step verifies
# the drafts the device allowed: min(2, 10 - emitted - 1). (decode steps, tokens, drafts,
# accepted, accepted per position):
#   accept 0: 9 steps of 1 token; drafts 2 x 7 (emitted 1..7) + 1 (8) + 0 (9) = 15
#   accept 1: 2 tokens a step to 9 (4 steps), then 0 drafts, 1 token: drafts 8, accepted 4
#   accept 2: 3 tokens a step: 4, 7, 10: drafts 6, accepted 6
#   step % 3 (steps 1..5 accept 1, 2, 0, 1, min(2, 0)): +2 +3 +1 +2 +1: drafts 2+2+2+2+0
@pytest.mark.parametrize("accept,expected", [
    (accept_none, (9, 9, 15, 0, [0, 0])),
    (accept_one, (5, 9, 8, 4, [4, 0])),
    (accept_all, (3, 9, 6, 6, [3, 3])),
    (accept_step_mod3, (5, 9, 8, 4, [3, 1])),
])
def test_speculation_metrics_by_hand(accept, expected):
    eng, run = make(accept=accept)
    p = [9, 8, 7, 6, 5]
    eng.add_request("a", p, greedy(10, ignore_eos=True))
    finals, _ = drive(eng, run)
    m = finals["a"].metrics
    got = (m.num_decode_steps, m.num_decode_tokens, m.num_draft_tokens, m.num_accepted_tokens,
           m.accepted_per_position)
    assert got == expected
    st = eng.get_stats()
    assert (st["num_decode_steps"], st["num_decode_tokens"], st["num_draft_tokens"],
            st["num_accepted_tokens"], st["accepted_per_position"]) == expected
    assert st["num_generated_tokens"] == 10
    assert finals["a"].token_ids == ref(p, 10, True)


def test_stats_totals_sum_the_requests():
    eng, run = make()
    for i in range(5):
        eng.add_request(f"r{i}", [3 + i, 9, 4], greedy(8 + i, ignore_eos=True))
    finals, _ = drive(eng, run)
    st = eng.get_stats()
    for key in ("num_draft_tokens", "num_accepted_tokens", "num_decode_steps",
                "num_decode_tokens"):
        assert st[key] == sum(getattr(f.metrics, key) for f in finals.values())
    assert st["num_generated_tokens"] == sum(8 + i for i in range(5))
    assert st["num_decode_tokens"] == sum(8 + i - 1 for i in range(5))   # all but the first


# ============================================================================ logprobs
@pytest.mark.parametrize("k", [0, 2, 3])
def test_logprobs_one_dict_per_token_with_the_token(k):
    # the fake's logprobs: top-n ids 0..n-1 at -1.0, the emitted token t at -t/64
    eng, run = make(max_logprobs=3, accept=accept_all)
    p = [4, 5, 6]
    eng.add_request("a", p, greedy(9, ignore_eos=True, logprobs=k))
    eng.add_request("b", p, greedy(4, ignore_eos=True))
    finals, streams = drive(eng, run)
    out = ref(p, 9, True)
    expected = []
    for t in out:
        d = {i: -1.0 for i in range(k)}
        d[t] = -t / 64
        expected.append(d)
    assert finals["a"].logprobs == expected          # (t / 64 is exact in f32)
    assert finals["b"].logprobs is None
    assert len(streams["a"][0].logprobs) == len(streams["a"][0].token_ids)


# ============================================================================ prefix caching
def _shared_prefix_run(dp):
    # A: 13 tokens, max_tokens 1: prefill 12 + 1 (budget 12), finishes in step 2 before the MTP
    # ran on position 12: min(13, 12) // 4 = 3 full blocks cached (keys need 13 tokens each:
    # the next token is in). B = A: 3 blocks hit (12 of 13 tokens; one position is always
    # computed). D = A[:12] + another token: block 2's key holds token 12: 2 blocks hit (8).
    # Hit rate (0 + 12 + 8) / (13 * 3).
    eng, run = make(enable_prefix_caching=True, data_parallel_size=dp)
    a = [(5 * i) % 60 + 2 for i in range(13)]
    d = a[:12] + [a[12] + 1]
    stats = []
    for rid, p in (("A", a), ("B", a), ("D", d)):
        eng.add_request(rid, p, greedy(1, ignore_eos=True))
        finals, _ = drive(eng, run)
        assert finals[rid].token_ids == ref(p, 1, True)
        stats.append(eng.get_stats())
    return eng, run, stats


@pytest.mark.parametrize("dp", [1, 2])
def test_prefix_cache_hit_rate_by_hand(dp):
    eng, run, stats = _shared_prefix_run(dp)
    assert [s["prefix_cache_hit_tokens"] for s in stats] == [0, 12, 20]
    assert [s["prefix_cache_queried_tokens"] for s in stats] == [13, 26, 39]
    assert stats[-1]["prefix_cache_hit_rate"] == pytest.approx(20 / 39)
    assert [s["num_cached_blocks"] for s in stats] == [3, 3, 3]
    assert [len(d["shared"]) for d in run.inserted] == [0, 3, 2]
    assert all(d["b"] == 0 for d in run.inserted)    # shard 0 each time: the lowest of equals
    assert stats[-1]["num_evictable_blocks"] == 3


def test_prefix_cache_prompt_of_whole_blocks_leaves_one_to_compute():
    # A (13 tokens) caches 3 blocks (see above). E = A[:12] fills 3 blocks exactly, but its last
    # position must be computed to give the first token: at most (12 - 1) // 4 = 2 blocks hit.
    eng, run = make(enable_prefix_caching=True)
    a = [(5 * i) % 60 + 2 for i in range(13)]
    for rid, p in (("A", a), ("E", a[:12])):
        eng.add_request(rid, p, greedy(3, ignore_eos=True))
        finals, _ = drive(eng, run)
        assert finals[rid].token_ids == ref(p, 3, True)
    assert [len(d["shared"]) for d in run.inserted] == [0, 2]
    assert eng.get_stats()["prefix_cache_hit_tokens"] == 8


def test_prefix_cache_evicts_under_pressure_by_hand():
    # 1 slot, 5 blocks of 4, budget 8. A (9 tokens, 1 token out): chunks 8 + 1 take 3 blocks;
    # 2 are cached, 3 free. B (other 9 tokens): the step's bound blocks_needed(8 + 1, 4) + 1 = 4
    # > 3 free evicts 1, the next (chunk 1: 1 + 1 = 2 > 1 free) the other. C = A's prompt: A's
    # blocks are gone (0 hits) and C evicts B's 2 the same way. D = A's prompt again: C's 2
    # blocks hit (8 of 9 tokens), nothing evicted.
    eng, run = make(enable_prefix_caching=True, max_num_seqs=1, max_model_len=16, num_blocks=5)
    a, b = list(range(3, 12)), list(range(20, 29))
    got = []
    for rid, p in (("A", a), ("B", b), ("C", a), ("D", a)):
        eng.add_request(rid, p, greedy(1, ignore_eos=True))
        finals, _ = drive(eng, run)
        assert finals[rid].token_ids == ref(p, 1, True)
        st = eng.get_stats()
        got.append((st["num_evicted_blocks"], st["num_cached_blocks"],
                    st["prefix_cache_hit_tokens"], st["num_free_blocks"]))
    assert got == [(0, 2, 0, 3), (2, 2, 0, 3), (4, 2, 0, 3), (4, 2, 8, 3)]
    assert eng.get_stats()["prefix_cache_queried_tokens"] == 36


@pytest.mark.parametrize("dp,extra", [(1, 6), (2, 6), (1, 12)])
def test_prefix_cache_repeated_prompts_under_pressure(dp, extra):
    # 17 blocks per shard (one max_model_len sequence), 2 slots per shard
    eng, run = make(enable_prefix_caching=True, data_parallel_size=dp, num_blocks=17 * dp,
                    max_num_seqs=2 * dp)
    base = [(11 * i) % 60 + 2 for i in range(17)]
    prompts = [base, base[:9], base + [3], [8] * 14, base, base[:13] + [9, 9], base, [8] * 14]
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, greedy(6 + i + extra, ignore_eos=bool(i % 2)))
    finals, _ = drive(eng, run)
    for i, p in enumerate(prompts):
        assert finals[f"r{i}"].token_ids == ref(p, 6 + i + extra, bool(i % 2)), i
    st = eng.get_stats()
    assert st["prefix_cache_hit_rate"] > 0 and st["num_evicted_blocks"] > 0
    assert st["num_free_blocks"] + st["num_cached_blocks"] == st["num_blocks"]


# ============================================================================ hand-off refusals
def test_handoff_refuses_n_above_one_before_queueing():
    eng, run = make()
    with pytest.raises(ValueError, match="n=1"):
        eng.add_prefill_request("a", [3, 4], SamplingParams(n=2))
    assert not eng.has_unfinished_requests()


def test_handoff_refuses_prefix_caching():
    eng, run = make(enable_prefix_caching=True)
    for call in (eng.add_prefill_request, eng.prefill_request):
        with pytest.raises(ValueError, match="enable_prefix_caching"):
            call("a", [3, 4])
    assert not eng.has_unfinished_requests()


def test_handoff_refuses_a_custom_drafter():
    run = Fake()
    run.engine_config = dataclasses.replace(run.engine_config, spec=SpeculativeConfig(
        "custom", 2, drafter=lambda state: None))
    eng = LLMEngine.from_runner(run)
    with pytest.raises(ValueError, match="custom drafter"):
        eng.add_prefill_request("a", [3, 4])
    assert not eng.has_unfinished_requests()


def test_prefill_request_needs_an_idle_engine_and_import_a_state():
    eng, run = make()
    eng.add_request("a", [3, 4], greedy(2))
    with pytest.raises(RuntimeError, match="unfinished"):
        eng.prefill_request("b", [5, 6])
    assert eng.get_num_unfinished_requests() == 1
    with pytest.raises(TypeError):
        eng.import_request({"request_id": "x"})
    assert eng.pop_exported("b") is None


# ============================================================================ mixed workloads
def oracle(prompt, sp: SamplingParams, max_model_len: int):
    """What a greedy request must return, from :func:`reference` and the tokenizer alone:
    ``(token_ids, text, finish_reason, stop_reason)``."""
    stop_ids = tuple(sp.stop_token_ids) + (() if sp.ignore_eos else (1,))
    toks = reference(prompt, sp.max_tokens, stop_ids=stop_ids, min_tokens=sp.min_tokens,
                     max_model_len=max_model_len)
    for i in range(len(toks)):          # a stop string ends the sample at the token completing it
        text = TOK.decode(toks[:i + 1])
        hits = [(text.find(s), s) for s in sp.stop if s in text]
        if hits:
            j, s = min(hits)
            return (toks[:i + 1], text[:j + len(s)] if sp.include_stop_str_in_output
                    else text[:j], "stop", s)
    last = toks[-1]
    if last in stop_ids and len(toks) > sp.min_tokens:
        return toks, TOK.decode(toks), "stop", last if last in sp.stop_token_ids else None
    return toks, TOK.decode(toks), "length", None


@pytest.mark.parametrize("case", range(12))
def test_mixed_workload_matches_the_oracle(case):
    rng = np.random.default_rng(1000 + case)
    dp = int(rng.choice([1, 2]))
    k = int(rng.choice([0, 1, 2, 3]))
    bs = int(rng.choice([4, 8]))
    B = int(rng.choice([2, 4])) * dp
    max_model_len = int(rng.choice([32, 48]))
    pages = -(-(max_model_len + 2 * k) // bs)
    kw = dict(data_parallel_size=dp, k=k, block_size=bs, max_num_seqs=B,
              max_model_len=max_model_len, num_blocks=dp * (pages + int(rng.integers(0, 6))),
              enable_prefix_caching=bool(rng.integers(0, 2)), max_logprobs=2)
    eng, run = make(tokenizer=TOK, **kw)
    base = [int(x) for x in rng.integers(2, 64, 20)]
    requests = {}
    for i in range(10):
        n = int(rng.integers(1, 20))
        p = base[:n] if rng.random() < 0.5 else [int(x) for x in rng.integers(2, 64, n)]
        out = reference(p, 30, stop_ids=())
        text = TOK.decode(out)
        a = int(rng.integers(0, max(len(text) - 3, 1)))
        max_tokens = int(rng.integers(1, 25))
        sp = SamplingParams(
            max_tokens=max_tokens, ignore_eos=bool(rng.random() < 0.5),
            stop=[text[a:a + int(rng.integers(2, 4))]] if rng.random() < 0.4 and text else None,
            include_stop_str_in_output=bool(rng.random() < 0.5),
            stop_token_ids=(out[int(rng.integers(0, len(out)))],) if rng.random() < 0.3 else (),
            min_tokens=min(int(rng.integers(0, 3)), max_tokens) if rng.random() < 0.3 else 0,
            n=int(rng.choice([1, 1, 2])), logprobs=1 if rng.random() < 0.3 else None)
        requests[f"r{i}"] = (p, sp)
    pending = list(requests)
    aborted, prior, steps = set(), [], 0
    while pending or eng.has_unfinished_requests():
        if pending and rng.random() < 0.5:          # requests arrive while others run
            rid = pending.pop(0)
            eng.add_request(rid, *requests[rid])
        outs = step(eng, run, prior)
        assert not {o.request_id for o in outs} & aborted
        unfinished = [r for r in requests if r not in pending and r not in aborted
                      and r not in {o.request_id for o in prior if o.finished}]
        if unfinished and rng.random() < 0.05:
            rid = unfinished[int(rng.integers(0, len(unfinished)))]
            eng.abort_request(rid)
            aborted.add(rid)
            run.check_invariants()
            check_prefix_bookkeeping(eng, run)
        steps += 1
        assert steps < 3000
    finals, _ = drive(eng, run, prior=prior)
    assert set(finals) == set(requests) - aborted
    for rid, f in finals.items():
        p, sp = requests[rid]
        toks, text, reason, stop_reason = oracle(p, sp, max_model_len)
        assert len(f.outputs) == sp.n
        for o in f.outputs:
            assert (o.token_ids, o.text, o.finish_reason, o.stop_reason) == (
                toks, text, reason, stop_reason), (rid, sp)
            if sp.logprobs is not None:
                assert len(o.logprobs) == len(toks) and all(t in d for t, d in
                                                            zip(toks, o.logprobs))
    st = eng.get_stats()
    assert st["num_running"] == st["num_waiting"] == 0
    assert st["num_free_blocks"] + st.get("num_cached_blocks", 0) == st["num_blocks"]


# A stop token cutting a fully accepted window (K=2; the prefill emits token 0, then 1-3, 4-6):
# the committed drafts before it count as accepted, as with a stop string.
@pytest.mark.parametrize("i,metrics", [(1, (1, 1, 2, 1)), (2, (1, 2, 2, 2)), (4, (2, 4, 4, 3)),
                                       (5, (2, 5, 4, 4))])
def test_stop_token_cutting_a_window_counts_committed_drafts(i, metrics):
    p = find_prompt(lambda p: len(set(reference(p, 8, stop_ids=()))) == 8
                    and 1 not in reference(p, 8, stop_ids=()), length=4)
    out = reference(p, 8, stop_ids=())
    eng, run = make(accept=accept_all)
    eng.add_request("a", p, greedy(20, ignore_eos=True, stop_token_ids=(out[i],)))
    finals, _ = drive(eng, run)
    f = finals["a"]
    assert f.token_ids == out[:i + 1] and (f.finish_reason, f.stop_reason) == ("stop", out[i])
    m = f.metrics
    assert (m.num_decode_steps, m.num_decode_tokens, m.num_draft_tokens,
            m.num_accepted_tokens) == metrics
    assert m.accepted_per_position == [metrics[0], metrics[3] - metrics[0]]
