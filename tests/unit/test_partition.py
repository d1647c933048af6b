"""Property tests of the shard arithmetic: random shapes and tp sizes, slices that
reassemble exactly, and head layouts that cover every head once."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from shardwise.comm import LocalCommunicator
from shardwise.layers import HeadLayout, ShardError, VocabShard, divide, padded_size, shard_range, valid_tp_sizes


class _FakeComm(LocalCommunicator):
    def __init__(self, rank: int, size: int) -> None:
        super().__init__()
        self.rank, self.size = rank, size


@given(st.integers(1, 64), st.integers(1, 4096))
def test_shard_ranges_tile_the_dimension(tp, width):
    size = tp * width
    ranges = [shard_range(size, tp, r) for r in range(tp)]
    assert ranges[0][0] == 0 and ranges[-1][1] == size
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))
    assert all(e - s == width for s, e in ranges)


@given(st.integers(1, 6), st.integers(1, 8), st.integers(1, 8), st.integers(0, 1))
def test_tensor_slices_reassemble_exactly(tp, rows, cols, dim):
    shape = [rows, cols]
    shape[dim] *= tp
    full = torch.randn(*shape)
    parts = []
    for r in range(tp):
        s, e = shard_range(full.shape[dim], tp, r)
        parts.append(full.narrow(dim, s, e - s))
    assert torch.equal(torch.cat(parts, dim=dim), full)


@given(st.integers(1, 10_000), st.integers(1, 64))
def test_divide_and_valid_sizes_agree(n, tp):
    valid = valid_tp_sizes(n, limit=64)
    if tp in valid:
        assert divide(n, tp, what="x") * tp == n
    else:
        with pytest.raises(ShardError, match=rf"x={n} cannot be split over tp={tp}; valid tp sizes: 1"):
            divide(n, tp, what="x")


@given(st.integers(1, 500), st.integers(1, 16))
def test_padded_vocab_shards_reassemble(vocab, tp):
    table = torch.arange(vocab * 2, dtype=torch.float32).view(vocab, 2)
    shards = [VocabShard(vocab, _FakeComm(r, tp)) for r in range(tp)]
    assert all(s.padded == padded_size(vocab, tp) and s.padded % tp == 0 for s in shards)
    assert 0 <= shards[0].padded - vocab < tp
    rows = torch.cat([s.copy_rows(table) for s in shards])
    assert torch.equal(rows[:vocab], table)
    assert not rows[vocab:].any(), "padded rows must be zero"


@given(st.integers(1, 64), st.integers(1, 64), st.integers(1, 64))
def test_head_layout_covers_every_head_and_matches_gqa(kv, group, tp):
    heads = kv * group
    valid = HeadLayout.valid_tp_sizes(heads, kv)
    if tp not in valid:
        with pytest.raises(ShardError, match=rf"cannot be split over tp={tp}; valid tp sizes: "):
            HeadLayout(heads, kv, tp)
        return
    lay = HeadLayout(heads, kv, tp)
    q_seen = [h for r in range(tp) for h in lay.q_heads(r)]
    assert q_seen == list(range(heads)), "each query head on exactly one rank, in order"
    for r in range(tp):
        kv_heads = list(lay.kv_heads(r))
        # every local query head attends with a KV head this rank holds
        assert {q // group for q in lay.q_heads(r)} <= set(kv_heads)
        assert len(kv_heads) == lay.local_kv_heads
    holders = [sum(h in lay.kv_heads(r) for r in range(tp)) for h in range(kv)]
    assert holders == [lay.kv_replicas] * kv, "every KV head held by the same number of ranks"


def test_head_error_lists_valid_sizes():
    with pytest.raises(
        ShardError, match=r"^num_key_value_heads=6 cannot be split over tp=4; valid tp sizes: 1, 2, 3, 6"
    ):
        HeadLayout(12, 6, 4)
    with pytest.raises(ShardError, match=r"^num_attention_heads=12 cannot be split over tp=5"):
        HeadLayout(12, 4, 5)
