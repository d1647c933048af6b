"""Ranks started by someone else: torchrun, or mpiexec with a rendezvous address.

This is the outer edge of the program, the one place that reads a launcher's
environment variables; library code only ever receives a Communicator.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = ["ExternalRank", "external_rank"]


@dataclass(frozen=True)
class ExternalRank:
    rank: int
    world_size: int
    master_addr: str
    master_port: int
    launcher: str


def external_rank(environ: dict[str, str] | None = None) -> ExternalRank | None:
    """This process's rank if a launcher started it, else None (we start our own ranks).

    torchrun sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT. mpiexec sets
    PMI_RANK/PMI_SIZE (MPICH) or OMPI_COMM_WORLD_RANK/SIZE (Open MPI); for the gloo
    backend it also needs MASTER_ADDR and MASTER_PORT, passed with `mpiexec -genv`/`-x`.
    """
    env = os.environ if environ is None else environ
    for launcher, rank_key, size_key in (
        ("torchrun", "RANK", "WORLD_SIZE"),
        ("mpiexec", "PMI_RANK", "PMI_SIZE"),
        ("mpiexec", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
    ):
        if rank_key in env and size_key in env:
            missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if k not in env]
            if missing:
                raise RuntimeError(
                    f"started by {launcher} ({rank_key}={env[rank_key]}) but {', '.join(missing)} is not set: "
                    "export MASTER_ADDR=<rank 0's host> MASTER_PORT=<free port> to every rank"
                )
            return ExternalRank(
                int(env[rank_key]), int(env[size_key]), env["MASTER_ADDR"], int(env["MASTER_PORT"]), launcher
            )
    return None
