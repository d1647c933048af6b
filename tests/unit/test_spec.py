"""ShardSpecs describe every sharded parameter exactly: cutting the unsharded tensors by
the specs gives what parallelize() gives, on every rank."""

from __future__ import annotations

import copy

import pytest
import torch

from helpers import NoCollectives
from shardwise.layers import model_shard_specs
from shardwise.models import BlockConfig, TinyLM
from shardwise.sharding import parallelize
from shardwise.sharding.plans import tiny_lm_plan


@pytest.mark.parametrize(
    "tp,cfg",
    [
        (2, BlockConfig(hidden_size=32, num_heads=8, num_kv_heads=4, vocab_size=50, bias=True)),
        (4, BlockConfig(hidden_size=32, num_heads=8, num_kv_heads=2, vocab_size=50, bias=True)),  # replicated KV
        (3, BlockConfig(hidden_size=48, num_heads=12, num_kv_heads=6, intermediate_size=48, vocab_size=50)),
    ],
)
def test_specs_cut_the_same_shards_as_parallelize(tp, cfg):
    torch.manual_seed(0)
    model = TinyLM(cfg)
    full = dict(model.named_parameters())
    for rank in range(tp):
        sharded = parallelize(copy.deepcopy(model), tiny_lm_plan(cfg), comm=NoCollectives(rank=rank, size=tp))
        specs = model_shard_specs(sharded)
        params = dict(sharded.named_parameters())
        assert specs.keys() == params.keys()
        for name, p in params.items():
            assert specs[name].local_shape == tuple(p.shape), name
            assert specs[name].global_shape == tuple(full[name].shape), name
            assert torch.equal(specs[name].take(full[name]), p), f"rank {rank}: {name}"
        if cfg.bias:
            assert specs["layers.0.attn.o.bias"].dim is None, "row-parallel bias is replicated"
