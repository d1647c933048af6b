"""The Communicator interface every layer talks to.

A Communicator is one group of ranks. Layers receive it explicitly; nothing in
shardwise reads a global process group. Backends (torch.distributed, MPI) implement
the underscored primitives; this base class short-circuits size-1 groups and counts
every collective it issues in `stats`.

`all_to_all` exchanges rows with uneven (and empty) splits: torch.distributed's
all_to_all_single with split sizes (gloo and NCCL), MPI's Ialltoallv, and for any other
backend a pairwise point-to-point exchange over the `_send`/`_recv` primitives.

Point-to-point (`send`, `recv`, `send_recv`) goes through the same wrapper: the same
timeout, the same accounting (`send/pp`, `recv/pp`: calls, payload bytes, seconds) and
the same CollectiveError, naming the peer. Ranks are local to the group (in a pp group,
rank s is stage s). With `p2p_check` on, each message is preceded by a (shape, dtype)
header and the receiver's answer, so a mismatch raises P2PMismatchError on both sides.

With a progress board attached (`attach_board`, done by the launchers), every operation is
also noted there (shardwise.comm.progress), and an operation that times out reads the
other ranks' records and names the rank(s) it waited for (CollectiveError.hang).
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, Literal, TypeVar

import torch

from shardwise.comm.accounting import CommStats

if TYPE_CHECKING:
    from shardwise.comm.hang import Hang
    from shardwise.comm.progress import Board

__all__ = [
    "Communicator",
    "LocalCommunicator",
    "Pending",
    "CollectiveError",
    "P2PMismatchError",
    "ReduceOp",
    "DEFAULT_TIMEOUT_S",
]

ReduceOp = Literal["sum", "max"]
T = TypeVar("T")
DEFAULT_TIMEOUT_S = 60.0

_TIMED_OUT = 0.9  # an operation that failed after this fraction of the timeout timed out
# Point-to-point message tags: the payload, the debug header, and the receiver's answer to it.
_TAG_DATA, _TAG_HEADER, _TAG_ANSWER = 0, 1, 2
_PEER_WORD = {"send": "to", "recv": "from"}


class CollectiveError(RuntimeError):
    """A collective failed: a peer died, or did not arrive within the timeout.

    Usually a consequence of another rank's failure; the launcher reports the root
    cause (a rank that raised something else, or died) in preference to these. When it
    timed out and the progress board names the rank(s) it waited for, `hang` says which
    (shardwise.comm.hang.Hang; ranks in it are world ranks) and the message ends with it.
    """

    def __init__(
        self, op: str, comm: Communicator, cause: BaseException, peer: int | None = None, hang: Hang | None = None
    ) -> None:
        to = f" {_PEER_WORD.get(op, 'with')} rank {peer}" if peer is not None else ""
        cause_text = " ".join(str(cause).split())  # one line: gloo's messages carry newlines
        tail = f" -- {hang.sentence()}" if hang is not None else ""
        super().__init__(
            f"{op}{to} on group {comm.name!r} (rank {comm.rank} of {comm.size}, {comm.backend}, "
            f"timeout {comm.timeout_s:g}s) failed: {cause_text}{tail}"
        )
        self.op, self.group, self.peer, self.hang = op, comm.name, peer, hang


class P2PMismatchError(ValueError):
    """Under `p2p_check`, a send and its recv disagree on shape or dtype. Raised on both
    ranks, naming both and both (shape, dtype)s; no payload has moved, the ranks are in step."""


class Communicator(ABC):
    """A group of ranks that can run collectives on tensors.

    All collectives return a new tensor (or the input itself for a size-1 group) and
    never modify their input, so they are safe to call inside autograd functions.
    """

    name: str
    rank: int
    size: int
    stats: CommStats
    backend: str
    timeout_s: float
    members: tuple[int, ...] = ()
    """The world ranks of this group's members, in group rank order (set by the backends)."""
    wire: str = "fp32"
    """What the activations' all-reduces (shardwise.comm.regions.reduce_from_region) carry on
    the wire: "fp32" (exact), "bf16" or "q8" (shardwise.comm.compress). Per group: splits do
    not inherit it; the commands set it on the tp group (--comm-dtype)."""
    p2p_check: bool = False
    """Debug mode: send a (shape, dtype) header before each point-to-point message, and the
    receiver answers with its own, so a mismatch raises P2PMismatchError on both ranks
    instead of hanging or corrupting. Two extra small messages per send: set it on every
    rank of the group, or on none. Splits inherit it."""

    _board: Board | None = None
    _chan: str = ""
    _p2p_chans: dict[tuple[str, int], str]
    _splits: list[Communicator] | None = None

    @property
    def device(self) -> torch.device:
        """Where this backend's tensors live (CUDA for NCCL, else CPU): recv's default."""
        return torch.device("cpu")

    # ---- the progress board -------------------------------------------------------------------
    def attach_board(self, board: Board | None) -> None:
        """Note every operation of this communicator (and of its later splits) on `board`."""
        from shardwise.comm.progress import channel

        self._board = board
        self._chan = channel(self.name, self.members)
        self._p2p_chans = {}

    def _derive(self, sub: Communicator, members: tuple[int, ...]) -> Communicator:
        """What a split inherits: p2p_check, the board; and its members' world ranks."""
        sub.members = members
        sub.p2p_check = self.p2p_check
        sub.attach_board(self._board)
        if self._splits is None:
            self._splits = []
        self._splits.append(sub)
        return sub

    def close_splits(self) -> None:
        """Release every communicator split from this one (and from those), keeping this one.

        Collective: every rank of this group calls it, after its last operation on them.
        A job builds its groups once and `close` ends them all; a process that builds
        meshes again and again (the test suite's pooled ranks, between cases) calls this,
        or every split's backend threads and sockets (gloo: 3 threads, 5 descriptors at
        world size 4) outlive their use."""
        while self._splits:
            sub = self._splits.pop()
            sub.close_splits()
            sub._release()

    def _release(self) -> None:  # noqa: B027 - optional hook
        """Free this split's backend resources; it is unusable afterwards."""

    def _p2p_channel(self, op: str, peer: int) -> str:
        key = (op, peer)
        chan = self._p2p_chans.get(key)
        if chan is None:  # one channel per direction, shared by the sender's send and the receiver's recv
            me, other = self.members[self.rank], self.members[peer]
            src, dst = (me, other) if op == "send" else (other, me)
            chan = self._p2p_chans[key] = f"{self._chan}:{src}>{dst}"
        return chan

    # ---- public API: size-1 short-circuit + accounting ---------------------------------
    def all_reduce(self, t: torch.Tensor, op: ReduceOp = "sum") -> torch.Tensor:
        """Element-wise reduction across the group; every rank gets the result."""
        if self.size == 1:
            return t
        return self._run("all_reduce", _nbytes(t), self._all_reduce, t, op)

    def all_reduce_(self, t: torch.Tensor, op: ReduceOp = "sum") -> torch.Tensor:
        """In-place all_reduce of a contiguous tensor nobody else reads (saves a copy per call)."""
        if self.size == 1:
            return t
        return self._run("all_reduce", _nbytes(t), self._all_reduce_inplace, t, op)

    def _all_reduce_inplace(self, t: torch.Tensor, op: ReduceOp) -> torch.Tensor:
        return t.copy_(self._all_reduce(t, op))  # backends override with a true in-place reduction

    def native_all_reduce(self):
        """A handle through which native code runs this group's fp32 sum all-reduces itself
        (shardwise.comm.shm.NativeAllReduce; used by the native decode step), or None: only the
        shared-memory all-reduce has one."""
        return None

    def all_gather(self, t: torch.Tensor, dim: int = -1, sizes: list[int] | None = None) -> torch.Tensor:
        """Concatenate every rank's `t` along `dim`, in rank order.

        sizes: every rank's length along `dim`, when they differ (an uneven split). Each rank
        then sends its part padded to the largest, and the padding is trimmed on arrival;
        the accounting counts the padded bytes, which is what travels."""
        if self.size == 1:
            return t
        dim = dim % t.dim()
        if sizes is None or len(set(sizes)) == 1:
            return self._run("all_gather", _nbytes(t), self._all_gather, t, dim)
        self._check_sizes("all_gather", sizes, t.shape[dim], sizes[self.rank])
        width = max(sizes)
        padded = _pad(t, dim, width)
        full = self._run("all_gather", _nbytes(padded), self._all_gather, padded, dim)
        parts = [p.narrow(dim, 0, n) for p, n in zip(full.split(width, dim), sizes, strict=True)]
        return torch.cat(parts, dim)

    def reduce_scatter(self, t: torch.Tensor, dim: int = -1, sizes: list[int] | None = None) -> torch.Tensor:
        """Sum across the group, then keep this rank's chunk along `dim`: 1/size of it, or
        sizes[rank] of it when `sizes` splits it unevenly (padded to the largest on the wire)."""
        if self.size == 1:
            return t
        dim = dim % t.dim()
        if sizes is None or len(set(sizes)) == 1:
            if t.shape[dim] % self.size:
                raise ValueError(
                    f"reduce_scatter: dim {dim} of size {t.shape[dim]} is not divisible by {self.size} ranks; "
                    "pass sizes= for an uneven split"
                )
            return self._run("reduce_scatter", _nbytes(t), self._reduce_scatter, t, dim)
        self._check_sizes("reduce_scatter", sizes, t.shape[dim], sum(sizes))
        width = max(sizes)
        padded = torch.cat([_pad(c, dim, width) for c in t.split(sizes, dim)], dim)
        mine = self._run("reduce_scatter", _nbytes(padded), self._reduce_scatter, padded, dim)
        return mine.narrow(dim, 0, sizes[self.rank])

    def _check_sizes(self, op: str, sizes: list[int], have: int, want: int) -> None:
        if len(sizes) != self.size or min(sizes) < 0:
            raise ValueError(f"{op}: sizes {sizes} must give one length >= 0 for each of {self.size} ranks")
        if have != want:
            raise ValueError(f"{op}: rank {self.rank} has length {have} along the split dim, sizes {sizes} say {want}")

    def broadcast(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Every rank gets `src`'s tensor (the others pass a buffer of the same shape and dtype)."""
        if self.size == 1:
            return t
        if not 0 <= src < self.size:
            raise ValueError(f"broadcast src={src} is outside group {self.name!r} of size {self.size}")
        return self._run("broadcast", _nbytes(t), self._broadcast, t, src)

    def all_to_all(self, t: torch.Tensor, send_sizes: list[int], recv_sizes: list[int] | None = None) -> torch.Tensor:
        """Exchange rows (dim 0) of `t`: rows [sum(send_sizes[:d]), +send_sizes[d]) go to rank d,
        and the result holds what every rank sent here, in rank order (recv_sizes[s] rows from
        rank s). Splits may be uneven or zero. recv_sizes None: they are learnt first from a
        small all_to_all of the counts (`all_to_all_sizes`), a second collective.

        Accounting: op "all_to_all", bytes = the bytes this rank SENDS (its input `t`, the rows
        it keeps for itself included), as for every other collective; the count exchange is
        one more call of 8 * size bytes. Bad sizes raise ValueError before any communication."""
        if t.dim() == 0:
            raise ValueError("all_to_all: a 0-dim tensor has no rows (dim 0) to split")
        self._check_split("all_to_all", "send_sizes", send_sizes, t.shape[0])
        if recv_sizes is not None:
            self._check_split("all_to_all", "recv_sizes", recv_sizes, None)
        if self.size == 1:
            if recv_sizes is not None and recv_sizes != send_sizes:
                raise ValueError(
                    f"all_to_all: a group of 1 receives what it sends: recv_sizes {recv_sizes} != send_sizes {send_sizes}"
                )
            return t
        if recv_sizes is None:
            recv_sizes = self.all_to_all_sizes(send_sizes)
        return self._run("all_to_all", _nbytes(t), self._all_to_all, t.contiguous(), list(send_sizes), list(recv_sizes))

    def all_to_all_sizes(self, send_sizes: list[int]) -> list[int]:
        """The recv_sizes of an all_to_all: how many rows each rank sends here (one all_to_all
        of `size` int64 counts, on this backend's device)."""
        self._check_split("all_to_all_sizes", "send_sizes", send_sizes, None)
        if self.size == 1:
            return list(send_sizes)
        counts = torch.tensor(send_sizes, dtype=torch.int64, device=self.device)  # (size,)
        ones = [1] * self.size
        return self._run("all_to_all", _nbytes(counts), self._all_to_all, counts, ones, ones).tolist()

    def _check_split(self, op: str, what: str, sizes: list[int], rows: int | None) -> None:
        if len(sizes) != self.size or any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in sizes):
            raise ValueError(f"{op}: {what} {list(sizes)} must give one int >= 0 for each of {self.size} ranks")
        if rows is not None and sum(sizes) != rows:
            raise ValueError(
                f"{op}: {what} {list(sizes)} sum to {sum(sizes)} but rank {self.rank}'s tensor has {rows} rows (dim 0)"
            )

    def _all_to_all(self, t: torch.Tensor, send_sizes: list[int], recv_sizes: list[int]) -> torch.Tensor:
        """The backend primitive: a contiguous (sum(send_sizes), ...) -> (sum(recv_sizes), ...).

        This default, for backends without one, is pairwise point-to-point over `_send`/`_recv`:
        every rank walks the pairs (i, j), i < j, in the same order, the lower rank sending
        first, so a blocking send always meets its receive (no deadlock; size - 1 exchanges per
        rank, serialized). Empty messages are skipped on both sides."""
        out = t.new_empty((sum(recv_sizes), *t.shape[1:]))
        sends, recvs = t.split(send_sizes), out.split(recv_sizes)
        recvs[self.rank].copy_(sends[self.rank])
        for i in range(self.size):
            for j in range(i + 1, self.size):
                if self.rank not in (i, j):
                    continue
                peer = j if self.rank == i else i
                steps = ("send", "recv") if self.rank == i else ("recv", "send")
                for step in steps:
                    if step == "send" and send_sizes[peer]:
                        self._send(sends[peer], peer, _TAG_DATA)  # dim-0 slices: contiguous
                    elif step == "recv" and recv_sizes[peer]:
                        self._recv(recvs[peer], peer, _TAG_DATA)
        return out

    def barrier(self) -> None:
        if self.size == 1:
            return
        self._run("barrier", 0, self._barrier)

    def external(self, op: str, fn: Callable[[], T], nbytes: int = 0) -> T:
        """fn(), a collective on this group that another library issues (DistributedDataParallel's
        own), run as one of ours: counted as `op`, noted on the progress board, and a failure
        raised as CollectiveError. Every member must call it at the same point."""
        if self.size == 1:
            return fn()
        return self._run(op, nbytes, fn)

    def all_reduce_async_(self, t: torch.Tensor) -> tuple[torch.futures.Future, Pending]:
        """Start an in-place sum of a contiguous `t` over the group and return at once (for
        DDP's comm hook, so the all-reduce overlaps backward): a Future of `t` reduced, and the
        operation's Pending, on the progress board until it completes and counted once
        `Pending.record()` is called on this thread. A failure fails the Future; raise
        `Pending.failed(error)` for it. Backends without asynchronous collectives reduce now."""
        pending = Pending(self, "all_reduce", _nbytes(t))

        def done(fut: torch.futures.Future) -> torch.Tensor:
            try:
                value = fut.value()
            except Exception as e:  # the backend's own error: it stays in flight on the board
                pending.error = e
                raise
            pending.finish()
            return value[0] if isinstance(value, list) else value

        return self._all_reduce_async(t).then(done), pending

    def _all_reduce_async(self, t: torch.Tensor) -> torch.futures.Future:
        """A Future of the reduced `t` (or of [t], as torch.distributed's)."""
        fut: torch.futures.Future = torch.futures.Future()
        if self.size == 1:
            fut.set_result(t)
            return fut
        try:
            fut.set_result(self._all_reduce_inplace(t, "sum"))
        except (RuntimeError, OSError) as e:
            fut.set_exception(e)
        return fut

    # ---- point-to-point ---------------------------------------------------------------------
    def send(self, t: torch.Tensor, dst: int) -> None:
        """Send `t` to rank `dst` of this group (blocking: returns once `t` may be reused).

        NOTE: a send may wait for its receive, so two ranks that send to each other first
        deadlock; use `send_recv` for exchanges."""
        self._check_peer("send", dst)
        t = t.detach().contiguous()
        self._run("send", _nbytes(t), self._send_checked, t, dst, peer=dst)

    def recv(
        self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype, src: int, *, device: torch.device | None = None
    ) -> torch.Tensor:
        """Receive a new (shape, dtype) tensor from rank `src` of this group, on `device`
        (default: this backend's device)."""
        self._check_peer("recv", src)
        buf = torch.empty(tuple(shape), dtype=dtype, device=device if device is not None else self.device)
        self._run("recv", _nbytes(buf), self._recv_checked, buf, src, peer=src)
        return buf

    def send_recv(
        self,
        t: torch.Tensor,
        dst: int,
        shape: tuple[int, ...] | torch.Size,
        dtype: torch.dtype,
        src: int,
        *,
        device: torch.device | None = None,
    ) -> torch.Tensor:
        """Send `t` to `dst` and receive a (shape, dtype) tensor from `src` (dst == src: a
        paired exchange). Ordered by rank parity, even ranks sending first and odd ranks
        receiving first, so two neighbours exchanging, or a ring shift of any size, cannot
        deadlock. Counted as one send and one recv."""
        if self.rank % 2 == 0:
            self.send(t, dst)
            return self.recv(shape, dtype, src, device=device)
        out = self.recv(shape, dtype, src, device=device)
        self.send(t, dst)
        return out

    def _check_peer(self, op: str, peer: int) -> None:
        if isinstance(peer, bool) or not isinstance(peer, int) or not 0 <= peer < self.size:
            raise ValueError(f"{op}: peer rank {peer!r} is outside group {self.name!r} of size {self.size}")
        if peer == self.rank:
            raise ValueError(f"{op}: rank {peer} of group {self.name!r} cannot {op} {_PEER_WORD[op]} itself")

    def _send_checked(self, t: torch.Tensor, dst: int) -> None:
        if self.p2p_check:
            mine = _header(t.shape, t.dtype, t.device)
            self._send(mine, dst, _TAG_HEADER)
            theirs = torch.empty_like(mine)
            self._recv(theirs, dst, _TAG_ANSWER)
            if not torch.equal(mine, theirs):
                raise P2PMismatchError(self._mismatch(self.rank, dst, mine, theirs, "sender"))
        self._send(t, dst, _TAG_DATA)

    def _recv_checked(self, buf: torch.Tensor, src: int) -> None:
        if self.p2p_check:
            mine = _header(buf.shape, buf.dtype, buf.device)
            theirs = torch.empty_like(mine)
            self._recv(theirs, src, _TAG_HEADER)
            self._send(mine, src, _TAG_ANSWER)
            if not torch.equal(mine, theirs):
                raise P2PMismatchError(self._mismatch(src, self.rank, theirs, mine, "receiver"))
        self._recv(buf, src, _TAG_DATA)

    def _mismatch(self, sender: int, receiver: int, sent: torch.Tensor, expected: torch.Tensor, side: str) -> str:
        return (
            f"point-to-point mismatch on group {self.name!r}: rank {sender} sends {_describe(sent)} "
            f"to rank {receiver}, which expects {_describe(expected)} (raised on the {side}, rank {self.rank})"
        )

    def _run(self, op: str, nbytes: int, primitive, *args, peer: int | None = None):
        """Call a backend primitive: count it, time it, note it on the board, and name the op
        (and peer, and after a timeout the rank(s) it waited for) on failure."""
        board = self._board
        if board is not None:  # NOTE: the hot path: a dict update and two attribute stores
            chan = self._chan if peer is None else self._p2p_channel(op, peer)
            counts = board.counts
            seq = counts.get(chan, 0) + 1
            if board.fault is not None:
                board.fault.check(op, self.name, seq)
            counts[chan] = seq
            t0 = time.perf_counter()
            board.current = (chan, op, self.name, seq, t0, peer, self.members)
        else:
            t0 = time.perf_counter()
        try:
            result = primitive(*args)
        except (RuntimeError, OSError) as e:  # backends raise RuntimeError subclasses
            waited = time.perf_counter() - t0
            raise CollectiveError(op, self, e, peer, hang=self._diagnose(waited)) from e
        t1 = time.perf_counter()
        if board is not None:
            board.idle_since = t1  # after the op's start: done (a failed op stays in progress)
        self.stats.record(op, self.name, nbytes, t1 - t0)
        return result

    def _diagnose(self, waited_s: float) -> Hang | None:
        """After an operation failed: the ranks it waited for, if it timed out (a failure well
        before the timeout is a peer's death or error, reported by that peer)."""
        if self._board is None or waited_s < _TIMED_OUT * self.timeout_s:
            return None
        from shardwise.comm.hang import diagnose

        try:
            self._board.publish()  # where this rank failed, for peers that diagnose too
            return diagnose(self._board.read_all(), now=time.time(), origin=self._board.rank)
        except Exception:  # noqa: BLE001 - a diagnosis must never hide the error itself
            return None

    # ---- backend primitives ---------------------------------------------------------------
    @abstractmethod
    def _all_reduce(self, t: torch.Tensor, op: ReduceOp) -> torch.Tensor: ...

    @abstractmethod
    def _all_gather(self, t: torch.Tensor, dim: int) -> torch.Tensor: ...

    @abstractmethod
    def _reduce_scatter(self, t: torch.Tensor, dim: int) -> torch.Tensor: ...

    @abstractmethod
    def _broadcast(self, t: torch.Tensor, src: int) -> torch.Tensor: ...

    @abstractmethod
    def _barrier(self) -> None: ...

    @abstractmethod
    def _send(self, t: torch.Tensor, dst: int, tag: int) -> None:
        """Blocking send of a contiguous tensor to group rank `dst`, within the timeout."""

    @abstractmethod
    def _recv(self, buf: torch.Tensor, src: int, tag: int) -> None:
        """Blocking receive into a contiguous `buf` from group rank `src`, within the timeout."""

    @abstractmethod
    def split(self, groups: list[list[int]], name: str) -> Communicator:
        """Collective: partition this group's ranks into `groups` (ranks of this group)
        and return the communicator of the group that holds this rank."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release backend resources (the world communicator only)."""

    @property
    def process_group(self):
        """This group's torch.distributed ProcessGroup, for PyTorch APIs that take one
        (DistributedDataParallel); None when the backend has none (MPI, a single process)."""
        return None

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(name={self.name!r}, rank={self.rank}, size={self.size}, backend={self.backend!r})"
        )


class Pending:
    """An asynchronous operation noted on a communicator's board (Communicator.all_reduce_async_)."""

    def __init__(self, comm: Communicator, op: str, nbytes: int) -> None:
        self.comm, self.op, self.nbytes = comm, op, nbytes
        self.start = time.perf_counter()
        self.end: float | None = None
        self.error: BaseException | None = None
        """The backend's error, if it failed."""
        self._key = None
        board = comm._board
        if board is not None:
            chan = comm._chan
            seq = board.counts[chan] = board.counts.get(chan, 0) + 1
            self._key = (chan, seq)
            board.pending[self._key] = (chan, op, comm.name, seq, self.start, None, comm.members)

    def finish(self) -> None:
        """It completed (any thread may call this: the board's entry goes, the time is kept)."""
        self.end = time.perf_counter()
        if self._key is not None:
            self.comm._board.pending.pop(self._key, None)

    def record(self) -> None:
        """Count it in the communicator's stats (on the thread that issued it, as every count is)."""
        if self.end is not None:
            self.comm.stats.record(self.op, self.comm.name, self.nbytes, self.end - self.start)

    def failed(self, cause: BaseException) -> CollectiveError:
        """The CollectiveError for its failure (`cause`): after a timeout, naming the rank(s) it waited for."""
        return CollectiveError(self.op, self.comm, cause, hang=self.comm._diagnose(time.perf_counter() - self.start))


class LocalCommunicator(Communicator):
    """The size-1 group: a single process with no distributed runtime at all."""

    def __init__(self, name: str = "world", stats: CommStats | None = None) -> None:
        self.name, self.rank, self.size = name, 0, 1
        self.stats = stats if stats is not None else CommStats()
        self.backend = "local"
        self.timeout_s = DEFAULT_TIMEOUT_S

    def _all_reduce(self, t, op):  # pragma: no cover - size 1 never reaches primitives
        return t

    _all_gather = _reduce_scatter = _broadcast = _all_reduce  # type: ignore[assignment]

    def _barrier(self) -> None:  # pragma: no cover
        pass

    def _send(self, t, dst, tag) -> None:  # pragma: no cover - a size-1 group has no peer
        raise AssertionError("unreachable")

    _recv = _send

    def split(self, groups: list[list[int]], name: str) -> Communicator:
        if groups != [[0]]:
            raise ValueError(f"a single process can only split into [[0]], got {groups}")
        return LocalCommunicator(name, self.stats)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _pad(t: torch.Tensor, dim: int, length: int) -> torch.Tensor:
    """t zero-padded at the end of `dim` to `length` (contiguous, as the backends need)."""
    if t.shape[dim] == length:
        return t.contiguous()
    shape = list(t.shape)
    shape[dim] = length - t.shape[dim]
    return torch.cat([t, t.new_zeros(shape)], dim)


# The debug header: [dtype code, ndim, size of each dim, 0...] as int64.
_HEADER_DIMS = 16
_DTYPES = (
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128,
)  # fmt: skip


def _header(shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if len(shape) > _HEADER_DIMS:
        raise ValueError(f"p2p_check: a tensor of {len(shape)} dims has more than {_HEADER_DIMS}")
    code = _DTYPES.index(dtype) if dtype in _DTYPES else len(_DTYPES)
    values = [code, len(shape), *shape] + [0] * (_HEADER_DIMS - len(shape))
    return torch.tensor(values, dtype=torch.int64, device=device)


def _describe(header: torch.Tensor) -> str:
    code, ndim, *dims = header.tolist()
    dtype = str(_DTYPES[code]).removeprefix("torch.") if 0 <= code < len(_DTYPES) else "another dtype"
    return f"{dtype} {tuple(dims[:ndim])}"
