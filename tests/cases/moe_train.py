"""Rank functions of the mixture-of-experts training tests (tests/multiproc/test_train_moe.py):
train a few steps, then take the gradients of one more step, everything unsharded."""

from __future__ import annotations

import torch

from shardwise.train import TrainConfig, setup, train_step, unsharded_state
from shardwise.train.step import _micro_steps


def _full_grads(tr) -> dict[str, torch.Tensor]:
    """Every gradient, unsharded (unsharded_state over the gradients in place of the weights)."""
    params = dict(tr.model.named_parameters())
    weights = {n: p.detach().clone() for n, p in params.items()}
    with torch.no_grad():
        for p in params.values():
            p.copy_(p.grad if p.grad is not None else torch.zeros_like(p))
        grads = unsharded_state(tr)
        for n, p in params.items():
            p.copy_(weights[n])
    return grads


def moe_train_case(world, cfg: TrainConfig) -> dict:
    """cfg.run.steps steps (loss parts, grad norm per step), the weights after them, and the
    gradients of the next step's global batch (dp-averaged, before clipping), on rank 0; the
    all_to_all calls of that step's forward and backward."""
    tr = setup(world, cfg)
    steps = [train_step(tr) for _ in range(cfg.run.steps)]
    state = unsharded_state(tr)
    world.stats.reset()
    _micro_steps(tr, tr.sampler.micro_batches(tr.step))
    calls = {g: world.stats.calls("all_to_all", g) for g in ("ep", "tp", "dp", "edp")}
    tr.sync.finish()
    grads = _full_grads(tr)
    return {
        "losses": [s.loss for s in steps],
        "ce": [s.ce_loss for s in steps],
        "aux": [s.aux_loss for s in steps],
        "norms": [s.grad_norm for s in steps],
        "state": state if world.rank == 0 else None,
        "grads": grads if world.rank == 0 else None,
        "grad_norm": float(tr.grad_norm.norm()),
        "all_to_all": calls,
        "sync": type(tr.sync).__name__,
    }


def moe_resume_case(world, cfg: TrainConfig, root: str) -> dict:
    """Train to cfg.run.steps (resuming from run.resume when set), save under `root`; the
    losses of the steps run here, the weights at the end (rank 0) and the checkpoint."""
    from shardwise.checkpoint import Checkpointer

    ckpt = Checkpointer(root)
    tr = setup(world, cfg, checkpointer=ckpt)
    losses = [train_step(tr).loss for _ in range(tr.step, cfg.run.steps)]
    path = ckpt.save(tr)
    state = unsharded_state(tr)
    return {"losses": losses, "state": state if world.rank == 0 else None, "checkpoint": str(path)}
