"""The tp sizes the plans here can split a model by: the one answer that loading, the
CLI, the planner and the demo all use (the arithmetic is in shardwise.layers.partition).

Query heads are split, key/value heads are split or evenly replicated (see HeadLayout),
the MLP's intermediate dim is split; the vocabulary is padded, so it never refuses a tp.
"""

from __future__ import annotations

from shardwise.layers.partition import HeadLayout, ShardError
from shardwise.models.config import ModelConfig

__all__ = ["model_tp_sizes", "check_tp"]


def model_tp_sizes(cfg: ModelConfig) -> list[int]:
    """Every tp size that can split this model, in increasing order."""
    heads = HeadLayout.valid_tp_sizes(cfg.num_heads, cfg.num_kv_heads)
    return [t for t in heads if cfg.intermediate_size % t == 0]


def check_tp(cfg: ModelConfig, tp: int) -> None:
    """Refuse a tp that cannot split this model: a ShardError naming the first size it
    cannot split, the numbers, and the valid tp sizes."""
    valid = model_tp_sizes(cfg)
    if tp in valid:
        return
    if tp < 1:
        raise ShardError(f"tp must be >= 1, got {tp}")
    if cfg.num_heads % tp:
        what = f"num_attention_heads={cfg.num_heads}"
    elif cfg.num_kv_heads % tp and tp % cfg.num_kv_heads:
        what = f"num_key_value_heads={cfg.num_kv_heads}"
    else:
        what = f"intermediate_size={cfg.intermediate_size}"
    raise ShardError(f"{what} cannot be split over tp={tp}; valid tp sizes: {', '.join(map(str, valid))}")
