"""Fused column-parallel projections: head-aware QKV and merged gate/up.

A fused projection is several column-parallel matrices that share one input. Fusing
them into one module means one copy_to_region, so one backward all-reduce, instead of
one per matrix; and one GEMM instead of several.

Both keep the unsharded layout of their parts, each part sharded on its own:

    unsharded:  W = [W_q; W_k; W_v]             rank i:  [W_q,i; W_k,i; W_v,i]
    unsharded:  W = [W_gate; W_up]              rank i:  [W_gate,i; W_up,i]

so a plain model can split the output with `.split` / `.chunk` and run unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shardwise.comm import Communicator, copy_to_region
from shardwise.kernels import linear
from shardwise.layers.linear import _init_
from shardwise.layers.partition import HeadLayout, ShardError, divide, split_ranges
from shardwise.layers.sequence import sequence_parallel_linear
from shardwise.layers.spec import ShardSpec

__all__ = ["QKVParallelLinear", "MergedColumnParallelLinear", "SumReplicaGrads"]


class QKVParallelLinear(nn.Module):
    """Fused q/k/v projection split by attention heads, with grouped-query attention.

    Output on each rank: (..., (local_heads + 2 * local_kv_heads) * head_dim), laid out
    as [q | k | v]. Query heads are dealt out contiguously, as evenly as tp allows; each
    rank holds the KV heads its query heads use, so a KV head shared by two ranks' query
    heads (tp > num_kv_heads, or an uneven split) is replicated (see HeadLayout); in
    training, the replicas' weight gradients are summed so that every replica takes the
    same optimizer step. `kv_groups` is None when every local KV head serves the same
    number of local query heads (plain GQA), else the count per local KV head, which
    Attention follows.

    sequence_parallel = True: the input is this rank's sequence shard (B, T/p, hidden),
    all-gathered in forward by sequence_parallel_linear.
    """

    sequence_parallel: bool = False

    def __init__(
        self,
        hidden_size: int,
        *,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        comm: Communicator,
        bias: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.comm = comm
        self.hidden_size, self.head_dim = hidden_size, head_dim
        self.layout = HeadLayout(num_heads, num_kv_heads, comm.size)
        self.local_heads = len(self.layout.q_heads(comm.rank))
        self.local_kv_heads = len(self.layout.kv_heads(comm.rank))
        self.kv_groups = None if self.layout.regular(comm.rank) else self.layout.kv_groups(comm.rank)
        self.q_size = self.local_heads * head_dim
        self.kv_size = self.local_kv_heads * head_dim
        rows = self.q_size + 2 * self.kv_size
        self.weight = nn.Parameter(torch.empty(rows, hidden_size, device=device, dtype=dtype))  # (q+2kv, hidden)
        self.bias = nn.Parameter(torch.empty(rows, device=device, dtype=dtype)) if bias else None
        if self.weight.device.type != "meta":
            _init_(self.weight, self.bias, hidden_size)

    # ---- construction from unsharded weights -----------------------------------------------
    @classmethod
    def from_linear(
        cls, linear: nn.Linear, *, num_heads: int, num_kv_heads: int, comm: Communicator
    ) -> QKVParallelLinear:
        """This rank's heads of a fused nn.Linear whose output is [q | k | v]."""
        total_heads = num_heads + 2 * num_kv_heads
        head_dim = divide(linear.out_features, total_heads, what="fused qkv out_features over (heads + 2*kv_heads)")
        w = linear.weight.detach()
        b = linear.bias.detach() if linear.bias is not None else None
        q_rows, kv_rows = num_heads * head_dim, num_kv_heads * head_dim
        if w.is_meta:  # shapes only: _from_parts needs no values, and a meta split would import dynamo
            parts_w, parts_b = (w,) * 3, (b,) * 3
        else:
            parts_w = w.split([q_rows, kv_rows, kv_rows])
            parts_b = b.split([q_rows, kv_rows, kv_rows]) if b is not None else (None, None, None)
        return cls._from_parts(parts_w, parts_b, head_dim, num_heads, num_kv_heads, linear.in_features, comm)

    @classmethod
    def from_linears(
        cls, q: nn.Linear, k: nn.Linear, v: nn.Linear, *, num_heads: int, num_kv_heads: int, comm: Communicator
    ) -> QKVParallelLinear:
        """This rank's heads of separate q, k and v projections, fused into one module."""
        head_dim = divide(q.out_features, num_heads, what="q out_features over num_heads")
        if k.out_features != num_kv_heads * head_dim or v.out_features != k.out_features:
            raise ShardError(
                f"k/v out_features ({k.out_features}, {v.out_features}) != num_kv_heads({num_kv_heads}) * "
                f"head_dim({head_dim})"
            )
        if (q.bias is None) != (k.bias is None) or (k.bias is None) != (v.bias is None):
            raise ShardError("q, k and v projections must all have a bias or all have none")
        parts_w = tuple(m.weight.detach() for m in (q, k, v))
        parts_b = tuple(m.bias.detach() if m.bias is not None else None for m in (q, k, v))
        return cls._from_parts(parts_w, parts_b, head_dim, num_heads, num_kv_heads, q.in_features, comm)

    @classmethod
    def _from_parts(cls, parts_w, parts_b, head_dim, num_heads, num_kv_heads, hidden, comm) -> QKVParallelLinear:
        layer = cls(
            hidden,
            head_dim=head_dim,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            comm=comm,
            bias=parts_b[0] is not None,
            device="meta",
            dtype=parts_w[0].dtype,
        )
        if parts_w[0].is_meta:  # NOTE: a model built on meta (models.meta): its meta parameters are the shard
            return layer
        rows = layer.local_rows()
        layer.weight = nn.Parameter(torch.cat([p[r] for p, r in zip(parts_w, rows, strict=True)]).clone())
        if parts_b[0] is not None:
            layer.bias = nn.Parameter(torch.cat([p[r] for p, r in zip(parts_b, rows, strict=True)]).clone())
        return layer

    def local_rows(self) -> tuple[slice, slice, slice]:
        """Slices of this rank's rows in the unsharded q, k and v weights."""
        hd, lay, r = self.head_dim, self.layout, self.comm.rank
        q, kv = lay.q_heads(r), lay.kv_heads(r)
        return slice(q.start * hd, q.stop * hd), slice(kv.start * hd, kv.stop * hd), slice(kv.start * hd, kv.stop * hd)

    def shard_specs(self) -> dict[str, ShardSpec]:
        """Rows of the unsharded [q | k | v] tensor: this rank's q, k and v heads."""
        lay, hd = self.layout, self.head_dim
        q_total, kv_total = lay.num_heads * hd, lay.num_kv_heads * hd
        q, k, v = self.local_rows()
        pieces = ((q.start, q.stop - q.start), (q_total + k.start, k.stop - k.start))
        pieces += ((q_total + kv_total + v.start, v.stop - v.start),)
        rows = q_total + 2 * kv_total
        specs = {"weight": ShardSpec((rows, self.hidden_size), 0, pieces)}
        if self.bias is not None:
            specs["bias"] = ShardSpec((rows,), 0, pieces)
        return specs

    # ---- forward ---------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            return self._sequence_parallel_forward(x)
        x = copy_to_region(x, self.comm)  # (..., hidden)   identity fwd, all-reduce bwd
        if not self.layout.replicated or not (torch.is_grad_enabled() and self.weight.requires_grad):
            return linear(x, self.weight, self.bias)  # (..., q + 2kv)
        # NOTE: replicated KV heads: each replica's gradient covers only its own query
        # heads. Route the k/v rows through SumReplicaGrads so that the replicas' weight
        # gradients are summed in backward, giving each the unsharded gradient.
        w_q, w_kv = self.weight.split([self.q_size, 2 * self.kv_size])
        b_q, b_kv = self.bias.split([self.q_size, 2 * self.kv_size]) if self.bias is not None else (None, None)
        w_kv = SumReplicaGrads.apply(w_kv, self.comm, self.layout)
        b_kv = SumReplicaGrads.apply(b_kv, self.comm, self.layout) if b_kv is not None else None
        return torch.cat([F.linear(x, w_q, b_q), F.linear(x, w_kv, b_kv)], dim=-1)

    def _sequence_parallel_forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T/p, hidden) -> (B, T, q + 2kv): one all-gather; replicated KV rows summed in
        backward (through a view of the weight: no copy is kept for backward)."""
        w, b = self.weight, self.bias
        if self.layout.replicated and torch.is_grad_enabled() and w.requires_grad:
            w = SumReplicaGrads.apply(w, self.comm, self.layout, self.q_size)
            b = SumReplicaGrads.apply(b, self.comm, self.layout, self.q_size) if b is not None else None
        return sequence_parallel_linear(x, w, b, self.comm)

    def extra_repr(self) -> str:
        return f"hidden_size={self.hidden_size}, head_dim={self.head_dim}, {self.layout}, bias={self.bias is not None}"


class SumReplicaGrads(torch.autograd.Function):
    """Forward: identity on this rank's k and v rows (rows `start:` of t, laid out as
    [k heads | v heads]; the rows before pass through). Backward: sum each KV head's rows'
    gradient over the ranks that hold that head."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, comm: Communicator, layout: HeadLayout, start: int = 0) -> torch.Tensor:
        ctx.comm, ctx.layout, ctx.start = comm, layout, start
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        comm, layout, start = ctx.comm, ctx.layout, ctx.start
        heads = layout.kv_heads(comm.rank)
        kv = grad[start:]  # (2 * local_kv * hd, ...)
        # One slot per KV head, for k and for v; each rank fills its heads' slots, and the
        # all-reduce sums the replicas of every head at once, using the tp group itself.
        local = kv.view(2, len(heads), -1, *kv.shape[1:])  # (2, local_kv, hd, ...)
        slots = kv.new_zeros((2, layout.num_kv_heads, *local.shape[2:]))
        slots[:, heads.start : heads.stop] = local
        summed = comm.all_reduce(slots)[:, heads.start : heads.stop].reshape(kv.shape)
        return (torch.cat([grad[:start], summed]) if start else summed), None, None, None


class MergedColumnParallelLinear(nn.Module):
    """Several column-parallel matrices on one input, each split on its own (e.g. gate and up).

    Output on each rank: [Y_1,i | Y_2,i | ...] with Y_k,i = X A_k,i, so `chunk(len(sizes))`
    recovers the parts when they are equal in size, sharded or not.

    sequence_parallel = True: the input is this rank's sequence shard (B, T/p, in),
    all-gathered in forward by sequence_parallel_linear.
    """

    sequence_parallel: bool = False

    def __init__(
        self,
        in_features: int,
        output_sizes: list[int],
        *,
        comm: Communicator,
        bias: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        unit: int | None = None,
    ) -> None:
        super().__init__()
        self.comm = comm
        self.in_features, self.output_sizes = in_features, list(output_sizes)
        self.ranges = [
            split_ranges(s, comm.size, unit=unit, what=f"output_sizes[{k}]") for k, s in enumerate(output_sizes)
        ]
        """Per part, every rank's [start, end) of it (uneven when tp does not divide the part)."""
        self.local_sizes = [r[comm.rank][1] - r[comm.rank][0] for r in self.ranges]
        rows = sum(self.local_sizes)
        self.weight = nn.Parameter(torch.empty(rows, in_features, device=device, dtype=dtype))  # (sum out/p, in)
        self.bias = nn.Parameter(torch.empty(rows, device=device, dtype=dtype)) if bias else None
        if self.weight.device.type != "meta":
            _init_(self.weight, self.bias, in_features)

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, output_sizes: list[int], *, comm: Communicator, unit: int | None = None
    ) -> MergedColumnParallelLinear:
        """This rank's slices of a fused nn.Linear whose output is [part_1 | part_2 | ...]."""
        if sum(output_sizes) != linear.out_features:
            raise ShardError(f"output_sizes {output_sizes} sum to {sum(output_sizes)}, not {linear.out_features}")
        w = linear.weight.detach().split(output_sizes)
        b = linear.bias.detach().split(output_sizes) if linear.bias is not None else None
        return cls._from_parts(list(w), list(b) if b else None, linear.in_features, comm, unit)

    @classmethod
    def from_linears(cls, *linears: nn.Linear, comm: Communicator) -> MergedColumnParallelLinear:
        """This rank's slices of separate projections (e.g. gate_proj, up_proj), merged."""
        if len({m.in_features for m in linears}) != 1:
            raise ShardError(f"merged projections need one in_features, got {[m.in_features for m in linears]}")
        has_bias = {m.bias is not None for m in linears}
        if len(has_bias) != 1:
            raise ShardError("merged projections must all have a bias or all have none")
        w = [m.weight.detach() for m in linears]
        b = [m.bias.detach() for m in linears] if has_bias == {True} else None
        return cls._from_parts(w, b, linears[0].in_features, comm)

    @classmethod
    def _from_parts(cls, w, b, in_features, comm, unit=None) -> MergedColumnParallelLinear:
        sizes = [p.shape[0] for p in w]
        layer = cls(in_features, sizes, comm=comm, bias=b is not None, device="meta", dtype=w[0].dtype, unit=unit)
        if w[0].is_meta:  # NOTE: a model built on meta (models.meta): its meta parameters are the shard
            return layer
        ranges = [r[comm.rank] for r in layer.ranges]
        layer.weight = nn.Parameter(torch.cat([p[s:e] for p, (s, e) in zip(w, ranges, strict=True)]).clone())
        if b is not None:
            layer.bias = nn.Parameter(torch.cat([p[s:e] for p, (s, e) in zip(b, ranges, strict=True)]).clone())
        return layer

    def shard_specs(self) -> dict[str, ShardSpec]:
        """Rows of the unsharded [part_1 | part_2 | ...] tensor: this rank's slice of each part."""
        pieces, offset = [], 0
        for size, ranges in zip(self.output_sizes, self.ranges, strict=True):
            s, e = ranges[self.comm.rank]
            pieces.append((offset + s, e - s))
            offset += size
        specs = {"weight": ShardSpec((offset, self.in_features), 0, tuple(pieces))}
        if self.bias is not None:
            specs["bias"] = ShardSpec((offset,), 0, tuple(pieces))
        return specs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            return sequence_parallel_linear(x, self.weight, self.bias, self.comm)  # (B, T/p, in) -> (B, T, sum/p)
        x = copy_to_region(x, self.comm)  # (..., in)   identity fwd, all-reduce bwd
        return linear(x, self.weight, self.bias)  # (..., sum(out)/p)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, output_sizes={self.output_sizes} "
            f"(local {self.local_sizes}), tp={self.comm.size}"
        )
