"""Vocab-parallel cross-entropy: the loss over sharded logits, never gathering them.

For logits z split by vocabulary over p ranks and a target t:

    loss = log(sum_j exp(z_j - m)) - (z_t - m),   m = max_j z_j

Each rank holds a slice of j. Two all-reduces in forward: the max, then the target
logit and the exp-sum stacked into one tensor. Backward is local:
dL/dz_j = softmax_j - [j == t], restricted to this rank's slice.
"""

from __future__ import annotations

import torch

from shardwise.comm import Communicator

__all__ = ["vocab_parallel_cross_entropy", "VocabParallelCrossEntropy"]


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Forward: per-token CE from vocab-sharded logits (2 all-reduces). Backward: local softmax - one-hot."""

    @staticmethod
    def forward(ctx, logits, target, comm, vocab_start, ignore_index):
        # logits: (N, V/p) this rank's columns; target: (N,) global ids
        z = logits.float()
        m = comm.all_reduce(z.max(dim=-1).values, op="max")  # (N,)
        z = z - m.unsqueeze(-1)  # (N, V/p), padded columns stay -inf
        local = z.shape[-1]
        valid = target != ignore_index
        mine = valid & (target >= vocab_start) & (target < vocab_start + local)
        idx = (target - vocab_start).masked_fill(~mine, 0)
        z_t = z.gather(-1, idx.unsqueeze(-1)).squeeze(-1).masked_fill(~mine, 0.0)  # (N,)
        e = z.exp()  # (N, V/p)
        z_t, sum_e = comm.all_reduce(torch.stack([z_t, e.sum(dim=-1)]))  # (N,), (N,)
        loss = (sum_e.log() - z_t).masked_fill(~valid, 0.0)
        e.div_(sum_e.unsqueeze(-1))  # softmax over the full vocabulary, this rank's slice
        ctx.save_for_backward(e, idx, mine, valid)
        ctx.logits_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, idx, mine, valid = ctx.saved_tensors
        grad = softmax  # reused in place: backward runs once
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad[rows[mine], idx[mine]] -= 1.0
        grad.mul_((grad_loss * valid).unsqueeze(-1))
        return grad.to(ctx.logits_dtype), None, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    comm: Communicator,
    vocab_start: int | None = None,
    ignore_index: int = -100,
) -> torch.Tensor:
    """Per-token cross-entropy of vocab-sharded logits.

    logits: (..., V_pad/p), this rank's columns (as VocabParallelLMHead returns them).
    target: (...), global token ids; positions equal to ignore_index get loss 0.
    vocab_start: first global id of this rank's columns (default rank * V_pad/p).
    Returns (...) losses in fp32; take .mean() over the non-ignored ones yourself.
    """
    if logits.shape[:-1] != target.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and target {tuple(target.shape)} disagree before the vocab dim")
    start = comm.rank * logits.shape[-1] if vocab_start is None else vocab_start
    flat = VocabParallelCrossEntropy.apply(
        logits.reshape(-1, logits.shape[-1]), target.reshape(-1), comm, start, ignore_index
    )
    return flat.view(target.shape)
