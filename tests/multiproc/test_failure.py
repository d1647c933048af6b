"""Failure semantics: a rank that raises or dies takes the whole job down with its own
error, within the collective timeout, and leaves no process behind; a collective whose
peer never arrives times out instead of hanging."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from cases.failure import one_rank_never_arrives, raise_on_rank
from processes import wait_gone
from shardwise.launch import JobTimeoutError, RankFailedError, launch


@pytest.mark.parametrize("world_size,bad_rank", [pytest.param(2, 1, marks=pytest.mark.smoke), (4, 2), (4, 0)])
def test_raising_rank_takes_job_down_with_its_error(world_size, bad_rank):
    start = time.monotonic()
    with pytest.raises(RankFailedError) as info:
        launch(raise_on_rank, world_size, args=(bad_rank,), timeout_s=30)
    elapsed = time.monotonic() - start
    err = info.value
    assert err.rank == bad_rank
    assert f"ValueError: boom on rank {bad_rank}" in str(err)
    assert "Traceback" in err.detail
    assert elapsed < 15, f"took {elapsed:.1f}s to fail"
    assert wait_gone(pids=err.pids) == [], "orphan rank processes remain"


def test_collective_times_out_instead_of_hanging():
    start = time.monotonic()
    with pytest.raises(RankFailedError) as info:
        launch(one_rank_never_arrives, 2, timeout_s=2)
    elapsed = time.monotonic() - start
    assert info.value.rank == 0
    assert "CollectiveError: all_reduce on group 'world' (rank 0 of 2, gloo, timeout 2s) failed" in str(info.value)
    assert "Timed out" in str(info.value)
    assert elapsed < 2 + 10, f"took {elapsed:.1f}s, collective timeout was 2s"
    assert wait_gone(pids=info.value.pids) == []


def _rank_killed(comm) -> None:
    if comm.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    for _ in range(1000):
        comm.all_reduce(torch.ones(4))


def test_killed_rank_is_reported_by_signal():
    with pytest.raises(RankFailedError) as info:
        launch(_rank_killed, 3, timeout_s=30)
    assert info.value.rank == 1
    assert "SIGKILL" in str(info.value)
    assert wait_gone(pids=info.value.pids) == []


def _sleep_forever(comm) -> None:
    time.sleep(120)


def test_job_timeout_kills_every_rank():
    with pytest.raises(JobTimeoutError) as info:
        launch(_sleep_forever, 2, job_timeout_s=2)
    assert "ranks [0, 1] had not finished" in str(info.value)
    assert wait_gone(pids=info.value.pids) == []


def test_ranks_die_with_a_killed_parent(tmp_path):
    """SIGKILL the launching process: its ranks must not outlive it."""
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    script = textwrap.dedent(
        f"""
        import os, time
        from shardwise.launch import launch

        def work(comm):
            open(os.path.join({str(pid_dir)!r}, str(os.getpid())), "w").close()
            time.sleep(120)

        if __name__ == "__main__":
            launch(work, 3)
        """
    )
    (tmp_path / "parent.py").write_text(script)
    parent = subprocess.Popen([sys.executable, str(tmp_path / "parent.py")], cwd=tmp_path)
    try:
        deadline = time.monotonic() + 60
        while len(list(pid_dir.iterdir())) < 3:
            assert time.monotonic() < deadline, "ranks did not start"
            assert parent.poll() is None, "launcher exited early"
            time.sleep(0.1)
        pids = [int(p.name) for p in pid_dir.iterdir()]
        parent.kill()
        parent.wait()
        assert wait_gone(pids=pids, within_s=10) == [], "ranks outlived their parent"
    finally:
        if parent.poll() is None:
            parent.kill()
