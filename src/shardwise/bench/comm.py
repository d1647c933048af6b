"""All-reduce latency and bandwidth per backend, measured on local ranks.

    points = measure_all_reduce("gloo", world_size=2, sizes=[4096, 65536])

Each point is the median over `repeats` timed all-reduces (after warm-up) of an fp32
tensor of `size` bytes, timed on rank 0 between barriers. Bus bandwidth follows the
NCCL-tests convention: algbw * 2 (n - 1) / n, the bytes each rank moves per second.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

import torch

from shardwise.comm import Communicator
from shardwise.launch import launch

__all__ = ["CommPoint", "measure_all_reduce", "DEFAULT_SIZES", "available_backends"]

DEFAULT_SIZES = [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20]


@dataclass(frozen=True)
class CommPoint:
    backend: str
    world_size: int
    size_bytes: int
    latency_us: float
    """Median time of one all-reduce."""
    busbw_gbps: float
    """Bus bandwidth, GB/s (1e9 bytes)."""

    def as_dict(self) -> dict:
        return asdict(self)


def _repeats_for(size: int, repeats: int) -> int:
    return max(5, min(repeats, int(repeats * (64 << 10) / max(size, 1)) or 5))


def _rank(world: Communicator, sizes: list[int], repeats: int) -> list[tuple[int, float]]:
    out = []
    for size in sizes:
        t = torch.ones(size // 4)
        n = _repeats_for(size, repeats)
        for _ in range(3):
            world.all_reduce(t)
        times = []
        for _ in range(n):
            world.barrier()
            t0 = time.perf_counter()
            world.all_reduce(t)
            times.append(time.perf_counter() - t0)
        out.append((size, statistics.median(times)))
    return out


def measure_all_reduce(
    backend: str, world_size: int, sizes: list[int] | None = None, repeats: int = 200
) -> list[CommPoint]:
    """Median all-reduce latency per size, over `world_size` fresh local ranks."""
    sizes = sizes or DEFAULT_SIZES
    timings = launch(_rank, world_size, args=(sizes, repeats), backend=backend)[0]
    points = []
    for size, seconds in timings:
        busbw = size / seconds * 2 * (world_size - 1) / world_size / 1e9
        points.append(CommPoint(backend, world_size, size, seconds * 1e6, busbw))
    return points


def available_backends() -> list[str]:
    """Backends that can run here: gloo always; nccl with 2+ GPUs; mpi with mpi4py."""
    found = ["gloo"]
    if torch.cuda.is_available() and torch.cuda.device_count() > 1:
        found.append("nccl")
    try:
        import mpi4py  # noqa: F401

        found.append("mpi")
    except ImportError:
        pass
    return found
