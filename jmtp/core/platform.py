"""The platform an engine is compiled for, named once and passed down explicitly.

Every backend-dependent choice of the engine (attention and allocator implementations, whether a
Pallas kernel runs in interpret mode, the MoE expert path, the layer loop, the default dtype) is
made from a platform name given here, resolved once from the devices the engine runs on (or from
a compile-only TPU topology, :mod:`jmtp.aot`). Nothing in the traced step reads
``jax.default_backend()``: compiling on a CPU host for TPU devices then produces the TPU program
(Mosaic kernels included), not the CPU one. (A choice that depends only on the platform XLA lowers
for, with no engine-level meaning, uses ``jax.lax.platform_dependent`` instead.)
"""
from __future__ import annotations

from typing import Sequence

import jax

#: Platform names jmtp knows (``jax.Device.platform`` values, CUDA/ROCm folded into ``"gpu"``).
PLATFORMS = ("cpu", "gpu", "tpu")
_ALIASES = {"cuda": "gpu", "rocm": "gpu"}


def platform_name(name: str) -> str:
    """``name`` as one of :data:`PLATFORMS` (``"cuda"``/``"rocm"`` -> ``"gpu"``).

    Raises:
      ValueError: an unknown platform.
    """
    p = _ALIASES.get(str(name).lower(), str(name).lower())
    if p not in PLATFORMS:
        raise ValueError(f"platform must be one of {PLATFORMS} (or cuda/rocm), got {name!r}")
    return p


def host_platform() -> str:
    """The platform of this process's default backend (``jax.default_backend()``)."""
    return platform_name(jax.default_backend())


def platform_of(devices: Sequence[jax.Device]) -> str:
    """The one platform of ``devices`` (real or compile-only topology devices).

    Raises:
      ValueError: no devices, or devices of several platforms.
    """
    names = {platform_name(d.platform) for d in devices}
    if len(names) != 1:
        raise ValueError(f"devices must share one platform, got {sorted(names) or 'none'}")
    return names.pop()


def kernel_interpret(kernel_platform: str, platform: str) -> bool:
    """Whether a Pallas kernel written for ``kernel_platform`` runs in interpret mode when the
    engine is compiled for ``platform`` (interpret iff they differ)."""
    return platform_name(kernel_platform) != platform_name(platform)


__all__ = ["PLATFORMS", "platform_name", "host_platform", "platform_of", "kernel_interpret"]
