"""Expert parallelism across data-parallel ranks (training): a mixture-of-experts block whose
routed experts are dealt out over an `ep` group of ranks holding different tokens, each
expert's width split over the tp group like tensor-parallel experts.

    ranks        tp group (same tokens, same experts, different widths) x ep group (same
                 tp rank, different tokens, different experts)
    experts      ep rank j holds the whole experts [first_j, end_j) (expert_ranges(E, ep)),
                 and of each of those the width slice of its tp rank: a "block" of
                 n_j = end_j - first_j experts, cut like tensor-parallel experts
    forward      logits = gate(x)                    replicated router, (N, E)
                 y = dispatch_experts(x, ...)        all_to_all over ep, the local experts'
                                                     width slice: a partial sum over tp
                 y += shared(x)                      the shared expert's tp slice, partial
                 y = all-reduce over tp              the layer's ONE tp collective

The gradients: the input's, the routing weights' and the shared gate's are partial over tp
and completed by copy_to_region (as in ParallelMoE); an expert's weights get every ep rank's
tokens' gradient through the all_to_all's backward, and are averaged by the trainer only
over the dp replicas holding the same experts (shardwise.train.experts).

A weight's place in the unsharded tensor is two cuts: a row block by ep (`block_spec`, whole
experts: dim 0 of both `up` (E*2I, H) and `down` (E*H, I)), then the tp slice within the block
(`specs`, the tensor-parallel experts' ShardSpecs of an n_j-expert model).
"""

from __future__ import annotations

import torch
from torch import nn

from shardwise.comm import Communicator, copy_to_region, reduce_from_region
from shardwise.layers.dispatch import dispatch_experts
from shardwise.layers.moe import ParallelMoE, PartialMLP, ShardedExperts, expert_ranges, expert_specs
from shardwise.layers.spec import ShardSpec
from shardwise.models.moe import MoE, route

__all__ = ["ExpertParallelMoE", "expert_block_specs", "ep_expert_specs"]


def expert_block_specs(num_experts: int, hidden: int, width: int, ep: int, ep_rank: int) -> dict[str, ShardSpec]:
    """The row blocks of `up` (E*2I, H) and `down` (E*H, I) holding ep rank `ep_rank`'s whole experts."""
    E, H, I = num_experts, hidden, width  # noqa: E741
    first, end = expert_ranges(E, ep)[ep_rank]
    n = end - first
    return {
        "up": ShardSpec((E * 2 * I, H), 0, ((first * 2 * I, n * 2 * I),)),
        "down": ShardSpec((E * H, I), 0, ((first * H, n * H),)),
    }


def ep_expert_specs(
    num_experts: int, hidden: int, width: int, *, ep: int, ep_rank: int, tp: int, tp_rank: int
) -> dict[str, ShardSpec]:
    """The tp slice within ep rank ep_rank's block: the ShardSpecs (global shape = the block's)
    of tensor-parallel experts over a model of the block's n experts."""
    first, end = expert_ranges(num_experts, ep)[ep_rank]
    return expert_specs(end - first, hidden, width, tp, tp_rank, expert_parallel=False)


def _cut2(param: torch.Tensor, block: ShardSpec, spec: ShardSpec) -> nn.Parameter:
    """The ep row block of a full parameter, then the tp slice of that block (meta stays meta)."""
    if param.is_meta:
        return nn.Parameter(torch.empty(spec.local_shape, device="meta", dtype=param.dtype))
    return nn.Parameter(spec.take(block.take(param.detach())))


class ExpertParallelMoE(MoE):
    """An MoE block over a tp group and an ep group (see the module docstring).
    (B, T, H) -> (B, T, H); per layer: 4 all_to_alls over ep and one all-reduce over tp forward."""

    def __init__(self, moe: MoE, *, tp: Communicator, ep: Communicator) -> None:
        nn.Module.__init__(self)
        hidden, width = moe.gate.in_features, moe.experts.up.shape[0] // (2 * moe.num_experts)
        blocks = expert_block_specs(moe.num_experts, hidden, width, ep.size, ep.rank)
        specs = ep_expert_specs(
            moe.num_experts, hidden, width, ep=ep.size, ep_rank=ep.rank, tp=tp.size, tp_rank=tp.rank
        )
        up = _cut2(moe.experts.up, blocks["up"], specs["up"])  # (n * 2 * I_local, H)
        down = _cut2(moe.experts.down, blocks["down"], specs["down"])  # (n * H, I_local)
        shared = PartialMLP(moe.shared, tp.size, tp.rank) if moe.shared is not None else None
        self._place(moe, tp, ep, blocks, specs, up, down, shared)

    @classmethod
    def from_tensor_parallel(cls, moe: ParallelMoE, *, ep: Communicator) -> ExpertParallelMoE:
        """The same block with its tensor-parallel experts (every expert's tp slice, as a
        Hugging Face checkpoint loads) cut down to this ep rank's experts: their local rows
        are already the block's tp slice, in order (the shared expert is kept as it is)."""
        if moe.expert_parallel:
            raise ValueError("from_tensor_parallel needs tensor-parallel experts, not expert parallelism over tp")
        tp, E = moe.comm, moe.num_experts
        hidden, width = moe.gate.in_features, moe.experts.specs["down"].global_shape[1]
        blocks = expert_block_specs(E, hidden, width, ep.size, ep.rank)
        specs = ep_expert_specs(E, hidden, width, ep=ep.size, ep_rank=ep.rank, tp=tp.size, tp_rank=tp.rank)
        first, end = expert_ranges(E, ep.size)[ep.rank]
        up_rows, down_rows = moe.experts.up.shape[0] // E, hidden  # local rows per expert
        up = nn.Parameter(moe.experts.up.detach()[first * up_rows : end * up_rows].clone())
        down = nn.Parameter(moe.experts.down.detach()[first * down_rows : end * down_rows].clone())
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new._place(moe, tp, ep, blocks, specs, up, down, moe.shared)
        return new

    def _place(
        self,
        moe: MoE,
        tp: Communicator,
        ep: Communicator,
        blocks: dict[str, ShardSpec],
        specs: dict[str, ShardSpec],
        up: nn.Parameter,
        down: nn.Parameter,
        shared: nn.Module | None,
    ) -> None:
        """Set every attribute: the router and shared gate from `moe`, this rank's experts."""
        self.comm, self.ep = tp, ep
        self.top_k, self.normalize, self.num_experts = moe.top_k, moe.normalize, moe.num_experts
        self.gate = moe.gate  # replicated router
        self.owners = expert_ranges(moe.num_experts, ep.size)
        experts = ShardedExperts.__new__(ShardedExperts)
        nn.Module.__init__(experts)
        experts.act, experts.first, experts.specs = moe.experts.act, self.owners[ep.rank][0], specs
        experts.up, experts.down = up, down
        self.experts, self.block_specs = experts, blocks
        self.shared = shared
        self.shared_gate = moe.shared_gate  # replicated
        self.router_logits = None
        self.routed = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])  # (N, H), the same on every tp rank
        logits = self.gate(flat)  # (N, E)
        weights, idx = route(logits, self.top_k, self.normalize)  # (N, k) each
        self.router_logits, self.routed = logits, idx
        part = copy_to_region(flat, self.comm)  # identity fwd; bwd all-reduces the partial input grads
        weights = copy_to_region(weights, self.comm)
        y = dispatch_experts(part, idx, weights, self.experts, self.ep, self.owners)  # (N, H), partial over tp
        if self.shared is not None:
            s = self.shared(part)  # (N, H), a partial sum
            if self.shared_gate is not None:
                s = copy_to_region(torch.sigmoid(self.shared_gate(flat)), self.comm) * s  # linear in the partial
            y = y + s
        y = reduce_from_region(y, self.comm, inplace=True)  # the layer's one tp all-reduce
        return y.view(shape)

    def extra_repr(self) -> str:
        first, end = self.owners[self.ep.rank]
        return f"experts {first}-{end - 1} of {self.num_experts} (ep={self.ep.size}), widths split over tp={self.comm.size}"
