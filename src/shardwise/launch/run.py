"""Run a job function on N ranks, however the ranks come about.

- `launch`: start N ranks ourselves and return every rank's result: child processes on
  this host (shardwise.launch.local), or for the MPI backend ranks under mpiexec
  (shardwise.launch.mpi). Both fail fast (shardwise.launch.failfast).
- `run_job`: what every command calls. Started by torchrun or mpiexec, this process is
  one rank: join and run. Otherwise `launch`.

The job function takes the world Communicator and returns a result; run_job returns only
rank 0's result (a job that needs all ranks' data gathers it itself), and None on the
other ranks of an externally launched job.

Under an external launcher a rank whose collective timed out waiting for a stuck rank
raises RankFailedError naming that rank (as our launchers do). Under mpiexec a failing
rank also ends the whole job (MPI_Abort; with gloo, by killing itself, which mpiexec
answers by killing every rank): mpiexec waits for every rank, a stopped one included.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import traceback
from collections.abc import Callable
from typing import Any

from shardwise.comm.communicator import DEFAULT_TIMEOUT_S, Communicator
from shardwise.comm.hang import set_rank_hosts
from shardwise.launch import board as boards
from shardwise.launch.env import ExternalRank, external_rank, resolve_backend
from shardwise.launch.failfast import RankFailedError, hang_failure, hang_of
from shardwise.launch.hosts import ALLOW_FLAG, HostLayoutError, gather_hosts
from shardwise.launch.local import launch_local
from shardwise.launch.mpi import launch_mpi
from shardwise.log import get_logger

__all__ = ["launch", "run_job", "LaunchError"]

log = get_logger("launch")


class LaunchError(ValueError):
    """The ranks an external launcher started do not fit the job (their number, no
    rendezvous address, a tp group across hosts); nothing ran. `quiet`: already printed
    (where the user sees it), a command need not print it again."""

    def __init__(self, message: str, *, quiet: bool = False) -> None:
        super().__init__(message)
        self.quiet = quiet


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
    """Run fn(world_communicator, *args) on `world_size` ranks started here; results by rank.

    timeout_s bounds every collective; job_timeout_s (default 4x timeout_s + 60 s;
    math.inf: none) bounds the whole job, for a rank stuck outside any collective.
    If any rank raises or dies, every rank is killed and RankFailedError names the root
    cause; past the job timeout, JobTimeoutError.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    opts = {"args": args, "timeout_s": timeout_s, "job_timeout_s": job_timeout_s, "threads_per_rank": threads_per_rank}
    if backend == "mpi" and world_size > 1:  # MPI ranks must come from mpiexec
        return launch_mpi(fn, world_size, **opts)
    return launch_local(fn, world_size, backend=backend, **opts)


def run_job(
    fn: Callable[..., Any],
    world_size: int,
    *,
    args: tuple = (),
    backend: str = "gloo",
    timeout_s: float = DEFAULT_TIMEOUT_S,
    job_timeout_s: float | None = None,
    tp: int | None = None,
    allow_cross_host_tp: bool = False,
) -> Any | None:
    """fn(world, *args) on `world_size` ranks: ours (`launch`), or torchrun's / mpiexec's
    when they started this process. Rank 0's result (None on an external launcher's
    other ranks). backend "auto" is resolved here (shardwise.launch.env.resolve_backend).

    job_timeout_s bounds the job on ranks we start (see `launch`; math.inf for a server);
    an external launcher's ranks are its own to stop.

    tp (default world_size: the whole world is one tp group) is the job's tensor-parallel
    size, its groups blocks of tp consecutive ranks (shardwise.comm.dims). Under an
    external launcher the ranks' hosts are gathered right after the rendezvous
    (shardwise.launch.hosts), and a tp group that spans hosts is refused (LaunchError, on
    every rank, before fn runs) unless allow_cross_host_tp. Ranks we start share this host.
    """
    backend = resolve_backend(backend, world_size=world_size)
    ext = external_rank()
    if ext is None:
        return launch(fn, world_size, args=args, backend=backend, timeout_s=timeout_s, job_timeout_s=job_timeout_s)[0]
    if ext.world_size != world_size:
        raise LaunchError(f"--tp {world_size} but {ext.launcher} started {ext.world_size} ranks; they must agree")
    if backend == "mpi":
        from shardwise.comm.mpi import init_mpi

        comm = init_mpi(timeout_s)
        if comm.size != ext.world_size:
            raise LaunchError(
                f"{ext.launcher} started {ext.world_size} ranks but MPI sees a world of {comm.size}: "
                f"MPI needs ranks started by mpiexec; under {ext.launcher} use --backend gloo"
            )
        _check_hosts(comm, ext, tp or world_size, allow_cross_host_tp)
        return _run(fn, comm, args, ext)
    if ext.master_addr is None or ext.master_port is None:
        raise LaunchError(
            f"started by {ext.launcher} for backend {backend!r}, but MASTER_ADDR/MASTER_PORT are not set: "
            "export them to every rank (rank 0's host and a free port), or use --backend mpi"
        )
    from shardwise.comm.torch_dist import init_torch_distributed

    comm = init_torch_distributed(
        rank=ext.rank,
        world_size=ext.world_size,
        master_addr=ext.master_addr,
        master_port=ext.master_port,
        backend=backend,
        timeout_s=timeout_s,
        init_method="env://" if ext.launcher == "torchrun" else None,
    )
    _check_hosts(comm, ext, tp or world_size, allow_cross_host_tp)
    return _run(fn, comm, args, ext)


def _check_hosts(comm: Communicator, ext: ExternalRank, tp: int, allow: bool) -> None:
    """Gather every rank's host and refuse a tp group across hosts, unless `allow`; rank 0
    logs the hosts.

    A refusal is printed once on each terminal: by rank 0 under mpiexec (which gathers every
    rank's output), by the first rank of each host under torchrun (one agent per host); then
    a barrier, so no rank exits (and has its launcher kill the others) before the printing
    ones have printed, and every rank raises LaunchError (quiet: already printed)."""
    if ext.local_world_size == ext.world_size:  # the launcher says: one host
        return
    hosts = gather_hosts(comm, ext.host)
    if len(hosts.names) == 1:
        return
    set_rank_hosts(hosts.labels)  # a hang's diagnosis names the host of a rank it cannot see
    try:
        hosts.check_tp(tp)
    except HostLayoutError as e:
        if not allow:
            printer = ext.rank == 0 if ext.launcher == "mpiexec" else hosts.ranks(ext.host)[0] == ext.rank
            if printer:
                print(f"shardwise: error: {e}", file=sys.stderr, flush=True)
            with contextlib.suppress(Exception):  # a peer gone already: the refusal still stands
                comm.barrier()
            comm.close()
            raise LaunchError(str(e), quiet=True) from None
        if ext.rank == 0:
            log.warning("tp groups span hosts (%s): %s", ALLOW_FLAG, hosts.summary())
        return
    if ext.rank == 0:
        log.info("%s; every tp=%d group inside one host", hosts.summary(), tp)


def _run(fn, comm: Communicator, args: tuple, ext: ExternalRank) -> Any | None:
    board = boards.attach(comm, launcher=ext.launcher)
    try:
        result = fn(comm, *args)
    except Exception as e:
        hang = hang_of(e)
        failure = None
        if hang is not None:
            failure = hang_failure(hang.ranks, hang.summary, ext.rank, f"{type(e).__name__}: {e}", _trace(), [])
        if ext.launcher == "mpiexec":
            boards.release(board)
            _end_mpiexec_job(comm, failure or RankFailedError(ext.rank, f"{type(e).__name__}: {e}", _trace(), []))
        if failure is not None:
            raise failure from None
        raise
    finally:
        comm.close()
    if board is not None:
        board.finish()
        if ext.rank == 0:
            boards.release(board)
    return result if ext.rank == 0 else None


def _trace() -> str:
    return traceback.format_exc().rstrip()


def _end_mpiexec_job(comm: Communicator, failure: RankFailedError) -> None:
    """Print the failure, then take every rank of the mpiexec job down. Never returns."""
    # NOTE: one write, flushed: the job may be torn down the moment this rank moves on
    end = "shardwise: ending the mpiexec job"
    print(
        f"shardwise: error: rank {failure.rank} failed: {failure.summary}\n{failure.detail}\n{end}",
        file=sys.stderr,
        flush=True,
    )
    if comm.backend == "mpi":
        from mpi4py import MPI

        MPI.COMM_WORLD.Abort(1)
    os.kill(os.getpid(), signal.SIGKILL)  # gloo: no MPI to abort with; mpiexec kills the others
