"""Rank functions of the pipeline training tests, fn(world, ...): train a config for a few
steps and report what the test compares with the single-process run. The gloo tests
(through the rank pool) and the MPI test run the same functions; the single-process
reference runs `train_case` on a LocalCommunicator.

Each rank reports its losses and gradient norms (every rank), and, on the rank with
tp and dp coordinates 0 of each stage, that stage's parameters and first-step gradients
unsharded over tp (the test merges the stages). Every rank also checks in-job what only
the job can see: its tied embedding's copy is bitwise the other stage's, and its dp
replicas hold bitwise the same weights.
"""

from __future__ import annotations

import torch

from shardwise.train import TrainConfig, full_state, setup, train_step

__all__ = ["train_case", "train_many"]


class _Grads:
    """A model's gradients where full_state expects its parameters."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def named_parameters(self):
        return ((n, p.grad) for n, p in self.model.named_parameters())


def train_case(world, cfg: TrainConfig) -> dict:
    """Train cfg.run.steps steps; see the module docstring for what comes back."""
    tr = setup(world, cfg)
    mesh = tr.mesh
    lead = mesh.tp.rank == 0 and mesh.dp.rank == 0
    grads: dict[str, torch.Tensor] = {}
    step = tr.optimizer.step

    def capture(*args, **kwargs):  # the first step's gradients: dp-averaged, tied copies summed, clipped
        if not grads:
            grads.update(full_state(_Grads(tr.model), mesh.tp, tr.specs))
        return step(*args, **kwargs)

    tr.optimizer.step = capture
    sends = world.stats.calls("send", "pp")
    stats = [train_step(tr) for _ in range(cfg.run.steps)]
    sends = world.stats.calls("send", "pp") - sends
    state = full_state(tr.model, mesh.tp, tr.specs)
    out = {
        "backend": world.backend,
        "pp_rank": mesh.pp_rank,
        "sends": sends,
        "losses": [s.loss for s in stats],
        "norms": [s.grad_norm for s in stats],
        "layers": tr.model.layer_indices(),
        "bytes": sum(p.numel() * p.element_size() for p in tr.model.parameters()),
        "grads": grads if lead else None,
        "state": state if lead else None,
        "tied_equal": None,
        "replicas_equal": None,
    }
    if tr.model_cfg.tie_embeddings and mesh.embed is not None and mesh.embed.size > 1:  # first or last stage
        mine = tr.model.embed.weight.detach()  # this tp rank's rows; the other stage holds the same rows
        both = mesh.embed.all_gather(mine.unsqueeze(0), dim=0)
        out["tied_equal"] = all(torch.equal(both[0], c) for c in both)
    if mesh.dp.size > 1:
        flat = torch.cat([p.detach().reshape(-1) for p in tr.model.parameters()]).unsqueeze(0)
        every = mesh.dp.all_gather(flat, dim=0)
        out["replicas_equal"] = all(torch.equal(every[0], c) for c in every)
    return out


def train_many(world, cfgs: list[TrainConfig]) -> list[dict]:
    """train_case for each config in turn (each sets up its own mesh and model)."""
    return [train_case(world, cfg) for cfg in cfgs]
