"""The step cost model (jmtp.runtime.host.roofline) against hand-counted bytes, FLOPs and kernels."""
from __future__ import annotations

import pytest

from jmtp.model.config import ModelConfig, MoEConfig
from jmtp.runtime.host.roofline import DeviceModel, fit_gap, speculative_speedup, step_cost

CFG = ModelConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_layers=3,
                  num_heads=4, num_kv_heads=2, head_dim=16)
H, Q, KV, I, V, L = 64, 64, 32, 128, 1000, 3
LAYER_W = H * (Q + 2 * KV) + Q * H + H * 2 * I + I * H      # qkv, o, gate+up, down
BARE = DeviceModel("test", hbm_bytes_per_s=1e12, matmul_flops_per_s=1e15, kernel_gap_s=0.0,
                   host_step_s=0.0, small_kernels_per_layer=0, fixed_kernels=0,
                   spec_fixed_kernels=0)


def test_memory_bound_step_is_bytes_over_bandwidth():
    dev = BARE.replace(matmul_flops_per_s=1e30)
    c = step_cost(CFG, dev, slots=2, rows_per_slot=1, context=10)
    weights = 2 * (L * LAYER_W + V * H)                         # bf16, LM head included
    kv = 2 * L * (2 * 10 * 2 * KV)                              # 2 slots x 10 positions, K and V
    assert c.weight_bytes == weights and c.kv_bytes == kv
    assert c.seconds == pytest.approx((weights + kv) / 1e12)
    assert c.memory_floor_seconds == pytest.approx(c.seconds)


def test_compute_bound_step_is_flops_over_rate():
    dev = BARE.replace(hbm_bytes_per_s=1e30, matmul_flops_per_s=1e9)
    rows, ctx = 2 * 4, 10
    c = step_cost(CFG, dev, slots=2, rows_per_slot=4, context=ctx)
    flops = L * (2 * rows * LAYER_W + 4 * rows * ctx * Q) + 2 * rows * V * H
    assert c.flops == pytest.approx(flops)
    assert c.seconds == pytest.approx(flops / 1e9)


def test_launch_bound_step_counts_kernels():
    dev = BARE.replace(hbm_bytes_per_s=1e30, matmul_flops_per_s=1e30, kernel_gap_s=1e-3,
                       host_step_s=5e-4, small_kernels_per_layer=6, fixed_kernels=30,
                       spec_fixed_kernels=60)
    plain = step_cost(CFG, dev, slots=1)
    assert plain.kernels == L * (4 + 1 + 6) + 1 + 30
    assert plain.seconds == pytest.approx(plain.kernels * 1e-3 + 5e-4)
    assert plain.gap_seconds == pytest.approx(plain.device_seconds)
    # an MTP substep: eh_proj, one decoder layer, the draft head, two small kernels
    spec = step_cost(CFG, dev, slots=1, rows_per_slot=3, mtp_substeps=2)
    assert spec.kernels == L * 11 + 1 + 60 + 2 * (11 + 4)
    r = speculative_speedup(CFG, dev, slots=1, k=2, acceptance_length=1.5)
    assert r["speedup"] == pytest.approx(1.5 * plain.seconds / spec.seconds)
    ngram = speculative_speedup(CFG, dev, slots=1, k=2, acceptance_length=1.5, mtp=False)
    assert ngram["spec"]["kernels"] == L * 11 + 1 + 60
    assert ngram["speedup"] > r["speedup"]
    # a host drafter's time per step is paid serially with the device call
    host = speculative_speedup(CFG, dev, slots=1, k=2, acceptance_length=1.5, mtp=False,
                               drafter_host_s=2e-3)
    spec_s = (L * 11 + 1 + 60) * 1e-3 + 5e-4 + 2e-3    # kernels x gap + host + the drafter
    assert host["spec"]["seconds"] == pytest.approx(spec_s)
    assert host["speedup"] == pytest.approx(1.5 * plain.seconds / spec_s)
    with pytest.raises(ValueError, match="drafter_host_s"):
        speculative_speedup(CFG, dev, slots=1, k=2, acceptance_length=1.5, drafter_host_s=-1)


def test_fit_gap_recovers_a_planted_gap():
    dev = DeviceModel("x", 4e12, 8e14, kernel_gap_s=3.7e-6, host_step_s=2e-4)
    t = step_cost(CFG, dev, slots=1).seconds
    got = fit_gap(CFG, dev.replace(kernel_gap_s=1e-5), t)
    assert got.kernel_gap_s == pytest.approx(3.7e-6, rel=1e-6)


def test_refuses_what_it_does_not_model():
    moe = CFG.replace(moe=MoEConfig(4, 2, 32, layers=(0,)))
    with pytest.raises(ValueError, match="dense"):
        step_cost(moe, BARE, slots=1)
    with pytest.raises(ValueError, match=">= 1"):
        step_cost(CFG, BARE, slots=0)
