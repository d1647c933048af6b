"""Start N ranks under mpiexec (the MPI backend), with the fail-fast semantics of
shardwise.launch.failfast, as the local launcher.

MPI ranks must be started by mpiexec, so they cannot be forked from this process. The
parent listens on a loopback port (authenticated with a random key), starts
`mpiexec -n N python -m shardwise.launch.mpi_rank`, and each rank connects back for
its job and returns its result or its error over that connection. If a rank fails, every
rank is killed (by pid) and then the mpiexec session; if the parent dies, each rank sees
its connection close and exits. On the first failure the ranks still running are told
(`_notify`), so their collectives fail at once instead of waiting out their timeout, and
fail with an error of their own: each rank runs in a session of its own, out of reach of
mpiexec's cleanup, which would otherwise SIGKILL them all at once when one dies by a
signal (shardwise.launch.mpi_rank). As with the local launcher, the ranks publish their
progress to a board directory this process creates.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection, Listener, wait
from pathlib import Path
from typing import Any

from shardwise.comm.communicator import DEFAULT_TIMEOUT_S
from shardwise.comm.shm_segment import remove_segments
from shardwise.launch import board as boards
from shardwise.launch.failfast import (
    Failure,
    JobTimeoutError,
    Outcomes,
    RankFailedError,
    job_deadline,
    out_of_memory,
    recv_report,
)
from shardwise.memory import oom_kills

__all__ = ["launch_mpi", "find_mpiexec"]


def find_mpiexec() -> str:
    """The venv's mpiexec (from the `mpich` wheel), else one on PATH."""
    exe = shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or shutil.which("mpiexec")
    if exe is None:
        raise RuntimeError("backend 'mpi' needs mpiexec and mpi4py: pip install 'shardwise[mpi]'")
    return exe


def launch_mpi(
    fn: Callable[..., Any],
    world_size: int,
    *,
    args: tuple = (),
    timeout_s: float = DEFAULT_TIMEOUT_S,
    job_timeout_s: float | None = None,
    threads_per_rank: int = 1,
) -> list[Any]:
    """Run fn(world_communicator, *args) on `world_size` MPI ranks; results by rank."""
    key = os.urandom(32)
    listener = Listener(("127.0.0.1", 0), authkey=key)
    host, port = listener.address
    board_dir = boards.new_dir()
    env = {
        **os.environ,
        "SHARDWISE_LAUNCH_ADDR": f"{host}:{port}",
        "SHARDWISE_LAUNCH_KEY": key.hex(),
        "OMP_NUM_THREADS": str(threads_per_rank),
    }
    # -disable-auto-cleanup: when a rank dies, mpiexec leaves the others running (mostly: see
    # shardwise.launch.mpi_rank), so that they can be told (_notify) and fail with an error of
    # their own (a server answers 503 and ends its requests) before this process kills them.
    cmd = [find_mpiexec(), "-disable-auto-cleanup", "-n", str(world_size), sys.executable]
    cmd += ["-m", "shardwise.launch.mpi_rank"]
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    conns: dict[Connection, int] = {}
    ranks: dict[int, tuple[int, int]] = {}  # rank -> (pid, pidfd): the rank processes, to kill at the end
    accepted: list[Connection] = []
    threading.Thread(
        target=lambda: [accepted.append(listener.accept()) for _ in range(world_size)], daemon=True
    ).start()
    deadline = job_deadline(timeout_s, job_timeout_s)
    grace = 0.0  # seconds to let mpiexec exit by itself: only after every rank succeeded
    try:
        main = sys.modules.get("__main__")
        main_file = getattr(main, "__file__", None) if fn.__module__ == "__main__" else None
        prep = pickle.dumps((list(sys.path), main_file, board_dir))
        job = pickle.dumps((fn, args, timeout_s, threads_per_rank))
        while len(conns) < world_size:  # every rank says hello with its rank, and gets the job
            if proc.poll() is not None:
                raise RankFailedError(
                    -1, f"mpiexec exited with code {proc.returncode} before all ranks started", "", []
                )
            if time.monotonic() > deadline:
                raise JobTimeoutError(f"only {len(conns)} of {world_size} MPI ranks started", [proc.pid])
            while accepted:
                conn = accepted.pop()
                rank, pid = pickle.loads(conn.recv_bytes())  # in-memory IPC from our own rank process
                conns[conn] = rank
                ranks[rank] = (pid, os.pidfd_open(pid))
                conn.send_bytes(prep)
                conn.send_bytes(job)
            time.sleep(0.01)
        results = _collect(proc, conns, ranks, world_size, deadline, board_dir, timeout_s)
        grace = 5.0
        return results
    finally:
        _kill(proc, ranks, grace)
        remove_segments([pid for pid, _ in ranks.values()])  # a rank that died while making its segment
        # MPICH's own, left by ranks killed before MPI_Finalize (a failed job, or a server
        # stopped by a signal): the ranks are gone by now (_kill waits), so their segments are unmapped
        remove_orphan_mpich_segments(min_age_s=ORPHAN_MIN_AGE_S)
        for conn in conns:
            conn.close()
        listener.close()
        boards.remove_dir(board_dir)


def _collect(
    proc: subprocess.Popen,
    conns: dict[Connection, int],
    ranks: dict[int, tuple[int, int]],
    world_size: int,
    deadline: float,
    board_dir: str,
    timeout_s: float,
) -> list[Any]:
    outcomes = Outcomes(world_size, [proc.pid, *(pid for pid, _ in ranks.values())])
    pending = dict(conns)
    ooms = oom_kills()  # a rank gone silent while the cgroup's OOM count grew: the OOM killer's

    def poll(seconds: float) -> None:
        for conn in wait(list(pending), timeout=seconds):
            rank = pending.pop(conn)
            try:
                outcomes.add(rank, recv_report(conn))
            except (EOFError, OSError):
                # NOTE: once one rank exits with an error, mpiexec kills the others; those
                # silent deaths are consequences, not the cause.
                after_report = any(f.detail for f in outcomes.failures)
                oom = out_of_memory(world_size, ooms, oom_kills())
                how = f"process {ranks[rank][0]} " + (oom or "exited without reporting (killed?)")
                outcomes.died(rank, how, secondary=after_report and oom is None)

    return outcomes.collect(
        poll,
        running=lambda: bool(pending),
        deadline=deadline,
        on_first_failure=lambda f: _notify(pending, f),
        diagnose=lambda: boards.diagnose_dir(board_dir, world_size),
        settle_s=timeout_s,  # the ranks told of the failure report at once, or within it
    )


def _notify(pending: dict[Connection, int], failure: Failure) -> None:
    """Tell the ranks still running that a peer died: their collectives fail at once."""
    notice = pickle.dumps(f"rank {failure.rank} failed: {failure.summary}")
    for conn in pending:
        with contextlib.suppress(OSError):
            conn.send_bytes(notice)


def _kill(proc: subprocess.Popen, ranks: dict[int, tuple[int, int]], grace_s: float = 0.0) -> None:
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=grace_s)  # a finished job exits by itself
    for _, pidfd in ranks.values():  # NOTE: a pidfd: never a later process that reuses the pid
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)  # a stopped rank too
    _wait_exited([pidfd for _, pidfd in ranks.values()], EXIT_WAIT_S)
    for _, pidfd in ranks.values():
        os.close(pidfd)
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # mpiexec: its proxy then kills the stand-ins
    proc.wait(timeout=10)


def _wait_exited(pidfds: list[int], timeout_s: float) -> None:
    """Until every process of `pidfds` has exited (a pidfd reads ready once its process is
    gone, its memory unmapped), or `timeout_s`. The ranks are not this process's children:
    no wait(); a SIGKILL takes effect a little after it is sent."""
    poller = select.poll()
    for fd in pidfds:
        poller.register(fd, select.POLLIN)
    left, deadline = set(pidfds), time.monotonic() + timeout_s
    while left and time.monotonic() < deadline:
        for fd, _ in poller.poll(max(1, int(1e3 * (deadline - time.monotonic())))):
            poller.unregister(fd)
            left.discard(fd)


EXIT_WAIT_S = 5.0
"""How long the end of a job waits for its killed ranks to be gone (before it looks for their
MPICH segments)."""
ORPHAN_MIN_AGE_S = 1.0
"""A segment this old that no process maps is an orphan: a rank maps the segment it makes
within milliseconds (so a job starting beside this one keeps its own). At 10 s, a server
stopped a few seconds after it started (the README's serve step under test: 9 s) left its
2 MB segment behind at every run."""
MPICH_SHM_GLOB = "mpich_shm_*"


def remove_orphan_mpich_segments(shm_dir: str = "/dev/shm", *, min_age_s: float = ORPHAN_MIN_AGE_S) -> list[str]:
    """Unlink MPICH's shared-memory segments (/dev/shm/mpich_shm_*) that no process maps and
    that are older than `min_age_s`: what ranks killed before MPI_Finalize leave behind (a
    failed or timed-out job: about 2-4 MB each). A segment of a job starting now is mapped
    by its creator within milliseconds of being made, so neither test touches it. The names removed."""
    now = time.time()
    candidates = []
    for path in Path(shm_dir).glob(MPICH_SHM_GLOB):
        with contextlib.suppress(FileNotFoundError):
            if now - path.stat().st_mtime >= min_age_s:
                candidates.append(path)
    if not candidates:
        return []
    mapped: set[str] = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        with contextlib.suppress(OSError):
            mapped.update(line.rsplit(None, 1)[-1] for line in maps.read_text().splitlines() if "mpich_shm_" in line)
    removed = []
    for path in candidates:
        if str(path) not in mapped:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
                removed.append(path.name)
    return removed
