"""Many multi-process cases per launched job: a pool of gloo ranks per world size.

    results = rank_pool.run(fn, world_size, args=(...))   # like launch(fn, world_size, args=...)

Starting ranks (fresh processes and a gloo rendezvous) costs more than most parity cases.
The pool starts the ranks of a world size once, through shardwise.launch.launch in a
background thread, with a rank function that loops: receive (fn, args) over a loopback
connection with an authkey, run fn(world, *args), send back the result or the error.

- Each case starts as in a fresh process: the communication counters are reset, torch's
  random generator is re-seeded with the process's initial seed, gradients are enabled.
- Nothing a case creates outlives it: the communicators it split from the world (their
  gloo threads and sockets) are released when it ends (`Communicator.close_splits`), so a
  rank's threads and descriptors stay bounded however many cases it runs
  (`RankPool.resources`; tests/multiproc/test_rank_pool.py guards it).
- A case that fails on any rank raises RankFailedError with that rank's own traceback
  (the root cause, as launch chooses it); the ranks may be out of step after a failure,
  so the job is killed and the next case of that world size starts a new one.
- A case that runs past its timeout raises JobTimeoutError, and the job is killed.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import queue
import secrets
import signal
import threading
import time
from collections.abc import Callable
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Connection, Listener, wait
from typing import Any

from shardwise.launch import JobTimeoutError, RankFailedError, launch
from shardwise.launch.failfast import Outcomes, error_report, ok_report, recv_report, send_report

__all__ = ["RankPool", "resources"]

CASE_TIMEOUT_S = 150.0  # under pytest's per-test timeout, so a hung case fails by its own name
START_TIMEOUT_S = 120.0


def resources(world=None) -> tuple[int, int]:
    """This process's (threads, open file descriptors), from /proc."""
    return len(os.listdir("/proc/self/task")), len(os.listdir("/proc/self/fd"))


def _serve_cases(world, address: tuple[str, int], authkey: bytes) -> None:
    """The rank function of a pooled job: run (fn, args) cases until told to stop."""
    import torch

    seed = torch.initial_seed()  # what a fresh process starts from
    conn = Client(address, authkey=authkey)
    send_report(conn, ("hello", world.rank, os.getpid()))
    while True:
        try:
            case = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return  # the test session is gone
        if case is None:
            break
        fn, args = case
        world.stats.reset()
        torch.manual_seed(seed)
        try:
            with torch.enable_grad():
                result = fn(world, *args)
            world.close_splits()  # collective: every rank's case has finished with them
            report = ok_report(result)
        except BaseException as e:  # noqa: BLE001 - every failure is reported to the test
            report = error_report(e)  # the job is killed: nothing to release
        send_report(conn, report)
    conn.close()


class _Job:
    """One launched job of `world_size` ranks, each looping over cases."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        authkey = secrets.token_bytes(32)
        self._listener = Listener(("127.0.0.1", 0), backlog=64, authkey=authkey)  # every rank connects at once
        self._address, self._authkey = self._listener.address, authkey
        self._error: BaseException | None = None
        self._accepting = True
        self.conns: dict[int, Connection] = {}
        self.pids: list[int] = []
        self._thread = threading.Thread(target=self._launch, name=f"rank-pool-{world_size}", daemon=True)
        self._thread.start()
        try:
            self._accept_all()
        finally:
            self._accepting = False
            self._poke()  # ends the accept loop
            self._listener.close()

    def _launch(self) -> None:
        try:
            # NOTE: the job lives as long as the test session; each case has its own timeout.
            launch(_serve_cases, self.world_size, args=(self._address, self._authkey), job_timeout_s=7 * 24 * 3600)
        except BaseException as e:  # noqa: BLE001 - reported by the case that finds the job dead
            self._error = e

    def _poke(self) -> None:
        with contextlib.suppress(OSError, EOFError, AuthenticationError):
            Client(self._address, authkey=self._authkey).close()

    def _accept_all(self) -> None:
        accepted: queue.Queue = queue.Queue()

        def accept() -> None:
            while self._accepting:
                try:
                    accepted.put(self._listener.accept())
                except (AuthenticationError, EOFError):
                    continue  # not one of ours
                except OSError:
                    return

        threading.Thread(target=accept, name="rank-pool-accept", daemon=True).start()
        deadline = time.monotonic() + START_TIMEOUT_S
        pids: dict[int, int] = {}
        while len(self.conns) < self.world_size:
            if not self._thread.is_alive():
                raise self._dead("while starting")
            if time.monotonic() > deadline:
                self.pids = list(pids.values())
                self.kill()  # a connected rank's death ends the job; unconnected ones fail to connect
                raise JobTimeoutError(f"a pool of {self.world_size} ranks did not start in {START_TIMEOUT_S:.0f} s", [])
            with contextlib.suppress(queue.Empty):
                conn = accepted.get(timeout=0.2)
                try:
                    _, rank, pid = pickle.loads(conn.recv_bytes())
                except (EOFError, OSError):
                    continue  # a poke
                self.conns[rank], pids[rank] = conn, pid
        self.pids = [pids[r] for r in range(self.world_size)]

    def _dead(self, when: str) -> BaseException:
        self._thread.join(timeout=30)
        if isinstance(self._error, RankFailedError | JobTimeoutError):
            return self._error
        return RuntimeError(f"the pooled job of {self.world_size} ranks ended {when}: {self._error!r}")

    def run(self, fn: Callable[..., Any], args: tuple, timeout_s: float) -> list[Any]:
        __tracebackhide__ = True  # pytest shows the rank's traceback, not this loop
        blob = pickle.dumps((fn, args))
        for conn in self.conns.values():
            conn.send_bytes(blob)
        pending = {conn: rank for rank, conn in self.conns.items()}
        outcomes = Outcomes(self.world_size, self.pids)

        def poll(seconds: float) -> None:
            for conn in wait(list(pending), timeout=seconds):
                rank = pending.pop(conn)
                try:
                    outcomes.add(rank, recv_report(conn))
                except (EOFError, OSError):
                    raise self._dead("during a case") from None  # a rank died: launch names the cause
            if pending and not self._thread.is_alive():
                raise self._dead("during a case")

        # the launcher's own loop: the root cause (a rank's own error before the failed
        # collectives it caused) GRACE_S after the first failure, or a timeout
        try:
            return outcomes.collect(poll, running=lambda: bool(pending), deadline=time.monotonic() + timeout_s)
        except JobTimeoutError:
            name, stuck = getattr(fn, "__qualname__", repr(fn)), sorted(pending.values())
            raise JobTimeoutError(
                f"case {name} timed out after {timeout_s:.0f} s; ranks {stuck} had not finished", self.pids
            ) from None

    def stop(self) -> None:
        for conn in self.conns.values():
            with contextlib.suppress(OSError):
                send_report(conn, None)
        self._thread.join(timeout=30)
        self.kill()

    def kill(self) -> None:
        """SIGKILL every rank; launch sees them die and returns (its error is dropped)."""
        if self._thread.is_alive():  # NOTE: once launch has returned, its ranks are reaped: a pid may be reused
            for pid in self.pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        self._thread.join(timeout=30)
        for conn in self.conns.values():
            conn.close()


class RankPool:
    """Jobs of gloo ranks, one per world size, started on first use and reused by every case."""

    def __init__(self) -> None:
        self._jobs: dict[int, _Job] = {}

    def run(
        self, fn: Callable[..., Any], world_size: int, *, args: tuple = (), timeout_s: float = CASE_TIMEOUT_S
    ) -> list[Any]:
        """fn(world_communicator, *args) on `world_size` pooled ranks; the results by rank."""
        __tracebackhide__ = True
        if world_size not in self._jobs:
            self._jobs[world_size] = _Job(world_size)
        try:
            return self._jobs[world_size].run(fn, args, timeout_s)
        except BaseException:  # a failed, hung or interrupted case leaves the ranks out of step
            self._jobs.pop(world_size).kill()
            raise

    def resources(self, world_size: int) -> list[tuple[int, int]]:
        """Each pooled rank's (threads, open file descriptors) now, between cases."""
        return self.run(resources, world_size)

    def close(self) -> None:
        while self._jobs:
            self._jobs.popitem()[1].stop()
