"""AdamW as shardwise.train builds it: torch's fused kernel on CPU floats (one pass a tensor),
stepping as the per-operation loop does, within fp32 rounding."""

from __future__ import annotations

import torch

from shardwise.train.config import OptimSection
from shardwise.train.optim import build_optimizer, fused_ok


def test_fused_adamw_steps_as_the_loop_does():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.LayerNorm(96), torch.nn.Linear(96, 8))
    twin = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.LayerNorm(96), torch.nn.Linear(96, 8))
    twin.load_state_dict(model.state_dict())
    start = [p.detach().clone() for p in model.parameters()]
    cfg = OptimSection(lr=1e-2, weight_decay=0.1)
    fused = build_optimizer(model, cfg)
    assert fused.defaults["fused"] is True
    decay = [p for p in twin.parameters() if p.dim() >= 2]
    rest = [p for p in twin.parameters() if p.dim() < 2]
    loop = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                             lr=1e-2, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, foreach=False)  # fmt: skip
    for _ in range(5):
        x = torch.randn(4, 64)
        for m, opt in ((model, fused), (twin, loop)):
            opt.zero_grad()
            m(x).square().mean().backward()
            opt.step()
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    moved = [float((a.detach() - p0).abs().max()) for a, p0 in zip(model.parameters(), start, strict=True)]
    assert min(moved) > 1e-3, moved  # five steps of lr 1e-2 moved every parameter


def test_fused_only_where_torch_has_it():
    assert fused_ok([torch.zeros(3), torch.zeros(2, 2, dtype=torch.bfloat16)])
    assert not fused_ok([torch.zeros(3, dtype=torch.int64)])
    assert not fused_ok([])
