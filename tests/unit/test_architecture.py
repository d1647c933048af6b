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
