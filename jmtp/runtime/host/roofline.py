"""A cost model of one engine step on an accelerator: memory roofline plus kernel-launch gaps.

It predicts the wall time of a decode step of ``A`` slots verifying ``t`` token rows each (plain
decoding: ``t = 1``; K drafts: ``t = K + 1``) from the model's shapes and four device figures,
and from it the speed-up of speculative decoding at a measured acceptance length. It exists so
that a prediction can be written down before a device run and confirmed or refuted by it
(``scripts/device_check.sh`` prints both; docs/performance.md, "Predicted GPU speed-up").

The step is a sequence of kernels, each taking the longest of (the XLA-fused decode step of one
device, bf16 weights):

* its bytes over HBM bandwidth (weights read once per step, the KV cache read by attention),
* its FLOPs over the bf16 matrix rate,
* a fixed *gap* per kernel (launch, tail and dependency wait of back-to-back small kernels),

summed, plus the host's own time per step (planning, outputs; serial with the device call in
today's engine). Per target layer: four matrix kernels (qkv, output projection, gate+up, down),
one attention kernel, and ``small_kernels_per_layer`` element-wise ones (norms, RoPE, the KV
write, the activation); per step: the LM head over every verified row, and ``fixed_kernels``
(embedding gather, sampling, verification, state update, block allocation). An MTP substep adds
its ``eh_proj`` matrix kernel, one decoder layer over the MTP cache and the (FR-Spec) draft LM
head. The kernel counts are assumptions of this model (named in :class:`DeviceModel`); a device
run measures the step itself.

References: the roofline model (Williams, Waterman & Patterson, CACM 2009); memory-bound decode
and speculative speed-up = acceptance length × plain step / speculative step (Leviathan et al.
2023, arXiv 2211.17192, section 3.4, with the step cost measured instead of a constant ratio).
"""
from __future__ import annotations

import dataclasses

from jmtp.model.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class DeviceModel:
    """The device and engine figures the model needs.

    Attributes:
      name: label.
      hbm_bytes_per_s: sustained HBM bandwidth (B/s).
      matmul_flops_per_s: sustained bf16 matrix rate (FLOP/s).
      kernel_gap_s: time a kernel costs at the least (s).
      host_step_s: host time per engine step outside the device call (s).
      small_kernels_per_layer: element-wise kernels per decoder layer.
      fixed_kernels: per-step kernels outside the layers, plain decoding.
      spec_fixed_kernels: the same with speculation (verification, draft bookkeeping).
    """

    name: str
    hbm_bytes_per_s: float
    matmul_flops_per_s: float
    kernel_gap_s: float = 4e-6
    host_step_s: float = 4e-4
    small_kernels_per_layer: int = 6
    fixed_kernels: int = 30
    spec_fixed_kernels: int = 60

    def replace(self, **kw) -> "DeviceModel":
        return dataclasses.replace(self, **kw)


# One H200 (SXM) as measured on the workplace's machine (KINDS.md, 2026-10/11): a device-to-device
# copy moved 4.3 TB/s (datasheet 4.8), an 8192^3 bf16 product ran at 769-798 TFLOP/s. The gap and
# the host time are assumptions: ~4 us per dependent XLA kernel on a Hopper GPU, and the engine's
# host work per step measured on the 2-core CPU (0.36-0.40 ms at batch 4, docs/performance.md).
H200 = DeviceModel("NVIDIA H200 (model)", hbm_bytes_per_s=4.3e12, matmul_flops_per_s=790e12)
H200_DATASHEET_BW = 4.8e12


@dataclasses.dataclass(frozen=True)
class StepCost:
    """Predicted decode step: ``seconds`` in all and its parts (s), bytes and FLOPs moved."""

    seconds: float
    device_seconds: float
    host_seconds: float
    kernels: int
    weight_bytes: float
    kv_bytes: float
    flops: float
    memory_floor_seconds: float     # (weights + KV) / bandwidth
    gap_seconds: float              # kernels whose gap exceeded their bytes and FLOPs

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _kernel(dev: DeviceModel, nbytes: float, flops: float) -> float:
    return max(dev.kernel_gap_s, nbytes / dev.hbm_bytes_per_s, flops / dev.matmul_flops_per_s)


def _layer_costs(cfg: ModelConfig, dev: DeviceModel, rows: int, slots: int, context: int,
                 wbytes: int, kvbytes: int):
    """(seconds, kernels, weight bytes, kv bytes, flops, gap seconds) of one dense decoder layer
    over ``rows`` query rows of ``slots`` slots, each slot reading ``context`` cached positions."""
    h, q, kv, i = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    mats = [h * (q + 2 * kv), q * h, h * 2 * i, i * h]          # qkv, o, gate+up, down
    sec = gap = 0.0
    wb = fl = 0.0
    for n in mats:
        b, f = n * wbytes, 2.0 * rows * n
        t = _kernel(dev, b, f)
        sec += t
        gap += t if t == dev.kernel_gap_s else 0.0
        wb, fl = wb + b, fl + f
    kvb = slots * context * 2 * kv * kvbytes
    attn_f = 4.0 * rows * context * q                   # QK^T and PV: 4·D per head, key and row
    t = _kernel(dev, kvb, attn_f)
    sec += t + dev.small_kernels_per_layer * dev.kernel_gap_s
    gap += (t if t == dev.kernel_gap_s else 0.0) + dev.small_kernels_per_layer * dev.kernel_gap_s
    return sec, len(mats) + 1 + dev.small_kernels_per_layer, wb, kvb, fl + attn_f, gap


def step_cost(cfg: ModelConfig, dev: DeviceModel, *, slots: int, rows_per_slot: int = 1,
              context: int = 256, mtp_substeps: int = 0, draft_vocab: int | None = None,
              weight_bytes: int = 2, kv_bytes: int = 2) -> StepCost:
    """Predicted wall time of one decode step.

    Args:
      cfg: a dense target (attention + SwiGLU layers; MoE, MLA and hybrid layers are not
        modelled).
      slots: A, decoding slots; rows_per_slot: t, verified rows per slot (1 + drafts).
      context: mean KV length per slot (positions read by attention).
      mtp_substeps: M, MTP drafting substeps run in the step (0: plain or n-gram drafting, whose
        device cost is a few gathers).
      draft_vocab: FR-Spec draft vocabulary of the MTP LM head (None: the full vocabulary).
      weight_bytes / kv_bytes: bytes per weight / cached value (2: bf16).

    Raises:
      ValueError: a non-dense target, or counts below 1 (``slots``, ``rows_per_slot``,
        ``context``) or below 0 (``mtp_substeps``).
    """
    if cfg.moe is not None or cfg.is_mla or cfg.is_hybrid:
        raise ValueError("step_cost models dense attention + SwiGLU targets only")
    if slots < 1 or rows_per_slot < 1 or context < 1 or mtp_substeps < 0:
        raise ValueError("slots, rows_per_slot and context must be >= 1, mtp_substeps >= 0")
    rows = slots * rows_per_slot
    s, k, w, kb, f, g = _layer_costs(cfg, dev, rows, slots, context, weight_bytes, kv_bytes)
    n = cfg.num_layers
    sec, kernels, wb, kvb, fl, gap = s * n, k * n, w * n, kb * n, f * n, g * n
    v, h = cfg.vocab_size, cfg.hidden_size
    head = _kernel(dev, v * h * weight_bytes, 2.0 * rows * v * h)      # LM head, every row
    sec, kernels, wb, fl = sec + head, kernels + 1, wb + v * h * weight_bytes, fl + 2.0 * rows * v * h
    gap += head if head == dev.kernel_gap_s else 0.0
    fixed = dev.spec_fixed_kernels if (rows_per_slot > 1 or mtp_substeps) else dev.fixed_kernels
    sec, kernels, gap = sec + fixed * dev.kernel_gap_s, kernels + fixed, gap + fixed * dev.kernel_gap_s
    for _ in range(mtp_substeps):
        # substep 0 runs over the committed rows, later ones over one row per slot
        r = rows if _ == 0 else slots
        eh = _kernel(dev, 2 * h * h * weight_bytes, 2.0 * r * 2 * h * h)
        s, k, w, kb, f, g = _layer_costs(cfg, dev, r, slots, context, weight_bytes, kv_bytes)
        dv = draft_vocab or v
        dh = _kernel(dev, dv * h * weight_bytes, 2.0 * slots * dv * h)
        sec += eh + s + dh + 2 * dev.kernel_gap_s          # + norms/argmax
        kernels += k + 4
        wb += 2 * h * h * weight_bytes + w + dv * h * weight_bytes
        kvb, fl = kvb + kb, fl + 2.0 * r * 2 * h * h + f + 2.0 * slots * dv * h
        gap += g + 2 * dev.kernel_gap_s + sum(t for t in (eh, dh) if t == dev.kernel_gap_s)
    return StepCost(seconds=sec + dev.host_step_s, device_seconds=sec, host_seconds=dev.host_step_s,
                    kernels=kernels, weight_bytes=wb, kv_bytes=kvb, flops=fl,
                    memory_floor_seconds=(wb + kvb) / dev.hbm_bytes_per_s, gap_seconds=gap)


def speculative_speedup(cfg: ModelConfig, dev: DeviceModel, *, slots: int, k: int,
                        acceptance_length: float, mtp: bool = True, context: int = 256,
                        draft_vocab: int | None = None, drafter_host_s: float = 0.0) -> dict:
    """Predicted speed-up of K-draft speculation over plain decoding at ``slots`` slots:
    ``acceptance_length × cost(plain) / cost(speculative)`` (both steps of this module).

    ``mtp``: MTP drafting with ``num_model_steps = K`` (K substeps per step); False: n-gram or
    host drafting (no substep). ``drafter_host_s``: seconds per step the drafter adds on the
    host, serial with the device call (suffix decoding's trees; ``suffix_host_seconds`` over
    the steps of a CPU run), added to the speculative step. Returns ``{"speedup", "plain",
    "spec"}`` (costs as dicts; ``spec["seconds"]`` includes ``drafter_host_s``) and the
    predicted tokens/s of each.

    Raises:
      ValueError: ``drafter_host_s`` below 0 (and as :func:`step_cost`).
    """
    if drafter_host_s < 0:
        raise ValueError(f"drafter_host_s must be >= 0, got {drafter_host_s}")
    plain = step_cost(cfg, dev, slots=slots, context=context)
    spec = step_cost(cfg, dev, slots=slots, rows_per_slot=k + 1, context=context,
                     mtp_substeps=k if mtp else 0, draft_vocab=draft_vocab)
    spec_s = spec.seconds + drafter_host_s
    return {"speedup": acceptance_length * plain.seconds / spec_s,
            "plain_tok_s": slots / plain.seconds,
            "spec_tok_s": slots * acceptance_length / spec_s,
            "plain": plain.to_dict(), "spec": dict(spec.to_dict(), seconds=spec_s,
                                                   drafter_host_seconds=drafter_host_s)}


def fit_gap(cfg: ModelConfig, dev: DeviceModel, measured_plain_step_s: float, *, slots: int = 1,
            context: int = 256) -> DeviceModel:
    """``dev`` with ``kernel_gap_s`` chosen so the model's plain step of ``slots`` slots equals a
    measured one (bisection; the host time is kept): how a device run re-anchors the model."""
    lo, hi = 0.0, 1e-3
    for _ in range(60):
        mid = (lo + hi) / 2
        t = step_cost(cfg, dev.replace(kernel_gap_s=mid), slots=slots, context=context).seconds
        lo, hi = (mid, hi) if t < measured_plain_step_s else (lo, mid)
    return dev.replace(kernel_gap_s=(lo + hi) / 2)
