"""Rank functions of the compressed all-reduce tests (shardwise.comm.compress), fn(world):
every wire format against the exact fp32 all-reduce, on random data with outliers, at
lengths not divisible by the world size or the block; raise on a mismatch. The gloo tests
(rank pool) and the MPI test run them."""

from __future__ import annotations

import torch

from helpers import tp_group
from shardwise.comm import reduce_from_region
from shardwise.comm.compress import BLOCK, chunk_len, compressed_all_reduce, error_bound, wire_bytes

__all__ = ["compressed_case", "wire_times_case", "LENGTHS"]

LENGTHS = (1, 7, 31, 33, 100, 576 * 3 + 5, 4099)
"""Element counts: below one block, around one, and not divisible by 2, 3, 4 or 32."""


def _inputs(world_size: int, n: int, seed: int) -> list[torch.Tensor]:
    """Every rank's input (each rank builds all of them, to hold its result to the bound)."""
    g = torch.Generator().manual_seed(seed)
    xs = []
    for r in range(world_size):
        x = torch.randn(n, generator=g) * (r + 1)  # ranks of different scales
        spikes = torch.randint(0, n, (max(1, n // 50),), generator=g)
        x[spikes] = torch.randn(len(spikes), generator=g) * 1000  # outliers: a block's scale jumps
        xs.append(x)
    return xs


def compressed_case(world) -> dict:
    comm = tp_group(world)
    p, r = comm.size, comm.rank
    worst: dict[str, float] = {}  # wire -> the largest error / bound seen
    for wire in ("bf16", "q8"):
        for i, n in enumerate(LENGTHS):
            xs = _inputs(p, n, seed=1000 * p + i)
            exact = comm.all_reduce(xs[r].clone())
            shape = (n,) if n % 3 else (3, n // 3)  # any shape: the all-reduce is element-wise
            got = compressed_all_reduce(xs[r].view(shape), comm, wire)
            assert got.shape == shape and got.dtype == torch.float32, (wire, n, got.shape, got.dtype)
            err = (got.reshape(-1) - exact).abs()
            bound = error_bound(xs, wire) + 1e-6 * sum(x.abs() for x in xs)  # fp32's own sums
            ratio = (err / bound).max().item()
            assert ratio <= 1.0, f"{wire} n={n} rank {r}: error {err.max().item():.3g} over the bound (x{ratio:.3g})"
            worst[wire] = max(worst.get(wire, 0.0), ratio)
            every = comm.all_gather(got.reshape(1, -1), dim=0)  # (p, n): the replicas agree bit for bit
            assert all(torch.equal(every[k], got.reshape(-1)) for k in range(p)), f"{wire} n={n}: ranks disagree"
            assert err.max() > 0 or p == 1 or n == 1, f"{wire} n={n}: no error at all, nothing was compressed"
        # the bytes that travel: size chunks out, one chunk gathered
        n = LENGTHS[-1]
        with comm.stats.track() as moved:
            compressed_all_reduce(torch.randn(n), comm, wire)
        c = chunk_len(n, p, wire)
        assert moved.calls("all_to_all") == 1 and moved.calls("all_gather") == 1 and moved.calls("all_reduce") == 0
        assert moved.bytes("all_to_all") == p * wire_bytes(c, wire), (wire, moved)
        assert moved.bytes("all_gather") == wire_bytes(c, wire), (wire, moved)
    # q8 worst case of the docstring: ~ 2 * size * amax / 254 with amax the largest input
    xs = _inputs(p, 4 * BLOCK * p, seed=7)
    got = compressed_all_reduce(xs[r], comm, "q8")
    amax = max(x.abs().max().item() for x in xs)
    assert (got - sum(xs)).abs().max().item() <= 2 * p * amax / 254 * 1.001

    # through the region function, as the layers call it: in place and not, bf16 activations,
    # and under autograd (forward compressed, backward the identity)
    comm.wire = "q8"
    try:
        xs = _inputs(p, 2 * 3 * 50, seed=11)
        y = reduce_from_region(xs[r].view(2, 3, 50).clone(), comm, inplace=True)
        assert torch.equal(y.reshape(-1), compressed_all_reduce(xs[r], comm, "q8"))
        half = reduce_from_region(xs[r].view(2, 3, 50).bfloat16(), comm)
        assert half.dtype == torch.bfloat16 and half.shape == (2, 3, 50)
        xg = xs[r].view(2, 3, 50).clone().requires_grad_()
        y = reduce_from_region(xg, comm)
        y.backward(torch.ones_like(y))
        assert torch.equal(xg.grad, torch.ones_like(xg))
    finally:
        comm.wire = "fp32"
    return worst


def wire_times_case(world) -> dict[str, float]:
    """planner.wire.measure_wires on a tp group of the whole world (as choose_wire runs it)."""
    from shardwise.planner.wire import measure_wires

    return measure_wires(tp_group(world), 2048, repeats=2)
