"""Expert parallelism (:mod:`jmtp.model.expert_parallel`) and attention data parallelism for
MoE targets on 8 CPU devices.

The multi-device runs happen once, in a subprocess with 8 CPU devices
(``tests/runtime/expert_parallel_worker.py``, as ``test_sharding.py`` does); the tests read its
results. Tiny random DeepSeek-V3 (MLA + MoE + its MoE MTP layer), GLM-4.5, Qwen3-MoE (and, with
``JMTP_FULL_MESH=1``, Qwen3-Next: gated DeltaNet + MoE) targets with
``enable_expert_parallel=True`` on ``(data, model)`` meshes of 8 devices: greedy MTP
tokens equal to the one-device plain output (the non-paged reference), seeded sampled MTP
tokens equal to the one-device engine's, through chunked prefill and preemption; every routed
expert tensor holds 1/8 of its bytes per device; one MoE layer equals the one-device layer on
every mesh with both dispatches and a skewed router. Each engine costs 20-30 s of compiling on
2 cores, so the suite runs each model on one mesh, each mesh once, DeepSeek-V3's one-device
sampled reference and the layer checks; ``JMTP_FULL_MESH=1`` runs every model on every mesh
of the issue its heads allow, with its one-device reference, and the ragged all-to-all dispatch
too.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from jmtp.model import expert_parallel as ep
from jmtp.model.config import MoEConfig
from tests.runtime import expert_parallel_worker as worker
from tests.runtime.conftest import reference_greedy

pytestmark = pytest.mark.xdist_group("expert_parallel")

FULL = os.environ.get("JMTP_FULL_MESH") == "1"
# (model, data, model axis, dispatch): every model once, every mesh once (the default run)
DEFAULT = [("deepseek_v3", 2, 4, "auto"), ("glm4_moe", 8, 1, "auto"),
           ("qwen3_moe", 1, 8, "auto")]
FULL_RUNS = ([(m, dp, tp, "auto") for m in worker.MODELS for dp, tp in worker.MODEL_MESHES[m]]
             + [(m, 2, 4, "ragged_all_to_all") for m in worker.MODELS if m != "qwen3_next"]
             + [("qwen3_next", 4, 2, "ragged_all_to_all")])
RUNS = FULL_RUNS if FULL else DEFAULT
ONE = list(worker.MODELS) if FULL else ["deepseek_v3"]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _name(model, dp, tp, a2a):
    return f"engine:model={model},dp={dp},tp={tp}" + ("" if a2a == "auto" else f",a2a={a2a}")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                        " --xla_force_host_platform_device_count=8").strip()
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env["JMTP_CACHE_DIR"] = str(tmp_path_factory.mktemp("ep-xla-cache"))
    cases = ["layer"] + [f"one:model={m}" for m in ONE] + [_name(*r) for r in RUNS]
    proc = subprocess.run([sys.executable, "-m", "tests.runtime.expert_parallel_worker", *cases],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def reference():
    """The one-device plain greedy tokens of every model (non-paged forward)."""
    out = {}
    for name in {r[0] for r in RUNS}:
        cfg, params = worker.model(name)
        out[name] = [reference_greedy(cfg, params, p, worker.MAX_TOKENS, stop_ids=())
                     for p in worker.PROMPTS]
    return out


def _ok(res):
    assert "error" not in res, res.get("error")
    return res


@pytest.mark.parametrize("model,dp,tp,a2a", RUNS)
def test_expert_parallel_greedy_mtp_equals_one_device(results, reference, model, dp, tp, a2a):
    """Greedy MTP (K=1) on the mesh with expert parallelism: the one-device plain output,
    through chunked prefill (prompts of 9-12 tokens, 4 tokens per shard and step) and
    preemption (two sequences outgrow their shard's pool); every block returned."""
    res = _ok(results[_name(model, dp, tp, a2a)])
    assert res["expert_parallel"] is True
    assert res["all2all_backend"] == ("allgather_reducescatter" if a2a == "auto" else a2a)
    assert res["tokens"] == reference[model]
    assert res["preemptions"][0] > 0 and res["preemptions"][1] > 0
    assert res["free_blocks"] == res["num_blocks"]
    assert res["step_executables"] <= 4          # the buckets of engine_kwargs: no recompiles


@pytest.mark.parametrize("model,dp,tp,a2a", [r for r in RUNS if r[0] in ONE])
def test_expert_parallel_seeded_sampling_equals_one_device(results, model, dp, tp, a2a):
    """temperature 0.8, a seed per request: the same MTP tokens as the one-device engine of the
    same shard shape (each request's random stream stays with its row, across preemption)."""
    one = _ok(results[f"one:model={model}"])
    res = _ok(results[_name(model, dp, tp, a2a)])
    assert res["sampled"] == one["sampled"]
    assert one["sampled"] != one["tokens"]      # really sampled


@pytest.mark.parametrize("model,dp,tp,a2a", RUNS)
def test_expert_bytes_per_device_are_an_eighth(results, model, dp, tp, a2a):
    """Every routed expert tensor (target and MTP layer) holds 1/8 of its bytes on a device
    (from the arrays' shardings); the KV cache is split by request over ``data`` (MLA's latent
    cache replicated over ``model``, GQA's split by kv heads)."""
    res = _ok(results[_name(model, dp, tp, a2a)])
    names = [path for path, _, _ in res["experts"]]
    for w in ("experts_gate", "experts_up", "experts_down"):     # target layers and MTP layer
        assert any("mtp" in n and w in n for n in names) and any(
            "layers" in n and w in n for n in names), w
    for path, local, total in res["experts"]:
        assert local * 8 == total, path
    if "layer_types" not in worker.MODELS[model]:   # (a hybrid's recurrent pool: test_sharding)
        local, total = res["memory"]["kv_cache"]
        shards = dp * (1 if worker.MODELS[model].get("attention_type") == "mla" else tp)
        assert local * shards == total


def test_one_moe_layer_on_every_mesh_and_dispatch(results):
    """One MoE layer, 5 rows per data shard (no model axis divides them): GLM-4.5's gating with
    a router that sends every token to the same 4 experts (the dropless worst case: every row
    lands on one or two devices) on every mesh, Qwen3-Next's (gated shared expert) and
    ERNIE-4.5's (softmax + correction bias, ``norm_min``) on (2, 4); both dispatches (and the
    grouped-matmul experts for GLM-4.5 at (2, 4)) equal the one-device layer. The all-gather
    dispatch compiles to one all-gather and one reduce-scatter over ``data`` and one all-reduce
    over ``model`` (each only where that axis has more than one device)."""
    res = _ok(results["layer"])
    assert len(res) == 10 + 2 + 2
    for key, r in res.items():
        assert r["error"] <= 1e-5 * r["scale"], (key, r)
        dp, tp = (int(v) for v in key.split("/")[1].split("x"))
        if "/allgather_reducescatter/" in key:
            want = {}
            if dp > 1:
                want.update({"all-gather": 1, "reduce-scatter": 1})
            if tp > 1:
                want["all-reduce"] = 1
            assert r["collectives"] == want, (key, r["collectives"])


# -- one device ------------------------------------------------------------------------------

def test_dispatch_choice_follows_platform_and_bytes():
    """CPU: always the all-gather form (XLA:CPU has no ragged all-to-all). TPU/GPU: the form that
    moves fewer bytes per device (hand-worked: DeepSeek-V3's k=8 on 8 devices, (2, 4):
    all-gather 2·1 + 2·3/4 = 3.5 T·H rows, ragged 2·8·7/32 + 1.5 = 5 -> all-gather; on 64
    devices as (16, 4): all-gather 30 + 1.5, ragged 2·8·63/256 + 1.5 = 5.44 -> ragged)."""
    assert ep.dispatch_bytes("allgather_reducescatter", 2, 4, 8) == pytest.approx(3.5)
    assert ep.dispatch_bytes("ragged_all_to_all", 2, 4, 8) == pytest.approx(5.0)
    assert ep.dispatch_bytes("ragged_all_to_all", 16, 4, 8) == pytest.approx(2 * 8 * 63 / 256 + 1.5)
    assert ep.resolve_all2all_backend("auto", "cpu", 16, 4, 8) == "allgather_reducescatter"
    assert ep.resolve_all2all_backend("auto", "tpu", 2, 4, 8) == "allgather_reducescatter"
    assert ep.resolve_all2all_backend("auto", "tpu", 1, 8, 8) == "allgather_reducescatter"
    assert ep.resolve_all2all_backend("auto", "gpu", 16, 4, 8) == "ragged_all_to_all"
    assert ep.resolve_all2all_backend("ragged_all_to_all", "cpu", 2, 4, 8) == "ragged_all_to_all"
    with pytest.raises(ValueError, match="all2all_backend must be one of"):
        ep.resolve_all2all_backend("deepep", "tpu", 2, 4, 8)


def test_expert_parallel_errors_and_no_ops(tiny, caplog):
    """Experts that the mesh does not divide: a ValueError naming both numbers; an unknown
    dispatch: a ValueError naming the field; a dense model or one device: nothing to split
    (logged), the engine unchanged."""
    with pytest.raises(ValueError, match=r"num_experts=6 must be a multiple of .* = 4 devices"):
        ep.check_expert_parallel(MoEConfig(6, 2, 8), 2, 2)
    ep.check_expert_parallel(MoEConfig(8, 2, 8), 2, 4)
    with pytest.raises(ValueError, match="MoEConfig.all2all_backend must be one of"):
        MoEConfig(8, 2, 8, all2all_backend="naive")
    from jmtp.runtime.host.llm_engine import LLMEngine
    cfg, params = tiny
    kw = dict(model_config=cfg, params=params, max_num_seqs=1, max_model_len=16, block_size=4,
              max_num_batched_tokens=4)
    with pytest.raises(ValueError, match="all2all_backend must be one of"):
        LLMEngine(all2all_backend="naive", **kw)
    with caplog.at_level("WARNING"):
        eng = LLMEngine(enable_expert_parallel=True, **kw)
    assert "no MoE layers" in caplog.text and eng.model_config.moe is None


def test_one_device_expert_parallel_changes_nothing():
    """On one device ``enable_expert_parallel`` leaves the MoE config as it is (nothing to
    split): the engine is the plain one."""
    from jmtp.runtime.host.llm_engine import LLMEngine
    cfg, params = worker.model("qwen3_moe")
    eng = LLMEngine(model_config=cfg, params=params, enable_expert_parallel=True,
                    **worker.engine_kwargs(1))
    assert not eng.model_config.moe.expert_parallel
    assert eng.runner.mesh is None


def test_expert_parallel_rules_and_data_specs():
    """The experts' logical axis maps to (data, model) together (data-major), their width to
    nothing, the router stays replicated; the data-parallel shard_map's spec of an expert
    tensor keeps only ``data`` (each shard sees its E/DP experts, split over model)."""
    from jax.sharding import PartitionSpec as P

    from jmtp.model import axes as ax

    from jmtp.model import schema
    from jmtp.runtime.device import sharding as shd

    class FakeMesh:                   # logical_spec only reads the axis sizes
        def __init__(self, dp, tp):
            self.shape = {shd.DATA: dp, shd.MODEL: tp}
    rules = shd.mesh_rules(True)
    assert shd.mesh_rules(False) is shd.LOGICAL_TO_MESH
    names = (ax.LAYERS,) + schema.LAYER_AXES["experts_gate"]
    assert shd.logical_spec(names, (2, 16, 32, 8), FakeMesh(2, 4), rules=rules) == P(
        None, (shd.DATA, shd.MODEL), None, None)
    assert shd.logical_spec(names, (2, 16, 32, 8), FakeMesh(1, 8), rules=rules) == P(
        None, shd.MODEL, None, None)                     # axes of size 1 left out
    assert shd.logical_spec(names, (2, 16, 32, 8), FakeMesh(8, 1), rules=rules) == P(
        None, shd.DATA, None, None)
    assert shd.logical_spec(names, (2, 12, 32, 8), FakeMesh(2, 4), rules=rules) == P(
        None, None, None, None)                          # 8 does not divide 12: replicated
    # without expert parallelism: each expert's width over model
    assert shd.logical_spec(names, (2, 16, 32, 8), FakeMesh(2, 4)) == P(
        None, None, None, shd.MODEL)
    assert shd.logical_spec(schema.LAYER_AXES["router"], (32, 16), FakeMesh(2, 4), rules=rules) == P(
        None, None)
    mesh = shd.make_mesh(1, 1)
    from jax.sharding import NamedSharding
    specs = shd.data_specs([NamedSharding(mesh, P(None, (shd.DATA, shd.MODEL))),
                            NamedSharding(mesh, P(shd.MODEL, None)), NamedSharding(mesh, P())])
    assert specs == (P(None, shd.DATA), P(None, None), P())


def test_mla_tensor_parallel_splits_query_heads_only():
    """Multi-head latent attention under tensor parallelism: the query heads must split (the
    latent cache has one head, replicated), so only ``num_heads`` is checked."""
    from jmtp.runtime.device import sharding as shd
    cfg, _ = worker.model("deepseek_v3")           # 8 query heads, one latent head
    shd.check_tensor_parallel(cfg, 8)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 must divide num_heads=8"):
        shd.check_tensor_parallel(cfg, 3)
