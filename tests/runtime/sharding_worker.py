"""Multi-device half of ``tests/runtime/test_sharding.py``: run in a subprocess whose
``XLA_FLAGS`` give 8 CPU devices (the flag must be set before JAX starts its backend, so the
pytest process, whose JAX already runs on one device, cannot do it).

``python -m tests.runtime.sharding_worker CASE...`` prints one JSON line ``{CASE: result}``.
A case is ``dp=D,tp=N,k=K[,hlo=1][,heads=Nq/Nkv][,kv=int8][,moe=1]`` (``moe=1``: the tiny MoE
target ``conftest.TINY_MOE`` with those heads; greedy and seeded sampled tokens of
:data:`PROMPTS` on a ``data_parallel_size=D, tensor_parallel_size=N`` engine, MTP with ``K`` drafts or
none for 0, ``kv`` its ``kv_cache_dtype``, the number of compiled step executables, whether the donated cache was given up,
per-parameter bytes on the first device, and with ``hlo=1`` the collectives of its compiled decode
step), ``errors`` (the ValueErrors of engines whose mesh does not fit the model or the devices),
``dp_host`` (the host side of data parallelism: balanced admission, per-shard preemption),
``prefix:dp=D,tp=N,k=K`` (prefix caching on that mesh), ``structured`` (constrained greedy
decoding on a (2, 2) mesh with MTP), ``hybrid`` (the tiny gated-DeltaNet target with MTP on a
(2, 2) mesh, and its hand-off to and from one device), ``handoff`` (prefill → decode hand-off
between TP=2 and one device, both ways), ``tie`` (greedy verification of
vocabulary-sharded logits with tied maxima on different shards) or ``attention`` (every attention
implementation under ``shard_map``).
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

from jmtp.runtime.config import SpeculativeConfig
from jmtp.runtime.device import sharding as shd
from jmtp.runtime.host.llm import LLM, SamplingParams
from tests.runtime.conftest import TINY_MOE, tiny_model, engine_of

# 8 kv heads and 8 query heads (head_dim 8): every TP in {2, 4, 8} splits whole heads, the
# vocabulary (64) and the MLP (64).
MODEL = dict(num_heads=8, num_kv_heads=8)
PROMPTS = [[5, 6, 7], list(range(2, 13)), [9, 3]]
MAX_TOKENS = 8
# One slot and a 4-token budget per data shard (the 11-token prompt runs as three prefill chunks);
# every step runs in the largest bucket, one step program per engine (compile time dominates).
# With 3 prompts, some slots are padding at some steps for every data_parallel_size.
ENGINE = dict(max_model_len=32, block_size=4, compile="largest")


def engine_sizes(dp: int = 1) -> dict:
    return dict(ENGINE, max_num_seqs=dp, max_num_batched_tokens=4 * dp)


def model(heads: str = "8/8", moe: bool = False):
    """The tiny model with ``"Nq/Nkv"`` heads (``"9/3"``: SmolLM2's head counts; its vocabulary
    and MLP (64) then split into no whole thirds and stay replicated); with ``moe`` the MoE target
    of ``conftest.TINY_MOE`` (each routed expert's and the shared expert's intermediate width
    split over ``model``)."""
    nq, nkv = (int(x) for x in heads.split("/"))
    return tiny_model(0, **dict(MODEL, num_heads=nq, num_kv_heads=nkv, **(TINY_MOE if moe else {})))


def make_llm(dp: int, tp: int, k: int, heads: str = "8/8", kv: str | None = None,
             moe: bool = False) -> LLM:
    cfg, params = model(heads, moe)
    spec = SpeculativeConfig("mtp", k) if k else None
    # async scheduling on (the default for GPU/TPU, off on CPU): the mesh cases run the
    # overlapped loop and the (2, 2) ones compare it with the synchronous loop
    return LLM(model_config=cfg, params=params, speculative_config=spec, kv_cache_dtype=kv,
               data_parallel_size=dp, tensor_parallel_size=tp, async_scheduling=True,
               **engine_sizes(dp))


def param_bytes(llm) -> list:
    """``[path, bytes on device 0, total bytes, sharded]`` per parameter."""
    out = []
    for path, a in jax.tree_util.tree_leaves_with_path(llm.llm_engine.runner.params):
        spec = a.sharding.spec if hasattr(a.sharding, "spec") else ()
        out.append([jax.tree_util.keystr(path), int(a.addressable_shards[0].data.nbytes),
                    int(a.nbytes), any(s is not None for s in spec)])
    return out


_OP = re.compile(r"= (\w+)\[([\d,]*)\][^ ]* (all-gather|all-reduce|all-to-all|"
                 r"collective-permute|reduce-scatter)(?:-start)?\(")


def collectives(llm) -> dict:
    """Compile the engine's decode step (bucket T=1, A=1) and list its collectives
    ``[op, dtype, result shape]``, with every weight shape (stacked, and one layer's slice)."""
    from jmtp.runtime.device.buckets import StepBucket
    eng = llm.llm_engine
    runner = engine_of(eng).runner
    with shd.mesh_context(eng.runner.mesh):
        text = runner.jitted_step.lower(*runner.step_args(StepBucket(1, 1))).compile().as_text()
    ops = [[m.group(3), m.group(1), [int(x) for x in m.group(2).split(",") if x]]
           for m in _OP.finditer(text)]
    weights = set()
    for path, a in jax.tree_util.tree_leaves_with_path(eng.runner.params):
        weights.add(tuple(a.shape))
        if "layers" in jax.tree_util.keystr(path) or "mtp" in jax.tree_util.keystr(path):
            weights.add(tuple(a.shape[1:]))   # one layer's slice inside the scan
    return {"collectives": ops, "weight_shapes": sorted(w for w in weights if len(w) >= 2)}


def run_case(dp: int, tp: int, k: int, hlo: bool = False, heads: str = "8/8",
             kv: str | None = None, moe: bool = False) -> dict:
    from jmtp.runtime.device.buckets import step_buckets
    llm = make_llm(dp, tp, k, heads, kv, moe)
    eng = llm.llm_engine
    first_cache = eng.runner.cache.k
    # jit objects of equal function and options share their executables: count this engine's
    compiled_before = engine_of(eng).runner.jitted_step._cache_size()
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS), use_tqdm=False)
    sampled = llm.generate(PROMPTS, [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8,
                                                    seed=100 + i) for i in range(len(PROMPTS))],
                           use_tqdm=False)
    out = {"tokens": [o.outputs[0].token_ids for o in outs],
           "sampled": [o.outputs[0].token_ids for o in sampled],
           # one executable per bucket used (stable shardings: no recompiles), the donated cache
           # updated in place (its first buffer given up)
           "step_executables": engine_of(eng).runner.jitted_step._cache_size() - compiled_before,
           "num_buckets": len(step_buckets(engine_of(eng).runner.shard_config)),
           "cache_donated": first_cache.is_deleted(),
           "params": param_bytes(llm), "memory": eng.memory_per_device(),
           "cache_spec": str(getattr(eng.runner.cache.k.sharding, "spec", None)),
           "scale_spec": (str(getattr(eng.runner.cache.k_scale.sharding, "spec", None))
                          if eng.runner.cache.k_scale is not None else None),
           "cache_dtype": str(eng.runner.cache.k.dtype),
           "free_blocks": eng.get_stats()["num_free_blocks"],
           "num_blocks": eng.engine_config.num_blocks}
    if (dp, tp) == (2, 2):      # the same requests with the synchronous loop (issue 50)
        out["async_on"] = eng.async_scheduling
        eng.async_scheduling = False
        out["sync_tokens"] = [o.outputs[0].token_ids for o in llm.generate(
            PROMPTS, SamplingParams(max_tokens=MAX_TOKENS), use_tqdm=False)]
        out["sync_sampled"] = [o.outputs[0].token_ids for o in llm.generate(
            PROMPTS, [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, seed=100 + i)
                      for i in range(len(PROMPTS))], use_tqdm=False)]
    if hlo:
        out["hlo"] = collectives(llm)
    return out


def errors_case() -> dict:
    """The messages of engines the mesh sizes do not fit (no compile)."""
    cfg, params = model()
    out = {}
    for name, kw in {"tp3": dict(tensor_parallel_size=3),
                     "dp2_seqs3": dict(data_parallel_size=2, max_num_seqs=3),
                     "dp4_blocks": dict(data_parallel_size=4, max_num_seqs=4, num_blocks=16),
                     "tp16": dict(tensor_parallel_size=16)}.items():
        try:
            LLM(model_config=cfg, params=params, **dict(engine_sizes(), **kw))
            out[name] = None
        except ValueError as e:
            out[name] = str(e)
    return out


def dp_host_case() -> dict:
    """Data parallel 2 × 2 slots with 8 KV blocks per shard (block 4): 4 requests whose
    sequences outgrow their shard's pool, greedy MTP K=3. Reports the (shard, row) each request
    was admitted to first, the preemptions, the greedy tokens and the free blocks at the end."""
    cfg, params = model()
    llm = LLM(model_config=cfg, params=params, speculative_config=SpeculativeConfig("mtp", 3),
              data_parallel_size=2, max_num_seqs=4, num_blocks=16, max_model_len=24,
              block_size=4, max_num_batched_tokens=16, compile="largest")
    eng = llm.llm_engine
    prompts = [[5, 6, 7], [9, 3, 1, 4], [2, 8], [7, 7, 7, 7, 7]]
    for i, p in enumerate(prompts):
        eng.add_request(str(i), p, SamplingParams(max_tokens=14))
    eng.step()
    first_slots = {seq.group.request_id: seq.slot for seq in engine_of(eng).scheduler.slots if seq is not None}
    done = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o.outputs[0].token_ids
    stats = eng.get_stats()
    return {"first_slots": first_slots, "tokens": [done[str(i)] for i in range(len(prompts))],
            "prompts": prompts, "max_tokens": 14, "num_preemptions": stats["num_preemptions"],
            "free_blocks": stats["num_free_blocks"], "num_blocks": stats["num_blocks"],
            "free_per_shard": list(engine_of(eng).runner.free_counts)}


PREFIX_BASE = list(range(2, 14))   # three full blocks of 4 shared by three of the prompts
PREFIX_PROMPTS = [PREFIX_BASE + [20], PREFIX_BASE + [21, 22], [5, 6, 7], PREFIX_BASE + [23]]


def prefix_case(dp: int, tp: int, k: int) -> dict:
    """Prefix caching on a ``(dp, tp)`` mesh (one cache per data shard): greedy tokens of
    :data:`PREFIX_PROMPTS` run twice through one engine (the second round reads the blocks the
    first cached), the hit rate after each round, and the free + cached blocks at the end."""
    cfg, params = model()
    llm = LLM(model_config=cfg, params=params,
              speculative_config=SpeculativeConfig("mtp", k) if k else None,
              data_parallel_size=dp, tensor_parallel_size=tp, max_num_seqs=2 * dp,
              max_model_len=32, block_size=4, max_num_batched_tokens=8 * dp, compile="largest",
              enable_prefix_caching=True)
    rounds, rates = [], []
    for _ in range(2):
        outs = llm.generate(PREFIX_PROMPTS, SamplingParams(max_tokens=MAX_TOKENS), use_tqdm=False)
        rounds.append([o.outputs[0].token_ids for o in outs])
        rates.append(llm.llm_engine.get_stats()["prefix_cache_hit_rate"])
    stats = llm.llm_engine.get_stats()
    return {"rounds": rounds, "hit_rates": rates, "num_blocks": stats["num_blocks"],
            "free_plus_cached": stats["num_free_blocks"] + stats["num_cached_blocks"]}


def handoff_case() -> dict:
    """Prefill → decode hand-off between a TP=2 engine and a one-device engine, both ways (MTP
    K=3): the greedy tokens of :data:`PROMPTS` each prefilled on one and decoded on the other."""
    cfg, params = model()
    make = lambda tp: LLM(model_config=cfg, params=params,
                          speculative_config=SpeculativeConfig("mtp", 3), tensor_parallel_size=tp,
                          **engine_sizes())
    engines = {"tp2": make(2), "tp1": make(1)}
    out = {}
    for src, dst in (("tp2", "tp1"), ("tp1", "tp2")):
        a, b = engines[src].llm_engine, engines[dst].llm_engine
        tokens = []
        for i, p in enumerate(PROMPTS):
            b.import_request(a.prefill_request(f"r{i}", p, SamplingParams(max_tokens=MAX_TOKENS)))
            done = None
            while b.has_unfinished_requests():
                done = next((o.outputs[0].token_ids for o in b.step() if o.finished), done)
            tokens.append(done)
        out[f"{src}->{dst}"] = {"tokens": tokens,
                                "free": [a.get_stats()["num_free_blocks"],
                                         b.get_stats()["num_free_blocks"]],
                                "num_blocks": [a.engine_config.num_blocks,
                                               b.engine_config.num_blocks]}
    return out


def tie_case() -> dict:
    """Greedy verification of vocabulary-sharded logits whose two maxima (exactly equal, or
    1 ulp apart) lie on different shards: per TP, ``accept_num`` / ``accept_tokens`` as every
    device holds them (all must agree, and equal the one-device result)."""
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    from jmtp.runtime.host.sampling_params import SamplingParams as SP
    from jmtp.runtime.host.sampling_rows import pack_sampling
    from jmtp.runtime.device.verify import verify

    V, K = 64, 3
    lo, hi = 5, 40            # shard 0, and shard 1 of 2 (shard 5 of 8)
    logits = np.zeros((3, K + 1, V), np.float32)
    logits[:, :, lo] = logits[:, :, hi] = 1.0
    logits[2, :, hi] = np.nextafter(np.float32(1.0), np.float32(2.0))   # near tie: hi wins
    drafts = np.array([[lo] * K, [hi] * K, [hi] * K], np.int32)
    args = (drafts, np.full((3,), K, np.int32), None,
            pack_sampling([SP(), SP(), SP()], 3, V), np.zeros((3,), np.int32),
            np.array([1], np.int32))
    fn = jax.jit(lambda lg, *a: verify(lg, *a))
    out = {}
    for tp in (1, 2, 8):
        lg = jnp.asarray(logits)
        mesh = None
        if tp > 1:
            mesh = shd.make_mesh(tp)
            lg = jax.device_put(lg, NamedSharding(mesh, P(None, None, shd.MODEL)))
        with shd.mesh_context(mesh):
            res = fn(lg, *args)
        out[tp] = {"accept_num": [np.asarray(s.data).tolist()
                                  for s in res.accept_num.addressable_shards],
                   "accept_tokens": [np.asarray(s.data).tolist()
                                     for s in res.accept_tokens.addressable_shards]}
    return out


def attention_case() -> dict:
    """Every ragged paged attention implementation (the Pallas kernels in interpret mode) under
    ``shard_map`` over the kv heads, TP 2 and 4 on 4 kv heads: ``{"tp/impl": [max |error|
    against the one-device reference, shard_map in the lowered graph, output spec]}``."""
    from jax.sharding import NamedSharding

    from jmtp.pallas import ragged_paged_attention as rpa
    from tests.pallas.attention_test_base import Config, build_case, reference_output

    case = build_case(Config(8, 4, 2, 64, num_tokens=16, num_seqs=2, max_kv=20), [3, 9], [20, 9],
                      stale_tables=True, seed=5)
    want = np.asarray(reference_output(case))
    args = case.jax_args()
    out = {}
    for tp in (2, 4):
        mesh = shd.make_mesh(tp)
        heads, cache, _ = shd.attention_specs()
        q, k, v = (jax.device_put(a, NamedSharding(mesh, spec))
                   for a, spec in zip(args[:3], (heads, cache, cache)))
        for impl in rpa.IMPLEMENTATIONS:
            f = jax.jit(lambda *a, impl=impl: rpa.ragged_paged_attention(
                *a, **case.kwargs(), implementation=impl, interpret=True))
            with shd.mesh_context(mesh):
                got = f(q, k, v, *args[3:])
                text = f.lower(q, k, v, *args[3:]).as_text()
            n = int(case.cu_q_lens[-1])                # real rows (padding rows: zeros)
            err = float(np.max(np.abs(np.asarray(got)[:n] - want[:n])))
            out[f"{tp}/{impl}"] = [err, "manual_computation" in text or "shard_map" in text,
                                   str(got.sharding.spec)]
    return out


def structured_case():
    """Constrained greedy tokens (the tiny JSON schema) on a (2, 2) mesh with MTP K=3."""
    from jmtp.runtime.host.structured import StructuredOutputsParams
    from tests.runtime.structured_fixtures import SCHEMA, VOCAB_SIZE, tiny_tokenizer
    cfg, params = tiny_model(0, vocab_size=VOCAB_SIZE, **MODEL)
    llm = LLM(model_config=cfg, params=params, tokenizer=tiny_tokenizer(),
              speculative_config=SpeculativeConfig("mtp", 3, 3), data_parallel_size=2,
              tensor_parallel_size=2, max_num_seqs=4, max_model_len=64, block_size=4,
              max_num_batched_tokens=16, compile="largest", async_scheduling=True)
    sp = SamplingParams(max_tokens=24, structured_outputs=StructuredOutputsParams(json=SCHEMA))
    outs = llm.generate(STRUCTURED_PROMPTS, sp, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


STRUCTURED_PROMPTS = ["ab", "hello", "{x}"]


def hybrid_case():
    """Greedy tokens of the tiny hybrid (gated-DeltaNet) target with MTP K=2 on a
    (data, model) = (2, 2) mesh (chunked prefill, the recurrent state pool stacked per data
    shard with its value heads over ``model``), and the pool's sharding."""
    from tests.runtime.conftest import TINY_HYBRID
    cfg, params = tiny_model(0, **TINY_HYBRID)
    llm = LLM(model_config=cfg, params=params, speculative_config=SpeculativeConfig("mtp", 2, 2),
              data_parallel_size=2, tensor_parallel_size=2, max_num_seqs=4, max_model_len=32,
              block_size=4, max_num_batched_tokens=12, compile="largest", async_scheduling=True)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS), use_tqdm=False)
    rec = engine_of(llm).runner.cache.linear.recurrent
    out = {"tokens": [o.outputs[0].token_ids for o in outs],
           "spec": [str(a) for a in rec.sharding.spec], "shape": list(rec.shape),
           "local": list(rec.addressable_shards[0].data.shape)}
    out["async_on"], llm.llm_engine.async_scheduling = llm.llm_engine.async_scheduling, False
    out["sync_tokens"] = [o.outputs[0].token_ids for o in llm.generate(
        PROMPTS, SamplingParams(max_tokens=MAX_TOKENS), use_tqdm=False)]
    # the hand-off carries the recurrent state between this (data, model) = (2, 2) engine and a
    # one-device one, both ways
    one = LLM(model_config=cfg, params=params, speculative_config=SpeculativeConfig("mtp", 2, 2),
              max_num_seqs=2, max_model_len=32, block_size=4, max_num_batched_tokens=6,
              compile="largest")
    out["handoff"] = {}
    for name, a, b in (("tp2->tp1", llm, one), ("tp1->tp2", one, llm)):
        states = a.prefill(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS))
        out["handoff"][name] = [o.token_ids for o in b.import_request(states, use_tqdm=False)]
    return out


def main(cases: list[str]) -> None:
    results = {}
    for case in cases:
        t0 = time.perf_counter()
        try:
            if case == "errors":
                results[case] = errors_case()
            elif case == "tie":
                results[case] = tie_case()
            elif case == "attention":
                results[case] = attention_case()
            elif case == "dp_host":
                results[case] = dp_host_case()
            elif case == "handoff":
                results[case] = handoff_case()
            elif case == "structured":
                results[case] = structured_case()
            elif case == "hybrid":
                results[case] = hybrid_case()
            elif case.startswith("prefix:"):
                kv = dict(part.split("=") for part in case[len("prefix:"):].split(","))
                results[case] = prefix_case(int(kv["dp"]), int(kv["tp"]), int(kv["k"]))
            else:
                kv = dict(part.split("=") for part in case.split(","))
                results[case] = run_case(int(kv["dp"]), int(kv["tp"]), int(kv["k"]),
                                         bool(int(kv.get("hlo", 0))), kv.get("heads", "8/8"),
                                         kv.get("kv"), bool(int(kv.get("moe", 0))))
        except Exception:
            results[case] = {"error": traceback.format_exc()}
        print(f"{case}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1:])
