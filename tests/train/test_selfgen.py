"""Training data at scale: the content-addressed token cache, self-generation with one engine,
batched hidden-state capture, device-resident batches and first-fit packing.

Tiny random models only; the engine test compiles a few small step buckets."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jmtp.model import ModelConfig, forward_hidden, init_params
from jmtp.model.llama import forward, init_model_cache
from jmtp.model.metadata import ragged_batch
from jmtp.train import data as D
from jmtp.train.capture import capture_hidden, dense_target_forward
from jmtp.train.config import TrainConfig
from jmtp.train.mtp_trainer import MTPTrainer
from jmtp.train.selfgen import EngineGenerator, plan_jobs, request_seed
from jmtp.train.token_cache import TokenCache, job_key

TINY = ModelConfig(vocab_size=48, hidden_size=32, intermediate_size=64, num_layers=3, num_heads=4,
                   num_kv_heads=2, head_dim=8)


def _params(cfg=TINY, seed=0):
    return init_params(cfg, jax.random.PRNGKey(seed), std=0.3)


# ------------------------------------------------------------------------------------ token cache
def _seqs(n, base=0):
    return [{"prompt_ids": [base + i, 2, 3], "response_ids": list(range(i + 1)), "prompt_id": f"p{i}",
             "kind": "greedy"} for i in range(n)]


def test_token_cache_adds_skips_and_verifies(tmp_path):
    c = TokenCache(tmp_path / "tc")
    jobs = [{"model": "m", "requests": [["p0", 0, 1]]}, {"model": "m", "requests": [["p1", 0, 2]]}]
    assert c.missing(jobs) == jobs
    e = c.add(jobs[0], _seqs(3))
    assert e["num_sequences"] == 3 and e["num_tokens"] == 9 + 6 and e["response_tokens"] == 6
    assert c.has(jobs[0]) and c.missing(jobs) == [jobs[1]]
    assert c.load_shard(e["sha256"]) == _seqs(3)
    # a new process sees the same manifest; equal content is one file (content addressing)
    c2 = TokenCache(tmp_path / "tc")
    assert set(c2.entries()) == {job_key(jobs[0])}
    e2 = c2.add(jobs[1], _seqs(3))
    assert e2["sha256"] == e["sha256"] and len(list((tmp_path / "tc" / "shards").rglob("*.npz"))) == 1
    assert c2.summary() == {"shards": 2, "sequences": 6, "tokens": 30, "response_tokens": 12}
    # a line cut by a crash is ignored; a damaged shard is skipped and its job counts as missing
    with open(tmp_path / "tc" / "manifest.jsonl", "a") as f:
        f.write('{"job_key": "x", "sha2')
    c3 = TokenCache(tmp_path / "tc")
    assert len(c3.entries()) == 2
    c3.add(jobs[0], _seqs(2, base=10))
    path = next(p for p in (tmp_path / "tc" / "shards").rglob("*.npz")
                if p.stem == c3.entries()[job_key(jobs[0])]["sha256"])
    z = dict(np.load(path))
    z["tokens"] = z["tokens"] + 1
    np.savez(path, **z)
    with pytest.raises(ValueError, match="damaged"):
        c3.load_shard(path.stem)
    assert len(c3.sequences()) == 3          # only the intact shard
    assert c3.missing(jobs) == [jobs[0]]
    with pytest.raises(ValueError, match="prompt_ids"):
        c3.add({"x": 1}, [{"response_ids": [1]}])


def test_plan_jobs_seeds_depend_only_on_the_request():
    ps = [("a", [1, 2]), ("b", [3]), ("c", [4, 5, 6])]
    jobs = plan_jobs(ps, model="m", split="train", kind="sampled", temperature=0.8,
                     max_tokens=8, samples=range(2), seed=7, shard_size=4)
    reqs = [r for j in jobs for r in j["requests"]]
    assert [r[:2] for r in reqs] == [["a", 0], ["b", 0], ["c", 0], ["a", 1], ["b", 1], ["c", 1]]
    assert [len(j["requests"]) for j in jobs] == [4, 2]
    assert reqs[4][2] == request_seed(7, "b", 1)
    # growing the prompt set or the samples keeps every earlier request's seed
    more = plan_jobs(ps[1:] + [("d", [9])], model="m", split="train", kind="sampled",
                     temperature=0.8, max_tokens=8, samples=range(3), seed=7, shard_size=4)
    seeds = {(r[0], r[1]): r[2] for j in more for r in j["requests"]}
    assert all(seeds[(r[0], r[1])] == r[2] for r in reqs if r[0] != "a")
    greedy = plan_jobs(ps, model="m", split="eval", kind="greedy", temperature=0.0,
                       max_tokens=8, samples=[0])
    assert all(r[2] == 0 for j in greedy for r in j["requests"])
    with pytest.raises(ValueError):
        plan_jobs(ps, model="m", split="x", kind="x", temperature=0.0, max_tokens=8, samples=[0],
                  shard_size=0)


@pytest.mark.xdist_group("selfgen_engine")
def test_engine_generator_fills_the_cache_and_resumes(tmp_path):
    from jmtp.train.generation import generate_tokens
    cfg, params = TINY, _params()
    rng = np.random.default_rng(0)
    prompts = {f"p{i}": rng.integers(3, cfg.vocab_size, 3 + i).tolist() for i in range(3)}
    pairs = list(prompts.items())
    common = dict(model="tiny", max_tokens=6, seed=1, shard_size=2)
    greedy = plan_jobs(pairs, split="train", kind="greedy", temperature=0.0, samples=[0], **common)
    cache = TokenCache(tmp_path / "tc")
    gen = EngineGenerator(cfg, params, batch_size=2, max_model_len=16)
    st = gen.fill(cache, greedy, prompts)
    assert st["jobs_done"] == 2 and st["jobs_left"] == 0 and st["sequences"] == 3
    got = {s["prompt_id"]: s["response_ids"] for s in cache.sequences()}
    want = generate_tokens(cfg, params, [prompts[p] for p in prompts], 6)
    assert [got[p] for p in prompts] == want          # the engine answers as the reference does
    assert st["tokens"] == sum(map(len, want))
    # a later run with more samples generates only what is new
    sampled = plan_jobs(pairs, split="train", kind="sampled", temperature=1.0, samples=range(2),
                        **common)
    st2 = gen.fill(cache, greedy + sampled, prompts)
    assert st2["jobs_done"] == 3 and cache.summary()["sequences"] == 9
    # a token budget stops new jobs (jobs in flight finish)
    more = plan_jobs(pairs, split="train", kind="sampled", temperature=1.0, samples=range(2, 6),
                     **common)
    st3 = gen.fill(cache, more, prompts, max_new_tokens=1)
    assert 1 <= st3["jobs_done"] < len(more) and st3["jobs_left"] == len(more) - st3["jobs_done"]


# ------------------------------------------------------------------------------------ capture
def test_dense_target_forward_equals_the_paged_prefill():
    cfg, params = TINY, _params(seed=2)
    rng = np.random.default_rng(1)
    lens = [5, 9, 2]
    w = 12
    ids = np.zeros((3, w), np.int32)
    for r, n in enumerate(lens):
        ids[r, :n] = rng.integers(0, cfg.vocab_size, n)
    h, feats = dense_target_forward(cfg, params, ids, lens, feature_layers=(0, 2))
    for r, n in enumerate(lens):
        ref = np.asarray(forward_hidden(cfg, params, ids[r, :n]))
        np.testing.assert_allclose(np.asarray(h[r, :n]), ref, rtol=2e-5, atol=2e-5)
        # feature i: the residual stream after layer i = a target cut after layer i, pre-norm
        for j, layer in enumerate((0, 2)):
            cut = dict(params, layers=jax.tree_util.tree_map(lambda a: a[:layer + 1],
                                                             params["layers"]))
            c = cfg.replace(num_layers=layer + 1)
            pos, meta = ragged_batch(jnp.asarray([n], jnp.int32), jnp.zeros((1,), jnp.int32),
                                     jnp.arange(1, dtype=jnp.int32)[None], 16, n)
            x, _ = forward(c, cut, jnp.asarray(ids[r, :n]), pos, meta,
                           init_model_cache(c, 1, 16, jnp.float32), pre_norm=True)
            np.testing.assert_allclose(np.asarray(feats[r, :n, j]), np.asarray(x), rtol=2e-5,
                                       atol=2e-5)
    with pytest.raises(ValueError, match="feature_layers"):
        dense_target_forward(cfg, params, ids, lens, feature_layers=(3,))
    with pytest.raises(ValueError, match="lens"):
        dense_target_forward(cfg, params, ids, [0, 1, 1])


def test_capture_hidden_buckets_keep_each_sequence():
    cfg, params = TINY, _params(seed=3)
    rng = np.random.default_rng(2)
    seqs = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (3, 70, 5, 33, 1, 64)]
    hid, feats = capture_hidden(cfg, params, seqs, batch_tokens=128, min_width=8,
                                dtype=np.float32, feature_layers=(1,))
    for s, h, f in zip(seqs, hid, feats):
        assert h.shape == (len(s), cfg.hidden_size) and f.shape == (len(s), 1, cfg.hidden_size)
        np.testing.assert_allclose(h, np.asarray(forward_hidden(cfg, params, s)), rtol=2e-5,
                                   atol=2e-5)


# ------------------------------------------------------------------------------------ batches
def _data(cfg, params, n=6, seed=4):
    rng = np.random.default_rng(seed)
    seqs = [rng.integers(0, cfg.vocab_size, int(rng.integers(6, 20))).tolist() for _ in range(n)]
    hid, _ = capture_hidden(cfg, params, seqs, batch_tokens=64)
    d = D.build_dataset(cfg, params, seqs, [2] * n, [f"p{i}" for i in range(n)], ["g"] * n,
                        hidden=hid)
    d.top1 = D.target_top1(cfg, params, d.hidden)
    return d


def test_device_batches_equal_host_batches(tmp_path):
    cfg, params = TINY, _params(seed=5)
    d = _data(cfg, params)
    tc = TrainConfig(steps=3, batch_size=2, seq_len=8, warmup_steps=0, labels="target",
                     prompt_rows=True, progress=False)
    host = MTPTrainer(cfg, params, d, None, tc, str(tmp_path / "a"))
    dev = MTPTrainer(cfg, params, d, None, tc, str(tmp_path / "b"), device_data=True)
    for step in range(3):
        a, b = host.batch(step), dev.batch(step)
        assert set(a) == set(b)
        for k in a:
            np.testing.assert_array_equal(np.asarray(a[k]), np.asarray(b[k]), err_msg=k)


def _first_fit(chunks, seq_len):
    rows, free = [], []
    for c in chunks:
        for r, f in enumerate(free):
            if f >= c[2]:
                rows[r].append(c)
                free[r] -= c[2]
                break
        else:
            rows.append([c])
            free.append(seq_len - c[2])
    return rows


def test_pack_rows_is_first_fit():
    rng = np.random.default_rng(6)
    for trial in range(60):
        n, w = int(rng.integers(1, 40)), int(rng.integers(2, 30))
        lens = rng.integers(2, 3 * w, n)
        toks = np.zeros(int(lens.sum()), np.int32)
        d = D.MTPData(tokens=toks, hidden=np.zeros((len(toks), 1), np.float16),
                      offsets=np.concatenate([[0], np.cumsum(lens)]).astype(np.int64),
                      prompt_lens=np.asarray([int(rng.integers(1, x)) for x in lens], np.int32),
                      prompt_ids=["a"] * n, kinds=["g"] * n)
        rows = D.pack_rows(d, w, prompt_rows=bool(trial % 2))
        chunks = [c for r in rows for c in r]
        assert rows == _first_fit(sorted(chunks), w)
