"""The plan for DecoderLM (every decoder family): Megatron-LM's layout, as data.

The first matrix of each pair is split by columns and the second by rows, so each of
attention and MLP costs one all-reduce forward and one backward.
"""

from __future__ import annotations

from shardwise.models.config import ModelConfig
from shardwise.sharding.plan import Plan
from shardwise.sharding.styles import QKV, Vocab

__all__ = ["attention_plan", "mlp_plan", "layer_plan", "decoder_plan"]


def attention_plan(cfg: ModelConfig, prefix: str = "") -> Plan:
    """An Attention (models/modules.py): the fused qkv by whole heads, o by rows."""
    return {f"{prefix}qkv": QKV(num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads), f"{prefix}o": "rowwise"}


def mlp_plan(cfg: ModelConfig, prefix: str = "") -> Plan:
    """An MLP (models/modules.py): up by columns (gate and up each, when gated), down by rows."""
    return {f"{prefix}up": "merged_colwise" if cfg.gated_mlp else "colwise", f"{prefix}down": "rowwise"}


def layer_plan(cfg: ModelConfig, prefix: str = "") -> Plan:
    """One layer (DecoderLayer or BertLayer): attention by heads, MLP by its intermediate dim.

    Its norms stay replicated."""
    return attention_plan(cfg, f"{prefix}attn.") | mlp_plan(cfg, f"{prefix}mlp.")


def decoder_plan(cfg: ModelConfig, *, gather_logits: bool = True) -> Plan:
    """Embedding and head by vocabulary; every layer as layer_plan.

    Norms, q/k norms and learned position embeddings stay replicated. gather_logits=False
    keeps the logits vocab-parallel, for vocab_parallel_cross_entropy.
    """
    return {
        "embed": "vocab",
        **layer_plan(cfg, "layers.*."),
        "lm_head": Vocab(gather_output=gather_logits),
    }
