"""The package's imports point one way: no module of ``fused_rl`` imports, at module level or
inside a function, a module that imports it back (directly or through others)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "fused_rl"


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _targets(module: str, path: Path, node: ast.AST, modules: dict) -> list[str]:
    """The package modules one import statement reaches (``from . import x`` names module
    ``x`` when it is one, else the package)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name in modules]
    base = module.split(".")
    if path.name != "__init__.py":
        base = base[:-1]
    if node.level:
        base = base[: len(base) - node.level + 1]
    parent = ".".join(base + ([node.module] if node.module else []))
    found = []
    for alias in node.names:
        child = f"{parent}.{alias.name}"
        found.append(child if child in modules else parent)
    return [m for m in found if m in modules]


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    graph = {m: set() for m in modules}
    for module, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import | ast.ImportFrom):
                graph[module].update(t for t in _targets(module, path, node, modules)
                                     if t != module and t != "fused_rl")  # fmt: skip
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_cycle_detection_works():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]


def test_no_import_cycle():
    graph = import_graph()
    assert "fused_rl.losses" in graph and "fused_rl.distributed" in graph["fused_rl.losses"]
    assert cycles(graph) == []
