"""The plan for BertEncoder: Megatron-LM's layout, as data."""

from __future__ import annotations

from shardwise.models.config import ModelConfig
from shardwise.sharding.plan import Plan
from shardwise.sharding.styles import QKV

__all__ = ["bert_plan"]


def bert_plan(cfg: ModelConfig) -> Plan:
    """Word embeddings by vocabulary; attention by heads; MLP by its intermediate dim.

    Position and token-type embeddings, every LayerNorm and the pooler stay replicated:
    the hidden state between sublayers is whole on every rank, so the pooler needs no
    collective.
    """
    return {
        "embed": "vocab",
        "layers.*.attn.qkv": QKV(num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads),
        "layers.*.attn.o": "rowwise",
        "layers.*.mlp.up": "colwise",
        "layers.*.mlp.down": "rowwise",
    }
