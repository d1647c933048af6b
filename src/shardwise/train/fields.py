"""Typed dataclasses from TOML tables: unknown keys and wrong types are refused by name.

    build_section(OptimSection, {"lr": 1e-3}, "optim", base_dir, path_fields) -> OptimSection(lr=0.001, ...)

Types come from the dataclass annotations: int, float (an int is accepted), str, bool,
`X | None` and Literal[...]. The dataclass's own __post_init__ then checks the values.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Literal

__all__ = ["ConfigError", "build_section", "check_type"]


class ConfigError(ValueError):
    """An invalid training configuration; the message names the field."""


def build_section(cls: type, raw: dict, name: str, base_dir: str | Path | None, path_fields: set) -> object:
    """cls(**raw) after checking every key is a field and every value has the field's type;
    relative paths in path_fields ((table, key) pairs) are taken from base_dir."""
    if not isinstance(raw, dict):
        raise ConfigError(f"[{name}] must be a table, got {raw!r}")
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ConfigError(f"unknown field {name}.{unknown[0]}; known fields of [{name}]: {', '.join(sorted(known))}")
    values = {}
    for key, value in raw.items():
        values[key] = check_type(value, hints[key], f"{name}.{key}")
        if (name, key) in path_fields and isinstance(value, str) and base_dir is not None and value != "latest":
            values[key] = str((Path(base_dir) / value).resolve()) if not Path(value).is_absolute() else value
    try:
        return cls(**values)
    except TypeError as e:
        raise ConfigError(f"[{name}]: {e}") from None


def check_type(value, hint, where: str):
    """value, checked against a field's type (int accepted for float); ConfigError otherwise."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(hint)
        if value is None and type(None) in options:
            return None
        for option in options:
            if option is type(None):
                continue
            try:
                return check_type(value, option, where)
            except ConfigError:
                pass
        raise ConfigError(f"{where} must be {_describe(hint)}, got {value!r}")
    if origin is list:
        (item,) = typing.get_args(hint)
        if not isinstance(value, list):
            raise ConfigError(f"{where} must be a list of {_describe(item)}s, got {value!r}")
        return [check_type(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is Literal:
        if value not in typing.get_args(hint):
            raise ConfigError(f"{where} must be one of {', '.join(map(repr, typing.get_args(hint)))}, got {value!r}")
        return value
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint is int and isinstance(value, bool):
        raise ConfigError(f"{where} must be an integer, got {value!r}")
    if not isinstance(value, hint):
        raise ConfigError(f"{where} must be {_describe(hint)}, got {value!r}")
    return value


def _describe(hint) -> str:
    names = {int: "an integer", float: "a number", str: "a string", bool: "true or false", type(None): "unset"}
    args = typing.get_args(hint)
    return " or ".join(names.get(a, str(a)) for a in args) if args else names.get(hint, str(hint))
