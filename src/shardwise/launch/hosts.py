"""Which ranks share a host, and the rule that a tensor-parallel group stays inside one.

    hosts = gather_hosts(world, ext.host)   # collective: one all_gather of each rank's label
    hosts.check_tp(tp)                      # HostLayoutError (one line) if a tp group spans hosts

Ranks are laid out tp-fastest (shardwise.comm.dims): a tp group is a block of `tp`
consecutive ranks, and every layer all-reduces over it, so it belongs on one host's fast
links. pp and dp groups may span hosts: a pipeline sends one activation per micro-batch
between stages, data parallelism one gradient all-reduce per step.

Each rank's label is what its launcher says (shardwise.launch.env.host_label); run_job
gathers the labels and checks the layout right after the rendezvous, before the job runs
any collective of its own, so every rank refuses the same layout with the same line.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardwise.comm.communicator import Communicator

__all__ = ["Hosts", "HostLayoutError", "gather_hosts", "ALLOW_FLAG"]

ALLOW_FLAG = "--allow-cross-host-tp"
_LABEL_BYTES = 256


class HostLayoutError(ValueError):
    """A tensor-parallel group would span hosts; nothing ran."""


@dataclass(frozen=True)
class Hosts:
    """Every rank's host label, by rank; ranks with equal labels share a host."""

    labels: tuple[str, ...]

    @property
    def names(self) -> list[str]:
        """The distinct hosts, in the order of their first rank."""
        return list(dict.fromkeys(self.labels))

    def ranks(self, host: str) -> list[int]:
        return [r for r, h in enumerate(self.labels) if h == host]

    def summary(self) -> str:
        """'2 hosts: vm:node0 (ranks 0-1), vm:node1 (ranks 2-3)'."""
        parts = [f"{h} ({_ranks(self.ranks(h))})" for h in self.names]
        return f"{len(parts)} host{'s' if len(parts) != 1 else ''}: " + ", ".join(parts)

    def cross_host_groups(self, tp: int) -> list[list[int]]:
        """The tp groups (blocks of tp consecutive ranks) whose ranks are on more than one host."""
        world = len(self.labels)
        blocks = [list(range(s, min(s + tp, world))) for s in range(0, world, tp)]
        return [b for b in blocks if len({self.labels[r] for r in b}) > 1]

    def tp_sizes(self) -> list[int]:
        """The tp sizes that divide the world and keep every tp group inside a host."""
        world = len(self.labels)
        return [t for t in range(1, world + 1) if world % t == 0 and not self.cross_host_groups(t)]

    def check_tp(self, tp: int) -> None:
        """HostLayoutError, one line naming the first cross-host tp group's ranks and hosts,
        every host's rank count and the tp sizes that fit, if a tp group spans hosts."""
        bad = self.cross_host_groups(tp)
        if not bad:
            return
        group = bad[0]
        where = " and ".join(
            f"{h} ({_ranks([r for r in group if self.labels[r] == h])})" for h in _hosts_of(self, group)
        )
        counts = ", ".join(self._count(h) for h in self.names[:8]) + (", ..." if len(self.names) > 8 else "")
        fits = ", ".join(map(str, self.tp_sizes()))
        raise HostLayoutError(
            f"tp={tp}: the tp group of ranks {_span(group)} spans hosts {where}; ranks are laid out tp-fastest, so each "
            f"host needs a multiple of {tp} consecutive ranks, and {counts}; tp sizes that stay inside a host: "
            f"{fits}; start {tp} ranks (or a multiple) per host, use one of those, or pass {ALLOW_FLAG} "
            f"(every layer then all-reduces across hosts)"
        )

    def _count(self, host: str) -> str:
        ranks = self.ranks(host)
        gaps = ranks != list(range(ranks[0], ranks[0] + len(ranks)))
        return f"{host} has {len(ranks)}" + (f" (ranks {_span(ranks)}, not consecutive)" if gaps else "")


def gather_hosts(comm: Communicator, label: str) -> Hosts:
    """Every rank's host label (this rank's is `label`). Collective: every rank must call it."""
    raw = label.encode()[:_LABEL_BYTES]
    mine = torch.zeros(_LABEL_BYTES, dtype=torch.uint8)
    mine[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    every = comm.all_gather(mine, dim=0).view(comm.size, _LABEL_BYTES)  # (world, _LABEL_BYTES)
    return Hosts(tuple(bytes(row.tolist()).rstrip(b"\0").decode(errors="replace") for row in every))


def _hosts_of(hosts: Hosts, group: list[int]) -> list[str]:
    return list(dict.fromkeys(hosts.labels[r] for r in group))


def _ranks(ranks: list[int]) -> str:
    """'rank 3' or 'ranks 0-1'."""
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {_span(ranks)}"


def _span(ranks: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    out, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            out.append(str(start) if start == r else f"{start}-{r}")
            start = None
    return ", ".join(out)
