"""Every tensor-parallel layer against its unsharded twin: outputs, input and parameter
gradients, batch > 1, at world sizes 1, 2, 3 and 4, on sizes tp divides and sizes it does
not (split unevenly: layers.partition). The cases
(tests/cases/layers.py) run on pooled ranks: no job is launched per case."""

from __future__ import annotations

import pytest

from cases.layers import DTYPES, linear_case, merged_case, qkv_case, untied_head_case, vocab_case
from helpers import grid

WORLD_SIZES = [1, 2, 3, 4]


def _smoke(*values) -> bool:
    """In `make test-fast`: each layer kind once, in fp32 at world size 2."""
    return values[-2:] == ("fp32", 2)


@pytest.mark.parametrize(
    "kind,gather,dtype,world_size",
    grid([("column", False), ("column", True), ("row", False)], list(DTYPES), WORLD_SIZES, smoke=_smoke),
)
def test_linear_parity(rank_pool, world_size, dtype, kind, gather):
    rank_pool.run(linear_case, world_size, args=(kind, dtype, gather))


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("kind,gather", [("column", False), ("column", True), ("row", False)])
def test_uneven_linear_parity(rank_pool, world_size, kind, gather):
    # 37 columns: no tp > 1 divides them (a gathered output all-gathers uneven parts)
    rank_pool.run(linear_case, world_size, args=(kind, "fp32", gather, 37))


@pytest.mark.parametrize(
    "dtype,num_heads,num_kv_heads,world_size",
    grid(
        list(DTYPES),
        # MHA, GQA split, GQA replicated at tp=4, MQA; then heads tp does not divide: 9 / 3 KV
        # (uneven, KV heads shared by two ranks), 14 / 2 KV (7 per group, groups split 4 + 3)
        [(12, 12), (12, 6), (8, 2), (4, 1), (9, 3), (14, 2)],
        WORLD_SIZES,
        smoke=lambda dtype, nh, nkv, ws: (dtype, nh, nkv, ws) == ("fp32", 8, 2, 2),
    ),
)
def test_qkv_parity(rank_pool, world_size, num_heads, num_kv_heads, dtype):
    rank_pool.run(qkv_case, world_size, args=(num_heads, num_kv_heads, dtype, False))


@pytest.mark.parametrize("world_size", [2, 4])
def test_qkv_from_separate_projections(rank_pool, world_size):
    rank_pool.run(qkv_case, world_size, args=(8, 2, "fp32", True))


@pytest.mark.parametrize("dtype,world_size", grid(list(DTYPES), WORLD_SIZES, smoke=_smoke))
def test_merged_gate_up_parity(rank_pool, world_size, dtype):
    rank_pool.run(merged_case, world_size, args=(dtype,))


@pytest.mark.parametrize("world_size", [3, 4])
def test_uneven_merged_gate_up_parity(rank_pool, world_size):
    rank_pool.run(merged_case, world_size, args=("fp32", 13))


@pytest.mark.parametrize(
    "dtype,vocab,world_size",
    # 48 is divisible by 1..4; 50 needs padding at tp=3, 4
    grid(list(DTYPES), [48, 50], WORLD_SIZES, smoke=lambda dtype, vocab, ws: (dtype, vocab, ws) == ("fp32", 50, 2)),
)
def test_vocab_parallel_parity(rank_pool, world_size, vocab, dtype):
    rank_pool.run(vocab_case, world_size, args=(vocab, dtype))


@pytest.mark.parametrize("world_size", [1, 3, 4])
def test_untied_lm_head_with_bias(rank_pool, world_size):
    rank_pool.run(untied_head_case, world_size)
