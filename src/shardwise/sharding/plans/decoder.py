"""The plan for DecoderLM (every decoder family): Megatron-LM's layout, as data."""

from __future__ import annotations

from shardwise.models.config import ModelConfig
from shardwise.sharding.plan import Plan
from shardwise.sharding.styles import QKV, Vocab

__all__ = ["decoder_plan"]


def decoder_plan(cfg: ModelConfig, *, gather_logits: bool = True) -> Plan:
    """Embedding and head by vocabulary; attention by heads; MLP by its intermediate dim.

    Norms, q/k norms and learned position embeddings stay replicated.
    """
    return {
        "embed": "vocab",
        "layers.*.attn.qkv": QKV(num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads),
        "layers.*.attn.o": "rowwise",
        "layers.*.mlp.up": "merged_colwise" if cfg.gated_mlp else "colwise",
        "layers.*.mlp.down": "rowwise",
        "lm_head": Vocab(gather_output=gather_logits),
    }
