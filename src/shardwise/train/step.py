"""One optimizer step on one rank: micro-batches, vocab-parallel loss, dp averaging,
global-norm clipping, AdamW.

    loss = mean over the step's G * L target tokens of  -log p(target)

Each micro-batch contributes its own token mean / grad_accum, and dp averages the
ranks' gradients; every micro-batch has the same number of tokens, so this is exactly
the mean over the global batch, whatever the layout.

A mixture-of-experts model with router_aux_loss_coef > 0 adds coef * the load-balancing
loss of each micro-step (its statistics pooled over every dp rank's micro-batch: the
global micro-batch's, whatever the dp size) / grad_accum. At pp > 1 the statistics of the
stages' layers are pooled too (pipeline/runtime.py: the totals travel with the transfers).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import nn

from shardwise.comm import Mesh
from shardwise.kernels import wgrad
from shardwise.layers import ShardSpec, vocab_parallel_cross_entropy
from shardwise.models.config import ModelConfig
from shardwise.pipeline.runtime import PipelineRunner
from shardwise.pipeline.stage import StageLayout
from shardwise.sharding import sum_partial_grads
from shardwise.train.config import TrainConfig
from shardwise.train.data import DPSampler, TokenFile
from shardwise.train.distopt import DistributedOptimizer, autocast
from shardwise.train.experts import ExpertLayout, router_aux_loss
from shardwise.train.optim import GradNorm, lr_at
from shardwise.train.rng import RNGTracker
from shardwise.train.sync import GradSync

__all__ = ["Trainer", "StepStats", "train_step"]


@dataclass
class StepStats:
    step: int
    """The optimizer step just taken (1-based: the model has now taken `step` steps)."""
    loss: float
    """Mean loss over the global batch (identical on every rank)."""
    grad_norm: float
    """Global gradient norm before clipping."""
    lr: float
    tokens: int
    """Target tokens in the global batch."""
    seconds: float
    ce_loss: float | None = None
    """The cross-entropy part of `loss`, when an auxiliary loss is added (else None: loss is all of it)."""
    aux_loss: float | None = None
    """The router's load-balancing loss (mean over the micro-steps, before its coefficient), or None."""


@dataclass
class Trainer:
    """Everything one rank holds while training."""

    cfg: TrainConfig
    mesh: Mesh
    model_cfg: ModelConfig
    model: nn.Module
    """This rank's shard of the model (not the DDP wrapper)."""
    specs: dict[str, list[ShardSpec]]
    """Every parameter's ShardSpec on every tp rank."""
    optimizer: torch.optim.Optimizer
    sync: GradSync
    grad_norm: GradNorm
    data: TokenFile
    sampler: DPSampler
    rng: RNGTracker
    step: int = 0
    """Optimizer steps taken so far."""
    history: list[tuple[int, float]] = field(default_factory=list)
    """(step, loss) of every step taken, including those before a resume."""
    extra: dict = field(default_factory=dict)
    """Free-form run information carried in checkpoints (e.g. the tokenizer path)."""
    layout: StageLayout | None = None
    """Layers per pipeline stage (pp = 1: one stage holding every layer)."""
    pipeline: PipelineRunner | None = None
    """Runs this rank's schedule at pp > 1; None at pp = 1."""
    copies: set[str] = field(default_factory=set)
    """Parameters this rank holds as a copy owned by another stage (a tied embedding on the
    last stage): not counted in the gradient norm, not written in checkpoints."""
    partial_grads: list[str] = field(default_factory=list)
    """Parameters used on this tp rank's sequence shard only (sequence parallelism: the
    norms), whose gradients are summed over tp after backward."""
    experts: ExpertLayout | None = None
    """Expert parallelism (ep > 1): the ep groups and where this rank's experts sit."""


def train_step(tr: Trainer) -> StepStats:
    cfg, dp = tr.cfg, tr.mesh.dp
    start = time.perf_counter()
    lr = lr_at(tr.step, cfg.optim, cfg.optim.decay_steps or cfg.run.steps)
    for group in tr.optimizer.param_groups:
        group["lr"] = lr
    micro = tr.sampler.micro_batches(tr.step)  # m lists of sample indices
    aux = torch.zeros(())
    if tr.pipeline is not None:
        total, aux = _pipeline_micro_steps(tr, micro)
    else:
        total, aux = _micro_steps(tr, micro)
    if isinstance(tr.sync, DistributedOptimizer):  # it frees p.grad: the tp sums go first
        sum_partial_grads(tr.model, tr.partial_grads, comm=tr.mesh.tp)
        tr.sync.finish()
    else:
        tr.sync.finish()
        sum_partial_grads(tr.model, tr.partial_grads, comm=tr.mesh.tp)  # sequence parallelism's norms
    mean_loss = dp.all_reduce(total.view(1))[0] / dp.size  # the cross-entropy
    coef = tr.model_cfg.router_aux_loss_coef if tr.model_cfg.num_experts else 0.0
    norm = tr.grad_norm.clip_(cfg.optim.grad_clip)
    tr.optimizer.step()
    wgrad.release(tr.model.parameters())  # .grad None, as zero_grad; the fused path's buffers kept for the next step
    tr.optimizer.zero_grad(set_to_none=True)
    tr.step += 1
    stats = StepStats(
        step=tr.step,
        loss=float(mean_loss) + coef * float(aux),
        grad_norm=norm,
        lr=lr,
        tokens=cfg.data.global_batch_size * cfg.data.seq_len,
        seconds=time.perf_counter() - start,
        ce_loss=float(mean_loss) if coef else None,
        aux_loss=float(aux) if coef else None,
    )
    tr.history.append((tr.step, stats.loss))
    return stats


def _micro_steps(tr: Trainer, micro: list) -> tuple[torch.Tensor, torch.Tensor]:
    """pp = 1: forward and backward of each micro-batch through the dp wrapper (DDP syncs
    during the last one's backward); the sum of their scaled cross-entropies, and the mean
    of their load-balancing losses (0 when off)."""
    cfg, tp = tr.cfg, tr.mesh.tp
    coef = tr.model_cfg.router_aux_loss_coef if tr.model_cfg.num_experts else 0.0
    total, aux_total = torch.zeros(()), torch.zeros(())
    for m, indices in enumerate(micro):
        x, y = tr.data.batch(indices)  # (B, L) inputs and targets
        with tr.sync.micro_step(last=m == len(micro) - 1):
            with autocast(tr.model, cfg.run):
                logits = tr.sync.module(x)  # (B, L, V_pad / tp), this rank's vocabulary columns
            loss = vocab_parallel_cross_entropy(logits, y, comm=tp).mean() / len(micro)
            objective = loss
            if coef:
                aux = router_aux_loss(tr.model, tr.model_cfg, tr.mesh.dp)  # the same on every rank
                objective = loss + coef * aux / len(micro)
                aux_total += aux.detach() / len(micro)
            objective.backward()
        total += loss.detach()
    return total, aux_total


def _pipeline_micro_steps(tr: Trainer, micro: list) -> tuple[torch.Tensor, torch.Tensor]:
    """The schedule's forwards and backwards over the step's micro-batches; the tied
    embedding's two copies summed; the loss (summed on the last stage) and the mean
    load-balancing loss (0 when off; pipeline/runtime.py) sent to every stage."""
    tp, m = tr.mesh.tp, len(micro)
    batches = [tr.data.batch(indices) for indices in micro]  # [(B, L) inputs, (B, L) targets] * m

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(logits, targets, comm=tp).mean() / m  # as at pp = 1

    total = tr.pipeline.run(batches, loss_fn)
    embed = tr.mesh.embed
    if tr.model_cfg.tie_embeddings and embed is not None and embed.size > 1:
        weight = tr.model.embed.weight
        if weight.grad is None:
            weight.grad = torch.zeros_like(weight)
        embed.all_reduce_(weight.grad)  # first stage's (lookup) + last stage's (head) gradient
    both = tr.mesh.pp.all_reduce(torch.stack([total, tr.pipeline.aux_sum.float()]))  # non-zero on the last stage only
    return both[0], both[1]
