"""The hybrid gated-DeltaNet family (Qwen3-Next, Qwen3.5, Qwen3.5-MoE) against transformers, the MTP
layer against a numpy reference written from the published ``mtp.*`` layout, the three forms of
the gated delta rule against each other and transformers' torch ones, and the recurrent-state
checkpoints per verify-window position against plain decoding."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from jmtp.model import forward_logits
from jmtp.model import gated_deltanet as gd
from jmtp.model.checkpoints.hf_loader import load_hf
from jmtp.model.llama import forward, init_model_cache, mtp_forward
from jmtp.model.metadata import ragged_batch

torch = pytest.importorskip("torch")
torch.set_num_threads(1)
pytest.importorskip("transformers")
from tests.model import hybrid_fixtures as hx  # noqa: E402

pytestmark = pytest.mark.xdist_group("hybrid_models")   # one worker builds the shared engines once


@functools.lru_cache(maxsize=None)
def _loaded(kind: str, tmp: str):
    from pathlib import Path
    model = hx.hf_model(kind)
    mtp = hx.mtp_tensors(model)
    path = hx.save_checkpoint(model, Path(tmp) / kind, mtp)
    cfg, params = load_hf(path, jnp.float32)
    return model, mtp, cfg, params


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("hybrid"))
    return lambda kind: _loaded(kind, tmp)


IDS = [int(i) for i in np.random.default_rng(0).integers(2, hx.V, 21)]


@pytest.mark.parametrize("kind", hx.KINDS)
def test_logits_match_transformers(loaded, kind):
    """Single prefill, and chunked prefill + paged one-token decode in slot 2 of a 4-slot state
    pool over shuffled KV blocks, every block / state slot / checkpoint NaN-poisoned: transformers'
    logits within 1e-4 (fp32)."""
    model, _, cfg, params = loaded(kind)
    assert cfg.is_hybrid and cfg.layer_types == tuple(hx.COMMON["layer_types"])
    assert cfg.attn_output_gate and cfg.num_mtp_layers == 1 and cfg.mtp_layout == "qwen3_next"
    ref = hx.hf_logits(model, IDS)
    one = np.asarray(forward_logits(cfg, params, IDS, block_size=8))
    np.testing.assert_allclose(one, ref, atol=1e-4, rtol=0)
    paged = hx.paged_slot_logits(cfg, params, IDS, prefill=13, chunk=5)
    np.testing.assert_allclose(paged, ref, atol=1e-4, rtol=0)


def test_moe_shared_expert_gate_and_dense_layer(loaded):
    """Qwen3-Next's ``mlp_only_layers=[1]`` gives one dense layer; the MoE layers carry the
    shared expert and its sigmoid gate."""
    _, _, cfg, params = loaded("qwen3_next")
    assert cfg.moe.layers == (0, 2, 3, 4) and cfg.moe.shared_expert_gate
    assert "w_gate" in params["layers"][1] and "shared_expert_gate" in params["layers"][0]
    assert params["layers"][0]["shared_expert_gate"].shape == (hx.H, 1)


# ---------------------------------------------------------------------------------------------
# The MTP layer against a numpy reference of the published layout
# ---------------------------------------------------------------------------------------------

def _rms(x, w, eps=1e-6, centred=True):
    y = x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps)
    return y * ((1.0 + w) if centred else w)


def _np_mtp(hf_cfg, sd, mtp, ids, hidden, positions):
    """vLLM ``Qwen3NextMultiTokenPredictor`` written out in numpy: zero-centred norms of the
    embedding and of the hidden, ``fc`` over ``[e; h]``, one full-attention decoder layer (gated
    attention with q/k norm and partial rotary; MoE with a gated shared expert, or SwiGLU), the
    final ``mtp.norm``. Causal attention over the rows themselves (positions 0..T-1)."""
    f = lambda n: np.asarray(mtp[n], np.float64)  # noqa: E731
    nq, nkv, d = hf_cfg.num_attention_heads, hf_cfg.num_key_value_heads, hf_cfg.head_dim
    e = np.asarray(sd["model.embed_tokens.weight"], np.float64)[ids]
    x = np.concatenate([_rms(e, f("mtp.pre_fc_norm_embedding.weight")),
                        _rms(hidden, f("mtp.pre_fc_norm_hidden.weight"))], -1) @ f("mtp.fc.weight").T
    p = "mtp.layers.0."
    a = _rms(x, f(p + "input_layernorm.weight"))
    t = len(ids)
    qg = (a @ f(p + "self_attn.q_proj.weight").T).reshape(t, nq, 2 * d)
    q, gate = qg[..., :d], qg[..., d:]
    k = (a @ f(p + "self_attn.k_proj.weight").T).reshape(t, nkv, d)
    v = (a @ f(p + "self_attn.v_proj.weight").T).reshape(t, nkv, d)
    q, k = _rms(q, f(p + "self_attn.q_norm.weight")), _rms(k, f(p + "self_attn.k_norm.weight"))
    rd = int(d * hf_cfg.rope_parameters["partial_rotary_factor"])
    inv = 1.0 / (hf_cfg.rope_parameters["rope_theta"] ** (np.arange(0, rd, 2) / rd))
    ang = np.asarray(positions)[:, None] * inv[None]
    cos, sin = np.cos(np.concatenate([ang, ang], -1))[:, None], np.sin(
        np.concatenate([ang, ang], -1))[:, None]

    def rope(z):
        zr = z[..., :rd]
        half = np.concatenate([-zr[..., rd // 2:], zr[..., :rd // 2]], -1)
        return np.concatenate([zr * cos + half * sin, z[..., rd:]], -1)

    q, k = rope(q), rope(k)
    k, v = np.repeat(k, nq // nkv, 1), np.repeat(v, nq // nkv, 1)
    s = np.einsum("thd,shd->hts", q, k) / np.sqrt(d)
    s = np.where(np.tril(np.ones((t, t), bool))[None], s, -np.inf)
    w = np.exp(s - s.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    o = np.einsum("hts,shd->thd", w, v).reshape(t, nq * d) / (1 + np.exp(-gate.reshape(t, -1)))
    x = x + o @ f(p + "self_attn.o_proj.weight").T
    hm = _rms(x, f(p + "post_attention_layernorm.weight"))
    silu = lambda z: z / (1 + np.exp(-z))  # noqa: E731
    swiglu = lambda z, g, u, dn: (silu(z @ g.T) * (z @ u.T)) @ dn.T  # noqa: E731
    if p + "mlp.gate.weight" in mtp:
        logits = hm @ f(p + "mlp.gate.weight").T
        pr = np.exp(logits - logits.max(-1, keepdims=True))
        pr /= pr.sum(-1, keepdims=True)
        kk = hf_cfg.num_experts_per_tok
        top = np.argsort(-pr, -1)[:, :kk]
        out = np.zeros_like(hm)
        gu, dn = f(p + "mlp.experts.gate_up_proj"), f(p + "mlp.experts.down_proj")
        i = gu.shape[1] // 2
        for r in range(t):
            wts = pr[r, top[r]] / pr[r, top[r]].sum()
            for wt, ex in zip(wts, top[r]):
                out[r] += wt * swiglu(hm[r], gu[ex, :i], gu[ex, i:], dn[ex])
        sh = swiglu(hm, f(p + "mlp.shared_expert.gate_proj.weight"),
                    f(p + "mlp.shared_expert.up_proj.weight"),
                    f(p + "mlp.shared_expert.down_proj.weight"))
        out += sh / (1 + np.exp(-(hm @ f(p + "mlp.shared_expert_gate.weight").T)))
    else:
        out = swiglu(hm, f(p + "mlp.gate_proj.weight"), f(p + "mlp.up_proj.weight"),
                     f(p + "mlp.down_proj.weight"))
    return _rms(x + out, f("mtp.norm.weight"))


@pytest.mark.parametrize("kind", ["qwen3_next", "qwen3_5"])
def test_mtp_layer_matches_numpy_reference(loaded, kind):
    """jmtp's MTP module on the loaded ``mtp.*`` weights (MoE for Qwen3-Next, dense for Qwen3.5)
    equals the numpy reference; the hidden it feeds back is the post-norm one."""
    model, mtp, cfg, params = loaded(kind)
    t = 9
    rng = np.random.default_rng(5)
    ids = rng.integers(0, hx.V, t)
    hidden = rng.standard_normal((t, hx.H))
    pos = np.arange(t)
    sd = {k: v.numpy() for k, v in model.state_dict().items()}
    ref = _np_mtp(model.config, sd, mtp, ids, hidden, pos)
    bs = 4
    pages = -(-t // bs)
    from jmtp.model.llama import init_kv_cache
    cache = init_kv_cache(cfg, 1, pages, bs)      # the MTP's own one-layer cache
    _, meta = ragged_batch(jnp.array([t]), jnp.array([0]), jnp.arange(pages)[None], bs, t)
    h, h_next, _ = mtp_forward(cfg, params, 0, jnp.asarray(ids, jnp.int32),
                               jnp.asarray(hidden, jnp.float32), jnp.asarray(pos, jnp.int32),
                               meta, cache)
    np.testing.assert_allclose(np.asarray(h), ref, atol=2e-5, rtol=0)
    np.testing.assert_array_equal(np.asarray(h_next), np.asarray(h))


# ---------------------------------------------------------------------------------------------
# The rule's three forms
# ---------------------------------------------------------------------------------------------

def _rule_inputs(rng, t, hk=2, hv=4, dk=8, dv=6):
    q = rng.standard_normal((t, hk, dk)).astype(np.float32)
    k = rng.standard_normal((t, hk, dk)).astype(np.float32)
    v = rng.standard_normal((t, hv, dv)).astype(np.float32)
    g = (-np.abs(rng.standard_normal((t, hv))) * 0.4).astype(np.float32)
    beta = (1 / (1 + np.exp(-rng.standard_normal((t, hv))))).astype(np.float32)
    s0 = rng.standard_normal((hv, dk, dv)).astype(np.float32)
    return q, k, v, g, beta, s0


@pytest.mark.parametrize("t,chunk", [(1, 4), (13, 4), (37, 8), (64, 64)])
def test_chunked_recurrent_and_torch_rules_agree(t, chunk):
    from transformers.models.qwen3_next import modeling_qwen3_next as M
    q, k, v, g, beta, s0 = _rule_inputs(np.random.default_rng(t), t)
    qq, kk = gd.prepare_qk(jnp.asarray(q), jnp.asarray(k), v.shape[1])
    o_r, states = gd.recurrent_gated_delta_rule(qq, kk, jnp.asarray(v), jnp.asarray(g),
                                                jnp.asarray(beta), jnp.asarray(s0))
    o_c, s_c = gd.chunk_gated_delta_rule(qq, kk, jnp.asarray(v), jnp.asarray(g),
                                         jnp.asarray(beta), jnp.asarray(s0), chunk)
    tt = lambda a: torch.tensor(a)[None]  # noqa: E731
    ref_o, ref_s = M.torch_chunk_gated_delta_rule(
        tt(q), tt(k), tt(v), tt(g), tt(beta), chunk_size=chunk,
        initial_state=torch.tensor(s0)[None], output_final_state=True,
        use_qk_l2norm_in_kernel=True)
    for o, s in ((o_r, states[-1]), (o_c, s_c)):
        np.testing.assert_allclose(np.asarray(o), ref_o[0].numpy(), atol=2e-5, rtol=0)
        np.testing.assert_allclose(np.asarray(s), ref_s[0].numpy(), atol=2e-5, rtol=0)


def test_packed_rule_restarts_each_slot_and_writes_marked_checkpoints():
    """Three slots packed with padding rows: each slot's rows equal the per-sequence recurrent
    rule from its own initial state; exactly the marked checkpoints are written (the others keep
    their NaN)."""
    rng = np.random.default_rng(1)
    lens, w = [5, 2, 3], 3
    t = sum(lens) + 2
    q, k, v, g, beta, _ = _rule_inputs(rng, t)
    init = rng.standard_normal((4, 4, 8, 6)).astype(np.float32)
    qq, kk = gd.prepare_qk(jnp.asarray(q), jnp.asarray(k), 4)
    cu = np.concatenate([[0], np.cumsum(lens + [0])])          # slot 3 idle
    pos = np.concatenate([np.arange(n) + 7 for n in lens] + [np.zeros(2, int)])
    rows = gd.packed_rows(jnp.asarray(cu, jnp.int32), jnp.asarray(pos, jnp.int32), w)
    pool = jnp.full((4, w, 4, 8, 6), jnp.nan)
    o, pool = gd.gated_delta_rule_packed(qq, kk, jnp.asarray(v), jnp.asarray(g), jnp.asarray(beta),
                                         rows.seq, rows.valid & (rows.local == 0), rows.ckpt,
                                         jnp.asarray(init), pool)
    pool = np.asarray(pool)
    for s, n in enumerate(lens):
        a = cu[s]
        ref_o, ref_states = gd.recurrent_gated_delta_rule(
            qq[a:a + n], kk[a:a + n], jnp.asarray(v[a:a + n]), jnp.asarray(g[a:a + n]),
            jnp.asarray(beta[a:a + n]), jnp.asarray(init[s]))
        np.testing.assert_allclose(np.asarray(o)[a:a + n], np.asarray(ref_o), atol=1e-6)
        for c in range(w):
            row = n - w + c          # checkpoint c: the state after row c - (W - q)
            if row >= 0:
                np.testing.assert_allclose(pool[s, c], np.asarray(ref_states[row]), atol=1e-6)
            else:
                assert np.isnan(pool[s, c]).all()
    assert np.isnan(pool[3]).all()


@pytest.mark.parametrize("chunk", [4, 64])
def test_mixed_rule_chunks_long_slots_and_scans_windows(chunk):
    """The engine's rule over slots of 9, 2, 3 and 6 rows with W = 3: the long slots (9, 6) by the
    chunked form (chunks of ``chunk``), the windows by the recurrent scan; every slot's outputs
    equal the per-sequence recurrent rule from its initial state; a long slot writes only its
    final state, to checkpoint W - 1; a window writes one checkpoint per row."""
    rng = np.random.default_rng(2)
    lens, w = [9, 2, 3, 6], 3
    t = sum(lens) + 3
    q, k, v, g, beta, _ = _rule_inputs(rng, t)
    init = rng.standard_normal((5, 4, 8, 6)).astype(np.float32)
    qq, kk = gd.prepare_qk(jnp.asarray(q), jnp.asarray(k), 4)
    cu = np.concatenate([[0], np.cumsum(lens + [0])])
    pos = np.concatenate([np.arange(n) + 4 for n in lens] + [np.zeros(3, int)])
    rows = gd.packed_rows(jnp.asarray(cu, jnp.int32), jnp.asarray(pos, jnp.int32), w)
    assert np.asarray(rows.q_lens).tolist() == lens + [0]
    o, pool = gd.gated_delta_rule_mixed(qq, kk, jnp.asarray(v), jnp.asarray(g), jnp.asarray(beta),
                                        rows, jnp.asarray(init),
                                        jnp.full((5, w, 4, 8, 6), jnp.nan), chunk_size=chunk)
    o, pool = np.asarray(o), np.asarray(pool)
    for s, n in enumerate(lens):
        a = cu[s]
        ref_o, ref_states = gd.recurrent_gated_delta_rule(
            qq[a:a + n], kk[a:a + n], jnp.asarray(v[a:a + n]), jnp.asarray(g[a:a + n]),
            jnp.asarray(beta[a:a + n]), jnp.asarray(init[s]))
        np.testing.assert_allclose(o[a:a + n], np.asarray(ref_o), atol=2e-5)
        np.testing.assert_allclose(pool[s, w - 1], np.asarray(ref_states[-1]), atol=2e-5)
        if n > w:
            assert np.isnan(pool[s, :w - 1]).all()
        else:
            for c in range(w - n, w - 1):
                np.testing.assert_allclose(pool[s, c], np.asarray(ref_states[n - w + c]),
                                           atol=1e-6)
    assert np.isnan(pool[4]).all()


# ---------------------------------------------------------------------------------------------
# Checkpoints per verify-window position == plain decoding (property test)
# ---------------------------------------------------------------------------------------------

_step = jax.jit(forward, static_argnums=0)
W, SLOTS, BS, WIDTH = 4, 3, 4, 16


def _run(cfg, params, cache, slot, tokens, start, tables):
    q = np.zeros(SLOTS, np.int32)
    q[slot] = len(tokens)
    ctx = np.zeros(SLOTS, np.int32)
    ctx[slot] = start
    pos, meta = ragged_batch(jnp.asarray(q), jnp.asarray(ctx), jnp.asarray(tables), BS, WIDTH)
    _, cache = _step(cfg, params, jnp.asarray(tokens + [0] * (WIDTH - len(tokens)), jnp.int32),
                     pos, meta, cache)
    return cache


def _set_current(cache, slot, c):
    return cache._replace(linear=cache.linear._replace(
        current=cache.linear.current.at[slot].set(c)))


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_state_after_accepting_j_of_k_equals_plain_decoding(loaded, data):
    """Prefill a prompt, verify a window ``[t0, d1..dK]`` of random drafts, accept ``j``: the slot
    continues from checkpoint :func:`next_checkpoint` (``n = j + 1`` committed rows), whose
    recurrent and convolution states equal (1e-6) those of plain one-token decoding of
    ``t0, d1..dj`` in another slot."""
    _, _, cfg, params = loaded("qwen3_5")
    k = data.draw(st.integers(1, W - 1), label="K")
    j = data.draw(st.integers(0, k), label="accepted")
    plen = data.draw(st.integers(1, 9), label="prompt_len")
    toks = data.draw(st.lists(st.integers(2, hx.V - 1), min_size=plen + 1 + k,
                              max_size=plen + 1 + k), label="tokens")
    prompt, window = toks[:plen], toks[plen:]
    pages = -(-(plen + W + 1) // BS)
    tables = np.arange(SLOTS * pages, dtype=np.int32).reshape(SLOTS, pages)
    cache = init_model_cache(cfg, SLOTS * pages, BS, num_slots=SLOTS, window=W)
    # speculative slot 0
    spec = _set_current(_run(cfg, params, cache, 0, prompt, 0, tables), 0, W - 1)
    spec = _run(cfg, params, spec, 0, window, plen, tables)
    cur = int(gd.next_checkpoint(spec.linear.current, jnp.array([k + 1, 0, 0]),
                                 jnp.array([j + 1, 0, 0]), jnp.zeros(3, bool), W)[0])
    # plain slot 1: the prompt, then t0, d1..dj one token at a time
    plain = _set_current(_run(cfg, params, spec, 1, prompt, 0, tables), 1, W - 1)
    for i, tok in enumerate(window[:j + 1]):
        plain = _set_current(_run(cfg, params, plain, 1, [tok], plen + i, tables), 1, W - 1)
    for name in ("recurrent", "conv"):
        a = np.asarray(getattr(spec.linear, name))[:, 0, cur]
        b = np.asarray(getattr(plain.linear, name))[:, 1, W - 1]
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)


def test_next_checkpoint_hand_worked():
    """W = 4: a prefill chunk continues from 3; a window of q = 3 rows committing n = 2 from
    W - q + n - 1 = 2; an idle / paused slot keeps its checkpoint."""
    got = gd.next_checkpoint(jnp.array([1, 1, 2, 0]), jnp.array([7, 3, 0, 4]),
                             jnp.array([0, 2, 0, 4]), jnp.array([True, False, False, False]), 4)
    assert np.asarray(got).tolist() == [3, 2, 2, 3]


def test_loader_errors_name_the_tensor(tmp_path):
    import json
    from safetensors.numpy import load_file, save_file
    model = hx.hf_model("qwen3_5")
    path = hx.save_checkpoint(model, tmp_path / "m")
    tensors = load_file(str(path / "model.safetensors"))
    del tensors["model.layers.0.linear_attn.A_log"]
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match="linear_attn.A_log"):
        load_hf(path, jnp.float32)
    good = json.loads((path / "config.json").read_text())
    for field in ("linear_num_value_heads", "head_dim", "num_key_value_heads"):
        cfg = dict(good)
        del cfg[field]
        (path / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(ValueError, match=field):
            load_hf(path, jnp.float32)
    # transformers' defaults differ per class (partial rotary 0.25): it must be stated
    cfg = {**good, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        load_hf(path, jnp.float32)
    (path / "config.json").write_text(json.dumps({**good, "rope_scaling": {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}}))
    with pytest.raises(ValueError, match="rope_scaling"):
        load_hf(path, jnp.float32)


def test_load_config_reads_generation_config_eos(tmp_path):
    """``load_config`` (no weights read) takes the EOS ids of ``generation_config.json`` too, as
    loading the checkpoint does: for a hybrid and for a dense config."""
    import json

    from transformers import LlamaConfig

    from jmtp.model.checkpoints.loader import load_config
    hybrid = hx.hf_model("qwen3_5").config
    dense = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=1, eos_token_id=2)
    hybrid.architectures, dense.architectures = ["Qwen3_5ForCausalLM"], ["LlamaForCausalLM"]
    for name, cfg in (("hybrid", hybrid), ("dense", dense)):
        d = tmp_path / name
        d.mkdir()
        cfg.to_json_file(str(d / "config.json"))
        assert 7 not in load_config(d).eos_token_ids
        (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9]}))
        eos = load_config(d).eos_token_ids
        assert {7, 9} <= set(eos) and int(cfg.eos_token_id) in eos, (name, eos)


def test_int8_kv_cache_key_shift_on_the_full_attention_layers(loaded):
    """An int8 cache on a hybrid target: the key shift is calibrated for the layers that have a
    KV cache only (``f32[num_kv_layers, Nkv, D]``, row j the mean post-RoPE key of cache layer
    j, checked against the f32 cache of the calibration prefill); logits of a prefill and
    one-token decode steps through an int8 cache (keys shifted and Hadamard-rotated) or an fp8
    cache stay within 5 % (relative) of transformers' f32 logits."""
    from jmtp.model.kv_shift import CALIBRATION_LEN, calibrate_k_shift, with_k_shift
    model, _, cfg, params = loaded("qwen3_next")
    mu = np.asarray(calibrate_k_shift(cfg, params, num_seqs=2, seq_len=12, block_size=4))
    assert mu.shape == (cfg.num_kv_layers, cfg.num_kv_heads, cfg.head_dim) == (2, 2, 16)
    # the same mean from the f32 cache of the same prefill, by hand
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, 24)
    cache = init_model_cache(cfg, 6, 4, num_slots=2)
    pos, meta = ragged_batch(jnp.array([12, 12]), jnp.zeros(2, jnp.int32),
                             jnp.arange(6, dtype=jnp.int32).reshape(2, 3), 4, 24)
    _, cache = hx._fwd(cfg, params, jnp.asarray(ids, jnp.int32), pos, meta, cache)
    keys = np.asarray(cache.k).reshape(2, 24, cfg.num_kv_heads, cfg.head_dim)
    np.testing.assert_allclose(mu, keys.mean(1), rtol=1e-5, atol=1e-6)
    assert CALIBRATION_LEN > 12
    shifted = with_k_shift(cfg, params, "int8")
    assert shifted["k_shift"].shape == mu.shape
    ref = hx.hf_logits(model, IDS)
    for kv, p in (("int8", shifted), ("fp8_e4m3", params)):
        got = _paged_logits_kv(cfg, p, IDS, kv)
        rel = np.linalg.norm(got - ref) / np.linalg.norm(ref)
        assert rel < 0.05, (kv, rel)


def _paged_logits_kv(cfg, params, ids, kv_cache_dtype):
    """Prefill 13 tokens then one token per step through a ``kv_cache_dtype`` cache."""
    from jmtp.model import compute_logits
    bs, pages = 4, -(-len(ids) // 4)
    cache = init_model_cache(cfg, pages, bs, num_slots=1, window=1, kv_cache_dtype=kv_cache_dtype)
    tables = jnp.arange(pages, dtype=jnp.int32)[None]
    out, done = [], 0
    for c in [13] + [1] * (len(ids) - 13):
        pos, meta = ragged_batch(jnp.array([c]), jnp.array([done]), tables, bs, c)
        h, cache = hx._fwd(cfg, params, jnp.asarray(ids[done:done + c], jnp.int32), pos, meta,
                           cache)
        out.append(np.asarray(compute_logits(params, h)))
        done += c
    return np.concatenate(out)
