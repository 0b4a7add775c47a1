"""MiMo-7B (``MiMoForCausalLM``): a Qwen2 target plus ``model.mtp_layers.{j}`` MTP layers.

A tiny random MiMo checkpoint is written the way the hub's is laid out: transformers'
``Qwen2ForCausalLM.save_pretrained`` for the target, then the MTP tensors added to the same
safetensors file and ``config.json`` switched to ``MiMoForCausalLM`` / ``mimo`` /
``num_nextn_predict_layers``. Checked here:

* the MTP layer (``mtp_forward``, prefill + decode steps, chained on its own output) equals a
  numpy implementation written from the facts of vLLM ``models/mimo_mtp.py`` (see
  ``docs/mimo.md``): embedding zeroed at position 0, ``token_layernorm`` / ``hidden_layernorm``,
  ``input_proj`` over ``[hidden; embedding]``, a Qwen2 block (q/k/v biases), ``final_layernorm``,
  whose output is both the LM-head input and the state fed back;
* the target's logits equal transformers' Qwen2 on the same weights (``load_model``);
* the engine's drafts equal that numpy MTP fed with the target's *pre*-final-norm hidden state
  (captured from transformers with a hook on ``model.norm``), and the LM head without the target
  norm; greedy MTP (K = 1, 3) equals plain greedy decoding through chunked prefill and preemption;
* bad checkpoints raise ``ValueError`` naming the tensor / field.
"""
from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jmtp.model import init_kv_cache, load_checkpoint, load_model, mtp_forward, ragged_batch
from jmtp.model.checkpoints.hf_loader import hf_config
from jmtp.runtime.config import SpeculativeConfig
from jmtp.runtime.host.llm import LLM, SamplingParams
from tests.runtime.conftest import reference_greedy, engine_of

pytestmark = pytest.mark.xdist_group("mimo")   # one worker builds the shared engines once

torch = pytest.importorskip("torch")
torch.set_num_threads(1)  # torch's thread pool thrashes on a small shared CPU
transformers = pytest.importorskip("transformers")

V, H, I, L, NQ, NKV = 96, 64, 80, 2, 4, 2
D = H // NQ
EPS = 1e-6          # Qwen2Config's default rms_norm_eps (written to config.json)
THETA = 640000.0    # MiMo-7B's rope_theta


# ---------------------------------------------------------------------------------------------
# checkpoint
# ---------------------------------------------------------------------------------------------

def _mtp_tensors(rng, j: int) -> dict[str, np.ndarray]:
    """MTP layer ``j`` as the hub's checkpoint names it: flat under ``model.mtp_layers.{j}.``
    (torch Linear weights ``[out, in]``)."""
    p = f"model.mtp_layers.{j}."
    lin = lambda n_out, n_in: (0.15 * rng.standard_normal((n_out, n_in))).astype(np.float32)
    vec = lambda n, s=0.1: (s * rng.standard_normal(n)).astype(np.float32)
    norm = lambda: (1 + 0.2 * rng.standard_normal(H)).astype(np.float32)
    return {p + "token_layernorm.weight": norm(), p + "hidden_layernorm.weight": norm(),
            p + "input_proj.weight": lin(H, 2 * H), p + "final_layernorm.weight": norm(),
            p + "input_layernorm.weight": norm(), p + "post_attention_layernorm.weight": norm(),
            p + "self_attn.q_proj.weight": lin(NQ * D, H), p + "self_attn.q_proj.bias": vec(NQ * D),
            p + "self_attn.k_proj.weight": lin(NKV * D, H), p + "self_attn.k_proj.bias": vec(NKV * D),
            p + "self_attn.v_proj.weight": lin(NKV * D, H), p + "self_attn.v_proj.bias": vec(NKV * D),
            p + "self_attn.o_proj.weight": lin(H, NQ * D),
            p + "mlp.gate_proj.weight": lin(I, H), p + "mlp.up_proj.weight": lin(I, H),
            p + "mlp.down_proj.weight": lin(H, I)}


def write_mimo(path, seed: int = 0, num_mtp: int = 1):
    """A tiny random MiMo checkpoint in ``path``; returns the transformers Qwen2 model (the
    target's reference) and every tensor of the checkpoint."""
    transformers.logging.set_verbosity_error()
    torch.manual_seed(seed)
    config = transformers.Qwen2Config(vocab_size=V, hidden_size=H, intermediate_size=I,
                                      num_hidden_layers=L, num_attention_heads=NQ,
                                      num_key_value_heads=NKV, rope_theta=THETA,
                                      tie_word_embeddings=False)
    model = transformers.Qwen2ForCausalLM(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape)
            p.copy_(1 + 0.2 * noise if "norm" in name else (0.5 if "embed" in name else 0.15) * noise)
    model.save_pretrained(path)
    f = path / "model.safetensors"
    t = load_file(str(f))
    rng = np.random.default_rng(seed + 100)
    for j in range(num_mtp):
        t.update(_mtp_tensors(rng, j))
    save_file(t, str(f), metadata={"format": "pt"})
    hf = json.loads((path / "config.json").read_text())
    hf.update(architectures=["MiMoForCausalLM"], model_type="mimo", num_nextn_predict_layers=num_mtp)
    (path / "config.json").write_text(json.dumps(hf))
    assert hf["rms_norm_eps"] == EPS
    _write_tokenizer(path)
    return model, t


def _write_tokenizer(path):
    """A word-level ``tokenizer.json`` over the V ids (``LLM(path)`` loads one; prompts here are
    token ids)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(V)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))


# ---------------------------------------------------------------------------------------------
# numpy reference (independent of jmtp: raw checkpoint tensors, torch [out, in] layout)
# ---------------------------------------------------------------------------------------------

def np_rms(x, w):
    x = x.astype(np.float64)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + EPS) * w


def np_rope(x, pos):
    """Qwen2 RoPE: rotate-half pairs (i, i + D/2). x: [T, heads, D]."""
    inv = 1.0 / THETA ** (np.arange(0, D, 2) / D)
    ang = pos[:, None, None] * inv[None, None, :]
    cos, sin = np.cos(ang), np.sin(ang)
    a, b = x[..., :D // 2], x[..., D // 2:]
    return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)


def np_qwen2_block(t, p, x, pos):
    """Qwen2DecoderLayer over T rows (causal GQA attention, q/k/v biases), residuals added."""
    lin = lambda n, z: z @ t[p + n + ".weight"].astype(np.float64).T + (
        t[p + n + ".bias"] if p + n + ".bias" in t else 0)
    T = x.shape[0]
    h = np_rms(x, t[p + "input_layernorm.weight"])
    q = np_rope(lin("self_attn.q_proj", h).reshape(T, NQ, D), pos)
    k = np_rope(lin("self_attn.k_proj", h).reshape(T, NKV, D), pos)
    v = lin("self_attn.v_proj", h).reshape(T, NKV, D)
    out = np.zeros((T, NQ, D))
    for hq in range(NQ):
        kv = hq // (NQ // NKV)
        s = q[:, hq] @ k[:, kv].T / np.sqrt(D)
        s = np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
        w = np.exp(s - s.max(-1, keepdims=True))
        out[:, hq] = (w / w.sum(-1, keepdims=True)) @ v[:, kv]
    x = x + lin("self_attn.o_proj", out.reshape(T, NQ * D))
    h = np_rms(x, t[p + "post_attention_layernorm.weight"])
    g, u = lin("mlp.gate_proj", h), lin("mlp.up_proj", h)
    return x + lin("mlp.down_proj", g / (1 + np.exp(-g)) * u)


def np_mimo_mtp(t, j, ids, hidden, pos, mask=True):
    """MiMo MTP layer ``j`` over rows (token ids[r], previous hidden[r], position pos[r]) of one
    sequence in position order; returns the final_layernorm output (LM-head input and fed-back
    state)."""
    p = f"model.mtp_layers.{j}."
    e = t["model.embed_tokens.weight"].astype(np.float64)[ids]
    if mask:
        e[pos == 0] = 0.0                                 # masked at position 0
    e = np_rms(e, t[p + "token_layernorm.weight"])
    hn = np_rms(hidden, t[p + "hidden_layernorm.weight"])
    x = np.concatenate([hn, e], axis=-1) @ t[p + "input_proj.weight"].astype(np.float64).T
    x = np_qwen2_block(t, p, x, pos)
    return np_rms(x, t[p + "final_layernorm.weight"])


# ---------------------------------------------------------------------------------------------

_mtp_jit = jax.jit(mtp_forward, static_argnums=(0,))


@pytest.fixture(scope="module")
def mimo(tmp_path_factory):
    path = tmp_path_factory.mktemp("mimo")
    model, tensors = write_mimo(path, seed=0, num_mtp=1)
    return path, model, tensors


def test_config_of_the_hub_checkpoint():
    """MiMo-7B-Base's config.json fields (shapes of the real model) parse: Qwen2 biases on."""
    hub = {"architectures": ["MiMoForCausalLM"], "model_type": "mimo", "hidden_act": "silu",
           "hidden_size": 4096, "intermediate_size": 11008, "max_position_embeddings": 32768,
           "max_window_layers": 36, "num_attention_heads": 32, "num_hidden_layers": 36,
           "num_key_value_heads": 8, "num_nextn_predict_layers": 1, "rms_norm_eps": 1e-05,
           "rope_scaling": None, "rope_theta": 640000, "sliding_window": 32768,
           "tie_word_embeddings": False, "use_sliding_window": False, "vocab_size": 151680}
    cfg = hf_config(hub, "config.json")
    assert (cfg.architecture, cfg.attention_bias, cfg.head_dim, cfg.num_kv_heads) == (
        "MiMoForCausalLM", True, 128, 8)
    assert not cfg.tie_word_embeddings and cfg.rope_theta == 640000


def test_mtp_layer_matches_numpy_prefill_and_decode(tmp_path):
    """Two MTP layers; each over a prefill of 5 rows then two decode rows, the second chained on
    the first's output (as the engine's substeps); positions 0.. so the position-0 mask counts."""
    _, t = write_mimo(tmp_path, seed=1, num_mtp=2)
    cfg, params = load_checkpoint(tmp_path, dtype=jnp.float32)
    assert (cfg.mtp_layout, cfg.num_mtp_layers, cfg.attention_bias) == ("mimo", 2, True)
    assert cfg.mtp_takes_prenorm_hidden and not cfg.mtp_feeds_back_prenorm
    rng = np.random.default_rng(2)
    n = 5
    ids = rng.integers(0, V, size=n + 2).astype(np.int32)
    hidden = rng.standard_normal((n + 1, H)).astype(np.float32)
    bs, pages = 4, 2
    tables = jnp.arange(pages, dtype=jnp.int32)[None]
    for j in range(2):
        cache = init_kv_cache(cfg, cfg.num_mtp_layers, pages, bs)
        pos, meta = ragged_batch(jnp.array([n]), jnp.array([0]), tables, bs, n)
        h0, f0, cache = _mtp_jit(cfg, params, j, jnp.asarray(ids[:n]), jnp.asarray(hidden[:n]),
                                 pos, meta, cache)
        pos, meta = ragged_batch(jnp.array([1]), jnp.array([n]), tables, bs, 1)
        h1, f1, cache = _mtp_jit(cfg, params, j, jnp.asarray(ids[n:n + 1]),
                                 jnp.asarray(hidden[n:n + 1]), pos, meta, cache)
        pos, meta = ragged_batch(jnp.array([1]), jnp.array([n + 1]), tables, bs, 1)
        h2, f2, _ = _mtp_jit(cfg, params, j, jnp.asarray(ids[n + 1:]), f1, pos, meta, cache)
        ours = np.concatenate([np.asarray(h0), np.asarray(h1), np.asarray(h2)])
        # numpy: the same rows, the last one fed numpy's own output of the row before
        ref = np_mimo_mtp(t, j, ids[:n + 1], hidden, np.arange(n + 1))
        ref_all = np_mimo_mtp(t, j, ids, np.concatenate([hidden, ref[-1:]]), np.arange(n + 2))
        np.testing.assert_allclose(ours, ref_all, rtol=1e-4, atol=1e-4, err_msg=f"layer {j}")
        # the fed-back state is the final_layernorm output itself
        np.testing.assert_array_equal(np.asarray(f0), np.asarray(h0))
        np.testing.assert_array_equal(np.asarray(f2), np.asarray(h2))
    # the position-0 mask matters for these inputs (row 0 differs without it)
    row0 = [np_mimo_mtp(t, 0, ids[:1], hidden[:1], np.array([0]), mask=m) for m in (True, False)]
    assert not np.allclose(*row0, atol=1e-2)


def test_target_logits_equal_transformers(mimo):
    path, model, _ = mimo
    cfg, m = load_model(path, dtype=jnp.float32)
    assert (cfg.architecture, cfg.mtp_layout, cfg.num_mtp_layers) == ("MiMoForCausalLM", "mimo", 1)
    ids = np.random.default_rng(3).integers(0, V, size=23).tolist()
    from jmtp.model import forward_logits
    ours = np.asarray(forward_logits(cfg, m.to_params(), ids))
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].float().numpy()
    assert np.abs(ref).max() > 0.5
    np.testing.assert_allclose(ours, ref, rtol=0, atol=1e-4)


def _prenorm_hidden(model, ids) -> np.ndarray:
    """transformers' target hidden states *before* ``model.norm`` (a forward pre-hook)."""
    cap = []
    hook = model.model.norm.register_forward_pre_hook(lambda mod, args: cap.append(args[0]))
    try:
        with torch.no_grad():
            model(torch.tensor([ids]))
    finally:
        hook.remove()
    return cap[0][0].double().numpy()


def np_drafts(model, t, seq: list[int], m: int) -> list[int]:
    """d1..dm of the committed ``seq`` from scratch: MTP position p pairs token seq[p+1] with the
    target's pre-norm hidden h_p (p = 0..n-2); then m-1 chained rows, each with the previous draft
    and the previous row's MTP output; logits = lm_head(MTP output) (no target norm)."""
    n = len(seq)
    hidden = _prenorm_hidden(model, seq)[: n - 1]
    ids = list(seq[1:])
    lm_head = t["lm_head.weight"].astype(np.float64)
    out = []
    for _ in range(m):
        o = np_mimo_mtp(t, 0, np.asarray(ids), hidden, np.arange(len(ids)))
        d = int(np.argmax(o[-1] @ lm_head.T))
        out.append(d)
        ids.append(d)
        hidden = np.concatenate([hidden, o[-1:]])
    return out


PROMPTS = [list(range(3, 33)), [5, 6, 7], [9] * 13]
MAX_TOKENS = 16


def _run(path, k, num_blocks, spy=None):
    spec = SpeculativeConfig("mtp", k, k) if k else None
    llm = LLM(str(path), dtype="float32", speculative_config=spec, max_num_seqs=3,
              max_model_len=64, block_size=4, num_blocks=num_blocks, max_num_batched_tokens=16)
    if spy is not None:
        step = engine_of(llm).runner.jitted_step

        def wrapped(*args):
            out = step(*args)
            spy(jax.device_get(out[0]))
            return out

        engine_of(llm).runner.jitted_step = wrapped
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True),
                        use_tqdm=False)
    st = llm.llm_engine.get_stats()
    assert st["num_free_blocks"] == st["num_blocks"]
    return [o.token_ids for o in outs], st["num_preemptions"], outs


@pytest.fixture(scope="module")
def plain(mimo):
    return _run(mimo[0], None, None)[0]


def test_plain_greedy_equals_reference(mimo, plain):
    cfg, params = load_checkpoint(mimo[0], dtype=jnp.float32)
    for p, toks in zip(PROMPTS, plain):
        assert toks == reference_greedy(cfg, params, p, MAX_TOKENS, stop_ids=())


@pytest.mark.parametrize("k", [1, 3])
def test_speculative_equals_plain_and_drafts_equal_numpy(mimo, plain, k):
    """Lossless through chunked prefill and preemption; every draft window the engine writes
    equals :func:`np_drafts` (checked on up to 12 windows)."""
    path, model, t = mimo
    seen = []

    def spy(st):
        for b in range(3):
            if not st.stop_flags[b] and st.step_idx[b] > 0 and len(seen) < 12:
                n = int(st.prompt_lens[b] + st.step_idx[b])
                seen.append((st.input_ids[b, :n].tolist(), st.draft_tokens[b, 1:1 + k].tolist()))

    spec, n_preempt, outs = _run(path, k, 14, spy)
    assert n_preempt > 0, "the block budget was meant to force a preemption"
    assert spec == plain
    assert sum(o.metrics.num_draft_tokens for o in outs) > 0
    assert len(seen) >= 6
    for seq, drafts in seen:
        allowed = [d for d in drafts if d >= 0]
        assert allowed == np_drafts(model, t, seq, k)[: len(allowed)], seq


def test_bad_checkpoints(tmp_path):
    write_mimo(tmp_path, seed=4, num_mtp=1)
    f = tmp_path / "model.safetensors"
    good = load_file(str(f))
    name = "model.mtp_layers.0.input_proj.weight"
    # wrong shape: named
    save_file(dict(good, **{name: np.zeros((H, H), np.float32)}), str(f))
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        load_checkpoint(tmp_path)
    # a missing MTP tensor: named
    for missing in ("model.mtp_layers.0.hidden_layernorm.weight",
                    "model.mtp_layers.0.self_attn.k_proj.bias"):
        save_file({k: v for k, v in good.items() if k != missing}, str(f))
        with pytest.raises(ValueError, match=missing.replace(".", r"\.")):
            load_checkpoint(tmp_path)
    # config announces two MTP layers, the checkpoint holds one
    save_file(good, str(f))
    hf = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(dict(hf, num_nextn_predict_layers=2)))
    with pytest.raises(ValueError, match="num_nextn_predict_layers.*model\\.mtp_layers\\.1\\."):
        load_checkpoint(tmp_path)
    # layers not numbered from 0
    (tmp_path / "config.json").write_text(json.dumps(hf))
    save_file({k.replace("mtp_layers.0.", "mtp_layers.1.") if "mtp_layers" in k else k: v
               for k, v in good.items()}, str(f))
    with pytest.raises(ValueError, match="numbered 0..0"):
        load_checkpoint(tmp_path)


def test_training_a_mimo_head_is_refused():
    from jmtp.model import init_params
    from jmtp.model.config import ModelConfig
    from jmtp.train.dense import dense_mtp_forward

    cfg = ModelConfig(vocab_size=V, hidden_size=32, intermediate_size=48, num_layers=1,
                      num_heads=2, num_kv_heads=1, head_dim=16, mtp_layout="mimo")
    params = init_params(cfg, jax.random.key(0))
    z = jnp.zeros((1, 4), jnp.int32)
    with pytest.raises(ValueError, match="mtp_layout='mimo'"):
        dense_mtp_forward(cfg, params, z, jnp.zeros((1, 4, 32)), z, z)
    # and before any target forward is spent collecting training data
    from jmtp.train.data import target_hidden_states
    with pytest.raises(ValueError, match="target_hidden_states: .*mtp_layout='mimo'"):
        target_hidden_states(cfg, params, [1, 2, 3])
