#!/usr/bin/env python
"""Build default engines one after another in one process, closing each, and check that the
process's memory mappings stay within a stock machine's ``vm.max_map_count`` (65,530).

XLA:CPU maps every compiled kernel on its own (``jmtp/runtime/process/host_maps.py``); an unrolled default
SmolLM2 engine holds ~18,000 mappings (15 step buckets, measured with jaxlib 0.10.2), so four of
them alive at once cross 65,530. ``LLM.close()`` releases an engine's executables and mappings
(``jmtp/runtime/device/executables.py``). The default run is the issue's A/B: plain decoding and MTP K=3,
at ``max_num_seqs`` 8 and 1, each the default ``LLM(...)`` otherwise (eager compiles, the
``"auto"`` layer loop), each generating a few tokens before it is closed. It prints the mappings
held after each build and after each close, and exits 1 if the peak plus
``jmtp.runtime.process.host_maps.RESERVE`` would not fit under ``--limit``.

    python scripts/engine_loop_maps.py                    # 4 engines, limit 65530
    nice python scripts/engine_loop_maps.py --no-close    # the same without close(): fails

Run it where ``vm.max_map_count`` is at its default to see the real thing; where it is raised
(CI), the check against ``--limit`` stands in for it.
"""
from __future__ import annotations

import argparse
import gc
import sys
import time

CONFIGS = {"plain-8": (None, 8), "mtp3-8": (3, 8), "plain-1": (None, 1), "mtp3-1": (3, 1)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"of {list(CONFIGS)}")
    ap.add_argument("--limit", type=int, default=65530, help="vm.max_map_count to check against")
    ap.add_argument("--no-close", action="store_true", help="keep every engine (shows the failure)")
    args = ap.parse_args(argv)

    import jmtp
    from jmtp.runtime.process.host_maps import RESERVE, map_count, map_limit

    def maps() -> int:
        gc.collect()
        return map_count()

    print(f"# vm.max_map_count of this machine: {map_limit()}; checked against {args.limit}")
    keep, peak, base = [], maps(), maps()
    print(f"{'engine':10} {'layer loop':10} {'buckets':>7} {'built s':>8} {'maps held':>9} "
          f"{'after close':>11}")
    for name in args.configs.split(","):
        k, b = CONFIGS[name]
        t0 = time.perf_counter()
        llm = jmtp.LLM(max_num_seqs=b, speculative_config=jmtp.SpeculativeConfig("mtp", k)
                       if k else None)
        llm.generate(["Hello, how are you?"], jmtp.SamplingParams(max_tokens=8), use_tqdm=False)
        built = maps()
        peak = max(peak, built)
        eng = llm.llm_engine
        row = (f"{name:10} {eng.layer_loop:10} {len(eng.compiled_buckets):7d} "
               f"{time.perf_counter() - t0:8.1f} {built - base:9d}")
        if args.no_close:
            keep.append(llm)
            print(row, flush=True)
            continue
        llm.close()
        del llm
        print(f"{row} {maps() - base:11d}", flush=True)
    ok = peak + RESERVE <= args.limit
    print(f"# peak {peak} mappings (base {base}) + reserve {RESERVE} "
          f"{'<=' if ok else '>'} {args.limit}: {'OK' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
