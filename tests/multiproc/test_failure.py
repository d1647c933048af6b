"""Failure semantics: a rank that raises or dies takes the whole job down with its own
error, within the collective timeout, and leaves no process behind; a collective whose
peer never arrives times out instead of hanging, and the error names the rank that did
not arrive (stopped, or stuck in Python), the operation and how long the others waited;
a checkpoint saved before such a hang verifies and resumes (in make test-more)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from cases.failure import one_rank_never_arrives, raise_on_rank, train_then_hang
from processes import process_tag, wait_gone
from shardwise.checkpoint import Checkpointer, CheckpointReader
from shardwise.comm import LocalCommunicator
from shardwise.launch import JobTimeoutError, RankFailedError, launch
from shardwise.train import train
from train_helpers import tiny_config, write_tiny_tokens

GRACE_S = 5.0
"""After the timeout, how long a hung job may take to end: the launcher's 1 s grace, killing
the ranks, and slack for a loaded machine."""


# (4, 2) in make test-more: (2, 1) and (4, 0) cover the gate
@pytest.mark.parametrize(
    "world_size,bad_rank",
    [pytest.param(2, 1, marks=pytest.mark.smoke), pytest.param(4, 2, marks=pytest.mark.full), (4, 0)],
)
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


def test_collective_times_out_instead_of_hanging_and_names_the_rank_that_never_arrived():
    start = time.monotonic()
    with pytest.raises(RankFailedError) as info:
        launch(one_rank_never_arrives, 2, timeout_s=2)
    elapsed = time.monotonic() - start
    err = info.value
    assert (err.rank, err.stuck) == (1, (1,)), "the rank that never arrived, not the one that timed out"
    assert re.match(r"stuck: never arrived at all_reduce/world #1 \(rank 0 waited 2\.\d s for it\); ", err.summary)
    assert "running outside communication for " in err.summary and "before its first operation" in err.summary
    assert err.detail.startswith("what rank 0 saw:\n")
    assert "CollectiveError: all_reduce on group 'world' (rank 0 of 2, gloo, timeout 2s) failed" in err.detail
    assert "Timed out" in err.detail
    assert elapsed < 2 + 10, f"took {elapsed:.1f}s, collective timeout was 2s"
    assert wait_gone(pids=err.pids) == []


def _mpi_available() -> bool:
    try:
        import mpi4py  # noqa: F401

        from shardwise.launch.mpi import find_mpiexec

        find_mpiexec()
    except (ImportError, RuntimeError):
        return False
    return True


_MPI = pytest.mark.skipif(not _mpi_available(), reason="needs mpi4py and mpiexec")


@pytest.mark.parametrize(
    "backend,hangs",
    [  # both in make test-more; the gate's timeout cases above name a rank that never arrived
        pytest.param("gloo", {3: "stop"}, marks=pytest.mark.full),
        pytest.param("mpi", {1: "sleep", 3: "stop"}, marks=[_MPI, pytest.mark.full]),
    ],
    ids=str,
)
def test_a_stuck_training_rank_is_named_and_its_checkpoint_resumes(tmp_path, monkeypatch, backend, hangs):
    """tp=2 x dp=2, right after the step-2 checkpoint. gloo: rank 3 stops; rank 2 waits for it
    in a tp all-reduce, rank 1 in DDP's dp gradient all-reduce, rank 0 for rank 2. MPI: rank 1
    sleeps in Python and rank 3 stops, one in each tp group: both are named. The checkpoint
    verifies and resumes (at tp=1, in this process)."""
    tokens = write_tiny_tokens(tmp_path / "tokens.safetensors")
    cfg = tiny_config(tokens, tmp_path / "run", tp=2, dp=2, steps=6, run={"save_every": 2})
    tag = process_tag() if backend == "mpi" else None  # NOTE: gloo ranks come from the session's forkserver
    for key, value in (tag or {}).items():
        monkeypatch.setenv(key, value)  # mpiexec and its ranks inherit it
    markers = tmp_path / "hung"
    markers.mkdir()
    timeout = 3.0
    with pytest.raises(RankFailedError) as info:
        launch(train_then_hang, 4, args=(cfg, hangs, str(markers)), backend=backend, timeout_s=timeout)
    ended = time.time()
    hung = {int(f.name): f.read_text().split() for f in markers.iterdir()}
    err = info.value
    assert sorted(err.stuck) == sorted(hangs) and err.rank == err.stuck[0]
    assert err.summary.startswith("stuck: never arrived at all_reduce/"), err.summary
    assert "all_reduce/tp #" in err.summary
    for rank, how in hangs.items():
        pid = hung[rank][1]
        state = f"stopped (process {pid}, state T; " if how == "stop" else "running outside communication for "
        assert state in err.summary, err.summary
        assert f"(rank {rank - 1} waited " in err.summary, "its tp partner waited for it"
    if len(hangs) == 1:
        assert "all_reduce/dp #" in err.summary and "(rank 1 waited" in err.summary, "DDP's all-reduce names it too"
    waited = ended - max(float(at) for at, _ in hung.values())
    assert waited < timeout + GRACE_S, f"the job ended {waited:.1f} s after the hang; the timeout was {timeout} s"
    assert wait_gone(pids=err.pids, tag=tag) == [], "orphan rank processes remain"

    checkpoint = tmp_path / "run" / "checkpoints" / "step-00000002"
    CheckpointReader(checkpoint).verify()
    resumed = cfg.replace(
        parallel={"tp": 1, "dp": 1}, run={"resume": str(checkpoint), "steps": 3, "out_dir": str(tmp_path / "resumed")}
    )
    result = train(LocalCommunicator(), resumed, Checkpointer())
    assert [step for step, _ in result.history] == [1, 2, 3] and result.step == 3


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
