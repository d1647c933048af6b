"""The column-parallel matmul under sequence parallelism: all-gather fused with the GEMM.

Under sequence parallelism a column-parallel layer's input X arrives split along the
sequence, X_i of (B, T / p, in). It needs the whole sequence:

    Y_j = all_gather(X_i) A_j + b_j            (B, T, out / p)

Autograd would save the gathered (B, T, in) input for dA, which is as large as plain
tensor parallelism's replicated input, so half of what sequence parallelism saves at
p = 2 would be lost. As Megatron-LM does (Korthikanti et al., 2022, section 4.2.2), this
saves only X_i and all-gathers it again in backward:

    forward:   X = all_gather(X_i);  Y = X A^T + b;                       saves X_i, A
    backward:  X = all_gather(X_i);  dX = reduce_scatter(dY A);  dA = dY^T X;  db = sum(dY)

So each such layer costs one all-gather forward, and an all-gather plus a reduce-scatter
backward. Under autocast the input is cast before the gather: the gather moves, and the
shard is saved, in the autocast dtype, as autocast's own linear would save it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shardwise.comm import Communicator
from shardwise.comm.regions import all_gather_sequence, reduce_scatter_sequence

__all__ = ["SequenceParallelLinear", "sequence_parallel_linear"]


class SequenceParallelLinear(torch.autograd.Function):
    """Forward: all-gather X's sequence shards, then X A^T + b. Backward: all-gather X again
    for dA; reduce-scatter dX = dY A back to this rank's shard."""

    @staticmethod
    def forward(ctx, x, weight, bias, comm: Communicator):
        # x: (B, T/p, in) this rank's positions; weight: (out/p, in); bias: (out/p,) or None
        if torch.is_autocast_enabled(x.device.type):
            x = x.to(torch.get_autocast_dtype(x.device.type))
        ctx.comm, ctx.has_bias = comm, bias is not None
        ctx.save_for_backward(x, weight)
        return F.linear(all_gather_sequence(x, comm), weight, bias)  # (B, T, out/p)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        comm, dtype = ctx.comm, grad.dtype
        full = all_gather_sequence(x, comm).to(dtype)  # (B, T, in), gathered again
        grad_x = reduce_scatter_sequence(grad.matmul(weight.to(dtype)), comm)  # (B, T/p, in)
        g2 = grad.reshape(-1, grad.shape[-1])  # (B*T, out/p)
        grad_w = g2.t().matmul(full.reshape(-1, full.shape[-1]))  # (out/p, in)
        grad_b = g2.sum(0) if ctx.has_bias else None
        return grad_x, grad_w, grad_b, None


def sequence_parallel_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, comm: Communicator
) -> torch.Tensor:
    """(B, T / p, in) sequence shard -> (B, T, out / p): see the module docstring."""
    if comm.size == 1:
        return F.linear(x, weight, bias)
    if not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)):
        return F.linear(all_gather_sequence(x, comm), weight, bias)
    return SequenceParallelLinear.apply(x, weight, bias, comm)
