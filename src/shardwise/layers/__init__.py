"""Tensor-parallel layers: each takes this rank's slice of an unsharded module."""

from shardwise.layers.dispatch import ExpertDispatch, check_owners, dispatch_experts
from shardwise.layers.embedding import VocabParallelEmbedding, VocabParallelLMHead, VocabShard
from shardwise.layers.fused import MergedColumnParallelLinear, QKVParallelLinear, SumReplicaGrads
from shardwise.layers.linear import ColumnParallelLinear, RowParallelLinear
from shardwise.layers.loss import VocabParallelCrossEntropy, vocab_parallel_cross_entropy
from shardwise.layers.moe import ParallelMoE, expert_ranges, expert_specs
from shardwise.layers.moe_ep import ExpertParallelMoE, ep_expert_specs, expert_block_specs
from shardwise.layers.partition import (
    HeadLayout,
    ShardError,
    divide,
    imbalance,
    padded_size,
    shard_range,
    split_ranges,
    split_sizes,
    valid_tp_sizes,
)
from shardwise.layers.sequence import SequenceParallelLinear, sequence_parallel_linear
from shardwise.layers.spec import ShardSpec, model_shard_specs

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "QKVParallelLinear",
    "MergedColumnParallelLinear",
    "SumReplicaGrads",
    "VocabParallelEmbedding",
    "VocabParallelLMHead",
    "VocabShard",
    "ParallelMoE",
    "expert_ranges",
    "expert_specs",
    "dispatch_experts",
    "ExpertDispatch",
    "check_owners",
    "ExpertParallelMoE",
    "ep_expert_specs",
    "expert_block_specs",
    "VocabParallelCrossEntropy",
    "vocab_parallel_cross_entropy",
    "SequenceParallelLinear",
    "sequence_parallel_linear",
    "HeadLayout",
    "ShardSpec",
    "model_shard_specs",
    "ShardError",
    "divide",
    "padded_size",
    "shard_range",
    "split_ranges",
    "split_sizes",
    "imbalance",
    "valid_tp_sizes",
]
