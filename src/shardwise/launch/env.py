"""Ranks started by someone else: torchrun, or mpiexec with a rendezvous address.

This is the outer edge of the program, the one place that reads a launcher's
environment variables; library code only ever receives a Communicator.
"""

from __future__ import annotations

import os
import socket
import sys
from dataclasses import dataclass

__all__ = ["ExternalRank", "external_rank", "gloo_fallback_note", "host_label", "resolve_backend"]


def resolve_backend(name: str, *, world_size: int = 1, environ: dict[str, str] | None = None) -> str:
    """`auto`: NCCL when CUDA is available, else MPI when mpi4py and mpiexec are, else gloo;
    under torchrun (its rendezvous is torch.distributed's), NCCL or gloo.

    When `auto` falls back to gloo for more than one rank, one line on stderr says why and
    how to get MPI (`gloo_fallback_note`), once per command: by the process that starts the
    ranks, or by rank 0 of a launcher's ranks.
    """
    if name != "auto":
        return name
    import torch

    if torch.cuda.is_available():
        return "nccl"
    ext = external_rank(environ)
    if ext is not None and ext.launcher == "torchrun":
        return "gloo"  # NOTE: MPI here would make each rank a world of its own
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        missing = "mpi4py is not installed"
    else:
        from shardwise.launch.mpi import find_mpiexec

        try:
            find_mpiexec()
            return "mpi"
        except RuntimeError:
            missing = "no mpiexec was found"
    if world_size > 1:
        _note_gloo_fallback(missing)
    return "gloo"


def gloo_fallback_note(missing: str) -> str:
    """The line `auto` prints when it falls back to gloo on CPU for more than one rank."""
    return (
        f"shardwise: note: backend auto is using gloo ({missing}); on CPU, MPI is much faster "
        "(the built-in model decodes about 10x faster per token at tp=2 here): "
        "pip install 'shardwise[mpi]' (mpi4py and the mpich wheel, or an MPI library such as mpich "
        "with mpi4py), or pass --backend gloo to keep gloo without this note"
    )


_noted = False


def _note_gloo_fallback(missing: str) -> None:
    global _noted
    ext = external_rank()
    if _noted or (ext is not None and ext.rank != 0):
        return
    _noted = True  # NOTE: a command may resolve its backend twice (train: the config, then run_job)
    print(gloo_fallback_note(missing), file=sys.stderr, flush=True)


@dataclass(frozen=True)
class ExternalRank:
    rank: int
    world_size: int
    master_addr: str | None
    """Rendezvous for gloo/NCCL (torchrun sets it; mpiexec users pass it). MPI needs none."""
    master_port: int | None
    launcher: str
    host: str = ""
    """The host this rank runs on, as the launcher names it (see `host_label`); ranks with
    the same label share a host."""
    local_world_size: int | None = None
    """Ranks on this host, where the launcher says (torchrun, hydra, Open MPI): equal to
    world_size, every rank is on one host and there is nothing to gather."""


def host_label(environ: dict[str, str] | None = None) -> str:
    """This rank's host, as its launcher says: torchrun's node (GROUP_RANK, the agent
    that started it), MPICH hydra's host entry (PMI_HOSTNAME), else the hostname.

    NOTE: the launcher's word comes first so that two torchrun agents, or two hydra host
    entries, on one machine are two hosts (how the tests simulate a cluster), and so that
    the label is the same on every rank of a host whatever its hostname resolves to.
    """
    env = os.environ if environ is None else environ
    name = socket.gethostname()
    if "GROUP_RANK" in env and "LOCAL_WORLD_SIZE" in env:  # torchrun
        return f"{name}:node{env['GROUP_RANK']}"
    if env.get("PMI_HOSTNAME"):  # MPICH hydra: the host entry of -hosts / the host file
        return env["PMI_HOSTNAME"]
    return name


def external_rank(environ: dict[str, str] | None = None) -> ExternalRank | None:
    """This process's rank if a launcher started it, else None (we start our own ranks).

    torchrun sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT. mpiexec sets
    PMI_RANK/PMI_SIZE (MPICH) or OMPI_COMM_WORLD_RANK/SIZE (Open MPI); the MPI backend
    needs nothing more, gloo also needs MASTER_ADDR and MASTER_PORT (`mpiexec -genv`/`-x`).
    Its host is `host_label`.
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
                int(env[rank_key]),
                int(env[size_key]),
                env.get("MASTER_ADDR"),
                int(port) if port else None,
                launcher,
                host_label(env),
                _local_world_size(env),
            )
    return None


def _local_world_size(env) -> int | None:
    for key in ("LOCAL_WORLD_SIZE", "MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE"):  # torchrun, hydra, Open MPI
        if env.get(key, "").isdigit():
            return int(env[key])
    return None
