"""The package's import graph runs one way: core ← pallas ← model ← runtime ← entry points.

Every ``import`` / ``from ... import`` in ``jmtp/`` is read from the source (function-level
imports included, so a circle cannot hide inside a function), and each module is placed in a
layer. A module may import its own layer and the layers below it, and the graph has no cycle."""
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
