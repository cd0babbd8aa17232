"""The package's imports point one way: no module of ``fused_rl`` imports, at module level or
inside a function, a module that imports it back (directly or through others)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

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


# The package's layers, lowest first: a module imports only modules of its own layer or a
# lower one (within a layer, test_no_import_cycle keeps the imports acyclic). The reference
# twin reads alone: plain PyTorch over the leaf helpers, nothing of the Triton side.
LAYERS = (
    ("leaves", ("fused_rl._shapes", "fused_rl.kernels.modes", "fused_rl._compile_marks",
                "fused_rl._mixture_poly")),
    ("reference", ("fused_rl.reference",)),
    ("base", ("fused_rl.config", "fused_rl._version", "fused_rl._backend", "fused_rl._launch",
              "fused_rl._policy_inputs",
              "fused_rl._validation", "fused_rl._agg", "fused_rl.policy_config",
              "fused_rl.profiling", "fused_rl._describe")),
    ("ops", ("fused_rl._ops", "fused_rl._vocab_ops", "fused_rl._policy_ops",
             "fused_rl._truncated_ops", "fused_rl._select_ops",
             "fused_rl._wide_gemm", "fused_rl._whole_rows")),
    ("vocab parallel", ("fused_rl.distributed", "fused_rl.truncated_parallel")),
    ("functions", ("fused_rl.logprobs", "fused_rl.kl", "fused_rl.reductions", "fused_rl.distill",
                   "fused_rl.rollout", "fused_rl.continuous", "fused_rl.advantages",
                   "fused_rl.truncated", "fused_rl.exact_kl",
                   "fused_rl.values", "fused_rl.losses", "fused_rl.linear",
                   "fused_rl.linear_distill")),
    ("adapters", ("fused_rl.nn", "fused_rl.compat", "fused_rl.integrations", "fused_rl.__main__")),
    ("package", ("fused_rl",)),
)  # fmt: skip


def layer_of(module: str) -> int:
    """The layer of ``module`` (a listed module or a submodule of one; ``fused_rl`` itself
    only by name, so a new module must be placed)."""
    for i, (_, prefixes) in enumerate(LAYERS):
        if module in prefixes or any(
            module.startswith(p + ".") for p in prefixes if p != "fused_rl"
        ):
            return i
    raise AssertionError(f"{module} is in no layer of tests/test_imports.py LAYERS: add it")


def test_imports_point_down():
    graph = import_graph()
    upward = [
        f"{m} ({LAYERS[layer_of(m)][0]}) imports {t} ({LAYERS[layer_of(t)][0]})"
        for m, targets in sorted(graph.items())
        for t in sorted(targets)
        if layer_of(t) > layer_of(m)
    ]
    assert upward == []


def test_layer_check_works():
    assert layer_of("fused_rl.reference.policy") < layer_of("fused_rl._launch")
    assert layer_of("fused_rl.compat.verl.core_algos") > layer_of("fused_rl.losses")
    assert layer_of("fused_rl") == len(LAYERS) - 1
    with pytest.raises(AssertionError, match="in no layer"):
        layer_of("fused_rl.somewhere_new")
