"""Communicator over torch.distributed: gloo on CPU, NCCL on CUDA.

This module is the only place in shardwise that calls torch.distributed collectives.
Every process group is created with the job's timeout, so a collective whose peer has
died or hangs raises instead of blocking forever. Point-to-point is one isend or irecv,
waited on with that timeout; never batched (batch_isend_irecv hangs on gloo in known
cases, pytorch #132644), so the caller orders sends and receives (Communicator.send_recv).
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from shardwise.comm.accounting import CommStats
from shardwise.comm.communicator import DEFAULT_TIMEOUT_S, Communicator, ReduceOp

__all__ = ["TorchDistCommunicator", "init_torch_distributed", "store_client"]

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}
# torch >= 2.11 names the flat-buffer collectives *_single; older releases *_tensor.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def init_torch_distributed(
    *,
    rank: int,
    world_size: int,
    master_addr: str = "127.0.0.1",
    master_port: int,
    backend: str = "gloo",
    timeout_s: float = DEFAULT_TIMEOUT_S,
    init_method: str | None = None,
    p2p_check: bool = False,
) -> TorchDistCommunicator:
    """Join (or create) the job's default process group and return the world communicator.

    Called once per process by the launcher, at the outer edge; library code only ever
    sees the returned communicator. init_method defaults to tcp://master_addr:master_port
    (rank 0 hosts the store); under torchrun it is "env://", to use the agent's store.
    """
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"torch.distributed backend must be 'gloo' or 'nccl', got {backend!r}")
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise RuntimeError("backend 'nccl' needs CUDA, but torch.cuda.is_available() is False")
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(
        backend,
        init_method=init_method or f"tcp://{master_addr}:{master_port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    world = TorchDistCommunicator(None, name="world", stats=CommStats(), backend=backend, timeout_s=timeout_s)
    world.p2p_check = p2p_check
    return world


class TorchDistCommunicator(Communicator):
    """One torch.distributed process group (None = the default, world group)."""

    def __init__(self, group, *, name: str, stats: CommStats, backend: str, timeout_s: float) -> None:
        self.group = group
        self.name = name
        self.stats = stats
        self.backend = backend
        self.timeout_s = timeout_s
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.members = tuple(range(self.size)) if group is None else tuple(dist.get_process_group_ranks(group))

    def _all_reduce(self, t: torch.Tensor, op: ReduceOp) -> torch.Tensor:
        out = t.contiguous().clone()
        dist.all_reduce(out, op=_OPS[op], group=self.group)
        return out

    def _all_reduce_inplace(self, t: torch.Tensor, op: ReduceOp) -> torch.Tensor:
        if not t.is_contiguous():
            return super()._all_reduce_inplace(t, op)
        dist.all_reduce(t, op=_OPS[op], group=self.group)
        return t

    def _all_gather(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        # Gather along dim 0 into one buffer, then move the rank axis next to `dim`.
        t = t.contiguous()
        out = torch.empty((self.size * t.shape[0], *t.shape[1:]), dtype=t.dtype, device=t.device)
        _all_gather_flat(out, t, group=self.group)  # (size * d0, ...)
        return torch.cat(out.chunk(self.size, dim=0), dim=dim) if dim else out

    def _reduce_scatter(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        if dim == 0:  # the chunks are already contiguous and in rank order: no copy
            out = torch.empty((t.shape[0] // self.size, *t.shape[1:]), dtype=t.dtype, device=t.device)
            _reduce_scatter_flat(out, t.contiguous(), group=self.group)
            return out
        # Put the chunks of `dim` in rank order along dim 0, so each rank's chunk is contiguous.
        chunks = torch.stack(t.chunk(self.size, dim=dim)).contiguous()  # (size, *chunk_shape)
        out = torch.empty(chunks.shape[1:], dtype=t.dtype, device=t.device)
        _reduce_scatter_flat(out, chunks.flatten(0, 1), group=self.group)
        return out

    def _broadcast(self, t: torch.Tensor, src: int) -> torch.Tensor:
        out = t.contiguous().clone()
        dist.broadcast(out, src=self._global(src), group=self.group)
        return out

    def _all_to_all(self, t: torch.Tensor, send_sizes: list[int], recv_sizes: list[int]) -> torch.Tensor:
        # all_to_all_single with split sizes: uneven (and empty) splits work on gloo (CPU) and NCCL.
        out = torch.empty((sum(recv_sizes), *t.shape[1:]), dtype=t.dtype, device=t.device)
        dist.all_to_all_single(out, t, recv_sizes, send_sizes, group=self.group)
        return out

    def _all_reduce_async(self, t: torch.Tensor) -> torch.futures.Future:
        return dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group, async_op=True).get_future()

    def _barrier(self) -> None:
        # A barrier as a tiny all-reduce: it honours the group timeout on every backend.
        dist.all_reduce(torch.zeros(1, device=self.device), group=self.group)

    def _send(self, t: torch.Tensor, dst: int, tag: int) -> None:
        self._wait(dist.isend(t, dst=self._global(dst), group=self.group, tag=tag), "send", dst)

    def _recv(self, buf: torch.Tensor, src: int, tag: int) -> None:
        self._wait(dist.irecv(buf, src=self._global(src), group=self.group, tag=tag), "recv", src)

    def _wait(self, work, op: str, peer: int) -> None:
        # An explicit timeout: a bare wait() on a point-to-point op may block for good.
        if not work.wait(timeout=timedelta(seconds=self.timeout_s)):
            raise RuntimeError(f"{op} with rank {peer} did not complete within {self.timeout_s:g}s")

    def _global(self, rank: int) -> int:
        return dist.get_global_rank(self.group, rank) if self.group is not None else rank

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")

    def split(self, groups: list[list[int]], name: str) -> Communicator:
        _check_partition(groups, self.size)
        mine = None
        global_ranks = list(range(self.size)) if self.group is None else dist.get_process_group_ranks(self.group)
        for ranks in groups:  # new_group is collective: every rank creates every group, in order
            members = [global_ranks[r] for r in ranks]
            pg = dist.new_group(members, timeout=timedelta(seconds=self.timeout_s), use_local_synchronization=False)
            if self.rank in ranks:
                mine = pg
        sub = TorchDistCommunicator(mine, name=name, stats=self.stats, backend=self.backend, timeout_s=self.timeout_s)
        return self._derive(sub, sub.members)

    @property
    def process_group(self) -> dist.ProcessGroup:
        return self.group if self.group is not None else dist.group.WORLD

    def close(self) -> None:
        if self.group is None and dist.is_initialized():
            self._splits = None  # destroyed with the default group
            dist.destroy_process_group()

    def _release(self) -> None:
        # NOTE: a rank outside a group holds GroupMember.NON_GROUP_MEMBER, nothing to free;
        # destroy_process_group shuts the group down (joins gloo's threads, closes its sockets)
        # even while stale Python references to it remain.
        if self.group is not None and self.group != dist.GroupMember.NON_GROUP_MEMBER and dist.is_initialized():
            dist.destroy_process_group(self.group)
        self.group = dist.GroupMember.NON_GROUP_MEMBER


def store_client(host: str, port: int, timeout_s: float = 30.0) -> dist.TCPStore:
    """A client of the TCPStore at host:port (torchrun's agent store, for the progress board)."""
    return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s), wait_for_workers=False)


def _check_partition(groups: list[list[int]], size: int) -> None:
    flat = sorted(r for g in groups for r in g)
    if flat != list(range(size)):
        raise ValueError(f"groups {groups} do not partition ranks 0..{size - 1}")
