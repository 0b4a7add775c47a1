"""Tiny random transformers checkpoints of the hybrid gated-DeltaNet family (Qwen3-Next, Qwen3.5,
Qwen3.5-MoE), saved with an ``mtp.*`` layer that transformers itself does not create, and the
paged, slot-addressed jmtp forward the tests compare them with."""
from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import torch

from jmtp.model import compute_logits, forward
from jmtp.model.llama import init_model_cache
from jmtp.model.metadata import ragged_batch

V, H = 96, 32
COMMON = dict(vocab_size=V, hidden_size=H, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
              linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
              rms_norm_eps=1e-6, tie_word_embeddings=False, max_position_embeddings=256,
              rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                               "partial_rotary_factor": 0.5},
              layer_types=["linear_attention", "linear_attention", "full_attention",
                           "linear_attention", "full_attention"],
              num_hidden_layers=5, eos_token_id=1, bos_token_id=0)
KINDS = ("qwen3_next", "qwen3_5", "qwen3_5_moe")


def hf_model(kind: str, seed: int = 0):
    """A transformers model of ``kind`` with every weight random (norms too, so the zero-centred
    conversion is exercised), in fp32, eval mode."""
    torch.manual_seed(seed)
    if kind == "qwen3_next":
        from transformers import Qwen3NextConfig, Qwen3NextForCausalLM
        cfg = Qwen3NextConfig(**COMMON, intermediate_size=48, num_experts=4, num_experts_per_tok=2,
                              moe_intermediate_size=16, shared_expert_intermediate_size=24,
                              decoder_sparse_step=1, mlp_only_layers=[1], norm_topk_prob=True)
        model = Qwen3NextForCausalLM(cfg)
    elif kind == "qwen3_5":
        from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig
        model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**COMMON, intermediate_size=48))
    else:
        from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig
        model = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(
            **COMMON, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
            shared_expert_intermediate_size=24))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.log(torch.empty_like(p).uniform_(0.5, 4)))
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn_like(p) * 0.5)
            elif "norm" in name:
                p.copy_(torch.randn_like(p) * 0.2 + (1.0 if name.endswith("linear_attn.norm.weight")
                                                      else 0.0))
            else:
                p.copy_(torch.randn_like(p) * 0.15)
    return model.float().eval()


def mtp_tensors(model, seed: int = 1) -> dict[str, np.ndarray]:
    """A random ``mtp.*`` layer in the published layout: ``fc``, ``pre_fc_norm_embedding``,
    ``pre_fc_norm_hidden``, ``norm`` and ``layers.0.*`` shaped like the model's last
    full-attention layer (its own random weights)."""
    rng = np.random.default_rng(seed)
    sd = model.state_dict()
    last = max(i for i, t in enumerate(model.config.layer_types) if t == "full_attention")
    pre = f"model.layers.{last}."
    out = {f"mtp.layers.0.{k[len(pre):]}": (rng.standard_normal(v.shape) * 0.15).astype(np.float32)
           for k, v in sd.items() if k.startswith(pre)}
    h = model.config.hidden_size
    out["mtp.fc.weight"] = (rng.standard_normal((h, 2 * h)) * 0.15).astype(np.float32)
    for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        out[f"mtp.{n}.weight"] = (rng.standard_normal(h) * 0.2).astype(np.float32)
    return out


def save_checkpoint(model, path: Path, mtp: dict[str, np.ndarray] | None = None) -> Path:
    """``save_pretrained`` plus the ``mtp.*`` tensors in a second safetensors file."""
    from safetensors.numpy import save_file
    model.save_pretrained(path, safe_serialization=True)
    if mtp:
        save_file(mtp, str(path / "mtp.safetensors"))
        idx = path / "model.safetensors.index.json"
        if idx.exists():
            data = json.loads(idx.read_text())
            data["weight_map"].update({k: "mtp.safetensors" for k in mtp})
            idx.write_text(json.dumps(data))
    return path


def hf_logits(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


_fwd = jax.jit(forward, static_argnums=0)


def paged_slot_logits(cfg, params, ids: list[int], *, prefill: int, chunk: int, slot: int = 2,
                      num_slots: int = 4, window: int = 3, block_size: int = 4, width: int = 8,
                      seed: int = 3) -> np.ndarray:
    """``f32[len(ids), V]`` of one sequence in slot ``slot`` of a ``num_slots``-slot state pool
    with ``window`` checkpoints: prefill chunks of ``chunk`` tokens, then one token per step,
    over shuffled KV blocks; every KV block and every state slot / checkpoint starts as NaN (a
    fresh sequence must not read them). The slot continues from the checkpoint its last row
    wrote (``W - 1``: prefill chunks and one-token steps)."""
    pages = -(-len(ids) // block_size)
    cache = init_model_cache(cfg, pages + 2, block_size, num_slots=num_slots, window=window)
    nan = lambda a: jnp.full_like(a, jnp.nan)   # noqa: E731
    lin = cache.linear
    cache = cache._replace(k=nan(cache.k), v=nan(cache.v),
                           linear=lin._replace(conv=nan(lin.conv), recurrent=nan(lin.recurrent),
                                               current=jnp.full_like(lin.current, 1)))
    perm = np.random.default_rng(seed).permutation(pages + 2)[:pages]
    tables = np.full((num_slots, pages), -1, np.int32)
    tables[slot] = perm
    steps = ([(s, min(s + chunk, prefill)) for s in range(0, prefill, chunk)]
             + [(t, t + 1) for t in range(prefill, len(ids))])
    got = []
    for a, b in steps:
        part = ids[a:b]
        q = np.zeros(num_slots, np.int32)
        q[slot] = len(part)
        ctx = np.zeros(num_slots, np.int32)
        ctx[slot] = a
        pos, meta = ragged_batch(jnp.asarray(q), jnp.asarray(ctx), jnp.asarray(tables),
                                 block_size, width)
        h, cache = _fwd(cfg, params, jnp.asarray(part + [0] * (width - len(part)), jnp.int32),
                        pos, meta, cache)
        cur = cache.linear.current.at[slot].set(window - 1)
        cache = cache._replace(linear=cache.linear._replace(current=cur))
        got.append(np.asarray(compute_logits(params, h))[: len(part)])
    return np.concatenate(got)
