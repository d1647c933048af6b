"""Fail-fast: the core both launchers share (local forkserver ranks, mpiexec ranks).

- A rank reports once, over its pipe or socket: `ok_report(result)` or
  `error_report(exception)`, sent with `send_report` and read with `recv_report`.
- The parent collects the reports with `Outcomes.collect`: every rank's result; or, after
  the first failure, every other rank's report (at least GRACE_S, at most the collective
  timeout: each live rank fails within it; a rank a report names as stuck is not waited
  for), then RankFailedError naming the root cause (`root_cause`): a rank that raised something
  other than a failed collective, or died, in preference to the CollectiveErrors
  ("connection closed by peer") its failure causes on the others; among those, a timeout
  that names the rank(s) it waited for (a hang: shardwise.comm.hang) comes first, and the
  error then names the stuck rank.
- A wall-clock deadline (`job_deadline`) bounds the whole job: JobTimeoutError.

The launchers own the transport and the processes (and kill every one of them on the
way out); this module owns the decisions, so they are made one way for every backend.
"""

from __future__ import annotations

import math
import os
import pickle
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from shardwise.comm.communicator import CollectiveError
from shardwise.comm.hang import Hang
from shardwise.memory import NEED_ENV, fmt_bytes, host_memory

__all__ = [
    "GRACE_S",
    "Failure",
    "Outcomes",
    "RankFailedError",
    "JobTimeoutError",
    "caused_by_collective",
    "hang_of",
    "hang_failure",
    "error_report",
    "job_deadline",
    "ok_report",
    "out_of_memory",
    "recv_report",
    "root_cause",
    "send_report",
]

GRACE_S = 1.0
"""After a first failure, how long at least to collect the other ranks' errors (one may be
the cause); longer while a rank that is not named stuck has not reported, up to `settle_s`
(the launchers pass the collective timeout). NOTE: the cause may report last: at pp > 1 a
server's rank 0 learns of a middle stage's error through the last stage, and needs its
own report (after answering 503 and ending its streams) before it is killed."""
_POLL_S = 0.2  # how long one wait for reports lasts, between deadline checks


class RankFailedError(RuntimeError):
    """A rank raised, died or hung; the job was taken down. `rank` is the root cause; for a
    hang, `stuck` holds every rank the others waited for (rank is the first)."""

    def __init__(self, rank: int, summary: str, detail: str, pids: list[int], stuck: tuple[int, ...] = ()) -> None:
        super().__init__(f"rank {rank} failed: {summary}\n{detail}")
        self.rank, self.summary, self.detail, self.pids, self.stuck = rank, summary, detail, pids, stuck


class JobTimeoutError(TimeoutError):
    """The job ran past its wall-clock limit; every rank was killed."""

    def __init__(self, message: str, pids: list[int]) -> None:
        super().__init__(message)
        self.pids = pids


@dataclass
class Failure:
    """One rank's failure, as the parent learnt of it."""

    rank: int
    when: float
    """time.time() of the failure (the rank's clock for a report, the parent's for a death)."""
    summary: str
    """One line: `ValueError: boom`, or how the process died."""
    detail: str = ""
    """The rank's traceback, when it could send one."""
    secondary: bool = False
    """A failed collective (or a silent death after another rank's report): most likely
    the effect of another rank's failure, not the cause."""
    stuck: tuple[int, ...] = ()
    """For a collective that timed out: the ranks it waited for (see shardwise.comm.hang)."""
    hang: str = ""
    """Then: what they were doing, one line (Hang.summary)."""
    aborted: bool = False
    """Died by SIGABRT: maybe NCCL's watchdog, ending a rank whose collective timed out."""


def hang_of(e: BaseException | None) -> Hang | None:
    """The hang diagnosis of a CollectiveError that is `e` or in its chain of causes."""
    while e is not None:
        if isinstance(e, CollectiveError) and e.hang is not None:
            return e.hang
        e = e.__cause__ or e.__context__
    return None


def hang_failure(
    stuck: tuple[int, ...], summary: str, reporter: int, error: str, detail: str, pids: list[int]
) -> RankFailedError:
    """The RankFailedError of a hang: it names the stuck rank(s) and what they were doing
    (`summary`, Hang.summary); its detail is what rank `reporter` saw (its traceback, or
    else its `error`)."""
    seen = detail.rstrip() or error
    return RankFailedError(stuck[0], summary, f"what rank {reporter} saw:\n{seen}", pids, stuck=stuck)


def caused_by_collective(e: BaseException | None) -> bool:
    """Whether a CollectiveError is `e` or anywhere in its chain of causes."""
    while e is not None:
        if isinstance(e, CollectiveError):
            return True
        e = e.__cause__ or e.__context__
    return False


def root_cause(failures: list[Failure]) -> Failure:
    """The failure to report: a rank that raised something other than a failed collective,
    or died; else a collective that timed out and names the rank(s) it waited for; else any
    failed collective. Among equals, the earliest."""
    if not failures:
        raise ValueError("root_cause of no failures")
    return min(failures, key=lambda f: (0 if not f.secondary else 1 if f.stuck else 2, f.when))


def job_deadline(timeout_s: float, job_timeout_s: float | None) -> float:
    """time.monotonic() past which the job is killed: job_timeout_s from now (math.inf:
    never), by default 4x the collective timeout + 60 s."""
    limit = job_timeout_s if job_timeout_s is not None else 4 * timeout_s + 60
    return math.inf if math.isinf(limit) else time.monotonic() + limit


def out_of_memory(world_size: int, ooms_before: int | None, ooms_after: int | None) -> str | None:
    """Words for a rank the kernel's out-of-memory killer ended, when the cgroup's oom_kill count
    grew while the job ran (shardwise.memory.oom_kills, read by the launcher before and after),
    with the bytes the command's pre-check estimated (NEED_ENV) and what the host allows now;
    None when it did not grow or could not be read."""
    if ooms_before is None or ooms_after is None or ooms_after <= ooms_before:
        return None
    words = f"killed by the out-of-memory killer (cgroup oom_kill {ooms_before} -> {ooms_after})"
    need = os.environ.get(NEED_ENV)
    try:
        host = host_memory()
    except ValueError:  # an unreadable SHARDWISE_MEMORY_LIMIT: the count alone says enough
        host = None
    said = [f"it needed about {fmt_bytes(int(need))}"] if need else []
    said += [f"the host allowed {fmt_bytes(host.available)} ({host.source}) for {world_size} ranks"] if host else []
    return words + ("; " + ", ".join(said) if said else "")


# ---- a rank's report ------------------------------------------------------------------------
def ok_report(result: Any) -> tuple:
    return ("ok", result)


def error_report(e: BaseException) -> tuple:
    """The report of a rank whose job raised `e` (call it inside the `except`)."""
    hang = hang_of(e)
    stuck, words = (hang.ranks, hang.summary) if hang is not None else ((), "")
    return (
        "error",
        time.time(),
        f"{type(e).__name__}: {e}",
        traceback.format_exc(),
        caused_by_collective(e),
        stuck,
        words,
    )


def send_report(conn: Connection, report: tuple) -> None:
    # NOTE: plain pickle, not multiprocessing's: that one shares tensor storage through
    # file descriptors, which vanish when the rank exits before the parent reads them.
    # In-memory IPC between our own processes; nothing is ever unpickled from a file.
    conn.send_bytes(pickle.dumps(report))


def recv_report(conn: Connection) -> tuple:
    """A rank's report; EOFError (or OSError) if it went away without one."""
    return pickle.loads(conn.recv_bytes())  # in-memory IPC from our own rank process


# ---- the parent's side ----------------------------------------------------------------------
class Outcomes:
    """What the parent knows of each rank: its result, or its failure."""

    def __init__(self, world_size: int, pids: list[int]) -> None:
        self.world_size, self.pids = world_size, pids
        self.results: dict[int, Any] = {}
        self.failures: list[Failure] = []

    def add(self, rank: int, report: tuple) -> None:
        """Record a rank's report (ok_report or error_report)."""
        if report[0] == "ok":
            self.results[rank] = report[1]
        else:
            self.failures.append(Failure(rank, *report[1:]))

    def died(self, rank: int, summary: str, *, secondary: bool = False, aborted: bool = False) -> None:
        """Record a rank that went away without a report."""
        self.failures.append(Failure(rank, time.time(), summary, "", secondary, aborted=aborted))

    def settled(self, rank: int) -> bool:
        return rank in self.results or any(f.rank == rank for f in self.failures)

    def awaited(self) -> list[int]:
        """The ranks whose report may still come: not settled, and named stuck by no report."""
        stuck = {r for f in self.failures for r in f.stuck}
        return [r for r in range(self.world_size) if not self.settled(r) and r not in stuck]

    def collect(
        self,
        poll: Callable[[float], None],
        *,
        running: Callable[[], bool],
        deadline: float,
        on_first_failure: Callable[[Failure], None] | None = None,
        diagnose: Callable[[], Hang | None] | None = None,
        settle_s: float = GRACE_S,
    ) -> list[Any]:
        """Call poll(seconds) (which waits that long at most and records what arrived) while
        running(); return the results by rank, or raise RankFailedError for the root cause
        once every rank the first failure left running has reported (`awaited`), but not
        before GRACE_S nor after max(GRACE_S, settle_s); or JobTimeoutError past the deadline.
        on_first_failure(failure) is called once, e.g. to tell the survivors. diagnose()
        reads the progress board when no rank's report names a hang and no rank raised a
        real error (their collectives failed without a diagnosis, or NCCL's watchdog aborted
        them): a hang it finds is the root cause."""
        first_failure_at: float | None = None
        while running():
            now = time.monotonic()
            waited = now - first_failure_at if first_failure_at is not None else None
            if waited is not None and waited > GRACE_S and (not self.awaited() or waited > settle_s):
                break
            if now > deadline:
                stuck = sorted(r for r in range(self.world_size) if r not in self.results)
                raise JobTimeoutError(f"job timed out; ranks {stuck} had not finished", self.pids)
            poll(_POLL_S)
            if self.failures and first_failure_at is None:
                first_failure_at = time.monotonic()
                if on_first_failure is not None:
                    on_first_failure(self.failures[0])
        if self.failures:
            root = root_cause(self.failures)
            if root.stuck:
                raise hang_failure(root.stuck, root.hang, root.rank, root.summary, root.detail, self.pids)
            if diagnose is not None and (root.secondary or root.aborted):
                hang = _quietly(diagnose)
                if hang is not None and not (root.aborted and root.rank in hang.ranks):
                    raise hang_failure(hang.ranks, hang.summary, root.rank, root.summary, root.detail, self.pids)
            raise RankFailedError(root.rank, root.summary, root.detail, self.pids)
        missing = [r for r in range(self.world_size) if r not in self.results]
        if missing:  # ended without a word, and without an error code
            raise RankFailedError(missing[0], "exited without reporting a result", "", self.pids)
        return [self.results[r] for r in range(self.world_size)]


def _quietly(diagnose: Callable[[], Hang | None]) -> Hang | None:
    try:
        return diagnose()
    except Exception:  # noqa: BLE001 - a failed diagnosis must not hide the failure itself
        return None
