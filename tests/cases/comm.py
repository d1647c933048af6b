"""Rank functions of the communicator tests, fn(world, ...): every collective's result on
tp and dp sub-groups, and the region autograd functions forward and backward. Each
raises on a mismatch; the gloo tests (through the rank pool) and the MPI test run them."""

from __future__ import annotations

import re

import torch

from helpers import tp_group
from shardwise.comm import (
    Communicator,
    ParallelDims,
    all_to_all,
    copy_to_region,
    gather_from_region,
    reduce_from_region,
    scatter_to_region,
)

__all__ = [
    "collectives_case",
    "regions_case",
    "uneven_case",
    "all_to_all_case",
    "all_to_all_never_arrives",
    "check_all_to_all",
]


def collectives_case(comm, tp: int) -> dict:
    mesh = ParallelDims(world_size=comm.size, tp=tp).build(comm)
    r, tp_rank, dp_rank = comm.rank, mesh.tp.rank, mesh.dp.rank
    tp_members = ParallelDims(world_size=comm.size, tp=tp).tp_groups()[r // tp]
    assert mesh.tp.size == tp and mesh.dp.size == comm.size // tp
    assert tp_rank == r % tp and dp_rank == r // tp

    # all_reduce sums (and maxes) within the group only
    got = mesh.tp.all_reduce(torch.full((2, 3), float(r)))
    assert torch.equal(got, torch.full((2, 3), float(sum(tp_members))))
    got = mesh.tp.all_reduce(torch.tensor([float(r), -float(r)]), op="max")
    assert torch.equal(got, torch.tensor([float(max(tp_members)), -float(min(tp_members))]))
    x = torch.tensor([1.0])
    assert mesh.tp.all_reduce(x) is not x or tp == 1, "collectives must not alias their input"
    for dtype in (torch.bfloat16, torch.float16):
        got = mesh.tp.all_reduce(torch.full((4,), 0.5, dtype=dtype))
        assert got.dtype == dtype and torch.equal(got, torch.full((4,), 0.5 * tp, dtype=dtype))

    # all_gather along dim 0 and dim 1, in rank order
    t = torch.arange(6.0).view(2, 3) + 100 * r
    for dim in (0, 1, -1):
        got = mesh.tp.all_gather(t, dim=dim)
        expect = torch.cat([torch.arange(6.0).view(2, 3) + 100 * m for m in tp_members], dim=dim)
        assert torch.equal(got, expect), (dim, got, expect)

    # reduce_scatter: sum, then this rank's chunk of the dim
    t = torch.arange(4.0 * tp).view(2, 2 * tp) * (r + 1)
    for dim in (1, 0) if tp <= 2 else (1,):
        got = mesh.tp.reduce_scatter(t, dim=dim)
        full = torch.arange(4.0 * tp).view(2, 2 * tp) * sum(m + 1 for m in tp_members)
        assert torch.equal(got, full.chunk(tp, dim=dim)[tp_rank]), (dim, got)

    # broadcast from the group's last rank (a group-local index)
    src = tp - 1
    got = mesh.tp.broadcast(torch.full((3,), float(r)), src=src)
    assert torch.equal(got, torch.full((3,), float(tp_members[src])))

    # dp group: ranks holding the same tp slice
    got = mesh.dp.all_reduce(torch.tensor([float(r)]))
    assert got.item() == sum(range(tp_rank, comm.size, tp))
    mesh.world.barrier()
    return comm.stats.snapshot()


def regions_case(world) -> None:
    comm = tp_group(world)
    p, r = comm.size, comm.rank
    torch.manual_seed(0)
    x = torch.randn(2, 3, 4 * p)  # the same full tensor on every rank
    g = torch.randn(2, 3, 4)  # the same upstream gradient of one shard on every rank
    local = x.chunk(p, dim=-1)[r]

    # scatter: forward keeps this rank's slice; backward all-gathers the gradient
    xs = x.clone().requires_grad_()
    y = scatter_to_region(xs, comm)
    assert torch.equal(y, local)
    y.backward(g)
    assert torch.equal(xs.grad, g.repeat(1, 1, p))

    # gather: forward concatenates the shards; backward keeps this rank's slice
    ls = local.clone().requires_grad_()
    y = gather_from_region(ls, comm)
    assert torch.equal(y, x)
    y.backward(x * 2)
    assert torch.equal(ls.grad, local * 2)

    # copy: identity forward; backward sums the gradient over the group
    xc = local.clone().requires_grad_()
    y = copy_to_region(xc, comm)
    assert torch.equal(y, local)
    y.backward(torch.full_like(local, float(r + 1)))
    assert torch.equal(xc.grad, torch.full_like(local, float(sum(range(1, p + 1)))))

    # reduce: forward sums over the group; backward passes the gradient through
    xr = torch.full((2,), float(r)).requires_grad_()
    y = reduce_from_region(xr, comm)
    assert torch.equal(y, torch.full((2,), float(sum(range(p)))))
    y.backward(torch.ones(2))
    assert torch.equal(xr.grad, torch.ones(2))

    if p == 1:  # size-1 groups short-circuit: no autograd node, no collective
        assert copy_to_region(x, comm) is x and reduce_from_region(x, comm) is x
        assert comm.stats.calls() == 0


def uneven_case(world) -> dict:
    """All-gather and reduce-scatter of parts of different lengths (an uneven tp split):
    exact results, the padded bytes in the accounting, and the region functions' gradients."""
    comm = tp_group(world)
    p, r = comm.size, comm.rank
    sizes = [3 + (k % 2) * 2 for k in range(p)]  # 3, 5, 3, 5: no two neighbours alike
    offsets = [sum(sizes[:k]) for k in range(p)]
    full = torch.arange(2.0 * sum(sizes)).view(2, sum(sizes))  # the same tensor on every rank
    mine = full[:, offsets[r] : offsets[r] + sizes[r]]
    with comm.stats.track() as gathered:
        got = comm.all_gather(mine.contiguous(), dim=1, sizes=sizes)
    assert torch.equal(got, full), (got, full)
    with comm.stats.track() as scattered:
        got = comm.reduce_scatter(full * (r + 1), dim=1, sizes=sizes)
    assert torch.equal(got, mine * sum(range(1, p + 1))), got

    # regions: gather forward / own slice backward, scatter forward / gather backward
    ls = mine.clone().requires_grad_()
    y = gather_from_region(ls, comm, sizes=sizes)
    assert torch.equal(y, full)
    y.backward(full * 3)
    assert torch.equal(ls.grad, mine * 3)
    xs = full.clone().requires_grad_()
    y = scatter_to_region(xs, comm, sizes=sizes)
    assert torch.equal(y, mine)
    y.backward(mine * 2)
    assert torch.equal(xs.grad, full * 2)
    return {"gather": gathered.snapshot(), "scatter": scattered.snapshot(), "sizes": sizes}


def _a2a_sizes(p: int) -> list[list[int]]:
    """sizes[s][d]: rows rank s sends rank d. Uneven, with zeros (rank 0 sends itself nothing,
    the last rank receives nothing from rank 1), and no two ranks alike."""
    sizes = [[(3 * s + 2 * d) % 5 for d in range(p)] for s in range(p)]
    if p > 1:
        sizes[1][p - 1] = 0
    return sizes


def _a2a_rows(s: int, d: int, n: int, dtype: torch.dtype, tail: tuple[int, ...]) -> torch.Tensor:
    """The n rows rank s sends rank d: values that name (s, d, row)."""
    base = torch.arange(n, dtype=torch.float64).view(n, *[1] * len(tail)) + 10 * d + 100 * s
    return (base + torch.zeros(n, *tail, dtype=torch.float64)).to(dtype)


def all_to_all_case(world) -> dict:
    """Communicator.all_to_all with uneven and empty splits, for several dtypes and shapes, recv
    sizes given or exchanged; the pairwise point-to-point fallback; bad sizes raising before any
    communication; and the autograd all_to_all's gradient against its unsharded twin (a row
    permutation of every rank's rows, concatenated). Returns the accounting of one exchange."""
    p, r = world.size, world.rank
    sizes = _a2a_sizes(p)
    send = sizes[r]
    recv = [sizes[s][r] for s in range(p)]
    for dtype, tail in ((torch.float32, (3,)), (torch.bfloat16, (2, 2)), (torch.int64, ()), (torch.bool, (4,))):
        t = torch.cat([_a2a_rows(r, d, send[d], dtype, tail) for d in range(p)])
        expect = torch.cat([_a2a_rows(s, r, recv[s], dtype, tail) for s in range(p)])
        for given in (recv, None):
            got = world.all_to_all(t, send, given)
            assert got.dtype == dtype and torch.equal(got, expect), (dtype, given, got, expect)
        if p > 1 and dtype == torch.float32:
            got = Communicator._all_to_all(world, t, send, recv)  # the point-to-point fallback
            assert torch.equal(got, expect), ("pairwise", got, expect)
    assert world.all_to_all_sizes(send) == recv

    t = torch.cat([_a2a_rows(r, d, send[d], torch.float32, (3,)) for d in range(p)])
    with world.stats.track() as one:
        world.all_to_all(t, send, recv)
    with world.stats.track() as learnt:
        world.all_to_all(t, send)
    errors = []
    for bad_send, bad_recv in (
        ([*send, 1], None),
        ([send[0] + 1, *send[1:]], None),
        (send, [*recv, 0]),
        (send, [-1] * p),
    ):
        with world.stats.track() as none:
            try:
                world.all_to_all(t, bad_send, bad_recv)
            except ValueError as e:
                errors.append(str(e))
        assert none.calls() == 0, "bad sizes must raise before any communication"

    # autograd: the twin is the permutation of the global rows (every rank's, in rank order)
    torch.manual_seed(0)
    width = 3
    xs = [torch.randn(sum(sizes[s]), width) for s in range(p)]  # every rank's input
    gs = [torch.randn(sum(sizes[s][d] for s in range(p)), width) for d in range(p)]  # every rank's upstream grad
    x = xs[r].clone().requires_grad_()
    y = all_to_all(x, world, send)
    twin_x = torch.cat(xs).requires_grad_()
    parts = [list(xi.split(sizes[s])) for s, xi in enumerate(twin_x.split([sum(row) for row in sizes]))]
    twin_y = [torch.cat([parts[s][d] for s in range(p)]) for d in range(p)]
    assert torch.equal(y, twin_y[r])
    y.backward(gs[r])
    torch.cat(twin_y).backward(torch.cat(gs))
    offset = sum(sum(sizes[s]) for s in range(r))
    assert torch.equal(x.grad, twin_x.grad[offset : offset + sum(send)])
    if p == 1:
        assert all_to_all(x, world, send) is x and world.stats.calls() == 0
    return {"one": one.snapshot(), "learnt": learnt.snapshot(), "sent_bytes": t.numel() * 4, "errors": errors}


def all_to_all_never_arrives(world) -> None:
    """Rank 1 never joins the all_to_all (run by launch, with a short timeout)."""
    if world.rank == 1:
        import time

        time.sleep(120)
    world.all_to_all(torch.ones(4, 2), [2] * 2, [2] * 2)


def check_all_to_all(out: dict, world_size: int) -> None:
    """all_to_all_case's accounting (bytes sent, the count exchange one more call) and errors."""
    if world_size == 1:
        assert out["one"] == {} and out["learnt"] == {}, "size 1 short-circuits"
    else:
        assert out["one"] == {"all_to_all/world": {"calls": 1, "bytes": out["sent_bytes"]}}
        assert out["learnt"] == {"all_to_all/world": {"calls": 2, "bytes": out["sent_bytes"] + 8 * world_size}}
    wrong_length, wrong_sum, wrong_recv, negative = out["errors"]
    assert f"must give one int >= 0 for each of {world_size} ranks" in wrong_length
    assert re.search(r"send_sizes \[.*\] sum to \d+ but rank \d's tensor has \d+ rows", wrong_sum), wrong_sum
    assert "recv_sizes" in wrong_recv and "recv_sizes [-1" in negative
