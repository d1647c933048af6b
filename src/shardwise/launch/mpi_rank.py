"""One MPI rank started by shardwise.launch.mpi: fetch the job, run it, report back.

The process mpiexec starts forks at once: the child, in a session of its own, is the
rank; the parent only stands in for it (it waits, and exits with the rank's status).
mpiexec's proxy (hydra) may SIGKILL the process groups of every process it started when
one of them dies by a signal, even with -disable-auto-cleanup (it depends on which it
notices first: the death or the closed PMI socket). That would take a server's rank 0
down at once, with no 503 and no error for its clients. The rank is out of reach of
that: it learns of a dead peer from our launcher (`_watch`) and fails with an error of
its own; the launcher kills every rank by pid when the job ends.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import pickle
import signal
import sys
import threading
from multiprocessing.connection import Client


def _watch(conn, board_dir: str | None) -> None:
    """Exit when the parent has gone (EOF); pass on its notice that another rank died."""
    from shardwise.comm.mpi import peer_failed
    from shardwise.comm.shm_segment import remove_segments
    from shardwise.launch.board import remove_dir

    try:
        while True:
            peer_failed(pickle.loads(conn.recv_bytes()))  # in-memory IPC with our parent
    except (EOFError, OSError):
        remove_dir(board_dir)  # the parent may have died (SIGKILL) without removing it
        remove_segments([os.getpid()])  # a shared-memory segment this rank made, not yet unlinked
        os._exit(3)


def _load_main(path: str) -> None:
    """Make the parent's __main__ module importable, for functions defined in a script."""
    spec = importlib.util.spec_from_file_location("__mp_main__", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["__mp_main__"] = module
    spec.loader.exec_module(module)  # a script guarded by `if __name__ == "__main__"` runs nothing
    sys.modules["__main__"] = module


def _stand_in(rank_pid: int) -> None:
    """The process mpiexec knows: wait for the rank, exit with its status. Never returns."""
    fd = os.environ.get("PMI_FD")
    if fd is not None and fd.isdigit():  # the rank's PMI socket: its closing tells mpiexec the rank ended
        with contextlib.suppress(OSError):
            os.close(int(fd))
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # hydra's notice that a peer died: the rank hears it from us
    _, status = os.waitpid(rank_pid, 0)
    code = os.waitstatus_to_exitcode(status)
    os._exit(code if code >= 0 else 128 - code)  # NOTE: an exit code, not the signal: see the module doc


def main() -> None:
    rank_pid = os.fork()  # NOTE: before MPI starts (importing mpi4py.MPI does): only the rank joins the job
    if rank_pid != 0:
        _stand_in(rank_pid)
    os.setsid()
    _rank()


def _rank() -> None:
    from mpi4py import MPI

    from shardwise.comm.mpi import init_mpi
    from shardwise.launch import board as boards
    from shardwise.launch.failfast import error_report, ok_report, send_report

    host, port = os.environ["SHARDWISE_LAUNCH_ADDR"].rsplit(":", 1)
    conn = Client((host, int(port)), authkey=bytes.fromhex(os.environ["SHARDWISE_LAUNCH_KEY"]))
    conn.send_bytes(pickle.dumps((MPI.COMM_WORLD.Get_rank(), os.getpid())))
    sys_path, main_file, board_dir = pickle.loads(conn.recv_bytes())
    job = conn.recv_bytes()
    threading.Thread(target=_watch, args=(conn, board_dir), daemon=True).start()
    try:
        sys.path[:] = sys_path  # as multiprocessing does: the parent's imports must resolve here
        if main_file:
            _load_main(main_file)
        fn, args, timeout_s, threads = pickle.loads(job)  # in-memory IPC with our parent
        import torch
        from tqdm import tqdm

        torch.set_num_threads(threads)
        tqdm.set_lock(threading.RLock())
        world = init_mpi(timeout_s)
        board = boards.attach(world, directory=board_dir)  # the directory our launcher made
        result = fn(world, *args)
        if board is not None:
            board.finish()
        send_report(conn, ok_report(result))
    except BaseException as e:  # noqa: BLE001 - every failure goes to the parent
        try:
            send_report(conn, error_report(e))
        finally:
            os._exit(1)


if __name__ == "__main__":
    main()
