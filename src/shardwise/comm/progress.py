"""The progress board: where each rank is, published for the others, so that a hang can name
the rank that never arrived (shardwise.comm.hang reads it).

Each process keeps one Board, which Communicator._run updates in memory on every operation
(a dict update and three attribute stores): the operation it is in (op, group, its sequence
number on that group's channel, when it started), or the last one it finished, and how many
operations it has entered on each channel. A daemon thread publishes that record as JSON
every HEARTBEAT_S, stamped with the time: a record that stops changing is a rank that stopped.

A channel is what one sequence number counts: the collectives of one group (every member
enters the same sequence of them), or the point-to-point messages from one rank to another
in a group. A rank waiting in a channel's n-th operation can tell from a peer's count on
that channel whether the peer ever arrived.

Where records are published (a Sink; shardwise.launch.board chooses):

- DirSink: a directory, one file per rank, replaced atomically. Our launchers create one
  (SHARDWISE_BOARD); a user can name a directory shared by several hosts.
- StoreSink: a torch.distributed store, e.g. torchrun's agent store (a stuck rank cannot
  take it down: the agent, not a rank, hosts it).

SHARDWISE_DEBUG_HANG="RANK:OP/GROUP#N:stop|sleep" makes rank RANK stop itself (SIGSTOP) or
sleep for an hour just before its first OP on GROUP from the group's N-th operation on:
fault injection for tests.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import threading
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

__all__ = [
    "Board",
    "DirSink",
    "StoreSink",
    "Fault",
    "Sink",
    "HEARTBEAT_S",
    "BOARD_ENV",
    "FAULT_ENV",
    "channel",
    "read_records",
]

HEARTBEAT_S = 0.25
"""How often each rank publishes its record."""
BOARD_ENV = "SHARDWISE_BOARD"
FAULT_ENV = "SHARDWISE_DEBUG_HANG"


def channel(name: str, members: tuple[int, ...]) -> str:
    """The key of a group's collectives: its name and a checksum of its members' world ranks
    (two groups of one name, e.g. the tp groups of successive jobs in one process, differ)."""
    return f"{name}@{zlib.crc32(repr(members).encode()):08x}"


class Sink(Protocol):
    def write(self, rank: int, text: str) -> None: ...

    def read(self, rank: int) -> str | None: ...


class DirSink:
    """One JSON file per rank in a directory (atomically replaced, so never read half-written)."""

    def __init__(self, path: str | Path, *, owned: bool = False) -> None:
        self.path = Path(path)
        self.owned = owned
        """Made for this job alone: removed when it ends (shardwise.launch.board.release)."""

    def write(self, rank: int, text: str) -> None:
        tmp = self.path / f".rank{rank}.{os.getpid()}.tmp"
        tmp.write_text(text)
        os.replace(tmp, self.path / f"rank{rank}.json")

    def read(self, rank: int) -> str | None:
        try:
            return (self.path / f"rank{rank}.json").read_text()
        except OSError:
            return None

    def __repr__(self) -> str:
        return f"directory {self.path}"


class StoreSink:
    """One key per rank in a torch.distributed Store (TCPStore)."""

    def __init__(self, store, prefix: str = "shardwise/board") -> None:
        self.store, self.prefix = store, prefix

    def write(self, rank: int, text: str) -> None:
        self.store.set(f"{self.prefix}/{rank}", text)

    def read(self, rank: int) -> str | None:
        key = f"{self.prefix}/{rank}"
        try:
            return self.store.get(key).decode() if self.store.check([key]) else None
        except RuntimeError:  # the store's host is gone
            return None

    def __repr__(self) -> str:
        return f"store {self.prefix}"


@dataclass(frozen=True)
class Fault:
    """Stop (SIGSTOP) or sleep on `rank` just before its first `op` on `group` numbered `seq`
    or later (the group's operations of every kind are numbered together; tests only)."""

    rank: int
    op: str
    group: str
    seq: int
    how: str

    @classmethod
    def parse(cls, text: str) -> Fault:
        m = re.fullmatch(r"(\d+):(\w+)/(\w+)#(\d+):(stop|sleep)", text.strip())
        if m is None:
            raise ValueError(f"{FAULT_ENV}={text!r}: expected RANK:OP/GROUP#N:stop|sleep, e.g. 1:all_reduce/tp#5:stop")
        return cls(int(m[1]), m[2], m[3], int(m[4]), m[5])

    def check(self, op: str, group: str, seq: int) -> None:
        if (op, group) == (self.op, self.group) and seq >= self.seq:
            if self.how == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)
            else:
                time.sleep(3600)


def read_records(sink: Sink, world_size: int, *, skip: int = -1) -> dict[int, dict[str, Any]]:
    """The records published on `sink` by ranks 0..world_size-1 (but `skip`), by rank."""
    records: dict[int, dict[str, Any]] = {}
    for rank in range(world_size):
        text = sink.read(rank) if rank != skip else None
        with contextlib.suppress(ValueError):
            if text:
                records[rank] = json.loads(text)
    return records


class Board:
    """This process's progress record, published by a heartbeat thread (see the module doc)."""

    __slots__ = (
        "rank", "world_size", "sink", "backend", "pid", "host", "counts", "current", "idle_since", "pending",
        "state", "fault", "_wall", "_stop", "_thread",
    )  # fmt: skip

    def __init__(self, rank: int, world_size: int, sink: Sink | None, *, backend: str = "") -> None:
        self.rank, self.world_size, self.sink, self.backend = rank, world_size, sink, backend
        self.pid, self.host = os.getpid(), socket.gethostname()
        self.counts: dict[str, int] = {}
        """Operations entered, by channel."""
        self.current: tuple | None = None
        """(channel, op, group, seq, start perf_counter, peer group rank | None, group members):
        the operation in progress, or, once idle_since is later than its start, the last one."""
        self.idle_since = time.perf_counter()
        """When the last operation ended (perf_counter)."""
        self.pending: dict[tuple[str, int], tuple] = {}
        """Asynchronous operations in flight (Communicator.pending), entries as `current`."""
        self.state = "running"  # or "done"
        self._wall = time.time() - time.perf_counter()  # perf_counter -> time.time()
        fault = os.environ.get(FAULT_ENV)
        parsed = Fault.parse(fault) if fault else None
        self.fault = parsed if parsed is not None and parsed.rank == rank else None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- the record -------------------------------------------------------------------------
    def record(self) -> dict[str, Any]:
        """This rank's record, as published: JSON-ready."""
        cur, idle_since = self.current, self.idle_since
        busy = cur is not None and idle_since < cur[4]
        rec: dict[str, Any] = {
            "rank": self.rank,
            "pid": self.pid,
            "host": self.host,
            "backend": self.backend,
            "beat": time.time(),
            "state": self.state,
            "counts": dict(self.counts),
            "op": None,
            "last": None,
            "pending": sorted((self._entry(e) for e in list(self.pending.values())), key=lambda e: e["start"]),
        }
        if cur is not None:
            entry = self._entry(cur)
            if busy:
                rec["op"] = entry
            else:
                entry["end"] = idle_since + self._wall
                rec["last"] = entry
        else:
            rec["idle_since"] = idle_since + self._wall
        return rec

    def _entry(self, op_tuple: tuple) -> dict[str, Any]:
        chan, op, group, seq, t0, peer, members = op_tuple
        return {
            "op": op,
            "group": group,
            "chan": chan,
            "seq": seq,
            "start": t0 + self._wall,
            "members": list(members),
            "peer": members[peer] if peer is not None else None,
        }

    def publish(self) -> None:
        if self.sink is not None:
            with contextlib.suppress(Exception):  # a board that cannot publish must not fail the job
                self.sink.write(self.rank, json.dumps(self.record()))

    def read_all(self) -> dict[int, dict[str, Any]]:
        """Every rank's last published record (this rank's fresh); ranks without one are absent."""
        others = read_records(self.sink, self.world_size, skip=self.rank) if self.sink is not None else {}
        return {**others, self.rank: self.record()}

    # ---- the heartbeat ----------------------------------------------------------------------
    def start(self) -> Board:
        """Publish now, then every HEARTBEAT_S from a daemon thread."""
        self.publish()
        if self.sink is not None and self._thread is None:
            self._thread = threading.Thread(target=self._beat, name="shardwise-board", daemon=True)
            self._thread.start()
        return self

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            self.publish()

    def finish(self) -> None:
        """The job function returned: say so (a peer still waiting is told this rank is done)."""
        self.state = "done"
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * HEARTBEAT_S)
        self.publish()
