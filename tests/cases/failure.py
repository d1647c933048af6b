"""Rank functions of the failure tests, fn(world, ...): a rank that raises while the others
are in collectives, a collective that one rank never joins, and a training rank that stops
or sleeps after a checkpoint. Run by launch (gloo and MPI), never by the rank pool: they
test how a launched job fails."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import torch

from shardwise.checkpoint import Checkpointer

__all__ = ["raise_on_rank", "one_rank_never_arrives", "HangAfterSave", "train_then_hang"]


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


class HangAfterSave(Checkpointer):
    """Saves as usual; then each world rank in `hangs` writes the time and its pid to
    `markers`/<rank> and stops itself (SIGSTOP, "stop") or sleeps in Python ("sleep"): the
    others go on into the next step's collectives without it."""

    def __init__(self, hangs: dict[int, str], markers: str) -> None:
        super().__init__()
        self.hangs, self.markers = hangs, Path(markers)

    def save(self, tr) -> Path:
        path = super().save(tr)
        how = self.hangs.get(tr.mesh.world.rank)
        if how is not None:
            (self.markers / str(tr.mesh.world.rank)).write_text(f"{time.time()}\n{os.getpid()}")
            if how == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)
            time.sleep(3600)
        return path


def train_then_hang(world, cfg, hangs: dict[int, str], markers: str):
    from shardwise.train import train

    return train(world, cfg, HangAfterSave(hangs, markers))
