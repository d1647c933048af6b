"""The layering the style guide asks for, checked on the source itself."""

from __future__ import annotations

import ast
from pathlib import Path

import shardwise

SRC = Path(shardwise.__file__).parent


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_only_the_torch_communicator_touches_torch_distributed():
    allowed = {SRC / "comm" / "torch_dist.py"}
    offenders = [
        str(p.relative_to(SRC))
        for p in SRC.rglob("*.py")
        if p not in allowed and any(n.startswith("torch.distributed") for n in _imports(p))
    ]
    assert offenders == [], f"call collectives through a Communicator instead: {offenders}"


def test_models_are_plain_modules():
    for p in (SRC / "models").rglob("*.py"):
        bad = [n for n in _imports(p) if n.startswith(("shardwise.comm", "shardwise.layers", "torch.distributed"))]
        assert bad == [], f"{p.name} imports {bad}"


def _backend_only_attributes() -> set[str]:
    """What the Communicator backends hold beyond the Communicator interface (torch's
    `group`, MPI's `comm`, ...): attributes set on `self` and methods of every subclass,
    less the names the base class declares."""
    classes = [n for p in (SRC / "comm").glob("*.py") for n in ast.walk(ast.parse(p.read_text()))]
    classes = [n for n in classes if isinstance(n, ast.ClassDef)]
    public: set[str] = set()
    own: set[str] = set()
    for cls in classes:
        body_names = {n.name for n in cls.body if isinstance(n, ast.FunctionDef)}
        body_names |= {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
        if cls.name == "Communicator":
            public |= body_names
        elif any(isinstance(b, ast.Name) and b.id.endswith("Communicator") for b in cls.bases):
            own |= body_names
            own |= {
                t.attr
                for n in ast.walk(cls)
                if isinstance(n, ast.Assign | ast.AnnAssign)
                for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
                for t in (t.elts if isinstance(t, ast.Tuple) else [t])
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"
            }
    return {n for n in own - public if not n.startswith("__")}


COMM_NAMES = {"world", "comm", "tp", "dp", "group"}  # what code calls a Communicator


def _reaches(source: str, private: set[str]) -> list[str]:
    """getattr/hasattr(x, "<backend-only attribute>") anywhere, and <communicator>.<backend-only
    attribute> on a variable named like a communicator (`dp.group`, `self.tp.comm`)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr", "setattr", "delattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and node.args[1].value in private
        ):
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.Attribute) and node.attr in private:
            base = node.value
            name = base.id if isinstance(base, ast.Name) else base.attr if isinstance(base, ast.Attribute) else None
            if name in COMM_NAMES:
                found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def test_no_reaching_through_a_communicator_into_its_backend():
    private = _backend_only_attributes()
    assert {"group", "comm"} <= private, f"backend-only attributes not found: {private}"
    # The rule catches what train/sync.py used to do for DDP.
    legacy = 'group = getattr(dp, "group", None)\nis_torch = hasattr(dp, "group")\npg = self.dp.group\n'
    assert len(_reaches(legacy, private)) == 3
    offenders = {
        str(p.relative_to(SRC)): hits
        for p in SRC.rglob("*.py")
        if (SRC / "comm") not in p.parents and (hits := _reaches(p.read_text(), private))
    }
    assert offenders == {}, f"use the Communicator interface (e.g. `process_group`), not its backend: {offenders}"


# --- import circles -------------------------------------------------------------------


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _ancestors(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(2, len(parts))]


def import_graph() -> dict[str, set[str]]:
    """module -> the shardwise modules it imports, anywhere in its body. Importing a.b.c
    also runs the __init__ of a.b, unless the importer is itself inside a.b (then that
    __init__ is already running: not an edge)."""
    paths = {_module_name(p): p for p in SRC.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        own = set(_ancestors(name)) | ({name} if path.name == "__init__.py" else set())
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                mods = [
                    f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in paths else node.module for a in node.names
                ]
            else:
                continue
            for m in mods:
                if m in paths:
                    implicit = {a for a in _ancestors(m) if a in paths} - own
                    targets |= {m} | implicit
        graph[name] = targets - {name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_a_circle_is_found():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circles():
    graph = import_graph()
    assert "shardwise.launch.failfast" in graph["shardwise.launch.local"]  # the graph sees imports
    assert "shardwise.launch.mpi" in graph["shardwise.launch.env"]  # lazy ones too (inside a function)
    found = cycles(graph)
    assert found == [], "import circles (two modules that are one idea, or a missing third): " + "; ".join(
        " <-> ".join(c) for c in found
    )


def test_the_planner_never_imports_the_measuring_code():
    """The planner reads measurements as data (a Calibration); bench/ measures."""
    graph = import_graph()
    bad = {m: sorted(d for d in deps if d.startswith("shardwise.bench")) for m, deps in graph.items()}
    assert {m: d for m, d in bad.items() if m.startswith("shardwise.planner") and d} == {}
