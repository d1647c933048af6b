"""The shared-memory all-reduce (shardwise.comm.shm): equal to the wrapped communicator's and
to the plain sum, many calls in a row, a decode with it on and off (pooled gloo ranks; MPI in
one launched job); a rank that fails mid-collective makes the others fail naming it, within
the timeout; no segment outlives its job. The cases are in tests/cases/shm.py."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from cases.shm import (
    decode_case,
    dies_holding_a_segment,
    fails_mid_collective,
    gather_broadcast_case,
    many_calls_case,
    other_host_case,
    parity_case,
)
from shardwise.comm.shm import shm_mode
from shardwise.comm.shm_segment import PREFIX, SHM_DIR
from shardwise.launch import RankFailedError, launch


def _segments(pids: list[int]) -> list[str]:
    return sorted(p.name for pid in pids for p in Path(SHM_DIR).glob(f"{PREFIX}{pid}-*"))


@pytest.mark.parametrize("world_size", [pytest.param(2, marks=pytest.mark.smoke), 3, 4])
def test_equals_the_wrapped_all_reduce_and_the_plain_sum(rank_pool, world_size):
    out = rank_pool.run(parity_case, world_size)
    assert all(len(r["checked"]) == 6 for r in out)
    assert all(r["linked"] == [] for r in out), "the segment's name must go once every rank has mapped it"
    assert len({r["calls"] for r in out}) == 1


@pytest.mark.parametrize("world_size", [2, pytest.param(3, marks=pytest.mark.full)])
def test_all_gather_and_broadcast_equal_the_wrapped_ones(rank_pool, world_size):
    out = rank_pool.run(gather_broadcast_case, world_size)
    assert all(r["checked"] == 9 for r in out) and len({r["calls"] for r in out}) == 1


@pytest.mark.parametrize("world_size", [2, 3])
def test_many_calls_in_a_row_wrap_the_counter(rank_pool, world_size):
    calls, period = 200, 6
    for r in rank_pool.run(many_calls_case, world_size, args=(calls, period)):
        assert r == {"calls": calls, "seq": calls % period, "period": period}


def test_decode_gives_the_same_tokens_with_shm_on_and_off(rank_pool):
    on, off = rank_pool.run(decode_case, 2)[0].values()
    assert on["shm"] and not off["shm"] and on["shm_calls"] > 0
    assert on["tokens"] == off["tokens"] and all(len(t) == 12 for t in on["tokens"])
    assert on["comm"] == off["comm"], "the accounting counts the shared-memory calls as the wrapped ones"


def test_a_group_across_hosts_keeps_the_wrapped_all_reduce(rank_pool):
    assert rank_pool.run(other_host_case, 3) == [("TorchDistCommunicator", [3.0, 3.0, 3.0])] * 3


@pytest.mark.parametrize(
    "how,backend",
    [
        ("raise", "gloo"),
        pytest.param("exit", "gloo", marks=pytest.mark.full),
        pytest.param("raise", "mpi", marks=pytest.mark.full),
    ],
)
def test_a_rank_that_fails_mid_collective_is_named_by_the_others(tmp_path, how, backend):
    timeout = 3.0
    with pytest.raises(RankFailedError) as info:
        launch(fails_mid_collective, 3, args=(how, 1, str(tmp_path)), backend=backend, timeout_s=timeout)
    assert info.value.rank == 1
    for rank in (0, 2):
        record = json.loads((tmp_path / str(rank)).read_text())
        # seen by its pid, or (MPI) told by the launcher first
        gone = r"shared-memory all_reduce #6(: rank 1 \(world rank 1, process \d+\) is gone| cannot complete: rank 1 failed)"
        assert re.search(gone, record["error"]), record["error"]
        assert record["waited"] < timeout, f"rank {rank} waited {record['waited']:.1f}s, past the timeout"
    assert _segments(info.value.pids) == []


@pytest.mark.full
def test_a_rank_that_never_arrives_times_out_naming_it(tmp_path):
    timeout = 2.0
    with pytest.raises(RankFailedError) as info:
        launch(fails_mid_collective, 3, args=("never", 1, str(tmp_path)), timeout_s=timeout)
    assert info.value.rank == 1 and info.value.stuck == (1,)
    for rank in (0, 2):
        record = json.loads((tmp_path / str(rank)).read_text())
        assert re.search(r"waited 2s for rank 1 \(world rank 1, process \d+\), which never arrived", record["error"])
        assert timeout <= record["waited"] < timeout + 1.5
    assert _segments(info.value.pids) == []


def test_the_launcher_removes_a_segment_its_dead_rank_left(tmp_path):
    with pytest.raises(RankFailedError, match="exit code 5"):
        launch(dies_holding_a_segment, 2, args=(str(tmp_path),))
    path = Path((tmp_path / "path").read_text())
    assert path.name.startswith(PREFIX) and not path.exists()


def test_mode_from_the_environment():
    assert shm_mode({}) == "auto" and shm_mode({"SHARDWISE_SHM_ALLREDUCE": " OFF "}) == "off"
    with pytest.raises(ValueError, match=r"SHARDWISE_SHM_ALLREDUCE='fast' is not one of auto, on, off"):
        shm_mode({"SHARDWISE_SHM_ALLREDUCE": "fast"})


def _mpi_checks(world) -> dict:
    return {"parity": parity_case(world), "many": many_calls_case(world, 100, 4), "decode": decode_case(world)}


@pytest.mark.full
@pytest.mark.parametrize("world_size", [2, 3])
def test_over_mpi(world_size):
    pytest.importorskip("mpi4py")
    out = launch(_mpi_checks, world_size, backend="mpi")
    assert all(r["parity"]["linked"] == [] and r["many"]["seq"] == 100 % 4 for r in out)
    on, off = out[0]["decode"].values()
    assert on["shm"] and on["tokens"] == off["tokens"]
