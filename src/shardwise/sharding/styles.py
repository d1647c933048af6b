"""Sharding styles: how one module is split. A plan maps module paths to these.

Each style checks a module against a tp size without touching any communicator
(`check`), then swaps it for its tensor-parallel twin (`apply`). Styles are small
frozen dataclasses, so a plan is plain data that the planner can read too.

Sequence parallelism is part of the plan too: the split layers take sequence_parallel=True
(their input or output is a sequence shard, see shardwise.comm.regions), the modules
between them that run on the shard are marked "sequence" (norms), and a replicated
module whose output must be split along the sequence is SequenceScatter (learned
position embeddings). `partial_grads` names the parameters whose gradient each rank then
computes from its own positions only, which training sums over tp
(shardwise.sharding.sequence).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from shardwise.comm import Communicator
from shardwise.comm.regions import scatter_to_sequence
from shardwise.layers import (
    ColumnParallelLinear,
    HeadLayout,
    MergedColumnParallelLinear,
    ParallelMoE,
    QKVParallelLinear,
    RowParallelLinear,
    ShardError,
    VocabParallelEmbedding,
    VocabParallelLMHead,
)
from shardwise.models.moe import MoE

__all__ = [
    "Style",
    "Colwise",
    "Rowwise",
    "Vocab",
    "Replicate",
    "QKV",
    "MergedColwise",
    "SequenceSharded",
    "SequenceScatter",
    "MixtureOfExperts",
    "STYLE_NAMES",
    "as_style",
]


def _require(path: str, module: nn.Module, kinds: tuple[type, ...], style: Style) -> None:
    if not isinstance(module, kinds):
        names = " or ".join(k.__name__ for k in kinds)
        raise ShardError(f"{path}: style {style} needs {names}, found {type(module).__name__}")


def _split(path: str, what: str, size: int, tp: int, unit: int = 1, unit_name: str = "") -> None:
    """Raise unless `size` splits over tp in whole units (e.g. whole heads of `unit` columns),
    each rank getting at least one. The shares may differ by a unit (an uneven split)."""
    if size % unit:
        raise ShardError(f"{path}: {what}={size} is not a multiple of {unit_name}={unit}")
    units = size // unit
    if units < tp:
        kind = "blocks" if unit_name == "weight block" else "heads"
        count = f"{what}={size}" if unit == 1 else f"{what}={size} ({units} {kind} of {unit_name}={unit})"
        raise ShardError(f"{path}.weight: {count} cannot give each of tp={tp} ranks a share; valid tp sizes: 1-{units}")


class Style(ABC):
    name: ClassVar[str]

    @abstractmethod
    def check(self, path: str, module: nn.Module, tp: int) -> None:
        """Raise ShardError (naming `path` and the numbers) if `module` cannot be split over tp."""

    @abstractmethod
    def apply(self, module: nn.Module, comm: Communicator) -> nn.Module:
        """This rank's tensor-parallel replacement for `module`."""

    def partial_grads(self, module: nn.Module) -> list[str]:
        """Names of `module`'s parameters (after apply) whose gradient is a partial sum over
        tp, each rank having used them on its sequence shard only."""
        return []

    def __str__(self) -> str:
        return self.name


def _sequence(layer: nn.Module, on: bool) -> nn.Module:
    layer.sequence_parallel = on
    return layer


@dataclass(frozen=True)
class Colwise(Style):
    """nn.Linear split by output features. head_dim, if given, keeps whole heads together."""

    name: ClassVar[str] = "colwise"
    gather_output: bool = False
    head_dim: int | None = None
    sequence_parallel: bool = False
    """The input is a sequence shard, all-gathered in forward."""

    def check(self, path, module, tp):
        _require(path, module, (nn.Linear,), self)
        _split(path, "out_features", module.out_features, tp, self.head_dim or 1, "head_dim")

    def apply(self, module, comm):
        return ColumnParallelLinear.from_linear(
            module,
            comm=comm,
            gather_output=self.gather_output,
            sequence_parallel=self.sequence_parallel,
            unit=self.head_dim,
        )


@dataclass(frozen=True)
class Rowwise(Style):
    """nn.Linear split by input features; its input must be the output of a colwise split
    (with the same head_dim, so that both cut the same heads)."""

    name: ClassVar[str] = "rowwise"
    head_dim: int | None = None
    sequence_parallel: bool = False
    """The output is reduce-scattered to a sequence shard (and the bias added on it)."""
    num_kv_heads: int | None = None
    """Attention's output projection: split by the query heads HeadLayout gives the fused qkv."""

    def check(self, path, module, tp):
        _require(path, module, (nn.Linear,), self)
        _split(path, "in_features", module.in_features, tp, self.head_dim or 1, "head_dim")

    def apply(self, module, comm):
        return RowParallelLinear.from_linear(
            module,
            comm=comm,
            sequence_parallel=self.sequence_parallel,
            unit=self.head_dim,
            num_kv_heads=self.num_kv_heads,
        )

    def partial_grads(self, module):
        return ["bias"] if self.sequence_parallel and module.bias is not None else []


@dataclass(frozen=True)
class Vocab(Style):
    """nn.Embedding or an LM-head nn.Linear split by vocabulary rows (padded, never an error)."""

    name: ClassVar[str] = "vocab"
    gather_output: bool = True
    """For an LM head: return full logits (True) or vocab-parallel ones for the loss (False)."""
    sequence_parallel: bool = False
    """An embedding's output is reduce-scattered to a sequence shard; an LM head's input is a
    sequence shard, all-gathered in forward."""

    def check(self, path, module, tp):
        _require(path, module, (nn.Embedding, nn.Linear), self)

    def apply(self, module, comm):
        if isinstance(module, nn.Embedding):
            layer = VocabParallelEmbedding.from_embedding(module, comm=comm)
        else:
            layer = VocabParallelLMHead.from_linear(module, comm=comm, gather_output=self.gather_output)
        return _sequence(layer, self.sequence_parallel)


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
    sequence_parallel: bool = False
    """The input is a sequence shard, all-gathered in forward."""

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
        layer = QKVParallelLinear.from_linear(
            module, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, comm=comm
        )
        return _sequence(layer, self.sequence_parallel)


@dataclass(frozen=True)
class MergedColwise(Style):
    """A fused nn.Linear of `parts` equal column blocks (e.g. [gate | up]), each split on its own."""

    name: ClassVar[str] = "merged_colwise"
    parts: int = 2
    sequence_parallel: bool = False
    """The input is a sequence shard, all-gathered in forward."""
    unit: int | None = None
    """Each part is dealt in blocks of this many rows (a GGUF file's weight block); None: automatic."""

    def check(self, path, module, tp):
        _require(path, module, (nn.Linear,), self)
        if module.out_features % self.parts:
            raise ShardError(f"{path}: out_features={module.out_features} is not {self.parts} equal parts")
        _split(path, "out_features per part", module.out_features // self.parts, tp, self.unit or 1, "weight block")

    def apply(self, module, comm):
        sizes = [module.out_features // self.parts] * self.parts
        merged = MergedColumnParallelLinear.from_linear(module, sizes, comm=comm, unit=self.unit)
        return _sequence(merged, self.sequence_parallel)


@dataclass(frozen=True)
class SequenceSharded(Style):
    """A replicated module that runs on this rank's sequence shard (a norm between the split
    layers under sequence parallelism): kept whole, and every parameter's gradient is a
    partial sum over tp."""

    name: ClassVar[str] = "sequence"

    def check(self, path, module, tp):
        pass

    def apply(self, module, comm):
        return module

    def partial_grads(self, module):
        return [n for n, _ in module.named_parameters()]


@dataclass(frozen=True)
class SequenceScatter(Style):
    """A replicated module whose (B, T, ...) output is cut to this rank's sequence shard
    (scatter_to_sequence), e.g. learned position embeddings added to a sequence-parallel
    token embedding. Its gradient is whole: the backward all-gathers the output's."""

    name: ClassVar[str] = "sequence_scatter"

    def check(self, path, module, tp):
        pass

    def apply(self, module, comm):
        module.register_forward_hook(_ScatterOutput(comm))
        return module


class _ScatterOutput:
    """A forward hook: the module's output, this rank's chunk of its sequence."""

    def __init__(self, comm: Communicator) -> None:
        self.comm = comm

    def __call__(self, module: nn.Module, args, output: torch.Tensor) -> torch.Tensor:
        return scatter_to_sequence(output, self.comm)


@dataclass(frozen=True)
class MixtureOfExperts(Style):
    """A mixture-of-experts block (models.moe.MoE): the router replicated, the routed experts
    split by their width (tensor-parallel experts) or dealt out whole (expert_parallel), the
    shared expert by its width; one all-reduce in all (shardwise.layers.moe)."""

    name: ClassVar[str] = "moe"
    expert_parallel: bool = False

    def check(self, path, module, tp):
        _require(path, module, (MoE,), self)
        width = module.experts.up.shape[0] // (2 * module.num_experts)
        if self.expert_parallel:
            if tp > module.num_experts:
                raise ShardError(
                    f"{path}: --expert-parallel needs tp <= num_experts={module.num_experts}, got tp={tp}; "
                    f"valid tp sizes: 1-{module.num_experts}"
                )
        else:
            _split(f"{path}.experts", "expert intermediate size", width, tp)
        if module.shared is not None:
            _split(f"{path}.shared", "shared expert intermediate size", module.shared.down.in_features, tp)

    def apply(self, module, comm):
        return ParallelMoE(module, comm=comm, expert_parallel=self.expert_parallel)


STYLE_NAMES: dict[str, Style] = {
    s.name: s
    for s in (
        Colwise(),
        Rowwise(),
        Vocab(),
        Replicate(),
        MergedColwise(),
        SequenceSharded(),
        SequenceScatter(),
        MixtureOfExperts(),
    )
}


def as_style(value: Style | str) -> Style:
    """A Style, given one or the name of a parameter-free one ("colwise", "rowwise", ...)."""
    if isinstance(value, Style):
        return value
    if value in STYLE_NAMES:
        return STYLE_NAMES[value]
    raise ShardError(f"unknown sharding style {value!r}; known: {', '.join(STYLE_NAMES)}, or a Style object (QKV(...))")
