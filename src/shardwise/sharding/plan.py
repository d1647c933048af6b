"""A sharding plan: module-path patterns mapped to styles, validated as a whole.

    plan = {
        "embed": "vocab",
        "layers.*.attn.qkv": QKV(num_heads=16, num_kv_heads=4),
        "layers.*.attn.o": "rowwise",
        "layers.*.mlp.gate_up": "merged_colwise",
        "layers.*.mlp.down": "rowwise",
        "lm_head": Vocab(gather_output=True),
    }

A pattern is a dotted path; each dotted part is matched with fnmatch, so "*" stands
for exactly one part ("layers.*.mlp.down" matches "layers.3.mlp.down").
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from fnmatch import fnmatchcase

from torch import nn

from shardwise.layers import ShardError
from shardwise.sharding.styles import Style, as_style

__all__ = ["Plan", "resolve_plan", "matches"]

Plan = Mapping[str, Style | str]


def matches(pattern: str, path: str) -> bool:
    """Whether a dotted module path matches a plan pattern, one dotted part at a time."""
    want, have = pattern.split("."), path.split(".")
    return len(want) == len(have) and all(fnmatchcase(h, w) for w, h in zip(want, have, strict=True))


def resolve_plan(model: nn.Module, plan: Plan, tp: int) -> dict[str, Style]:
    """Match every pattern to modules and check every split, touching no communicator.

    Returns {module path: style}. Raises ShardError for a pattern that matches nothing,
    a module matched twice, or any tensor that cannot be split over tp; the error names
    the module, the numbers, and the valid tp sizes.
    """
    if tp < 1:
        raise ShardError(f"tp must be >= 1, got {tp}")
    modules = dict(model.named_modules())
    paths = [p for p in modules if p]
    resolved: dict[str, Style] = {}
    owner: dict[str, str] = {}
    for pattern, value in plan.items():
        style = as_style(value)
        hits = [p for p in paths if matches(pattern, p)]
        if not hits:
            close = difflib.get_close_matches(pattern, paths, n=3, cutoff=0.5)
            hint = f"; closest module paths: {', '.join(close)}" if close else ""
            raise ShardError(f"plan pattern {pattern!r} matches no module of {type(model).__name__}{hint}")
        for path in hits:
            if path in owner:
                raise ShardError(f"module {path!r} is matched by both {owner[path]!r} and {pattern!r}")
            owner[path] = pattern
            style.check(path, modules[path], tp)
            resolved[path] = style
    nested = [(a, b) for a in resolved for b in resolved if b.startswith(a + ".")]
    if nested:
        a, b = nested[0]
        raise ShardError(f"plan shards both {a!r} and its submodule {b!r}")
    return resolved
