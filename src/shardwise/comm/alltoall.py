"""The autograd all-to-all: rows of a tensor sent to the ranks that need them (expert
parallelism's token dispatch, shardwise.layers.dispatch).

Forward, rank r sends rows [sum(send_sizes[:d]), +send_sizes[d]) of x to rank d and
receives recv_sizes[s] rows from each rank s, in rank order. The operation is a
permutation of the rows of the global tensor (every rank's x, concatenated), so its
backward is the inverse permutation: the all-to-all of the gradient with the sizes
swapped, each gradient row going back to the rank (and position) its row came from.
"""

from __future__ import annotations

import torch

from shardwise.comm.communicator import Communicator

__all__ = ["AllToAll", "all_to_all"]


class AllToAll(torch.autograd.Function):
    """Forward: all_to_all(x, send_sizes, recv_sizes) over `comm`. Backward: all_to_all of
    the gradient with send and recv sizes swapped."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Communicator, send_sizes: list[int], recv_sizes: list[int]) -> torch.Tensor:
        ctx.comm, ctx.send_sizes, ctx.recv_sizes = comm, send_sizes, recv_sizes
        return comm.all_to_all(x, send_sizes, recv_sizes)  # (sum(recv_sizes), ...)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # grad (sum(recv_sizes), ...) -> (sum(send_sizes), ...): every row back where it came from
        return ctx.comm.all_to_all(grad.contiguous(), ctx.recv_sizes, ctx.send_sizes), None, None, None


def all_to_all(
    x: torch.Tensor, comm: Communicator, send_sizes: list[int], recv_sizes: list[int] | None = None
) -> torch.Tensor:
    """x (sum(send_sizes), ...) -> (sum(recv_sizes), ...), differentiable (AllToAll).

    recv_sizes None: learnt first with Communicator.all_to_all_sizes (one more small collective,
    outside autograd). A size-1 group creates no autograd node and no collective. Every rank of
    `comm` must call it, and (when x requires grad on one rank) run the backward too."""
    send_sizes = [int(n) for n in send_sizes]
    if comm.size == 1:
        return comm.all_to_all(x, send_sizes, recv_sizes)  # checks the sizes; returns x
    if x.dim() == 0:
        raise ValueError("all_to_all: a 0-dim tensor has no rows (dim 0) to split")
    comm._check_split("all_to_all", "send_sizes", send_sizes, x.shape[0])  # before any collective
    if recv_sizes is None:
        recv_sizes = comm.all_to_all_sizes(send_sizes)
    return AllToAll.apply(x, comm, send_sizes, [int(n) for n in recv_sizes])
