"""The engine's incremental MTP proposal (shadow state, chunked prefill, recursive substeps) equals
the MTP formula recomputed from scratch over the committed sequence."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jmtp.model import compute_logits, forward, init_kv_cache, mtp_forward, ragged_batch
from jmtp.runtime.config import SpeculativeConfig
from jmtp.runtime.host.llm import LLM, SamplingParams
from tests.runtime.conftest import tiny_model, engine_of


PAD = 128


def drafts_from_scratch(cfg, params, seq: list[int], m: int, vocab=None) -> list[int]:
    """d1..dm for the committed sequence ``seq`` computed non-incrementally (one dense prefill of
    the target, one MTP pass over the whole sequence, then m-1 recursive one-token passes).
    ``vocab``: FR-Spec draft vocabulary (ids); the argmax then runs over those ids only (full
    logits masked to -inf elsewhere)."""
    n = len(seq)
    padded = jnp.asarray(seq + [0] * (PAD - n), jnp.int32)
    in_vocab = np.ones(cfg.vocab_size, bool)
    if vocab is not None:
        in_vocab[:] = False
        in_vocab[np.asarray(vocab)] = True
    return [int(x) for x in _drafts(cfg, params, padded, jnp.int32(n), m, jnp.asarray(in_vocab))]


@functools.partial(jax.jit, static_argnums=(0, 4))
def _drafts(cfg, params, padded, n, m, in_vocab):
    def argmax(h_rows):
        logits = jnp.where(in_vocab, compute_logits(params, h_rows)[0], -jnp.inf)
        return jnp.argmax(logits).astype(jnp.int32)

    h = _target_hidden(cfg, params, padded)                       # h_0..h_{PAD-1}
    bs, pages = 8, (PAD + m) // 8 + 1
    cache = init_kv_cache(cfg, 1, pages, bs)
    tables = jnp.arange(pages, dtype=jnp.int32)[None]
    # MTP position p pairs token seq[p+1] with h_p, p = 0..n-2; row n-2 predicts seq[n] (d1).
    ids = jnp.concatenate([padded[1:], jnp.zeros((1,), jnp.int32)])
    pos, meta = ragged_batch(jnp.reshape(n - 1, (1,)), jnp.zeros((1,), jnp.int32), tables, bs, PAD)
    h_log, h_next, cache = mtp_forward(cfg, params, 0, ids, h, pos, meta, cache)
    d = argmax(h_log[n - 2][None])
    out, hp = [d], h_next[n - 2][None]
    for s in range(1, m):  # recursive: token d_s with the head's own hidden, position n-2+s
        pos, meta = ragged_batch(jnp.ones((1,), jnp.int32), jnp.reshape(n - 2 + s, (1,)), tables,
                                 bs, 1)
        h_log, h_next, cache = mtp_forward(cfg, params, 0, d[None], hp, pos, meta, cache)
        d = argmax(h_log)
        out.append(d)
        hp = h_next
    return jnp.stack(out)


def _target_hidden(cfg, params, ids):
    t = ids.shape[0]
    bs = 8
    cache = init_kv_cache(cfg, cfg.num_layers, t // bs, bs)
    tables = jnp.arange(t // bs, dtype=jnp.int32)[None]
    pos, meta = ragged_batch(jnp.array([t], jnp.int32), jnp.zeros((1,), jnp.int32), tables, bs, t)
    h, _ = forward(cfg, params, ids, pos, meta, cache)
    return h


@pytest.mark.parametrize("layout,k,m,budget,draft_vocab", [
    ("deepseek", 3, 3, 16, 0), ("ernie", 2, 1, 64, 0), ("deepseek", 3, 2, 16, 20),
    ("deepseek", 2, 2, 64, 63)])
def test_incremental_drafts_match_from_scratch(layout, k, m, budget, draft_vocab):
    """Also with an FR-Spec draft vocabulary (N of a shuffled 64-id ranking): drafts are the argmax
    over those N ids of the full logits."""
    cfg, params = tiny_model(1, mtp_layout=layout)
    ranking = np.random.default_rng(5).permutation(cfg.vocab_size).astype(np.int32)
    params = dict(params, draft_vocab=ranking)
    prompts = [list(range(2, 42)), [7, 8, 9]]           # the first is prefilled in chunks
    llm = LLM(model_config=cfg, params=params,
              speculative_config=SpeculativeConfig("mtp", k, m, draft_vocab_size=draft_vocab),
              max_num_seqs=2, max_model_len=80, block_size=4, max_num_batched_tokens=budget)
    assert llm.llm_engine.draft_vocab_size == draft_vocab
    seen = []
    step = engine_of(llm).runner.jitted_step

    def spy(*args):
        out = step(*args)
        st = jax.device_get(out[0])
        for b in range(2):
            if not st.stop_flags[b] and st.step_idx[b] > 0:
                n = st.prompt_lens[b] + st.step_idx[b]
                seen.append((list(st.input_ids[b, :n]), list(st.draft_tokens[b, 1:1 + m])))
        return out

    engine_of(llm).runner.jitted_step = spy
    llm.generate(prompts, SamplingParams(max_tokens=10, ignore_eos=True), use_tqdm=False)
    assert len(seen) >= 8
    for seq, drafts in seen:
        allowed = [d for d in drafts if d >= 0]
        vocab = ranking[:draft_vocab] if draft_vocab else None
        assert allowed == drafts_from_scratch(cfg, params, seq, m, vocab)[: len(allowed)]
        if vocab is not None:
            assert set(allowed) <= set(vocab.tolist())
