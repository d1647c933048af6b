"""Data parallelism: averaging gradients over the dp group.

Two ways, chosen by ParallelSection.dp_sync:

- DDPSync: PyTorch DistributedDataParallel on the dp process group (torch.distributed
  backends). Its all-reduces overlap with backward; micro-steps before the last run
  under `no_sync()`, so gradient accumulation costs one round of all-reduces per step.
  A comm hook runs each bucket's all-reduce through the dp Communicator (all_reduce_async_):
  counted as all_reduce/dp, on the progress board while in flight, and a failure raised as
  its CollectiveError, naming after a timeout the rank that never arrived. DDP's own
  broadcasts (at construction, and of its bucket order after the first backward) run
  through the Communicator too (Communicator.external).
- BucketedSync: after the last micro-step, gradients are packed into flat buckets of
  about bucket_mb each and every bucket is all-reduced through the Communicator. It
  works on any Communicator (MPI included), with one collective per bucket.

Both leave each rank with the dp mean of the gradients.

- ExpertParallelSync (parallel.ep > 1): the dense parameters bucketed over dp; the experts'
  gradients summed over the ranks holding the same experts only (edp) and divided by dp
  (see shardwise.train.experts).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from shardwise.comm import CollectiveError, Communicator
from shardwise.comm.communicator import Pending

__all__ = ["GradSync", "NoSync", "DDPSync", "BucketedSync", "ExpertParallelSync", "make_grad_sync"]


class GradSync:
    """Runs the forward passes (`module`) and averages gradients over dp (`finish`)."""

    module: nn.Module

    def micro_step(self, last: bool) -> contextlib.AbstractContextManager:
        """Wraps one micro-step's forward and backward; `last` = the step's final one."""
        return contextlib.nullcontext()

    def finish(self) -> None:
        """After the last micro-step's backward: make every gradient the dp mean."""


class NoSync(GradSync):
    """dp = 1: nothing to average."""

    def __init__(self, model: nn.Module) -> None:
        self.module = model


class DDPSync(GradSync):
    """DistributedDataParallel over the dp communicator's torch.distributed process group."""

    def __init__(self, model: nn.Module, dp: Communicator, bucket_mb: float) -> None:
        from torch.nn.parallel import DistributedDataParallel

        if dp.process_group is None:
            raise ValueError(f"DistributedDataParallel needs a torch.distributed group; dp uses {dp.backend!r}")
        # NOTE: parameters are already identical on every dp rank (same seed or same checkpoint);
        # DDP's initial broadcast from dp rank 0 keeps them so.
        self.module = dp.external(
            "broadcast", lambda: DistributedDataParallel(model, process_group=dp.process_group, bucket_cap_mb=bucket_mb)
        )
        self.dp, self._synced, self._rebuilt = dp, False, False
        self._in_flight: list[Pending] = []
        self.module.register_comm_hook(self, _all_reduce_hook)

    @contextlib.contextmanager
    def micro_step(self, last: bool):
        if self._synced and not self._rebuilt:
            # DDP re-buckets the gradients in the order of the first synced backward, and broadcasts
            # that order from dp rank 0 at the next forward: issued here, through the communicator.
            self._rebuilt = True
            rebuild = getattr(self.module.reducer, "_rebuild_buckets", None)
            if rebuild is not None:
                self.dp.external("broadcast", rebuild)
        try:
            with contextlib.nullcontext() if last else self.module.no_sync():
                yield
        except RuntimeError as e:
            # a bucket's all-reduce failed: DDP re-raises its error as a plain RuntimeError
            failed = next((p for p in self._in_flight if p.end is None), None)
            if failed is None or isinstance(e, CollectiveError):
                raise
            raise failed.failed(failed.error or e) from e

    def finish(self) -> None:
        self._synced = True
        for pending in self._in_flight:  # done by now: backward waits for every bucket
            pending.record()
        self._in_flight.clear()


def _all_reduce_hook(sync: DDPSync, bucket):  # NOTE: DDP rejects string annotations of these two
    """DDP's comm hook: as DDP's own (the bucket's dp mean, all-reduced asynchronously, so that
    it overlaps the rest of backward), through the dp Communicator."""
    grads = bucket.buffer().div_(sync.dp.size)  # (bucket numel,) flat gradients
    reduced, pending = sync.dp.all_reduce_async_(grads)
    sync._in_flight.append(pending)
    return reduced


class BucketedSync(GradSync):
    """Flat-bucket all-reduce of the gradients through any Communicator.

    params: the parameters to reduce (default: all of the model's); divide_by: what the sums
    are divided by (default: dp.size, the mean)."""

    def __init__(
        self,
        model: nn.Module,
        dp: Communicator,
        bucket_mb: float,
        *,
        params: list[nn.Parameter] | None = None,
        divide_by: int | None = None,
    ) -> None:
        self.module, self.dp = model, dp
        self.divide_by = dp.size if divide_by is None else divide_by
        self.buckets: list[list[nn.Parameter]] = []
        limit, size, current = int(bucket_mb * 2**20), 0, []
        params = [p for p in model.parameters() if p.requires_grad] if params is None else params
        # Reverse registration order, as DDP: roughly the order backward produces gradients.
        for p in reversed(params):
            if current and (size + p.numel() * p.element_size() > limit or p.dtype != current[0].dtype):
                self.buckets.append(current)
                size, current = 0, []
            current.append(p)
            size += p.numel() * p.element_size()
        if current:
            self.buckets.append(current)

    def finish(self) -> None:
        for bucket in self.buckets:
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in bucket]
            flat = torch.cat([g.reshape(-1) for g in grads])  # (bucket numel,)
            flat = self.dp.all_reduce(flat).div_(self.divide_by)
            for p, part in zip(bucket, flat.split([g.numel() for g in grads]), strict=True):
                if p.grad is None:
                    p.grad = part.view_as(p).clone()
                else:
                    p.grad.copy_(part.view_as(p))


class ExpertParallelSync(GradSync):
    """ep > 1: dense parameters averaged over dp, experts summed over edp and divided by dp."""

    def __init__(
        self, model: nn.Module, dp: Communicator, edp: Communicator, experts: set[str], bucket_mb: float
    ) -> None:
        self.module = model
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        dense = [p for n, p in named if n not in experts]
        expert = [p for n, p in named if n in experts]
        self.parts = [
            BucketedSync(model, dp, bucket_mb, params=dense),
            BucketedSync(model, edp, bucket_mb, params=expert, divide_by=dp.size),
        ]

    def finish(self) -> None:
        for part in self.parts:
            part.finish()


def make_grad_sync(model: nn.Module, dp: Communicator, *, mode: str, bucket_mb: float) -> GradSync:
    """The GradSync for `mode` ("auto", "ddp", "bucketed") on this dp communicator."""
    if dp.size == 1:
        return NoSync(model)
    is_torch = dp.process_group is not None
    if mode == "ddp" and not is_torch:
        raise ValueError(f"parallel.dp_sync='ddp' needs a torch.distributed backend; dp group uses {dp.backend!r}")
    if mode == "ddp" or (mode == "auto" and is_torch):
        return DDPSync(model, dp, bucket_mb)
    return BucketedSync(model, dp, bucket_mb)
