"""The tensor-parallel twin of a mixture-of-experts block (shardwise.models.moe.MoE).

Two placements of the routed experts over the tp group, one collective either way:

    tensor-parallel experts   every expert's gate/up rows split by columns and its down by
                              rows, like a dense MLP:  y_e = sum_r down_e,r(act(gate_e,r x) * up_e,r x)
    expert parallelism        rank r holds the whole experts [first_r, first_r + n_r), a
                              contiguous range (uneven when tp does not divide num_experts)

The router is replicated, so every rank routes every token alike; each rank computes the
weighted sum over what it holds (a partial sum), adds its slice of the shared expert (split
colwise/rowwise like a dense MLP, sigmoid gate applied to the partial: it is linear in it) and
ONE all-reduce completes the layer, the same collective a dense MLP costs.

Backward (training): the input, the routing weights and the shared gate's output each enter
the partial sums, so their gradients are partial too; copy_to_region all-reduces them
(identity forward), and every rank's router and shared gate see the full gradient.
"""

from __future__ import annotations

import torch
from torch import nn

from shardwise.comm import Communicator, copy_to_region, reduce_from_region
from shardwise.kernels import linear
from shardwise.layers.partition import ShardError, split_ranges
from shardwise.layers.spec import ShardSpec
from shardwise.models.moe import Experts, MoE, route

__all__ = ["ParallelMoE", "ShardedExperts", "SlicedLinear", "PartialMLP", "expert_ranges", "expert_specs"]


def expert_ranges(num_experts: int, tp: int) -> list[tuple[int, int]]:
    """[first, end) of the experts each rank holds under expert parallelism, in rank order."""
    if tp > num_experts:
        raise ShardError(
            f"expert parallelism needs tp <= num_experts: tp={tp}, num_experts={num_experts}; "
            f"valid tp sizes: 1-{num_experts}"
        )
    return split_ranges(num_experts, tp, unit=1, what="num_experts")


def expert_specs(
    num_experts: int, hidden: int, width: int, tp: int, rank: int, *, expert_parallel: bool
) -> dict[str, ShardSpec]:
    """The ShardSpecs of the stacked `up` (E*2I, H) and `down` (E*H, I) on `rank`.

    Expert parallel: one row block of each. Tensor-parallel experts: for every expert its
    gate rows and its up rows [s, e) of the width (dim 0 of up), and columns [s, e) of down."""
    E, H, I = num_experts, hidden, width  # noqa: E741
    up_shape, down_shape = (E * 2 * I, H), (E * H, I)
    if expert_parallel:
        first, end = expert_ranges(E, tp)[rank]
        n = end - first
        return {
            "up": ShardSpec(up_shape, 0, ((first * 2 * I, n * 2 * I),)),
            "down": ShardSpec(down_shape, 0, ((first * H, n * H),)),
        }
    if tp > I:
        raise ShardError(f"tensor-parallel experts need tp <= expert width: tp={tp}, width={I}; valid tp sizes: 1-{I}")
    s, e = split_ranges(I, tp, what="expert intermediate size")[rank]
    pieces = tuple(p for x in range(E) for p in ((x * 2 * I + s, e - s), (x * 2 * I + I + s, e - s)))
    return {"up": ShardSpec(up_shape, 0, pieces), "down": ShardSpec(down_shape, 1, ((s, e - s),))}


def _cut(param: torch.Tensor, spec: ShardSpec) -> nn.Parameter:
    """This rank's local parameter for spec: a meta tensor of the local shape for a model
    built on meta (the loader fills it), else the slice of the full tensor."""
    if param.is_meta:
        return nn.Parameter(torch.empty(spec.local_shape, device="meta", dtype=param.dtype))
    return nn.Parameter(spec.take(param.detach()))


class ShardedExperts(Experts):
    """Experts holding this rank's slice of the stacked weights (whole experts from `first`,
    or every expert's column/row slice); the forward is Experts' (widths from shapes)."""

    @classmethod
    def from_experts(cls, experts: Experts, specs: dict[str, ShardSpec], first: int) -> ShardedExperts:
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.act, new.first, new.specs = experts.act, first, specs
        new.up = _cut(experts.up, specs["up"])  # (E_local * 2 * I_local, H)
        new.down = _cut(experts.down, specs["down"])  # (E_local * H, I_local)
        return new

    def shard_specs(self) -> dict[str, ShardSpec]:
        return dict(self.specs)

    def forward(self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        if x.is_meta:  # NOTE: routing is data-dependent; a meta dry run (`shardwise info`) only needs the shape
            return x.new_empty(x.shape)
        return super().forward(x, idx, weights)


class SlicedLinear(nn.Module):
    """A bias-free linear holding a slice of a bigger weight (pieces of its rows or columns);
    no collective: the caller reduces."""

    def __init__(self, linear: nn.Linear, spec: ShardSpec) -> None:
        super().__init__()
        if linear.bias is not None:
            raise ShardError("a shared expert with biases is not supported")
        self.spec = spec
        self.weight = _cut(linear.weight, spec)

    def shard_specs(self) -> dict[str, ShardSpec]:
        return {"weight": self.spec}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight)


class PartialMLP(nn.Module):
    """A gated MLP split like a dense one (gate/up by columns, down by rows) whose output is
    this rank's partial sum, left for the caller's all-reduce. (N, H) -> (N, H)."""

    def __init__(self, mlp: nn.Module, tp: int, rank: int) -> None:
        super().__init__()
        self.act = mlp.act
        width = mlp.down.in_features
        s, e = split_ranges(width, tp, what="shared expert intermediate size")[rank]
        hidden = mlp.down.out_features
        self.up = SlicedLinear(mlp.up, ShardSpec((2 * width, hidden), 0, ((s, e - s), (width + s, e - s))))
        self.down = SlicedLinear(mlp.down, ShardSpec((hidden, width), 1, ((s, e - s),)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.up(x).chunk(2, dim=-1)  # (N, I/p) each
        return self.down(self.act(gate) * up)  # (N, H), a partial sum


class ParallelMoE(MoE):
    """An MoE block over a tp group (see the module docstring). Still an MoE (moe_blocks
    finds it; router_logits and routed are kept). (B, T, H) -> (B, T, H), one all-reduce."""

    def __init__(self, moe: MoE, *, comm: Communicator, expert_parallel: bool) -> None:
        nn.Module.__init__(self)
        self.comm, self.expert_parallel = comm, expert_parallel
        self.top_k, self.normalize, self.num_experts = moe.top_k, moe.normalize, moe.num_experts
        self.gate = moe.gate  # replicated router
        hidden = moe.gate.in_features
        width = moe.experts.up.shape[0] // (2 * moe.num_experts)
        specs = expert_specs(moe.num_experts, hidden, width, comm.size, comm.rank, expert_parallel=expert_parallel)
        first = expert_ranges(moe.num_experts, comm.size)[comm.rank][0] if expert_parallel else 0
        self.experts = ShardedExperts.from_experts(moe.experts, specs, first)
        self.shared = PartialMLP(moe.shared, comm.size, comm.rank) if moe.shared is not None else None
        self.shared_gate = moe.shared_gate  # replicated
        self.router_logits = None
        self.routed = None

    def held_experts(self) -> range:
        """Global ids of the experts this rank computes (all of them, sliced, unless expert-parallel)."""
        return range(self.experts.first, self.experts.first + self.experts.num_local)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])  # (N, H)
        logits = self.gate(flat)  # (N, E), the same on every rank
        weights, idx = route(logits, self.top_k, self.normalize)  # (N, k) each
        self.router_logits, self.routed = logits, idx
        part = copy_to_region(flat, self.comm)  # identity fwd; bwd all-reduces the partial input grads
        weights = copy_to_region(weights, self.comm)
        y = self.experts(part, idx, weights)  # (N, H), a partial sum
        if self.shared is not None:
            s = self.shared(part)  # (N, H), a partial sum
            if self.shared_gate is not None:
                s = copy_to_region(torch.sigmoid(self.shared_gate(flat)), self.comm) * s  # linear in the partial
            y = y + s
        y = reduce_from_region(y, self.comm, inplace=True)  # the layer's one all-reduce
        return y.view(shape)

    def extra_repr(self) -> str:
        held = self.held_experts()
        mode = "expert-parallel" if self.expert_parallel else "tensor-parallel experts"
        return f"{mode}, experts {held.start}-{held.stop - 1} of {self.num_experts}, tp={self.comm.size}"
