"""The planner's modules import downward only (no circles, lazy imports included), and
the planner reads measurements as data: it never imports the measuring code in bench/."""

from __future__ import annotations

import ast
from pathlib import Path

import shardwise

SRC = Path(shardwise.__file__).parent
PACKAGES = ("planner", "bench")


def _module(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _graph() -> dict[str, set[str]]:
    """module -> the shardwise modules it imports, anywhere in the file (lazy ones too)."""
    files = {_module(p): p for pkg in PACKAGES for p in (SRC / pkg).rglob("*.py")}
    known = {_module(p) for p in SRC.rglob("*.py")}
    graph = {}
    for name, path in files.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                deps.add(node.module)
                deps |= {f"{node.module}.{a.name}" for a in node.names}
        graph[name] = {d for d in deps if d in known and d != name}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return [*path[path.index(dep) :], dep] if dep in path else [*path, dep]
            if dep in graph and dep not in state:
                found = visit(dep, [*path, dep])
                if found:
                    return found
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state:
            found = visit(start, [start])
            if found:
                return found
    return None


def test_planner_and_bench_have_no_import_circles():
    graph = _graph()
    assert "shardwise.planner.search" in graph["shardwise.planner.recommend"]  # the graph sees imports
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_a_circle_is_found():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_the_planner_never_imports_the_measuring_code():
    bad = {m: sorted(d for d in deps if d.startswith("shardwise.bench")) for m, deps in _graph().items()}
    assert {m: d for m, d in bad.items() if m.startswith("shardwise.planner") and d} == {}
