"""Start N ranks on this host and run one function on each, with fail-fast semantics.

    results = launch(fn, world_size=4, args=(cfg,))   # fn(world: Communicator, *args)

- Each rank is a fresh process (forkserver: torch is imported once, ranks fork from it),
  with one compute thread unless asked otherwise, joined to the job's communicator on
  a free loopback port.
- If any rank raises or dies, every other rank is killed at once and RankFailedError is
  raised with the failing rank's own traceback: the root cause, not the failed
  collectives (CollectiveError: "connection closed by peer") that it causes on the others.
- Ranks die with their parent, even on SIGKILL: each watches a lifeline pipe, and exits
  when the parent's end closes. No orphan processes remain.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import pickle
import signal
import socket
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

from shardwise.comm.communicator import DEFAULT_TIMEOUT_S, CollectiveError, Communicator, LocalCommunicator

__all__ = ["launch", "RankFailedError", "JobTimeoutError", "free_port"]

_GRACE_S = 1.0  # after a first failure, how long to collect the other ranks' errors


@dataclass
class _Failure:
    rank: int
    when: float
    summary: str
    detail: str
    secondary: bool = False
    """A failed collective: most likely the effect of another rank's failure."""


class RankFailedError(RuntimeError):
    """A rank raised or died; the job was taken down. `rank` is the root cause."""

    def __init__(self, rank: int, summary: str, detail: str, pids: list[int]) -> None:
        super().__init__(f"rank {rank} failed: {summary}\n{detail}")
        self.rank, self.summary, self.detail, self.pids = rank, summary, detail, pids


class JobTimeoutError(TimeoutError):
    """The job ran past its wall-clock limit; every rank was killed."""

    def __init__(self, message: str, pids: list[int]) -> None:
        super().__init__(message)
        self.pids = pids


def free_port() -> int:
    """A TCP port on loopback that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _watch_lifeline(conn: Connection) -> None:
    with contextlib.suppress(EOFError, OSError):
        conn.recv()  # the parent never sends: this returns only by EOF
    os._exit(3)


def _send(conn: Connection, msg: tuple) -> None:
    # NOTE: plain pickle, not multiprocessing's: that one shares tensor storage through
    # file descriptors, which vanish when the rank exits before the parent reads them.
    # In-memory IPC between our own processes; nothing is ever unpickled from a file.
    conn.send_bytes(pickle.dumps(msg))


def _caused_by_collective(e: BaseException | None) -> bool:
    while e is not None:
        if isinstance(e, CollectiveError):
            return True
        e = e.__cause__ or e.__context__
    return False


def _worker(rank, world_size, port, backend, timeout_s, threads, fn, args, result_conn, lifeline) -> None:
    threading.Thread(target=_watch_lifeline, args=(lifeline,), daemon=True).start()
    # NOTE: a rank may be SIGKILLed when another fails, so it must hold no cross-process
    # semaphore (they would leak); tqdm's default lock is one, a thread lock suffices.
    from tqdm import tqdm

    tqdm.set_lock(threading.RLock())
    os.environ["OMP_NUM_THREADS"] = str(threads)
    import torch

    torch.set_num_threads(threads)
    comm: Communicator | None = None
    try:
        if world_size == 1:
            comm = LocalCommunicator()
        else:
            from shardwise.comm.torch_dist import init_torch_distributed

            comm = init_torch_distributed(
                rank=rank, world_size=world_size, master_port=port, backend=backend, timeout_s=timeout_s
            )
        result = fn(comm, *args)
        _send(result_conn, ("ok", result))
    except BaseException as e:  # noqa: BLE001 - every failure is reported to the parent
        try:
            secondary = _caused_by_collective(e)
            _send(result_conn, ("error", time.time(), f"{type(e).__name__}: {e}", traceback.format_exc(), secondary))
        finally:
            os._exit(1)  # NOTE: skip teardown: a collective with dead peers could block it
    if comm is not None:
        comm.close()


def launch(
    fn: Callable[..., Any],
    world_size: int,
    *,
    args: tuple = (),
    backend: str = "gloo",
    timeout_s: float = DEFAULT_TIMEOUT_S,
    job_timeout_s: float | None = None,
    threads_per_rank: int = 1,
) -> list[Any]:
    """Run fn(world_communicator, *args) on `world_size` local ranks; return results by rank.

    timeout_s bounds every collective; job_timeout_s (default 4x timeout_s + 60 s)
    bounds the whole job, for a rank stuck outside any collective.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if backend == "mpi" and world_size > 1:  # MPI ranks must come from mpiexec
        from shardwise.launch.mpi import launch_mpi

        return launch_mpi(
            fn,
            world_size,
            args=args,
            timeout_s=timeout_s,
            job_timeout_s=job_timeout_s,
            threads_per_rank=threads_per_rank,
        )
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "shardwise.launch.local"])
    port = free_port()
    procs, results, lifelines = [], {}, []
    pending: dict[Connection, int] = {}
    try:
        for rank in range(world_size):
            r_recv, r_send = ctx.Pipe(duplex=False)
            l_recv, l_send = ctx.Pipe(duplex=False)
            p = ctx.Process(
                target=_worker,
                args=(rank, world_size, port, backend, timeout_s, threads_per_rank, fn, args, r_send, l_recv),
                name=f"shardwise-rank{rank}",
                daemon=True,
            )
            p.start()
            r_send.close()
            l_recv.close()
            procs.append(p)
            lifelines.append(l_send)
            pending[r_recv] = rank
        deadline = time.monotonic() + (job_timeout_s if job_timeout_s is not None else 4 * timeout_s + 60)
        failures = _collect(procs, pending, results, deadline)
        if failures:
            # The root cause: a rank that raised something other than a failed collective,
            # or died; among equals, the earliest.
            root = min(failures, key=lambda f: (f.secondary, f.when))
            raise RankFailedError(root.rank, root.summary, root.detail, [p.pid for p in procs])
        return [results[r] for r in range(world_size)]
    finally:
        _kill_all(procs)
        for conn in [*lifelines, *pending]:
            conn.close()


def _collect(procs, pending: dict[Connection, int], results: dict, deadline: float) -> list[_Failure]:
    """Wait for every rank's result; stop at the first failure (after a short grace period)."""
    failures: list[_Failure] = []
    first_failure_at: float | None = None
    while pending or any(p.is_alive() for p in procs):
        now = time.monotonic()
        if first_failure_at is not None and now - first_failure_at > _GRACE_S:
            break
        if now > deadline:
            stuck = sorted(r for r in range(len(procs)) if r not in results)
            raise JobTimeoutError(f"job timed out; ranks {stuck} had not finished", [p.pid for p in procs])
        ready = wait([*pending, *(p.sentinel for p in procs if p.is_alive())], timeout=0.2)
        for obj in ready:
            if obj in pending:
                rank = pending.pop(obj)
                try:
                    msg = pickle.loads(obj.recv_bytes())
                except EOFError:
                    continue  # died without a word: the exit code below reports it
                if msg[0] == "ok":
                    results[rank] = msg[1]
                else:
                    failures.append(_Failure(rank, *msg[1:]))
        for rank, p in enumerate(procs):
            if p.exitcode not in (None, 0) and rank not in results and all(f.rank != rank for f in failures):
                if any(c for c, r in pending.items() if r == rank and c.poll()):
                    continue  # its error message is still in the pipe
                how = (
                    f"killed by signal {signal.Signals(-p.exitcode).name}"
                    if p.exitcode < 0
                    else f"exit code {p.exitcode}"
                )
                failures.append(_Failure(rank, time.time(), f"process {p.pid} {how}", ""))
                for c in [c for c, r in pending.items() if r == rank]:
                    del pending[c]
        if failures and first_failure_at is None:
            first_failure_at = time.monotonic()
    return failures


def _kill_all(procs) -> None:
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(timeout=10)
