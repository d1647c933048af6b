"""ParallelDims: the tp x dp (x pp) layout of a job, validated on construction.

Ranks are laid out with tp innermost, as in Megatron-LM, so the ranks of one
tensor-parallel group are consecutive (and, on a multi-GPU host, share the fast
intra-node links):

    rank = (pp_idx * dp + dp_idx) * tp + tp_idx

With world_size=8, tp=2, dp=4: tp groups [0,1] [2,3] [4,5] [6,7];
dp groups [0,2,4,6] [1,3,5,7].
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shardwise.comm.communicator import Communicator

__all__ = ["ParallelDims", "Mesh", "tp_only"]


@dataclass(frozen=True)
class ParallelDims:
    """How a job's ranks are split between the kinds of parallelism."""

    world_size: int
    """Total number of ranks in the job."""
    tp: int = 1
    """Tensor-parallel size: ranks that each hold a slice of every layer."""
    dp: int | None = None
    """Data-parallel size: model replicas taking different batches.
    None means world_size // (tp * pp)."""
    pp: int = 1
    """Pipeline-parallel size. Reserved: only pp=1 is implemented."""

    def __post_init__(self) -> None:
        for name in ("world_size", "tp", "pp"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.pp != 1:
            raise ValueError(f"pp({self.pp}) > 1 is reserved: pipeline parallelism is not implemented yet")
        if self.dp is None:
            if self.world_size % (self.tp * self.pp):
                raise ValueError(
                    f"tp({self.tp}) does not divide world_size({self.world_size}); "
                    f"valid tp sizes: {', '.join(map(str, _divisors(self.world_size)))}"
                )
            object.__setattr__(self, "dp", self.world_size // (self.tp * self.pp))
        if not isinstance(self.dp, int) or isinstance(self.dp, bool) or self.dp < 1:
            raise ValueError(f"dp must be a positive int, got {self.dp!r}")
        if self.tp * self.dp * self.pp != self.world_size:
            pp = f" * pp({self.pp})" if self.pp != 1 else ""
            raise ValueError(f"tp({self.tp}) * dp({self.dp}){pp} != world_size({self.world_size})")

    def coords(self, rank: int) -> dict[str, int]:
        """This rank's index along each dimension."""
        self._check_rank(rank)
        return {"tp": rank % self.tp, "dp": (rank // self.tp) % self.dp, "pp": rank // (self.tp * self.dp)}

    def tp_groups(self) -> list[list[int]]:
        """Every tensor-parallel group, as lists of consecutive ranks."""
        return [list(range(start, start + self.tp)) for start in range(0, self.world_size, self.tp)]

    def dp_groups(self) -> list[list[int]]:
        """Every data-parallel group: ranks holding the same tp slice of one pipeline stage."""
        groups = []
        for stage in range(self.pp):
            base = stage * self.tp * self.dp
            groups += [[base + d * self.tp + t for d in range(self.dp)] for t in range(self.tp)]
        return groups

    def build(self, world: Communicator) -> Mesh:
        """Create the tp and dp communicators. Collective: every rank must call it."""
        if world.size != self.world_size:
            raise ValueError(f"communicator has {world.size} ranks but ParallelDims.world_size={self.world_size}")
        self._check_rank(world.rank)
        tp = world.split(self.tp_groups(), name="tp")
        dp = world.split(self.dp_groups(), name="dp")
        return Mesh(dims=self, world=world, tp=tp, dp=dp)

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank({rank}) is outside world_size({self.world_size})")


@dataclass(frozen=True)
class Mesh:
    """This rank's communicators, one per dimension of a ParallelDims."""

    dims: ParallelDims
    world: Communicator
    tp: Communicator
    dp: Communicator


def tp_only(world: Communicator) -> Communicator:
    """The whole world as one tensor-parallel group (tp = world size, dp = 1), named "tp" in
    the accounting. Collective: every rank must call it."""
    return ParallelDims(world_size=world.size, tp=world.size).build(world).tp


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
