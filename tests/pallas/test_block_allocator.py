"""One shared test base for every implementation of ``jmtp.pallas.block_allocator.allocate_blocks``.

Expected values come from a hand-worked case and from ``_oracle``, a plain-Python transcription of
the contract (loops, no jnp) written independently of the vectorised reference. Pallas kernels run
in interpret mode on CPU (TPU: race detector on, out-of-bounds reads raise).
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jmtp.pallas import block_allocator as ba
from jmtp.pallas import block_allocator_kernel as bak
from jmtp.pallas.ragged_paged_attention import ragged_paged_attention_reference, write_kv

IMPLS = list(ba.IMPLEMENTATIONS)
# Interpret mode is slow (one Python callback per scalar access): fewer examples for the kernels.
EXAMPLES = {"reference": 25, "pallas_tpu": 6, "pallas_gpu": 12}
LIFECYCLES = {"reference": 12, "pallas_tpu": 1, "pallas_gpu": 4}
SHAPES = [(16, 4, 5), (40, 6, 8)]  # (N blocks, B slots, P pages per slot)


@functools.cache
def _alloc_fn(impl):
    return jax.jit(functools.partial(ba.allocate_blocks, implementation=impl))


def _races_found() -> bool:
    """TPU interpret mode's race detector flag (private jax state; False if unavailable)."""
    try:
        from jax._src.pallas.mosaic.interpret import interpret_pallas_call as ipc
    except ImportError:  # pragma: no cover
        return False
    races = getattr(ipc, "races", None)
    return bool(getattr(races, "races_found", False))


def _run(impl, fs, fc, bt, no, rel, need):
    out = _alloc_fn(impl)(jnp.asarray(fs, jnp.int32), jnp.asarray(fc, jnp.int32),
                          jnp.asarray(bt, jnp.int32), jnp.asarray(no, jnp.int32),
                          jnp.asarray(rel, bool), jnp.asarray(need, jnp.int32))
    out = jax.tree.map(np.asarray, out)
    if impl == "pallas_tpu":
        assert not _races_found(), "TPU interpret mode reported a data race"
    return out


def _oracle(fs, fc, bt, no, rel, need):
    """The contract, slot by slot, in plain Python (clamping rules for invalid states included)."""
    fs = [int(x) for x in fs]
    bt = [[int(x) for x in row] for row in bt]
    no = [int(x) for x in no]
    n, b, p = len(fs), len(bt), len(bt[0])
    top = min(max(int(fc), 0), n)
    for s in range(b):                                   # 1. release
        if rel[s]:
            for j in range(min(max(no[s], 0), p)):
                if top < n:
                    fs[top] = bt[s][j]
                    top += 1
            bt[s] = [-1] * p
            no[s] = 0
    paused = [False] * b
    for s in range(b):                                   # 2. allocate
        k = int(need[s]) - no[s]
        if k <= 0:
            continue
        if int(need[s]) > p or no[s] < 0 or k > top:
            paused[s] = True
            continue
        for j in range(k):
            top -= 1
            bt[s][no[s] + j] = fs[top]
            fs[top] = -1
        no[s] = int(need[s])
    return dict(free_stack=np.array(fs), free_count=top, block_tables=np.array(bt),
                num_owned=np.array(no), paused=np.array(paused))


def _assert_equal(out, expected):
    for field in ("free_stack", "free_count", "block_tables", "num_owned", "paused"):
        np.testing.assert_array_equal(getattr(out, field), expected[field], err_msg=field)


def _random_valid_state(rng, n, b, p):
    """Random valid state: blocks permuted, owned counts random, the rest on the stack."""
    perm = rng.permutation(n)
    no = np.zeros(b, np.int64)
    for s in rng.permutation(b):
        no[s] = rng.integers(0, min(p, n - no.sum()) + 1)
    bt = np.full((b, p), -1)
    pos = 0
    for s in range(b):
        bt[s, :no[s]] = perm[pos:pos + no[s]]
        pos += no[s]
    fc = n - pos
    fs = rng.integers(-5, 2 * n, size=n)          # garbage past free_count must pass through
    fs[:fc] = perm[pos:]
    rel = rng.random(b) < 0.3
    need = rng.integers(0, p + 3, size=b)          # includes < owned, == owned and > P
    return fs, fc, bt, no, rel, need


# ---------------------------------------------------------------------------------------------
# Hand-worked case.


@pytest.mark.parametrize("impl", IMPLS)
def test_hand_worked_two_steps(impl):
    fs, fc, bt, no = ba.init_allocator_state(10, 3, 4)   # stack [9..0], block 0 on top
    np.testing.assert_array_equal(fs, np.arange(9, -1, -1))
    # Step 1: slot 0 needs 2 -> pops 0, 1; slot 1 needs 5 > P=4 -> paused;
    # slot 2 needs 3 -> pops 2, 3, 4.
    r = _run(impl, fs, fc, bt, no, [False, False, False], [2, 5, 3])
    np.testing.assert_array_equal(r.free_stack, [9, 8, 7, 6, 5, -1, -1, -1, -1, -1])
    assert r.free_count == 5
    np.testing.assert_array_equal(r.block_tables, [[0, 1, -1, -1], [-1] * 4, [2, 3, 4, -1]])
    np.testing.assert_array_equal(r.num_owned, [2, 0, 3])
    np.testing.assert_array_equal(r.paused, [False, True, False])
    # Step 2: slot 0 released (pushes 0 then 1: stack [9 8 7 6 5 0 1]) and re-filled with 1 block
    # (pops 1); slot 1 needs 4 -> 0, 5, 6, 7; slot 2 grows 3 -> 4 -> 8.
    r = _run(impl, r.free_stack, r.free_count, r.block_tables, r.num_owned,
             [True, False, False], [1, 4, 4])
    np.testing.assert_array_equal(r.free_stack, [9] + [-1] * 9)
    assert r.free_count == 1
    np.testing.assert_array_equal(r.block_tables, [[1, -1, -1, -1], [0, 5, 6, 7], [2, 3, 4, 8]])
    np.testing.assert_array_equal(r.num_owned, [1, 4, 4])
    np.testing.assert_array_equal(r.paused, [False, False, False])
    # Step 3: slot 0 wants 3 more than it has but only 1 is free: all or nothing -> paused, and
    # slot 1 (wants 4, has 4) is untouched; the one free block stays free.
    r2 = _run(impl, r.free_stack, r.free_count, r.block_tables, r.num_owned,
              [False, False, False], [4, 4, 0])
    np.testing.assert_array_equal(r2.block_tables, r.block_tables)
    np.testing.assert_array_equal(r2.num_owned, r.num_owned)
    np.testing.assert_array_equal(r2.paused, [True, False, False])
    assert r2.free_count == 1 and r2.free_stack[0] == 9


# ---------------------------------------------------------------------------------------------
# Every implementation == the oracle, on random valid states and on arbitrary (invalid) inputs.


@pytest.mark.parametrize("impl", IMPLS)
def test_matches_oracle_on_random_valid_states(impl):
    @settings(max_examples=EXAMPLES[impl], deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow])
    @given(seed=st.integers(0, 2**32 - 1), shape=st.sampled_from(SHAPES))
    def check(seed, shape):
        rng = np.random.default_rng(seed)
        n, b, p = shape
        fs, fc, bt, no, rel, need = _random_valid_state(rng, n, b, p)
        out = _run(impl, fs, fc, bt, no, rel, need)
        _assert_equal(out, _oracle(fs, fc, bt, no, rel, need))
        ba.check_state(out.free_stack, out.free_count, out.block_tables, out.num_owned)
        assert out.free_count + out.num_owned.sum() == n
        owned_after_release = np.where(rel, 0, no)
        for s in np.nonzero(out.paused)[0]:
            assert out.num_owned[s] == owned_after_release[s]
            expected_row = np.full(p, -1) if rel[s] else bt[s]
            np.testing.assert_array_equal(out.block_tables[s], expected_row)

    check()


@pytest.mark.parametrize("impl", IMPLS)
def test_matches_oracle_and_stays_in_bounds_on_arbitrary_inputs(impl):
    """Garbage counts and ids: well defined, identical everywhere, no out-of-bounds access (TPU
    interpret mode raises on one)."""
    @settings(max_examples=EXAMPLES[impl], deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow])
    @given(seed=st.integers(0, 2**32 - 1), shape=st.sampled_from(SHAPES))
    def check(seed, shape):
        rng = np.random.default_rng(seed)
        n, b, p = shape
        fs = rng.integers(-3, n + 3, size=n)
        fc = rng.integers(-3, n + 4)
        bt = rng.integers(-3, n + 3, size=(b, p))
        no = rng.integers(-3, p + 4, size=b)
        rel = rng.random(b) < 0.5
        need = rng.integers(-3, p + 4, size=b)
        _assert_equal(_run(impl, fs, fc, bt, no, rel, need), _oracle(fs, fc, bt, no, rel, need))

    check()


# ---------------------------------------------------------------------------------------------
# Request lifecycles: arrive, grow by 1..K+1 positions per step, finish, get preempted when paused.


def _lifecycle(impl, seed, *, n=14, b=4, p=5, bs=4, k=2, steps=24):
    rng = np.random.default_rng(seed)
    fs, fc, bt, no = (np.asarray(x) for x in ba.init_allocator_state(n, b, p))
    live = [None] * b            # per slot: dict(id, length, blocks, paused)
    next_id = 0
    waiting = []                 # preempted requests: their lengths, re-admitted later
    stats = dict(pauses=0, preemptions=0, reused=0, finished=0)
    ever_owned = set()
    for _ in range(steps):
        rel = np.zeros(b, bool)
        need = np.zeros(b, np.int64)
        for s in range(b):
            seq = live[s]
            if seq is not None:
                if seq["paused"] and rng.random() < 0.5:           # host preempts a paused slot
                    rel[s] = True
                    waiting.append(seq["length"])
                    stats["preemptions"] += 1
                    live[s] = None
                elif rng.random() < 0.15 or seq["length"] + 2 * (k + 1) > p * bs:
                    rel[s] = True                                    # finished
                    stats["finished"] += 1
                    live[s] = None
                elif not seq["paused"]:
                    seq["length"] += int(rng.integers(1, k + 2))     # accepted 1..K+1 tokens
            if live[s] is None and rng.random() < 0.6:               # admit (maybe same call)
                if waiting and rng.random() < 0.5:
                    length = waiting.pop(0)
                elif rng.random() < 0.05:
                    length = p * bs                                  # can never fit: num_needed > P
                else:
                    length = int(rng.integers(1, p * bs - 2 * (k + 1)))
                live[s] = dict(id=next_id, length=length, blocks=[], paused=False)
                next_id += 1
            if live[s] is not None:
                need[s] = math.ceil((live[s]["length"] + k + 1) / bs)
        out = _run(impl, fs, fc, bt, no, rel, need)
        _assert_equal(out, _oracle(fs, fc, bt, no, rel, need))

        # Independent property checks.
        ba.check_state(out.free_stack, out.free_count, out.block_tables, out.num_owned)
        assert int(out.free_count) + int(out.num_owned.sum()) == n        # conservation
        owners = {}
        for s in range(b):
            seq = live[s]
            row = out.block_tables[s]
            if seq is None:
                assert out.num_owned[s] == 0 and (row == -1).all() and not out.paused[s]
                continue
            had = seq["blocks"]
            if out.paused[s]:
                stats["pauses"] += 1
                assert need[s] > len(had)
                assert list(row[:len(had)]) == had and out.num_owned[s] == len(had)
                assert (row[len(had):] == -1).all()                     # never corrupted
            else:
                assert out.num_owned[s] == max(need[s], len(had))
                assert list(row[:len(had)]) == had                      # blocks never move
                new = [int(x) for x in row[len(had):out.num_owned[s]]]
                stats["reused"] += len(ever_owned.intersection(new))
                ever_owned.update(new)
                seq["blocks"] = had + new
            seq["paused"] = bool(out.paused[s])
            for blk in seq["blocks"]:
                assert blk not in owners, f"block {blk} owned by seqs {owners[blk]} and {seq['id']}"
                owners[blk] = seq["id"]
        fs, fc, bt, no = out.free_stack, out.free_count, out.block_tables, out.num_owned
    return stats


@pytest.mark.parametrize("impl", IMPLS)
def test_lifecycle_properties(impl):
    @settings(max_examples=LIFECYCLES[impl], deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow])
    @given(seed=st.integers(0, 2**32 - 1))
    def check(seed):
        _lifecycle(impl, seed)

    check()


def test_lifecycle_exercises_pauses_preemption_and_reuse():
    """The lifecycle generator reaches the interesting cases (else the properties are moot)."""
    totals = dict(pauses=0, preemptions=0, reused=0, finished=0)
    for seed in range(4):
        for key, v in _lifecycle("reference", seed).items():
            totals[key] += v
    assert all(v > 0 for v in totals.values()), totals


# ---------------------------------------------------------------------------------------------
# A freed block's old contents are never read by its next owner.


def _dense_attention(q, k, v, sm_scale):
    """numpy causal GQA attention of the last len(q) positions of one sequence over its k/v."""
    t, nq, d = q.shape
    length, nkv, _ = k.shape
    g = nq // nkv
    out = np.zeros((t, nq, d))
    for i in range(t):
        pos = length - t + i
        for h in range(nq):
            s = k[:pos + 1, h // g] @ q[i, h] * sm_scale
            w = np.exp(s - s.max())
            out[i, h] = (w / w.sum()) @ v[:pos + 1, h // g]
    return out


@functools.partial(jax.jit, static_argnames=("block_size",))
def _write_and_attend_jit(k_cache, v_cache, k_new, v_new, slots, q, kv_len, q_len, table, *,
                          block_size):
    kc, vc = write_kv(k_cache, v_cache, k_new, v_new, slots)
    cu = jnp.stack([jnp.int32(0), q_len])
    return ragged_paged_attention_reference(q, kc, vc, kv_len[None], table, cu,
                                            sm_scale=q.shape[-1] ** -0.5)


def _write_and_attend(k_cache, v_cache, k_b, v_b, q, table, bs):
    """write_kv of one sequence's positions [0, len) + attention of its last len(q) positions,
    padded to fixed shapes (rows past the sequence: slot -1 / padding queries) to compile once."""
    length, nkv, d = k_b.shape
    t_max = table.shape[1] * bs
    pos = np.arange(t_max)
    slots = np.where(pos < length, np.asarray(table[0])[np.minimum(pos // bs, table.shape[1] - 1)]
                     * bs + pos % bs, -1)
    pad = lambda x, rows: np.concatenate([x, np.zeros((rows - len(x),) + x.shape[1:], x.dtype)])
    out = _write_and_attend_jit(
        jnp.asarray(k_cache), jnp.asarray(v_cache), jnp.asarray(pad(k_b, t_max)),
        jnp.asarray(pad(v_b, t_max)), jnp.asarray(slots, jnp.int32), jnp.asarray(pad(q, 4)),
        jnp.int32(length), jnp.int32(len(q)), jnp.asarray(table, jnp.int32), block_size=bs)
    out = np.asarray(out)
    assert (out[len(q):] == 0).all()          # padding query rows
    return out[:len(q)]


@pytest.mark.parametrize("impl", IMPLS)
def test_freed_block_contents_never_read_by_next_owner(impl):
    n, b, p, bs, nkv, nq, d = 8, 2, 4, 4, 2, 4, 8

    @settings(max_examples=4 if impl == "pallas_tpu" else 8, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow])
    @given(len_a=st.integers(bs + 1, p * bs), len_b=st.integers(1, p * bs),
           q_len=st.integers(1, 4), poison=st.sampled_from([np.nan, 1e30, -3e38]),
           seed=st.integers(0, 2**31 - 1))
    def check(len_a, len_b, q_len, poison, seed):
        rng = np.random.default_rng(seed)
        q_len = min(q_len, len_b)
        fs, fc, bt, no = ba.init_allocator_state(n, b, p)
        # Sequence A in slot 0, another live sequence in slot 1 (one block).
        st1 = _run(impl, fs, fc, bt, no, [False, False], [math.ceil(len_a / bs), 1])
        blocks_a = [int(x) for x in st1.block_tables[0, :st1.num_owned[0]]]
        # A's whole blocks and every free block hold poison (stale data from a finished tenant).
        k_cache = np.asarray(rng.standard_normal((n, bs, nkv, d)), np.float32)
        v_cache = np.asarray(rng.standard_normal((n, bs, nkv, d)), np.float32)
        stale = blocks_a + [int(x) for x in st1.free_stack[:st1.free_count]]
        k_cache[stale] = poison
        v_cache[stale] = poison
        # A finishes; B arrives in the same slot in the same call and gets A's blocks back (LIFO).
        st2 = _run(impl, st1.free_stack, st1.free_count, st1.block_tables, st1.num_owned,
                   [True, False], [math.ceil(len_b / bs), 1])
        assert not st2.paused.any()
        blocks_b = [int(x) for x in st2.block_tables[0, :st2.num_owned[0]]]
        assert set(blocks_b) & set(blocks_a), "test must exercise reuse of A's blocks"
        # B writes its keys/values for positions [0, len_b), then attends (fixed padded shapes).
        k_b = rng.standard_normal((len_b, nkv, d)).astype(np.float32)
        v_b = rng.standard_normal((len_b, nkv, d)).astype(np.float32)
        q = rng.standard_normal((q_len, nq, d)).astype(np.float32)
        out = _write_and_attend(k_cache, v_cache, k_b, v_b, q, st2.block_tables[:1], bs)
        assert np.isfinite(out).all()
        np.testing.assert_allclose(out, _dense_attention(q, k_b, v_b, d ** -0.5),
                                   rtol=1e-5, atol=1e-5)

    check()


# ---------------------------------------------------------------------------------------------
# Contract plumbing: validation, helpers, lowering for the kernels' real platforms.


def _good_args(n=8, b=2, p=3):
    fs, fc, bt, no = ba.init_allocator_state(n, b, p)
    return dict(free_stack=fs, free_count=fc, block_tables=bt, num_owned=no,
                release=jnp.zeros((b,), bool), num_needed=jnp.zeros((b,), jnp.int32))


@pytest.mark.parametrize("name,bad", [
    ("free_stack", jnp.zeros((2, 4), jnp.int32)),
    ("free_stack", jnp.zeros((8,), jnp.float32)),
    ("free_count", jnp.zeros((1,), jnp.int32)),
    ("block_tables", jnp.zeros((2,), jnp.int32)),
    ("block_tables", jnp.zeros((2, 3), jnp.int64 if jax.config.x64_enabled else jnp.int16)),
    ("num_owned", jnp.zeros((3,), jnp.int32)),
    ("release", jnp.zeros((2,), jnp.int32)),
    ("num_needed", jnp.zeros((5,), jnp.int32)),
    ("num_needed", [0, 0]),
])
@pytest.mark.parametrize("impl", IMPLS)
def test_validation_names_the_argument(name, bad, impl):
    args = _good_args()
    args[name] = bad
    with pytest.raises(ValueError, match=name):
        ba.allocate_blocks(**args, implementation=impl)


def test_unknown_implementation():
    with pytest.raises(ValueError, match="implementation"):
        ba.allocate_blocks(**_good_args(), implementation="cuda")
    with pytest.raises(ValueError, match="implementation"):
        ba.resolve_implementation("tpu", 8, 2, 3)


def test_tpu_smem_bytes_hand_computed():
    # N=10, B=3, P=4, int32 words: stack scratch 10 + tables scratch 3*4 = 12; SMEM inputs
    # free_count 1 + num_owned 3 + release 3 + num_needed 3; SMEM outputs free_count 1 + num_owned 3
    # + paused 3.  10 + 12 + 10 + 7 = 39 words = 156 bytes.
    assert bak.tpu_smem_bytes(10, 3, 4) == 156
    # The large configuration: B=128 slots, P=8192/16=512 pages, the engine's default
    # N = B*P = 65536 blocks: 4 * (65536 + 65536 + 640 + 2) = 526,856 bytes > 512 KiB.
    assert bak.tpu_smem_bytes(65536, 128, 512) == 526_856
    assert bak.TPU_SMEM_BUDGET_BYTES == 512 * 1024
    if jax.default_backend() != "tpu":
        assert bak.tpu_smem_budget_bytes() == bak.TPU_SMEM_BUDGET_BYTES
    assert bak.tpu_smem_bytes(65536, 128, 512) > bak.tpu_smem_budget_bytes()
    assert bak.tpu_smem_bytes(65536, 64, 512) <= bak.tpu_smem_budget_bytes()


def test_resolve_implementation(monkeypatch):
    monkeypatch.setattr(ba, "_warned_fallbacks", set())   # warn here, not only once per process
    default = ba.default_implementation()
    assert ba.resolve_implementation(None, 8, 2, 3) == default
    assert ba.resolve_implementation("auto", 8, 2, 3) == default
    for impl in IMPLS:
        assert ba.resolve_implementation(impl, 8, 2, 3) == impl
    # Over the TPU SMEM budget: pallas_tpu runs the reference; pallas_gpu (GMEM) has no such limit.
    assert ba.resolve_implementation("pallas_tpu", 65536, 128, 512) == "reference"
    assert ba.resolve_implementation("pallas_gpu", 65536, 128, 512) == "pallas_gpu"


def test_tpu_kernel_itself_refuses_a_state_over_the_smem_budget():
    n = bak.TPU_SMEM_BUDGET_BYTES // 4
    assert bak.tpu_smem_bytes(n, 2, 3) > bak.TPU_SMEM_BUDGET_BYTES
    assert bak.tpu_smem_bytes(n // 2, 2, 3) <= bak.TPU_SMEM_BUDGET_BYTES
    with pytest.raises(ValueError, match="SMEM"):
        bak.allocate_blocks_tpu(*_good_args(n=n, b=2, p=3).values(), interpret=True)


def test_pallas_tpu_over_smem_budget_falls_back_to_reference(monkeypatch, caplog):
    """A state over the (lowered) SMEM budget runs the reference, bit for bit, at trace time, with
    one warning naming the figures; under the budget the kernel is traced as before."""
    n, b, p = SHAPES[1]
    need = bak.tpu_smem_bytes(n, b, p)
    monkeypatch.setattr(ba, "_warned_fallbacks", set())
    rng = np.random.default_rng(7)
    fs, fc, bt, no, rel, needed = _random_valid_state(rng, n, b, p)
    args = (jnp.asarray(fs, jnp.int32), jnp.asarray(fc, jnp.int32), jnp.asarray(bt, jnp.int32),
            jnp.asarray(no, jnp.int32), jnp.asarray(rel, bool), jnp.asarray(needed, jnp.int32))

    def tpu():  # a fresh function per trace: jax caches traces per function, not per budget
        return functools.partial(ba.allocate_blocks, implementation="pallas_tpu")

    monkeypatch.setattr(bak, "TPU_SMEM_BUDGET_BYTES", need)           # fits exactly: the kernel
    assert "pallas_call" in str(jax.make_jaxpr(tpu())(*args))

    monkeypatch.setattr(bak, "TPU_SMEM_BUDGET_BYTES", need - 4)       # one word over: reference
    with caplog.at_level("WARNING", logger=ba.__name__):
        assert "pallas_call" not in str(jax.make_jaxpr(tpu())(*args))

        def no_kernel(*a, **k):
            raise AssertionError("the TPU kernel ran on a state over its SMEM budget")

        monkeypatch.setattr(bak, "allocate_blocks_tpu", no_kernel)
        got = jax.tree.map(np.asarray, tpu()(*args))
        got_jit = jax.tree.map(np.asarray, jax.jit(tpu())(*args))
    warnings = [r for r in caplog.records if r.name == ba.__name__ and r.levelname == "WARNING"]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]          # once per size
    msg = warnings[0].getMessage()
    for figure in (str(need), str(need - 4), f"num_blocks={n}", f"max_num_seqs={b}",
                   f"pages_per_seq={p}", "reference"):
        assert figure in msg, msg
    want = jax.tree.map(np.asarray, ba.allocate_blocks_reference(*args))
    for out in (got, got_jit):
        for name in ("free_stack", "free_count", "block_tables", "num_owned", "paused"):
            np.testing.assert_array_equal(getattr(out, name), getattr(want, name), err_msg=name)
    _assert_equal(got, _oracle(fs, fc, bt, no, rel, needed))


def test_check_state_detects_violations():
    fs, fc, bt, no = (np.asarray(x) for x in ba.init_allocator_state(6, 2, 3))
    ba.check_state(fs, fc, bt, no)
    bt2 = bt.copy()
    bt2[0, 0] = fs[-1]                    # block owned and still free
    with pytest.raises(ValueError, match="held twice"):
        ba.check_state(fs, fc, bt2, np.array([1, 0]))
    with pytest.raises(ValueError, match="past num_owned"):
        ba.check_state(fs, fc, bt2, no)
    with pytest.raises(ValueError, match="free_count"):
        ba.check_state(fs, 7, bt, no)


def test_default_implementation_on_cpu_is_reference():
    assert jax.default_backend() != "cpu" or ba.default_implementation() == "reference"


def test_kernels_lower_for_their_platforms():
    """Lower (not run) each kernel for its real backend from this CPU host: Mosaic TPU, Triton."""
    args = tuple(_good_args().values())
    gpu = jax.jit(functools.partial(bak.allocate_blocks_gpu, interpret=False))
    assert "triton" in gpu.trace(*args).lower(lowering_platforms=("cuda",)).as_text()

    tpu_info = pytest.importorskip("jax._src.pallas.mosaic.tpu_info")
    if not hasattr(tpu_info, "registry") or not hasattr(tpu_info, "_get_tpu_info_impl"):
        pytest.skip("private jax TPU info registry changed")
    # Pallas TPU lowering asks the default device for TPU facts; register the CPU as a v5e.
    saved = dict(tpu_info.registry)
    tpu_info.registry[jax.devices()[0].device_kind] = functools.partial(
        tpu_info._get_tpu_info_impl, tpu_info.ChipVersion.TPU_V5E, 1)
    try:
        tpu = jax.jit(functools.partial(bak.allocate_blocks_tpu, interpret=False))
        text = tpu.trace(*args).lower(lowering_platforms=("tpu",)).as_text()
    finally:
        tpu_info.registry.clear()
        tpu_info.registry.update(saved)
    assert "tpu_custom_call" in text
    assert "output_operand_alias" in text    # state updated in place
