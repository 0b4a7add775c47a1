"""Multi-device half of ``tests/runtime/test_expert_parallel.py``: run in a subprocess whose
``XLA_FLAGS`` give 8 CPU devices (as ``tests/runtime/sharding_worker.py``).

``python -m tests.runtime.expert_parallel_worker CASE...`` prints one JSON line ``{CASE:
result}``. Cases:

* ``layer``: one MoE layer (:func:`jmtp.model.moe.moe_ffn`) with expert parallelism against the
  same layer on one device, on every mesh of :data:`MESHES`, both dispatches, a skewed router
  (every token picks the same experts: the dropless worst case) and a row count no model axis
  divides; max |error| per combination, and the collectives of the compiled layer by kind.
* ``engine:model=M,dp=D,tp=N[,a2a=B]``: the tiny model ``M`` of :data:`MODELS` with
  ``enable_expert_parallel=True`` on a ``(D, N)`` mesh (``B``: the dispatch, default ``auto``):
  greedy and seeded sampled MTP tokens of :data:`PROMPTS` (chunked prefill, preemption), the
  preemptions, free blocks, the experts' bytes on the first device and in all, the KV cache's
  sharding, compiled step executables.
* ``one:model=M``: the same engine on one device (the seeded sampled reference).

A case that raises reports ``{"error": traceback}`` and the others still run.
"""
from __future__ import annotations

import json
import re
import sys
import time
import traceback

import jax
import numpy as np

from jmtp.model.config import MoEConfig, RopeScaling
from jmtp.runtime.config import SpeculativeConfig
from jmtp.runtime.host.llm import LLM, SamplingParams
from tests.runtime.conftest import TINY_HYBRID, engine_of, tiny_model

#: (data, model) meshes of 8 devices: model-parallel attention, both, and attention data
#: parallel only ((8, 1): SGLang's "DP attention" with the experts over all 8).
MESHES = [(1, 8), (2, 4), (4, 2), (8, 1)]
_YARN = RopeScaling(factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0,
                    original_max_position_embeddings=16, rope_type="yarn", mscale=1.0,
                    mscale_all_dim=0.7)
#: Tiny random targets in the shape of each family (over conftest.TINY: V=64, H=32), each with
#: a MoE MTP layer (the DeepSeek layout; a fresh head copies the last layer).
MODELS = {
    # MLA (q compressed, YaRN), dense layer 0, MoE layer 1: 8 experts in 4 groups (2 kept),
    # top-3, sigmoid router with score-correction bias, one shared expert, scaling 2.5
    "deepseek_v3": dict(
        architecture="DeepseekV3ForCausalLM", num_heads=8, num_kv_heads=8, head_dim=8,
        attention_type="mla", q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=8, v_head_dim=8, rope_scaling=_YARN, tie_word_embeddings=False,
        moe=MoEConfig(8, 3, 16, layers=(1,), mtp_moe=True, scoring="sigmoid",
                      norm_topk_prob=True, score_bias=True, n_group=4, topk_group=2,
                      routed_scaling_factor=2.5, shared_intermediate_size=16)),
    # GQA 16/8 with biases, q/k norm, partial rotary 0.5; 16 experts top-4, sigmoid + bias,
    # one shared expert
    "glm4_moe": dict(
        architecture="Glm4MoeForCausalLM", num_heads=16, num_kv_heads=8, head_dim=8,
        partial_rotary_factor=0.5, attention_bias=True, qk_norm=True, tie_word_embeddings=False,
        moe=MoEConfig(16, 4, 16, layers=(1,), mtp_moe=True, scoring="sigmoid",
                      norm_topk_prob=True, score_bias=True, routed_scaling_factor=2.5,
                      shared_intermediate_size=16)),
    # every layer MoE (stacked, one lax.scan): softmax top-2 renormalised, no shared expert
    "qwen3_moe": dict(
        architecture="Qwen3MoeForCausalLM", num_heads=8, num_kv_heads=8, head_dim=8,
        qk_norm=True, moe=MoEConfig(8, 2, 16, layers=(0, 1), mtp_moe=True,
                                    norm_topk_prob=True)),
    # hybrid: gated-DeltaNet layers around a gated full-attention layer (2 key / 4 value heads:
    # a model axis of at most 2), every layer MoE with a gated shared expert, MoE MTP layer
    "qwen3_next": dict(
        TINY_HYBRID, architecture="Qwen3NextForCausalLM",
        moe=MoEConfig(8, 2, 16, layers=(0, 1, 2), mtp_moe=True, norm_topk_prob=True,
                      shared_intermediate_size=16, shared_expert_gate=True)),
}
#: Meshes a model's heads allow (Qwen3-Next's 2 linear key heads: a model axis of at most 2).
MODEL_MESHES = {name: [(dp, tp) for dp, tp in MESHES if name != "qwen3_next" or tp <= 2]
                for name in MODELS}
#: 16 prompts (2 per data shard even at DP = 8) of 9 to 12 tokens, 12 new tokens each: chunked
#: prefill at 4 tokens per shard per step. Each sequence ends holding 5 or 6 of its shard's 7
#: blocks, and the first to finish cannot do so before the other holds the 3 of its prompt, so
#: both wait for blocks at some step: a preemption on every shard.
PROMPTS = [[(7 * i + j) % 61 + 2 for j in range(9 + i % 4)] for i in range(16)]
MAX_TOKENS = 12
K = 1


def model(name: str):
    """``(cfg, params)`` of :data:`MODELS` ``name``, the score-correction biases random (so
    they steer the choice)."""
    cfg, params = tiny_model(0, **MODELS[name])
    if cfg.moe.score_bias:
        params = jax.tree_util.tree_map_with_path(
            lambda path, a: (0.5 * jax.random.normal(jax.random.key(len(str(path))), a.shape)
                             if "router_bias" in jax.tree_util.keystr(path) else a), params)
    return cfg, params


def engine_kwargs(dp: int) -> dict:
    """2 slots, 7 blocks (one 24-token sequence and the MTP layer's look-ahead) and a 4-token
    budget per data shard."""
    return dict(max_num_seqs=2 * dp, num_blocks=7 * dp, max_model_len=24, block_size=4,
                max_num_batched_tokens=4 * dp, compile="largest",
                speculative_config=SpeculativeConfig("mtp", K))


def _generate(llm):
    greedy = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True),
                          use_tqdm=False)
    preempted = llm.llm_engine.get_stats()["num_preemptions"]
    sampled = llm.generate(PROMPTS, [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8,
                                                    seed=100 + i, ignore_eos=True)
                                     for i in range(len(PROMPTS))], use_tqdm=False)
    stats = llm.llm_engine.get_stats()
    return {"tokens": [o.outputs[0].token_ids for o in greedy],
            "sampled": [o.outputs[0].token_ids for o in sampled],
            "preemptions": [preempted, stats["num_preemptions"] - preempted],
            "free_blocks": stats["num_free_blocks"], "num_blocks": stats["num_blocks"]}


def expert_bytes(llm) -> list:
    """``[path, bytes on the first device, total bytes]`` of every routed-expert tensor."""
    out = []
    for path, a in jax.tree_util.tree_leaves_with_path(llm.llm_engine.runner.params):
        name = jax.tree_util.keystr(path)
        if "experts_" in name:
            out.append([name, int(a.addressable_shards[0].data.nbytes), int(a.nbytes)])
    return out


def engine_case(name: str, dp: int, tp: int, a2a: str = "auto") -> dict:
    cfg, params = model(name)
    llm = LLM(model_config=cfg, params=params, data_parallel_size=dp, tensor_parallel_size=tp,
              enable_expert_parallel=True, all2all_backend=a2a, **engine_kwargs(dp))
    runner = engine_of(llm.llm_engine).runner
    before = runner.jitted_step._cache_size()
    out = _generate(llm)
    out.update(experts=expert_bytes(llm), first_call_seconds=runner.first_call_seconds,
               memory=llm.llm_engine.memory_per_device(),
               cache_spec=str(runner.cache.k.sharding.spec),
               all2all_backend=llm.model_config.moe.all2all_backend,
               expert_parallel=llm.model_config.moe.expert_parallel,
               step_executables=runner.jitted_step._cache_size() - before)
    return out


def one_device_case(name: str) -> dict:
    cfg, params = model(name)
    return _generate(LLM(model_config=cfg, params=params, **engine_kwargs(1)))


_OP = re.compile(r"\b(all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute)"
                 r"(?:-start)?\(")


#: MoE layers of the layer case: GLM-4.5's gating (its router biased so that every token picks
#: experts 0..3: the dropless worst case, all rows on one or two devices), Qwen3-Next /
#: Qwen3.5-MoE's (softmax, the shared expert gated per token) and ERNIE-4.5-MoE's (softmax,
#: correction bias for the choice only, renormalised by max(sum, norm_min)).
LAYERS = {
    "glm4_moe": MODELS["glm4_moe"]["moe"].replace(layers=(0,)),
    "qwen3_next": MoEConfig(16, 4, 16, layers=(0,), norm_topk_prob=True,
                            shared_intermediate_size=16, shared_expert_gate=True),
    "ernie4_5_moe": MoEConfig(16, 4, 16, layers=(0,), score_bias=True, norm_topk_prob=True,
                              norm_min=1e-12, shared_intermediate_size=16),
}


def layer_case() -> dict:
    """One MoE layer of each of :data:`LAYERS`, 5 rows per data shard (no model axis divides
    them): expert parallel (GLM-4.5's on every mesh, the others on (2, 4)) with both dispatches
    (dense experts; GLM-4.5's grouped-matmul experts too at (2, 4)) against the one-device
    layer.
    ``{"name/DxN/dispatch/experts": {"error", "scale", "collectives": {kind: count}}}``."""
    from jmtp.model import moe as moe_mod
    out = {}
    for name, moe_cfg in LAYERS.items():
        cfg, params = tiny_model(1, num_layers=1, moe=moe_cfg)
        p = {k: v[0] for k, v in params["layers"].items() if k in moe_mod.MOE_KEYS}
        if name == "glm4_moe":      # every token's k experts the same
            p["router_bias"] = p["router_bias"].at[:moe_cfg.num_experts_per_tok].add(50.0)
        out.update(_layer_meshes(name, cfg, p, MESHES if name == "glm4_moe" else [(2, 4)]))
    return out


def _layer_meshes(name, cfg, p, meshes):
    from jax.sharding import NamedSharding, PartitionSpec as P

    from jmtp.model import schema
    from jmtp.model import moe as moe_mod
    from jmtp.runtime.device import sharding as shd
    rows, out = 5, {}
    for dp, tp in meshes:
        x = jax.random.normal(jax.random.key(dp), (dp * rows, cfg.hidden_size))
        want = np.asarray(moe_mod.moe_ffn(cfg.moe, p, x, "dense"))
        mesh = shd.make_mesh(tp, dp)
        shardings = {k: NamedSharding(mesh, shd.logical_spec(
            schema.LAYER_AXES[k], v.shape, mesh, k, shd.mesh_rules(True))) for k, v in p.items()}
        placed = jax.device_put(p, shardings)
        specs = dict(zip(shardings, shd.data_specs(list(shardings.values()))))
        for a2a in ("allgather_reducescatter", "ragged_all_to_all"):
            for impl in ("dense", "ragged") if (name, dp, tp) == ("glm4_moe", 2, 4) else ("dense",):
                moe = cfg.moe.replace(expert_parallel=True, all2all_backend=a2a)

                def f(x, q, moe=moe, impl=impl):
                    return moe_mod.moe_ffn(moe, q, x, impl)
                fn = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P(shd.DATA), specs),
                                           out_specs=P(shd.DATA), axis_names={shd.DATA},
                                           check_vma=False))
                with shd.mesh_context(mesh):
                    got = np.asarray(fn(x, placed))
                    text = fn.lower(x, placed).compile().as_text()
                ops: dict[str, int] = {}
                for op in _OP.findall(text):
                    ops[op] = ops.get(op, 0) + 1
                out[f"{name}/{dp}x{tp}/{a2a}/{impl}"] = {
                    "error": float(np.max(np.abs(got - want))),
                    "scale": float(np.max(np.abs(want))), "collectives": ops}
    return out


def main(cases: list[str]) -> None:
    results = {}
    for case in cases:
        t0 = time.perf_counter()
        try:
            if case == "layer":
                results[case] = layer_case()
            else:
                kind, _, rest = case.partition(":")
                kv = dict(part.split("=") for part in rest.split(","))
                if kind == "one":
                    results[case] = one_device_case(kv["model"])
                else:
                    results[case] = engine_case(kv["model"], int(kv["dp"]), int(kv["tp"]),
                                                kv.get("a2a", "auto"))
        except Exception:
            results[case] = {"error": traceback.format_exc()}
        print(f"{case}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1:])
