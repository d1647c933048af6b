"""The Communicator interface every layer talks to.

A Communicator is one group of ranks. Layers receive it explicitly; nothing in
shardwise reads a global process group. Backends (torch.distributed, MPI) implement
the underscored primitives; this base class short-circuits size-1 groups and counts
every collective it issues in `stats`.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from typing import Literal

import torch

from shardwise.comm.accounting import CommStats

__all__ = ["Communicator", "LocalCommunicator", "CollectiveError", "ReduceOp", "DEFAULT_TIMEOUT_S"]

ReduceOp = Literal["sum", "max"]
DEFAULT_TIMEOUT_S = 60.0


class CollectiveError(RuntimeError):
    """A collective failed: a peer died, or did not arrive within the timeout.

    Usually a consequence of another rank's failure; the launcher reports the root
    cause (a rank that raised something else, or died) in preference to these.
    """

    def __init__(self, op: str, comm: Communicator, cause: BaseException) -> None:
        super().__init__(
            f"{op} on group {comm.name!r} (rank {comm.rank} of {comm.size}, {comm.backend}, "
            f"timeout {comm.timeout_s:g}s) failed: {cause}"
        )
        self.op, self.group = op, comm.name


class Communicator(ABC):
    """A group of ranks that can run collectives on tensors.

    All collectives return a new tensor (or the input itself for a size-1 group) and
    never modify their input, so they are safe to call inside autograd functions.
    """

    name: str
    rank: int
    size: int
    stats: CommStats
    backend: str
    timeout_s: float

    # ---- public API: size-1 short-circuit + accounting ---------------------------------
    def all_reduce(self, t: torch.Tensor, op: ReduceOp = "sum") -> torch.Tensor:
        """Element-wise reduction across the group; every rank gets the result."""
        if self.size == 1:
            return t
        return self._run("all_reduce", _nbytes(t), self._all_reduce, t, op)

    def all_reduce_(self, t: torch.Tensor, op: ReduceOp = "sum") -> torch.Tensor:
        """In-place all_reduce of a contiguous tensor nobody else reads (saves a copy per call)."""
        if self.size == 1:
            return t
        return self._run("all_reduce", _nbytes(t), self._all_reduce_inplace, t, op)

    def _all_reduce_inplace(self, t: torch.Tensor, op: ReduceOp) -> torch.Tensor:
        return t.copy_(self._all_reduce(t, op))  # backends override with a true in-place reduction

    def all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's equal-shaped `t` along `dim`, in rank order."""
        if self.size == 1:
            return t
        return self._run("all_gather", _nbytes(t), self._all_gather, t, dim % t.dim())

    def reduce_scatter(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Sum across the group, then keep this rank's 1/size chunk along `dim`."""
        if self.size == 1:
            return t
        dim = dim % t.dim()
        if t.shape[dim] % self.size:
            raise ValueError(f"reduce_scatter: dim {dim} of size {t.shape[dim]} is not divisible by {self.size} ranks")
        return self._run("reduce_scatter", _nbytes(t), self._reduce_scatter, t, dim)

    def broadcast(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Every rank gets `src`'s tensor (the others pass a buffer of the same shape and dtype)."""
        if self.size == 1:
            return t
        if not 0 <= src < self.size:
            raise ValueError(f"broadcast src={src} is outside group {self.name!r} of size {self.size}")
        return self._run("broadcast", _nbytes(t), self._broadcast, t, src)

    def barrier(self) -> None:
        if self.size == 1:
            return
        self._run("barrier", 0, self._barrier)

    def _run(self, op: str, nbytes: int, primitive, *args):
        """Call a backend primitive: count it, time it, and name the op on failure."""
        t0 = time.perf_counter()
        try:
            result = primitive(*args)
        except (RuntimeError, OSError) as e:  # backends raise RuntimeError subclasses
            raise CollectiveError(op, self, e) from e
        self.stats.record(op, self.name, nbytes, time.perf_counter() - t0)
        return result

    # ---- backend primitives ---------------------------------------------------------------
    @abstractmethod
    def _all_reduce(self, t: torch.Tensor, op: ReduceOp) -> torch.Tensor: ...

    @abstractmethod
    def _all_gather(self, t: torch.Tensor, dim: int) -> torch.Tensor: ...

    @abstractmethod
    def _reduce_scatter(self, t: torch.Tensor, dim: int) -> torch.Tensor: ...

    @abstractmethod
    def _broadcast(self, t: torch.Tensor, src: int) -> torch.Tensor: ...

    @abstractmethod
    def _barrier(self) -> None: ...

    @abstractmethod
    def split(self, groups: list[list[int]], name: str) -> Communicator:
        """Collective: partition this group's ranks into `groups` (ranks of this group)
        and return the communicator of the group that holds this rank."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release backend resources (the world communicator only)."""

    @property
    def process_group(self):
        """This group's torch.distributed ProcessGroup, for PyTorch APIs that take one
        (DistributedDataParallel); None when the backend has none (MPI, a single process)."""
        return None

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(name={self.name!r}, rank={self.rank}, size={self.size}, backend={self.backend!r})"
        )


class LocalCommunicator(Communicator):
    """The size-1 group: a single process with no distributed runtime at all."""

    def __init__(self, name: str = "world", stats: CommStats | None = None) -> None:
        self.name, self.rank, self.size = name, 0, 1
        self.stats = stats if stats is not None else CommStats()
        self.backend = "local"
        self.timeout_s = DEFAULT_TIMEOUT_S

    def _all_reduce(self, t, op):  # pragma: no cover - size 1 never reaches primitives
        return t

    _all_gather = _reduce_scatter = _broadcast = _all_reduce  # type: ignore[assignment]

    def _barrier(self) -> None:  # pragma: no cover
        pass

    def split(self, groups: list[list[int]], name: str) -> Communicator:
        if groups != [[0]]:
            raise ValueError(f"a single process can only split into [[0]], got {groups}")
        return LocalCommunicator(name, self.stats)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
