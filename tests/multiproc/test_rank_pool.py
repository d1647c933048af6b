"""The rank pool that runs the multi-process cases: a case starts as in a fresh process,
a failing case is reported with its rank's own traceback and does not poison the next
one, and a hung case times out."""

from __future__ import annotations

import time

import pytest
import torch

from processes import wait_gone
from shardwise.launch import JobTimeoutError, RankFailedError


def _state(world, n_all_reduces: int) -> dict:
    fresh = {"calls": world.stats.calls(), "draw": torch.rand(3), "grad": torch.is_grad_enabled()}
    for _ in range(n_all_reduces):
        world.all_reduce(torch.ones(1))
    torch.manual_seed(123)  # a case that seeds must not change what the next one draws
    torch.set_grad_enabled(False)
    return fresh


def _raise_on(world, bad_rank: int) -> int:
    if world.rank == bad_rank:
        raise ValueError(f"boom on rank {bad_rank}")
    world.all_reduce(torch.ones(1))  # the others wait for it: out of step until the pool restarts
    return world.rank


def _sleep(world, seconds: float) -> None:
    time.sleep(seconds)


def test_each_case_starts_as_in_a_fresh_process(rank_pool):
    first = rank_pool.run(_state, 2, args=(3,))
    second = rank_pool.run(_state, 2, args=(0,))
    for a, b in zip(first, second, strict=True):
        assert a["calls"] == b["calls"] == 0, "communication counters carried over"
        assert torch.equal(a["draw"], b["draw"]), "the random state carried over"
        assert a["grad"] and b["grad"], "grad mode carried over"


def test_a_failing_case_names_its_rank_and_the_next_case_runs(rank_pool):
    rank_pool.run(_raise_on, 3, args=(-1,))
    with pytest.raises(RankFailedError) as info:
        rank_pool.run(_raise_on, 3, args=(1,))
    assert info.value.rank == 1 and "ValueError: boom on rank 1" in str(info.value)
    assert "Traceback" in info.value.detail and "_raise_on" in info.value.detail
    assert wait_gone(pids=info.value.pids) == [], "the out-of-step ranks were not stopped"
    assert rank_pool.run(_raise_on, 3, args=(-1,)) == [0, 1, 2]


def test_a_hung_case_times_out_and_the_next_case_runs(rank_pool):
    start = time.monotonic()
    with pytest.raises(
        JobTimeoutError, match=r"case _sleep timed out after 2 s; ranks \[0, 1\] had not finished"
    ) as info:
        rank_pool.run(_sleep, 2, args=(60,), timeout_s=2)
    assert time.monotonic() - start < 2 + 20
    assert len(info.value.pids) == 2 and wait_gone(pids=info.value.pids) == [], "the hung ranks were not stopped"
    rank_pool.run(_sleep, 2, args=(0,))
