"""Sharding styles: how one module is split. A plan maps module paths to these.

Each style checks a module against a tp size without touching any communicator
(`check`), then swaps it for its tensor-parallel twin (`apply`). Styles are small
frozen dataclasses, so a plan is plain data that the planner can read too.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

from torch import nn

from shardwise.comm import Communicator
from shardwise.layers import (
    ColumnParallelLinear,
    HeadLayout,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    ShardError,
    VocabParallelEmbedding,
    VocabParallelLMHead,
    valid_tp_sizes,
)

__all__ = ["Style", "Colwise", "Rowwise", "Vocab", "Replicate", "QKV", "MergedColwise", "STYLE_NAMES", "as_style"]


def _require(path: str, module: nn.Module, kinds: tuple[type, ...], style: Style) -> None:
    if not isinstance(module, kinds):
        names = " or ".join(k.__name__ for k in kinds)
        raise ShardError(f"{path}: style {style} needs {names}, found {type(module).__name__}")


def _split(path: str, what: str, size: int, tp: int, unit: int = 1, unit_name: str = "") -> None:
    """Raise unless `size` splits over tp in whole units (e.g. whole heads of `unit` columns)."""
    if size % unit:
        raise ShardError(f"{path}: {what}={size} is not a multiple of {unit_name}={unit}")
    if (size // unit) % tp:
        count = f"{what}={size}" if unit == 1 else f"{what}={size} ({size // unit} heads of {unit_name}={unit})"
        valid = ", ".join(map(str, valid_tp_sizes(size // unit)))
        raise ShardError(f"{path}.weight: {count} cannot be split over tp={tp}; valid tp sizes: {valid}")


class Style(ABC):
    name: ClassVar[str]

    @abstractmethod
    def check(self, path: str, module: nn.Module, tp: int) -> None:
        """Raise ShardError (naming `path` and the numbers) if `module` cannot be split over tp."""

    @abstractmethod
    def apply(self, module: nn.Module, comm: Communicator) -> nn.Module:
        """This rank's tensor-parallel replacement for `module`."""

    def __str__(self) -> str:
        return self.name


@dataclass(frozen=True)
class Colwise(Style):
    """nn.Linear split by output features. head_dim, if given, keeps whole heads together."""

    name: ClassVar[str] = "colwise"
    gather_output: bool = False
    head_dim: int | None = None

    def check(self, path, module, tp):
        _require(path, module, (nn.Linear,), self)
        _split(path, "out_features", module.out_features, tp, self.head_dim or 1, "head_dim")

    def apply(self, module, comm):
        return ColumnParallelLinear.from_linear(module, comm=comm, gather_output=self.gather_output)


@dataclass(frozen=True)
class Rowwise(Style):
    """nn.Linear split by input features; its input must be the output of a colwise split."""

    name: ClassVar[str] = "rowwise"
    head_dim: int | None = None

    def check(self, path, module, tp):
        _require(path, module, (nn.Linear,), self)
        _split(path, "in_features", module.in_features, tp, self.head_dim or 1, "head_dim")

    def apply(self, module, comm):
        return RowParallelLinear.from_linear(module, comm=comm)


@dataclass(frozen=True)
class Vocab(Style):
    """nn.Embedding or an LM-head nn.Linear split by vocabulary rows (padded, never an error)."""

    name: ClassVar[str] = "vocab"
    gather_output: bool = True
    """For an LM head: return full logits (True) or vocab-parallel ones for the loss (False)."""

    def check(self, path, module, tp):
        _require(path, module, (nn.Embedding, nn.Linear), self)

    def apply(self, module, comm):
        if isinstance(module, nn.Embedding):
            return VocabParallelEmbedding.from_embedding(module, comm=comm)
        return VocabParallelLMHead.from_linear(module, comm=comm, gather_output=self.gather_output)


@dataclass(frozen=True)
class Replicate(Style):
    """Every rank keeps the whole module (norms, small layers). Listed to make it explicit."""

    name: ClassVar[str] = "replicate"

    def check(self, path, module, tp):
        pass

    def apply(self, module, comm):
        return module


@dataclass(frozen=True)
class QKV(Style):
    """A fused [q | k | v] nn.Linear split by heads, with GQA and KV-head replication."""

    name: ClassVar[str] = "qkv"
    num_heads: int = 0
    num_kv_heads: int = 0

    def check(self, path, module, tp):
        _require(path, module, (nn.Linear,), self)
        total = self.num_heads + 2 * self.num_kv_heads
        if self.num_heads < 1 or self.num_kv_heads < 1 or module.out_features % total:
            raise ShardError(
                f"{path}: out_features={module.out_features} is not (num_heads={self.num_heads} + "
                f"2 * num_kv_heads={self.num_kv_heads}) * head_dim"
            )
        try:
            HeadLayout(self.num_heads, self.num_kv_heads, tp)
        except ShardError as e:
            raise ShardError(f"{path}: {e}") from None

    def apply(self, module, comm):
        return QKVParallelLinear.from_linear(
            module, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, comm=comm
        )


@dataclass(frozen=True)
class MergedColwise(Style):
    """A fused nn.Linear of `parts` equal column blocks (e.g. [gate | up]), each split on its own."""

    name: ClassVar[str] = "merged_colwise"
    parts: int = 2

    def check(self, path, module, tp):
        _require(path, module, (nn.Linear,), self)
        if module.out_features % self.parts:
            raise ShardError(f"{path}: out_features={module.out_features} is not {self.parts} equal parts")
        _split(path, "out_features per part", module.out_features // self.parts, tp)

    def apply(self, module, comm):
        sizes = [module.out_features // self.parts] * self.parts
        return MergedColumnParallelLinear.from_linear(module, sizes, comm=comm)


STYLE_NAMES: dict[str, Style] = {s.name: s for s in (Colwise(), Rowwise(), Vocab(), Replicate(), MergedColwise())}


def as_style(value: Style | str) -> Style:
    """A Style, given one or the name of a parameter-free one ("colwise", "rowwise", ...)."""
    if isinstance(value, Style):
        return value
    if value in STYLE_NAMES:
        return STYLE_NAMES[value]
    raise ShardError(f"unknown sharding style {value!r}; known: {', '.join(STYLE_NAMES)}, or a Style object (QKV(...))")
