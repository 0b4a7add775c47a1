"""Ahead-of-time compilation of an engine for TPU topologies, without a TPU.

``libtpu`` (installed by ``scripts/setup_env.sh``) carries the real TPU compiler, Mosaic
included. ``jax.experimental.topologies`` describes a TPU slice (``"v5e:2x2"``, ``"v6e:2x4"``,
``"v5p:2x2x1"``, ``"v4:2x2x1"``, multi-host ones such as ``"v5e:16x16"``) as *compile-only*
devices; an engine built abstractly on them (:class:`~jmtp.runtime.host.engine_args.EngineArgs` with
``abstract=True``: shapes and shardings, no weights, no arrays) compiles every step bucket and
slot operation for that slice with ``jit(...).trace(...).lower().compile()``, the same calls a
TPU host makes. What the compiler reports per device (arguments, outputs, temporaries, code) is
set against the chip's HBM and against jmtp's own arithmetic (parameters, KV cache and engine
state from their shapes and shardings), and gives the largest ``num_blocks`` that fits a memory
fraction (vLLM's ``gpu_memory_utilization``).

Entry points: :func:`compile_engine` (an :class:`AotReport`), ``jmtp compile`` (the same from the
command line; JSON and markdown). Nothing here runs a step: an abstract engine cannot run.

GPU: the CUDA plugin has no compile-only devices in jaxlib 0.10 (``get_topology_desc`` supports
TPU only), so a GPU compile needs a GPU; ``docs/scaling.md`` has the evidence.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import re
import sys
import time
from typing import Any, Sequence

import jax
import numpy as np

from jmtp.runtime.device import sharding as shd
from jmtp.runtime.process.compile import persistent_cache_off

log = logging.getLogger(__name__)

#: HLO collectives counted in each executable.
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all",
               "ragged-all-to-all")
# (a name is not matched inside a longer one: "all-to-all" of "ragged-all-to-all")
_COLLECTIVE_RE = re.compile(r"(?<![\w-])(" + "|".join(COLLECTIVES) + r")(?:-start)?\(")
_KERNEL_NAME_RE = re.compile(r"\b(jmtp_[a-z0-9_]+)/pallas_call")
GiB = 1 << 30


def topology_devices(name: str) -> list[jax.Device]:
    """The compile-only devices of TPU topology ``name`` (``"<generation>:<chips>"``, e.g.
    ``"v5e:2x2"``, ``"v6e:1x1"``, ``"v5p:2x2x1"``, ``"v4:2x2x1"``, ``"v5e:16x16"``).

    A single chip (``...:1x1``) is described as a one-chip host. Sets ``TPU_WORKER_HOSTNAMES`` /
    ``TPU_ACCELERATOR_TYPE`` for libtpu when unset (they only silence its host probing), and
    ``ALLOW_MULTIPLE_LIBTPU_LOAD=1``: libtpu otherwise takes ``/tmp/libtpu_lockfile``, and a
    second JAX process on the machine (a test worker, a server) makes the topology query fail
    with "Internal error when accessing libtpu multi-process lockfile"; compile-only devices
    touch no chip.

    Raises:
      ValueError: ``libtpu`` missing or the name unknown to it.
    """
    from jax.experimental import topologies
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    gen, _, chips = name.partition(":")
    if not gen or not chips:
        raise ValueError(f"topology must look like 'v5e:2x2', got {name!r}")
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", f"{gen}-{_num_chips(chips)}")
    one_chip = all(c == "1" for c in chips.split("x"))
    kw = {"chips_per_host_bounds": [1, 1, 1]} if one_chip else {}
    try:
        topo = topologies.get_topology_desc(platform="tpu", topology_name=name, **kw)
    except Exception as e:   # libtpu missing, unknown generation or shape
        raise ValueError(f"cannot describe TPU topology {name!r} ({type(e).__name__}: {e}); "
                         "is libtpu installed (scripts/setup_env.sh)?") from e
    return list(topo.devices)


def _num_chips(chips: str) -> int:
    try:
        return int(np.prod([int(c) for c in chips.split("x")]))
    except ValueError:
        raise ValueError(f"topology chips must look like 2x2 or 2x2x1, got {chips!r}") from None


def hbm_bytes(device: jax.Device) -> int:
    """HBM bytes of one (compile-only or real) TPU device, from Pallas's chip table: its
    per-TensorCore capacity times the device's cores (``num_cores``: 2 on a megacore chip such
    as v5p, where one JAX device is the whole chip; 1 on v5e/v6e, and on v4 where each core is a
    device)."""
    from jax.experimental.pallas import tpu as pltpu
    with jax.default_device(device):
        per_core = int(pltpu.get_tpu_info().hbm_capacity_bytes)
    return per_core * int(getattr(device, "num_cores", 1) or 1)


@dataclasses.dataclass
class ExecutableReport:
    """What the compiler says about one executable (bytes are per device); ``mosaic_kernels``:
    Mosaic custom calls by Pallas kernel name (``jmtp_ragged_paged_attention_tpu``,
    ``jmtp_allocate_blocks_tpu``), ``collectives``: HLO collectives by kind."""

    label: str
    seconds: float
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    code_bytes: int
    mosaic_kernels: dict[str, int]
    collectives: dict[str, int]

    @property
    def num_mosaic_kernels(self) -> int:
        """Mosaic kernel call sites in the executable (all names)."""
        return sum(self.mosaic_kernels.values())

    @property
    def peak_bytes(self) -> int:
        """Arguments + outputs not aliased to them + temporaries + code."""
        return (self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes
                + self.code_bytes)

    @classmethod
    def of(cls, label: str, exe, seconds: float) -> "ExecutableReport":
        m = exe.memory_analysis()
        text = exe.as_text()
        counts = {c: 0 for c in COLLECTIVES}
        for hit in _COLLECTIVE_RE.findall(text):
            counts[hit] += 1
        kernels: dict[str, int] = {}
        for line in text.splitlines():
            if 'custom_call_target="tpu_custom_call"' in line:
                hit = _KERNEL_NAME_RE.search(line)
                name = hit.group(1) if hit else "other"
                kernels[name] = kernels.get(name, 0) + 1
        return cls(label=str(label), seconds=seconds, argument_bytes=m.argument_size_in_bytes,
                   output_bytes=m.output_size_in_bytes, alias_bytes=m.alias_size_in_bytes,
                   temp_bytes=m.temp_size_in_bytes, code_bytes=m.generated_code_size_in_bytes,
                   mosaic_kernels=kernels, collectives=counts)


@dataclasses.dataclass
class AotReport:
    """Per-device memory and kernel report of an engine compiled for a topology.

    Attributes:
      topology, device_kind, num_devices, mesh (``{"data": DP, "model": TP}``), platform.
      config: the engine sizes compiled (``max_num_seqs``, ``num_blocks``, ...).
      predicted: jmtp's own per-device bytes: ``params``, ``kv_cache``, ``state`` and their
        ``total`` (from shapes and shardings, :func:`jmtp.runtime.device.sharding.per_device_bytes`).
      executables: one :class:`ExecutableReport` per step bucket and slot operation.
      hbm_bytes: one device's HBM.
      memory_fraction: the share of HBM the engine may use.
      max_num_blocks: the largest ``num_blocks`` (total over data shards) whose peak fits
        ``memory_fraction · hbm_bytes`` (temporaries modelled as linear in ``num_blocks`` from
        two compiles of the step bucket with the most; None when not measured).
      temp_per_block_bytes: that model's slope (temporary bytes per KV block per device).
      requested_num_blocks: with ``fit``, the ``num_blocks`` asked for when the compiler found
        it did not fit (the report is then of a halved engine); else None.
    """

    topology: str
    device_kind: str
    num_devices: int
    mesh: dict[str, int]
    platform: str
    config: dict[str, Any]
    predicted: dict[str, int]
    executables: list[ExecutableReport]
    hbm_bytes: int
    memory_fraction: float
    max_num_blocks: int | None = None
    temp_per_block_bytes: float | None = None
    requested_num_blocks: int | None = None

    @property
    def step_reports(self) -> list[ExecutableReport]:
        return [e for e in self.executables if e.label.startswith("T=")]

    @property
    def peak_bytes(self) -> int:
        """The largest per-device peak of any executable (jmtp's own prediction of the
        parameters, KV and state when nothing was compiled)."""
        return max((e.peak_bytes for e in self.executables), default=self.predicted["total"])

    @property
    def compiler_argument_bytes(self) -> int | None:
        """The step's per-device argument bytes (parameters, state, caches, two ``i32[B]`` and
        the structured-output inputs ``i32[B, K+1, ceil(V/32)]`` and ``i32[B, K]``, which
        jmtp's prediction leaves out: 0.2 MiB for SmolLM2 at 64 slots and K=3); None when no
        step bucket was compiled."""
        return max((e.argument_bytes for e in self.step_reports), default=None)

    @property
    def prediction_error(self) -> float | None:
        """``compiler_argument_bytes / predicted["total"] - 1`` (None without a step)."""
        args = self.compiler_argument_bytes
        return None if args is None else args / self.predicted["total"] - 1.0

    @property
    def fits(self) -> bool:
        return self.peak_bytes <= self.memory_fraction * self.hbm_bytes

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d.update(peak_bytes=self.peak_bytes, compiler_argument_bytes=self.compiler_argument_bytes,
                 prediction_error=self.prediction_error, fits=self.fits)
        for e, rep in zip(d["executables"], self.executables):
            e["peak_bytes"] = rep.peak_bytes
            e["num_mosaic_kernels"] = rep.num_mosaic_kernels
        return d

    def summary_row(self) -> dict[str, str]:
        """One markdown-table row (GiB per device)."""
        steps = self.step_reports
        g = lambda b: f"{b / GiB:.2f}"
        return {
            "topology": self.topology, "mesh (DP,TP)": f"({self.mesh['data']},{self.mesh['model']})",
            "params": g(self.predicted["params"]), "KV": g(self.predicted["kv_cache"]),
            "temp (max)": g(max((e.temp_bytes for e in self.executables), default=0)),
            "peak": g(self.peak_bytes), "HBM": g(self.hbm_bytes),
            "fits": "yes" if self.fits else "no",
            "max num_blocks": ("-" if self.max_num_blocks is None else str(self.max_num_blocks))
            + ("" if self.requested_num_blocks is None
               else f" (asked {self.requested_num_blocks}: no fit)"),
            "compiler/jmtp args": ("-" if not steps else
                                   f"{self.compiler_argument_bytes / self.predicted['total']:.3f}"),
            "Mosaic kernels/step": str(max((e.num_mosaic_kernels for e in steps), default="-")),
            "collectives/step": str(max((sum(e.collectives.values()) for e in steps),
                                        default="-")),
            "buckets": str(len(steps)),
        }

    def to_markdown(self) -> str:
        row = self.summary_row()
        lines = [f"### {self.config.get('model', 'model')} on {self.topology} "
                 f"({self.num_devices} x {self.device_kind})", "",
                 "| " + " | ".join(row) + " |", "|" + "---|" * len(row),
                 "| " + " | ".join(row.values()) + " |", "",
                 "| executable | args GiB | temp GiB | peak GiB | Mosaic | collectives | by kind "
                 "| s |", "|---|---|---|---|---|---|---|---|"]
        for e in self.executables:
            kinds = ", ".join(f"{k} {n}" for k, n in e.collectives.items() if n) or "-"
            lines.append(f"| {e.label} | {e.argument_bytes / GiB:.3f} | {e.temp_bytes / GiB:.3f} "
                         f"| {e.peak_bytes / GiB:.3f} | {e.num_mosaic_kernels} | "
                         f"{sum(e.collectives.values())} | {kinds} | {e.seconds:.1f} |")
        return "\n".join(lines) + "\n"


def markdown_table(reports: Sequence[AotReport], names: Sequence[str]) -> str:
    """One table, a row per report (``names``: the model column)."""
    rows = [{"model": n, **r.summary_row()} for n, r in zip(names, reports)]
    head = list(rows[0])
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(r[h] for h in head) + " |" for r in rows]
    return "\n".join(out) + "\n"


#: Halvings of ``num_blocks`` :func:`compile_engine` tries with ``fit`` when the compiler
#: reports that the engine does not fit.
MAX_FIT_HALVINGS = 6


def compile_engine(args, *, topology: str | None = None, name: str = "model", buckets: str = "all",
                   slot_ops: bool = True, memory_fraction: float = 0.9, fit: bool = False,
                   serialize_dir: str | None = None, progress: bool = False) -> AotReport:
    """Build ``args`` (an :class:`~jmtp.runtime.host.engine_args.EngineArgs`) abstractly and compile
    its step buckets and slot operations; the per-device report.

    When the TPU compiler finds that the engine does not fit the chip's HBM
    (``RESOURCE_EXHAUSTED``), ``fit`` halves ``num_blocks`` until it compiles (at most
    :data:`MAX_FIT_HALVINGS` times) and reports that engine, its ``max_num_blocks`` and the
    ``requested_num_blocks``; without ``fit`` a ``ValueError`` carries the compiler's message.

    Args:
      args: the engine's arguments; ``abstract`` is forced on and ``devices`` set from
        ``topology`` when given (else ``args.devices`` / ``args.mesh`` are used as they are).
      topology: a TPU topology name (:func:`topology_devices`).
      name: the model's name in the report.
      buckets: ``"all"`` (every step bucket), ``"largest"`` (the largest prefill bucket and the
        largest decode bucket), ``"decode"`` (the largest decode bucket only: the smallest
        compile that shows a serving step's collectives and decode memory) or ``"none"``.
      slot_ops: also compile the request insert and slot release (retire/push with prefix
        caching).
      memory_fraction: the HBM share the engine may use (``0 < f <= 1``).
      fit: compile the bucket with the most temporaries again at half the blocks and report
        :attr:`AotReport.max_num_blocks`.
      serialize_dir: write each executable there (``jax.experimental.serialize_executable``),
        loadable by a TPU host with the same jax/libtpu.
      progress: a tqdm bar over the compiles.

    On a ``topology`` (compile-only devices) JAX's persistent compilation cache is off while it
    compiles (:func:`~jmtp.runtime.process.compile.persistent_cache_off`): such executables cannot
    be loaded back from it.

    Raises:
      ValueError: bad ``buckets``/``memory_fraction``, the engine arguments' own errors, or
        an engine that does not fit (see above).
    """
    if topology is not None:
        args = dataclasses.replace(args, devices=topology_devices(topology), mesh=None)
    kw = dict(topology=topology, name=name, buckets=buckets, slot_ops=slot_ops,
              memory_fraction=memory_fraction, fit=fit, serialize_dir=serialize_dir,
              progress=progress)
    # compile-only devices: nothing the persistent cache holds could be loaded back
    with persistent_cache_off() if topology is not None else contextlib.nullcontext():
        return _fit_and_compile(args, kw)


def _fit_and_compile(args, kw: dict) -> AotReport:
    """:func:`compile_engine`'s retries (``kw``: its keyword arguments): halve ``num_blocks``
    while the compiler finds no room."""
    fit, topology = kw["fit"], kw["topology"]
    requested = None
    for _ in range(MAX_FIT_HALVINGS + 1):
        try:
            report = _compile_engine(args, **kw)
            report.requested_num_blocks = requested
            return report
        except jax.errors.JaxRuntimeError as e:
            msg = str(e).splitlines()[0]
            if "RESOURCE_EXHAUSTED" not in msg:
                raise
            nb = args.num_blocks or dataclasses.replace(args, abstract=True).build() \
                .runner.engine_config.num_blocks
            if not fit:
                raise ValueError(f"the engine does not fit {topology or 'the device'} at "
                                 f"num_blocks={nb}: {msg} (fewer blocks or --fit)") from None
            dp = max(1, args.data_parallel_size)
            requested = requested or nb
            half = max(dp, nb // 2 // dp * dp)
            if half >= nb:
                break
            args = dataclasses.replace(args, num_blocks=half)
    raise ValueError(f"the engine does not fit {topology or 'the device'} even at "
                     f"num_blocks={args.num_blocks}")


def _compile_engine(args, *, topology: str | None = None, name: str = "model",
                    buckets: str = "all", slot_ops: bool = True, memory_fraction: float = 0.9,
                    fit: bool = False, serialize_dir: str | None = None,
                    progress: bool = False) -> AotReport:
    """One compile of ``args`` (no retry): :func:`compile_engine`."""
    from jmtp.runtime.device.buckets import StepBucket, decode_buckets, slot_buckets
    from jmtp.runtime.host.sampling_params import SamplingParams
    from jmtp.runtime.host.sampling_rows import make_row
    if buckets not in ("all", "largest", "decode", "none"):
        raise ValueError(f"buckets must be 'all', 'largest', 'decode' or 'none', got {buckets!r}")
    if not 0 < memory_fraction <= 1:
        raise ValueError(f"memory_fraction must lie in (0, 1], got {memory_fraction}")
    args = dataclasses.replace(args, abstract=True, compile="lazy", compilation_cache_dir=None)
    runner = args.build().runner
    devices = (list(runner.mesh.devices.flat) if runner.mesh is not None else [runner.device]
               if runner.device is not None else jax.devices()[:1])
    sec = runner.shard_config
    todo = list(runner.uncompiled_buckets())
    dec = max(StepBucket(t, a) for a in slot_buckets(sec) for t in decode_buckets(sec, a))
    if buckets == "largest":
        todo = sorted({max(todo), dec})
    elif buckets == "decode":
        todo = [dec]
    elif buckets == "none":
        todo = []
    reports: list[ExecutableReport] = []
    exes: dict[str, Any] = {}

    def keep(label, exe):
        reports.append(ExecutableReport.of(label, exe, time.perf_counter() - t0[0]))
        if serialize_dir is not None:
            exes[str(label)] = exe
        t0[0] = time.perf_counter()

    t0 = [time.perf_counter()]
    runner.compile_buckets(todo, progress=progress, on_executable=keep)
    if slot_ops:
        t0[0] = time.perf_counter()
        ec, mc = runner.engine_config, runner.model_config
        row = make_row(SamplingParams(), [0], mc.vocab_size, max_stop=ec.max_stop_ids,
                       max_bad_words=ec.max_bad_words, max_bad_word_len=ec.max_bad_word_len,
                       max_logit_bias=ec.max_logit_bias, eos_ids=mc.eos_token_ids,
                       request_seed=0)
        runner.compile_slot_ops(row, on_executable=keep)
    params_b = shd.per_device_bytes(runner.params)[1]
    kv_b = shd.per_device_bytes((runner.cache, runner.mtp_cache))[1]
    state_b = shd.per_device_bytes(runner.state)[1]
    ec = runner.engine_config
    dp, tp = shd.mesh_sizes(runner.mesh) if runner.mesh is not None else (1, 1)
    label = topology or devices[0].device_kind
    total = len(args.devices) if args.devices is not None else len(devices)
    if len(devices) < total:
        log.warning("the engine uses %d of the %d devices of %s (data_parallel_size x "
                    "tensor_parallel_size = %d); set them to use the whole slice", len(devices),
                    total, label, len(devices))
        label = f"{label} ({len(devices)} of {total} devices)"
    report = AotReport(
        topology=label, device_kind=devices[0].device_kind,
        num_devices=len(devices), mesh={"data": dp, "model": tp}, platform=ec.platform,
        config=dict(model=name,
                    max_num_seqs=ec.max_num_seqs, max_model_len=ec.max_model_len,
                    block_size=ec.block_size, num_blocks=ec.num_blocks,
                    max_num_batched_tokens=ec.max_num_batched_tokens,
                    speculative=repr(ec.spec.method), k=ec.k, kv_cache_dtype=ec.kv_cache_dtype,
                    dtype=str(runner.params["final_norm"].get_value().dtype),
                    quantization=(runner.model_config.quantization.describe()
                                  if runner.model_config.quantization else None),
                    cache_dtype=str(runner.cache.k.dtype),
                    attention=runner.attention.implementation,
                    block_allocator=ec.block_allocator,
                    **_moe_config(runner.model_config)),
        predicted=dict(params=params_b, kv_cache=kv_b, state=state_b,
                       total=params_b + kv_b + state_b),
        executables=reports, hbm_bytes=hbm_bytes(devices[0]) if ec.platform == "tpu" else 0,
        memory_fraction=memory_fraction)
    if fit and report.step_reports:
        _fit_num_blocks(report, args, runner)
    if serialize_dir is not None:
        _serialize(exes, serialize_dir)
    return report


def _moe_config(cfg) -> dict:
    """The MoE placement of a report's config: expert parallelism and its dispatch, or the
    experts' width split over ``model`` (nothing for a dense model)."""
    if cfg.moe is None:
        return {}
    return dict(expert_parallel=cfg.moe.expert_parallel,
                all2all_backend=cfg.moe.all2all_backend if cfg.moe.expert_parallel else None)


def _fit_num_blocks(report: AotReport, args, runner) -> None:
    """Fill ``max_num_blocks``: recompile the step bucket with the most temporaries at half the
    blocks; temporaries and KV bytes are linear in ``num_blocks`` between the two."""
    worst = max(report.step_reports, key=lambda e: e.temp_bytes)
    nb = runner.engine_config.num_blocks
    dp = report.mesh["data"]
    half = max(dp, nb // 2 // dp * dp)
    if half >= nb:      # too few blocks to halve: no second point for the model
        return
    small = dataclasses.replace(args, num_blocks=half).build().runner
    bucket = next(b for b in runner.uncompiled_buckets() + tuple(runner.compiled_buckets)
                  if b.label == worst.label)
    got = []
    small.compile_buckets([bucket], on_executable=lambda l, e: got.append(
        ExecutableReport.of(l, e, 0.0)))
    slope = (worst.temp_bytes - got[0].temp_bytes) / (nb - half)
    kv_per_block = report.predicted["kv_cache"] / nb
    fixed = worst.peak_bytes - (kv_per_block + slope) * nb
    budget = report.memory_fraction * report.hbm_bytes - fixed
    report.temp_per_block_bytes = slope
    report.max_num_blocks = max(0, int(budget // (kv_per_block + max(slope, 0.0))) // dp * dp)


def _serialize(exes: dict, folder: str) -> None:
    from jax.experimental.serialize_executable import serialize
    os.makedirs(folder, exist_ok=True)
    for label, exe in exes.items():
        payload, _, _ = serialize(exe)
        name = re.sub(r"[^A-Za-z0-9_.=-]", "_", label)
        with open(os.path.join(folder, f"{name}.xla"), "wb") as f:
            f.write(payload)


def write_report(reports: Sequence[AotReport], names: Sequence[str], json_path: str | None,
                 markdown_path: str | None) -> None:
    """Write the reports as JSON (a list) and markdown (a summary table, then each report)."""
    if json_path:
        with open(json_path, "w") as f:
            json.dump([dict(name=n, **r.to_json()) for n, r in zip(names, reports)], f, indent=1)
    if markdown_path:
        with open(markdown_path, "w") as f:
            f.write(markdown_table(reports, names) + "\n")
            for r in reports:
                f.write(r.to_markdown() + "\n")


def add_compile_args(p) -> None:
    """``jmtp compile``'s options (``jmtp.cli`` adds the expert-parallel ones every engine
    command shares)."""
    p.add_argument("--model", default=None,
                   help="GGUF file, HF checkpoint directory or HF config.json (only the config "
                        "is read; default: SmolLM2-135M-Instruct)")
    p.add_argument("--topology", required=True, action="append",
                   help="TPU topology, e.g. v5e:1x1, v5e:2x2, v6e:2x4, v5p:2x2x1, v4:2x2x1, "
                        "v5e:16x16 (repeatable)")
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--data-parallel-size", type=int, default=1)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--num-blocks", type=int, default=None,
                   help="KV blocks in total (default: every slot at max-model-len)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--speculative-method", default="mtp", choices=["mtp", "ngram", "none"])
    p.add_argument("--num-speculative-tokens", type=int, default=3)
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8", "fp8_e4m3"])
    p.add_argument("--quantization", default="auto", choices=["auto", "int8", "fp8"],
                   help="8-bit weights: auto = the config's quantization_config (a published "
                        "FP8 config.json plans 8-bit weights), int8, fp8")
    p.add_argument("--attention-backend", default="auto",
                   choices=["auto", "reference", "xla", "pallas_tpu", "pallas_gpu"],
                   help="auto: the best for the topology (pallas_tpu)")
    p.add_argument("--dtype", default=None, help="parameter dtype (default bf16 on TPU)")
    p.add_argument("--enable-prefix-caching", action="store_true")
    p.add_argument("--buckets", default="all", choices=["all", "largest", "decode", "none"],
                   help="step buckets to compile (largest: the largest prefill and decode ones; "
                        "decode: the largest decode one)")
    p.add_argument("--memory-fraction", type=float, default=0.9,
                   help="HBM share the engine may use (vLLM's gpu_memory_utilization)")
    p.add_argument("--fit", action="store_true",
                   help="also find the largest num_blocks that fits (one more compile at half "
                        "the blocks); when the compiler reports the engine does not fit, halve "
                        "num_blocks until it does (at most 6 times) and report that engine")
    p.add_argument("--json", default=None, help="write the reports as JSON here")
    p.add_argument("--markdown", default=None, help="write the reports as markdown here")
    p.add_argument("--serialize-dir", default=None,
                   help="write every executable here (jax.experimental.serialize_executable)")


def run_compile(args) -> int:
    """``jmtp compile``: compile the engine for each topology; print the markdown table."""
    from jmtp.model.checkpoints.loader import load_config
    from jmtp.runtime.config import SpeculativeConfig
    from jmtp.runtime.host.engine_args import EngineArgs
    cfg = load_config(args.model, None if args.quantization == "auto" else args.quantization)
    spec = (None if args.speculative_method == "none" else
            SpeculativeConfig(args.speculative_method, args.num_speculative_tokens))
    name = ("SmolLM2-135M-Instruct" if args.model is None
            else os.path.basename(os.path.normpath(args.model)))
    ea = EngineArgs(model_config=cfg, speculative_config=spec, max_num_seqs=args.max_num_seqs,
                    max_model_len=args.max_model_len, num_blocks=args.num_blocks,
                    block_size=args.block_size, max_num_batched_tokens=args.max_num_batched_tokens,
                    kv_cache_dtype=None if args.kv_cache_dtype == "auto" else args.kv_cache_dtype,
                    attention_backend=(None if args.attention_backend == "auto"
                                       else args.attention_backend), dtype=args.dtype,
                    tensor_parallel_size=args.tensor_parallel_size,
                    data_parallel_size=args.data_parallel_size,
                    enable_expert_parallel=getattr(args, "enable_expert_parallel", False),
                    all2all_backend=getattr(args, "all2all_backend", "auto"),
                    enable_prefix_caching=args.enable_prefix_caching)
    reports = []
    for topo in args.topology:
        folder = (os.path.join(args.serialize_dir, topo.replace(":", "_"))
                  if args.serialize_dir else None)
        reports.append(compile_engine(ea, topology=topo, name=name, buckets=args.buckets,
                                      memory_fraction=args.memory_fraction, fit=args.fit,
                                      serialize_dir=folder, progress=True))
    names = [name] * len(reports)
    print(markdown_table(reports, names))
    write_report(reports, names, args.json, args.markdown)
    for r in reports:
        if not r.fits:
            print(f"error: on {r.topology} the peak {r.peak_bytes / GiB:.2f} GiB exceeds "
                  f"{r.memory_fraction:.0%} of {r.hbm_bytes / GiB:.2f} GiB HBM",
                  file=sys.stderr)
    return 0 if all(r.fits for r in reports) else 1


__all__ = ["COLLECTIVES", "topology_devices", "hbm_bytes", "ExecutableReport", "AotReport",
           "compile_engine", "markdown_table", "write_report", "add_compile_args", "run_compile"]
