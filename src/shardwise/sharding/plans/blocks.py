"""Plans for the plain blocks in shardwise.models.blocks.

Megatron-LM's layout: the first matrix of each pair is split by columns and the second
by rows, so each of attention and MLP costs one all-reduce forward and one backward.
"""

from __future__ import annotations

from shardwise.models.blocks import BlockConfig
from shardwise.sharding.plan import Plan
from shardwise.sharding.styles import QKV, Vocab

__all__ = ["block_plan", "mlp_plan", "tiny_lm_plan"]


def block_plan(cfg: BlockConfig, prefix: str = "") -> Plan:
    """A TransformerBlock: attention split by heads, gated MLP by its intermediate dim."""
    return {
        f"{prefix}attn.qkv": QKV(num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads),
        f"{prefix}attn.o": "rowwise",
        f"{prefix}mlp.gate_up": "merged_colwise",
        f"{prefix}mlp.down": "rowwise",
    }


def mlp_plan(prefix: str = "") -> Plan:
    """The Megatron MLP: fc1 by columns, fc2 by rows."""
    return {f"{prefix}fc1": "colwise", f"{prefix}fc2": "rowwise"}


def tiny_lm_plan(cfg: BlockConfig, *, gather_logits: bool = True) -> Plan:
    """TinyLM: vocab-parallel embedding and tied head, every block as block_plan.

    gather_logits=False keeps the logits vocab-parallel, for vocab_parallel_cross_entropy.
    """
    return {
        "embed": "vocab",
        **block_plan(cfg, prefix="layers.*."),
        "lm_head": Vocab(gather_output=gather_logits),
    }
