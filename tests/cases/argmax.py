"""Rank function of the vocab-parallel greedy choice's test (shardwise.engine.argmax)."""

from __future__ import annotations

import torch

from shardwise.engine.argmax import split_logits, vocab_parallel_argmax
from shardwise.layers.embedding import VocabParallelLMHead

__all__ = ["argmax_case"]


def argmax_case(world) -> int:
    """A vocab-parallel head over the world (a vocabulary the ranks do not divide: padded
    columns), logits with ties across shards, +inf, NaN: every rank's choice equals
    torch.argmax of the whole row, on every rank. Returns the rows checked."""
    V, D, B = 37, 8, 3
    torch.manual_seed(0)
    full = torch.nn.Linear(D, V, bias=False)
    head = VocabParallelLMHead.from_linear(full, comm=world, gather_output=True)
    model = torch.nn.Module()
    model.lm_head = head
    x = torch.randn(B, D)
    checked = 0
    with torch.no_grad():
        for case in ("random", "ties", "inf", "nan"):
            whole = full(x)  # (B, V)
            if case == "ties":  # integers: equal maxima in different shards, the lowest index wins
                whole = (whole * 2).round().clamp(max=2.0)
            elif case == "inf":
                whole[:, [3, V - 2]] = float("inf")
            elif case == "nan":
                whole[0, V - 1] = float("nan")
                whole[1, [2, 30]] = float("nan")  # two NaNs: the first
            local = whole.new_full((B, head.shard.local), float("-inf"))
            n = max(head.shard.real_end - head.shard.start, 0)
            local[:, :n] = whole[:, head.shard.start : head.shard.start + n]
            got = vocab_parallel_argmax(local, head) if world.size > 1 else torch.argmax(local, -1)
            want = torch.argmax(whole, dim=-1)
            assert torch.equal(got, want), f"{case} at world size {world.size}: {got.tolist()} != {want.tolist()}"
            every = world.all_gather(got.unsqueeze(0), dim=0)
            assert bool((every == got).all()), f"{case}: ranks disagree"
            checked += B
        # the head itself: split inside the context, gathered again after it
        with split_logits(model) as h:
            split = model.lm_head(x)
        assert (h is head) == (world.size > 1) and head.gather_output
        assert split.shape == (B, head.shard.local if world.size > 1 else V)
        assert torch.equal(vocab_parallel_argmax(split, head) if h else split.argmax(-1), full(x).argmax(-1))
    return checked
