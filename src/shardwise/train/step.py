"""One optimizer step on one rank: micro-batches, vocab-parallel loss, dp averaging,
global-norm clipping, AdamW.

    loss = mean over the step's G * L target tokens of  -log p(target)

Each micro-batch contributes its own token mean / grad_accum, and dp averages the
ranks' gradients; every micro-batch has the same number of tokens, so this is exactly
the mean over the global batch, whatever the layout.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import nn

from shardwise.comm import Mesh
from shardwise.layers import ShardSpec, vocab_parallel_cross_entropy
from shardwise.models.config import ModelConfig
from shardwise.train.config import TrainConfig
from shardwise.train.data import DPSampler, TokenFile
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


def train_step(tr: Trainer) -> StepStats:
    cfg, tp, dp = tr.cfg, tr.mesh.tp, tr.mesh.dp
    start = time.perf_counter()
    lr = lr_at(tr.step, cfg.optim, cfg.optim.decay_steps or cfg.run.steps)
    for group in tr.optimizer.param_groups:
        group["lr"] = lr
    micro = tr.sampler.micro_batches(tr.step)
    total = torch.zeros(())
    for m, indices in enumerate(micro):
        x, y = tr.data.batch(indices)  # (B, L) inputs and targets
        with tr.sync.micro_step(last=m == len(micro) - 1):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.run.bf16):
                logits = tr.sync.module(x)  # (B, L, V_pad / tp), this rank's vocabulary columns
            loss = vocab_parallel_cross_entropy(logits, y, comm=tp).mean() / len(micro)
            loss.backward()
        total += loss.detach()
    tr.sync.finish()
    mean_loss = dp.all_reduce(total.view(1))[0] / dp.size
    norm = tr.grad_norm.clip_(cfg.optim.grad_clip)
    tr.optimizer.step()
    tr.optimizer.zero_grad(set_to_none=True)
    tr.step += 1
    stats = StepStats(
        step=tr.step,
        loss=float(mean_loss),
        grad_norm=norm,
        lr=lr,
        tokens=cfg.data.global_batch_size * cfg.data.seq_len,
        seconds=time.perf_counter() - start,
    )
    tr.history.append((tr.step, stats.loss))
    return stats
