"""The pipeline mesh and point-to-point on gloo: pp groups of ParallelDims, send/recv of
every dtype along the pipeline and around the ring, the paired exchange, the accounting,
the p2p_check header, and a recv whose peer never sends. The cases (tests/cases/p2p.py)
run on pooled ranks; the timeout case has its own launch."""

from __future__ import annotations

import re
import time

import pytest

from cases.p2p import mesh_case, mismatch_case, p2p_case, peer_never_sends
from processes import wait_gone
from shardwise.launch import RankFailedError, launch

LAYOUTS = [  # (world_size, tp, pp)
    pytest.param(2, 1, 2, marks=pytest.mark.smoke),
    (4, 1, 4),
    (4, 2, 2),
    (4, 1, 2),  # dp = 2
]


@pytest.mark.parametrize("world_size,tp,pp", LAYOUTS)
def test_pp_groups(rank_pool, world_size, tp, pp):
    rank_pool.run(mesh_case, world_size, args=(tp, pp))


@pytest.mark.parametrize("check", [False, True])
@pytest.mark.parametrize("world_size,tp,pp", LAYOUTS)
def test_send_recv_and_exchange(rank_pool, world_size, tp, pp, check):
    results = rank_pool.run(p2p_case, world_size, args=(tp, pp, check))
    for rank, r in enumerate(results):
        # every message counted once, payload bytes only (the p2p_check header is not)
        assert r["counted"] == r["expected"], (rank, r)
        assert r["other_ops"] == [], (rank, r)
    if (world_size, tp, pp) == (2, 1, 2):
        # stage 0: 7 sends forward, 1 recv backward, 3 ring exchanges, 1 paired exchange
        first = results[0]["counted"]
        assert first["send"] == (7 + 3 + 1, 24 + 40 + 12 + 56 + 9 + 8 + 0 + (24 + 40 + 12) + 24)
        assert first["recv"] == (1 + 3 + 1, 24 + (24 + 40 + 12) + 20)


def _tp2_pp2_dp2(world) -> list[dict]:
    mesh_case(world, 2, 2)
    return [p2p_case(world, 2, 2, check) for check in (False, True)]


@pytest.mark.full  # 8 ranks on 2 cores
def test_tp2_pp2_dp2_on_8_ranks():
    # One launch of its own: a rank pool of 8 did not start within its 120 s here.
    for rank, results in enumerate(launch(_tp2_pp2_dp2, 8, timeout_s=60)):
        for r in results:
            assert r["counted"] == r["expected"] and r["other_ops"] == [], (rank, r)


@pytest.mark.parametrize("world_size", [pytest.param(2, marks=pytest.mark.smoke), 4])
def test_mismatch_raises_on_both_sides(rank_pool, world_size):
    results = rank_pool.run(mismatch_case, world_size)
    both = "point-to-point mismatch on group 'pp': rank 0 sends float32 (2, 3) to rank 1, which expects bfloat16 (2, 4)"
    assert len(results[0]) == 1 and both in results[0][0] and "raised on the sender, rank 0" in results[0][0]
    assert len(results[1]) == 1 and both in results[1][0] and "raised on the receiver, rank 1" in results[1][0]
    assert all(r == [] for r in results[2:])


@pytest.mark.full  # a launch of its own; test_failure's collective timeout covers the gate
def test_recv_from_a_peer_that_never_sends_times_out():
    start = time.monotonic()
    with pytest.raises(RankFailedError) as info:
        launch(peer_never_sends, 2, timeout_s=2)
    elapsed = time.monotonic() - start
    assert info.value.rank == 1, "the rank that never sent, not the one that timed out"
    assert re.match(r"stuck: never arrived at recv/pp #1 \(rank 0 waited 2\.\d s for it\)", info.value.summary)
    assert "CollectiveError: recv from rank 1 on group 'pp' (rank 0 of 2, gloo, timeout 2s) failed" in str(info.value)
    assert elapsed < 2 + 10, f"took {elapsed:.1f}s, the timeout was 2s"
    assert wait_gone(pids=info.value.pids) == []
