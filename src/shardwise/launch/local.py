"""Start N ranks on this host as child processes and run one function on each.

    results = launch_local(fn, world_size=4, args=(cfg,))   # fn(world: Communicator, *args)

- Each rank is a fresh process (forkserver: torch is imported once, ranks fork from it),
  with one compute thread unless asked otherwise, joined to the job's communicator on
  a free loopback port.
- Fail-fast (shardwise.launch.failfast): if any rank raises or dies, every other rank is
  killed at once and RankFailedError is raised with the root cause's own traceback.
- Ranks die with their parent, even on SIGKILL: each watches a lifeline pipe, and exits
  when the parent's end closes. No orphan processes remain.
- Each rank publishes its progress to a board directory this process creates (and removes),
  so a collective that times out names the rank it waited for (shardwise.launch.board).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import socket
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import Any

from shardwise.comm.communicator import DEFAULT_TIMEOUT_S, Communicator, LocalCommunicator
from shardwise.comm.shm_segment import remove_segments
from shardwise.launch import board as boards
from shardwise.launch.failfast import (
    Outcomes,
    error_report,
    job_deadline,
    ok_report,
    out_of_memory,
    recv_report,
    send_report,
)
from shardwise.memory import oom_kills

__all__ = ["launch_local", "free_port", "death"]


PRELOAD: list[str] = []
"""More modules for the forkserver to import once, before it forks ranks (with those named
in SHARDWISE_PRELOAD, comma-separated). E.g. "torch._dynamo": building an optimizer imports
it, about a second of CPU in every training rank. Only the first launch of a process
counts: its forkserver serves every later one."""


def _extra_preload() -> list[str]:
    return PRELOAD + [m for m in os.environ.get("SHARDWISE_PRELOAD", "").split(",") if m.strip()]


def free_port() -> int:
    """A TCP port on loopback that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _watch_lifeline(conn: Connection, board_dir: str | None) -> None:
    with contextlib.suppress(EOFError, OSError):
        conn.recv()  # the parent never sends: this returns only by EOF
    boards.remove_dir(board_dir)  # the parent may have died (SIGKILL) without removing it
    remove_segments([os.getpid()])  # a shared-memory segment this rank made, not yet unlinked
    os._exit(3)


def _worker(rank, world_size, port, backend, timeout_s, threads, board_dir, fn, args, result_conn, lifeline) -> None:
    threading.Thread(target=_watch_lifeline, args=(lifeline, board_dir), daemon=True).start()
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
        board = boards.attach(comm, directory=board_dir)
        result = fn(comm, *args)
        if board is not None:
            board.finish()
        send_report(result_conn, ok_report(result))
    except BaseException as e:  # noqa: BLE001 - every failure is reported to the parent
        try:
            send_report(result_conn, error_report(e))
        finally:
            os._exit(1)  # NOTE: skip teardown: a collective with dead peers could block it
    if comm is not None:
        comm.close()


def launch_local(
    fn: Callable[..., Any],
    world_size: int,
    *,
    args: tuple = (),
    backend: str = "gloo",
    timeout_s: float = DEFAULT_TIMEOUT_S,
    job_timeout_s: float | None = None,
    threads_per_rank: int = 1,
) -> list[Any]:
    """Run fn(world_communicator, *args) on `world_size` child processes (gloo or NCCL);
    results by rank. See shardwise.launch.launch for the timeouts."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "shardwise.launch.local", *_extra_preload()])
    port = free_port()
    ooms = oom_kills()  # before: a SIGKILLed rank is the OOM killer's if the count grew
    board_dir = boards.new_dir()
    procs, lifelines = [], []
    pending: dict[Connection, int] = {}
    try:
        for rank in range(world_size):
            r_recv, r_send = ctx.Pipe(duplex=False)
            l_recv, l_send = ctx.Pipe(duplex=False)
            worker_args = (rank, world_size, port, backend, timeout_s, threads_per_rank, board_dir)
            p = ctx.Process(
                target=_worker,
                args=(*worker_args, fn, args, r_send, l_recv),
                name=f"shardwise-rank{rank}",
                daemon=True,
            )
            p.start()
            r_send.close()
            l_recv.close()
            procs.append(p)
            lifelines.append(l_send)
            pending[r_recv] = rank
        deadline = job_deadline(timeout_s, job_timeout_s)
        outcomes = Outcomes(world_size, [p.pid for p in procs])
        return outcomes.collect(
            lambda seconds: _poll(procs, pending, outcomes, seconds, ooms),
            running=lambda: bool(pending) or any(p.is_alive() for p in procs),
            deadline=deadline,
            diagnose=lambda: boards.diagnose_dir(board_dir, world_size),
            settle_s=timeout_s,  # a live rank fails within it: its report may be the cause
        )
    finally:
        _kill_all(procs)
        remove_segments([p.pid for p in procs])  # a rank that died while making its segment
        for conn in [*lifelines, *pending]:
            conn.close()
        boards.remove_dir(board_dir)


def death(exitcode: int, world_size: int, ooms_before: int | None, ooms_after: int | None) -> str:
    """How a rank died, in words: its exit code or signal; for SIGKILL whether the kernel's
    out-of-memory killer did it (failfast.out_of_memory), "possibly out of memory" where the
    cgroup's count cannot be read."""
    if exitcode >= 0:
        return f"exit code {exitcode}"
    how = f"killed by signal {signal.Signals(-exitcode).name}"
    if exitcode != -signal.SIGKILL:
        return how
    if ooms_before is None or ooms_after is None:
        return how + " (possibly out of memory: the cgroup's OOM count is not readable)"
    return out_of_memory(world_size, ooms_before, ooms_after) or how


def _poll(procs, pending: dict[Connection, int], outcomes: Outcomes, seconds: float, ooms: int | None) -> None:
    """Wait up to `seconds` for reports and exits; record them in `outcomes`."""
    for obj in wait([*pending, *(p.sentinel for p in procs if p.is_alive())], timeout=seconds):
        if obj in pending:
            rank = pending.pop(obj)
            try:
                outcomes.add(rank, recv_report(obj))
            except EOFError:
                continue  # died without a word: the exit code below reports it
    for rank, p in enumerate(procs):
        if p.exitcode not in (None, 0) and not outcomes.settled(rank):
            if any(c for c, r in pending.items() if r == rank and c.poll()):
                continue  # its error report is still in the pipe
            how = death(p.exitcode, len(procs), ooms, oom_kills() if p.exitcode == -signal.SIGKILL else None)
            outcomes.died(rank, f"process {p.pid} {how}", aborted=p.exitcode == -signal.SIGABRT)
            for c in [c for c, r in pending.items() if r == rank]:
                del pending[c]


def _kill_all(procs) -> None:
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(timeout=10)
