"""The engine on a hybrid gated-DeltaNet target (tiny random Qwen3-Next with an ``mtp.*`` layer,
loaded from a transformers checkpoint): greedy output with MTP speculation at K = 1, 2, 3 equals
transformers' greedy decoding, with chunked prefill and forced preemptions; an oracle drafter that
is right up to a chosen position rejects in the middle of windows, every position of the window
in turn; seeded sampling with ``target_match`` verification reproduces plain seeded sampling;
the prefill → decode hand-off carries the recurrent state; its bytes are reported."""
from __future__ import annotations

import functools
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from jmtp.model.checkpoints.hf_loader import load_hf
from jmtp.runtime.config import SpeculativeConfig
from jmtp.runtime.host.llm import LLM, SamplingParams

torch = pytest.importorskip("torch")
torch.set_num_threads(1)
pytest.importorskip("transformers")
from tests.model import hybrid_fixtures as hx  # noqa: E402

pytestmark = pytest.mark.xdist_group("hybrid_engine")   # one worker builds the shared engines once

PROMPTS = [[5, 6, 7], list(range(2, 40)), [9, 10] * 8, [11, 12, 13, 14, 15, 16]]
MAX_TOKENS = 14
ARGS = dict(max_num_seqs=3, max_model_len=64, block_size=4, max_num_batched_tokens=12,
            num_blocks=16, dtype="float32")


@functools.lru_cache(maxsize=None)
def _model(tmp: str):
    model = hx.hf_model("qwen3_next")
    path = hx.save_checkpoint(model, Path(tmp) / "qwen3_next", hx.mtp_tensors(model))
    cfg, params = load_hf(path, jnp.float32)
    refs = []
    for p in PROMPTS:        # transformers' greedy decoding: the independent reference
        ids, out = list(p), []
        with torch.no_grad():
            for _ in range(MAX_TOKENS):
                tok = int(model(torch.tensor([ids])).logits[0, -1].argmax())
                out.append(tok)
                ids.append(tok)
        refs.append(out)
    return cfg, params, refs


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    return _model(str(tmp_path_factory.mktemp("hybrid_engine")))


@functools.lru_cache(maxsize=None)
def _llm(cfg, params_id, spec):
    return LLM(model_config=cfg, params=_PARAMS[params_id], speculative_config=spec, **ARGS)


_PARAMS: dict = {}


def llm(hybrid, spec=None):
    cfg, params, _ = hybrid
    _PARAMS[id(params)] = params
    return _llm(cfg, id(params), spec)


GREEDY = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_mtp_greedy_equals_transformers(hybrid, k):
    """MTP at K = 1, 2, 3: transformers' greedy tokens, with a 38-token prompt prefilled in
    chunks of at most 12 and preemptions (16 blocks for 3 slots); every block is free after."""
    eng = llm(hybrid, SpeculativeConfig("mtp", k, k))
    outs = eng.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == hybrid[2]
    stats = eng.llm_engine.get_stats()
    assert stats["num_preemptions"] > 0 and stats["num_draft_tokens"] > 0
    assert stats["num_free_blocks"] == ARGS["num_blocks"]


def oracle_with_a_wrong_draft(refs: list[list[int]], k: int, short: bool = False):
    """A custom drafter that drafts the reference continuation of the slot's request (found by its
    first prompt token) but replaces draft ``(seq_len mod (K+1))`` by a wrong token: windows are
    accepted up to a position that moves along the window, then rejected. With ``short`` it also
    drafts only ``(7·seq_len + 1) mod (K+1)`` tokens (-1 after them): windows of 1..K+1 rows."""
    width = 128
    table = np.full((256, width), 0, np.int32)
    for p, r in zip(PROMPTS, refs):
        seq = p + r
        table[p[0], :len(seq)] = seq
    table = jnp.asarray(table)

    def drafter(state):
        seq_len = state.prompt_lens + state.step_idx
        idx = jnp.clip(seq_len[:, None] + jnp.arange(k)[None], 0, width - 1)
        d = jnp.take_along_axis(table[state.input_ids[:, 0]], idx, axis=1)
        wrong = (seq_len % (k + 1))[:, None] == jnp.arange(k)[None]
        d = jnp.where(wrong, (d + 1) % hx.V, d)
        if short:
            n = (seq_len * 7 + 1) % (k + 1)
            d = jnp.where(jnp.arange(k)[None] < n[:, None], d, -1)
        return d

    return drafter


def test_rejections_in_the_middle_of_windows(hybrid):
    """Drafts right up to a moving position then wrong: every position accepts sometimes and
    some windows are cut after 1 and 2 accepted drafts; greedy output is still transformers'."""
    k = 3
    spec = SpeculativeConfig("custom", k, drafter=oracle_with_a_wrong_draft(hybrid[2], k))
    eng = llm(hybrid, spec)
    outs = eng.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == hybrid[2]
    stats = eng.llm_engine.get_stats()
    per_pos = stats["accepted_per_position"]
    assert per_pos[0] > per_pos[1] > per_pos[2] > 0      # windows cut after 1 and after 2 drafts
    assert 0 < stats["num_accepted_tokens"] < stats["num_draft_tokens"]


def test_short_windows_under_the_dynamic_policy(hybrid):
    """Windows of every length 1..K+1 (drafts cut by the drafter, and the dynamic policy's own
    limits): the checkpoint each slot continues from depends on the window's length; greedy output
    is still transformers'."""
    k = 3
    spec = SpeculativeConfig("custom", k, drafter=oracle_with_a_wrong_draft(hybrid[2], k, True),
                             speculation_policy="dynamic")
    eng = llm(hybrid, spec)
    assert [o.token_ids for o in eng.generate(PROMPTS, GREEDY, use_tqdm=False)] == hybrid[2]
    assert eng.llm_engine.get_stats()["num_accepted_tokens"] > 0


def test_seeded_sampling_with_target_match_equals_plain(hybrid):
    """Seeded sampled requests: MTP K=2 with ``target_match`` verification gives plain decoding's
    seeded tokens exactly (each window row is sampled from the target with the plain stream)."""
    sp = [SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, top_p=0.9, seed=s,
                         ignore_eos=True) for s in range(len(PROMPTS))]
    plain = llm(hybrid).generate(PROMPTS, sp, use_tqdm=False)
    tm = llm(hybrid, SpeculativeConfig("mtp", 2, 2, verify_strategy="target_match"))
    assert ([o.token_ids for o in tm.generate(PROMPTS, sp, use_tqdm=False)]
            == [o.token_ids for o in plain])


def test_state_pool_bytes_reported(hybrid):
    """``kv_cache_bytes()["linear_state"]``: per linear layer, slot and checkpoint, the
    convolution state (Kc-1 inputs of conv_dim channels, fp32 here) and the fp32 delta-rule
    state, plus the slots' current checkpoint."""
    cfg = hybrid[0]
    eng = llm(hybrid, SpeculativeConfig("mtp", 2, 2))
    lc, n = cfg.linear, len(cfg.linear_layers)
    per = (lc.conv_kernel_dim - 1) * lc.conv_dim * 4 + lc.num_value_heads * lc.key_head_dim * (
        lc.value_head_dim * 4)
    want = n * ARGS["max_num_seqs"] * 3 * per + ARGS["max_num_seqs"] * 4
    got = eng.llm_engine.kv_cache_bytes()
    assert got["linear_state"] == want and got["total"] >= want + got["values"]
    # the paged cache covers the full-attention layers only; the layers run unrolled
    assert eng.llm_engine.runner.cache.k.shape[0] == len(cfg.kv_layers) == 2
    assert eng.llm_engine.layer_loop == "unrolled"


def test_unsupported_options_refused(hybrid):
    cfg, params, _ = hybrid
    with pytest.raises(ValueError, match="max_cached_states"):
        LLM(model_config=cfg, params=params, **{**ARGS, "enable_prefix_caching": True,
                                                "max_cached_states": -1})


def _wire(states):
    from jmtp.runtime.host.handoff import RequestState
    return [RequestState.from_bytes(s.to_bytes()) for s in states]


# K=1's path is K=3's with fewer drafts (and runs across meshes in test_sharding.py)
@pytest.mark.parametrize("k", [2, 3])
def test_handoff_carries_the_recurrent_state(hybrid, k):
    """A request prefilled on one engine and decoded on another (K = 2: an engine of 1 slot and
    other KV blocks; K = 3: the same engine, through bytes either way) gives transformers'
    greedy tokens and the one-engine acceptance counts; the state carries every linear layer's
    convolution and delta-rule state at the slot's checkpoint."""
    cfg = hybrid[0]
    a = llm(hybrid, SpeculativeConfig("mtp", k, k))
    b = (LLM(model_config=cfg, params=hybrid[1], speculative_config=SpeculativeConfig("mtp", 2, 2),
             **{**ARGS, "max_num_seqs": 1, "num_blocks": 20}) if k == 2 else a)
    ref = a.generate(PROMPTS, GREEDY, use_tqdm=False)
    states = a.prefill(PROMPTS, GREEDY)
    lc, n = cfg.linear, len(cfg.linear_layers)
    for st in states:
        assert st.kv["linear_recurrent"].shape == (n, lc.num_value_heads, lc.key_head_dim,
                                                   lc.value_head_dim)
        assert st.kv["linear_conv"].shape == (n, lc.conv_kernel_dim - 1, lc.conv_dim)
        assert int(st.kv["linear_current"]) == k      # a prefill continues from checkpoint K
        assert st.nbytes()["linear_state"] > 0
    outs = b.import_request(_wire(states), use_tqdm=False)
    assert [o.token_ids for o in outs] == hybrid[2] == [r.token_ids for r in ref]
    assert ([o.metrics.accepted_per_position for o in outs]
            == [r.metrics.accepted_per_position for r in ref])


def test_handoff_refuses_a_mismatched_state_layout(hybrid):
    """The fingerprint covers the state layout: a state whose layout differs (here: another
    number of checkpoints per slot, as a K-mismatched engine writes) is refused naming
    ``kv.linear_state``; a state whose arrays do not match the layout its fingerprint states is
    refused naming the array."""
    import copy

    from jmtp.runtime.host.handoff import fingerprint_hash
    a = llm(hybrid, SpeculativeConfig("mtp", 2, 2))
    (st,) = a.prefill(PROMPTS[:1], GREEDY)
    bad = copy.deepcopy(st)
    bad.compat["kv"]["linear_state"]["checkpoints"] = 5
    bad.fingerprint = fingerprint_hash(bad.compat)
    with pytest.raises(ValueError, match=r"kv\.linear_state\.checkpoints"):
        a.llm_engine.import_request(bad, "x1")
    bad = copy.deepcopy(st)
    bad.kv["linear_recurrent"] = bad.kv["linear_recurrent"][:, :1]
    with pytest.raises(ValueError, match=r"kv\['linear_recurrent'\]"):
        a.llm_engine.import_request(bad, "x2")
    bad.kv.pop("linear_conv")
    with pytest.raises(ValueError, match=r"kv\['linear_conv'\]"):
        a.llm_engine.import_request(bad, "x3")
    assert not a.llm_engine.has_unfinished_requests()


def test_state_pool_is_not_copied(hybrid):
    """The linear layers update the recurrent and convolution state pools in place (one flat
    view of every linear layer's pool, like the KV cache's): the compiled step of the largest
    bucket (prefill chunks by the chunked form, windows by the packed rule) has no instruction
    that makes a buffer of one layer's pool ``[B, W, ...]`` (a slice written back: what the
    layers did before) and no ``copy`` of a whole pool or of its flat view."""
    import re

    from jmtp.runtime.device.buckets import step_buckets
    run = llm(hybrid, SpeculativeConfig("mtp", 2, 2)).llm_engine.runner
    lin = run.cache.linear
    bucket = step_buckets(run.shard_config)[-1]
    text = run.jitted_step.lower(*run.step_args(bucket)).compile().as_text()
    ops = [(tuple(int(d) for d in m.group(1).split(",") if d), m.group(2))
           for m in re.finditer(r"= \w+\[([\d,]*)\]\S* ([\w-]+)\(", text)]
    layer = {tuple(a.shape[1:]) for a in (lin.recurrent, lin.conv)}
    whole = {s for a in (lin.recurrent, lin.conv)
             for s in (tuple(a.shape), (a.shape[0] * a.shape[1],) + tuple(a.shape[2:]))}
    assert ops and any(op == "fusion" for _, op in ops)
    assert [o for o in ops if o[0] in layer and o[1] not in ("parameter", "bitcast")] == []
    assert [o for o in ops if o[0] in whole and o[1] == "copy"] == []
