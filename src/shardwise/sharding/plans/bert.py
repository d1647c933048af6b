"""The plan for BertEncoder: Megatron-LM's layout, as data."""

from __future__ import annotations

from shardwise.models.config import ModelConfig
from shardwise.sharding.plan import Plan
from shardwise.sharding.plans.decoder import layer_plan

__all__ = ["bert_plan"]


def bert_plan(cfg: ModelConfig) -> Plan:
    """Word embeddings by vocabulary; every layer as a decoder layer (attention by heads,
    MLP by its intermediate dim).

    Position and token-type embeddings, every LayerNorm and the pooler stay replicated:
    the hidden state between sublayers is whole on every rank, so the pooler needs no
    collective.
    """
    return {"embed": "vocab", **layer_plan(cfg, "layers.*.")}
