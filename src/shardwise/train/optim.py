"""AdamW, its learning-rate schedule, and gradient clipping by the global norm across tp shards.

The global norm is that of the unsharded gradient:

    ||g||^2 = sum over pp stages and tp ranks of (sum of squares of the rows this rank owns)

A row held by several ranks (a replicated norm weight, or a KV head replicated when
tp > num_kv_heads) is counted once, by its owner (see shardwise.train.layout). The dp
replicas hold identical, already averaged gradients, so an all-reduce over tp and one
over pp suffice (a tied embedding's copy on the last stage is not counted), and every rank of the job gets the same norm and the same clipping factor.

Under expert parallelism (ep > 1) the ranks of an ep group hold different experts: their
experts' squares are summed over ep (each expert counted once) before the tp sum.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from shardwise.comm import Communicator
from shardwise.layers import ShardSpec
from shardwise.train.config import OptimSection
from shardwise.train.layout import owned_mask

__all__ = ["build_optimizer", "lr_at", "GradNorm"]


def build_optimizer(model: nn.Module, cfg: OptimSection) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices and embeddings (dim >= 2) only."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=fused_ok(params))


def fused_ok(params: list[torch.Tensor]) -> bool:
    """Whether torch's fused AdamW takes these parameters (floats on the CPU or CUDA): one pass
    over each tensor instead of a pass per operation. On one core of an AMD EPYC (Zen 4) it
    steps 100M fp32 parameters at 0.67 ns each against 5.55 for the per-operation loop torch
    picks by default on CPU (benchmarks/bench_adamw.py, docs/benchmarks/adamw.json)."""
    floats = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
    return bool(params) and all(p.device.type in ("cpu", "cuda") and p.dtype in floats for p in params)


def lr_at(step: int, cfg: OptimSection, total_steps: int) -> float:
    """Learning rate of optimizer step `step` (0-based): linear warmup, then cosine or constant."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return cfg.lr
    span = max(total_steps - cfg.warmup_steps, 1)
    progress = min((step - cfg.warmup_steps) / span, 1.0)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * progress))


_CHUNK = 1 << 20
"""Elements squared in fp64 at a time: a gradient's whole fp64 square (4 GB on a 1B model's
rank) was two fresh tensors of twice its size each step, 4 s of a 14 s step there."""


def sum_of_squares(g: torch.Tensor, mask: torch.Tensor | None = None, dim: int = 0) -> torch.Tensor:
    """sum(g ** 2) in fp64 over the entries whose index along `dim` the bool `mask` keeps
    (all where mask is None; the rest count 0, whatever they hold), a chunk of dim-0 rows at a
    time: no gradient-sized fp64 temporaries. GradNorm's rows or columns of a tp shard, and the
    distributed optimizer's flat slices (1-D, a mask per element)."""
    if g.dim() == 0:
        keep = mask is None or bool(mask.any())
        return g.double().square() if keep else torch.zeros((), dtype=torch.float64, device=g.device)
    if mask is not None and dim != 0:  # columns kept: the same rows, a column mask broadcast
        shape = [1] * g.dim()
        shape[dim] = -1
        drop_cols = ~mask.view(shape)
    total = torch.zeros((), dtype=torch.float64, device=g.device)
    rows = max(1, _CHUNK // max(1, g[0].numel()))
    for r in range(0, g.shape[0], rows):
        sq = g[r : r + rows].double().square_()
        if mask is not None:
            sq.masked_fill_(~mask[r : r + rows].view([-1] + [1] * (g.dim() - 1)) if dim == 0 else drop_cols, 0.0)
        total += sq.sum()
    return total


class GradNorm:
    """The global gradient norm of a tp-sharded model, and clipping by it."""

    def __init__(
        self,
        model: nn.Module,
        specs: dict[str, list[ShardSpec]],
        tp: Communicator,
        *,
        pp: Communicator | None = None,
        skip: set[str] | frozenset[str] = frozenset(),
        ep: Communicator | None = None,
        experts: set[str] | frozenset[str] = frozenset(),
    ) -> None:
        """specs: the parameters this rank holds. pp: the pipeline group whose stages' sums
        add up (None = one stage). skip: parameters held here as a copy another stage owns
        (a tied embedding on the last stage): clipped, not counted. ep, experts: the
        expert-parallel group and the parameters whose squares are summed over it."""
        self.tp, self.pp, self.ep = tp, pp, ep
        params = dict(model.named_parameters())
        # (param, None | bool mask over rows of the split dim, split dim, counted, an ep-sharded expert)
        self.items: list[tuple[nn.Parameter, torch.Tensor | None, int, bool, bool]] = []
        for name, per_rank in specs.items():
            spec = per_rank[tp.rank]
            mask = owned_mask(per_rank, tp.rank)
            self.items.append((params[name], mask, spec.dim or 0, name not in skip, name in experts))

    def norm(self) -> torch.Tensor:
        """The unsharded gradient's L2 norm, as a 0-d fp32 tensor (collective over tp)."""
        dense = torch.zeros((), dtype=torch.float64)
        expert = torch.zeros((), dtype=torch.float64)
        for p, mask, dim, counted, is_expert in self.items:
            if p.grad is None or not counted:
                continue
            sq = sum_of_squares(p.grad.detach(), mask, dim)
            if is_expert:
                expert += sq
            else:
                dense += sq
        if self.ep is not None:
            expert = self.ep.all_reduce(expert.view(1))[0]  # each ep rank's own experts
        total = self.tp.all_reduce((dense + expert).view(1))
        if self.pp is not None:
            total = self.pp.all_reduce(total)  # every stage's layers (tied copies counted once)
        return total.sqrt().float()[0]

    def clip_(self, max_norm: float | None) -> float:
        """Scale every gradient by min(1, max_norm / (norm + 1e-6)), as torch.nn.utils.clip_grad_norm_
        does; return the norm before clipping."""
        norm = self.norm()
        if max_norm is not None:
            coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
            for p, *_ in self.items:
                if p.grad is not None:
                    p.grad.detach().mul_(coef.to(p.grad.dtype))
        return float(norm)
