"""Rank functions of the expert-parallel dispatch tests, fn(world, ...): every rank holds
different tokens and its own run of experts; dispatch_experts over the world is compared
with one process running all the experts on every rank's tokens, concatenated (forward,
and the gradients of the tokens, the routing weights and each expert's weights). Each
raises on a mismatch; the gloo tests (rank pool) and the MPI test run them."""

from __future__ import annotations

import torch

from helpers import assert_close
from shardwise.layers.dispatch import dispatch_experts
from shardwise.layers.partition import split_ranges
from shardwise.models.moe import Experts

__all__ = ["dispatch_case"]

H, WIDTH = 8, 6  # hidden, expert width


def _routing(n: int, k: int, allowed: list[int], gen: torch.Generator) -> torch.Tensor:
    """(n, k) distinct expert ids per token, drawn from `allowed`."""
    scores = torch.rand(n, len(allowed), generator=gen)  # (n, |allowed|)
    picks = scores.topk(k, dim=-1).indices  # (n, k)
    return torch.tensor(allowed)[picks]


def dispatch_case(world, num_experts: int, k: int, tokens: list[int], starve: int | None = None) -> dict:
    """tokens[r]: rank r's token count (0 allowed). starve: a rank whose experts no token picks
    (it receives nothing). Returns what this rank sent and received (pairs) and the accounting."""
    p, r = world.size, world.rank
    owners = split_ranges(num_experts, p, unit=1, what="experts")
    gen = torch.Generator().manual_seed(1234)  # every rank draws every rank's data alike
    full = Experts(num_experts, H, WIDTH, "silu")
    with torch.no_grad():
        full.up.copy_(torch.randn(full.up.shape, generator=gen) * 0.5)
        full.down.copy_(torch.randn(full.down.shape, generator=gen) * 0.5)
    allowed = [e for e in range(num_experts) if starve is None or not owners[starve][0] <= e < owners[starve][1]]
    xs = [torch.randn(n, H, generator=gen) for n in tokens]  # (n_s, H) each rank's tokens
    idxs = [_routing(n, k, allowed, gen) for n in tokens]  # (n_s, k)
    ws = [torch.rand(n, k, generator=gen) for n in tokens]  # (n_s, k)
    gs = [torch.randn(n, H, generator=gen) for n in tokens]  # (n_s, H) upstream gradients

    # the unsharded twin: one process, all experts, every rank's tokens
    x_all = torch.cat(xs).requires_grad_()
    w_all = torch.cat(ws).requires_grad_()
    y_all = full(x_all, torch.cat(idxs), w_all)  # (sum n, H)
    y_all.backward(torch.cat(gs))

    # this rank: its tokens, its experts
    lo, hi = owners[r]
    mine = Experts(hi - lo, H, WIDTH, "silu")
    mine.first = lo
    with torch.no_grad():
        mine.up.copy_(full.up[lo * 2 * WIDTH : hi * 2 * WIDTH])
        mine.down.copy_(full.down[lo * H : hi * H])
    x = xs[r].clone().requires_grad_()
    w = ws[r].clone().requires_grad_()
    with world.stats.track() as fwd:
        y = dispatch_experts(x, idxs[r], w, mine, world, owners)
    with world.stats.track() as bwd:
        y.backward(gs[r])

    start = sum(tokens[:r])
    rows = slice(start, start + tokens[r])
    assert_close(y, y_all[rows].detach(), "output")
    assert_close(x.grad, x_all.grad[rows], "grad x")
    assert_close(w.grad, w_all.grad[rows], "grad routing weights")
    for name, block in (("up", 2 * WIDTH), ("down", H)):
        got = getattr(mine, name).grad
        expect = getattr(full, name).grad[lo * block : hi * block]
        if got is None:  # no token reached these experts: nothing flowed, the twin's rows are 0
            assert not expect.any(), f"grad {name}: none here, nonzero in the twin"
        else:
            assert_close(got, expect, f"grad {name}")
    received = sum(int(((i >= lo) & (i < hi)).sum()) for i in idxs)
    return {"received": received, "fwd": fwd.snapshot(), "bwd": bwd.snapshot(), "owners": owners}
