"""Rank functions of the mixture-of-experts training tests (tests/multiproc/test_train_moe.py):
train a few steps, then take the gradients of one more step, everything unsharded."""

from __future__ import annotations

import torch

from shardwise.models.moe import moe_blocks
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
        "moe_layers": len(moe_blocks(tr.model)),
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


def ep_layer_case(world, tp: int, num_experts: int, shared: bool) -> dict:
    """ExpertParallelMoE over tp x ep (ep = world / tp, each ep rank its own tokens) against
    one MoE run on every rank's tokens: the largest differences of the outputs, the input
    gradients, this rank's expert-weight gradients (its block's tp slice) and the router's
    gradient (summed over ep: each rank routes its own tokens)."""
    import copy

    from shardwise.comm import ParallelDims
    from shardwise.layers import ExpertParallelMoE
    from shardwise.models.config import ModelConfig
    from shardwise.models.moe import MoE
    from shardwise.train.experts import ep_groups

    dims = ParallelDims(world_size=world.size, tp=tp)
    mesh = dims.build(world)
    ep = world.split(ep_groups(dims, dims.dp)[0], name="ep")
    cfg = ModelConfig.debug(
        family="mixtral", num_experts=num_experts, experts_per_token=2, expert_size=12,
        shared_expert_size=8 if shared else 0, shared_expert_gate=shared,
    )  # fmt: skip
    g = torch.Generator().manual_seed(0)
    moe = MoE(cfg)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    xs = [torch.randn(2, 3 + r, cfg.hidden_size, generator=g) for r in range(ep.size)]  # (B, T_r, H) per ep rank
    ws = [torch.randn(x.shape, generator=g) for x in xs]  # a loss weight per output element
    par = ExpertParallelMoE(copy.deepcopy(moe), tp=mesh.tp, ep=ep)
    ref_x = [x.clone().requires_grad_() for x in xs]
    ref_y = [moe(x) for x in ref_x]
    sum((y * w).sum() for y, w in zip(ref_y, ws, strict=True)).backward()

    r = ep.rank
    x = xs[r].clone().requires_grad_()
    y = par(x)
    (y * ws[r]).sum().backward()

    def local(name: str) -> torch.Tensor:
        full = getattr(moe.experts, name).grad
        return par.experts.specs[name].take(par.block_specs[name].take(full))

    router = ep.all_reduce(par.gate.weight.grad.clone())
    return {
        "y": (y - ref_y[r]).abs().max().item(),
        "x_grad": (x.grad - ref_x[r].grad).abs().max().item(),
        "up_grad": (par.experts.up.grad - local("up")).abs().max().item(),
        "down_grad": (par.experts.down.grad - local("down")).abs().max().item(),
        "router_grad": (router - moe.gate.weight.grad).abs().max().item(),
        "scale": max(p.grad.abs().max().item() for p in moe.parameters()),
        "held": [par.experts.first, par.experts.num_local],
    }
