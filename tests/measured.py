"""What the model tests measured, for the docs' tables: with SHARDWISE_MEASURED=FILE set,
`record(...)` appends one JSON line per comparison to FILE (the assertions are unchanged;
without the variable nothing is written).

    SHARDWISE_MEASURED=/tmp/m.jsonl pytest -m full tests/multiproc/test_gguf_models.py
"""

from __future__ import annotations

import json
import os


def record(test: str, arch: str, fmt: str, layout: str, rel_err: float, **extra) -> None:
    path = os.environ.get("SHARDWISE_MEASURED")
    if not path:
        return
    row = {"test": test, "arch": arch, "format": fmt, "layout": layout, "rel_err": rel_err, **extra}
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")
