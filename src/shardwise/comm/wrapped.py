"""A communicator that takes another's place and does some of its collectives another way.

    class Faster(Wrapped):
        def _all_reduce(self, t, op): ...      # the rest: the wrapped communicator's

shardwise.comm.shm (a group inside one host: shared memory) and shardwise.comm.tcp (a group
across hosts: direct TCP connections) wrap a group's gloo or MPI communicator this way. The
wrapper shares the wrapped one's name, ranks, timeout, accounting and progress board, so its
calls count, time out and are named exactly as the wrapped communicator's would be; what it
does not override passes through.
"""

from __future__ import annotations

import torch

from shardwise.comm.communicator import Communicator, ReduceOp

__all__ = ["Wrapped", "take_place"]


class Wrapped(Communicator):
    """`inner`, every primitive passed through (subclasses override those they do themselves)."""

    def __init__(self, inner: Communicator) -> None:
        self.inner = inner
        self.name, self.rank, self.size = inner.name, inner.rank, inner.size
        self.stats, self.backend, self.timeout_s = inner.stats, inner.backend, inner.timeout_s
        self.members, self.wire, self.p2p_check = inner.members, inner.wire, inner.p2p_check
        self.attach_board(inner._board)

    def __getattr__(self, name: str):
        # only for what this class lacks (a backend's own handle: .group, .comm): the wrapped one's
        if name == "inner":  # not set yet (during construction, or unpickling)
            raise AttributeError(name)
        return getattr(self.inner, name)

    def _all_reduce(self, t: torch.Tensor, op: ReduceOp) -> torch.Tensor:
        return self.inner._all_reduce(t, op)

    def _all_reduce_inplace(self, t: torch.Tensor, op: ReduceOp) -> torch.Tensor:
        return self.inner._all_reduce_inplace(t, op)

    def _all_gather(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        return self.inner._all_gather(t, dim)

    def _reduce_scatter(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        return self.inner._reduce_scatter(t, dim)

    def _broadcast(self, t: torch.Tensor, src: int) -> torch.Tensor:
        return self.inner._broadcast(t, src)

    def _all_to_all(self, t: torch.Tensor, send_sizes: list[int], recv_sizes: list[int]) -> torch.Tensor:
        return self.inner._all_to_all(t, send_sizes, recv_sizes)

    def _all_reduce_async(self, t: torch.Tensor) -> torch.futures.Future:
        return self.inner._all_reduce_async(t)

    def _barrier(self) -> None:
        self.inner._barrier()

    def _send(self, t: torch.Tensor, dst: int, tag: int) -> None:
        self.inner._send(t, dst, tag)

    def _recv(self, buf: torch.Tensor, src: int, tag: int) -> None:
        self.inner._recv(buf, src, tag)

    def split(self, groups: list[list[int]], name: str) -> Communicator:
        return self.inner.split(groups, name)

    @property
    def device(self) -> torch.device:
        return self.inner.device

    @property
    def process_group(self):
        return self.inner.process_group

    def close_splits(self) -> None:
        self.inner.close_splits()

    def _drop(self) -> None:  # noqa: B027 - optional hook
        """Free what the wrapper itself holds (before the wrapped communicator goes)."""

    def _release(self) -> None:
        self._drop()
        self.inner._release()

    def close(self) -> None:
        self._drop()
        self.inner.close()


def take_place(wrapped: Communicator, comm: Communicator, parent: Communicator | None) -> Communicator:
    """`wrapped` in `comm`'s place among parent's splits (parent.close_splits() releases it too)."""
    if parent is not None and parent._splits and comm in parent._splits:
        parent._splits[parent._splits.index(comm)] = wrapped
    return wrapped
