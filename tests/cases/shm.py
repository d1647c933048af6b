"""Rank functions of the shared-memory all-reduce tests (shardwise.comm.shm), fn(world, ...):
its results against the wrapped communicator's and the plain sum, many calls in a row
(the sequence counter wrapping), a decode with the path on and off (pooled ranks); a rank
that fails mid-collective, and one that dies holding a linked segment (launched jobs)."""

from __future__ import annotations

import importlib.resources
import json
import os
import time
from pathlib import Path

import torch

from shardwise.comm import CollectiveError, ParallelDims
from shardwise.comm.shm import ShmCommunicator, intra_host
from shardwise.comm.shm_segment import PREFIX, SHM_DIR, Segment

__all__ = [
    "parity_case",
    "gather_broadcast_case",
    "many_calls_case",
    "decode_case",
    "other_host_case",
    "fails_mid_collective",
    "dies_holding_a_segment",
]

SHAPES = [(1, 576), (16, 2048), (3, 5, 7)]


def _groups(world, **shm) -> tuple[ShmCommunicator, object]:
    """The whole world as a tp group twice: through shared memory, and the wrapped one alone."""
    on = intra_host(world.split([list(range(world.size))], name="tp"), parent=world, mode="on", **shm)
    off = ParallelDims(world_size=world.size, tp=world.size).build(world, shm_allreduce="off").tp
    assert isinstance(on, ShmCommunicator), f"rank {world.rank}: no shared-memory path: {on!r}"
    assert not isinstance(off, ShmCommunicator)
    return on, off


def _plain_sum(every: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """every: (size, *shape). Summed in rank order in fp32 (in fp32 for half precision too), then rounded."""
    acc = every[0].float()
    for part in every[1:]:
        acc = acc + part.float()
    return acc.to(dtype)


def parity_case(world) -> dict:
    on, off = _groups(world)
    names = sorted(p.name for p in Path(SHM_DIR).glob(f"{PREFIX}*-*"))
    linked = [n for n in names if n.startswith(f"{PREFIX}{os.getpid()}-")]  # this rank's own, after setup
    gen = torch.Generator().manual_seed(1234 + world.rank)
    checked = []
    for dtype in (torch.float32, torch.bfloat16):
        for shape in SHAPES:
            x = torch.randn(shape, generator=gen).to(dtype)
            every = world.all_gather(x.unsqueeze(0), dim=0)  # (size, *shape): every rank's x
            with world.stats.track() as counted_on:
                got, top = on.all_reduce(x), on.all_reduce(x, "max")
                inplace = x.clone()
                same = on.all_reduce_(inplace)
            with world.stats.track() as counted_off:
                ref, ref_top = off.all_reduce(x), off.all_reduce(x, "max")
                off.all_reduce_(x.clone())
            what = f"{dtype} {shape} at world size {world.size}, rank {world.rank}"
            assert got.shape == x.shape and got.dtype == dtype, what
            assert torch.equal(got, _plain_sum(every, dtype)), f"sum of {what}"
            assert torch.equal(inplace, got) and same is inplace, f"in-place sum of {what}"
            assert torch.equal(top, every.amax(0)) and torch.equal(top, ref_top), f"max of {what}"
            # the wrapped one may round each partial sum to bf16 (gloo): size - 1 roundings, and ours once
            eps = 2.0**-8 * world.size if dtype == torch.bfloat16 else 1e-6
            bound = eps * every.float().abs().sum(0)
            err = (got.float() - ref.float()).abs()
            assert bool((err <= bound + 1e-30).all()), f"{what}: {err.max().item():.3g} from the wrapped all-reduce"
            assert counted_on.snapshot() == counted_off.snapshot(), f"{what}: {counted_on} != {counted_off}"
            replicas = world.all_gather(got.unsqueeze(0), dim=0)
            assert all(torch.equal(r, got) for r in replicas), f"{what}: the ranks' results differ"
            checked.append(f"{dtype}/{shape}")
    calls = on._calls
    # past the segment's size: the wrapped all-reduce, counted the same
    big = torch.full((on.max_bytes // 4 + 1,), float(world.rank))
    with world.stats.track() as counted:
        assert torch.equal(on.all_reduce(big), torch.full_like(big, world.size * (world.size - 1) / 2))
    assert on._calls == calls and counted.calls("all_reduce", "tp") == 1
    # a strided view, an int64 tensor, a tensor that requires grad (no graph through the segment)
    y = torch.arange(12.0).view(3, 4).t() + world.rank  # (4, 3), not contiguous
    assert torch.equal(on.all_reduce(y), off.all_reduce(y))
    z = torch.arange(5) * (world.rank + 1)
    assert torch.equal(on.all_reduce(z), off.all_reduce(z))
    w = torch.ones(2, 3, requires_grad=True)
    assert torch.equal(on.all_reduce(w).detach(), torch.full((2, 3), float(world.size)))
    return {"checked": checked, "linked": linked, "calls": on._calls}


def gather_broadcast_case(world) -> dict:
    """all_gather (even and uneven, along the first and last dim) and broadcast (from every rank)
    through the segment against the wrapped communicator's: equal, counted alike, in place."""
    on, off = _groups(world)
    gen = torch.Generator().manual_seed(99 + world.rank)
    checked = 0
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        for shape in ((1, 24576), (4, 3, 5), (7,)):
            x = (torch.randn(shape, generator=gen) * 100).to(dtype)
            for dim in {0, len(shape) - 1}:
                with world.stats.track() as c_on:
                    got = on.all_gather(x, dim=dim)
                with world.stats.track() as c_off:
                    ref = off.all_gather(x, dim=dim)
                assert torch.equal(got, ref) and c_on.snapshot() == c_off.snapshot(), (
                    f"all_gather {dtype} {shape} {dim}"
                )
            sizes = [shape[-1] - (r % 2) for r in range(world.size)]  # uneven along the last dim
            part = x[..., : sizes[world.rank]]
            assert torch.equal(on.all_gather(part, dim=-1, sizes=sizes), off.all_gather(part, dim=-1, sizes=sizes))
            for src in range(world.size):
                a, b = x.clone(), x.clone()
                with world.stats.track() as c_on:
                    out = on.broadcast(a, src=src)
                with world.stats.track() as c_off:
                    ref = off.broadcast(b, src=src)
                assert out is a and torch.equal(a, ref) and c_on.snapshot() == c_off.snapshot(), f"broadcast {src}"
            checked += 1
    calls = on._calls
    big = torch.full((on.max_bytes // 4 + 1,), float(world.rank))  # past a slot: the wrapped one's
    assert torch.equal(on.all_gather(big, dim=0), off.all_gather(big, dim=0))
    assert torch.equal(on.broadcast(big.clone(), src=0), torch.zeros_like(big))
    assert on._calls == calls
    return {"checked": checked, "calls": on._calls}


def many_calls_case(world, calls: int, period: int) -> dict:
    """`calls` all-reduces of alternating shapes, dtypes and ops, the counter wrapping every `period`."""
    on, _ = _groups(world, period=period)
    p = world.size
    for i in range(calls):
        shape, dtype = SHAPES[i % 3], (torch.float32, torch.bfloat16)[i % 2]
        x = torch.full(shape, float(world.rank + i % 7), dtype=dtype)
        if i % 11 == 10:  # an all-gather and a broadcast take their turn in the same counter
            got, want = on.all_gather(x.reshape(-1), dim=0).view(p, -1)[p - 1], float(p - 1 + i % 7)
        elif i % 13 == 12:
            got, want = on.broadcast(x, src=p - 1), float(p - 1 + i % 7)
        elif i % 5 == 4:
            got, want = on.all_reduce(x, "max"), float(p - 1 + i % 7)
        elif i % 5 == 3:
            got, want = on.all_reduce_(x), float(p * (i % 7) + p * (p - 1) // 2)
        else:
            got, want = on.all_reduce(x), float(p * (i % 7) + p * (p - 1) // 2)
        if not bool((got == want).all()):
            raise AssertionError(f"call {i} ({dtype}, {shape}) on rank {world.rank}: {got.flatten()[0]} != {want}")
        if i % 50 == 0:
            world.barrier()  # another collective in between: the segment's counters are its own
    return {"calls": on._calls, "seq": on.seg.words[on._mine], "period": on.period}


def decode_case(world) -> dict:
    """Greedy tokens of the built-in model with the shared-memory path on and off."""
    from shardwise.engine import generate
    from shardwise.hf import load_pretrained

    root = importlib.resources.files("shardwise") / "assets" / "default"
    prompts = [[1, 17, 42, 99, 7], [3, 250, 8]]
    out = {}
    with importlib.resources.as_file(root) as path:
        for mode in ("on", "off"):
            tp = ParallelDims(world_size=world.size, tp=world.size).build(world, shm_allreduce=mode).tp
            model, _ = load_pretrained(path, comm=tp)
            with torch.no_grad():
                res = generate(model, prompts, comm=tp, max_new_tokens=12)
            out[mode] = {
                "tokens": res.tokens,
                "shm": isinstance(tp, ShmCommunicator),
                "shm_calls": getattr(tp, "_calls", 0),
                "comm": res.comm_per_step,
            }
    return out


def other_host_case(world) -> tuple[str, list[float]]:
    """The last rank says it is on another host: the group keeps the wrapped all-reduce."""
    from shardwise.comm import shm

    real = shm.host_key
    if world.rank == world.size - 1:
        shm.host_key = lambda: real() + 1
    try:
        tp = intra_host(world.split([list(range(world.size))], name="tp"), parent=world, mode="on")
    finally:
        shm.host_key = real
    return type(tp).__name__, tp.all_reduce(torch.ones(3)).tolist()


def fails_mid_collective(world, how: str, bad: int, out_dir: str) -> None:
    """Every rank all-reduces through shared memory; then rank `bad` raises, exits or never
    arrives ("raise", "exit", "never") while the others are in the next one. Each other rank
    writes its CollectiveError and how long it waited to out_dir/<rank>."""
    tp = ParallelDims(world_size=world.size, tp=world.size).build(world, shm_allreduce="on").tp
    assert isinstance(tp, ShmCommunicator)
    fail_mid_collective(tp, world.rank, how, bad, out_dir)


def fail_mid_collective(tp, rank: int, how: str, bad: int, out_dir: str) -> None:
    """Five all-reduces on `tp`, then rank `bad` fails as `how` says while the others are in
    the sixth; each other rank writes its CollectiveError and its wait to out_dir/<rank>."""
    for _ in range(5):
        tp.all_reduce(torch.ones(4))
    if rank == bad:
        time.sleep(0.3)  # the others are already waiting
        if how == "raise":
            raise ValueError(f"boom on rank {bad}")
        if how == "exit":
            os._exit(7)
        time.sleep(120)  # stuck outside any collective
    start = time.monotonic()
    try:
        tp.all_reduce(torch.ones(4))
    except CollectiveError as e:
        record = {"error": str(e), "waited": time.monotonic() - start}
        Path(out_dir, str(rank)).write_text(json.dumps(record))
        raise
    raise AssertionError(f"rank {rank}: the all-reduce completed without rank {bad}")


def dies_holding_a_segment(world, out_dir: str) -> None:
    """Rank 0 makes a segment, as intra_host's setup does, and dies before its name is unlinked."""
    if world.rank == 0:
        path = Path(SHM_DIR) / f"{PREFIX}{os.getpid()}-d1ed"
        Segment(path, world.size, 4096, create=True, nonce=1)
        Path(out_dir, "path").write_text(str(path))
        os._exit(5)  # no atexit: only the launcher's cleanup can remove it
