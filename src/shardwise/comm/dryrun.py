"""A communicator that moves no data: one rank of an imaginary group of any size.

Collectives return tensors of the right shape (on the meta device they cost nothing)
and are counted like real ones, so running a sharded model on the meta device through
this communicator gives the exact collectives, and their bytes, of a real run, for any
tp size, on one process. `shardwise info` and the planner use it. Point-to-point is
counted too; a recv returns zeros. p2p_check stays off (there is no peer to answer).
"""

from __future__ import annotations

import torch

from shardwise.comm.accounting import CommStats
from shardwise.comm.communicator import DEFAULT_TIMEOUT_S, Communicator, ReduceOp

__all__ = ["DryRunCommunicator"]


class DryRunCommunicator(Communicator):
    """Rank `rank` of a group of `size` ranks; results have the right shapes, not values."""

    def __init__(self, size: int, rank: int = 0, *, name: str = "tp", stats: CommStats | None = None) -> None:
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} is outside a group of size {size}")
        self.name, self.rank, self.size = name, rank, size
        self.stats = stats if stats is not None else CommStats()
        self.backend = "dry-run"
        self.timeout_s = DEFAULT_TIMEOUT_S

    def _all_reduce(self, t: torch.Tensor, op: ReduceOp) -> torch.Tensor:
        return t.clone()

    def _all_reduce_inplace(self, t: torch.Tensor, op: ReduceOp) -> torch.Tensor:
        return t

    def _all_gather(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        return torch.cat([t] * self.size, dim=dim)

    def _reduce_scatter(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        return t.chunk(self.size, dim=dim)[self.rank].clone()

    def _broadcast(self, t: torch.Tensor, src: int) -> torch.Tensor:
        return t.clone()

    def _barrier(self) -> None:
        pass

    def _send(self, t: torch.Tensor, dst: int, tag: int) -> None:
        pass

    def _recv(self, buf: torch.Tensor, src: int, tag: int) -> None:
        buf.zero_()  # no peer: zeros of the right shape (free on the meta device)

    def split(self, groups: list[list[int]], name: str) -> Communicator:
        mine = next(g for g in groups if self.rank in g)
        return DryRunCommunicator(len(mine), mine.index(self.rank), name=name, stats=self.stats)
