"""Rank functions of the distributed-optimizer tests (tests/multiproc/test_train_distopt.py):
several layouts per launched job, each trained with the plain and the distributed optimizer."""

from __future__ import annotations

import torch

from shardwise.train import TrainConfig, setup, train_step, unsharded_state


def train_case(world, cfg: TrainConfig) -> dict:
    """cfg.run.steps steps: losses, gradient norms, the unsharded weights this rank's stage holds
    (tp rank 0 of dp replica 0, else None), the bytes of optimizer state held here."""
    tr = setup(world, cfg)
    steps = [train_step(tr) for _ in range(cfg.run.steps)]
    state = unsharded_state(tr)
    opt = tr.optimizer
    held = (
        opt.state_bytes()
        if hasattr(opt, "state_bytes")
        else {
            "moments": sum(
                t.numel() * t.element_size() for s in opt.state.values() for k, t in s.items() if k != "step"
            )
        }
    )
    lead = tr.mesh.tp.rank == 0 and tr.mesh.dp.rank == 0
    return {
        "losses": [s.loss for s in steps],
        "norms": [s.grad_norm for s in steps],
        "state": state if lead else None,
        "held": held,
        "dtypes": sorted({str(p.dtype) for p in tr.model.parameters()}),
    }


def layouts_case(world, cfgs: list[TrainConfig]) -> list[dict]:
    """train_case for each config in turn (one job for many cases)."""
    return [train_case(world, cfg) for cfg in cfgs]


def resume_case(world, cfg: TrainConfig, root: str) -> dict:
    """Train to cfg.run.steps (resuming from run.resume when set), save under `root`: the
    losses of the steps run here and the weights at the end (as train_case)."""
    from shardwise.checkpoint import Checkpointer

    ckpt = Checkpointer(root)
    tr = setup(world, cfg, checkpointer=ckpt)
    losses = [train_step(tr).loss for _ in range(tr.step, cfg.run.steps)]
    path = ckpt.save(tr)
    state = unsharded_state(tr)
    lead = tr.mesh.tp.rank == 0 and tr.mesh.dp.rank == 0
    return {"losses": losses, "state": state if lead else None, "checkpoint": str(path)}


def resumes_case(world, runs: list[tuple[TrainConfig, str]]) -> list[dict]:
    return [resume_case(world, cfg, root) for cfg, root in runs]


def merged_state(results: list[dict]) -> dict[str, torch.Tensor]:
    """Every stage's weights from a job's per-rank results."""
    out: dict[str, torch.Tensor] = {}
    for r in results:
        out |= r["state"] or {}
    return out


def memory_case(world, cfg: TrainConfig) -> dict:
    """One step, then the next step's backward: the training state this rank holds at that
    point (weights, whole gradients, optimizer state; held_bytes), and again after the dp
    reduction (the reduced fp32 slice instead of the whole gradients); the larger of the two
    against bytes_per_param."""
    from shardwise.train.distopt import bytes_per_param, held_bytes
    from shardwise.train.step import _micro_steps, _pipeline_micro_steps

    tr = setup(world, cfg)
    train_step(tr)
    micro = tr.sampler.micro_batches(tr.step)
    (_pipeline_micro_steps if tr.pipeline is not None else _micro_steps)(tr, micro)
    backward = held_bytes(tr.model, tr.optimizer)
    if tr.sync is not None:
        tr.sync.finish()  # the dp reduction (plain AdamW: an all-reduce in place)
    reduced = held_bytes(tr.model, tr.optimizer)
    n = sum(p.numel() for p in tr.model.parameters())
    formula = bytes_per_param(cfg.run.dtype, cfg.optim.distributed, tr.mesh.dp.size)
    return {
        "held": max(backward, reduced, key=lambda h: sum(h.values())),
        "phases": {"backward": backward, "reduced": reduced},
        "params": n,
        "formula": formula,
        "dtypes": sorted({str(p.dtype) for p in tr.model.parameters()}),
        # fp32 weights stepped in place: every parameter a view of one flat buffer
        "weights_are_views": len({p.untyped_storage().data_ptr() for p in tr.model.parameters()}) == 1,
    }
