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
