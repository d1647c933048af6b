"""Autograd-aware collectives: the f and g operators of Megatron-LM (Shoeybi et al., 2019).

Each is a named torch.autograd.Function whose docstring says what it does forward and
backward. The wrappers below short-circuit a size-1 group, so at tp=1 no autograd node
and no collective is created.

Where they sit in a tensor-parallel MLP  Y = GeLU(X A) B,  A = [A_1 .. A_p] by columns,
B = [B_1; ..; B_p] by rows:

    X --copy_to_region--> X A_i --GeLU--> (X A_i) B_i --reduce_from_region--> Y

Sequence parallelism (Korthikanti et al., 2022) keeps the tensors between the regions
split along the sequence (dim 1 of (batch, seq, hidden)) instead of whole on every rank:
each all-reduce becomes a reduce-scatter and an all-gather of the same volume,

    X_i --gather_from_sequence--> X A_j --GeLU--> (X A_j) B_j --reduce_scatter_to_sequence--> Y_i

so the norms and residual adds between regions run on T / p positions per rank.
"""

from __future__ import annotations

import torch

from shardwise.comm.communicator import Communicator
from shardwise.comm.compress import compressed_all_reduce

__all__ = [
    "copy_to_region",
    "reduce_from_region",
    "gather_from_region",
    "scatter_to_region",
    "CopyToRegion",
    "ReduceFromRegion",
    "GatherFromRegion",
    "ScatterToRegion",
    "SEQ_DIM",
    "gather_from_sequence",
    "reduce_scatter_to_sequence",
    "scatter_to_sequence",
    "GatherFromSequence",
    "ReduceScatterToSequence",
    "ScatterToSequence",
    "all_gather_sequence",
    "reduce_scatter_sequence",
    "check_sequence",
]

SEQ_DIM = 1
"""The sequence dim of every activation sequence parallelism splits: (batch, seq, ...)."""


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
    """Forward: all-reduce the partial sums (compressed when comm.wire says so). Backward:
    identity (the gradient is replicated)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Communicator, inplace: bool = False) -> torch.Tensor:
        if _in_place(x, inplace):
            ctx.mark_dirty(x)  # x is reduced in place: autograd must know
        return _all_reduce(x, comm, inplace)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None, None


class GatherFromRegion(torch.autograd.Function):
    """Forward: all-gather the shards along the last dim (of per-rank `sizes` when they
    differ). Backward: keep this rank's slice."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Communicator, sizes: list[int] | None = None) -> torch.Tensor:
        ctx.comm, ctx.sizes = comm, sizes
        return comm.all_gather(x, dim=-1, sizes=sizes)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _local_chunk(grad, ctx.comm, ctx.sizes), None, None


class ScatterToRegion(torch.autograd.Function):
    """Forward: keep this rank's slice of the last dim (of per-rank `sizes` when they differ).
    Backward: all-gather the gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Communicator, sizes: list[int] | None = None) -> torch.Tensor:
        ctx.comm, ctx.sizes = comm, sizes
        return _local_chunk(x, comm, sizes)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.comm.all_gather(grad.contiguous(), dim=-1, sizes=ctx.sizes), None, None


class GatherFromSequence(torch.autograd.Function):
    """Forward: all-gather the sequence shards (dim 1), T / p -> T positions. Backward:
    reduce-scatter the gradient along dim 1 (every rank's consumer used the whole sequence,
    so each holds a partial sum of the gradient of every position)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Communicator) -> torch.Tensor:
        ctx.comm = comm
        return all_gather_sequence(x, comm)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return reduce_scatter_sequence(grad, ctx.comm), None


class ReduceScatterToSequence(torch.autograd.Function):
    """Forward: sum the partial results over the group and keep this rank's sequence chunk
    (dim 1), T -> T / p positions. Backward: all-gather the gradient along dim 1."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Communicator) -> torch.Tensor:
        ctx.comm = comm
        return reduce_scatter_sequence(x, comm)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return all_gather_sequence(grad, ctx.comm), None


class ScatterToSequence(torch.autograd.Function):
    """Forward: keep this rank's chunk of a replicated tensor's sequence (dim 1). Backward:
    all-gather the gradient (each rank's chunk of it), so the producer sees the whole one."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Communicator) -> torch.Tensor:
        ctx.comm = comm
        check_sequence(x.shape[SEQ_DIM], comm)
        return x.chunk(comm.size, dim=SEQ_DIM)[comm.rank].contiguous()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return all_gather_sequence(grad, ctx.comm), None


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
    if comm.wire != "fp32":  # a slow link: bf16 or 8-bit blocks on the wire (comm.compress)
        out = compressed_all_reduce(x, comm, comm.wire)
        return x.copy_(out) if _in_place(x, inplace) else out
    return comm.all_reduce_(x) if _in_place(x, inplace) else comm.all_reduce(x)


def gather_from_region(x: torch.Tensor, comm: Communicator, *, sizes: list[int] | None = None) -> torch.Tensor:
    return x if comm.size == 1 else GatherFromRegion.apply(x, comm, sizes)


def scatter_to_region(x: torch.Tensor, comm: Communicator, *, sizes: list[int] | None = None) -> torch.Tensor:
    return x if comm.size == 1 else ScatterToRegion.apply(x, comm, sizes)


def _local_chunk(x: torch.Tensor, comm: Communicator, sizes: list[int] | None = None) -> torch.Tensor:
    last = x.shape[-1]
    if sizes is not None:
        if len(sizes) != comm.size or sum(sizes) != last:
            raise ValueError(f"sizes {sizes} do not split a last dim of {last} over group {comm.name!r} of {comm.size}")
        start = sum(sizes[: comm.rank])
        return x[..., start : start + sizes[comm.rank]].contiguous()
    if last % comm.size:
        raise ValueError(f"last dim {last} is not divisible by group {comm.name!r} of size {comm.size}")
    width = last // comm.size
    return x[..., comm.rank * width : (comm.rank + 1) * width].contiguous()


def gather_from_sequence(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """(B, T / p, ...) -> (B, T, ...): all-gather forward, reduce-scatter backward."""
    if comm.size == 1:
        return x
    return GatherFromSequence.apply(x, comm) if _needs_grad(x) else all_gather_sequence(x, comm)


def reduce_scatter_to_sequence(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """(B, T, ...) partial sums -> (B, T / p, ...) summed: reduce-scatter forward, all-gather backward."""
    if comm.size == 1:
        return x
    return ReduceScatterToSequence.apply(x, comm) if _needs_grad(x) else reduce_scatter_sequence(x, comm)


def scatter_to_sequence(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """(B, T, ...) replicated -> (B, T / p, ...) this rank's chunk: no collective forward, all-gather backward."""
    return x if comm.size == 1 else ScatterToSequence.apply(x, comm)


def check_sequence(length: int, comm: Communicator) -> None:
    """Raise (one line, the numbers) unless `length` positions split evenly over the group."""
    if length % comm.size:
        raise ValueError(
            f"sequence parallelism: sequence length {length} is not a multiple of group {comm.name!r} of "
            f"size {comm.size}; use a length that is (e.g. {length - length % comm.size or comm.size})"
        )


def all_gather_sequence(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """The sequence shards of (B, T / p, ...) concatenated along dim 1 (no autograd)."""
    if x.shape[0] == 1:  # NOTE: one row: gather along its leading dim, with no reordering copy
        return comm.all_gather(x[0], dim=0).unsqueeze(0)
    return comm.all_gather(x, dim=SEQ_DIM)


def reduce_scatter_sequence(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """(B, T, ...) summed over the group, this rank's chunk of dim 1 (no autograd)."""
    check_sequence(x.shape[SEQ_DIM], comm)
    if x.shape[0] == 1:
        return comm.reduce_scatter(x[0], dim=0).unsqueeze(0)
    return comm.reduce_scatter(x, dim=SEQ_DIM)
