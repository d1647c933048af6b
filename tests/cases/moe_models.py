"""Rank functions of the mixture-of-experts tests, fn(world, ...): checkpoints loaded sharded in
both expert placements, and one MoE block against its unsharded twin (outputs and gradients)."""

from __future__ import annotations

import copy

import torch

from helpers import assert_close, tp_group
from hf_models import greedy, prompts
from shardwise.layers import model_shard_specs
from shardwise.models.config import ModelConfig
from shardwise.models.moe import MoE
from shardwise.sharding.styles import MixtureOfExperts

__all__ = ["checkpoint_case", "block_case"]


def checkpoint_case(world, path: str, vocab: int, expert_parallel: bool) -> dict:
    """Logits and 16 greedy tokens of a checkpoint loaded over the whole world, the experts each
    rank holds, and the all-reduces each layer's MLP (dense or MoE) costs in one forward."""
    from shardwise.hf import load_pretrained

    tp = tp_group(world)
    model, _ = load_pretrained(path, comm=tp, expert_parallel=expert_parallel)
    ids, mask = prompts(vocab)

    def fwd(i, m, pos):
        return model(i, attention_mask=m, positions=pos)

    with torch.no_grad():
        logits = fwd(ids, mask, (mask.cumsum(-1) - 1).clamp(min=0))
        tokens = greedy(fwd, ids, mask)
        x = torch.randn(2, 5, model.cfg.hidden_size)
        reduces, held = {}, {}
        for i, layer in enumerate(model.layers):
            before = world.stats.copy()
            layer.mlp(x)
            reduces[i] = (type(layer.mlp).__name__, (world.stats - before).calls("all_reduce", "tp"))
            if hasattr(layer.mlp, "held_experts"):
                held[i] = list(layer.mlp.held_experts())
    return {"logits": logits, "tokens": tokens, "reduces": reduces, "held": held}


def block_case(world, expert_parallel: bool, shared: bool) -> None:
    """One MoE block (batch 3) sharded against its twin: output, input gradient and every
    parameter's gradient (this rank's slice of the twin's); raises on a mismatch."""
    tp = tp_group(world)
    cfg = ModelConfig.debug(
        hidden_size=16, num_experts=5, experts_per_token=2, expert_size=11, norm_topk_prob=False,
        shared_expert_size=9 if shared else 0, shared_expert_gate=shared,
    )  # fmt: skip
    torch.manual_seed(0)
    full = MoE(cfg)
    with torch.no_grad():
        for p in full.parameters():
            p.normal_(0, 0.5)
    par = MixtureOfExperts(expert_parallel=expert_parallel).apply(copy.deepcopy(full), tp)
    x = torch.randn(3, 4, 16)
    x_full, x_par = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_full, y_par = full(x_full), par(x_par)
    assert_close(y_par, y_full, "output")
    g = torch.randn_like(y_full)
    (y_full * g).sum().backward()
    (y_par * g).sum().backward()
    assert_close(x_par.grad, x_full.grad, "input grad")
    specs = model_shard_specs(par)
    full_params = dict(full.named_parameters())
    for name, p in par.named_parameters():
        assert_close(p.grad, specs[name].take(full_params[name].grad), f"grad of {name}")
