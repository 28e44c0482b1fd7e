"""The package's import graph (issue 63): no import cycles, counting imports inside functions too,
and the lowest layers import nothing of the layers above them.

The graph is read from the sources (every ``import`` / ``from ... import`` statement anywhere in a
module, resolved to fastlayers' own modules), so a function-level import that closes a circle
fails here as a top-level one would.
"""

from __future__ import annotations

import ast
from pathlib import Path

import fastlayers

ROOT = Path(fastlayers.__file__).parent


def _modules() -> dict[str, Path]:
    found = {}
    for path in ROOT.rglob("*.py"):
        parts = ("fastlayers", *path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    edges: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                    base = ".".join(parts + ([node.module] if node.module else []))
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
            else:
                continue
            edges[name].update(t for t in targets if t in modules and t != name)
    return edges


def test_every_import_names_a_module_of_the_package():
    """An import of fastlayers (relative ones and those inside functions too) names one of its
    modules: a path left stale by a move fails here, not at the first call that runs the import."""
    modules = _modules()
    stale = []
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                    base = ".".join(parts + ([node.module] if node.module else []))
                if base.startswith("fastlayers") and base not in modules:
                    stale.append(f"{path.name}:{node.lineno}: {base}")
            elif isinstance(node, ast.Import):
                stale += [f"{path.name}:{node.lineno}: {a.name}" for a in node.names
                          if a.name.startswith("fastlayers") and a.name not in modules]
    assert stale == []


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_graph_reads_the_package():
    edges = _graph()
    assert len(edges) > 50
    assert "fastlayers._native" in edges["fastlayers._native.ops_lib"]  # a top-level import
    assert "fastlayers._core.compiling" in edges["fastlayers._core.backend"]  # an import inside a function


def test_no_import_cycles():
    assert _cycles(_graph()) == []


def test_cycle_finder_finds_one():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_lowest_layers_import_nothing_above_them():
    """The kernels (_native, _triton) and the shared internals (_core) import nothing of the layer
    families; the trace-time helpers (_core.compiling) import nothing of fastlayers; the operator
    library's loader knows no layer family. (import-linter's layers contract, run by make test,
    checks the whole order; this test also counts imports inside functions, the same way.)"""
    edges = _graph()
    for name, targets in edges.items():
        if name.startswith(("fastlayers._native", "fastlayers._triton")):
            assert all(t.startswith(("fastlayers._native", "fastlayers._triton")) for t in targets), (name, targets)
        if name.startswith("fastlayers._core"):
            assert all(t.startswith(("fastlayers._core", "fastlayers._native", "fastlayers._triton"))
                       for t in targets), (name, targets)
    assert edges["fastlayers._core.compiling"] == set()
    assert edges["fastlayers._native.ops_lib"] == {"fastlayers._native"}


def test_layer_families_are_independent():
    families = ("fastlayers.rnn", "fastlayers.local", "fastlayers.attention")
    for name, targets in _graph().items():
        own = next((f for f in families if name == f or name.startswith(f + ".")), None)
        if own is not None:
            others = [t for t in targets if t != own and not t.startswith(own + ".") and t.startswith(families)]
            assert others == [], (name, others)
