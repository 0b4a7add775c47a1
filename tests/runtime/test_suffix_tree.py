"""The suffix tree and cache of suffix decoding against a naive scan of the stored sequences
(``jmtp/runtime/host/suffix_tree.py``, ``jmtp/runtime/host/suffix_decoding.py``): counts, children,
drafts (match lengths, the length rule, the probability floor, ties), removal and the cache's
bounds. Pure Python: no XLA."""
from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from jmtp.runtime.device.bitmask import KEEP_DRAFT, NO_DRAFT
from jmtp.runtime.host.suffix_decoding import SuffixCache, merge_overrides
from jmtp.runtime.host.suffix_tree import EMPTY_DRAFT, SuffixTree


# ---------------------------------------------------------------- the naive reference
def ref_count(seqs, s) -> int:
    """Occurrences of ``s`` in the sequences, by scanning every position."""
    n = len(s)
    return sum(1 for q in seqs for i in range(len(q) - n + 1) if q[i:i + n] == list(s))


def ref_children(seqs, s, depth) -> dict[int, int]:
    """Tokens that follow an occurrence of ``s`` (within the depth bound), with their counts."""
    out: dict[int, int] = {}
    n = len(s)
    if n >= depth:
        return out
    for q in seqs:
        for i in range(len(q) - n):
            if q[i:i + n] == list(s):
                out[q[i + n]] = out.get(q[i + n], 0) + 1
    return out


def ref_draft(seqs, context, depth, max_spec, factor, min_prob, offset=0.0):
    """The drafting rule of jmtp.runtime.host.suffix_tree, over the naive counts: ``(tokens, probs,
    score, match_len)``."""
    ctx = list(context[-(depth - 1):]) if len(context) >= depth else list(context)
    best = ((), (), 0.0, 0)
    for m in range(1, len(ctx) + 1):
        s = ctx[len(ctx) - m:]
        base = ref_count(seqs, s)
        if base == 0:
            break
        limit = min(max_spec, int(m * factor + offset + 1e-6))
        toks, probs, score, cur = [], [], 0.0, list(s)
        while len(toks) < limit:
            ch = ref_children(seqs, cur, depth)
            if not ch:
                break
            t = min(ch, key=lambda x: (-ch[x], x))      # most frequent, then the smaller id
            p = ref_count(seqs, cur + [t]) / base
            if p < min_prob:
                break
            toks.append(t)
            probs.append(p)
            score += p
            cur.append(t)
        if toks and score >= best[2]:
            best = (tuple(toks), tuple(probs), score, m)
    return best


def as_tuple(d):
    return d.token_ids, d.probs, d.score, d.match_len


def build(seqs, depth, pieces: random.Random | None = None) -> SuffixTree:
    """A tree of ``seqs`` (sequence ids 0..); with ``pieces``, appended a few tokens at a time
    to sequences taken in random order (interleaved, as running requests append)."""
    t = SuffixTree(depth)
    left = {i: list(q) for i, q in enumerate(seqs)}
    for i in left:
        t.extend(i, [])
    while left:
        i = pieces.choice(sorted(left)) if pieces else min(left)
        step = pieces.randint(0, 4) if pieces else len(left[i])
        t.extend(i, left[i][:step])
        left[i] = left[i][step:]
        if not left[i]:
            del left[i]
    return t


def distinct_substrings(seqs, depth) -> set:
    return {tuple(q[i:i + n]) for q in seqs for n in range(1, depth + 1)
            for i in range(len(q) - n + 1)}


seq_lists = st.lists(st.lists(st.integers(0, 3), max_size=24), min_size=1, max_size=4)


# ---------------------------------------------------------------- counts and drafts
@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(seqs=seq_lists, depth=st.integers(2, 6), seed=st.integers(0, 2**16))
def test_counts_and_children_equal_a_naive_scan(seqs, depth, seed):
    tree = build(seqs, depth, random.Random(seed))
    assert tree.num_tokens == sum(map(len, seqs)) == tree.count(())
    subs = distinct_substrings(seqs, depth)
    for s in subs:
        assert tree.count(s) == ref_count(seqs, s), s
        if len(s) < depth:
            assert tree.children(s) == ref_children(seqs, s, depth), s
    assert tree.count((9,)) == 0
    # a node per string seen at least twice, a tail per string seen once right below one (or
    # the root), and the root: what the memory bound counts
    twice = {s for s in subs if ref_count(seqs, s) >= 2}
    tails = {s for s in subs if ref_count(seqs, s) == 1 and (len(s) == 1 or s[:-1] in twice)}
    assert tree.num_nodes == 1 + len(twice) + len(tails)


@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
@given(seqs=seq_lists, depth=st.integers(2, 7), data=st.data())
def test_drafts_equal_the_naive_rule(seqs, depth, data):
    tree = build(seqs, depth)
    max_spec = data.draw(st.integers(0, 6), label="max_spec_tokens")
    factor = data.draw(st.sampled_from([0.0, 0.5, 1.0, 2.0]), label="factor")
    min_prob = data.draw(st.sampled_from([0.0, 0.1, 0.34, 0.5, 1.0]), label="min_prob")
    offset = data.draw(st.sampled_from([0.0, 1.0, -1.0]), label="offset")
    # a context that ends like a stored sequence, or any tokens
    if data.draw(st.booleans(), label="from_stored") and any(seqs):
        q = data.draw(st.sampled_from([q for q in seqs if q]), label="stored")
        cut = data.draw(st.integers(1, len(q)), label="cut")
        context = data.draw(st.lists(st.integers(0, 3), max_size=4), label="prefix") + q[:cut]
    else:
        context = data.draw(st.lists(st.integers(0, 4), max_size=10), label="context")
    got = tree.speculate(context, max_spec, factor, offset, min_prob)
    assert as_tuple(got) == ref_draft(seqs, context, depth, max_spec, factor, min_prob, offset)
    assert all(p >= min_prob for p in got.probs)
    assert list(got.probs) == sorted(got.probs, reverse=True)
    assert got.match_len + len(got.token_ids) <= depth


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(seqs=seq_lists, depth=st.integers(2, 6), seed=st.integers(0, 2**16))
def test_a_sequences_own_nodes_are_the_walked_ones(seqs, depth, seed):
    """``active_nodes`` (kept while appending, also when another sequence's append makes a
    string at this one's end seen twice) are the walked positions of the sequence's last ``m``
    tokens for every ``m`` whose string occurs twice or more; the longer ones occur once. So a
    running sample's context needs no walk: drafting from them, walking only past the stored
    sequence, gives the walked draft."""
    tree = build(seqs, depth, random.Random(seed))
    for i, q in enumerate(seqs):
        act = tree.active_nodes(i)
        assert act == tree.match_nodes(q)[:len(act)]
        for m in range(1, min(len(q), depth - 1) + 1):
            assert (ref_count(seqs, q[len(q) - m:]) >= 2) == (m <= len(act)), m
        for prefix in ([], [0], [3, 2, 1]):
            ctx = prefix + q
            assert as_tuple(tree.speculate(nodes=tree.match_nodes(ctx, act, len(q)))) == (
                ref_draft(seqs, ctx, depth, 8, 1.0, 0.1))


def test_hand_worked_draft():
    """'a b c a b d a b c a b' (a=1 b=2 c=3 d=4 at positions 0..10), D = 4.

    Context 'c a b', factor 1: m=1 'b' (4 times; then c twice, d once) drafts c at 2/4; m=2
    'a b' (4 times) drafts c at 2/4 then, after 'a b c', a at count('a b c a')/4 = 2/4 (depth 4
    reached); m=3 'c a b' (twice, then d once) drafts d at 1/2. Best score: m=2, 1.0.
    Context 'd a': m=1 'a' drafts b at 4/4 (limit 1); m=2 'd a' (once) drafts b, c at 1/1
    each: score 2. Factor 0.5 leaves m=1 no token and m=2 one."""
    seq = [1, 2, 3, 1, 2, 4, 1, 2, 3, 1, 2]
    tree = build([seq], 4)
    assert tree.children((1, 2)) == {3: 2, 4: 1}
    assert tree.count((1, 2)) == 4 and tree.count((3, 1, 2)) == 2
    d = tree.speculate([3, 1, 2], max_spec_tokens=5, max_spec_factor=1.0, min_token_prob=0.1)
    assert (d.token_ids, d.probs, d.score, d.match_len) == ((3, 1), (0.5, 0.5), 1.0, 2)
    d = tree.speculate([3, 1, 2], max_spec_tokens=1, max_spec_factor=1.0, min_token_prob=0.1)
    assert (d.token_ids, d.match_len) == ((4,), 3)     # three drafts of 0.5: the longest match
    assert tree.speculate([3, 1, 2], 5, 1.0, min_token_prob=0.6) == EMPTY_DRAFT
    d = tree.speculate([4, 1], max_spec_tokens=5, max_spec_factor=1.0, min_token_prob=0.1)
    assert (d.token_ids, d.probs, d.match_len) == ((2, 3), (1.0, 1.0), 2)
    d = tree.speculate([4, 1], max_spec_tokens=5, max_spec_factor=0.5, min_token_prob=0.1)
    assert (d.token_ids, d.match_len) == ((2,), 2)
    assert tree.speculate([4, 5], 5) == EMPTY_DRAFT      # no string ends with 5


# ---------------------------------------------------------------- removal and memory
@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(seqs=st.lists(st.lists(st.integers(0, 3), max_size=20), min_size=1, max_size=5),
       depth=st.integers(2, 6), data=st.data())
def test_removal_equals_never_having_stored(seqs, depth, data):
    """Removing sequences leaves the tree of the others: the same counts, children and drafts,
    no node for a string no longer stored, nothing once all are gone."""
    tree = build(seqs, depth, random.Random(data.draw(st.integers(0, 2**16), label="seed")))
    drop = data.draw(st.sets(st.integers(0, len(seqs) - 1)), label="drop")
    for i in sorted(drop):
        tree.remove(i)
    kept = [q for i, q in enumerate(seqs) if i not in drop]
    fresh = build(kept, depth)
    subs = distinct_substrings(seqs, depth)
    for s in subs:
        assert tree.count(s) == fresh.count(s) == ref_count(kept, s)
        if len(s) < depth:
            assert tree.children(s) == fresh.children(s)
    # every node left stands for a string still stored (a node seen twice once may stay)
    assert fresh.num_nodes <= tree.num_nodes <= 1 + len(distinct_substrings(kept, depth))
    assert tree.num_tokens == sum(map(len, kept))
    for q in kept:
        for cut in range(1, len(q) + 1):
            assert as_tuple(tree.speculate(q[:cut], 4)) == ref_draft(kept, q[:cut], depth, 4,
                                                                     1.0, 0.1)
    for i in range(len(seqs)):
        if i not in drop:
            tree.remove(i)
    assert tree.num_nodes == 1 and tree.num_tokens == 0 and not tree._edge   # all freed


def test_bad_arguments():
    with pytest.raises(ValueError, match="max_depth"):
        SuffixTree(1)
    t = SuffixTree(3)
    with pytest.raises(KeyError):
        t.remove(0)


# ---------------------------------------------------------------- the cache
def test_cache_drafts_the_better_tree_and_bounds_the_global_one():
    """Local trees over prompt + output, the global tree over outputs only; the draft is the
    better of the two (the naive rule over each one's sequences); finished outputs are evicted
    oldest first when the request or token budget is exceeded, running ones never."""
    rng = random.Random(0)
    D, K = 5, 4
    c = SuffixCache(D, max_cached_requests=3, corpus_tokens=40)
    outputs: dict[int, list[int]] = {}
    prompts: dict[int, list[int]] = {}
    finished: list[int] = []
    running: list[int] = []
    for step in range(120):
        if len(running) < 2 and rng.random() < 0.3:
            key = step
            prompts[key] = [rng.randint(0, 3) for _ in range(rng.randint(1, 8))]
            outputs[key] = []
            c.start(key, prompts[key])
            running.append(key)
        if not running:
            continue
        key = rng.choice(running)
        toks = [rng.randint(0, 3) for _ in range(rng.randint(1, 3))]
        c.extend(key, toks)
        outputs[key] += toks
        if rng.random() < 0.1:
            c.stop(key)
            running.remove(key)
            finished.append(key)
        # what the global tree must hold: every running output, the newest finished ones
        held = [k for k in finished if outputs[k]]
        while held and (len(running) + len(held) > 3
                        or sum(len(outputs[k]) for k in running + held) > 40):
            held.pop(0)
        glob = [outputs[k] for k in held + running]
        stats = c.stats()
        assert stats["suffix_cached_tokens"] == sum(map(len, glob))
        assert stats["suffix_global_tree_nodes"] <= 1 + len(distinct_substrings(glob, D))
        for key in running:
            ctx = prompts[key] + outputs[key]
            got = c.speculate(key, ctx, K, 1.0, 0.1)
            loc = ref_draft([ctx], ctx, D, K, 1.0, 0.1)
            gl = ref_draft(glob, ctx, D, K, 1.0, 0.1)
            assert as_tuple(got) == (gl if gl[2] > loc[2] else loc)
    assert c.num_evicted > 0


def test_cache_without_a_global_tree_and_clear():
    c = SuffixCache(4, max_cached_requests=0, corpus_tokens=10)
    c.start("a", [1, 2, 3], [])
    c.extend("a", [1, 2])
    c.stop("a")
    c.start("b", [7], [])
    c.extend("b", [1, 2])
    assert c.speculate("b", [7, 1, 2], 3, 1.0, 0.1) == EMPTY_DRAFT   # 'a' is not remembered
    assert c.stats()["suffix_cached_requests"] == 0
    with pytest.raises(ValueError, match="already running"):
        c.start("b", [1])
    g = SuffixCache(4, max_cached_requests=5, corpus_tokens=100)
    g.start("a", [5], [])
    g.extend("a", [1, 2, 3, 1])
    g.stop("a")
    g.start("b", [6], [])
    g.extend("b", [1, 2])
    assert g.speculate("b", [6, 1, 2], 3, 1.0, 0.1).token_ids == (3, 1)   # from a's output
    g.clear()
    assert g.stats()["suffix_cached_requests"] == 1                     # b still runs
    assert g.speculate("b", [6, 1, 2], 3, 1.0, 0.1) == EMPTY_DRAFT


def test_merge_overrides_by_hand():
    """Where the grammar keeps the pending draft, the suffix override applies; the grammar's
    own forced tokens and cuts win."""
    K = 4
    suffix = np.array([[5, 6, NO_DRAFT, NO_DRAFT], [KEEP_DRAFT] * K], np.int32)
    masks = np.zeros((2, K + 1, 1), np.int32)
    grammar = np.array([[KEEP_DRAFT, 9, KEEP_DRAFT, KEEP_DRAFT],
                        [KEEP_DRAFT, NO_DRAFT, KEEP_DRAFT, KEEP_DRAFT]], np.int32)
    m, o = merge_overrides((masks, grammar), suffix)
    assert m is masks
    np.testing.assert_array_equal(o, [[5, 9, NO_DRAFT, NO_DRAFT],
                                      [KEEP_DRAFT, NO_DRAFT, KEEP_DRAFT, KEEP_DRAFT]])
    assert merge_overrides(None, suffix)[0] is None
    assert merge_overrides((masks, grammar), None)[1] is grammar
