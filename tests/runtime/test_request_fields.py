"""Request fields honoured as vLLM / OpenAI define them (issue 49): ``logit_bias`` inside the step
(verify and draft rows alike, lossless), 64-bit seeds and ``seed=-1``, ``prompt_logprobs`` from
the target's prefill rows, ``min_tokens`` over stop strings, special-token stop strings and
``skip_special_tokens``.

References are independent of the engine: greedy decoding over the non-paged full forward with
the bias added to its logits; the full forward's log-softmax for prompt logprobs; the fake
runner's known model (``tests/runtime/fake_runner.py``) and a hand-computed text for the host's
stop-string rules."""
from __future__ import annotations

import numpy as np
import pytest

import jmtp
from jmtp import SamplingParams, SpeculativeConfig
from jmtp.model import forward_logits
from jmtp.runtime.device.sampling.rng import seed_keys

import jax
import jax.numpy as jnp

from tests.runtime.conftest import reference_greedy
from tests.runtime.fake_runner import reference
from tests.runtime.test_host_logic import CharTokenizer, drive, find_prompt, make

pytestmark = pytest.mark.xdist_group("request_fields")   # one worker builds the engines once

PROMPTS = [[5, 9, 13, 2, 7, 30, 22], [40, 41, 3]]
LONG_PROMPT = [(7 * i + 3) % 60 + 2 for i in range(21)]      # prefilled in chunks of <= 8 rows


@pytest.fixture(scope="module")
def engines(tiny):
    """A plain and an MTP K=2 engine over the tiny model: 2 slots, a step budget of 8 rows (long
    prompts prefill in chunks), logprobs served."""
    cfg, params = tiny
    kw = dict(model_config=cfg, params=params, max_num_seqs=2, max_model_len=64,
              max_num_batched_tokens=8, max_logprobs=3)
    plain = jmtp.LLM(**kw)
    mtp = jmtp.LLM(speculative_config=SpeculativeConfig("mtp", 2), **kw)
    yield plain, mtp
    plain.close()
    mtp.close()


def biased_greedy(cfg, params, prompt, max_tokens, bias: dict[int, float]) -> list[int]:
    """Greedy decoding over the full forward with ``bias`` added to every step's logits."""
    b = np.zeros((cfg.vocab_size,), np.float32)
    for t, v in bias.items():
        b[t] = v
    ids, out = list(prompt), []
    while len(out) < max_tokens:
        logits = np.asarray(forward_logits(cfg, params, ids + [0] * (-len(ids) % 16)))
        tok = int(np.argmax(logits[len(ids) - 1] + b))
        out.append(tok)
        ids.append(tok)
        if tok in cfg.eos_token_ids:
            break
    return out


def test_logit_bias_is_applied_in_the_step_and_stays_lossless(tiny, engines):
    """-100 on each prompt's greedy first token removes it, +5 on another token pulls it in:
    plain and MTP engines equal the biased reference (and differ from the unbiased one)."""
    cfg, params = tiny
    for prompt in PROMPTS:
        plain_ref = reference_greedy(cfg, params, prompt, 10)
        bias = {plain_ref[0]: -100.0, 17: 5.0, 23: -2.5}
        want = biased_greedy(cfg, params, prompt, 10, bias)
        assert want[0] != plain_ref[0] and want != plain_ref
        for llm in engines:
            out = llm.generate([prompt], SamplingParams(max_tokens=10, logit_bias=bias),
                               use_tqdm=False)[0]
            assert out.outputs[0].token_ids == want
    # sampled rows: a -100 token is never drawn, a +100 token always is (both engines)
    banned = {t: -100.0 for t in range(2, 40)}
    for llm in engines:
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=1.0, seed=3,
                                                    logit_bias=banned, ignore_eos=True),
                            use_tqdm=False)
        for o in outs:
            assert not set(o.outputs[0].token_ids) & set(banned)
        forced = llm.generate(PROMPTS, SamplingParams(max_tokens=6, temperature=1.0, seed=4,
                                                      logit_bias={33: 100.0}), use_tqdm=False)
        assert all(o.outputs[0].token_ids == [33] * 6 for o in forced)


def test_logit_bias_capacity_and_ids_are_checked(engines):
    plain = engines[0]
    with pytest.raises(ValueError, match="logit_bias") as ei:
        plain.generate([PROMPTS[0]], SamplingParams(logit_bias={64: 1.0}), use_tqdm=False)
    assert ei.value.field == "logit_bias"
    too_many = {t: 0.5 for t in range(301)}
    with pytest.raises(ValueError, match="max_logit_bias=300"):
        plain.llm_engine.add_request("x", PROMPTS[0], SamplingParams(logit_bias=too_many))
    assert not plain.llm_engine.has_unfinished_requests()


def test_seeds_are_64_bit_and_minus_one_is_unseeded(engines):
    """vLLM's conventions: ``seed=-1`` = no seed; any int64 seed is reproducible, and its high
    32 bits change the stream (the key folds them in); seeds below 2**32 keep their old key."""
    lo = jnp.asarray([7, 7], jnp.uint32)
    keys = seed_keys(lo, jnp.asarray([0, 1], jnp.uint32))
    assert (jax.random.key_data(keys[0]) == jax.random.key_data(jax.random.key(7))).all()
    assert not (jax.random.key_data(keys[1]) == jax.random.key_data(keys[0])).all()
    plain = engines[0]

    def sample(seed):
        sp = SamplingParams(max_tokens=10, temperature=1.0, seed=seed, ignore_eos=True)
        return plain.generate([PROMPTS[0]], sp, use_tqdm=False)[0].outputs[0].token_ids

    a, b = sample(2**40 + 5), sample(2**40 + 5)
    assert a == b
    assert sample(5) != a and sample(-(2**40) + 5) != a       # only the high bits differ
    assert len(sample(-1)) == 10                                # unseeded: runs
    assert SamplingParams(seed=-1).seed is None


def test_prompt_logprobs_equal_the_full_forward(tiny, engines):
    """vLLM's ``prompt_logprobs``: None for the first prompt token, then the logprob of each
    token and the top-2 of its row, equal to the full forward's log-softmax; over a prompt
    prefilled in chunks, with and without MTP; the generated tokens are unchanged."""
    cfg, params = tiny
    logits = np.asarray(forward_logits(cfg, params, LONG_PROMPT + [0] * 11), np.float64)
    lp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - logits.max(-1, keepdims=True)
    for llm in engines:
        out = llm.generate([LONG_PROMPT], SamplingParams(max_tokens=4, prompt_logprobs=2),
                           use_tqdm=False)[0]
        assert out.outputs[0].token_ids == reference_greedy(cfg, params, LONG_PROMPT, 4)
        plp = out.prompt_logprobs
        assert len(plp) == len(LONG_PROMPT) and plp[0] is None
        for q in range(1, len(LONG_PROMPT)):
            row = lp[q - 1]
            top2 = list(np.argsort(-row, kind="stable")[:2])
            assert set(plp[q]) == set(top2) | {LONG_PROMPT[q]}
            for t, v in plp[q].items():
                assert v == pytest.approx(row[t], abs=2e-4)
        no = llm.generate([LONG_PROMPT], SamplingParams(max_tokens=2), use_tqdm=False)[0]
        assert no.prompt_logprobs is None
    with pytest.raises(ValueError, match="prompt_logprobs=4 exceeds max_logprobs=3"):
        engines[0].generate([PROMPTS[0]], SamplingParams(prompt_logprobs=4), use_tqdm=False)


# ---------------------------------------------------------------- host rules (fake runner)
class SpecialCharTokenizer(CharTokenizer):
    """The fake runner's character tokenizer with its EOS (id 1, text "<eos>") special."""

    @staticmethod
    def special_token_ids():
        return {"<eos>": 1}


TOK = SpecialCharTokenizer()


def _run(sp, prompt):
    engine, runner = make(tokenizer=TOK)
    engine.add_request("r", prompt, sp)
    finals, _ = drive(engine, runner)
    return finals["r"].outputs[0]


def test_min_tokens_holds_back_stop_strings():
    """vLLM: a stop string counts only if it ends in the text of a token after the first
    ``min_tokens``. The stop string is the text of output token 1, which recurs later: with
    min_tokens=3 the output runs to its next occurrence; the text is cut before it."""
    def recurring(p):
        out = reference(p, 24, stop_ids=())
        return 1 not in out and out[1] in out[4:]
    prompt = find_prompt(recurring)
    out_ref = reference(prompt, 24, stop_ids=())
    stop = CharTokenizer.piece(out_ref[1])
    later = out_ref.index(out_ref[1], 4)       # hand-worked: the first occurrence after token 3
    early = _run(SamplingParams(max_tokens=24, stop=stop, ignore_eos=True), prompt)
    assert early.token_ids == out_ref[:2] and early.stop_reason == stop
    held = _run(SamplingParams(max_tokens=24, stop=stop, ignore_eos=True, min_tokens=3), prompt)
    assert held.token_ids == out_ref[:later + 1] and held.stop_reason == stop
    assert held.text == TOK.decode(out_ref[:later])


def test_special_token_stop_string_matches_the_token():
    """A stop string equal to a special token's text ends the output at that token (its text
    is not in the output with skip_special_tokens, vLLM's default); skip_special_tokens=False
    keeps special tokens' text in the output, where the stop string is found as text."""
    from tests.runtime.test_host_logic import EOS_AT, EOS_PROMPT
    out_ref = reference(EOS_PROMPT, 12, stop_ids=())
    out = _run(SamplingParams(max_tokens=12, stop="<eos>", ignore_eos=True), EOS_PROMPT)
    assert out.token_ids == out_ref[:EOS_AT + 1] and out.stop_reason == "<eos>"
    assert out.text == TOK.decode(out_ref[:EOS_AT]) and out.finish_reason == "stop"
    inc = _run(SamplingParams(max_tokens=12, stop="<eos>", ignore_eos=True,
                              include_stop_str_in_output=True), EOS_PROMPT)
    assert inc.text == TOK.decode(out_ref[:EOS_AT]) + "<eos>"
    shown = _run(SamplingParams(max_tokens=12, ignore_eos=True, skip_special_tokens=False),
                 EOS_PROMPT)
    assert shown.token_ids == out_ref and "<eos>" in shown.text
    assert shown.text == TOK.decode(out_ref, skip_special_tokens=False)
    hidden = _run(SamplingParams(max_tokens=12, ignore_eos=True), EOS_PROMPT)
    assert hidden.text == TOK.decode(out_ref) and "<eos>" not in hidden.text
