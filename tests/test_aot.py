"""Ahead-of-time compiles for TPU topologies with libtpu's real compiler (no TPU needed):
:mod:`jmtp.aot` and ``jmtp compile``.

Interpret mode cannot pass these tests: they count the Mosaic custom calls in the compiled TPU
executables. Each compile of the tiny engine takes a few seconds; the module runs in about a
minute on 2 cores.
"""
from __future__ import annotations

import json
import logging

import jax
import numpy as np
import pytest

from jmtp import aot
from jmtp.model.config import ModelConfig
from jmtp.runtime.config import SpeculativeConfig
from jmtp.runtime.host.engine_args import EngineArgs

pytestmark = pytest.mark.xdist_group("aot")

# Nkv·D = 256: the merged KV rows fill whole 128-lane tiles.
CFG = ModelConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=128, num_mtp_layers=1)
K = 2


def args(**kw) -> EngineArgs:
    base = dict(model_config=CFG, max_num_seqs=4, max_model_len=256,
                speculative_config=SpeculativeConfig(method="mtp", num_speculative_tokens=K))
    return EngineArgs(**{**base, **kw})


def expected_kernels(m: int) -> dict[str, int]:
    """Mosaic call sites of one step, from the step's structure: attention once in the scanned
    target layer and once per MTP substep (M); the allocator once for the step's allocation and
    once for releasing finished slots."""
    return {"jmtp_ragged_paged_attention_tpu": 1 + m, "jmtp_allocate_blocks_tpu": 2}


@pytest.fixture(scope="module")
def one_chip():
    """The tiny engine on one v5e chip, its pool dominating its bytes (4,096 blocks: 150+ MiB of
    KV), with its slot operations: one compile for the kernel, memory and no-copy checks."""
    return aot.compile_engine(args(num_blocks=4096), topology="v5e:1x1", buckets="largest")


def test_one_chip_compiles_the_real_kernels(one_chip):
    r = one_chip
    assert (r.platform, r.device_kind, r.num_devices) == ("tpu", "TPU v5 lite", 1)
    assert r.config["attention"] == "pallas_tpu" and r.config["dtype"] == "bfloat16"
    steps = r.step_reports
    assert steps and all(e.mosaic_kernels == expected_kernels(K) for e in steps)
    labels = {e.label for e in r.executables}
    assert {"insert", "release"} <= labels
    release = next(e for e in r.executables if e.label == "release")
    assert release.mosaic_kernels == {"jmtp_allocate_blocks_tpu": 1}
    assert all(sum(e.collectives.values()) == 0 for e in steps)   # one chip: no collectives
    assert r.fits and r.hbm_bytes == pytest.approx(16 * 2**30, rel=0.01)


def test_prediction_matches_the_compiler(one_chip):
    """jmtp's per-device bytes (params + KV + state from shapes) against the compiler's
    argument bytes of the step (the same buffers plus two i32[B] lanes): within 10 %."""
    assert abs(one_chip.prediction_error) < 0.10
    assert one_chip.compiler_argument_bytes >= one_chip.predicted["total"]


@pytest.mark.parametrize("topology,dp,tp", [("v5e:2x2", 2, 2), ("v6e:2x2", 1, 4),
                                            ("v4:2x2x1", 4, 2)])
def test_meshes_compile_with_kernels_under_shard_map(topology, dp, tp):
    """Every mesh shape compiles with the Mosaic kernels (before issue 35 any mesh failed:
    'Mosaic kernels cannot be automatically partitioned'). TP=4 > 2 kv heads replicates each kv
    head twice (jmtp.model.params.replicate_kv_heads): the pool per device is then half of the
    one-chip pool, not a quarter."""
    r = aot.compile_engine(args(tensor_parallel_size=tp, data_parallel_size=dp),
                           topology=topology, buckets="largest", slot_ops=False)
    assert r.mesh == {"data": dp, "model": tp}
    assert all(e.mosaic_kernels == expected_kernels(K) for e in r.step_reports)
    if tp > 1:   # tensor parallelism: the attention output projection reduces over heads
        assert all(e.collectives["all-reduce"] > 0 for e in r.step_reports)
    # per device: the KV pool splits over both axes, the parameters over the model axis only
    full = aot.compile_engine(args(), topology="v5e:1x1", buckets="none", slot_ops=False)
    replicas = max(1, tp // CFG.num_kv_heads)
    assert r.predicted["kv_cache"] == full.predicted["kv_cache"] * replicas // (dp * tp)


# SmolLM2's head shape: 3 kv heads of 64 lanes, rows of 192 lanes (padded to 256 on TPU)
NARROW = CFG.replace(num_heads=6, num_kv_heads=3, head_dim=64)


@pytest.mark.parametrize("cfg,topology,tp", [(CFG, "v5e:1x1", 1), (NARROW, "v5e:1x1", 1),
                                             (NARROW, "v5e:2x2", 3)])
def test_no_copy_of_the_kv_pool(cfg, topology, tp, request):
    """Temporaries stay below a quarter of the KV bytes on a pool-dominated engine. Before the
    merged cache layout the pool was laid out transposed at entry and copied whole around the
    step (SmolLM2 at 64 slots: 15.2 GiB of temporaries for 2.9 GiB of KV); merged rows of 192
    lanes still were (3.9 GiB) until each shard's row was padded to whole 128-lane tiles. The
    first case is the ``one_chip`` engine (the same configuration: compiled once)."""
    if cfg is CFG and tp == 1:
        r = request.getfixturevalue("one_chip")
    else:
        r = aot.compile_engine(args(model_config=cfg, num_blocks=4096, tensor_parallel_size=tp),
                               topology=topology, buckets="largest", slot_ops=False)
    kv = r.predicted["kv_cache"]
    assert kv * tp > 150 * 2**20
    for e in r.step_reports:
        assert e.temp_bytes < kv / 4, (e.label, e.temp_bytes, kv)
    assert all(e.mosaic_kernels == expected_kernels(K) for e in r.step_reports)


def test_int8_cache(caplog):
    """An int8 cache compiles: with block_size 128 through the Mosaic attention kernel; with
    block_size 16 (the kernel's scale DMAs would be lane-misaligned, which Mosaic refuses) the
    engine falls back to the XLA attention with a logged reason."""
    r = aot.compile_engine(args(kv_cache_dtype="int8", block_size=128, max_model_len=512),
                           topology="v5e:1x1", buckets="largest", slot_ops=False)
    assert all(e.mosaic_kernels == expected_kernels(K) for e in r.step_reports)
    assert r.config["kv_cache_dtype"] == "int8"
    with caplog.at_level(logging.WARNING, logger="jmtp.runtime.host.engine_args"):
        r16 = aot.compile_engine(args(kv_cache_dtype="int8"), topology="v6e:1x1",
                                 buckets="largest", slot_ops=False)
    assert "attention runs the 'xla' implementation" in caplog.text
    assert r16.config["attention"] == "xla"
    assert all(e.mosaic_kernels == {"jmtp_allocate_blocks_tpu": 2} for e in r16.step_reports)


def test_compile_only_executables_stay_out_of_the_persistent_cache(tmp_path):
    """With JAX's persistent cache set, a compile for a topology writes nothing to it (before, each
    compile-only executable was serialized there, and one found again failed to load with a
    warning); the cache is used again after it."""
    from jax.experimental.compilation_cache import compilation_cache as cc

    from jmtp.runtime.process.compile import setup_compilation_cache
    before = jax.config.jax_compilation_cache_dir
    setup_compilation_cache(str(tmp_path))
    try:
        aot.compile_engine(args(speculative_config=None, max_model_len=64), topology="v5e:1x1",
                           buckets="decode", slot_ops=False)
        assert list(tmp_path.iterdir()) == []
        assert jax.config.jax_enable_compilation_cache
        jax.jit(lambda x: x * 3 + 1)(np.arange(7))          # a CPU program: cached as before
        assert list(tmp_path.iterdir())
    finally:
        jax.config.update("jax_compilation_cache_dir", before)
        cc.reset_cache()


def test_platform_comes_from_the_devices_not_the_host():
    """Built for TPU devices on a CPU host, every backend choice is the TPU one."""
    assert jax.default_backend() == "cpu"
    runner = args(abstract=True, devices=aot.topology_devices("v5e:1x1")).build().runner
    ec = runner.engine_config
    assert ec.platform == "tpu" and runner.attention.implementation == "pallas_tpu"
    assert runner.cache.k.dtype == np.dtype("bfloat16")
    leaves = jax.tree_util.tree_leaves(runner.params)
    assert leaves and all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)   # no arrays
    with pytest.raises(RuntimeError, match="abstract"):
        runner.run_step(runner.uncompiled_buckets()[0], np.zeros(4, np.int32),
                        np.zeros(4, np.int32))


def test_bad_topology_and_arguments():
    with pytest.raises(ValueError, match="v5e:2x2"):
        aot.topology_devices("v5e")
    with pytest.raises(ValueError, match="cannot describe TPU topology"):
        aot.topology_devices("v99:2x2")
    with pytest.raises(ValueError, match="memory_fraction"):
        aot.compile_engine(args(), topology="v5e:1x1", memory_fraction=1.5)
    with pytest.raises(ValueError, match="model_config"):
        EngineArgs(abstract=True).build()


def test_compile_command(tmp_path, capsys):
    """``jmtp compile`` on an HF config.json: the table on stdout, JSON and markdown files, the
    largest num_blocks that fits, serialized executables."""
    from jmtp.cli import main
    hf = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 512,
          "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 128,
          "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 1024,
          "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2}
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(hf))
    out_json, out_md = tmp_path / "r.json", tmp_path / "r.md"
    rc = main(["compile", "--model", str(cfg), "--topology", "v5e:1x1", "--max-num-seqs", "4",
               "--max-model-len", "256", "--num-speculative-tokens", "1", "--buckets", "largest",
               "--fit", "--json", str(out_json), "--markdown", str(out_md),
               "--serialize-dir", str(tmp_path / "exe")])
    assert rc == 0
    assert "| config.json | v5e:1x1 | (1,1) |" in capsys.readouterr().out
    rep = json.loads(out_json.read_text())[0]
    assert rep["fits"] and rep["max_num_blocks"] > rep["config"]["num_blocks"]
    assert "### config.json on v5e:1x1 (1 x TPU v5 lite)" in out_md.read_text()
    assert sorted(p.name for p in (tmp_path / "exe" / "v5e_1x1").iterdir())


def test_an_engine_that_does_not_fit():
    """A pool larger than the chip (18.3 GiB of KV on a 16 GiB v5e): the compiler's RESOURCE_EXHAUSTED becomes a ValueError naming
    the blocks; with ``fit`` the blocks are halved until the engine compiles, and the report
    gives the largest num_blocks that fits and the number asked for."""
    big = args(num_blocks=600_000, speculative_config=None, max_model_len=64)
    with pytest.raises(ValueError, match="does not fit v5e:1x1 at num_blocks=600000"):
        aot.compile_engine(big, topology="v5e:1x1", buckets="largest", slot_ops=False)
    r = aot.compile_engine(big, topology="v5e:1x1", buckets="largest", slot_ops=False, fit=True)
    assert r.requested_num_blocks == 600_000 and r.config["num_blocks"] == 300_000
    assert r.fits and 300_000 <= r.max_num_blocks < 600_000
    assert "(asked 600000: no fit)" in r.summary_row()["max num_blocks"]


def test_part_of_a_slice_and_no_buckets():
    """An engine on fewer devices than the topology has says so in its report; buckets='none'
    reports jmtp's own prediction without a step (no crash on the empty step list)."""
    r = aot.compile_engine(args(tensor_parallel_size=2), topology="v5e:2x2", buckets="none",
                           slot_ops=False)
    assert r.topology == "v5e:2x2 (2 of 4 devices)" and r.executables == []
    assert r.compiler_argument_bytes is None and r.prediction_error is None
    row = r.summary_row()
    assert row["Mosaic kernels/step"] == "-" and row["compiler/jmtp args"] == "-"
    assert r.peak_bytes == r.predicted["total"]


def test_handoff_fingerprint_covers_the_row_layout():
    """Exported KV pages are raw cache rows: engines whose rows differ in width, or are padded
    per different shard counts at the same width (2 heads of 96 lanes: one 256-lane row at TP 1,
    two 128-lane halves at TP 2), must not exchange requests."""
    from jmtp.runtime.config import EngineConfig
    from jmtp.runtime.host.handoff import engine_fingerprint, fingerprint_hash
    ec = EngineConfig(max_num_seqs=2, max_model_len=64, num_blocks=16, max_num_batched_tokens=16)
    fp = lambda w, g: fingerprint_hash(engine_fingerprint(CFG, ec, 0, "bfloat16", {}, w, g))
    assert fp(256, 1) != fp(256, 2) != fp(384, 2)
    assert fp(256, 1) == fp(256, 1)


# A Qwen3-Next-shaped hybrid target in small: gated DeltaNet layers with 128-dim heads
# (Hk = 2 key heads, Hv = 4 value heads) around one gated full-attention layer, an MTP layer.
HYBRID = CFG.replace(
    num_layers=3, layer_types=("linear_attention", "full_attention", "linear_attention"),
    linear=__import__("jmtp.model.config", fromlist=["LinearAttentionConfig"])
    .LinearAttentionConfig(2, 4, 128, 128, 4),
    attn_output_gate=True, qk_norm=True, partial_rotary_factor=0.25, mtp_layout="qwen3_next")


def test_hybrid_engine_compiles_with_the_gated_delta_rule_kernels():
    """The TPU engine of a hybrid target compiles for v5e:1x1 with its gated-delta-rule kernels in
    the step (Mosaic calls counted): in every linear layer the packed recurrent rule and the
    multi-slot chunked prefill kernel (varlen over chunk-aligned slots, skipped at run time in a
    step without a long chunk); with prefix caching the allocator runs once (the host releases
    slots) and the state-checkpoint slot operation compiles too."""
    r = aot.compile_engine(args(model_config=HYBRID, enable_prefix_caching=True),
                           topology="v5e:1x1", buckets="largest")
    n_lin, n_kv = len(HYBRID.linear_layers), len(HYBRID.kv_layers)
    want = {"jmtp_ragged_paged_attention_tpu": n_kv + K, "jmtp_allocate_blocks_tpu": 1,
            "jmtp_gated_delta_rule_packed_tpu": n_lin,
            "jmtp_chunk_gated_delta_rule_varlen_tpu": n_lin}
    assert len(r.step_reports) == 2
    assert all(e.mosaic_kernels == want for e in r.step_reports), [
        e.mosaic_kernels for e in r.step_reports]
    assert "slot_state" in {e.label for e in r.executables}


@pytest.mark.parametrize("a2a", ["allgather_reducescatter", "ragged_all_to_all"])
def test_expert_parallel_compiles_with_its_dispatch(a2a):
    """A MoE target (every layer and the MTP layer MoE) with expert parallelism on a (2, 2)
    v5e mesh: the routed experts hold a quarter of their bytes per device, and the compiled step
    carries the dispatch's collectives: ragged all-to-alls (the TPU op, not the CPU emulation),
    or for the all-gather dispatch none of them (the TPU compiler turns its small reduce-scatter
    into an all-reduce and a slice; the step's plain all-to-alls belong to the sampler's sort
    over the vocabulary-sharded logits)."""
    from jmtp.model.config import MoEConfig
    from jmtp.runtime.device import sharding as shd
    moe = MoEConfig(8, 2, 128, layers=(0, 1), mtp_moe=True, shared_intermediate_size=128)
    rep = aot.compile_engine(args(model_config=CFG.replace(moe=moe), data_parallel_size=2,
                                  tensor_parallel_size=2, enable_expert_parallel=True,
                                  all2all_backend=a2a, max_num_seqs=4),
                             topology="v5e:2x2", buckets="largest", slot_ops=False)
    assert rep.config["expert_parallel"] and rep.config["all2all_backend"] == a2a
    runner = args(model_config=CFG.replace(moe=moe), data_parallel_size=2, tensor_parallel_size=2,
                  enable_expert_parallel=True, abstract=True,
                  devices=aot.topology_devices("v5e:2x2")).build().runner
    experts = [shd.per_device_bytes(a) for path, a in
               jax.tree_util.tree_leaves_with_path(runner.params)
               if "experts_" in jax.tree_util.keystr(path)]
    assert len(experts) == 6 and all(local * 4 == total for total, local in experts)
    for e in rep.step_reports:
        if a2a == "ragged_all_to_all":
            assert e.collectives["ragged-all-to-all"] > 0, e.collectives
        else:
            assert e.collectives["ragged-all-to-all"] == 0, e.collectives


def test_hbm_of_a_megacore_device_is_the_whole_chip():
    """A v5p device is a whole chip (2 TensorCores, ``num_cores``): 103 GB of HBM (Pallas's
    chip table gives it per core); a v5e or v6e device is one core of its chip's memory."""
    assert aot.hbm_bytes(aot.topology_devices("v5p:2x2x1")[0]) == 103_000_000_000
    assert aot.hbm_bytes(aot.topology_devices("v5e:2x2")[0]) == 17_200_000_000


def test_compile_plans_a_published_fp8_config_in_8_bits(tmp_path, capsys):
    """``jmtp compile`` on a config.json with DeepSeek-V3's ``quantization_config`` (no weights):
    the engine is built 8-bit (the decoder-block linears of the target and of the MTP head fp8
    in 128x128 blocks, the rest bf16), jmtp's parameter bytes are the hand count, and the
    compiler's argument bytes are within 10 % of jmtp's prediction."""
    from jmtp.cli import main
    hf = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 512,
          "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 128,
          "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 1024,
          "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
          "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3",
                                  "quant_method": "fp8", "weight_block_size": [128, 128]}}
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(hf))
    out = tmp_path / "r.json"
    assert main(["compile", "--model", str(cfg), "--topology", "v5e:1x1", "--max-num-seqs", "4",
                 "--max-model-len", "256", "--num-speculative-tokens", "1", "--buckets",
                 "largest", "--json", str(out)]) == 0
    capsys.readouterr()
    rep = json.loads(out.read_text())[0]
    assert rep["config"]["quantization"] == "fp8 (128x128 blocks)"
    h, i, q, kv, blocks = 128, 256, 512, 256, 3            # 2 target layers + the MTP layer
    fp8 = blocks * (2 * h * q + 2 * h * kv + 3 * h * i)   # one byte per weight
    scales = 4 * blocks * (4 + 2 + 2 + 4 + 2 + 2 + 2)     # f32 per 128x128 block
    bf16 = 2 * (2 * 512 * h + h + blocks * 2 * h + 3 * h + 2 * h * h)
    assert rep["predicted"]["params"] == fp8 + scales + bf16
    assert abs(rep["prediction_error"]) < 0.10
