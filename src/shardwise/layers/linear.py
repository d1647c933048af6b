"""Column- and row-parallel linear layers (Megatron-LM, Shoeybi et al., 2019).

    Y = X A + b

Column parallel splits A by output columns,  A = [A_1 ... A_p]:
    each rank computes Y_i = X A_i + b_i; Y = [Y_1 ... Y_p] stays sharded unless gathered.
Row parallel splits A by input rows,  A = [A_1; ...; A_p], X = [X_1 ... X_p]:
    each rank computes X_i A_i; Y = sum_i X_i A_i + b needs one all-reduce.

Weights keep nn.Linear's (out_features, in_features) layout, so a rank's shard is a
slice of dim 0 (column) or dim 1 (row) of the full weight.

The slices need not be equal (layers.partition.split_ranges): a width tp does not divide is
dealt out in whole units (`unit`: a head's columns, or an automatic block), the first ranks
taking one more. Nothing else changes: the all-reduce sums equal-shaped partial products,
and a gathered output is all-gathered with per-rank sizes.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from shardwise.comm import Communicator, copy_to_region, gather_from_region, reduce_from_region
from shardwise.comm.regions import reduce_scatter_to_sequence
from shardwise.kernels import linear
from shardwise.layers.partition import HeadLayout, split_ranges
from shardwise.layers.sequence import sequence_parallel_linear
from shardwise.layers.spec import ShardSpec

__all__ = ["ColumnParallelLinear", "RowParallelLinear"]


def _init_(weight: torch.Tensor, bias: torch.Tensor | None, fan_in: int) -> None:
    # nn.Linear's default init, using the *global* fan-in so every tp size draws from
    # the same distribution.
    bound = 1 / math.sqrt(fan_in) if fan_in > 0 else 0
    with torch.no_grad():
        weight.uniform_(-bound, bound)
        if bias is not None:
            bias.uniform_(-bound, bound)


class ColumnParallelLinear(nn.Module):
    """Y_i = X A_i + b_i, with A = [A_1 ... A_p] split by output features.

    The input must be replicated across the group. Forward is purely local; backward
    all-reduces dL/dX (copy_to_region). With gather_output=True the output is
    all-gathered to the full width (for a final layer whose consumer needs all of it).

    sequence_parallel=True: the input is this rank's sequence shard (B, T/p, in), all-gathered
    in forward (reduce-scattered in backward) by sequence_parallel_linear.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        comm: Communicator,
        bias: bool = True,
        gather_output: bool = False,
        sequence_parallel: bool = False,
        unit: int | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.comm = comm
        self.in_features, self.out_features = in_features, out_features
        self.gather_output = gather_output
        self.sequence_parallel = sequence_parallel
        self.unit = unit
        self.ranges = split_ranges(out_features, comm.size, unit=unit, what="out_features")
        """Every rank's [start, end) of the output features (uneven when tp does not divide them)."""
        self.sizes = [e - s for s, e in self.ranges]
        start, end = self.ranges[comm.rank]
        local_out = end - start
        self.weight = nn.Parameter(torch.empty(local_out, in_features, device=device, dtype=dtype))  # (out/p, in)
        self.bias = nn.Parameter(torch.empty(local_out, device=device, dtype=dtype)) if bias else None
        if self.weight.device.type != "meta":
            _init_(self.weight, self.bias, in_features)

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        *,
        comm: Communicator,
        gather_output: bool = False,
        sequence_parallel: bool = False,
        unit: int | None = None,
    ) -> ColumnParallelLinear:
        """This rank's column slice of an existing nn.Linear (its rows of `weight`)."""
        layer = cls(
            linear.in_features,
            linear.out_features,
            comm=comm,
            bias=linear.bias is not None,
            gather_output=gather_output,
            sequence_parallel=sequence_parallel,
            unit=unit,
            device="meta",
            dtype=linear.weight.dtype,
        )
        if linear.weight.is_meta:  # NOTE: a model built on meta (models.meta): its meta parameters are the shard
            return layer
        start, end = layer.ranges[comm.rank]
        layer.weight = nn.Parameter(linear.weight.detach()[start:end].clone())
        if linear.bias is not None:
            layer.bias = nn.Parameter(linear.bias.detach()[start:end].clone())
        return layer

    def shard_specs(self) -> dict[str, ShardSpec]:
        s, e = self.ranges[self.comm.rank]
        pieces = ((s, e - s),)
        specs = {"weight": ShardSpec((self.out_features, self.in_features), 0, pieces)}
        if self.bias is not None:
            specs["bias"] = ShardSpec((self.out_features,), 0, pieces)
        return specs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            y = sequence_parallel_linear(x, self.weight, self.bias, self.comm)  # (B, T/p, in) -> (B, T, out/p)
        else:
            x = copy_to_region(x, self.comm)  # (..., in)        identity fwd, all-reduce bwd
            y = linear(x, self.weight, self.bias)  # (..., out/p)
        if self.gather_output:
            y = gather_from_region(y, self.comm, sizes=self.sizes)  # (..., out)
        return y

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features} "
            f"(local {self.weight.shape[0]}), tp={self.comm.size}, bias={self.bias is not None}, "
            f"gather_output={self.gather_output}" + (", sequence_parallel=True" if self.sequence_parallel else "")
        )


class RowParallelLinear(nn.Module):
    """Y = sum_i X_i A_i + b, with A = [A_1; ...; A_p] split by input features.

    The input is already sharded along its last dim (the output of a
    ColumnParallelLinear). Forward all-reduces the partial products
    (reduce_from_region); the bias is replicated and added once, after the reduction.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        comm: Communicator,
        bias: bool = True,
        sequence_parallel: bool = False,
        unit: int | None = None,
        num_kv_heads: int | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.comm = comm
        self.in_features, self.out_features = in_features, out_features
        self.sequence_parallel = sequence_parallel
        self.unit, self.num_kv_heads = unit, num_kv_heads
        if num_kv_heads is None:
            self.ranges = split_ranges(in_features, comm.size, unit=unit, what="in_features")
        else:  # attention's output projection: the query heads qkv holds (HeadLayout), unit = head_dim
            lay = HeadLayout(in_features // unit, num_kv_heads, comm.size)
            self.ranges = [(q.start * unit, q.stop * unit) for q in map(lay.q_heads, range(comm.size))]
        """Every rank's [start, end) of the input features (uneven when tp does not divide them)."""
        start, end = self.ranges[comm.rank]
        local_in = end - start
        self.weight = nn.Parameter(torch.empty(out_features, local_in, device=device, dtype=dtype))  # (out, in/p)
        self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype)) if bias else None
        if self.weight.device.type != "meta":
            _init_(self.weight, self.bias, in_features)

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        *,
        comm: Communicator,
        sequence_parallel: bool = False,
        unit: int | None = None,
        num_kv_heads: int | None = None,
    ) -> RowParallelLinear:
        """This rank's row slice of an existing nn.Linear (its columns of `weight`)."""
        layer = cls(
            linear.in_features,
            linear.out_features,
            comm=comm,
            bias=linear.bias is not None,
            sequence_parallel=sequence_parallel,
            unit=unit,
            num_kv_heads=num_kv_heads,
            device="meta",
            dtype=linear.weight.dtype,
        )
        if linear.weight.is_meta:  # NOTE: a model built on meta (models.meta): its meta parameters are the shard
            return layer
        start, end = layer.ranges[comm.rank]
        layer.weight = nn.Parameter(linear.weight.detach()[:, start:end].clone())
        if linear.bias is not None:
            layer.bias = nn.Parameter(linear.bias.detach().clone())
        return layer

    def shard_specs(self) -> dict[str, ShardSpec]:
        s, e = self.ranges[self.comm.rank]
        specs = {"weight": ShardSpec((self.out_features, self.in_features), 1, ((s, e - s),))}
        if self.bias is not None:
            specs["bias"] = ShardSpec.replicated((self.out_features,))
        return specs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(x, self.weight)  # (..., in/p) -> (..., out), a partial sum
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence(y, self.comm)  # (B, T/p, out): reduce-scatter fwd, all-gather bwd
        else:
            y = reduce_from_region(y, self.comm, inplace=True)  # all-reduce fwd (in place), identity bwd
        if self.bias is not None:
            y = y + self.bias
        return y

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features} (local {self.weight.shape[1]}), out_features={self.out_features}, "
            f"tp={self.comm.size}, bias={self.bias is not None}"
            + (", sequence_parallel=True" if self.sequence_parallel else "")
        )
