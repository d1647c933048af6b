"""Sequence parallelism's one duty outside the forward: summing the partial gradients.

Under sequence parallelism a norm's weight (or a row-parallel layer's bias) is replicated
on every tp rank but used on that rank's T / tp positions only, so each rank's gradient
covers only its positions. Megatron-LM marks such parameters and all-reduces their
gradients over tp after backward; here the plan marks them (Style.partial_grads) and

    names = partial_grad_names(model, plan)           # after parallelize(model, plan, ...)
    ...loss.backward()...
    sum_partial_grads(model, names, comm=tp)           # one all-reduce, every such gradient

makes every rank's gradient the whole one, as without sequence parallelism.
"""

from __future__ import annotations

import torch
from torch import nn

from shardwise.comm import Communicator
from shardwise.sharding.plan import Plan, matches
from shardwise.sharding.styles import as_style

__all__ = ["partial_grad_names", "sum_partial_grads", "enable_sequence_parallel"]


def partial_grad_names(model: nn.Module, plan: Plan) -> list[str]:
    """Parameters of a parallelized model whose gradient is a partial sum over tp, in
    registration order: the "sequence" modules' parameters and sequence-parallel rowwise
    biases. Empty for a plan without sequence parallelism."""
    params = dict(model.named_parameters())
    found: set[str] = set()
    for path, module in model.named_modules():
        for pattern, value in plan.items():
            if path and matches(pattern, path):
                found.update(f"{path}.{name}" for name in as_style(value).partial_grads(module))
    missing = found - params.keys()
    if missing:
        raise ValueError(f"plan names parameters the model lacks: {', '.join(sorted(missing))}")
    return [n for n in params if n in found]


def sum_partial_grads(model: nn.Module, names: list[str], *, comm: Communicator) -> None:
    """All-reduce the gradients `names` over tp in one flat collective (in place). A
    parameter with no gradient on this rank contributes zeros and receives the sum."""
    if comm.size == 1 or not names:
        return
    params = dict(model.named_parameters())
    chosen = [params[n] for n in names]
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in chosen]
    flat = comm.all_reduce(torch.cat([g.reshape(-1) for g in grads]))  # (sum of sizes,)
    for p, part in zip(chosen, flat.split([g.numel() for g in grads]), strict=True):
        if p.grad is None:
            p.grad = part.view_as(p).clone()
        else:
            p.grad.copy_(part.view_as(p))


def enable_sequence_parallel(model: nn.Module, plan: Plan, *, comm: Communicator) -> None:
    """Switch a model already parallelized without sequence parallelism (e.g. loaded from a
    Hugging Face directory) to `plan`'s sequence-parallel layout, in place: the split layers
    take their sequence_parallel flag from the plan, SequenceScatter modules get their hook.
    Parameters are unchanged (sequence parallelism moves activations, not weights)."""
    for path, module in model.named_modules():
        for pattern, value in plan.items():
            if not (path and matches(pattern, path)):
                continue
            style = as_style(value)
            if hasattr(module, "sequence_parallel"):
                module.sequence_parallel = bool(getattr(style, "sequence_parallel", False))
            elif style.name == "sequence_scatter":
                style.apply(module, comm)
