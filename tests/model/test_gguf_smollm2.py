"""GGUF loading checked against transformers' own GGUF loader (independent dequantization and q/k
de-permutation): the real SmolLM2-135M-Instruct Q4_1 file, and a tiny synthetic Llama GGUF that
uses every supported tensor type."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jmtp.model import compute_logits, forward, forward_logits, init_kv_cache, ragged_batch

pytestmark = pytest.mark.xdist_group("smollm2_reference")   # one worker loads transformers' SmolLM2 once

torch = pytest.importorskip("torch")
torch.set_num_threads(1)  # torch's thread pool thrashes on a small shared CPU
transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "Photosynthesis converts light energy into chemical energy. The main products are",
    "1, 1, 2, 3, 5, 8, 13, 21,",
]
CHAT = [{"role": "user", "content": "Name three primary colours."}]


def _hf_logits(model, ids) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


# ---------------------------------------------------------------------------------------------
# jmtp's paged forward at fixed shapes (one compile for every prompt): a prefill padded to BUCKET
# rows, then one token per decode step. Cache: PAGES blocks of BLOCK positions.
# ---------------------------------------------------------------------------------------------
BUCKET, BLOCK, PAGES = 64, 16, 8


@functools.partial(jax.jit, static_argnums=(0,))
def _run(cfg, params, ids, q_len, context_len, cache):
    """Rows ``[0, q_len)`` of ``ids`` are new tokens at positions ``context_len + j``."""
    tables = jnp.arange(PAGES, dtype=jnp.int32)[None]
    positions, meta = ragged_batch(q_len[None], context_len[None], tables, BLOCK, ids.shape[0])
    h, cache = forward(cfg, params, ids, positions, meta, cache)
    return compute_logits(params, h), cache


def prefill(cfg, params, prompt):
    """``(logits f32[len(prompt), V], cache)`` of a prompt of at most BUCKET tokens."""
    assert 0 < len(prompt) <= BUCKET
    ids = np.zeros(BUCKET, np.int32)
    ids[:len(prompt)] = prompt
    cache = init_kv_cache(cfg, cfg.num_layers, PAGES, BLOCK, params["embed"].dtype)
    logits, cache = _run(cfg, params, jnp.asarray(ids), jnp.int32(len(prompt)), jnp.int32(0), cache)
    return np.asarray(logits[:len(prompt)]), cache


def greedy(cfg, params, prompt, n, eos=()):
    """Greedy continuation of ``prompt`` (list[int]) for ``n`` tokens, stopping after an EOS."""
    assert len(prompt) + n <= PAGES * BLOCK
    logits, cache = prefill(cfg, params, prompt)
    out = [int(logits[-1].argmax())]
    while len(out) < n and out[-1] not in eos:
        ctx = jnp.int32(len(prompt) + len(out) - 1)
        logits, cache = _run(cfg, params, jnp.asarray([out[-1]], jnp.int32), jnp.int32(1), ctx,
                             cache)
        out.append(int(jnp.argmax(logits[0])))
    return out


# ---------------------------------------------------------------------------------------------
# Real model
# ---------------------------------------------------------------------------------------------

def test_config_matches_transformers(smollm2, hf_smollm2_model):
    cfg, params = smollm2
    hc = hf_smollm2_model.config
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_layers) == (
        hc.vocab_size, hc.hidden_size, hc.intermediate_size, hc.num_hidden_layers)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (
        hc.num_attention_heads, hc.num_key_value_heads, hc.head_dim)
    assert cfg.rope_theta == pytest.approx(hc.rope_parameters["rope_theta"])
    assert cfg.rms_norm_eps == pytest.approx(hc.rms_norm_eps)
    assert cfg.tie_word_embeddings and "lm_head" not in params
    assert cfg.eos_token_ids == (2,) and cfg.bos_token_id == 1
    assert cfg.num_mtp_layers == 1 and params["mtp"]["eh_proj"].shape == (1, 2 * 576, 576)
    assert params["embed"].dtype == jnp.float32
    # the dequantized, de-permuted q projection equals transformers' weight (ours is [in, out])
    hf_wq = hf_smollm2_model.model.layers[3].self_attn.q_proj.weight.detach().numpy()
    np.testing.assert_allclose(np.asarray(params["layers"]["wq"][3]), hf_wq.T, rtol=0, atol=1e-6)


def test_logits_match_transformers(smollm2, smollm2_tokenizer, hf_smollm2_model):
    cfg, params = smollm2
    chat = smollm2_tokenizer.apply_chat_template(CHAT, add_generation_prompt=True)
    for text in PROMPTS + [chat]:
        ids = smollm2_tokenizer.encode(text)
        # the public one-sequence entry point for the chat prompt, the paged prefill for the rest
        ours = np.asarray(forward_logits(cfg, params, ids)) if text == chat else prefill(
            cfg, params, ids)[0]
        ref = _hf_logits(hf_smollm2_model, ids)
        err = np.abs(ours - ref).max()
        assert err <= 1e-3 * np.abs(ref).max(), (text, err, np.abs(ref).max())
        np.testing.assert_array_equal(ours.argmax(-1), ref.argmax(-1), err_msg=text)


def test_greedy_continuation_matches_generate(smollm2, smollm2_tokenizer, hf_smollm2_model):
    cfg, params = smollm2
    text = smollm2_tokenizer.apply_chat_template(
        [{"role": "user", "content": "Write a short story about a robot who learns to paint."}])
    prompt = smollm2_tokenizer.encode(text)
    with torch.no_grad():
        ref = hf_smollm2_model.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False, max_new_tokens=64, pad_token_id=2)[0, len(prompt):].tolist()
    assert len(prompt) <= BUCKET
    ours = greedy(cfg, params, prompt, 64, eos=cfg.eos_token_ids)
    assert len(ref) >= 32  # a real continuation, not an immediate stop
    assert ours == ref, (smollm2_tokenizer.decode(ours), smollm2_tokenizer.decode(ref))


# ---------------------------------------------------------------------------------------------
# Tiny synthetic GGUF using every supported tensor type
# ---------------------------------------------------------------------------------------------

Q = gguf.GGMLQuantizationType
# (bytes per block, offsets of fp16 scale fields) for the K-quants we build from random blocks
_KQ = {Q.Q2_K: (84, (80, 82)), Q.Q3_K: (110, (108,)), Q.Q4_K: (144, (0, 2)),
       Q.Q5_K: (176, (0, 2)), Q.Q6_K: (210, (208,))}


def _llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py's q/k row permutation (HF rotate-half → interleaved)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _encode(w: np.ndarray, qtype, rng) -> tuple[np.ndarray, np.ndarray]:
    """``(payload for GGUFWriter, the exact fp32 values it decodes to)`` for a ``[out, in]`` tensor."""
    if qtype == Q.F32:
        return w.astype(np.float32), w.astype(np.float32)
    if qtype == Q.F16:
        return w.astype(np.float16), w.astype(np.float16).astype(np.float32)
    if qtype in _KQ:  # no numpy quantizer for K-quants: random blocks with small fp16 scales
        nbytes, scale_offs = _KQ[qtype]
        rows, cols = w.shape
        blocks = rng.integers(0, 256, size=(rows * cols // 256, nbytes), dtype=np.uint8)
        for off in scale_offs:
            blocks[:, off:off + 2] = rng.uniform(2e-4, 1e-3, size=(blocks.shape[0], 1)).astype(
                np.float16).view(np.uint8)
        raw = blocks.reshape(rows, -1)
    else:
        raw = gguf.quants.quantize(w.astype(np.float32), qtype)
    return raw, gguf.quants.dequantize(raw, qtype).astype(np.float32)


def _write_tiny_gguf(path, rng):
    v, h, inter, nq, nkv, d, layers = 320, 256, 512, 4, 2, 64, 2
    types = iter([Q.Q8_0, Q.Q6_K,                                              # embed, output
                  Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q2_K,       # layer 0
                  Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q8_0, Q.F32, Q.Q4_K])      # layer 1
    w = gguf.GGUFWriter(str(path), "llama")
    for key, val in [("block_count", layers), ("context_length", 256), ("embedding_length", h),
                     ("feed_forward_length", inter), ("head_count", nq), ("head_count_kv", nkv),
                     ("rope_dimension_count", d), ("vocab_size", v)]:
        getattr(w, f"add_{key}")(val)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    hf = {}  # what the decoded file means in HF layout (rotate-half q/k)
    orig = {}  # the HF-layout tensors before permutation and quantization

    def put(name, hf_name, arr, qtype, permute_heads=None):
        orig[hf_name] = arr
        if permute_heads:
            arr = _llamacpp_permute(arr, permute_heads)
        raw, decoded = _encode(arr, qtype, rng)
        w.add_tensor(name, raw, raw_dtype=None if qtype in (Q.F32, Q.F16) else qtype)
        if permute_heads:  # the de-permuted decoded tensor is what a correct loader must produce
            decoded = decoded.reshape(permute_heads, decoded.shape[0] // permute_heads // 2, 2,
                                      -1).swapaxes(1, 2).reshape(decoded.shape)
        hf[hf_name] = decoded

    def rnd(*shape, std=0.05):
        return (std * rng.standard_normal(shape)).astype(np.float32)

    put("token_embd.weight", "embed", rnd(v, h, std=1.0), next(types))
    put("output.weight", "lm_head", rnd(v, h), next(types))
    put("output_norm.weight", "final_norm", 1 + rnd(h, std=0.1), Q.F32)
    for i in range(layers):
        put(f"blk.{i}.attn_norm.weight", f"{i}.attn_norm", 1 + rnd(h, std=0.1), Q.F32)
        put(f"blk.{i}.ffn_norm.weight", f"{i}.mlp_norm", 1 + rnd(h, std=0.1), Q.F32)
        put(f"blk.{i}.attn_q.weight", f"{i}.wq", rnd(nq * d, h), next(types), permute_heads=nq)
        put(f"blk.{i}.attn_k.weight", f"{i}.wk", rnd(nkv * d, h), next(types), permute_heads=nkv)
        put(f"blk.{i}.attn_v.weight", f"{i}.wv", rnd(nkv * d, h), next(types))
        put(f"blk.{i}.attn_output.weight", f"{i}.wo", rnd(h, nq * d), next(types))
        put(f"blk.{i}.ffn_gate.weight", f"{i}.w_gate", rnd(inter, h), next(types))
        put(f"blk.{i}.ffn_up.weight", f"{i}.w_up", rnd(inter, h), next(types))
        put(f"blk.{i}.ffn_down.weight", f"{i}.w_down", rnd(h, inter), next(types))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return hf, orig


def test_tiny_gguf_every_type_matches_transformers(tmp_path):
    from jmtp.model import load_checkpoint

    rng = np.random.default_rng(0)
    path = tmp_path / "tiny.gguf"
    decoded, orig = _write_tiny_gguf(path, rng)
    cfg, params = load_checkpoint(path, dtype=jnp.float32)
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (2, 4, 2, 64)
    assert not cfg.tie_word_embeddings
    # every tensor equals the exactly-decoded payload in HF layout (q/k de-permuted)
    np.testing.assert_array_equal(np.asarray(params["embed"]), decoded["embed"])
    np.testing.assert_array_equal(np.asarray(params["lm_head"]), decoded["lm_head"].T)
    for i in range(2):
        for name in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"):
            np.testing.assert_array_equal(np.asarray(params["layers"][name][i]),
                                          decoded[f"{i}.{name}"].T, err_msg=f"{i}.{name}")
    # layer 0 stores q in F16 and k in BF16: de-permuted they are the original HF rows again
    np.testing.assert_allclose(np.asarray(params["layers"]["wq"][0]), orig["0.wq"].T, atol=1e-4)
    np.testing.assert_allclose(np.asarray(params["layers"]["wk"][0]), orig["0.wk"].T, atol=1e-3)
    # and the model computes what transformers computes from the same file
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file="tiny.gguf", dtype=torch.float32).eval()
    ids = rng.integers(0, 320, size=11).tolist()
    ours = np.asarray(forward_logits(cfg, params, ids))
    ref = _hf_logits(hf_model, ids)
    np.testing.assert_allclose(ours, ref, rtol=0, atol=1e-4 * np.abs(ref).max())
