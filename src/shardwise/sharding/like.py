"""Shard other tensors exactly as a plan shards a model's parameters.

Gradients, optimizer moments and reference weights have the parameters' shapes; to
compare or move them, each rank needs its shard of each. Rather than a second copy of
the slicing rules, this runs the same plan over a copy of the model whose parameters
hold the other tensors.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from shardwise.comm import Communicator
from shardwise.sharding.apply import parallelize
from shardwise.sharding.plan import Plan

__all__ = ["shard_like", "shard_grads_like"]


def shard_like(
    model: nn.Module, plan: Plan, values: dict[str, torch.Tensor], *, comm: Communicator
) -> dict[str, torch.Tensor]:
    """This rank's shard of `values` (unsharded, keyed like model.named_parameters())."""
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in twin.named_parameters():
            p.copy_(values[name])
    parallelize(twin, plan, comm=comm)
    return {name: p.detach() for name, p in twin.named_parameters()}


def shard_grads_like(model: nn.Module, plan: Plan, *, comm: Communicator) -> dict[str, torch.Tensor]:
    """This rank's shard of every unsharded parameter gradient of `model`."""
    grads = {name: p.grad for name, p in model.named_parameters()}
    missing = [n for n, g in grads.items() if g is None]
    if missing:
        raise ValueError(f"parameters without a gradient: {', '.join(missing)}")
    return shard_like(model, plan, grads, comm=comm)
