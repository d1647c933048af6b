"""Property tests of the shard arithmetic: random shapes and tp sizes, slices that
reassemble exactly, and head layouts that cover every head once."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from shardwise.comm import LocalCommunicator
from shardwise.layers import HeadLayout, ShardError, VocabShard, divide, padded_size, shard_range, valid_tp_sizes
from shardwise.layers.partition import imbalance, split_ranges, width_unit


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
    if tp > heads:
        with pytest.raises(ShardError, match=rf"tp={tp} is more than the model's num_attention_heads={heads}"):
            HeadLayout(heads, kv, tp)
        return
    lay = HeadLayout(heads, kv, tp)
    q_seen = [h for r in range(tp) for h in lay.q_heads(r)]
    assert q_seen == list(range(heads)), "each query head on exactly one rank, in order"
    shares = [len(lay.q_heads(r)) for r in range(tp)]
    assert max(shares) - min(shares) <= 1, f"shares {shares} differ by more than one head"
    assert lay.max_heads == max(shares) and lay.imbalance == max(shares) * tp / heads
    for r in range(tp):
        kv_heads = list(lay.kv_heads(r))
        # exactly the KV heads the local query heads attend with, and how many use each
        used = [q // group for q in lay.q_heads(r)]
        assert sorted(set(used)) == kv_heads
        assert lay.kv_groups(r) == tuple(used.count(h) for h in kv_heads)
        assert lay.regular(r) == (len(set(lay.kv_groups(r))) == 1)
    holders = [sum(h in lay.kv_heads(r) for r in range(tp)) for h in range(kv)]
    assert tuple(holders) == lay.kv_holders and min(holders) >= 1
    assert lay.replicated == (max(holders) > 1)
    if heads % tp == 0 and (kv % tp == 0 or tp % kv == 0):  # the classic layouts: unchanged
        assert shares == [heads // tp] * tp and len(set(holders)) == 1
        assert all(lay.regular(r) for r in range(tp))


def test_head_layouts_of_the_issue():
    # 9 heads / 3 KV heads at tp=2: KV head 1 serves query heads on both ranks
    lay = HeadLayout(9, 3, 2)
    assert [list(lay.q_heads(r)) for r in range(2)] == [[0, 1, 2, 3, 4], [5, 6, 7, 8]]
    assert [list(lay.kv_heads(r)) for r in range(2)] == [[0, 1], [1, 2]]
    assert [lay.kv_groups(r) for r in range(2)] == [(3, 2), (1, 3)] and lay.kv_holders == (1, 2, 1)
    # 28 / 4 at tp=8: each KV group of 7 split 4 + 3 over its own two ranks, no rank straddles
    lay = HeadLayout(28, 4, 8)
    assert [len(lay.q_heads(r)) for r in range(8)] == [4, 3] * 4
    assert all(len(lay.kv_heads(r)) == 1 for r in range(8)) and lay.kv_holders == (2, 2, 2, 2)


def test_head_error_lists_valid_sizes():
    with pytest.raises(
        ShardError, match=r"^tp=13 is more than the model's num_attention_heads=12: .*; valid tp sizes: 1-12$"
    ):
        HeadLayout(12, 6, 13)
    with pytest.raises(ShardError, match=r"must be a positive multiple of num_key_value_heads=5"):
        HeadLayout(12, 5, 2)


@given(st.integers(1, 20_000), st.integers(1, 16))
def test_uneven_width_splits_tile_and_stay_balanced(size, tp):
    if size < tp:
        with pytest.raises(ShardError, match=rf"cannot give each of tp={tp} ranks a share"):
            split_ranges(size, tp)
        return
    ranges = split_ranges(size, tp)
    assert ranges[0][0] == 0 and ranges[-1][1] == size
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))
    widths = [e - s for s, e in ranges]
    unit = width_unit(size, tp)
    if size % tp == 0:
        assert widths == [size // tp] * tp, "an even split stays the classic one"
    else:
        assert all(w % unit == 0 for w in widths) and max(widths) - min(widths) <= unit
        best = -(-size // tp) * tp / size  # single columns
        assert imbalance(size, tp) <= best * 1.01 + 1e-12
