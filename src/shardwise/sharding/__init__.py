"""Sharding plans as data, and the one function that applies them."""

from shardwise.sharding.apply import parallelize
from shardwise.sharding.like import shard_grads_like, shard_like
from shardwise.sharding.plan import Plan, matches, resolve_plan
from shardwise.sharding.sequence import enable_sequence_parallel, partial_grad_names, sum_partial_grads
from shardwise.sharding.styles import (
    QKV,
    STYLE_NAMES,
    Colwise,
    MergedColwise,
    Replicate,
    Rowwise,
    SequenceScatter,
    SequenceSharded,
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
    "SequenceSharded",
    "SequenceScatter",
    "partial_grad_names",
    "sum_partial_grads",
    "enable_sequence_parallel",
    "STYLE_NAMES",
    "as_style",
]
