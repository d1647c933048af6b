"""Greedy decoding with the logits left split by vocabulary: each rank's best token, then one
tiny all-gather, instead of the whole logits gathered and the choice broadcast.

    with split_logits(model) as head:              # the vocab-parallel head, gather_output off
        local = model(ids, ..., last_only=True)[:, -1]      # (B, V_pad / tp) on each rank
    tokens = vocab_parallel_argmax(local, head)     # (B,), the same on every rank

A vocab-parallel LM head gathers (B, V) logits to every rank, and rank 0 then picks and
broadcasts the token. For greedy decoding only the largest logit matters: each rank takes its
shard's (kernels.ops.argmax: the first of equal ones, a NaN the largest), and one all-gather of
(value, global index) pairs, 16 bytes a row, gives every rank every shard's; all ranks then
pick alike, torch.argmax's choice over the full row (the largest; NaN above all; of equal ones
the lowest index). For Llama-3's 128,256-token vocabulary at tp=2 that is 16 bytes a token
instead of 256 KiB per rank, and one collective fewer (the broadcast): across hosts, most of
what crossed the link (docs/benchmarks/links.md).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from shardwise.kernels import ops as kernel_ops
from shardwise.layers.embedding import VocabParallelLMHead

__all__ = ["split_head", "split_logits", "vocab_parallel_argmax"]


def split_head(model) -> VocabParallelLMHead | None:
    """The model's vocab-parallel LM head if greedy decoding can leave its logits split (it
    gathers them, over more than one rank), else None."""
    head = getattr(model, "lm_head", None)
    if isinstance(head, VocabParallelLMHead) and head.gather_output and head.comm.size > 1:
        return head
    return None


@contextlib.contextmanager
def split_logits(model) -> Iterator[VocabParallelLMHead | None]:
    """Within it, the model's vocab-parallel head returns this rank's (..., V_pad / tp) logits
    (padded columns -inf) instead of gathering them; yields the head (None: nothing to split)."""
    head = split_head(model)
    if head is None:
        yield None
        return
    head.gather_output = False
    try:
        yield head
    finally:
        head.gather_output = True


def vocab_parallel_argmax(local: torch.Tensor, head: VocabParallelLMHead) -> torch.Tensor:
    """local (B, V_pad / tp): this rank's logits of `head`'s vocabulary rows -> (B,) int64, the
    argmax over every rank's, equal on every rank (see the module docstring)."""
    idx = kernel_ops.argmax(local)  # (B,), this shard's first best
    val = local.gather(-1, idx.unsqueeze(-1)).squeeze(-1)  # (B,)
    mine = torch.stack([val.double(), (idx + head.shard.start).double()], dim=-1)  # (B, 2)
    every = head.comm.all_gather(mine.unsqueeze(0), dim=0)  # (tp, B, 2)
    vals, ids = every[..., 0], every[..., 1]  # (tp, B)
    nan = torch.isnan(vals)
    key = torch.where(nan, torch.inf, vals)  # NaN ties with +inf here ...
    best = key.amax(dim=0)  # (B,)
    wins = (key == best) & (nan | ~nan.any(dim=0))  # ... and wins the tie
    return torch.where(wins, ids, torch.inf).amin(dim=0).long()  # the lowest index among the winners
