"""Sharding plans as data, and the one function that applies them."""

from shardwise.sharding.apply import parallelize
from shardwise.sharding.like import shard_grads_like, shard_like
from shardwise.sharding.plan import Plan, matches, resolve_plan
from shardwise.sharding.styles import (
    QKV,
    STYLE_NAMES,
    Colwise,
    MergedColwise,
    Replicate,
    Rowwise,
    Style,
    Vocab,
    as_style,
)

__all__ = [
    "parallelize",
    "shard_like",
    "shard_grads_like",
    "Plan",
    "matches",
    "resolve_plan",
    "Style",
    "Colwise",
    "Rowwise",
    "Vocab",
    "Replicate",
    "QKV",
    "MergedColwise",
    "STYLE_NAMES",
    "as_style",
]
