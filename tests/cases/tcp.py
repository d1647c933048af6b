"""Rank functions of the direct-TCP collectives' tests (shardwise.comm.tcp), fn(world, ...):
every collective against the wrapped gloo communicator's and the plain sum (pooled ranks, one
host, mode "on"); a decode and a tensor-parallel MLP's gradients with the path on and off; a
rank that fails, dies or never arrives mid-collective, and ranks out of step (launched jobs)."""

from __future__ import annotations

import importlib.resources
from pathlib import Path

import torch

from cases.shm import fail_mid_collective
from shardwise.comm import CollectiveError, ParallelDims
from shardwise.comm.tcp import SPLIT_BYTES, TcpCommunicator, across_hosts

__all__ = [
    "parity_case",
    "decode_case",
    "mlp_grad_case",
    "other_host_case",
    "cannot_listen_case",
    "fails_mid_collective",
    "out_of_step",
]


def _groups(world) -> tuple[TcpCommunicator, object]:
    """The whole world as a tp group twice: over direct TCP, and gloo's own (no shared memory)."""
    on = across_hosts(world.split([list(range(world.size))], name="tp"), parent=world, mode="on")
    off = ParallelDims(world_size=world.size, tp=world.size).build(world, shm_allreduce="off", tcp="off").tp
    assert isinstance(on, TcpCommunicator), f"rank {world.rank}: no tcp path: {on!r}"
    assert not isinstance(off, TcpCommunicator)
    return on, off


def _plain_sum(every: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """every: (size, *shape). Summed in rank order (in fp32 for half precision), then rounded."""
    acc = every[0].float() if dtype == torch.bfloat16 else every[0].clone()
    for part in every[1:]:
        acc = acc + (part.float() if dtype == torch.bfloat16 else part)
    return acc.to(dtype)


def parity_case(world) -> dict:
    """Every collective of the tcp path against gloo's: sums exact (rank order), the rest equal,
    counted alike; big tensors (the reduce-scatter + all-gather path past SPLIT_BYTES at more
    than 2 ranks, a length the ranks do not divide), strided and int64 ones."""
    on, off = _groups(world)
    gen = torch.Generator().manual_seed(77 + world.rank)
    big = SPLIT_BYTES // 4 + 3 * world.size + 1  # floats: past the split, not divisible by the size
    checked = []
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        for shape in ((1, 576), (16, 2048), (3, 5, 7), (big,)):
            x = (torch.randn(shape, generator=gen) * 50).to(dtype)
            every = world.all_gather(x.unsqueeze(0), dim=0)  # (size, *shape)
            what = f"{dtype} {shape} at world size {world.size}, rank {world.rank}"
            with world.stats.track() as c_on:
                got, top = on.all_reduce(x), on.all_reduce(x, "max")
                inplace = x.clone()
                same = on.all_reduce_(inplace)
            with world.stats.track() as c_off:
                ref = off.all_reduce(x)
                off.all_reduce(x, "max")
                off.all_reduce_(x.clone())
            assert got.shape == x.shape and got.dtype == dtype, what
            assert torch.equal(got, _plain_sum(every, dtype)), f"sum of {what}"
            assert torch.equal(inplace, got) and same is inplace, f"in-place sum of {what}"
            assert torch.equal(top, every.amax(0)), f"max of {what}"
            if dtype != torch.bfloat16:  # gloo rounds each partial bf16 sum; ours rounds once
                assert torch.allclose(got.double(), ref.double(), rtol=1e-6, atol=1e-4), f"gloo's sum of {what}"
            assert c_on.snapshot() == c_off.snapshot(), f"{what}: {c_on} != {c_off}"
            replicas = world.all_gather(got.unsqueeze(0), dim=0)
            assert all(torch.equal(r, got) for r in replicas), f"{what}: the ranks' results differ"
            for dim in {0, len(shape) - 1}:
                assert torch.equal(on.all_gather(x, dim=dim), off.all_gather(x, dim=dim)), f"all_gather {dim} {what}"
                if x.shape[dim] % world.size == 0 and dtype != torch.bfloat16:
                    mine = on.reduce_scatter(x, dim=dim)
                    want = _plain_sum(every, dtype).chunk(world.size, dim)[world.rank]
                    assert torch.equal(mine, want), f"reduce_scatter {dim} {what}"
            for src in range(world.size):
                a = x.clone()
                assert on.broadcast(a, src=src) is a and torch.equal(a, every[src]), f"broadcast {src} {what}"
            checked.append(f"{dtype}/{shape}")
    # uneven all-gather and reduce-scatter, an uneven all_to_all with empty parts
    sizes = [5 - (r % 2) for r in range(world.size)]
    part = torch.randn(3, sizes[world.rank], generator=gen)
    assert torch.equal(on.all_gather(part, dim=-1, sizes=sizes), off.all_gather(part, dim=-1, sizes=sizes))
    whole = torch.randn(3, sum(sizes), generator=gen)
    assert torch.allclose(on.reduce_scatter(whole, -1, sizes=sizes), off.reduce_scatter(whole, -1, sizes=sizes))
    send = [(world.rank + d) % 3 for d in range(world.size)]  # 0-2 rows to each rank
    rows = torch.arange(sum(send) * 4, dtype=torch.float32).view(-1, 4) + 100 * world.rank
    assert torch.equal(on.all_to_all(rows, send), off.all_to_all(rows, send))
    y = torch.arange(12.0).view(3, 4).t() + world.rank  # (4, 3), not contiguous
    assert torch.equal(on.all_reduce(y), off.all_reduce(y))
    w = torch.ones(2, 3, requires_grad=True)
    assert torch.equal(on.all_reduce(w).detach(), torch.full((2, 3), float(world.size)))
    return {"checked": checked, "calls": on._calls}


def decode_case(world) -> dict:
    """Greedy tokens of the built-in model with the tp group over direct TCP (the native decode
    step stopping at each all-reduce) and over gloo (the per-op path: no segment, no handle)."""
    from shardwise.engine import generate
    from shardwise.hf import load_pretrained

    root = importlib.resources.files("shardwise") / "assets" / "default"
    prompts = [[1, 17, 42, 99, 7], [3, 250, 8]]
    out = {}
    with importlib.resources.as_file(root) as path:
        for mode in ("on", "off", "q8"):
            tp = (
                ParallelDims(world_size=world.size, tp=world.size)
                .build(world, shm_allreduce="off", tcp="off" if mode == "off" else "on")
                .tp
            )
            tp.wire = "q8" if mode == "q8" else "fp32"  # q8: the native step (fp32 only) is refused
            model, _ = load_pretrained(path, comm=tp)
            with torch.no_grad():
                res = generate(model, prompts, comm=tp, max_new_tokens=12)
            programs = [e.program for e in model.__dict__.get("_step_programs", {}).values() if e]
            out[mode] = {
                "tokens": res.tokens,
                "tcp": isinstance(tp, TcpCommunicator),
                "calls": getattr(tp, "_calls", 0),
                # the native decode step ran, stopping at each all-reduce for the tcp exchange
                "native": [(p.external, p.waits) for p in programs],
                "comm": res.comm_per_step,
            }
            world.close_splits()
    return out


def mlp_grad_case(world) -> dict:
    """A column- then row-parallel MLP over direct TCP: outputs and input and weight gradients
    against the same MLP unsharded (batch 3)."""
    from shardwise.layers import ColumnParallelLinear, RowParallelLinear

    tp = ParallelDims(world_size=world.size, tp=world.size).build(world, shm_allreduce="off", tcp="on").tp
    assert isinstance(tp, TcpCommunicator)
    torch.manual_seed(0)
    h, f = 16, 8 * world.size
    w1, w2 = torch.randn(f, h), torch.randn(h, f)
    x = torch.randn(3, 5, h)
    up = ColumnParallelLinear(h, f, comm=tp, bias=False)
    down = RowParallelLinear(f, h, comm=tp, bias=False)
    start, end = up.ranges[world.rank]
    mine = slice(start, end)
    with torch.no_grad():
        up.weight.copy_(w1[mine])
        down.weight.copy_(w2[:, mine])
    xs = x.clone().requires_grad_()
    y = down(torch.relu(up(xs)))
    y.pow(2).sum().backward()
    xr = x.clone().requires_grad_()
    w1r, w2r = w1.clone().requires_grad_(), w2.clone().requires_grad_()
    yr = torch.relu(xr @ w1r.t()) @ w2r.t()
    yr.pow(2).sum().backward()

    def close(got: torch.Tensor, ref: torch.Tensor) -> None:
        # fp32 sums in another order (the shards' products, then the all-reduce): an entry that
        # cancels terms of the tensor's largest size keeps their rounding, a few ulps of that size
        # (the gradients reach ~3000 here; on an AVX2-only Zen 3 an entry of 1.25 was 1.2e-4 off)
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=max(1e-4, 1e-6 * ref.abs().max().item()))

    close(y, yr)
    close(xs.grad, xr.grad)
    close(up.weight.grad, w1r.grad[mine])
    close(down.weight.grad, w2r.grad[:, mine])
    calls = tp._calls
    world.close_splits()
    return {"calls": calls}


def other_host_case(world) -> tuple[str, list[float]]:
    """The last rank says it is on another host: mode auto takes the tcp path (and the result is right)."""
    from shardwise.comm import tcp

    real = tcp.host_key
    if world.rank == world.size - 1:
        tcp.host_key = lambda: real() + 1
    try:
        group = across_hosts(world.split([list(range(world.size))], name="tp"), parent=world, mode="auto")
    finally:
        tcp.host_key = real
    out = type(group).__name__, group.all_reduce(torch.ones(3)).tolist()
    world.close_splits()
    return out


def fails_mid_collective(world, how: str, bad: int, out_dir: str) -> None:
    """Every rank all-reduces over direct TCP; then rank `bad` raises, exits or never arrives
    ("raise", "exit", "never") while the others are in the next one. Each other rank writes its
    CollectiveError and how long it waited to out_dir/<rank>."""
    tp = ParallelDims(world_size=world.size, tp=world.size).build(world, shm_allreduce="off", tcp="on").tp
    assert isinstance(tp, TcpCommunicator)
    fail_mid_collective(tp, world.rank, how, bad, out_dir)


def out_of_step(world, out_dir: str) -> None:
    """Rank 1 all-gathers while the others all-reduce: every rank fails, naming the mismatch."""
    tp = ParallelDims(world_size=world.size, tp=world.size).build(world, shm_allreduce="off", tcp="on").tp
    x = torch.ones(4)
    try:
        tp.all_gather(x, dim=0) if world.rank == 1 else tp.all_reduce(x)
    except CollectiveError as e:
        Path(out_dir, str(world.rank)).write_text(str(e))
        raise
    raise AssertionError(f"rank {world.rank}: ranks out of step were not caught")


def cannot_listen_case(world) -> tuple[str, list[float]]:
    """Every rank says it is on a host of its own and listens where SHARDWISE_TCP_ADDR says:
    127.0.0.1, but the last rank an address this machine does not have. Every rank keeps the
    wrapped communicator alike (and it works)."""
    import os

    from shardwise.comm import tcp

    real, before = tcp.host_key, os.environ.get(tcp.ADDR_ENV)
    tcp.host_key = lambda: real() + world.rank  # every rank a host of its own
    os.environ[tcp.ADDR_ENV] = "192.0.2.1" if world.rank == world.size - 1 else "127.0.0.1"  # TEST-NET-1
    try:
        group = across_hosts(world.split([list(range(world.size))], name="tp"), parent=world, mode="auto")
    finally:
        tcp.host_key = real
        if before is None:
            del os.environ[tcp.ADDR_ENV]
        else:
            os.environ[tcp.ADDR_ENV] = before
    out = type(group).__name__, group.all_reduce(torch.ones(3)).tolist()
    world.close_splits()
    return out
