"""Collectives over direct TCP connections, for a group whose ranks are on different hosts.

    tp = across_hosts(tp, parent=world, mode="auto")

wraps a group's gloo communicator so that its all-reduces, all-gathers, reduce-scatters,
broadcasts and all-to-alls go over one TCP connection between each pair of its ranks, made
once, at setup, and driven by the calling thread itself; point-to-point, the asynchronous
all-reduce and the barrier stay the wrapped communicator's.

Why: gloo hands every operation to a worker thread, which hands the socket to its I/O loop
thread and back; on a small host (a VM's core or two) each hand-off is a sleep and a wake, and
a 1 KiB all-reduce between two namespace hosts cost gloo 1.3-2.6 ms on average (a tail of
several ms), and 43-214 us this way (benchmarks/veth_tail.py; docs/benchmarks/links.md,
"Collectives over direct TCP"). A decode
step makes two all-reduces a layer: across hosts, that is the step.

Each call sends every peer a 24-byte header (the call's number, the operation, the payload's
bytes) and the payload, and reads the same from each: a peer that makes another call, or
another size, fails both with both named instead of exchanging garbage. Sums run in rank
order on every rank (fp32 for half precision), so the replicas stay bitwise equal. Two ranks
exchange whole tensors (what a ring would send too); more ranks exchange whole tensors up to
SPLIT_BYTES, and above it reduce-scatter, then all-gather, chunk by chunk (2 (n-1)/n of the
bytes a rank sends, as a ring).

A rank whose peers have not answered retries on its own thread for up to 2 ms (yielding its core
after the first 50 us), then sleeps in select: a decode step's peers are rarely further apart,
and a sleep's wake-up is slow on a VM (_YIELD_S).

No wait is unbounded: a peer whose connection closes (its process ended: the kernel closes
its sockets) fails the call at once, naming the rank; a peer that sends nothing within the
communicator's timeout (a host cut off) fails it after the timeout. A rank whose call failed
closes its connections, so its peers fail at once too.
"""

from __future__ import annotations

import os
import secrets
import select
import socket
import struct
import time

import torch

from shardwise.comm.communicator import Communicator, ReduceOp
from shardwise.comm.shm import ShmCommunicator, _reduce
from shardwise.comm.shm_segment import host_key
from shardwise.comm.wrapped import Wrapped, take_place
from shardwise.log import get_logger

__all__ = ["TcpCommunicator", "across_hosts", "tcp_mode", "MODE_ENV", "MODES", "ADDR_ENV"]

log = get_logger("comm")

MODE_ENV = "SHARDWISE_TCP_COLLECTIVES"
"""auto (the default): every gloo group whose ranks are on more than one host; on: every gloo
or MPI group, one host or several (a warning where it cannot be used); off: the backend's."""
MODES = ("auto", "on", "off")
ADDR_ENV = "SHARDWISE_TCP_ADDR"
"""The address this rank listens on for its peers (default: GLOO_SOCKET_IFNAME's address, else
the one that routes to MASTER_ADDR, else the hostname's; 127.0.0.1 when the group is on one host)."""
SPLIT_BYTES = 256 << 10
"""Above this, a group of more than two ranks all-reduces as reduce-scatter then all-gather."""

_HEADER = struct.Struct("<qqq")  # call number, operation, payload bytes
_OPS = {"all_reduce": 1, "all_gather": 2, "reduce_scatter": 3, "broadcast": 4, "all_to_all": 5}
_SPIN_S = 50e-6  # retries back to back before a waiting rank yields its core between them
_YIELD_S = float(os.environ.get("SHARDWISE_TCP_SPIN_US", "2000")) * 1e-6
"""How long a waiting rank retries (yielding its core between tries: a peer on the same core
runs) before it sleeps in select. A sleeping rank's wake-up is what a small exchange costs on a
VM: the built-in model's decode across two namespace hosts at 1 Gbit/s took 1.94-5.32 ms a
token (medians of 3 launches; median 2.00 over 5 runs) with 50 us of retries and 1.43-2.00 ms
(median 1.74 over 9 runs) with 2 ms (Intel Xeon model 207, 2026-12-07,
docs/benchmarks/tcp_spin_ab_xeon207.txt). The yields cost
nothing measurable there and let a rank that shares its core with the peer it waits for run it."""
_TICK_S = 0.1  # select's longest sleep: how often a waiting rank looks at the clock
_SETUP_S = 30.0
_CLOSED = "closed its connection (its process ended or failed)"


def tcp_mode(environ: dict[str, str] | None = None) -> str:
    """SHARDWISE_TCP_COLLECTIVES (default auto), checked."""
    mode = (os.environ if environ is None else environ).get(MODE_ENV, "auto").strip().lower() or "auto"
    if mode not in MODES:
        raise ValueError(f"{MODE_ENV}={mode!r} is not one of {', '.join(MODES)}")
    return mode


def _bytes(t: torch.Tensor) -> memoryview:
    """A contiguous CPU tensor's memory, as bytes (written through, for a receive buffer)."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


class TcpCommunicator(Wrapped):
    """`inner` with its collectives over `socks` (group rank -> a connected, non-blocking socket)."""

    def __init__(self, inner: Communicator, socks: dict[int, socket.socket], hosts: list[str]) -> None:
        super().__init__(inner)
        self.socks, self.hosts = socks, hosts
        self._calls = 0
        self._broken: str | None = None
        self._headers = {p: bytearray(_HEADER.size) for p in socks}

    # ---- the collectives ------------------------------------------------------------------
    def _all_reduce(self, t: torch.Tensor, op: ReduceOp) -> torch.Tensor:
        if t.device.type != "cpu":
            return self.inner._all_reduce(t, op)
        return self._sum(t.contiguous(), op, None)

    def _all_reduce_inplace(self, t: torch.Tensor, op: ReduceOp) -> torch.Tensor:
        if t.device.type != "cpu" or not t.is_contiguous():
            return self.inner._all_reduce_inplace(t, op)
        return self._sum(t, op, t)

    def _sum(self, t: torch.Tensor, op: ReduceOp, out: torch.Tensor | None) -> torch.Tensor:
        n = self.size
        if n > 2 and t.numel() * t.element_size() > SPLIT_BYTES and t.numel() >= n:
            flat = t.reshape(-1)
            per = -(-flat.numel() // n)
            padded = torch.nn.functional.pad(flat, (0, per * n - flat.numel())) if per * n != flat.numel() else flat
            mine = self._reduce_chunks(padded.view(n, per), op, "all_reduce")  # (per,)
            full = torch.cat(self._gather(mine, "all_reduce"))[: flat.numel()].view(t.shape)
            return out.copy_(full) if out is not None else full
        rows = self._swap("all_reduce", {p: t for p in self.socks}, t)
        total = _reduce(rows, op, t.dtype, None)  # NOTE: not into t, which is one of the rows
        return out.copy_(total) if out is not None else total

    def _all_gather(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        if t.device.type != "cpu":
            return self.inner._all_gather(t, dim)
        return torch.cat(self._gather(t.contiguous(), "all_gather"), dim)

    def _gather(self, t: torch.Tensor, op: str) -> list[torch.Tensor]:
        return self._swap(op, {p: t for p in self.socks}, t)

    def _reduce_scatter(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        if t.device.type != "cpu":
            return self.inner._reduce_scatter(t, dim)
        chunks = torch.stack([c.contiguous() for c in t.chunk(self.size, dim)])  # (size, *chunk)
        return self._reduce_chunks(chunks, "sum", "reduce_scatter")

    def _reduce_chunks(self, chunks: torch.Tensor, op: ReduceOp, name: str) -> torch.Tensor:
        """Rank r gets chunks[r] of every rank, reduced in rank order."""
        rows = self._swap(name, {p: chunks[p] for p in self.socks}, chunks[self.rank])
        return _reduce(rows, op, chunks.dtype, None)

    def _broadcast(self, t: torch.Tensor, src: int) -> torch.Tensor:
        if t.device.type != "cpu" or not t.is_contiguous():
            return self.inner._broadcast(t, src)
        if self.rank == src:
            self._swap("broadcast", {p: t for p in self.socks}, t, receive=())
        else:
            self._swap("broadcast", {}, t, receive=(src,), into=t)
        return t

    def _all_to_all(self, t: torch.Tensor, send_sizes: list[int], recv_sizes: list[int]) -> torch.Tensor:
        if t.device.type != "cpu":
            return self.inner._all_to_all(t, send_sizes, recv_sizes)
        out = t.new_empty((sum(recv_sizes), *t.shape[1:]))
        sends, recvs = t.split(send_sizes), out.split(recv_sizes)
        recvs[self.rank].copy_(sends[self.rank])
        self._exchange(
            "all_to_all", {p: _bytes(sends[p]) for p in self.socks}, {p: _bytes(recvs[p]) for p in self.socks}
        )
        return out

    def _swap(self, op: str, send: dict, mine: torch.Tensor, receive=None, into=None) -> list[torch.Tensor]:
        """Send each peer its tensor, receive one like `mine` from each peer in `receive` (every
        peer by default; into `into` if given): every rank's tensor in rank order, `mine` at ours."""
        peers = self.socks if receive is None else receive
        rows = [mine] * self.size
        for p in peers:
            rows[p] = into if into is not None else torch.empty_like(mine)
        self._exchange(op, {p: _bytes(x) for p, x in send.items()}, {p: _bytes(rows[p]) for p in peers})
        return rows

    # ---- the exchange ---------------------------------------------------------------------
    def _exchange(self, op: str, send: dict[int, memoryview], recv: dict[int, memoryview]) -> None:
        """Send each peer in `send` a header and its bytes, and fill each buffer in `recv` from
        its peer (after checking its header), all at once, from this thread."""
        if self._broken is not None:
            raise RuntimeError(f"tcp {op} is unusable after an earlier failure: {self._broken}")
        self._calls += 1
        call, code = self._calls, _OPS[op]
        out = {p: [memoryview(_HEADER.pack(call, code, len(b))), b] for p, b in send.items()}
        into = {p: [memoryview(self._headers[p]), b] for p, b in recv.items()}
        got = dict.fromkeys(recv, 0)
        waiting_since = None
        while out or into:
            moved = False
            for p in list(out):
                try:
                    n = self.socks[p].sendmsg(out[p])
                except BlockingIOError:
                    continue
                except (BrokenPipeError, ConnectionResetError):
                    self._fail(f"tcp {op} #{call}: {self._who(p)} {_CLOSED}")
                except OSError as e:
                    self._fail(f"tcp {op} #{call}: sending to {self._who(p)} failed ({e.strerror or e})")
                moved = True
                if not _advance(out[p], n):
                    del out[p]
            for p in list(into):
                try:
                    n = self.socks[p].recvmsg_into(into[p])[0]
                except BlockingIOError:
                    continue
                except ConnectionResetError:
                    n = 0
                except OSError as e:
                    self._fail(f"tcp {op} #{call}: receiving from {self._who(p)} failed ({e.strerror or e})")
                if n == 0:
                    self._fail(f"tcp {op} #{call}: {self._who(p)} {_CLOSED}")
                moved = True
                before, got[p] = got[p], got[p] + n
                if before < _HEADER.size <= got[p]:
                    self._check(p, op, call, code, len(recv[p]))
                if not _advance(into[p], n):
                    del into[p]
            if moved or not (out or into):
                waiting_since = None
                continue
            now = time.monotonic()
            if waiting_since is None:
                waiting_since = now
            waited = now - waiting_since
            if waited < _SPIN_S:
                continue
            if waited < _YIELD_S:
                os.sched_yield()
                continue
            if waited > self.timeout_s:
                late = ", ".join(self._who(p) for p in sorted({*out, *into}))
                self._fail(f"tcp {op} #{call} waited {self.timeout_s:g}s for {late}, which never arrived")
            select.select([self.socks[p] for p in into], [self.socks[p] for p in out], [], _TICK_S)

    def native_all_reduce(self) -> TcpNativeAllReduce | None:
        """The native decode step's handle (shardwise.kernels.step): the step stops at each of
        its all-reduces and this runs it; None after a failure."""
        return None if self._broken is not None else TcpNativeAllReduce(self)

    def _check(self, peer: int, op: str, call: int, code: int, nbytes: int) -> None:
        their_call, their_code, their_bytes = _HEADER.unpack(self._headers[peer])
        if (their_call, their_code, their_bytes) != (call, code, nbytes):
            names = {v: k for k, v in _OPS.items()}
            self._fail(
                f"tcp collectives out of step: this rank's call #{call} is {op} of {nbytes} bytes from "
                f"{self._who(peer)}, which sent call #{their_call}, {names.get(their_code, their_code)} "
                f"of {their_bytes} bytes"
            )

    def _who(self, peer: int) -> str:
        return f"rank {peer} (world rank {self.members[peer]}, host {self.hosts[peer]})"

    def _fail(self, problem: str) -> None:
        self._broken = problem
        self._drop()  # NOTE: peers waiting for this rank see its connections close, and fail at once
        raise RuntimeError(problem)

    def _drop(self) -> None:
        self._broken = self._broken or "its group was closed"
        for s in self.socks.values():
            s.close()


class TcpNativeAllReduce:
    """A TcpCommunicator as the native decode step uses it (kernels.step.StepProgram, external):
    the step returns at each all-reduce, and `reduce` runs it as one of the communicator's own
    (counted, timed out, named on failure)."""

    external = True

    def __init__(self, comm: TcpCommunicator) -> None:
        self.comm, self.rank, self.size = comm, comm.rank, comm.size

    def calls(self) -> int:
        """0 (the step numbers none of these calls itself); raises once the group failed."""
        if self.comm._broken is not None:
            raise RuntimeError(f"tcp all_reduce is unusable after an earlier failure: {self.comm._broken}")
        return 0

    def done(self, calls: int, nbytes: int, seconds: float) -> None:
        """Nothing: every call went through `reduce`, counted there."""

    def reduce(self, y: torch.Tensor) -> None:
        self.comm.all_reduce_(y)

    def fault_injected(self) -> bool:
        return False  # NOTE: every call goes through the communicator, which checks the board's fault


def _advance(views: list[memoryview], n: int) -> bool:
    """Drop n bytes from the front of `views` (and the views emptied); whether any are left."""
    while views and n >= len(views[0]):
        n -= len(views.pop(0))
    if views and n:
        views[0] = views[0][n:]
    while views and not len(views[0]):
        views.pop(0)
    return bool(views)


def across_hosts(comm: Communicator, *, parent: Communicator | None = None, mode: str = "auto") -> Communicator:
    """`comm` with its collectives over direct TCP connections if `mode` allows (auto: a gloo
    group on more than one host); else `comm` itself. Collective over comm (a few small
    operations, not counted). parent: the communicator comm was split from (see take_place)."""
    if mode not in MODES:
        raise ValueError(f"tcp collectives mode {mode!r} is not one of {', '.join(MODES)}")
    if mode == "off" or comm.size == 1 or isinstance(comm, (TcpCommunicator, ShmCommunicator)):
        return comm
    if comm.backend not in ("gloo", "mpi") or comm.device != torch.device("cpu"):
        return comm
    if mode == "auto" and comm.backend != "gloo":
        return comm
    keys = comm._all_gather(torch.tensor([host_key()], dtype=torch.int64), 0)  # (size,)
    one_host = bool((keys == keys[0]).all())
    if mode == "auto" and one_host:
        return comm
    wrapped, why = _connect(comm, one_host)
    if wrapped is None:
        if comm.rank == 0:
            log.warning("group %r keeps %s's collectives: %s", comm.name, comm.backend, why)
        return comm
    return take_place(wrapped, comm, parent)


def _connect(comm: Communicator, one_host: bool) -> tuple[TcpCommunicator | None, str]:
    """Every rank listens, learns the others' addresses, and connects to those below it; or
    None and why not (every rank alike)."""
    me, n = comm.rank, comm.size
    nonce = int(comm._broadcast(torch.tensor([secrets.randbits(62)], dtype=torch.int64), 0))
    listener, socks, why = None, {}, ""
    try:
        addr = "127.0.0.1" if one_host else _my_address()
        listener = socket.create_server((addr, 0), family=_family(addr), backlog=n)
        port = listener.getsockname()[1]
    except OSError as e:
        addr, port, why = "", 0, f"rank {me} cannot listen: {e}"
    packed = addr.encode()[:60].ljust(64, b"\0") + struct.pack("<q", port)
    table = comm._all_gather(torch.frombuffer(bytearray(packed), dtype=torch.uint8), 0).view(n, 72)
    hosts = [bytes(row[:64].tolist()).rstrip(b"\0").decode() for row in table]
    ports = [struct.unpack("<q", bytes(row[64:].tolist()))[0] for row in table]
    if not why and not all(ports):
        why = "a rank cannot listen"
    try:
        if not why:
            hello = struct.Struct("<qq")
            for p in range(me):  # to each lower rank: this rank's number and the group's nonce
                s = socket.create_connection((hosts[p], ports[p]), timeout=_SETUP_S)
                s.sendall(hello.pack(me, nonce))
                socks[p] = s
            listener.settimeout(_SETUP_S)
            while len(socks) < n - 1:
                s, _ = listener.accept()
                s.settimeout(_SETUP_S)
                peer, theirs = hello.unpack(_recv_exactly(s, hello.size))
                if theirs != nonce or not me < peer < n or peer in socks:
                    s.close()  # a stranger, or a stale connection: not one of this group's
                    continue
                socks[peer] = s
            for s in socks.values():
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                s.setblocking(False)
    except OSError as e:
        why = why or f"rank {me} could not connect to its peers: {e}"
    finally:
        if listener is not None:
            listener.close()  # NOTE: nothing listens once the group is connected
    failed = comm._all_reduce(torch.tensor([int(bool(why))], dtype=torch.int64), "max")
    if failed[0]:
        for s in socks.values():
            s.close()
        return None, why or "a peer could not connect"
    return TcpCommunicator(comm, socks, hosts), ""


def _recv_exactly(s: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("closed during the handshake")
        buf += chunk
    return buf


def _family(addr: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in addr else socket.AF_INET


def _my_address() -> str:
    """Where this rank's peers reach it; see ADDR_ENV."""
    if os.environ.get(ADDR_ENV):
        return os.environ[ADDR_ENV]
    iface = os.environ.get("GLOO_SOCKET_IFNAME", "").split(",")[0]
    if iface:
        import fcntl

        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:  # SIOCGIFADDR: the interface's IPv4 address
            req = struct.pack("256s", iface.encode()[:15])
            return socket.inet_ntoa(fcntl.ioctl(s.fileno(), 0x8915, req)[20:24])
    master = os.environ.get("MASTER_ADDR")
    if master:
        info = socket.getaddrinfo(master, 1, type=socket.SOCK_DGRAM)[0]
        with socket.socket(info[0], socket.SOCK_DGRAM) as s:  # no packet: only the route's source address
            s.connect(info[4])
            return s.getsockname()[0]
    return socket.gethostbyname(socket.gethostname())
