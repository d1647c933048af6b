"""DistributedDataParallel's gradient all-reduce goes through the dp Communicator (a comm
hook): counted as all_reduce/dp like every other collective, so a hang in it is named."""

from __future__ import annotations

from shardwise.train import setup, train
from train_helpers import tiny_config, write_tiny_tokens


def _ddp_counts(world, cfg) -> dict:
    steps = len(train(world, cfg).stats)
    stats = world.stats.snapshot()
    grad_bytes = sum(p.numel() * p.element_size() for p in setup(world, cfg).model.parameters() if p.requires_grad)
    return {"stats": stats, "grad_bytes": grad_bytes, "steps": steps}


def test_ddp_gradient_all_reduce_is_counted_as_all_reduce_dp(rank_pool, tmp_path):
    tokens = write_tiny_tokens(tmp_path / "tokens.safetensors")
    cfg = tiny_config(tokens, tmp_path / "run", dp=2, steps=2, parallel={"dp_sync": "ddp"})
    for r in rank_pool.run(_ddp_counts, 2, args=(cfg,)):
        # one round of bucket all-reduces per step (the micro-steps before the last run under
        # no_sync), and the loss's
        assert r["stats"]["all_reduce/dp"]["bytes"] == r["steps"] * (r["grad_bytes"] + 4), r["stats"]
        # DDP's own: the initial parameter broadcast, and its bucket order after the first backward
        assert r["stats"]["broadcast/dp"]["calls"] == 2, r["stats"]
