"""Where a job's progress board lives (shardwise.comm.progress), chosen by who started the ranks.

- Our launchers (shardwise.launch.local, .mpi): a fresh directory on this host (`new_dir`),
  passed to every rank, read by the launcher too (`diagnose_dir`) and removed at the end.
- torchrun: its agent's TCPStore (MASTER_ADDR:MASTER_PORT), which a stuck rank cannot take down.
- An external mpiexec: SHARDWISE_BOARD if set (a directory every host sees, for a job on
  several hosts), else a directory rank 0 creates in the temp dir and names to the others
  (the same path on each host: each host's ranks see that host's records only, and a rank
  on another host shows as "published no progress record"). Rank 0 removes it when the
  job succeeds, the rank that ends a failed job when it does; on a host without either,
  it stays in the temp dir.

SHARDWISE_BOARD=off turns the board off (then a timeout cannot name the stuck rank).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
from pathlib import Path

import torch

from shardwise.comm.communicator import Communicator
from shardwise.comm.hang import Hang, diagnose
from shardwise.comm.progress import BOARD_ENV, Board, DirSink, Sink, StoreSink, read_records

__all__ = ["attach", "release", "new_dir", "remove_dir", "diagnose_dir"]

_PATH_BYTES = 1024


def new_dir() -> str | None:
    """A fresh board directory for a job whose ranks we start (None if none can be made: the
    job runs without one)."""
    try:
        return tempfile.mkdtemp(prefix="shardwise-board-")
    except OSError:
        return None


def remove_dir(path: str | None) -> None:
    if path is not None:
        shutil.rmtree(path, ignore_errors=True)


def attach(world: Communicator, *, directory: str | None = None, launcher: str | None = None) -> Board | None:
    """Give `world` (and its later splits) a progress board and start its heartbeat; None for
    a single rank, or when none is reachable. `directory`: ours (our launchers); otherwise
    SHARDWISE_BOARD, or the launcher's ("torchrun", "mpiexec") way (see the module doc).
    Collective under an external mpiexec without SHARDWISE_BOARD."""
    if world.size == 1 or os.environ.get(BOARD_ENV) == "off":
        return None
    path, owned = directory or os.environ.get(BOARD_ENV), False
    if not path and launcher == "mpiexec":
        path, owned = _named_by_rank0(world), True  # collective: before anything that may fail on one rank
    sink: Sink | None = None
    try:
        if path:
            Path(path).mkdir(parents=True, exist_ok=True)  # on each host, for a temporary directory
            sink = DirSink(path, owned=owned)
        elif launcher == "torchrun":
            sink = _torchrun_store()
    except (OSError, RuntimeError):  # no board is no reason to fail the job
        return None
    if sink is None:
        return None
    board = Board(world.rank, world.size, sink, backend=world.backend)
    world.attach_board(board)
    return board.start()


def release(board: Board | None) -> None:
    """Remove the board's directory if it was made for this job alone (an external mpiexec's)."""
    if board is not None and isinstance(board.sink, DirSink) and board.sink.owned:
        remove_dir(str(board.sink.path))


def _torchrun_store() -> Sink | None:
    """A client of torchrun's agent store, under a key prefix of this run and restart."""
    from shardwise.comm.torch_dist import store_client

    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not addr or not port:
        return None
    store = store_client(addr, int(port))
    run = f"{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    return _Bounded(StoreSink(store, f"shardwise/board/{run}"))


class _Bounded:
    """A sink whose every write and read returns within `limit_s`. NOTE: a TCPStore client's
    socket reads have no timeout: with the store's host cut off (its link down, tested in
    tests/e2e/test_netns.py) a read blocks for good, and the rank whose collective timed out
    never gets to raise. An operation that overruns marks the sink dead: it does nothing after."""

    def __init__(self, sink: Sink, limit_s: float = 5.0) -> None:
        self.sink, self.limit_s, self.dead = sink, limit_s, False

    def _call(self, fn, *args):
        if self.dead:
            return None
        box: list = []

        def run() -> None:
            try:
                box.append((True, fn(*args)))
            except Exception as e:  # noqa: BLE001 - handed to the caller
                box.append((False, e))

        t = threading.Thread(target=run, name="shardwise-board-op", daemon=True)
        t.start()
        t.join(self.limit_s)
        if not box:
            self.dead = True  # the thread stays blocked; a daemon, it never holds the process
            return None
        ok, value = box[0]
        if not ok:
            raise value
        return value

    def write(self, rank: int, text: str) -> None:
        self._call(self.sink.write, rank, text)

    def read(self, rank: int) -> str | None:
        return self._call(self.sink.read, rank)

    def __repr__(self) -> str:
        return repr(self.sink)


def _named_by_rank0(world: Communicator) -> str | None:
    """A directory rank 0 creates, its path broadcast to every rank (each creates it on its host)."""
    buf = torch.zeros(_PATH_BYTES, dtype=torch.uint8, device=world.device)
    if world.rank == 0:
        raw = (new_dir() or "").encode()[:_PATH_BYTES]
        buf[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    buf = world._broadcast(buf, 0)  # NOTE: the raw primitive: not counted, and no board yet
    return bytes(buf.cpu().tolist()).rstrip(b"\0").decode() or None


def diagnose_dir(path: str | None, world_size: int) -> Hang | None:
    """The launcher's diagnosis from a board directory on this host (every rank's record)."""
    if path is None:
        return None
    return diagnose(read_records(DirSink(path), world_size), now=time.time())
