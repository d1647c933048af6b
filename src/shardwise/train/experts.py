"""Mixture-of-experts training: expert parallelism across dp ranks, and the router's
load-balancing loss.

    ep group    the ranks with the same tp (and pp) rank in a block of `ep` consecutive dp
                ranks: they hold different tokens and different experts, and exchange
                routed tokens (shardwise.layers.moe_ep.ExpertParallelMoE)
    edp group   the ranks holding the same experts: the same tp rank and the same ep rank
                in each of the dp / ep blocks (size 1 when ep = dp)

With world = 4, tp = 2, dp = 2, ep = 2: tp groups [0,1] [2,3]; dp groups [0,2] [1,3];
ep groups [0,2] [1,3] (every dp rank in one block); edp groups [0] [1] [2] [3].

Gradients: dense parameters (attention, norms, router, shared expert, embeddings) are
averaged over dp as usual. An expert's gradient on its owner already sums the contributions
of every token of its ep block (the all_to_all's backward brings them); it is summed over
the edp replicas and divided by dp, the same 1/dp as the dense ones, so both equal the
single-process gradient of the global batch's mean loss. The gradient norm counts each
expert once: the squares of the expert weights are summed over ep (shardwise.train.optim).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from shardwise.comm import Communicator, ParallelDims, copy_to_region, reduce_from_region
from shardwise.layers import ShardSpec
from shardwise.layers.moe_ep import ExpertParallelMoE, ep_expert_specs, expert_block_specs
from shardwise.models.config import ModelConfig
from shardwise.models.moe import load_balancing_loss, moe_blocks
from shardwise.train.fields import ConfigError
from shardwise.train.layout import full_state

__all__ = [
    "ep_groups",
    "check_moe_training",
    "ExpertLayout",
    "expert_layout",
    "router_aux_loss",
    "gather_experts",
    "unsharded_state",
]


def ep_groups(dims: ParallelDims, ep: int) -> tuple[list[list[int]], list[list[int]]]:
    """(ep groups, edp groups) of a tp x dp x pp job (see the module docstring)."""
    blocks = dims.dp // ep
    ep_g = [
        [dims.rank_of(tp=t, dp=b * ep + j, pp=s) for j in range(ep)]
        for s in range(dims.pp)
        for t in range(dims.tp)
        for b in range(blocks)
    ]
    edp_g = [
        [dims.rank_of(tp=t, dp=b * ep + j, pp=s) for b in range(blocks)]
        for s in range(dims.pp)
        for t in range(dims.tp)
        for j in range(ep)
    ]
    return ep_g, edp_g


def check_moe_training(model_cfg: ModelConfig, *, ep: int, dp: int, pp: int) -> None:
    """One-line ConfigError, before any collective, for what MoE training does not support."""
    if not model_cfg.num_experts:
        if ep > 1:
            raise ConfigError(
                f"parallel.ep={ep} needs a mixture-of-experts model; this {model_cfg.family} model has no experts "
                "(set model.num_experts, or ep = 1)"
            )
        return
    if ep > model_cfg.num_experts:
        raise ConfigError(
            f"parallel.ep={ep} exceeds num_experts={model_cfg.num_experts}: every ep rank needs at least one expert; "
            f"valid ep at dp={dp}: {', '.join(str(k) for k in range(1, model_cfg.num_experts + 1) if dp % k == 0)}"
        )


@dataclass
class ExpertLayout:
    """Where this rank's expert weights sit, and the groups that share them."""

    ep: Communicator
    edp: Communicator
    blocks: dict[str, list[ShardSpec]]
    """Expert parameter name -> its row block (dim 0, whole experts) on every ep rank."""

    @property
    def names(self) -> set[str]:
        return set(self.blocks)

    def block(self, name: str) -> ShardSpec:
        """This rank's row block of `name`."""
        return self.blocks[name][self.ep.rank]

    def tp_specs(self, model_cfg: ModelConfig, tp: int) -> dict[str, list[ShardSpec]]:
        """{expert parameter: [its ShardSpec within this rank's block, on tp rank 0, 1, ...]}."""
        E, H, I = model_cfg.num_experts, model_cfg.hidden_size, model_cfg.expert_size  # noqa: E741
        per_rank = [
            ep_expert_specs(E, H, I, ep=self.ep.size, ep_rank=self.ep.rank, tp=tp, tp_rank=r) for r in range(tp)
        ]
        return {name: [s[name.rsplit(".", 1)[1]] for s in per_rank] for name in self.blocks}


def expert_layout(model: nn.Module, ep: Communicator, edp: Communicator) -> ExpertLayout:
    """The ExpertLayout of a model whose MoE blocks are ExpertParallelMoE."""
    blocks = {}
    for prefix, module in model.named_modules():
        if isinstance(module, ExpertParallelMoE):
            ups = module.block_specs["up"]
            E, width = module.num_experts, ups.global_shape[0] // (2 * module.num_experts)
            H = ups.global_shape[1]
            per_rank = [expert_block_specs(E, H, width, ep.size, r) for r in range(ep.size)]
            for p in ("up", "down"):
                blocks[f"{prefix}.experts.{p}"] = [s[p] for s in per_rank]
    return ExpertLayout(ep=ep, edp=edp, blocks=blocks)


def gather_experts(block: torch.Tensor, per_rank: list[ShardSpec], ep: Communicator) -> torch.Tensor:
    """This ep rank's (unsharded over tp) row block -> the whole tensor, on every ep rank."""
    sizes = [s.pieces[0][1] for s in per_rank]
    return ep.all_gather(block, dim=0, sizes=sizes)


def _sum_over(dp: Communicator):
    """An all-reduce over dp whose backward all-reduces too: every rank's loss is the global
    one, so each rank's statistics get the gradient of all of them (then averaged over dp)."""
    return lambda t: reduce_from_region(copy_to_region(t, dp), dp)


def router_aux_loss(model: nn.Module, model_cfg: ModelConfig, dp: Communicator) -> torch.Tensor | None:
    """The load-balancing loss of the last forward's router logits, pooled over every MoE
    layer and every dp rank's micro-batch (None without MoE blocks)."""
    blocks = moe_blocks(model)
    if not blocks:
        return None
    logits = [b.router_logits for b in blocks]
    return load_balancing_loss(logits, model_cfg.num_experts, model_cfg.experts_per_token, sum_over=_sum_over(dp))


def unsharded_state(tr) -> dict[str, torch.Tensor]:
    """Every parameter of a Trainer's model, unsharded, on every rank of its tp (and ep)
    group (collective): full_state over tp, then each expert weight's blocks gathered over ep."""
    state = full_state(tr.model, tr.mesh.tp, tr.specs)
    if tr.experts is not None:
        for name in sorted(tr.experts.names):
            state[name] = gather_experts(state[name], tr.experts.blocks[name], tr.experts.ep)
    return state
