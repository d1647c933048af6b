"""The torch.distributed communicator and its groups: every collective's result, on
tp and dp sub-groups built by ParallelDims, and the accounting of each; the region
functions. The cases (tests/cases/comm.py) run on pooled ranks."""

from __future__ import annotations

import re
import time

import pytest

from cases.comm import (
    all_to_all_case,
    all_to_all_never_arrives,
    check_all_to_all,
    collectives_case,
    regions_case,
    uneven_case,
)
from processes import wait_gone
from shardwise.comm import ParallelDims
from shardwise.launch import RankFailedError, launch


@pytest.mark.parametrize("world_size,tp", [(1, 1), pytest.param(2, 2, marks=pytest.mark.smoke), (3, 3), (4, 2), (4, 4)])
def test_collectives_on_sub_groups(rank_pool, world_size, tp):
    snapshots = rank_pool.run(collectives_case, world_size, args=(tp,))
    stats = snapshots[0]
    if tp == 1:
        assert "all_reduce/tp" not in stats, "size-1 groups must short-circuit"
    else:
        # 1 sum + 1 max + 1 alias check + 2 half-precision sums
        assert stats["all_reduce/tp"]["calls"] == 5
        assert stats["all_reduce/tp"]["bytes"] == 6 * 4 + 2 * 4 + 4 + 4 * 2 * 2
        assert stats["all_gather/tp"] == {"calls": 3, "bytes": 3 * 6 * 4}
        assert stats["broadcast/tp"] == {"calls": 1, "bytes": 12}
    if world_size // tp > 1:
        assert stats["all_reduce/dp"] == {"calls": 1, "bytes": 4}
    if world_size > 1:
        assert stats["barrier/world"]["calls"] == 1


def _mismatched_world(comm) -> None:
    ParallelDims(world_size=comm.size + 1, tp=1).build(comm)


def test_build_rejects_a_mesh_of_the_wrong_size():
    from shardwise.launch import RankFailedError

    with pytest.raises(RankFailedError, match=r"communicator has 2 ranks but ParallelDims.world_size=3"):
        launch(_mismatched_world, 2)


@pytest.mark.parametrize("world_size", [1, pytest.param(2, marks=pytest.mark.smoke), 3, 4])
def test_region_functions_forward_and_backward(rank_pool, world_size):
    rank_pool.run(regions_case, world_size)


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_uneven_all_gather_and_reduce_scatter(rank_pool, world_size):
    out = rank_pool.run(uneven_case, world_size)[0]
    widest = max(out["sizes"])
    # pad-and-trim: every rank sends its part padded to the widest; the accounting counts that
    assert out["gather"]["all_gather/tp"] == {"calls": 1, "bytes": 2 * widest * 4}
    assert out["scatter"]["reduce_scatter/tp"] == {"calls": 1, "bytes": 2 * widest * world_size * 4}


@pytest.mark.parametrize("world_size", [1, pytest.param(2, marks=pytest.mark.smoke), 3, 4])
def test_all_to_all_uneven_and_empty_splits(rank_pool, world_size):
    for out in rank_pool.run(all_to_all_case, world_size):
        check_all_to_all(out, world_size)


@pytest.mark.full  # a launch of its own; test_failure's all_reduce timeout covers the gate
def test_all_to_all_with_a_rank_that_never_arrives_times_out():
    start = time.monotonic()
    with pytest.raises(RankFailedError) as info:
        launch(all_to_all_never_arrives, 2, timeout_s=2)
    elapsed = time.monotonic() - start
    assert info.value.rank == 1, "the rank that never arrived, not the one that timed out"
    assert re.match(r"stuck: never arrived at all_to_all/world #1 \(rank 0 waited 2\.\d s for it\)", info.value.summary)
    assert "CollectiveError: all_to_all on group 'world' (rank 0 of 2, gloo, timeout 2s) failed" in str(info.value)
    assert elapsed < 2 + 10, f"took {elapsed:.1f}s, the timeout was 2s"
    assert wait_gone(pids=info.value.pids) == []
