"""An all-reduce through shared memory, for a group whose ranks all run on one host.

    tp = intra_host(world.split(groups, name="tp"), parent=world, mode="auto")

wraps a group's communicator (gloo or MPI) so that its all-reduces, all-gathers and
broadcasts of tensors up to `max_bytes` go through one POSIX shared-memory segment (a file in
/dev/shm) made once, at setup; every other operation, and larger or non-CPU tensors, pass
through to the wrapped communicator. (A decode step's all-gather of vocabulary-parallel
logits and its token broadcast cost gloo a few hundred us each; through the segment, a copy.) The accounting, the progress board and CollectiveError are the base class's,
so the calls count exactly as the wrapped communicator's would.

The segment (shardwise.comm.shm_segment) holds a line per rank (its seq, pid, failed words)
and two buffers of one slot per rank.

Operation number k (every rank counts its calls; an all-gather and a broadcast are one call
each, exactly like an all-reduce) uses buffer b = k % 2: each rank copies its tensor into its
slot, then stores k into its seq (mod PERIOD), waits until every peer's
seq is k or k + 1, and sums the size slots in rank order (every rank the same order, so the
replicas stay bitwise equal). Two buffers are enough: a rank writes call k + 1's slot only
after seeing every peer at k, and a peer stores k only once it has finished reading call
k - 1, the last user of that buffer.

NOTE: the stores are ordered by x86-64's memory model (TSO: a store is never seen before an
earlier one, a load never done before an earlier one); Python has no fence, so other
architectures keep the wrapped communicator's all-reduce.

No wait is unbounded: a peer that does not arrive within the communicator's timeout, whose
process is gone (its pid, from the segment), that failed an earlier call, or that the MPI
launcher reports dead (shardwise.comm.mpi.peer_failed) makes the all-reduce raise, naming
that rank. The segment's name is unlinked as soon as every rank has mapped it (and at
exit, and by the launchers' cleanup if the creator dies before): no file outlives the
setup, and the mapping nothing but the processes.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

import torch

from shardwise.comm.communicator import Communicator, ReduceOp
from shardwise.comm.hang import proc_state
from shardwise.comm.mpi import _peer_failure
from shardwise.comm.shm_segment import DATA, FAILED, PID, PREFIX, SHM_DIR, Segment, host_key, supported
from shardwise.comm.wrapped import Wrapped, take_place
from shardwise.log import get_logger

__all__ = ["ShmCommunicator", "NativeAllReduce", "intra_host", "shm_mode", "MODE_ENV", "MODES"]

log = get_logger("comm")

MODE_ENV = "SHARDWISE_SHM_ALLREDUCE"
"""auto (the default): every gloo and MPI group whose ranks share a host (measured faster than
both: docs/benchmarks/decode-step.md); on: the same, and a warning where it cannot be used;
off: the wrapped communicator's all-reduce."""
MODES = ("auto", "on", "off")
DEFAULT_MAX_BYTES = 4 << 20
"""The largest tensor the segment holds (per rank and buffer); larger ones go to the wrapped one."""
PERIOD = 1 << 62
"""Sequence numbers are counted modulo this (even, so a call's buffer parity survives the wrap)."""

_SPIN_POLLS = 256  # polls before a waiting rank starts yielding its core (sched_yield)
_NAP_AFTER_S = 0.005  # a wait this long is a peer with other work, not a collective's latency
_NAP_S = 0.0002
_CHECK_EVERY = 64  # polls between looks at the clock, the peers' pids and the MPI launcher's word
_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64)
_HALF = (torch.float16, torch.bfloat16)  # summed in fp32, rounded once


def shm_mode(environ: dict[str, str] | None = None) -> str:
    """SHARDWISE_SHM_ALLREDUCE (default auto), checked."""
    mode = (os.environ if environ is None else environ).get(MODE_ENV, "auto").strip().lower() or "auto"
    if mode not in MODES:
        raise ValueError(f"{MODE_ENV}={mode!r} is not one of {', '.join(MODES)}")
    return mode


class ShmCommunicator(Wrapped):
    """`inner` with its all-reduces (up to max_bytes, on CPU) through a shared-memory segment."""

    def __init__(self, inner: Communicator, segment: Segment, *, period: int = PERIOD) -> None:
        if period < 4 or period % 2:
            raise ValueError(f"period {period} must be even and >= 4")
        super().__init__(inner)
        self.seg, self.period = segment, period
        self.max_bytes = segment.slot_bytes
        self._calls = 0
        self._mine = segment.line(self.rank)
        self._peers = [(p, segment.line(p)) for p in range(self.size) if p != self.rank]
        self._pids = {p: segment.words[segment.line(p) + PID] for p in range(self.size)}
        self._slots: dict[torch.dtype, torch.Tensor] = {}
        self._rows: dict[tuple[torch.dtype, torch.Size, int], tuple[torch.Tensor, ...]] = {}
        self._broken: str | None = None

    # ---- the all-reduce ----------------------------------------------------------------------
    def _fits(self, t: torch.Tensor) -> bool:
        return t.device.type == "cpu" and t.dtype in _DTYPES and t.numel() * t.element_size() <= self.max_bytes

    def _all_reduce(self, t: torch.Tensor, op: ReduceOp) -> torch.Tensor:
        if not self._fits(t):
            return self.inner._all_reduce(t, op)
        return _reduce(self._exchange(t), op, t.dtype, None)

    def _all_reduce_inplace(self, t: torch.Tensor, op: ReduceOp) -> torch.Tensor:
        if not (self._fits(t) and t.is_contiguous()):
            return self.inner._all_reduce_inplace(t, op)
        _reduce(self._exchange(t), op, t.dtype, t)
        return t

    def _exchange(self, t: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Write t into this rank's slot, signal, wait for every peer: every rank's tensor
        (views of the segment, t's shape)."""
        if self._broken is not None:
            raise RuntimeError(f"shared-memory all_reduce is unusable after an earlier failure: {self._broken}")
        self._calls += 1
        seq = self._calls % self.period
        rows = self._rows_of(t.dtype, t.shape, seq & 1)  # size x t.shape
        rows[self.rank].copy_(t.detach() if t.requires_grad else t)  # NOTE: never part of a graph
        words = self.seg.words
        words[self._mine] = seq  # NOTE: after the copy's stores (TSO): a peer that sees seq sees the data
        period, start = self.period, None
        for _, line in self._peers:
            if (words[line] - seq) % period > 1:
                start = self._wait(line, seq, start)
        return rows

    def _rows_of(self, dtype: torch.dtype, shape: torch.Size, parity: int) -> tuple[torch.Tensor, ...]:
        """Every rank's slot of buffer `parity` as a `shape` tensor of `dtype` (made once per key)."""
        key = (dtype, shape, parity)
        rows = self._rows.get(key)
        if rows is None:
            slots = self._slots.get(dtype)
            if slots is None:
                slots = self._slots[dtype] = self.seg.slots(dtype)  # (2, size, per)
            if len(self._rows) > 256:
                self._rows.clear()  # many shapes (a prefill of every length): keep it bounded
            n = shape.numel()
            rows = self._rows[key] = tuple(slots[parity, r, :n].view(shape) for r in range(self.size))
        return rows

    def _wait(self, line: int, seq: int, start: float | None) -> float:
        """Poll the seq word at `line` until it reaches seq (or seq + 1); raise past the timeout
        (counted from `start`, this call's first wait) or if a peer failed. Returns start."""
        words, period = self.seg.words, self.period
        start, polls, napping = start if start is not None else time.monotonic(), 0, False
        while (words[line] - seq) % period > 1:
            polls += 1
            if polls <= _SPIN_POLLS:
                continue
            if polls % _CHECK_EVERY == 0:
                waited = time.monotonic() - start
                problem = self._problem(seq, waited)
                if problem is not None:
                    self._fail(problem)
                napping = waited > _NAP_AFTER_S
            if napping:
                time.sleep(_NAP_S)
            else:
                os.sched_yield()
        return start

    def _problem(self, seq: int, waited: float) -> str | None:
        """Why this call cannot complete, naming the peers it waits for; None: wait on."""
        words, where = self.seg.words, f"shared-memory all_reduce #{self._calls}"
        late = [p for p, line in self._peers if (words[line] - seq) % self.period > 1]
        for p in late:
            if words[self.seg.line(p) + FAILED]:
                return f"{where}: {self._who(p)} failed an earlier one"
        if _peer_failure:  # the MPI launcher's word that a rank died
            return f"{where} cannot complete: {_peer_failure[0]}"
        if waited > _NAP_AFTER_S:
            gone = [p for p in late if proc_state(self._pids[p]) is None]
            if gone:
                return f"{where}: {', '.join(map(self._who, gone))} {'is' if len(gone) == 1 else 'are'} gone"
        if waited > self.timeout_s:
            return f"{where} waited {self.timeout_s:g}s for {', '.join(map(self._who, late))}, which never arrived"
        return None

    def _who(self, peer: int) -> str:
        return f"rank {peer} (world rank {self.members[peer]}, process {self._pids[peer]})"

    def _fail(self, problem: str) -> None:
        self._broken = problem
        self.seg.words[self._mine + FAILED] = 1  # peers waiting for this rank fail at once
        raise RuntimeError(problem)

    # ---- the native decode step's all-reduces (shardwise.kernels.step) -------------------------
    def native_all_reduce(self) -> NativeAllReduce | None:
        """This group's all-reduce for native code that runs the protocol itself (csrc/step.c);
        None after a failure. The mapping lives as long as this communicator."""
        if self._broken is not None:
            return None
        slots = self._slots.get(torch.float32)
        if slots is None:
            slots = self._slots[torch.float32] = self.seg.slots(torch.float32)  # (2, size, per)
        return NativeAllReduce(self, slots)

    # ---- the all-gather and the broadcast through the segment; the rest: the wrapped one's ------
    def _all_gather(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        if not self._fits(t):
            return self.inner._all_gather(t, dim)
        return torch.cat(self._exchange(t), dim)  # every rank's slot, in rank order: a copy each

    def _broadcast(self, t: torch.Tensor, src: int) -> torch.Tensor:
        if not (self._fits(t) and t.is_contiguous()):
            return self.inner._broadcast(t, src)
        rows = self._exchange(t)  # NOTE: every rank posts (the protocol's seq); only src's slot is read
        return t.copy_(rows[src])  # in place, as the backends' broadcast

    def _drop(self) -> None:
        self._broken = self._broken or "its group was closed"
        self._rows.clear()
        self._slots.clear()
        self.seg.close()


class NativeAllReduce:
    """A ShmCommunicator's segment as native code addresses it (the words' and the fp32 slots'
    addresses, this rank's and its peers' seq words), and the bookkeeping of the calls native
    code makes: `done` counts, numbers on the progress board and times those it completed,
    as `_run` does for one; `wait` waits for a late peer of the call it posted, as one of the
    communicator's own (its timeout, peer checks, diagnosis)."""

    def __init__(self, comm: ShmCommunicator, slots: torch.Tensor) -> None:
        self.comm = comm
        self.slots = slots.data_ptr()
        self.words = self.slots - DATA  # NOTE: one mapping: the header words start DATA bytes before
        self.slot_floats = slots.shape[2]
        self.mine, self.peers = comm._mine, [line for _, line in comm._peers]
        self.rank, self.size, self.period = comm.rank, comm.size, comm.period

    def calls(self) -> int:
        """Operations this rank has made on the segment so far (the next one is calls() + 1).
        Raises when the communicator failed or was closed: its mapping may be gone."""
        c = self.comm
        if c._broken is not None:
            raise RuntimeError(f"shared-memory all_reduce is unusable after an earlier failure: {c._broken}")
        return c._calls

    def done(self, calls: int, nbytes: int, seconds: float) -> None:
        if calls <= 0:
            return
        c = self.comm
        c._calls += calls
        board = c._board
        if board is not None:
            board.counts[c._chan] = board.counts.get(c._chan, 0) + calls
            board.idle_since = time.perf_counter()
        c.stats.record("all_reduce", c.name, nbytes * calls, seconds, calls=calls)

    def wait(self, seq: int, nbytes: int) -> None:
        c = self.comm
        if c._broken is not None:
            raise RuntimeError(f"shared-memory all_reduce is unusable after an earlier failure: {c._broken}")
        c._calls += 1

        def wait() -> None:
            start = None
            for _, line in c._peers:
                if (c.seg.words[line] - seq) % c.period > 1:
                    start = c._wait(line, seq, start)

        c._run("all_reduce", nbytes, wait)

    def fault_injected(self) -> bool:
        """A fault is injected on this rank's board (SHARDWISE_DEBUG_HANG): checked per call by the
        communicator, so native code must not make the calls."""
        board = self.comm._board
        return board is not None and board.fault is not None


def _reduce(rows: tuple[torch.Tensor, ...], op: ReduceOp, dtype: torch.dtype, out: torch.Tensor | None):
    """rows[0] op rows[1] op ... in rank order (fp32 for half precision), into `out` if given."""
    if op == "max":
        acc = torch.maximum(rows[0], rows[1], out=out) if out is not None else torch.maximum(rows[0], rows[1])
        for row in rows[2:]:
            torch.maximum(acc, row, out=acc)
        return acc
    if dtype in _HALF:
        acc = rows[0].float()  # t.shape, fp32
        for row in rows[1:]:
            acc += row
        return out.copy_(acc) if out is not None else acc.to(dtype)
    acc = torch.add(rows[0], rows[1], out=out) if out is not None else rows[0] + rows[1]
    for row in rows[2:]:
        acc += row
    return acc


def intra_host(
    comm: Communicator,
    *,
    parent: Communicator | None = None,
    mode: str = "auto",
    max_bytes: int = DEFAULT_MAX_BYTES,
    period: int = PERIOD,
) -> Communicator:
    """`comm` with the shared-memory all-reduce if `mode` allows and every rank of it is on this
    host; else `comm` itself. Collective over comm (a few small operations, not counted).

    parent: the communicator comm was split from; the wrapper takes comm's place among its
    splits, so parent.close_splits() releases the segment too. period: see PERIOD (the tests
    make it small, to wrap)."""
    if mode not in MODES:
        raise ValueError(f"shared-memory all-reduce mode {mode!r} is not one of {', '.join(MODES)}")
    if max_bytes < 64 or max_bytes % 64:
        raise ValueError(f"max_bytes {max_bytes} must be a positive multiple of 64")
    if mode == "off" or comm.size == 1 or isinstance(comm, ShmCommunicator):
        return comm
    wrapped, why = _setup(comm, max_bytes, period)
    if wrapped is None:
        if mode == "on" and why and comm.rank == 0:
            log.warning("group %r keeps %s's all-reduce (%s=on): %s", comm.name, comm.backend, MODE_ENV, why)
        return comm
    return take_place(wrapped, comm, parent)


def _setup(comm: Communicator, max_bytes: int, period: int) -> tuple[ShmCommunicator | None, str]:
    """The segment, made by rank 0 and mapped by every rank, or None and why not (every rank alike)."""
    if comm.backend not in ("gloo", "mpi") or comm.device != torch.device("cpu"):
        return None, ""  # NCCL, a dry run: nothing to say
    # every rank gathers every rank's host, and decides alike
    keys = comm._all_gather(torch.tensor([host_key(), int(supported())], dtype=torch.int64), 0)  # (2 * size,)
    hosts, able = keys[0::2], keys[1::2]
    if not bool((hosts == hosts[0]).all()):
        return None, f"its ranks are on {len(set(hosts.tolist()))} hosts"
    if not bool(able.all()):
        return None, f"not every rank is on x86-64 with {SHM_DIR}"
    nonce = int.from_bytes(os.urandom(7), "little")
    path = Path(SHM_DIR) / f"{PREFIX}{os.getpid()}-{nonce:x}"
    seg, made = None, torch.zeros(3, dtype=torch.int64)  # (pid, nonce, ok) of rank 0's segment
    if comm.rank == 0:
        with contextlib.suppress(OSError, ValueError):  # ValueError: more ranks than it has lines for
            seg = Segment(path, comm.size, max_bytes, create=True, nonce=nonce)
            made[:] = torch.tensor([os.getpid(), nonce, 1])
    made = comm._broadcast(made, 0)
    failed = torch.tensor([0 if made[2] else 1], dtype=torch.int64)
    if comm.rank != 0 and made[2]:
        pid, nonce = int(made[0]), int(made[1])
        try:
            seg = Segment(Path(SHM_DIR) / f"{PREFIX}{pid}-{nonce:x}", comm.size, max_bytes, create=False, nonce=nonce)
        except OSError:
            failed[0] = 1
    if seg is not None:
        seg.words[seg.line(comm.rank) + PID] = os.getpid()
    failed = comm._all_reduce(failed, "max")  # every rank has mapped it (and written its pid), or one could not
    if seg is not None:
        seg.unlink()  # rank 0's name goes; the mapping stays
    why = f"a rank could not make or map a segment of {2 * comm.size * max_bytes} bytes in {SHM_DIR}"
    if not failed[0]:
        # NOTE: a peer's death is seen by its pid: each must be visible here (one pid namespace)
        pids = [seg.words[seg.line(r) + PID] for r in range(comm.size)]
        hidden = any(pid <= 0 or proc_state(pid) is None for pid in pids)
        failed = comm._all_reduce(torch.tensor([int(hidden)], dtype=torch.int64), "max")
        why = "a rank cannot see its peers' processes (another pid namespace)"
    if failed[0]:
        if seg is not None:
            seg.close()
        return None, why
    return ShmCommunicator(comm, seg, period=period), ""
