"""Whole layers and a whole tiny DecoderLM, sharded by their plans, against their
unsharded twins; and the Megatron communication count (2 all-reduces per layer forward,
2 backward) asserted through the communication accounting. The rank functions are in
cases/blocks.py (shared with the MPI test)."""

from __future__ import annotations

import pytest

from cases.blocks import TINY, TINY3, block_case, tiny_lm_case
from shardwise.models import ModelConfig


def _only_tp_all_reduces(snapshot: dict[str, dict]) -> int:
    assert set(snapshot) <= {"all_reduce/tp"}, f"unexpected collectives: {snapshot}"
    return snapshot.get("all_reduce/tp", {"calls": 0})["calls"]


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_transformer_block_two_all_reduces_each_way(rank_pool, world_size):
    cfg = ModelConfig.debug(hidden_size=32, num_heads=8, num_kv_heads=4, intermediate_size=64)
    for counts in rank_pool.run(block_case, world_size, args=(cfg, "block")):
        expected = 0 if world_size == 1 else 2
        assert _only_tp_all_reduces(counts["fwd"]) == expected
        assert _only_tp_all_reduces(counts["bwd"]) == expected


MEGATRON_MLP = ModelConfig.debug(
    hidden_size=24, num_heads=4, num_kv_heads=4, intermediate_size=48, gated_mlp=False, act="gelu", mlp_bias=True
)  # down(gelu(up(x))) with biases: Megatron-LM's fc2(gelu(fc1(x)))


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_megatron_mlp_one_all_reduce_each_way(rank_pool, world_size):
    for counts in rank_pool.run(block_case, world_size, args=(MEGATRON_MLP, "mlp")):
        assert _only_tp_all_reduces(counts["fwd"]) == 1
        assert _only_tp_all_reduces(counts["bwd"]) == 1


def test_replicated_kv_block_sums_replica_grads(rank_pool):
    """2 KV heads at tp=4: each KV head on 2 ranks. Grads still match the unsharded block;
    the replicas' weight and bias gradients cost one extra all-reduce in backward."""
    cfg = ModelConfig.debug(
        hidden_size=32, num_heads=8, num_kv_heads=2, intermediate_size=64, qkv_bias=True, o_bias=True, mlp_bias=True
    )
    for counts in rank_pool.run(block_case, 4, args=(cfg, "block")):
        assert _only_tp_all_reduces(counts["fwd"]) == 2
        assert _only_tp_all_reduces(counts["bwd"]) == 2 + 2  # + weight and bias replica sums


@pytest.mark.parametrize(
    "world_size,cfg",
    [(1, TINY), (2, TINY), (3, TINY3), (4, TINY)],
    ids=["tp1", "tp2", "tp3", "tp4-replicated-kv"],
)
def test_tiny_lm_loss_and_grads_match_unsharded(rank_pool, world_size, cfg):
    rank_pool.run(tiny_lm_case, world_size, args=(cfg, "fp32"))


@pytest.mark.parametrize("world_size", [2, 4])
def test_tiny_lm_bf16(rank_pool, world_size):
    rank_pool.run(tiny_lm_case, world_size, args=(TINY, "bf16"))
