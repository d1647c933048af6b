"""ShardSpecs describe every sharded parameter exactly: cutting the unsharded tensors by
the specs gives what parallelize() gives, on every rank."""

from __future__ import annotations

import copy

import pytest
import torch

from helpers import NoCollectives
from shardwise.layers import model_shard_specs
from shardwise.models import DecoderLM, ModelConfig
from shardwise.sharding import parallelize
from shardwise.sharding.plans import decoder_plan

BIAS = dict(qkv_bias=True, o_bias=True, mlp_bias=True)


@pytest.mark.parametrize(
    "tp,cfg",
    [
        (
            2,
            ModelConfig.debug(
                hidden_size=32, num_heads=8, num_kv_heads=4, intermediate_size=128, vocab_size=50, **BIAS
            ),
        ),
        (
            4,
            ModelConfig.debug(
                hidden_size=32, num_heads=8, num_kv_heads=2, intermediate_size=128, vocab_size=50, **BIAS
            ),
        ),  # replicated KV
        (3, ModelConfig.debug(hidden_size=48, num_heads=12, num_kv_heads=6, intermediate_size=48, vocab_size=50)),
    ],
)
def test_specs_cut_the_same_shards_as_parallelize(tp, cfg):
    torch.manual_seed(0)
    model = DecoderLM(cfg)
    full = dict(model.named_parameters())
    for rank in range(tp):
        sharded = parallelize(copy.deepcopy(model), decoder_plan(cfg), comm=NoCollectives(rank=rank, size=tp))
        specs = model_shard_specs(sharded)
        params = dict(sharded.named_parameters())
        assert specs.keys() == params.keys()
        for name, p in params.items():
            assert specs[name].local_shape == tuple(p.shape), name
            assert specs[name].global_shape == tuple(full[name].shape), name
            assert torch.equal(specs[name].take(full[name]), p), f"rank {rank}: {name}"
        if cfg.o_bias:
            assert specs["layers.0.attn.o.bias"].dim is None, "row-parallel bias is replicated"
