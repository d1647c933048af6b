"""Plans are validated as a whole when applied, before any module changes and before
any collective runs; errors name the module, the numbers and the valid tp sizes."""

from __future__ import annotations

import pytest
from torch import nn

from helpers import NoCollectives
from shardwise.layers import ColumnParallelLinear, RowParallelLinear, ShardError
from shardwise.models import DecoderLM, ModelConfig
from shardwise.sharding import Colwise, matches, parallelize, resolve_plan
from shardwise.sharding.plans import decoder_plan


class UserMLP(nn.Module):
    def __init__(self, hidden=12, inner=30):
        super().__init__()
        self.fc1 = nn.Linear(hidden, inner)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(inner, hidden)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


def _snapshot(model):
    return {n: (type(m).__name__) for n, m in model.named_modules()}


def test_pattern_matching_is_per_dotted_part():
    assert matches("layers.*.mlp.down", "layers.3.mlp.down")
    assert not matches("layers.*.down", "layers.3.mlp.down")
    assert matches("layers.[0-1].attn.o", "layers.1.attn.o")


def test_too_many_ranks_for_the_heads_are_refused_before_any_change():
    cfg = ModelConfig.debug(hidden_size=48, num_heads=12, num_kv_heads=6, vocab_size=50)
    model = DecoderLM(cfg)
    before = _snapshot(model)
    with pytest.raises(
        ShardError,
        match=r"^layers\.0\.attn\.qkv: tp=13 is more than the model's num_attention_heads=12: .*valid tp sizes: 1-12$",
    ):
        parallelize(model, decoder_plan(cfg), comm=NoCollectives(size=13))
    assert _snapshot(model) == before, "a failed parallelize must leave the model untouched"


def test_a_linear_with_fewer_columns_than_ranks_is_refused():
    with pytest.raises(
        ShardError, match=r"^fc1\.weight: out_features=30 cannot give each of tp=31 ranks a share; valid tp sizes: 1-30"
    ):
        resolve_plan(UserMLP(), {"fc1": "colwise", "fc2": "rowwise"}, tp=31)


def test_whole_heads_stay_together():
    with pytest.raises(ShardError, match=r"out_features=30 \(3 heads of head_dim=10\) cannot give each of tp=4"):
        resolve_plan(UserMLP(), {"fc1": Colwise(head_dim=10)}, tp=4)
    resolve_plan(UserMLP(), {"fc1": Colwise(head_dim=10)}, tp=2)  # 2 heads and 1: uneven, accepted


def test_mismatched_plan_path_suggests_real_ones():
    with pytest.raises(ShardError, match=r"plan pattern 'fc3' matches no module of UserMLP; closest module paths: fc"):
        parallelize(UserMLP(), {"fc3": "colwise"}, comm=NoCollectives())


@pytest.mark.parametrize(
    "plan,message",
    [
        ({"act": "colwise"}, r"act: style colwise needs Linear, found GELU"),
        ({"fc1": "diagonal"}, r"unknown sharding style 'diagonal'; known: colwise, rowwise, vocab"),
        ({"fc*": "colwise", "fc1": "rowwise"}, r"module 'fc1' is matched by both 'fc\*' and 'fc1'"),
    ],
)
def test_bad_plans(plan, message):
    with pytest.raises(ShardError, match=message):
        parallelize(UserMLP(inner=32), plan, comm=NoCollectives())


def test_valid_plan_swaps_modules_without_collectives():
    model = parallelize(UserMLP(hidden=12, inner=32), {"fc1": "colwise", "fc2": "rowwise"}, comm=NoCollectives(rank=3))
    assert isinstance(model.fc1, ColumnParallelLinear) and model.fc1.weight.shape == (8, 12)
    assert isinstance(model.fc2, RowParallelLinear) and model.fc2.weight.shape == (12, 8)


def test_tied_embedding_and_head_stay_tied_with_padded_vocab():
    cfg = ModelConfig.debug(hidden_size=32, num_heads=8, num_kv_heads=2, vocab_size=50)
    model = parallelize(DecoderLM(cfg), decoder_plan(cfg), comm=NoCollectives(rank=3))
    assert model.lm_head.weight is model.embed.weight
    assert model.embed.weight.shape == (13, 32)  # 50 padded to 52, over 4 ranks
    assert not model.embed.weight[11:].any(), "rank 3's rows 50 and 51 are padding"
