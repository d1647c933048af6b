"""Ranks started by someone else: torchrun, or mpiexec with a rendezvous address.

This is the outer edge of the program, the one place that reads a launcher's
environment variables; library code only ever receives a Communicator.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = ["ExternalRank", "external_rank", "resolve_backend"]


def resolve_backend(name: str) -> str:
    """`auto`: NCCL when CUDA is available, else MPI when mpi4py and mpiexec are, else gloo."""
    if name != "auto":
        return name
    import torch

    if torch.cuda.is_available():
        return "nccl"
    try:
        import mpi4py  # noqa: F401

        from shardwise.launch.mpi import find_mpiexec

        find_mpiexec()
        return "mpi"
    except (ImportError, RuntimeError):
        return "gloo"


@dataclass(frozen=True)
class ExternalRank:
    rank: int
    world_size: int
    master_addr: str | None
    """Rendezvous for gloo/NCCL (torchrun sets it; mpiexec users pass it). MPI needs none."""
    master_port: int | None
    launcher: str


def external_rank(environ: dict[str, str] | None = None) -> ExternalRank | None:
    """This process's rank if a launcher started it, else None (we start our own ranks).

    torchrun sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT. mpiexec sets
    PMI_RANK/PMI_SIZE (MPICH) or OMPI_COMM_WORLD_RANK/SIZE (Open MPI); the MPI backend
    needs nothing more, gloo also needs MASTER_ADDR and MASTER_PORT (`mpiexec -genv`/`-x`).
    """
    env = os.environ if environ is None else environ
    for launcher, rank_key, size_key in (
        ("torchrun", "RANK", "WORLD_SIZE"),
        ("mpiexec", "PMI_RANK", "PMI_SIZE"),
        ("mpiexec", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
    ):
        if rank_key in env and size_key in env:
            port = env.get("MASTER_PORT")
            return ExternalRank(
                int(env[rank_key]), int(env[size_key]), env.get("MASTER_ADDR"), int(port) if port else None, launcher
            )
    return None
