"""Rank functions of the communicator tests, fn(world, ...): every collective's result on
tp and dp sub-groups, and the region autograd functions forward and backward. Each
raises on a mismatch; the gloo tests (through the rank pool) and the MPI test run them."""

from __future__ import annotations

import torch

from helpers import tp_group
from shardwise.comm import (
    ParallelDims,
    copy_to_region,
    gather_from_region,
    reduce_from_region,
    scatter_to_region,
)

__all__ = ["collectives_case", "regions_case", "uneven_case"]


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
