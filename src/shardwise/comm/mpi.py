"""Communicator over MPI (mpi4py): the fast path between CPU ranks on one host.

MPI's shared-memory transport all-reduces a 4 KiB tensor in microseconds, where gloo
goes through loopback TCP. Tensors are handed to MPI as zero-copy NumPy views of their
CPU storage. bf16 and fp16 are reduced in fp32 (NumPy has no bf16, and half-precision
sums lose accuracy); other collectives move their raw bytes.

MPI collectives have no timeout of their own, so each one is started non-blocking and
polled against the deadline; a peer that died or never arrives raises, instead of hanging.
Point-to-point is one Isend or Irecv, polled the same way.
"""

from __future__ import annotations

import math
import os
import time

import numpy as np
import torch

from shardwise.comm.accounting import CommStats
from shardwise.comm.communicator import DEFAULT_TIMEOUT_S, Communicator, ReduceOp

__all__ = ["MPICommunicator", "init_mpi", "peer_failed"]

_peer_failure: list[str] = []  # set by the launcher's watcher thread when another rank has died


def peer_failed(message: str) -> None:
    """Make every collective of this process fail at once with `message` (a peer rank died,
    as shardwise.launch.mpi reports): a shared-memory collective would wait out its timeout."""
    _peer_failure.append(message)


_SPIN_POLLS = 256  # polls (about a microsecond each) before a waiting rank starts yielding its core
_NAP_AFTER_S = 0.005  # a wait this long is not a collective's latency but a peer with other work
_NAP_S = 0.0002  # then poll every 0.2 ms: an idle rank costs ~nothing, a late peer at most 0.2 ms
_HALF = (torch.bfloat16, torch.float16)
# Point-to-point requests that timed out, with their buffers: MPI may still write to (or read
# from) the memory of a pending request, so it must outlive the failed op.
_abandoned: list[tuple[object, np.ndarray]] = []
_RAW = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.bool: torch.uint8}


def init_mpi(timeout_s: float = DEFAULT_TIMEOUT_S, *, p2p_check: bool = False) -> MPICommunicator:
    """The world communicator of a job started by mpiexec (MPI is initialised on import).
    p2p_check turns on Communicator.p2p_check (header-checked point-to-point) on every group."""
    from mpi4py import MPI

    world = MPICommunicator(MPI.COMM_WORLD, name="world", stats=CommStats(), timeout_s=timeout_s)
    world.p2p_check = p2p_check
    return world


def _bytes(t: torch.Tensor) -> np.ndarray:
    """Zero-copy flat uint8 NumPy view of a contiguous CPU tensor (empty ones included)."""
    return t.reshape(-1).view(torch.uint8).numpy()


def _offsets(counts: list[int]) -> list[int]:
    return [sum(counts[:i]) for i in range(len(counts))]


def _np(t: torch.Tensor) -> np.ndarray:
    """Zero-copy NumPy view of a contiguous CPU tensor (bf16/fp16/bool as raw integers)."""
    raw = _RAW.get(t.dtype)
    return (t.view(raw) if raw is not None else t).numpy()


class MPICommunicator(Communicator):
    """One MPI communicator (COMM_WORLD or a split of it)."""

    def __init__(self, mpi_comm, *, name: str, stats: CommStats, timeout_s: float) -> None:
        from mpi4py import MPI

        self._MPI = MPI
        self.comm = mpi_comm
        self.name, self.stats, self.timeout_s = name, stats, timeout_s
        self.backend = "mpi"
        self.rank, self.size = mpi_comm.Get_rank(), mpi_comm.Get_size()
        self.members = tuple(range(self.size))  # the world's; a split's are set by split()
        self._ops = {"sum": MPI.SUM, "max": MPI.MAX}

    def _wait(self, request, op: str) -> None:
        # Poll Test: a blocking Wait has no timeout. The clock is read every 64 polls.
        # After a short spin each poll yields the core (sched_yield): free when nothing
        # else wants the core, and it lets a peer rank that shares it (more ranks than
        # cores) reach the collective instead of waiting out a scheduler time slice.
        # A wait longer than _NAP_AFTER_S (an idle server rank waiting for work) naps
        # between polls instead, so an idle rank does not keep a core busy.
        start, polls, napping = time.monotonic(), 0, False
        while not request.Test():
            polls += 1
            if polls <= _SPIN_POLLS:
                continue
            if polls & 63 == 0:
                if _peer_failure:
                    raise RuntimeError(f"MPI {op} cannot complete: {_peer_failure[0]}")
                waited = time.monotonic() - start
                if waited > self.timeout_s:
                    raise RuntimeError(f"MPI {op} timed out after {self.timeout_s:g}s (a peer died or never arrived)")
                napping = waited > _NAP_AFTER_S
            if napping:
                time.sleep(_NAP_S)
            else:
                os.sched_yield()

    def _all_reduce(self, t: torch.Tensor, op: ReduceOp) -> torch.Tensor:
        work = t.to(torch.float32) if t.dtype in _HALF else t.contiguous().clone()
        self._wait(self.comm.Iallreduce(self._MPI.IN_PLACE, _np(work), op=self._ops[op]), "all_reduce")
        return work.to(t.dtype) if t.dtype in _HALF else work

    def _all_reduce_inplace(self, t: torch.Tensor, op: ReduceOp) -> torch.Tensor:
        if t.dtype in _HALF or not t.is_contiguous():
            return super()._all_reduce_inplace(t, op)
        self._wait(self.comm.Iallreduce(self._MPI.IN_PLACE, _np(t), op=self._ops[op]), "all_reduce")
        return t

    def _all_gather(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        t = t.contiguous()
        out = torch.empty((self.size * t.shape[0], *t.shape[1:]), dtype=t.dtype)  # (size * d0, ...)
        self._wait(self.comm.Iallgather(_np(t), _np(out)), "all_gather")
        return torch.cat(out.chunk(self.size, dim=0), dim=dim) if dim else out

    def _reduce_scatter(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        chunks = torch.stack(t.chunk(self.size, dim=dim)).contiguous()  # (size, *chunk)
        work = chunks.to(torch.float32) if t.dtype in _HALF else chunks
        out = torch.empty(work.shape[1:], dtype=work.dtype)
        self._wait(self.comm.Ireduce_scatter_block(_np(work), _np(out), op=self._MPI.SUM), "reduce_scatter")
        return out.to(t.dtype)

    def _broadcast(self, t: torch.Tensor, src: int) -> torch.Tensor:
        out = t.contiguous().clone()
        self._wait(self.comm.Ibcast(_np(out), root=src), "broadcast")
        return out

    def _all_to_all(self, t: torch.Tensor, send_sizes: list[int], recv_sizes: list[int]) -> torch.Tensor:
        # Ialltoallv on the raw bytes (any dtype, bf16 included), counted in rows of a
        # contiguous datatype of one row's bytes (so counts stay small: MPI counts are ints).
        out = torch.empty((sum(recv_sizes), *t.shape[1:]), dtype=t.dtype)  # (sum(recv_sizes), ...)
        row = t.element_size() * math.prod(t.shape[1:])  # bytes per row
        if row == 0:
            return out  # rows of no bytes: nothing to move
        rowtype = self._MPI.BYTE.Create_contiguous(row).Commit()
        try:
            request = self.comm.Ialltoallv(
                [_bytes(t), (send_sizes, _offsets(send_sizes)), rowtype],
                [_bytes(out), (recv_sizes, _offsets(recv_sizes)), rowtype],
            )
            self._wait(request, "all_to_all")
        finally:
            rowtype.Free()  # MPI keeps it alive for a request still pending
        return out

    def _barrier(self) -> None:
        self._wait(self.comm.Ibarrier(), "barrier")

    def _send(self, t: torch.Tensor, dst: int, tag: int) -> None:
        self._wait_p2p(lambda a: self.comm.Isend(a, dest=dst, tag=tag), _np(t), "send")

    def _recv(self, buf: torch.Tensor, src: int, tag: int) -> None:
        self._wait_p2p(lambda a: self.comm.Irecv(a, source=src, tag=tag), _np(buf), "recv")

    def _wait_p2p(self, start, array: np.ndarray, op: str) -> None:
        request = start(array)
        try:
            self._wait(request, op)
        except RuntimeError:
            _abandoned.append((request, array))
            raise

    def split(self, groups: list[list[int]], name: str) -> Communicator:
        flat = sorted(r for g in groups for r in g)
        if flat != list(range(self.size)):
            raise ValueError(f"groups {groups} do not partition ranks 0..{self.size - 1}")
        color = next(i for i, g in enumerate(groups) if self.rank in g)
        key = groups[color].index(self.rank)
        sub = MPICommunicator(self.comm.Split(color, key), name=name, stats=self.stats, timeout_s=self.timeout_s)
        return self._derive(sub, tuple(self.members[r] for r in groups[color]))

    def close(self) -> None:
        pass  # MPI is finalised by mpi4py at interpreter exit

    def _release(self) -> None:
        if self.comm not in (self._MPI.COMM_WORLD, self._MPI.COMM_NULL):
            self.comm.Free()  # collective over this split's ranks, as close_splits is
