"""One MoE layer on a ``(data, model)`` mesh of CPU devices: expert parallelism's two dispatches
against today's tensor-parallel experts, in one run.

For every mesh of ``--meshes`` and every row count of ``--rows`` (token rows per data shard:
1 and 16 are decode steps of 1 and 4 slots with K=3, 128 a prefill chunk) this times the MoE
FFN of one layer (:func:`jmtp.model.moe.moe_ffn`, inside the data-parallel ``shard_map`` as the
engine step runs it) in three placements:

* ``tp``: the routed experts replicated over ``data``, each expert's width split over
  ``model`` (``enable_expert_parallel=False``, GSPMD inserts the collectives);
* ``ag_rs``: expert parallelism, all-gather + reduce-scatter dispatch;
* ``ragged``: expert parallelism, ragged all-to-all dispatch. XLA:CPU has no
  ``ragged-all-to-all``, so on CPU this runs the all-gather emulation
  (:func:`jmtp.model.expert_parallel._exchange`): its time is *not* that of the real op.

and prints the warm median step time of each (``--repeats`` interleaved rounds after a warm-up;
compile time apart), the ratios to ``tp`` measured in the same run, the collectives of each
compiled layer by kind, and the routed-expert bytes per device.

**On CPU these numbers measure overhead, not scaling**: the host devices share the same cores
and the collectives are in-process copies. What a CPU run shows faithfully: the collective
counts, the bytes per device, and whether a placement adds work on the same cores (the dense
expert implementation runs every local expert on every row it holds, so ``tp`` does ``E·T``
rows per device over ``I_e/TP``, ``ag_rs`` ``E/N·DP·T`` rows over the whole ``I_e``). The TPU
collective counts of whole engine steps come from ``jmtp compile`` (``docs/moe.md``).

    python scripts/bench_expert_parallel.py                       # ~2-4 min on 2 cores
    python scripts/bench_expert_parallel.py --meshes 2x4 --rows 1,128 --experts 64 --top-k 8
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import time

_OP = re.compile(r"\b(all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute)"
                 r"(?:-start)?\(")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--meshes", default="1x8,2x4,4x2,8x1", help="DATAxMODEL, comma separated")
    ap.add_argument("--rows", default="1,16,128", help="token rows per data shard")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--expert-width", type=int, default=256)
    ap.add_argument("--shared-width", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--host-devices", type=int, default=8)
    args = ap.parse_args(argv)
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = (f"{flags} --xla_force_host_platform_device_count="
                                   f"{args.host_devices}").strip()
    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    from jmtp.model import axes as ax

    from jmtp.model import schema
    from jmtp.model import moe as moe_mod
    from jmtp.model.config import ModelConfig, MoEConfig
    from jmtp.model.params import init_params
    from jmtp.runtime.device import sharding as shd

    moe = MoEConfig(args.experts, args.top_k, args.expert_width, layers=(0,),
                    scoring="sigmoid", norm_topk_prob=True, score_bias=True,
                    shared_intermediate_size=args.shared_width)
    cfg = ModelConfig(vocab_size=256, hidden_size=args.hidden, intermediate_size=256,
                      num_layers=1, num_heads=8, num_kv_heads=8, head_dim=8, num_mtp_layers=0,
                      moe=moe)
    params = init_params(cfg, jax.random.key(0), std=0.05)
    p = {k: v[0] for k, v in params["layers"].items() if k in moe_mod.MOE_KEYS}
    print(f"# MoE layer H={args.hidden} E={args.experts} k={args.top_k} "
          f"I_e={args.expert_width} I_s={args.shared_width}, dense experts, fp32, "
          f"{len(jax.devices())} CPU devices on {os.cpu_count()} cores")
    print("| mesh | rows/shard | placement | ms (median) | / tp | collectives | "
          "expert MiB/device | compile s |")
    print("|---|---|---|---|---|---|---|---|")
    placements = {"tp": (False, "allgather_reducescatter"),
                  "ag_rs": (True, "allgather_reducescatter"),
                  "ragged": (True, "ragged_all_to_all")}
    for mesh_text in args.meshes.split(","):
        dp, tp = (int(v) for v in mesh_text.split("x"))
        mesh = shd.make_mesh(tp, dp)
        for rows in (int(r) for r in args.rows.split(",")):
            x = jax.random.normal(jax.random.key(rows), (dp * rows, args.hidden))
            fns, info = {}, {}
            for name, (ep, a2a) in placements.items():
                rules = shd.mesh_rules(ep)
                shardings = {k: NamedSharding(mesh, shd.logical_spec(schema.LAYER_AXES[k], v.shape,
                                                                     mesh, k, rules))
                             for k, v in p.items()}
                placed = jax.device_put(p, shardings)
                specs = dict(zip(shardings, shd.data_specs(list(shardings.values()))))
                m = moe.replace(expert_parallel=ep, all2all_backend=a2a)

                def f(x, q, m=m):
                    return moe_mod.moe_ffn(m, q, x, "dense")
                fn = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P(shd.DATA), specs),
                                           out_specs=P(shd.DATA), axis_names={shd.DATA},
                                           check_vma=False))
                t0 = time.perf_counter()
                with shd.mesh_context(mesh):
                    exe = fn.lower(x, placed).compile()
                compile_s = time.perf_counter() - t0
                ops: dict[str, int] = {}
                for op in _OP.findall(exe.as_text()):
                    ops[op] = ops.get(op, 0) + 1
                local = sum(placed[k].addressable_shards[0].data.nbytes for k in placed
                            if k.startswith("experts_"))
                fns[name] = (exe, placed)
                info[name] = (ops, local / 2**20, compile_s)
                jax.block_until_ready(exe(x, placed))     # warm
            times = {name: [] for name in fns}
            for _ in range(args.repeats):                   # interleaved rounds
                for name, (exe, placed) in fns.items():
                    t0 = time.perf_counter()
                    jax.block_until_ready(exe(x, placed))
                    times[name].append(time.perf_counter() - t0)
            base = statistics.median(times["tp"])
            for name in fns:
                med = statistics.median(times[name])
                ops, mib, cs = info[name]
                kinds = ", ".join(f"{k} {n}" for k, n in sorted(ops.items())) or "-"
                note = " (emulated on CPU)" if name == "ragged" else ""
                print(f"| ({dp},{tp}) | {rows} | {name}{note} | {med * 1e3:.2f} | "
                      f"{med / base:.2f} | {kinds} | {mib:.2f} | {cs:.1f} |")
            sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
