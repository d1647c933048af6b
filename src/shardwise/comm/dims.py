"""ParallelDims: the tp x dp x pp layout of a job, validated on construction.

Ranks are laid out with tp innermost, then dp, then pp outermost, as in Megatron-LM
and torchtitan, so the ranks of one tensor-parallel group are consecutive (and, on a
multi-GPU host, share the fast intra-node links) and a pipeline stage is a contiguous
block of dp * tp ranks:

    rank = pp_rank * (dp * tp) + dp_rank * tp + tp_rank

With world_size=8, tp=2, dp=4: tp groups [0,1] [2,3] [4,5] [6,7];
dp groups [0,2,4,6] [1,3,5,7].
With world_size=8, tp=2, pp=2, dp=2: tp groups [0,1] [2,3] [4,5] [6,7];
dp groups [0,2] [1,3] [4,6] [5,7]; pp groups [0,4] [1,5] [2,6] [3,7]
(the ranks with the same tp and dp coordinates, one per stage, in stage order).
"""

from __future__ import annotations

from dataclasses import dataclass

from shardwise.comm.communicator import Communicator, LocalCommunicator
from shardwise.comm.shm import intra_host, shm_mode
from shardwise.comm.tcp import across_hosts, tcp_mode

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
    """Pipeline-parallel size: stages, each holding a contiguous run of the layers."""

    def __post_init__(self) -> None:
        for name in ("world_size", "tp", "pp"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.dp is None:
            replica = self.tp * self.pp
            if self.world_size % replica:
                what = f"tp({self.tp}) * pp({self.pp}) = {replica}" if self.pp != 1 else f"tp({self.tp})"
                valid = "tp * pp" if self.pp != 1 else "tp"
                raise ValueError(
                    f"{what} does not divide world_size({self.world_size}); "
                    f"valid {valid} sizes: {', '.join(map(str, _divisors(self.world_size)))}"
                )
            object.__setattr__(self, "dp", self.world_size // replica)
        if not isinstance(self.dp, int) or isinstance(self.dp, bool) or self.dp < 1:
            raise ValueError(f"dp must be a positive int, got {self.dp!r}")
        if self.tp * self.dp * self.pp != self.world_size:
            if self.pp == 1:  # today's message, unchanged
                raise ValueError(f"tp({self.tp}) * dp({self.dp}) != world_size({self.world_size})")
            product = self.tp * self.pp * self.dp
            raise ValueError(
                f"tp({self.tp}) * pp({self.pp}) * dp({self.dp}) = {product} != world_size({self.world_size})"
            )

    def coords(self, rank: int) -> dict[str, int]:
        """This rank's index along each dimension."""
        self._check_rank(rank)
        return {"tp": rank % self.tp, "dp": (rank // self.tp) % self.dp, "pp": rank // (self.tp * self.dp)}

    def rank_of(self, *, tp: int = 0, dp: int = 0, pp: int = 0) -> int:
        """The global rank at these coordinates (the inverse of `coords`)."""
        for name, value, size in (("tp", tp, self.tp), ("dp", dp, self.dp), ("pp", pp, self.pp)):
            if not 0 <= value < size:
                raise ValueError(f"{name} coordinate {value} is outside {name}({size})")
        return (pp * self.dp + dp) * self.tp + tp

    def tp_groups(self) -> list[list[int]]:
        """Every tensor-parallel group, as lists of consecutive ranks."""
        return [list(range(start, start + self.tp)) for start in range(0, self.world_size, self.tp)]

    def dp_groups(self) -> list[list[int]]:
        """Every data-parallel group: ranks holding the same tp slice of one pipeline stage."""
        return [
            [self.rank_of(tp=t, dp=d, pp=s) for d in range(self.dp)] for s in range(self.pp) for t in range(self.tp)
        ]

    def pp_groups(self) -> list[list[int]]:
        """Every pipeline group: the ranks with the same tp and dp coordinates, in stage order."""
        return [
            [self.rank_of(tp=t, dp=d, pp=s) for s in range(self.pp)] for d in range(self.dp) for t in range(self.tp)
        ]

    def embed_groups(self) -> list[list[int]]:
        """The groups that sum a tied embedding's gradient: the first and the last stage's
        ranks with the same tp and dp coordinates (each holds a copy); every middle-stage
        rank alone. At pp == 1 each rank alone (its one copy is the tied weight itself)."""
        if self.pp == 1:
            return [[r] for r in range(self.world_size)]
        pairs = [
            [self.rank_of(tp=t, dp=d, pp=0), self.rank_of(tp=t, dp=d, pp=self.pp - 1)]
            for d in range(self.dp)
            for t in range(self.tp)
        ]
        middle = [
            [self.rank_of(tp=t, dp=d, pp=s)]
            for s in range(1, self.pp - 1)
            for d in range(self.dp)
            for t in range(self.tp)
        ]
        return pairs + middle

    def build(self, world: Communicator, *, shm_allreduce: str | None = None, tcp: str | None = None) -> Mesh:
        """Create the tp, dp and pp communicators. Collective: every rank must call it.

        At pp == 1 the pp communicator is this rank alone (a size-1 group, no split).
        shm_allreduce (auto, on, off; None: SHARDWISE_SHM_ALLREDUCE, default auto): whether
        a tp group whose ranks share a host all-reduces through shared memory
        (shardwise.comm.shm). tcp (auto, on, off; None: SHARDWISE_TCP_COLLECTIVES, default
        auto): whether a tp group whose ranks are on several hosts runs its collectives over
        direct TCP connections (shardwise.comm.tcp)."""
        if world.size != self.world_size:
            raise ValueError(f"communicator has {world.size} ranks but ParallelDims.world_size={self.world_size}")
        self._check_rank(world.rank)
        mode = shm_mode() if shm_allreduce is None else shm_allreduce
        tp = intra_host(world.split(self.tp_groups(), name="tp"), parent=world, mode=mode)
        tp = across_hosts(tp, parent=world, mode=tcp_mode() if tcp is None else tcp)
        dp = world.split(self.dp_groups(), name="dp")
        # pp == 1: this rank alone, without creating world_size one-rank groups
        if self.pp == 1:
            pp = embed = LocalCommunicator("pp", world.stats)
        else:
            pp = world.split(self.pp_groups(), name="pp")
            embed = world.split(self.embed_groups(), name="embed")
        return Mesh(dims=self, world=world, tp=tp, dp=dp, pp=pp, embed=embed)

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank({rank}) is outside world_size({self.world_size})")


@dataclass(frozen=True)
class Mesh:
    """This rank's communicators, one per dimension of a ParallelDims, and its pipeline
    coordinates. Ranks of `pp` are stage indices: pp rank s holds stage s."""

    dims: ParallelDims
    world: Communicator
    tp: Communicator
    dp: Communicator
    pp: Communicator
    embed: Communicator | None = None
    """The first and last stage's ranks of this rank's (tp, dp) position, which sum a tied
    embedding's gradient; a size-1 group on middle stages and at pp == 1."""

    @property
    def pp_rank(self) -> int:
        """This rank's pipeline stage (its rank in the pp group)."""
        return self.pp.rank

    @property
    def is_first_stage(self) -> bool:
        return self.pp.rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp.rank == self.pp.size - 1

    @property
    def prev_stage(self) -> int:
        """The previous stage's rank in the pp group; the first stage's is the last
        (a ring, as in Megatron: interleaved schedules send around it)."""
        return (self.pp.rank - 1) % self.pp.size

    @property
    def next_stage(self) -> int:
        """The next stage's rank in the pp group; the last stage's is the first."""
        return (self.pp.rank + 1) % self.pp.size


def tp_only(world: Communicator) -> Communicator:
    """The whole world as one tensor-parallel group (tp = world size, dp = 1), named "tp" in
    the accounting. Collective: every rank must call it."""
    return ParallelDims(world_size=world.size, tp=world.size).build(world).tp


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
