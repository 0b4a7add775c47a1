"""LLMEngine: requests added while it runs, abort, stop strings, streaming deltas, n, chat,
seeded requests that survive preemption."""
from __future__ import annotations

import jax
import pytest

from jmtp import CompletionOutput, LLMEngine
from jmtp.runtime.config import SpeculativeConfig
from jmtp.runtime.host.llm import LLM, SamplingParams
from tests.engines import GROUPS, tiny_engine
from tests.runtime.conftest import reference_greedy, tiny_model, engine_of
from tests.runtime.test_engine_edges import K, MAX_LEN, oracle_drafter

# outputs, not buckets: each engine runs its steps in the fewest step programs (conftest.py)

PROMPTS = [[5, 6, 7], [3], list(range(2, 30)), [9] * 11]


class ToyTokenizer:
    """Token t decodes to two letters (``TOY[t]``); enough to place stop strings across tokens."""

    def __init__(self, vocab_size):
        self.vocab = [chr(65 + t % 26) + chr(97 + t // 26) for t in range(vocab_size)]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.vocab[int(t)] for t in ids)

    def encode(self, text):
        return [self.vocab.index(text[i:i + 2]) for i in range(0, len(text), 2)]


def _engine(spec=None, **kw):
    cfg, params = tiny_model(0)
    kw.setdefault("max_num_seqs", 4)
    kw.setdefault("max_num_batched_tokens", 32)
    return LLMEngine(model_config=cfg, params=params, speculative_config=spec,
                     max_model_len=MAX_LEN, block_size=4, **kw)


def _drain(engine, outs=None):
    """Step until idle; returns {request_id: [RequestOutput, ...]} in arrival order."""
    outs = {} if outs is None else outs
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    return outs


@GROUPS["plain"]        # the canonical 3-slot MTP K=2 shape (tests/engines.py), compiled once
def test_requests_added_between_steps_equal_offline_greedy():
    cfg, params = tiny_model(0)
    refs = [reference_greedy(cfg, params, p, 12) for p in PROMPTS]
    engine = tiny_engine("mtp2_3slots")    # 3 slots: "c" joins the running batch, "d" waits
    sp = SamplingParams(max_tokens=12)
    outs: dict = {}
    engine.add_request("a", PROMPTS[0], sp)
    engine.add_request("b", PROMPTS[1], sp)
    for _ in range(3):
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    assert engine.get_stats()["num_running"] == 2
    engine.add_request("c", PROMPTS[2], sp)          # joins the running batch
    for o in engine.step():
        outs.setdefault(o.request_id, []).append(o)
    engine.add_request("d", PROMPTS[3], sp)
    _drain(engine, outs)
    for rid, ref in zip("abcd", refs):
        seq = outs[rid]
        assert seq[-1].finished and not any(o.finished for o in seq[:-1])
        assert seq[-1].token_ids == ref
        # deltas are exactly the new tokens of each output
        assert sum((o.outputs[0].delta_token_ids for o in seq), []) == ref
        assert all(o.outputs[0].delta_token_ids for o in seq)
    st = engine.get_stats()
    assert st["num_free_blocks"] == st["num_blocks"] and st["num_unfinished_requests"] == 0
    assert st["num_decode_steps"] > 0 and len(st["accepted_per_position"]) == 2


def test_abort_frees_blocks_waiting_prefilling_decoding():
    # The synchronous loop: the block counts below are read between steps, and with a step in
    # flight (async scheduling) they lag it by a step whose timing varies (the async loop's aborts
    # are covered by test_async_scheduling's random-abort property test).
    engine = _engine(SpeculativeConfig("mtp", 2, 2), max_num_seqs=2, max_num_batched_tokens=8,
                     async_scheduling=False)
    n_blocks = engine.engine_config.num_blocks
    sp = SamplingParams(max_tokens=40, ignore_eos=True)
    engine.add_request("dec", [5, 6, 7], sp)
    engine.add_request("pre", list(range(2, 50)), sp)  # 48-token prompt, 8-token step budget
    engine.add_request("wait", [3, 4], sp)              # no slot free: waits
    for _ in range(3):
        engine.step()
    st = engine.get_stats()
    assert st["num_running"] == 2 and st["num_waiting"] == 1
    assert engine_of(engine).scheduler.slots[0].output_ids and not engine_of(engine).scheduler.slots[1].output_ids  # decoding / prefilling
    used = n_blocks - st["num_free_blocks"]
    assert used > 0
    engine.abort_request("wait")
    assert engine.get_stats()["num_waiting"] == 0
    engine.abort_request("pre")
    mid = engine.get_stats()["num_free_blocks"]
    assert n_blocks - used < mid < n_blocks             # the prefilling request's blocks came back
    engine.abort_request(["dec", "unknown"])            # unknown ids are ignored
    st = engine.get_stats()
    assert st["num_free_blocks"] == n_blocks == int(engine.runner.state.free_count)
    assert not engine.has_unfinished_requests() and engine.step() == []
    # the engine keeps serving after aborts, and a reused id is fine once the old one is gone
    engine.add_request("dec", [5, 6, 7], SamplingParams(max_tokens=5))
    out = _drain(engine)["dec"][-1]
    cfg, params = tiny_model(0)
    assert out.token_ids == reference_greedy(cfg, params, [5, 6, 7], 5)
    assert engine.get_stats()["num_free_blocks"] == n_blocks


def test_add_request_validates_early():
    engine = _engine()
    calls = []
    engine_of(engine).runner.jitted_step = lambda *a: calls.append(a)
    engine.add_request("x", [3, 4])
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("x", [3, 4])
    with pytest.raises(TypeError, match="request_id"):
        engine.add_request(7, [3, 4])
    with pytest.raises(TypeError, match="sampling_params"):
        engine.add_request("y", [3, 4], {"max_tokens": 3})
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("y", [])
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request("y", [3] * MAX_LEN)
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        engine.add_request("y", [3], SamplingParams(stop=["a"]))
    with pytest.raises(ValueError, match="string prompt"):
        engine.add_request("y", "hello")
    assert engine.get_num_unfinished_requests() == 1 and not calls
    engine.abort_request("x")
    assert not engine.has_unfinished_requests()


def _oracle_setup(n_tokens=16):
    cfg, params = tiny_model(0)
    prompt = [5, 6, 7]
    ref = reference_greedy(cfg, params, prompt, n_tokens, stop_ids=())
    drafter = oracle_drafter([prompt + ref], MAX_LEN + K + 1, 2)
    llm = LLM(model_config=cfg, params=params, tokenizer=ToyTokenizer(cfg.vocab_size),
              speculative_config=SpeculativeConfig("custom", K, drafter=drafter), max_num_seqs=2,
              max_model_len=MAX_LEN, block_size=4, max_num_batched_tokens=16)
    return llm, prompt, ref


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_inside_accepted_block_is_cut_exactly(include):
    llm, prompt, ref = _oracle_setup()
    toy = llm.tokenizer
    full = toy.decode(ref)
    # a stop string from the middle of token 6 to the end of token 7: the oracle's windows emit
    # token 0 (prefill), then tokens 1-4 and 5-8 in one step each, so it completes inside a block
    stop = full[13:16]
    j = full.find(stop)
    last = next(m for m in range(1, len(ref) + 1) if stop in toy.decode(ref[:m]))
    assert 5 <= last - 1 < 8, "the stop must complete strictly inside the second block"
    engine = llm.llm_engine
    engine.add_request("s", prompt, SamplingParams(max_tokens=16, ignore_eos=True, stop=[stop, "zz"],
                                                   include_stop_str_in_output=include))
    outs = _drain(engine)["s"]
    o = outs[-1].outputs[0]
    assert o.finish_reason == "stop" and o.stop_reason == stop
    assert o.token_ids == ref[:last]                    # nothing after the completing token
    assert o.text == (full[:j + len(stop)] if include else full[:j])
    assert "".join(x.outputs[0].delta_text for x in outs) == o.text
    assert sum((x.outputs[0].delta_token_ids for x in outs), []) == o.token_ids
    assert outs[-1].metrics.num_decode_tokens == last - 1   # tokens after the cut not counted
    assert max(len(x.outputs[0].delta_token_ids) for x in outs) > 1   # several tokens per step
    st = engine.get_stats()
    assert st["num_free_blocks"] == st["num_blocks"]


def test_stop_strings_through_generate_and_streaming_holdback():
    llm, prompt, ref = _oracle_setup()
    toy = llm.tokenizer
    full = toy.decode(ref)
    stop = full[20:24]
    j = full.find(stop)
    [out] = llm.generate([prompt], SamplingParams(max_tokens=16, ignore_eos=True, stop=stop),
                         use_tqdm=False)
    assert out.text == full[:j] and out.finish_reason == "stop" and out.stop_reason == stop
    # No stop in the text: the whole output, finish "length"
    [out] = llm.generate([prompt], SamplingParams(max_tokens=16, ignore_eos=True, stop="@@"),
                         use_tqdm=False)
    assert out.text == full and out.finish_reason == "length" and out.stop_reason is None


@GROUPS["plain"]
def test_n_samples_independent_and_reproducible():
    engine = tiny_engine("mtp2_3slots")
    sp = SamplingParams(max_tokens=16, temperature=1.0, seed=7, n=3, ignore_eos=True)
    engine.add_request("n", [5, 6, 7], sp)
    o1 = _drain(engine)["n"][-1]
    engine.add_request("n", [5, 6, 7], sp)
    o2 = _drain(engine)["n"][-1]
    engine.add_request("one", [5, 6, 7], SamplingParams(max_tokens=16, temperature=1.0, seed=7,
                                                         ignore_eos=True))
    single = _drain(engine)["one"][-1]
    assert [c.index for c in o1.outputs] == [0, 1, 2]
    assert all(isinstance(c, CompletionOutput) and len(c.token_ids) == 16 for c in o1.outputs)
    toks = [c.token_ids for c in o1.outputs]
    assert toks[0] != toks[1] and toks[1] != toks[2] and toks[0] != toks[2]
    assert toks == [c.token_ids for c in o2.outputs]          # same seed: same samples
    assert toks[0] == single.token_ids                        # sample 0 uses the seed itself
    # greedy n > 1: every sample is the greedy output
    engine.add_request("g", [5, 6, 7], SamplingParams(max_tokens=8, n=2))
    g = _drain(engine)["g"][-1]
    cfg, params = tiny_model(0)
    assert [c.token_ids for c in g.outputs] == [reference_greedy(cfg, params, [5, 6, 7], 8)] * 2
    st = engine.get_stats()
    assert st["num_free_blocks"] == st["num_blocks"]


@GROUPS["plain"]
def test_top_k_minus_one_equals_off():
    engine = tiny_engine("plain")
    outs = []
    for k in (-1, 0, 5):
        engine.add_request(f"k{k}", [5, 6, 7], SamplingParams(max_tokens=12, temperature=1.5,
                                                              top_k=k, seed=3, ignore_eos=True))
        outs.append(_drain(engine)[f"k{k}"][-1].token_ids)
    assert outs[0] == outs[1]
    assert outs[0] != outs[2]   # top_k=5 really filters (a check that k matters at all)


@pytest.mark.xdist_group("llm_engine_preemption")  # both temperatures on one worker: one compile
@pytest.mark.parametrize("spec", [None, SpeculativeConfig("mtp", 2, 2)], ids=["plain", "mtp2"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_seeded_request_survives_preemption(spec, temperature, kept_engines):
    cfg, params = tiny_model(0)
    prompts = [[5, 6, 7, 8, 9], [3, 4], [10] * 9, [20, 21, 22]]
    sp = SamplingParams(max_tokens=24, ignore_eos=True, temperature=temperature, seed=7)

    def run(num_blocks):
        llm = LLM(model_config=cfg, params=params, speculative_config=spec, max_num_seqs=4,
                  max_model_len=MAX_LEN, block_size=4, num_blocks=num_blocks,
                  max_num_batched_tokens=32)
        kept_engines.append(llm)    # a fresh engine; the other temperature's runs its buckets
        outs = llm.generate(prompts, sp, use_tqdm=False)
        st = llm.llm_engine.get_stats()
        assert st["num_free_blocks"] == st["num_blocks"]
        return [o.token_ids for o in outs], st["num_preemptions"]

    ample, n_ample = run(None)
    tight, n_tight = run(11 if spec is None else 12)
    assert n_ample == 0 and n_tight > 0, "the block budget was meant to force a preemption"
    assert tight == ample
    if temperature == 0.0:
        assert ample == [reference_greedy(cfg, params, p, 24, stop_ids=()) for p in prompts]


def test_chat_equals_generate_on_templated_prompt(smollm2_tokenizer, hf_smollm2_tokenizer):
    tok = smollm2_tokenizer
    cfg, params = tiny_model(0, vocab_size=tok.vocab_size)
    llm = LLM(model_config=cfg, params=params, tokenizer=tok, max_num_seqs=2, max_model_len=128,
              block_size=8, max_num_batched_tokens=64)
    conv = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "What is 2+2? 你好 🦀"}]
    conv2 = [{"role": "user", "content": "Hi"}]
    sp = SamplingParams(max_tokens=6)
    chat = llm.chat([conv, conv2], sp, use_tqdm=False)
    # the independent reference: transformers' own chat template rendering + tokenization
    want = [hf_smollm2_tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=True)
            for c in (conv, conv2)]
    want = [list(w["input_ids"]) if isinstance(w, dict) or hasattr(w, "keys") else list(w)
            for w in want]
    assert [o.prompt_token_ids for o in chat] == want
    gen = llm.generate(want, sp, use_tqdm=False)
    assert [o.token_ids for o in chat] == [o.token_ids for o in gen]
    assert [o.text for o in chat] == [tok.decode(o.token_ids) for o in gen]
    assert llm.chat(conv, sp, use_tqdm=False)[0].token_ids == chat[0].token_ids


@pytest.mark.parametrize("loop", ["scan", "unrolled"])
def test_each_layer_loop_decodes_like_the_reference(loop):
    """``layer_loop="scan"`` (stacked weights under one ``lax.scan``) and ``"unrolled"``
    (per-layer weights, a Python loop over the layers) both give the non-paged reference's greedy
    tokens, plain and with MTP K=2; bad values are refused early."""
    cfg, params = tiny_model(0)
    prompt = [5, 9, 2, 7, 11]
    ref = reference_greedy(cfg, params, prompt, 10, stop_ids=())
    for spec in (None, SpeculativeConfig("mtp", 2)):
        llm = LLM(model_config=cfg, params=params, speculative_config=spec, max_num_seqs=2,
                  max_model_len=MAX_LEN, block_size=4, layer_loop=loop)
        assert llm.llm_engine.layer_loop == loop
        paths = [jax.tree_util.keystr(p) for p, _ in
                 jax.tree_util.tree_leaves_with_path(llm.llm_engine.runner.params)]
        per_layer = "['layers']['layers'][1]['attn']['wq'].value" in paths
        assert per_layer == (loop == "unrolled")
        out = llm.generate([prompt], SamplingParams(max_tokens=10, ignore_eos=True),
                           use_tqdm=False)[0]
        assert out.token_ids == ref
    with pytest.raises(ValueError, match="layer_loop"):
        LLM(model_config=cfg, params=params, layer_loop="unroll")


def test_auto_layer_loop_is_unrolled_on_one_cpu_device_else_scan():
    """``layer_loop="auto"`` (the default): unrolled on XLA:CPU without a mesh (the scan copies
    each layer's weights there), scan with a mesh (unrolled does not support one) and on TPU /
    GPU; explicit values are kept."""
    from jmtp.runtime.host.engine_args import resolve_layer_loop
    assert resolve_layer_loop("auto", True, "cpu") == "unrolled"
    assert resolve_layer_loop("auto", False, "cpu") == "scan"
    assert resolve_layer_loop("auto", True, "tpu") == "scan"
    assert resolve_layer_loop("auto", True, "gpu") == "scan"
    assert resolve_layer_loop("scan", True, "cpu") == "scan"
    assert resolve_layer_loop("unrolled", True, "tpu") == "unrolled"
    cfg, params = tiny_model(0)
    llm = LLM(model_config=cfg, params=params, max_num_seqs=2, max_model_len=MAX_LEN,
              block_size=4)
    assert llm.llm_engine.layer_loop == ("unrolled" if jax.default_backend() == "cpu" else "scan")
