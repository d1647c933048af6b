"""Uneven tp on a decoder: the query heads a rank's qkv computes are the heads its o
projection's columns multiply, at every tp 1..num_heads (no processes: dry-run ranks)."""

from __future__ import annotations

import pytest

from shardwise.comm.dryrun import DryRunCommunicator
from shardwise.layers import model_shard_specs
from shardwise.models import DecoderLM, ModelConfig
from shardwise.models.meta import on_meta
from shardwise.sharding import parallelize
from shardwise.sharding.plans import decoder_plan

HEADS = [(9, 3), (28, 4), (14, 2), (6, 2), (8, 2), (12, 4), (10, 10)]


def _q_and_o_heads(cfg: ModelConfig, tp: int, rank: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """(first, count) of the query heads in qkv's rows and in o's columns on `rank`."""
    with on_meta():
        model = DecoderLM(cfg)
    parallelize(model, decoder_plan(cfg), comm=DryRunCommunicator(tp, rank))
    specs, hd = model_shard_specs(model), cfg.head_dim
    q_start, q_len = specs["layers.0.attn.qkv.weight"].pieces[0]  # [q | k | v] rows: q first
    (o_start, o_len), *_ = specs["layers.0.attn.o.weight"].pieces
    return (q_start // hd, q_len // hd), (o_start // hd, o_len // hd)


@pytest.mark.parametrize("heads,kv", HEADS, ids=[f"{h}h{kv}kv" for h, kv in HEADS])
def test_o_columns_follow_the_query_heads_of_qkv(heads, kv):
    cfg = ModelConfig.debug(hidden_size=4 * heads, num_heads=heads, num_kv_heads=kv, intermediate_size=37)
    for tp in range(1, heads + 1):
        for rank in range(tp):
            q, o = _q_and_o_heads(cfg, tp, rank)
            assert q == o, f"{heads} heads / {kv} KV heads, tp={tp} rank {rank}: qkv holds q heads {q}, o {o}"
