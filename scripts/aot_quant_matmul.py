#!/usr/bin/env python
"""What XLA:TPU makes of jmtp's 8-bit matmuls, compiled for a TPU topology on this machine.

Each of :mod:`jmtp.model.quant`'s helpers (``matmul``, ``expert_matmul``, ``ragged_dot``) on a
DeepSeek-V3-sized weight is compiled with libtpu's compiler for compile-only devices
(``jax.jit(...).lower().compile()``, no TPU needed), next to the bf16 weight and to the naive
form that dequantises the weight first (``x @ (value · scale)``); the table gives the compiler's
argument and temporary bytes per call. Temporaries near 0 mean the conversion and the scales
were fused into the dot (the weight is read 8-bit from HBM); temporaries the size of the weight in
bf16 mean a dequantised copy was materialised.

    python scripts/aot_quant_matmul.py --topology v5e:1x1
"""
from __future__ import annotations

import argparse


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--topology", default="v5e:1x1")
    ap.add_argument("--experts", type=int, default=32,
                    help="routed experts on the device (DeepSeek-V3: 256 over the expert-parallel "
                         "devices)")
    args = ap.parse_args(argv)
    import jax
    import jax.numpy as jnp
    from jax.sharding import SingleDeviceSharding

    from jmtp.aot import topology_devices
    from jmtp.model import quant

    dev = topology_devices(args.topology)[0]
    sds = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt,                   # noqa: E731
                                                 sharding=SingleDeviceSharding(dev))
    bf16, f8, i8, f32 = jnp.bfloat16, jnp.float8_e4m3fn, jnp.int8, jnp.float32
    k, n, e, i = 7168, 18432, args.experts, 2048

    def qw(shape, dt, block):
        return quant.QuantizedWeight(sds(shape, dt), sds(quant.scale_shape(shape, block), f32),
                                     block)

    def naive(x, w):
        return x @ quant.dequantize(w, bf16)

    def naive_ragged(x, w, g):
        return jax.lax.ragged_dot(x, quant.dequantize(w, bf16), g)

    cases = []
    for t in (64, 2048):
        x = sds((t, k), bf16)
        cases += [
            (f"dense {k}x{n}, {t} rows", "bf16 weight", quant.matmul, (x, sds((k, n), bf16))),
            (f"dense {k}x{n}, {t} rows", "fp8 128x128, dequantise first", naive,
             (x, qw((k, n), f8, (128, 128)))),
            (f"dense {k}x{n}, {t} rows", "fp8 128x128, quant.matmul", quant.matmul,
             (x, qw((k, n), f8, (128, 128)))),
            (f"dense {k}x{n}, {t} rows", "int8 per channel, quant.matmul", quant.matmul,
             (x, qw((k, n), i8, (k, 1)))),
        ]
    x = sds((64, k), bf16)
    cases += [(f"{e} experts {k}x{i}, 64 rows", "fp8, quant.expert_matmul", quant.expert_matmul,
               (x, qw((e, k, i), f8, (128, 128))))]
    m, g = 512, sds((e,), jnp.int32)
    xr = sds((m, k), bf16)
    cases += [
        (f"ragged {e} experts {k}x{i}, {m} rows", "bf16 weight", quant.ragged_dot,
         (xr, sds((e, k, i), bf16), g)),
        (f"ragged {e} experts {k}x{i}, {m} rows", "fp8, dequantise first", naive_ragged,
         (xr, qw((e, k, i), f8, (128, 128)), g)),
        (f"ragged {e} experts {k}x{i}, {m} rows", "fp8, quant.ragged_dot", quant.ragged_dot,
         (xr, qw((e, k, i), f8, (128, 128)), g)),
        (f"ragged {e} experts {k}x{i}, {m} rows", "int8 per channel, quant.ragged_dot",
         quant.ragged_dot, (xr, qw((e, k, i), i8, (k, 1)), g)),
    ]
    print(f"# {args.topology} ({dev.device_kind}), libtpu compile-only; MiB per call")
    print("| shape | weight, path | arguments | temporaries |")
    print("|---|---|---|---|")
    for shape, what, fn, a in cases:
        with jax.default_device(dev):
            m_ = jax.jit(fn).trace(*a).lower().compile().memory_analysis()
        print(f"| {shape} | {what} | {m_.argument_size_in_bytes / 2**20:.0f} | "
              f"{m_.temp_size_in_bytes / 2**20:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
