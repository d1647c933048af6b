"""Greedy decoding with the logits left split (shardwise.engine.argmax): each rank's best and
one all-gather choose what torch.argmax chooses on the whole row (ties to the lowest index,
+inf, NaN, padded columns), the same on every rank, world sizes 1-4, batch 3."""

from __future__ import annotations

import pytest

from cases.argmax import argmax_case


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_the_split_choice_is_the_whole_rows_argmax(rank_pool, world_size):
    assert rank_pool.run(argmax_case, world_size) == [12] * world_size
