"""parallelize: apply a plan to a plain single-device module by swapping submodules.

Every split is validated first (resolve_plan), so bad input fails on every rank before
any module changes and before any collective runs. Then each matched module is
replaced by its tensor-parallel twin, whose forward shows its collectives.
"""

from __future__ import annotations

from torch import nn

from shardwise.comm import Communicator
from shardwise.sharding.plan import Plan, resolve_plan

__all__ = ["parallelize"]


def parallelize(model: nn.Module, plan: Plan, *, comm: Communicator) -> nn.Module:
    """Shard `model` in place over the tensor-parallel group `comm`, and return it.

    Weights tied in the original (e.g. an embedding and an LM head sharing one
    Parameter, both with style "vocab") stay tied after sharding.
    """
    resolved = resolve_plan(model, plan, comm.size)
    tied = _tied_groups(model, resolved)
    for path, style in resolved.items():
        parent, _, name = path.rpartition(".")
        holder = model.get_submodule(parent) if parent else model
        setattr(holder, name, style.apply(holder.get_submodule(name), comm))
    for first, *rest in tied:
        shared = model.get_submodule(first).weight
        for path in rest:
            other = model.get_submodule(path)
            if other.weight.shape != shared.shape:
                raise ValueError(f"tied weights of {first!r} and {path!r} were sharded differently")
            other.weight = shared
    return model


def _tied_groups(model: nn.Module, resolved: dict) -> list[list[str]]:
    """Paths of sharded modules whose `weight` is one shared Parameter, grouped."""
    by_param: dict[int, list[str]] = {}
    for path in resolved:
        weight = getattr(model.get_submodule(path), "weight", None)
        if isinstance(weight, nn.Parameter):
            by_param.setdefault(id(weight), []).append(path)
    return [paths for paths in by_param.values() if len(paths) > 1]
