"""Sharding plans for shardwise's own model families, written as data."""

from shardwise.sharding.plans.blocks import block_plan, mlp_plan, tiny_lm_plan
from shardwise.sharding.plans.decoder import decoder_plan

__all__ = ["block_plan", "mlp_plan", "tiny_lm_plan", "decoder_plan"]
