"""Run a job function on N ranks, however the ranks come about.

- Started by torchrun or mpiexec: this process is one rank; join and run.
- Otherwise: start N local ranks ourselves (shardwise.launch.local; under mpiexec for
  the MPI backend, shardwise.launch.mpi).

The job function takes the world Communicator and returns a result; only rank 0's
result is returned (a job that needs all ranks' data gathers it itself), and None on
the other ranks of an externally launched job.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from shardwise.comm.communicator import DEFAULT_TIMEOUT_S
from shardwise.launch.env import external_rank, resolve_backend
from shardwise.launch.local import launch

__all__ = ["run_job"]


def run_job(
    fn: Callable[..., Any],
    world_size: int,
    *,
    args: tuple = (),
    backend: str = "gloo",
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> Any | None:
    backend = resolve_backend(backend)
    ext = external_rank()
    if ext is None:
        return launch(fn, world_size, args=args, backend=backend, timeout_s=timeout_s)[0]
    if ext.world_size != world_size:
        raise ValueError(f"--tp {world_size} but {ext.launcher} started {ext.world_size} ranks; they must agree")
    if backend == "mpi":
        from shardwise.comm.mpi import init_mpi

        comm = init_mpi(timeout_s)
        return _run(fn, comm, args, ext.rank)
    if ext.master_addr is None or ext.master_port is None:
        raise RuntimeError(
            f"started by {ext.launcher} for backend {backend!r}, but MASTER_ADDR/MASTER_PORT are not set: "
            "export them to every rank (rank 0's host and a free port), or use --backend mpi"
        )
    from shardwise.comm.torch_dist import init_torch_distributed

    comm = init_torch_distributed(
        rank=ext.rank,
        world_size=ext.world_size,
        master_addr=ext.master_addr,
        master_port=ext.master_port,
        backend=backend,
        timeout_s=timeout_s,
        init_method="env://" if ext.launcher == "torchrun" else None,
    )
    return _run(fn, comm, args, ext.rank)


def _run(fn, comm, args: tuple, rank: int) -> Any | None:
    try:
        result = fn(comm, *args)
    finally:
        comm.close()
    return result if rank == 0 else None
