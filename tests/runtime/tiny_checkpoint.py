"""A tiny random Llama checkpoint directory that ``jmtp serve --model DIR`` loads in about a
second: ``config.json`` (LlamaForCausalLM, 2 layers, hidden 32), ``model.safetensors`` (random
weights, transformers' tensor names) and a byte-level tokenizer (``tokenizer.json``: one id per
byte, plus ChatML's ``<|im_start|>`` / ``<|im_end|>`` and two more special tokens) with a ChatML
chat template in ``tokenizer_config.json``. The server tests that are about the server, not the
model, run on it (tests/runtime/test_server_hardening.py)."""
from __future__ import annotations

import json
import pathlib

import numpy as np

SPECIALS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<pad>"]
VOCAB = 256 + len(SPECIALS)
EOS = "<|im_end|>"
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
HIDDEN, LAYERS, HEADS, KV_HEADS, FFN = 32, 2, 4, 2, 64


def _tokenizer_json(path: pathlib.Path) -> None:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True) for s in SPECIALS])
    tok.save(str(path))


def write_tiny_checkpoint(path, seed: int = 0, std: float = 0.3) -> pathlib.Path:
    """Write the checkpoint into folder ``path`` (created) and return it."""
    from safetensors.numpy import save_file

    d = pathlib.Path(path)
    d.mkdir(parents=True, exist_ok=True)
    _tokenizer_json(d / "tokenizer.json")
    eos = 256 + SPECIALS.index(EOS)
    (d / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": EOS, "chat_template": TEMPLATE}))
    head_dim = HIDDEN // HEADS
    (d / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": VOCAB,
        "hidden_size": HIDDEN, "intermediate_size": FFN, "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "head_dim": head_dim,
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "tie_word_embeddings": False, "eos_token_id": eos, "hidden_act": "silu"}))
    rng = np.random.default_rng(seed)

    def w(*shape):
        return (rng.standard_normal(shape) * std).astype(np.float32)

    t = {"model.embed_tokens.weight": w(VOCAB, HIDDEN), "lm_head.weight": w(VOCAB, HIDDEN),
         "model.norm.weight": np.ones(HIDDEN, np.float32)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        t.update({p + "input_layernorm.weight": np.ones(HIDDEN, np.float32),
                  p + "post_attention_layernorm.weight": np.ones(HIDDEN, np.float32),
                  p + "self_attn.q_proj.weight": w(HEADS * head_dim, HIDDEN),
                  p + "self_attn.k_proj.weight": w(KV_HEADS * head_dim, HIDDEN),
                  p + "self_attn.v_proj.weight": w(KV_HEADS * head_dim, HIDDEN),
                  p + "self_attn.o_proj.weight": w(HIDDEN, HEADS * head_dim),
                  p + "mlp.gate_proj.weight": w(FFN, HIDDEN),
                  p + "mlp.up_proj.weight": w(FFN, HIDDEN),
                  p + "mlp.down_proj.weight": w(HIDDEN, FFN)})
    save_file(t, str(d / "model.safetensors"))
    return d
