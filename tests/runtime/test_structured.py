"""Structured outputs: bitmask, grammar roll-back, draft repair and lossless constrained decoding.

References are independent of the engine's path: llguidance's own NumPy mask application for the
bitmask; a fresh matcher fed only the committed tokens for the roll-back; plain (non-paged)
``forward_logits`` with masks applied one token at a time for constrained greedy decoding; the
exact constrained distribution, enumerated over the grammar's finite language from the same
reference logits, for constrained sampling with and without speculation.
"""
from __future__ import annotations

import dataclasses
import functools
import json

import jax.numpy as jnp
import jsonschema
import llguidance.numpy as llg_np
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from jmtp import LLM, SamplingParams, SpeculativeConfig
from jmtp.core.errors import InvalidRequestError
from jmtp.model import forward_logits
from jmtp.runtime.device.bitmask import (KEEP_DRAFT, NO_DRAFT, apply_token_bitmask, override_drafts,
                                         unpack_bitmask)
from jmtp.runtime.host.structured import StructuredOutputsParams as SOP
from jmtp.runtime.host.structured.grammar import unpack_row

from conftest import tiny_model
from structured_fixtures import (SCHEMA, VOCAB_SIZE, compiler, reference_constrained_greedy,
                                 tiny_tokenizer)

pytestmark = pytest.mark.xdist_group("structured_engines")   # one worker builds the shared engines once

V = VOCAB_SIZE


SPECS = {"ngram3": SpeculativeConfig("ngram", 3),
         "hybrid3.1": SpeculativeConfig("mtp", 3, 1, mtp_strategy="with_ngram")}


@functools.lru_cache(maxsize=None)
def engine(k, draft_sampling: bool = False):
    """A tiny engine: ``k`` = 0 (no speculation), K MTP drafts, or a name of :data:`SPECS`."""
    cfg, params = tiny_model(0, vocab_size=V)
    spec = SPECS[k] if isinstance(k, str) else (
        SpeculativeConfig("mtp", k, k, draft_sampling=draft_sampling) if k else None)
    # fp32 everywhere: the references run the fp32 forward (an accelerator's default is bf16)
    return LLM(model_config=cfg, params=params, tokenizer=tiny_tokenizer(),
               speculative_config=spec, max_num_seqs=8, max_model_len=96, block_size=8,
               max_num_batched_tokens=64, dtype=jnp.float32)


# ------------------------------------------------------------------------------ bitmask, override
def test_bitmask_matches_llguidance_numpy_reference():
    rng = np.random.default_rng(0)
    for vocab in (5, 32, 33, 100):
        words = (vocab + 31) // 32
        mask = rng.integers(-2**31, 2**31, size=(3, words), dtype=np.int64).astype(np.int32)
        logits = rng.normal(size=(3, vocab)).astype(np.float32)
        want = logits.copy()
        llg_np.apply_token_bitmask_inplace(want, mask)
        got = np.asarray(apply_token_bitmask(jnp.asarray(logits), jnp.asarray(mask)))
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(np.asarray(unpack_bitmask(jnp.asarray(mask), vocab)),
                                      np.isfinite(want))
        # all ones constrains nothing; a wrong word count is refused at trace time
        np.testing.assert_array_equal(np.asarray(apply_token_bitmask(
            jnp.asarray(logits), jnp.full((3, words), -1, jnp.int32))), logits)
    with pytest.raises(ValueError, match="token_bitmask"):
        apply_token_bitmask(jnp.zeros((2, 40)), jnp.zeros((2, 1), jnp.int32))


def test_override_drafts_by_hand():
    drafts = jnp.array([[7, 10, 11, 12], [8, 20, -1, -1], [9, 30, 31, 32]], jnp.int32)
    q = jnp.full((3, 3, 4), 0.25)
    override = jnp.array([[KEEP_DRAFT, 3, KEEP_DRAFT],          # force position 2
                          [KEEP_DRAFT, 2, 1],                   # extend past the proposer
                          [NO_DRAFT, 0, KEEP_DRAFT]], jnp.int32)  # cut: nothing survives
    # (ids >= 4 do not fit q's toy vocabulary; only forced ids need a one-hot row)
    tokens, probs = override_drafts(drafts, q, override)
    np.testing.assert_array_equal(np.asarray(tokens), [[7, 10, 3, 12], [8, 20, 2, 1],
                                                      [9, -1, -1, -1]])
    probs = np.asarray(probs)
    np.testing.assert_array_equal(probs[0, 1], [0, 0, 0, 1])
    np.testing.assert_array_equal(probs[1, 1], [0, 0, 1, 0])
    np.testing.assert_array_equal(probs[1, 2], [0, 1, 0, 0])
    np.testing.assert_array_equal(probs[0, 0], [0.25] * 4)
    np.testing.assert_array_equal(probs[2], 0.25)   # cut rows keep q (never read)


# ------------------------------------------------------------------------------ params
@pytest.mark.parametrize("kwargs, field", [
    (dict(), "structured_outputs"),
    (dict(json=SCHEMA, regex="a"), "structured_outputs"),
    (dict(json={"type": "objekt"}), "structured_outputs.json"),
    (dict(json="{not json"), "structured_outputs.json"),
    (dict(regex="a(b"), "structured_outputs.regex"),
    (dict(choice=[]), "structured_outputs.choice"),
    (dict(choice="ab"), "structured_outputs.choice"),
    (dict(grammar="  "), "structured_outputs.grammar"),
    (dict(json_object=False, regex=None), "structured_outputs"),
])
def test_bad_params_name_the_field(kwargs, field):
    with pytest.raises(InvalidRequestError) as e:
        SOP(**kwargs)
    assert e.value.field == field


def test_min_tokens_is_refused_with_a_constraint():
    """EOS banned before min_tokens could leave a complete constraint with no token at all."""
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(min_tokens=5, structured_outputs=SOP(choice=["yes"]))
    assert e.value.field == "min_tokens"


def test_ignore_eos_continues_with_eos_only():
    """A complete constraint allows EOS alone, also in the window rows after an EOS draft (with
    ignore_eos the verify rows past an EOS are emitted)."""
    for k in (0, 3):
        out = engine(k).generate(["ab"], SamplingParams(
            max_tokens=12, ignore_eos=True, structured_outputs=SOP(choice=["nabab"])),
            use_tqdm=False)[0].outputs[0]
        ids = out.token_ids
        first_eos = ids.index(1)
        assert tiny_tokenizer().decode(ids[:first_eos]) == "nabab", k
        assert ids[first_eos:] == [1] * (12 - first_eos) and out.finish_reason == "length", k


def test_grammar_errors_fail_at_intake_and_the_engine_goes_on():
    llm = engine(0)
    eng = llm.llm_engine
    bad = [(SOP(grammar="start: foo"), "structured_outputs.grammar"),            # undefined rule
           (SOP(grammar="root ::= [a-"), "structured_outputs.grammar")]
    for params, field in bad:
        with pytest.raises(InvalidRequestError) as e:
            eng.add_request("bad", "x", SamplingParams(structured_outputs=params))
        assert e.value.field == field
        assert not eng.has_unfinished_requests()
    out = llm.generate(["x"], SamplingParams(max_tokens=8, structured_outputs=SOP(
        grammar='root ::= "ab" ("c" | "d")')), use_tqdm=False)[0].outputs[0]
    assert out.text in ("abc", "abd") and out.finish_reason == "stop"


def test_dead_end_finishes_the_sample_with_abort():
    """A constraint no token of the vocabulary can start (non-ASCII, absent from the tiny
    byte-level vocabulary) ends its sample with a clear reason; its batch mate is unaffected."""
    llm = engine(2)
    sp_dead = SamplingParams(max_tokens=8, structured_outputs=SOP(regex="é+"))
    sp_ok = SamplingParams(max_tokens=8, structured_outputs=SOP(choice=["abc"]))
    dead, ok = llm.generate(["x", "y"], [sp_dead, sp_ok], use_tqdm=False)
    assert dead.outputs[0].finish_reason == "abort" and dead.outputs[0].token_ids == []
    assert "dead end" in str(dead.outputs[0].stop_reason)
    assert ok.outputs[0].text == "abc"
    assert not llm.llm_engine.has_unfinished_requests()


# ------------------------------------------------------------------------------ roll-back
def _walk(rng, g, n):
    """n tokens the grammar accepts, chosen at random from its masks (no EOS)."""
    row = np.zeros(g.num_words, np.int32)
    out = []
    m = g.matcher
    for _ in range(n):
        g.fill_mask(row)
        ok = [t for t in np.flatnonzero(unpack_row(row, V)) if t != 1]
        if not ok:
            break
        t = int(rng.choice(ok))
        assert m.consume_token(t)
        out.append(t)
    m.rollback(len(out))
    return out


def _state(g) -> tuple:
    row = np.zeros(g.num_words, np.int32)
    g.fill_mask(row)
    return row.tobytes(), g.matcher.is_accepting(), g.matcher.is_stopped()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31 - 1), prefix=st.integers(0, 12), k=st.integers(1, 4),
       exact=st.booleans(), kind=st.sampled_from(["json", "regex", "grammar"]))
def test_rollback_after_a_mid_window_rejection_equals_feeding_the_accepted_tokens(
        seed, prefix, k, exact, kind):
    params = {"json": SOP(json=SCHEMA), "regex": SOP(regex=r"(ab|ba|n[a-e]+)*c[0-9]{2,4}"),
              "grammar": SOP(grammar='root ::= "[" item ("," item)* "]"\n'
                                     'item ::= [a-c]+ | "true" | "false"')}[kind]
    rng = np.random.default_rng(seed)
    g = compiler().matcher(params)
    committed = _walk(rng, g, prefix)
    g.commit(committed)
    # drafts: a valid continuation with one random token swapped in at a random place
    drafts = _walk(rng, g, k)
    if drafts and rng.random() < 0.6:
        drafts[int(rng.integers(len(drafts)))] = int(rng.integers(2, V))
    masks = np.zeros((k + 1, g.num_words), np.int32)
    before = _state(g)
    override = g.fill_window(masks, drafts, k, exact_q=exact)
    assert _state(g) == before                     # fill_window leaves the state as it was
    # the verified window, as the step sees it, and a rejection after j of its drafts
    window = []
    for w, v in enumerate(override):
        d = v if v >= 0 else (drafts[w] if v == KEEP_DRAFT and w < len(drafts) else None)
        if d is None:
            break
        window.append(int(d))
    ok = 0
    for w, d in enumerate(window):                 # the drafts the masks let through
        if not unpack_row(masks[w], V)[d]:
            break
        ok += 1
    j = int(rng.integers(0, ok + 1))
    allowed_next = np.flatnonzero(unpack_row(masks[j], V))
    allowed_next = allowed_next[allowed_next != 1]
    accepted = window[:j] + ([int(rng.choice(allowed_next))] if len(allowed_next) else [])
    g.commit(accepted)
    fresh = compiler().matcher(params)
    fresh.commit(committed + accepted)
    assert g.error is None and fresh.error is None
    assert _state(g) == _state(fresh)
    # every mask row the window used equals a fresh matcher's after the same prefix (the row
    # after a forced EOS is never used: the window ends at EOS)
    for w in range(ok + 1):
        if w and window[w - 1] == 1:
            break
        f = compiler().matcher(params)
        f.commit(committed + window[:w])
        row = np.zeros(g.num_words, np.int32)
        f.fill_mask(row)
        np.testing.assert_array_equal(masks[w], row)


def test_forced_tokens_become_drafts_and_invalid_drafts_are_repaired():
    g = compiler().matcher(SOP(json=SCHEMA))
    tok = tiny_tokenizer()
    masks = np.zeros((4, g.num_words), np.int32)
    # nothing proposed: the grammar forces '{"name": "'
    override = g.fill_window(masks, [], 3, exact_q=False)
    assert tok.decode([int(t) for t in override]) == '{"name'
    # a greedy slot's invalid draft is cut; a sampled slot's is kept for the verifier
    g.commit(tok.encode('{"name": "ab", "age": '))
    bad = tok.encode("x")[0]
    assert list(g.fill_window(masks, [bad, bad], 3, exact_q=False)) == [NO_DRAFT] * 3
    assert list(g.fill_window(masks, [bad, bad], 3, exact_q=True)) == [KEEP_DRAFT, KEEP_DRAFT,
                                                                        NO_DRAFT]
    assert not unpack_row(masks[0], V)[bad]


# ------------------------------------------------------------------------------ engine
CONSTRAINTS = [SOP(json=SCHEMA), SOP(regex=r"(ab|ba)+c[0-9]{3}"),
               SOP(choice=["false", "true", "nabab"]),
               SOP(grammar='root ::= "[" item ("," item)* "]"\nitem ::= "ab" | "ba" | "c"'),
               SOP(json_object=True)]


@pytest.mark.parametrize("k", [0, 1, 3, "ngram3", "hybrid3.1"])
def test_constrained_greedy_equals_the_masked_reference(k):
    """Every proposer (MTP, n-gram, hybrid) goes through the same mask and draft repair."""
    llm = engine(k)
    prompts = ["ab", "hello", "{x}", "z"]
    tok = tiny_tokenizer()
    for sop in CONSTRAINTS:
        sp = SamplingParams(max_tokens=40, structured_outputs=sop)
        outs = llm.generate(prompts, sp, use_tqdm=False)
        for p, o in zip(prompts, outs):
            ref = reference_constrained_greedy(*tiny_model(0, vocab_size=V), sop, tok.encode(p),
                                               40)
            assert o.outputs[0].token_ids == ref, (sop.kind, p)
            text = o.outputs[0].text
            if sop.json is not None and o.outputs[0].finish_reason == "stop":
                jsonschema.validate(json.loads(text), SCHEMA)
    if k:
        stats = llm.llm_engine.get_stats()
        assert stats["structured_forced_drafts"] > 0
        assert stats["num_accepted_tokens"] > 0


def test_jump_forward_drafts_are_accepted():
    """A schema of long fixed keys: the forced drafts are accepted by construction, so constrained
    speculation commits more tokens per step than the proposer alone could."""
    schema = {"type": "object", "additionalProperties": False,
              "required": ["nameagenameage", "agenameagename"],
              "properties": {"nameagenameage": {"type": "boolean"},
                             "agenameagename": {"type": "boolean"}}}
    llm = engine(3)
    eng = llm.llm_engine
    before = eng.get_stats()
    outs = llm.generate(["ab", "cd"], SamplingParams(max_tokens=40,
                                                     structured_outputs=SOP(json=schema)),
                        use_tqdm=False)
    after = eng.get_stats()
    for o in outs:
        jsonschema.validate(json.loads(o.outputs[0].text), schema)
    forced = after["structured_forced_drafts"] - before["structured_forced_drafts"]
    accepted = after["num_accepted_tokens"] - before["num_accepted_tokens"]
    steps = after["num_decode_steps"] - before["num_decode_steps"]
    tokens = after["num_decode_tokens"] - before["num_decode_tokens"]
    assert forced >= 10 and accepted >= forced * 0.9, (forced, accepted)
    assert tokens / steps > 2.0, (tokens, steps)


# ------------------------------------------------------------------------------ lossless sampling
TV_CONSTRAINTS = {
    "short": SOP(regex=r"(ab|ba|a)(b|c)?"),
    # a forced token in mid-window ("x") replaces a sampled draft while later sampled drafts stay
    "forced_mid": SOP(regex=r"(a|b)x(c|d)(e|f)(g|h)"),
}
TV_PROMPT = "n"


@functools.lru_cache(maxsize=None)
def exact_constrained_distribution(name: str = "short") -> dict[tuple, float]:
    """P(token ids) of constrained sampling at temperature 1 without speculation, enumerated
    over the (finite) language through the plain forward with the masks of the reference."""
    cfg, params = tiny_model(0, vocab_size=V)
    prompt = tiny_tokenizer().encode(TV_PROMPT)
    out = {}
    row = np.zeros(compiler().num_words, np.int32)

    def walk(prefix, prob):
        g = compiler().matcher(TV_CONSTRAINTS[name])
        g.commit(prefix)
        g.fill_mask(row)
        ids = prompt + prefix
        padded = ids + [0] * (-len(ids) % 64)
        logits = np.asarray(forward_logits(cfg, params, padded, block_size=64),
                            np.float64)[len(ids) - 1]
        logits = np.where(unpack_row(row, V), logits, -np.inf)
        p = np.exp(logits - logits.max())
        p /= p.sum()
        for t in np.flatnonzero(p > 0):
            if t == 1:
                out[tuple(prefix + [1])] = prob * p[t]
            else:
                walk(prefix + [int(t)], prob * p[t])

    walk([], 1.0)
    return out


@pytest.mark.parametrize("k, draft_sampling, name", [(0, False, "short"), (2, False, "short"),
                                                     (2, True, "short"),
                                                     (3, True, "forced_mid")])
def test_constrained_sampling_with_speculation_is_lossless(k, draft_sampling, name):
    """Total variation between the engine's empirical distribution of constrained samples and
    the exact one, against the statistical noise of N samples (the same check as the
    speculative-sampling tests in test_verify_distribution.py, at engine level)."""
    truth = exact_constrained_distribution(name)
    assert abs(sum(truth.values()) - 1) < 1e-9 and len(truth) >= 6
    llm = engine(k, draft_sampling)
    N = 1200
    sps = [SamplingParams(max_tokens=8, temperature=1.0, seed=1000 + i,
                          structured_outputs=TV_CONSTRAINTS[name]) for i in range(N)]
    outs = llm.generate([TV_PROMPT] * N, sps, use_tqdm=False)
    counts = {}
    for o in outs:
        key = tuple(o.outputs[0].token_ids)
        counts[key] = counts.get(key, 0) + 1
    assert set(counts) <= set(truth), set(counts) - set(truth)
    p = np.array(list(truth.values()))
    emp = np.array([counts.get(key, 0) / N for key in truth])
    tv = 0.5 * float(np.abs(emp - p).sum())
    expected = 0.5 * float(np.sum(np.sqrt(2 * p * (1 - p) / (np.pi * N))))
    assert tv < 2.5 * expected, (tv, expected)


def test_preempted_constrained_requests_resume_their_grammar():
    """Out of KV blocks, the newest constrained request is preempted, recomputed and resumed: its
    grammar state (kept on the host) continues where it stopped, so every output still equals
    the masked reference and validates."""
    cfg, params = tiny_model(0, vocab_size=V)
    llm = LLM(model_config=cfg, params=params, tokenizer=tiny_tokenizer(),
              speculative_config=SpeculativeConfig("mtp", 3, 3), max_num_seqs=4,
              max_model_len=64, block_size=4, num_blocks=24, max_num_batched_tokens=32,
              dtype=jnp.float32)
    tok = tiny_tokenizer()
    prompts = ["ab", "hello", "{x}", "z"]
    sop = SOP(json=SCHEMA)
    outs = llm.generate(prompts, SamplingParams(max_tokens=40, structured_outputs=sop),
                        use_tqdm=False)
    assert llm.llm_engine.get_stats()["num_preemptions"] > 0
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == reference_constrained_greedy(
            cfg, params, sop, tok.encode(p), 40), p


class _ForcedIntoDeadEnd:
    """A matcher double: tokens {5, 6} are allowed first and 5 is forced (fast-forward), but
    after 5 nothing is allowed (a dead end); after anything else everything is."""

    def __init__(self, toks=()):
        self.toks = list(toks)

    def deep_copy(self):
        return _ForcedIntoDeadEnd(self.toks)

    def is_error(self):
        return False

    def stop_reason(self):
        return "NoExtension"

    def compute_ff_tokens(self):
        return [5] if not self.toks else []

    def consume_token(self, t):
        self.toks.append(t)
        return True

    def unsafe_compute_mask_ptr(self, ptr, nbytes):
        import ctypes
        arr = np.ctypeslib.as_array((ctypes.c_int32 * (nbytes // 4)).from_address(ptr))
        arr[:] = 0
        if not self.toks:
            arr[0] = (1 << 5) | (1 << 6)
        elif self.toks != [5]:
            arr[:] = -1


def test_forced_draft_into_a_dead_end_is_cut_not_swapped_back():
    """Sampled drafts (exact q): the forced token 5 replaces the draft, leads into a dead end, is
    forbidden and cut; the proposer's draft 6 must not come back in its place with an unmasked
    row after it (review of issue 37). A greedy slot keeps its valid draft 6 instead."""
    from jmtp.runtime.host.structured.grammar import SequenceGrammar
    g = SequenceGrammar(_ForcedIntoDeadEnd(), 2, {1})
    masks = np.zeros((4, 2), np.int32)
    override = g.fill_window(masks, [6, 7, 8], 3, exact_q=True)
    assert list(override) == [NO_DRAFT] * 3
    assert list(np.flatnonzero(unpack_row(masks[0], 64))) == [6]
    override = g.fill_window(masks, [6, 7, 8], 3, exact_q=False)
    assert list(override) == [KEEP_DRAFT] * 3


def test_banned_tokens_that_empty_the_constraint_end_the_sample_cleanly():
    """bad_token_ids removing every token the constraint allows: a dead end found on the host
    (no arbitrary token from an all -inf row), with the reason."""
    ban = tiny_tokenizer().encode("x")
    out = engine(2).generate(["ab"], SamplingParams(
        max_tokens=8, bad_token_ids=ban, structured_outputs=SOP(choice=["x"])),
        use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [] and out.finish_reason == "abort"
    assert "dead end" in str(out.stop_reason)
    ok = engine(2).generate(["ab"], SamplingParams(
        max_tokens=8, bad_token_ids=ban, structured_outputs=SOP(choice=["x", "yz"])),
        use_tqdm=False)[0].outputs[0]
    assert ok.text == "yz"


# ------------------------------------------------------------------------------ a broken constraint
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**16), prefix=st.integers(0, 6), bad_at=st.integers(0, 4))
def test_commit_accepts_exactly_the_prefix_the_grammar_allows(seed, prefix, bad_at):
    """``SequenceGrammar.commit`` returns how many tokens, from the first, the grammar accepts;
    at a refused token it stops (error set) with the state of the accepted prefix, and accepts
    nothing after it. After a complete constraint only EOS is accepted."""
    rng = np.random.default_rng(seed)
    g = compiler().matcher(SOP(json=SCHEMA))
    walk = _walk(rng, g, prefix + bad_at)
    ok, rest = walk[:prefix], walk[prefix:]
    ref = compiler().matcher(SOP(json=SCHEMA))
    ref.commit(ok)
    row = np.zeros(g.num_words, np.int32)
    ref.fill_mask(row)
    refused = [t for t in range(V) if not unpack_row(row, V)[t]]
    bad = int(rng.choice(refused))
    assert g.commit(ok + [bad] + rest) == len(ok)
    assert g.error is not None and "outside the constraint" in g.error
    assert _state(g) == _state(ref)
    assert g.commit(rest) == 0
    done = compiler().matcher(SOP(choice=["ab"]))
    ids = tiny_tokenizer().encode("ab")
    assert done.commit(ids + [1, 1, 2]) == len(ids) + 2 and "complete" in done.error


@pytest.mark.parametrize("penalty", [1e-45, 3e38])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_extreme_penalties_keep_the_constraint(penalty, temperature):
    """A repetition penalty the CPU flushes to 0 turned a masked (-inf) logit seen in the prompt
    into NaN (``-inf * 0``), which argmax and sampling then picked: the step emitted a token
    outside the constraint (found by the engine's check, "token 2 broke the constraint"). One
    large enough to overflow must not leave a row with no finite logit either."""
    out = engine("ngram3").generate(["zzqqxx yes no"], SamplingParams(
        max_tokens=8, temperature=temperature, seed=3, repetition_penalty=penalty,
        structured_outputs=SOP(choice=["yes", "no"])), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.text in ("yes", "no"), (out.text, out.stop_reason)


def test_a_token_outside_the_constraint_is_never_emitted(caplog):
    """If a step ever returns a token the grammar refuses (injected here into an accepted
    window), the engine emits only the tokens before it and ends that sample with
    finish_reason="abort" and the reason, logged; before, the token was recorded and the sample
    finished as a normal "stop" (the soak's "token X broke the constraint")."""
    llm = engine(3)
    eng = llm.llm_engine
    tok = tiny_tokenizer()
    bad = tok.encode("z")[0]
    run_step = eng.runner.run_step

    def faulty(*args, **kwargs):
        out = run_step(*args, **kwargs)
        for b, seq in enumerate(eng.scheduler.slots):
            if (seq is not None and seq.group.prompt == "ab" and seq.output_ids
                    and int(out.num_tokens[b]) >= 2):
                tokens = np.array(out.tokens)
                tokens[b, 1] = bad
                return dataclasses.replace(out, tokens=tokens)
        return out

    eng.runner.run_step = faulty
    try:
        with caplog.at_level("ERROR", logger="jmtp"):
            broken, mate = llm.generate(["ab", "cd"], [
                SamplingParams(max_tokens=12, structured_outputs=SOP(choice=["abcabc"])),
                SamplingParams(max_tokens=12, structured_outputs=SOP(choice=["nabab"]))],
                use_tqdm=False)
    finally:
        del eng.runner.run_step
    c = broken.outputs[0]
    assert c.finish_reason == "abort" and "outside the constraint" in str(c.stop_reason)
    assert bad not in c.token_ids and "abcabc".startswith(c.text) and c.text, c.text
    assert any("outside the constraint" in r.getMessage() for r in caplog.records)
    assert mate.outputs[0].text == "nabab" and mate.outputs[0].finish_reason == "stop"
    assert not eng.has_unfinished_requests()
