"""Autograd-aware collectives: the f and g operators of Megatron-LM (Shoeybi et al., 2019).

Each is a named torch.autograd.Function whose docstring says what it does forward and
backward. The wrappers below short-circuit a size-1 group, so at tp=1 no autograd node
and no collective is created.

Where they sit in a tensor-parallel MLP  Y = GeLU(X A) B,  A = [A_1 .. A_p] by columns,
B = [B_1; ..; B_p] by rows:

    X --copy_to_region--> X A_i --GeLU--> (X A_i) B_i --reduce_from_region--> Y
"""

from __future__ import annotations

import torch

from shardwise.comm.communicator import Communicator

__all__ = [
    "copy_to_region",
    "reduce_from_region",
    "gather_from_region",
    "scatter_to_region",
    "CopyToRegion",
    "ReduceFromRegion",
    "GatherFromRegion",
    "ScatterToRegion",
]


class CopyToRegion(torch.autograd.Function):
    """Forward: identity (every rank already has X). Backward: all-reduce dL/dX over the group."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Communicator) -> torch.Tensor:
        ctx.comm = comm
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.comm.all_reduce(grad), None


class ReduceFromRegion(torch.autograd.Function):
    """Forward: all-reduce the partial sums. Backward: identity (the gradient is replicated)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Communicator, inplace: bool = False) -> torch.Tensor:
        if _in_place(x, inplace):
            ctx.mark_dirty(x)  # x is reduced in place: autograd must know
        return _all_reduce(x, comm, inplace)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None, None


class GatherFromRegion(torch.autograd.Function):
    """Forward: all-gather the shards along the last dim. Backward: keep this rank's slice."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Communicator) -> torch.Tensor:
        ctx.comm = comm
        return comm.all_gather(x, dim=-1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _local_chunk(grad, ctx.comm), None


class ScatterToRegion(torch.autograd.Function):
    """Forward: keep this rank's slice of the last dim. Backward: all-gather the gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Communicator) -> torch.Tensor:
        ctx.comm = comm
        return _local_chunk(x, comm)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.comm.all_gather(grad.contiguous(), dim=-1), None


def _needs_grad(x: torch.Tensor) -> bool:
    # Without autograd (inference) the Functions' forwards are called directly: an
    # autograd.Function.apply costs several microseconds, four times per layer per token.
    return x.requires_grad and torch.is_grad_enabled()


def copy_to_region(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    if comm.size == 1 or not _needs_grad(x):
        return x  # identity forward; the backward all-reduce is only needed with autograd
    return CopyToRegion.apply(x, comm)


def reduce_from_region(x: torch.Tensor, comm: Communicator, *, inplace: bool = False) -> torch.Tensor:
    """inplace=True reduces x's own storage, saving a copy per call: only for a fresh
    partial product that nothing else reads (a row-parallel matmul's output)."""
    if comm.size == 1:
        return x
    if not _needs_grad(x):
        return _all_reduce(x, comm, inplace)
    return ReduceFromRegion.apply(x, comm, inplace)


def _in_place(x: torch.Tensor, inplace: bool) -> bool:
    return inplace and x.is_contiguous()


def _all_reduce(x: torch.Tensor, comm: Communicator, inplace: bool) -> torch.Tensor:
    return comm.all_reduce_(x) if _in_place(x, inplace) else comm.all_reduce(x)


def gather_from_region(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    return x if comm.size == 1 else GatherFromRegion.apply(x, comm)


def scatter_to_region(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    return x if comm.size == 1 else ScatterToRegion.apply(x, comm)


def _local_chunk(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    last = x.shape[-1]
    if last % comm.size:
        raise ValueError(f"last dim {last} is not divisible by group {comm.name!r} of size {comm.size}")
    width = last // comm.size
    return x[..., comm.rank * width : (comm.rank + 1) * width].contiguous()
