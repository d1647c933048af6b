"""A stuck rank, end to end: `shardwise serve` with a worker stopped mid-generation (our
launcher), and `shardwise generate` with a rank stuck before a collective under torchrun
(sleeping) and under an external mpiexec (stopped). Each ends within the collective
timeout plus a grace, with an error that names the stuck rank and the operation the
others waited in, and leaves no process behind.

The hang is injected with SHARDWISE_DEBUG_HANG (shardwise.comm.progress): every rank an
external launcher starts inherits it."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from processes import process_tag, wait_gone

BIN = Path(sys.executable).parent
TIMEOUT = 2.0
GRACE_S = 5.0
"""After the timeout, how long the job may take to end: the launcher's grace, the kills, slack."""
GENERATE = ["-m", "shardwise", "generate", "--tp", "2", "--timeout", str(TIMEOUT), "--max-new-tokens", "20"]


def test_a_stopped_serve_worker_is_named_in_the_log_and_the_server_exits_1(tmp_path):
    pytest.importorskip("httpx")
    pytest.importorskip("openai")
    from test_serve import Server, _fault_case

    s = Server(tmp_path, "--tp", "2", "--timeout", str(TIMEOUT), "--backend", "gloo")
    try:
        import httpx

        pids = httpx.get(f"{s.url}/health", timeout=10).json()["pids"]
        stopped_at: list[float] = []

        def stop() -> None:
            stopped_at.append(time.monotonic())
            os.kill(pids[1], signal.SIGSTOP)

        _fault_case(s, stop)  # a stream is running: it ends with an error, /health turns 503, exit status 1
        ended = time.monotonic() - stopped_at[0]
        log = s.log.read_text()
        engine = next(line for line in log.splitlines() if "ERROR engine stopped: CollectiveError:" in line)
        # the operation rank 0 waited in: the next collective after the stop (a tp all-reduce, or the
        # world broadcast of the step's tokens, wherever the stop landed)
        assert re.search(r" -- rank 1 is stuck: never arrived at \w+/(tp|world) #\d+ ", engine), engine
        assert f"stopped (process {pids[1]}, state T; " in engine
        assert "shardwise: error: rank 1 failed: stuck: " in log
        assert ended < TIMEOUT + GRACE_S, f"the server exited {ended:.1f} s after its worker stopped"
    finally:
        s.stop()  # asserts that no rank process remains


def _run(cmd: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path), **env}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False, env=env)


def test_generate_under_torchrun_names_a_rank_sleeping_before_a_collective():
    if not (BIN / "torchrun").exists():
        pytest.skip("torchrun not installed")
    tag = process_tag()
    cmd = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2", *GENERATE, "--backend", "gloo"]
    out = _run(cmd, {"SHARDWISE_DEBUG_HANG": "1:all_reduce/tp#30:sleep", **tag})
    assert out.returncode != 0
    # the torchrun agent's store carries the ranks' progress records: rank 0 names rank 1
    named = r"shardwise: error: rank 1 failed: stuck: never arrived at all_reduce/tp #\d+ \(rank 0 waited 2\.\d s for it\); "
    assert re.search(named + "running outside communication for ", out.stderr), out.stderr[-3000:]
    assert wait_gone(tag=tag) == [], "orphan rank processes remain"


def test_generate_under_mpiexec_names_a_stopped_rank_and_ends_the_job(tmp_path):
    pytest.importorskip("mpi4py")
    if not (BIN / "mpiexec").exists():
        pytest.skip("mpiexec not installed (pip install mpich)")
    tag = process_tag()
    cmd = [str(BIN / "mpiexec"), "-n", "2", sys.executable, *GENERATE, "--backend", "mpi"]
    env = {"SHARDWISE_DEBUG_HANG": "1:all_reduce/tp#30:stop", "SHARDWISE_BOARD": str(tmp_path / "board"), **tag}
    start = time.monotonic()
    out = _run(cmd, env)
    elapsed = time.monotonic() - start
    # NOTE: mpiexec waits for every rank, a stopped one too: the rank that timed out ends the job
    assert out.returncode == 1, out.stderr[-3000:]
    named = r"shardwise: error: rank 1 failed: stuck: never arrived at all_reduce/tp #\d+ \(rank 0 waited 2\.\d s for it\); "
    assert re.search(named + r"stopped \(process \d+, state T; ", out.stderr), out.stderr[-3000:]
    assert "shardwise: ending the mpiexec job" in out.stderr
    assert elapsed < 120, f"took {elapsed:.0f} s"
    assert wait_gone(tag=tag) == [], "orphan rank processes remain"
