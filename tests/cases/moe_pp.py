"""Rank functions of the mixture-of-experts x pipeline training tests
(tests/multiproc/test_train_moe_pp.py): train a few steps, report the loss parts, the
gradient norms, the unsharded weights and the last step's gradients (dp-averaged, tied
copies summed, clipped) of each stage, from the rank with tp, dp coordinates 0 of the stage."""

from __future__ import annotations

import torch

from cases.moe_train import _full_grads
from shardwise.train import TrainConfig, setup, train_step, unsharded_state


def _pool_like(tr, dp: int, m: int) -> None:
    """One process only: group each step's samples into the global micro-batches of a
    dp x m job (micro-batch j = every dp rank's j-th), so each micro-step's load-balancing
    loss pools the same tokens as there."""
    sampler = tr.sampler
    G = tr.cfg.data.global_batch_size
    mb = G // (dp * m)

    def micro_batches(step: int) -> list[list[int]]:
        idx = sampler.global_indices(step)
        return [[i for r in range(dp) for i in idx[(r * m + j) * mb : (r * m + j + 1) * mb]] for j in range(m)]

    sampler.micro_batches = micro_batches


def moe_pp_case(world, cfg: TrainConfig, pool: tuple[int, int] | None = None) -> dict:
    """cfg.run.steps steps; `pool` = (dp, m) of the job a one-process run stands for."""
    tr = setup(world, cfg)
    if pool is not None:
        _pool_like(tr, *pool)
    mesh = tr.mesh
    lead = mesh.tp.rank == 0 and mesh.dp.rank == 0
    grads: dict[str, torch.Tensor] = {}
    step = tr.optimizer.step

    def capture(*args, **kwargs):  # collective over tp and ep: every rank steps at once
        grads.clear()
        grads.update(_full_grads(tr))
        return step(*args, **kwargs)

    tr.optimizer.step = capture
    stats = [train_step(tr) for _ in range(cfg.run.steps)]
    state = unsharded_state(tr)
    return {
        "pp_rank": mesh.pp_rank,
        "losses": [s.loss for s in stats],
        "ce": [s.ce_loss for s in stats],
        "aux": [s.aux_loss for s in stats],
        "norms": [s.grad_norm for s in stats],
        "state": state if lead else None,
        "grads": grads if lead else None,
    }
