"""The package's import graph runs one way: core ← pallas ← model ← runtime ← entry points.

Every ``import`` / ``from ... import`` in ``jmtp/`` is read from the source (function-level
imports included, so a circle cannot hide inside a function), and each module is placed in a
layer. A module may import its own layer and the layers below it, and the graph has no cycle.

Inside ``jmtp/runtime/`` code is split by where it runs (``config.py`` at the root, shared):
``process`` ← ``host`` ← ``serve`` and ``device`` ← ``host``. Traced code (``device/``) never reaches
host or process state; the host reaches the device only through the runner and the step's public types
(:data:`HOST_MAY_IMPORT`); the server is a client of the host."""
from __future__ import annotations

import ast
from pathlib import Path

import jmtp

ROOT = Path(jmtp.__file__).parent
# Layer of each top-level part of the package (higher imports lower, never the reverse).
LAYERS = {
    "core": 0, "data": 0,   # data: package resources only (shipped head, prompts)
    "pallas": 1,
    "model": 2,
    "runtime": 3, "train": 3,
    "cli": 4, "chat": 4, "launch": 4, "aot": 4, "__main__": 4, "": 4,   # "": jmtp/__init__.py
}


def _modules() -> dict[str, Path]:
    out = {}
    for f in ROOT.rglob("*.py"):
        parts = ("jmtp",) + f.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = f
    return out


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for name, f in mods.items():
        package = name if f.name == "__init__.py" else name.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in mods]
                targets = subs + ([base] if len(subs) < len(node.names) else [])
            else:
                continue
            graph[name].update(t for t in targets if t in mods and t != name)
    return graph


def _layer(module: str) -> int:
    parts = module.split(".")
    return LAYERS[parts[1] if len(parts) > 1 else ""]


def test_every_module_has_a_layer():
    for m in _modules():
        assert (m.split(".") + [""])[1] in LAYERS, f"{m}: add its top-level part to LAYERS"


def test_no_import_from_a_lower_layer_to_a_higher_one():
    bad = [f"{a} -> {b}" for a, bs in _graph().items() for b in bs if _layer(b) > _layer(a)]
    assert bad == []


def test_core_imports_nothing_else_of_jmtp():
    graph = _graph()
    bad = [f"{a} -> {b}" for a in graph if a.startswith("jmtp.core")
           for b in graph[a] if not b.startswith("jmtp.core")]
    assert bad == []


def test_no_import_cycle():
    graph = _graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:             # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert cycles == []


def test_the_checker_sees_function_level_imports(tmp_path):
    """The premise of the tests above: an import inside a function body counts."""
    tree = ast.parse("def f():\n    from jmtp.runtime import server\n")
    found = [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert [n.module for n in found] == ["jmtp.runtime"]
    assert "jmtp.core.mesh" in _graph()["jmtp.pallas.ragged_paged_attention"]


# ---------------------------------------------------------------- runtime/: where code runs
SIDES = ("device", "host", "serve", "process")
#: The device modules the host may import, and why: the runner (the seam) and the step's public
#: types and constants. Anything else of ``device/`` is the runner's business.
HOST_MAY_IMPORT = {
    "jmtp.runtime.device.runner": "DeviceRunner, the host's only handle on device arrays",
    "jmtp.runtime.device.state": "EngineState (hand-off rows) and FINISH_REASONS",
    "jmtp.runtime.device.buckets": "StepBucket and the bucket tables the scheduler plans in",
    "jmtp.runtime.device.sampling.arrays": "SamplingArrays (the rows the host fills), GREEDY_EPS",
    "jmtp.runtime.device.bitmask": "the step's draft-override sentinels and bitmask row width",
    "jmtp.runtime.device.handoff_ops": "the hand-off row layout (ROW_FIELDS, LINEAR_PREFIX)",
    "jmtp.runtime.device.sharding": "mesh construction and its checks when the engine is built",
}


def _side(module: str) -> str | None:
    parts = module.split(".")
    if parts[:2] != ["jmtp", "runtime"] or len(parts) < 3:
        return None
    return parts[2]


def _runtime_arrows(src_side: str) -> list[tuple[str, str]]:
    graph = _graph()
    arrows = [(a, b) for a, bs in graph.items() if _side(a) == src_side for b in bs
              if b.startswith("jmtp.runtime.")]
    assert [a for a in graph if _side(a) == src_side], f"no module in jmtp/runtime/{src_side}/"
    return arrows


def test_every_runtime_module_runs_on_one_side():
    stray = [m for m in _modules() if m.startswith("jmtp.runtime.")
             and _side(m) not in SIDES + ("config",)]
    assert stray == [], "put each runtime module in device/, host/, serve/ or process/"


def test_device_never_imports_host_serve_or_process():
    """Traced code and the runner import no host, serve or process module: the process-level
    services the runner uses (ahead-of-time compiles, the memory-map budget) are handed in when
    the host builds it, and the multi-process put / fetch lives in ``jmtp.core.multihost``."""
    bad = [f"{a} -> {b}" for a, b in _runtime_arrows("device")
           if _side(b) in ("host", "serve", "process")]
    assert bad == []


def test_host_imports_device_only_through_the_runner_and_the_step_types():
    bad = [f"{a} -> {b}" for a, b in _runtime_arrows("host")
           if _side(b) == "device" and b not in HOST_MAY_IMPORT]
    assert bad == []
    assert not [b for a, b in _runtime_arrows("host") if _side(b) == "serve"]


def test_serve_imports_no_device_module():
    bad = [f"{a} -> {b}" for a, b in _runtime_arrows("serve") if _side(b) == "device"]
    assert bad == []


def test_process_and_config_import_nothing_above_them():
    bad = [f"{a} -> {b}" for a, b in _runtime_arrows("process") if _side(b) != "process"]
    bad += [f"jmtp.runtime.config -> {b}" for b in _graph()["jmtp.runtime.config"]
            if b.startswith("jmtp.runtime.")]
    assert bad == []
