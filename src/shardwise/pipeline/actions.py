"""Actions: the steps of a pipeline schedule, as data.

A schedule gives each pp rank one list of actions, run in order. Two kinds compute
(FORWARD, BACKWARD of one micro-batch on one virtual stage); four move a tensor between
neighbouring ranks with a blocking point-to-point call:

    SEND_ACT   the output of `stage` to the next rank (it arrives as stage + 1's input)
    RECV_ACT   the input of `stage` from the previous rank (stage - 1's output)
    SEND_GRAD  the gradient of `stage`'s input to the previous rank (stage - 1's output gradient)
    RECV_GRAD  the gradient of `stage`'s output from the next rank (stage + 1's input gradient)

`stage` is always the virtual stage on the rank holding the action: a send names the
stage that produced the tensor, a receive the stage that will use it. Virtual stage
s lives on rank s % pp as model chunk s // pp (Megatron's interleaving: chunk c of
rank r holds virtual stage c * pp + r); with one chunk per rank, stage == rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

__all__ = ["Kind", "Action", "TRANSFERS"]


class Kind(StrEnum):
    FORWARD = "FORWARD"
    BACKWARD = "BACKWARD"
    SEND_ACT = "SEND_ACT"
    RECV_ACT = "RECV_ACT"
    SEND_GRAD = "SEND_GRAD"
    RECV_GRAD = "RECV_GRAD"


TRANSFERS = frozenset({Kind.SEND_ACT, Kind.RECV_ACT, Kind.SEND_GRAD, Kind.RECV_GRAD})

# The kind at the other end of each transfer, and how far its stage is from ours.
_COUNTERPART = {
    Kind.SEND_ACT: (Kind.RECV_ACT, +1),
    Kind.RECV_ACT: (Kind.SEND_ACT, -1),
    Kind.SEND_GRAD: (Kind.RECV_GRAD, -1),
    Kind.RECV_GRAD: (Kind.SEND_GRAD, +1),
}


@dataclass(frozen=True, slots=True)
class Action:
    """One step of one rank's list."""

    kind: Kind
    microbatch: int
    """Which micro-batch, 0-based."""
    stage: int
    """The virtual stage on this rank that computes, produced the sent tensor, or uses the received one."""
    peer: int | None = None
    """The rank at the other end of a transfer; None for FORWARD and BACKWARD."""

    @property
    def is_transfer(self) -> bool:
        return self.kind in TRANSFERS

    @property
    def is_send(self) -> bool:
        return self.kind in (Kind.SEND_ACT, Kind.SEND_GRAD)

    def chunk(self, pp: int) -> int:
        """The model chunk of this rank that `stage` is (0 unless interleaved)."""
        return self.stage // pp

    def counterpart(self, rank: int) -> Action:
        """The action the peer must be at for this transfer (run by `rank`) to happen."""
        if not self.is_transfer or self.peer is None:
            raise ValueError(f"{self} is not a transfer")
        kind, step = _COUNTERPART[self.kind]
        return Action(kind, self.microbatch, self.stage + step, rank)

    def __str__(self) -> str:
        where = f"microbatch {self.microbatch}, stage {self.stage}"
        if self.peer is None:
            return f"{self.kind.value}({where})"
        arrow = "->" if self.is_send else "<-"
        return f"{self.kind.value}({where} {arrow} rank {self.peer})"
