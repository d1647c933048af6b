"""Rank functions of the failure tests, fn(world, ...): a rank that raises while the others
are in collectives, and a collective that one rank never joins. Run by launch (gloo and
MPI), never by the rank pool: they test how a launched job fails."""

from __future__ import annotations

import time

import torch

__all__ = ["raise_on_rank", "one_rank_never_arrives"]


def raise_on_rank(comm, bad_rank: int) -> None:
    if comm.rank == bad_rank:
        time.sleep(0.2)  # the others are already waiting in the collective
        raise ValueError(f"boom on rank {bad_rank}")
    for _ in range(1000):
        comm.all_reduce(torch.ones(4))


def one_rank_never_arrives(comm) -> None:
    if comm.rank == 1:
        time.sleep(120)  # stuck outside any collective
    comm.all_reduce(torch.ones(4))
