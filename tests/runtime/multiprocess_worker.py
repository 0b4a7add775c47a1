"""One process of the multi-process test (``tests/runtime/test_multiprocess.py``).

Run by ``jmtp launch -n P --devices-per-process M --exec -- python -m
tests.runtime.multiprocess_worker --mesh DP,TP --out DIR``: joins the ``jax.distributed`` job
(:func:`jmtp.runtime.process.distributed.initialize` from the launcher's variables), builds the tiny
8-kv-head model of ``sharding_worker`` on every process, serves :func:`cases` with a plain and an
MTP (K=3) engine on the global ``(DP, TP)`` mesh and writes ``DIR/p<process>.json``: the tokens of
every case, the mesh layout (device ids and owning process per mesh position) and what the
engine left (free blocks, bytes per device, whether the parameters span processes).

The mesh shape is a parameter: ``(1, 4)`` on 2 processes × 2 devices puts the model axis across
both processes; ``(2, 2)`` (data across processes) runs once data parallelism exists.
:func:`run_engine` is also what the test calls on one device for the reference.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from tests.runtime.conftest import engine_of

# Slots B=2 so that a one-request batch leaves a padding slot; a budget of 2·(K+1) tokens
# prefills the 11-token prompt in several chunks; every step runs in the largest bucket, one step
# program per engine (compile dominates).
MAX_NUM_SEQS = 2
ENGINE = dict(max_num_seqs=MAX_NUM_SEQS, max_model_len=32, block_size=4, compile="largest")
KS = (0, 3)
TEMPERATURE = 0.8


PROMPTS = [[5, 6, 7], list(range(2, 13))]
MAX_TOKENS = 8


def cases():
    """``{name: (prompts, [SamplingParams per prompt])}``: greedy and seeded sampled, on a full
    batch (2 requests, 2 slots) and a padded one (1 request, 2 slots)."""
    from jmtp.runtime.host.sampling_params import SamplingParams as SP
    greedy = SP(max_tokens=MAX_TOKENS)
    return {
        "greedy": (PROMPTS, [greedy] * len(PROMPTS)),
        "sampled": (PROMPTS, [SP(max_tokens=MAX_TOKENS, temperature=TEMPERATURE, seed=100 + i)
                              for i in range(len(PROMPTS))]),
        "greedy_padded": (PROMPTS[1:], [greedy]),
        "sampled_padded": (PROMPTS[:1], [SP(max_tokens=MAX_TOKENS, temperature=TEMPERATURE,
                                            seed=7)]),
    }


def run_engine(dp: int, tp: int, k: int) -> dict:
    """Serve :func:`cases` with one engine on a ``(dp, tp)`` mesh (``(1, 1)``: one device, no
    mesh); ``{case: [token ids per prompt]}`` plus the engine's leftovers under ``"_engine"``."""
    import jax

    from jmtp.runtime.config import SpeculativeConfig
    from jmtp.runtime.host.llm import LLM
    from jmtp.runtime.device import sharding as shd
    from tests.runtime.sharding_worker import model

    cfg, params = model()
    spec = SpeculativeConfig("mtp", k) if k else None
    llm = LLM(model_config=cfg, params=params, speculative_config=spec,
              max_num_batched_tokens=MAX_NUM_SEQS * (k + 1), tensor_parallel_size=tp,
              data_parallel_size=dp, async_scheduling=True, **ENGINE)   # (off by default on CPU)
    out = {name: [o.outputs[0].token_ids for o in llm.generate(prompts, sps, use_tqdm=False)]
           for name, (prompts, sps) in cases().items()}
    eng = llm.llm_engine
    if jax.process_count() > 1:     # the same cases with the synchronous loop (issue 50)
        out["_async_on"], eng.async_scheduling = eng.async_scheduling, False
        out["_sync"] = {name: [o.outputs[0].token_ids for o in llm.generate(prompts, sps,
                                                                           use_tqdm=False)]
                        for name, (prompts, sps) in cases().items()}
        eng.async_scheduling = out["_async_on"]
    embed = eng.runner.params["embed"][...]
    out["_engine"] = {
        "step_executables": engine_of(eng).runner.jitted_step._cache_size(),
        "free_blocks": eng.get_stats()["num_free_blocks"],
        "num_blocks": eng.engine_config.num_blocks,
        "memory": eng.memory_per_device(),
        "params_span_processes": not embed.is_fully_addressable,
        "embed_spec": str(getattr(embed.sharding, "spec", None)),
        "mesh": None if eng.runner.mesh is None else [
            [[int(d.id), int(d.process_index)] for d in row] for row in eng.runner.mesh.devices],
        "mesh_shape": (list(shd.mesh_sizes(eng.runner.mesh)) if eng.runner.mesh is not None
                       else [1, 1]),
    }
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mesh", required=True, help="DP,TP")
    ap.add_argument("--out", required=True, help="folder for p<process>.json")
    args = ap.parse_args()
    dp, tp = (int(x) for x in args.mesh.split(","))
    t0 = time.perf_counter()
    from jmtp.runtime.process import distributed
    distributed.initialize()            # from JMTP_* set by jmtp launch
    import jax
    res = {"process_index": jax.process_index(), "process_count": jax.process_count(),
           "local_devices": [int(d.id) for d in jax.local_devices()],
           "global_devices": [int(d.id) for d in jax.devices()]}
    for k in KS:
        res[f"k={k}"] = run_engine(dp, tp, k)
    res["seconds"] = time.perf_counter() - t0
    path = os.path.join(args.out, f"p{jax.process_index()}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(res, f)
    os.replace(path + ".tmp", path)
    print(f"process {jax.process_index()}: wrote {path} after {res['seconds']:.1f} s", flush=True)


if __name__ == "__main__":
    main()
