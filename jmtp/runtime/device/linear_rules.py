"""Which implementation of the gated delta rule a hybrid model's linear layers run, per platform.

The step passes two static choices to the model (:class:`~jmtp.model.metadata.AttentionMetadata`
``linear_rule`` / ``linear_chunk_rule``):

* the **packed recurrent rule** of verify windows and short chunks (contract
  :func:`jmtp.model.gated_deltanet.gated_delta_rule_packed`);
* the **chunked rule over chunk-aligned slots** of longer prefill chunks (contract
  :func:`jmtp.model.gated_deltanet.chunk_gated_delta_rule_varlen`).

On TPU both are Mosaic kernels (:mod:`jmtp.pallas.gated_delta_rule`), on GPU Pallas Triton
kernels (:mod:`jmtp.pallas.gated_delta_rule_gpu`), elsewhere the jnp forms (None). Kernels run in
interpret mode when the engine is compiled for another platform than theirs (never, in practice:
the choice follows the platform). Mosaic and Triton kernels are not partitioned automatically, so
on a mesh each runs under ``shard_map`` over the value heads when the ``model`` axis divides them
(heads are independent), else on all of them.
"""
from __future__ import annotations

import functools

import jax
from jax.sharding import PartitionSpec as P

from jmtp.core.platform import kernel_interpret


def _sharded(kernel, rank_of: tuple[int, ...], head_axis: tuple[int | None, ...],
             out_pick: tuple[int, ...], pool_base: bool):
    """``kernel`` (positional array operands, then ``pool_base=`` when ``pool_base``) under
    ``shard_map`` over the value heads when an auto mesh is active. ``rank_of[i]`` /
    ``head_axis[i]``: operand ``i``'s rank and the axis holding the value heads (None:
    replicated); ``out_pick``: the operands whose specs the outputs take."""
    def run(*args, **kw):
        from jmtp.core import mesh as jm
        axes = jm.auto_axes()
        if not axes:
            return kernel(*args, **kw)
        tp = jm.model_axis_size()
        heads = args[0].shape[1]
        h = jm.LOGICAL_TO_MESH[jm.Q_HEADS] if (jm.MODEL in axes and heads % tp == 0) else None
        specs = tuple(P(*[(h if a == ax else None) for a in range(r)])
                      for r, ax in zip(rank_of, head_axis))
        outs = tuple(specs[i] for i in out_pick)
        if pool_base:
            base = kw.get("pool_base", 0)
            return jax.shard_map(lambda *a: kernel(*a[:-1], pool_base=a[-1]),
                                 in_specs=specs + (P(),), out_specs=outs, axis_names=axes,
                                 check_vma=False)(*args, base)
        return jax.shard_map(kernel, in_specs=specs, out_specs=outs, axis_names=axes,
                             check_vma=False)(*args)
    return run


# operands: q, k, v, g, beta, row_seq, row_start, row_ckpt, init, pool -> (o, pool)
_PACKED = dict(rank_of=(3, 3, 3, 2, 2, 1, 1, 1, 4, 5),
               head_axis=(1, 1, 1, 1, 1, None, None, None, 1, 2), out_pick=(2, 9), pool_base=True)
# operands: q, k, v, g, beta, chunk_seq, chunk_first, chunk_last, init -> (o, final)
_CHUNKED = dict(rank_of=(3, 3, 3, 2, 2, 1, 1, 1, 4),
                head_axis=(1, 1, 1, 1, 1, None, None, None, 1), out_pick=(2, 8), pool_base=False)


@functools.lru_cache(maxsize=None)
def linear_rules_for(platform: str) -> tuple:
    """``(packed rule, chunked rule)`` of a hybrid model's linear layers on ``platform`` (None:
    the jnp form)."""
    if platform == "tpu":
        from jmtp.pallas import gated_delta_rule as tpu
        from jmtp.pallas import gated_delta_rule_varlen as tpu_varlen
        interp = kernel_interpret("tpu", platform)
        packed = functools.partial(tpu.gated_delta_rule_packed_pallas, interpret=interp)
        chunked = functools.partial(tpu_varlen.chunk_gated_delta_rule_varlen_pallas,
                                    interpret=interp)
        return _sharded(packed, **_PACKED), _sharded(chunked, **_CHUNKED)
    if platform == "gpu":
        from jmtp.pallas import gated_delta_rule_gpu as gpu
        interp = kernel_interpret("gpu", platform)
        packed = functools.partial(gpu.gated_delta_rule_packed_gpu, interpret=interp)
        chunked = functools.partial(gpu.chunk_gated_delta_rule_varlen_gpu, interpret=interp)
        return _sharded(packed, **_PACKED), _sharded(chunked, **_CHUNKED)
    return None, None


__all__ = ["linear_rules_for"]
