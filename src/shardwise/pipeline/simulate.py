"""A single-process simulator: run every rank's action list as blocking send/recv would.

It checks a schedule without processes and measures it:
- each send meets its receive (same micro-batch, direction, neighbouring stage, peer);
- nothing waits in a cycle (the lists finish);
- a forward has its input, a backward its forward and its output gradient, so backwards
  run in reverse stage order; each (stage, micro-batch) runs forward and backward exactly once;
and reports busy and idle time per rank, the makespan, the bubble (idle fraction) and the
peak number of micro-batches in flight (activations held) per rank and per virtual stage.

Two readings of a blocking send (`sends=`):
- "rendezvous" (the default, and the check): a send completes only when its receive is
  reached, as MPI and gloo do for large messages. A transfer starts when both ends have
  reached it and holds both for `Costs.transfer`. Lists that finish here finish under any
  buffering.
- "buffered": a send returns at once (small messages, eager protocols); the message arrives
  `Costs.transfer` later, and receives take messages from each peer in order (MPI's
  non-overtaking rule). Shows what blocking costs a schedule.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Literal

from shardwise.pipeline.actions import Action, Kind

__all__ = ["Costs", "ScheduleCheckError", "Simulation", "simulate"]


class ScheduleCheckError(ValueError):
    """A malformed schedule: names the rank, the action and the micro-batch."""


@dataclass(frozen=True)
class Costs:
    """Time per action, in any unit."""

    forward: float = 1.0
    """One FORWARD (one micro-batch through one virtual stage)."""
    backward: float = 1.0
    """One BACKWARD."""
    transfer: float = 0.0
    """One send/receive pair (both ranks are held for it)."""

    def __post_init__(self) -> None:
        for name in ("forward", "backward"):
            if not getattr(self, name) > 0:
                raise ValueError(f"Costs.{name} must be > 0, got {getattr(self, name)!r}")
        if not self.transfer >= 0:
            raise ValueError(f"Costs.transfer must be >= 0, got {self.transfer!r}")


@dataclass(frozen=True)
class Simulation:
    """What running the lists took."""

    makespan: float
    """Time until the last rank finishes."""
    busy: list[float]
    """Per rank: time spent computing (transfers are not busy time)."""
    idle: list[float]
    """Per rank: makespan - busy."""
    peak_in_flight: list[int]
    """Per rank: most micro-batch x chunk activations held at once (forward done, backward not)."""
    peak_in_flight_per_stage: list[int]
    """Per virtual stage: most micro-batches in flight at once."""
    timeline: list[list[tuple[float, float, Action]]] = field(repr=False)
    """Per rank: (start, end, action) in execution order."""

    @property
    def bubble(self) -> float:
        """Idle fraction of all ranks' wall time: sum(idle) / (pp * makespan)."""
        return sum(self.idle) / (len(self.idle) * self.makespan)


def _fail(rank: int, action: Action, why: str) -> ScheduleCheckError:
    return ScheduleCheckError(f"rank {rank}, {action}: {why}")


def simulate(
    lists: list[list[Action]],
    *,
    microbatches: int | None = None,
    virtual_stages: int | None = None,
    costs: Costs | None = None,
    sends: Literal["rendezvous", "buffered"] = "rendezvous",
) -> Simulation:
    """Run `lists` (one per pp rank). `microbatches` and `virtual_stages` default to what the
    lists mention; give them to also catch a micro-batch or chunk that no list mentions.
    `costs` defaults to Costs(): forward = backward = 1, free transfers. `sends`: see the module
    docstring; "rendezvous" is the check, "buffered" shows what blocking costs."""
    costs = costs if costs is not None else Costs()
    if sends not in ("rendezvous", "buffered"):
        raise ValueError(f"sends must be 'rendezvous' or 'buffered', got {sends!r}")
    pp = len(lists)
    if pp < 1:
        raise ScheduleCheckError("no ranks: the schedule has no action lists")
    seen = [a for actions in lists for a in actions]
    m = microbatches if microbatches is not None else max((a.microbatch for a in seen), default=-1) + 1
    v = virtual_stages if virtual_stages is not None else max((a.stage for a in seen), default=-1) // pp + 1
    stages = pp * v
    if m < 1 or stages < 1:
        raise ScheduleCheckError(f"the lists hold no FORWARD or BACKWARD (microbatches={m}, virtual_stages={v})")
    for r, actions in enumerate(lists):
        for a in actions:
            _check_static(r, a, pp, m, stages)

    pos = [0] * pp
    clock = [0.0] * pp
    busy = [0.0] * pp
    timeline: list[list[tuple[float, float, Action]]] = [[] for _ in range(pp)]
    done: set[Action] = set()  # FORWARD/BACKWARD that ran (peer-less actions)
    have: set[tuple[Kind, int, int]] = set()  # (FORWARD = input | BACKWARD = output grad, mb, stage) present
    sent: set[Action] = set()  # sends that happened (a send's stage fixes its rank)
    channels: dict[tuple[int, int], deque[tuple[float, Action]]] = {}  # buffered: (src, dst) -> (arrival, send)
    held = [0] * pp
    peak = [0] * pp
    held_stage = [0] * stages
    peak_stage = [0] * stages

    def run_compute(r: int, a: Action) -> None:
        if a in done:
            raise _fail(r, a, "runs a second time")
        if a.kind == Kind.FORWARD:
            if a.stage > 0 and (Kind.FORWARD, a.microbatch, a.stage) not in have:
                raise _fail(r, a, f"has no input: no RECV_ACT for microbatch {a.microbatch} before it")
            cost = costs.forward
            held[r] += 1
            held_stage[a.stage] += 1
            peak[r] = max(peak[r], held[r])
            peak_stage[a.stage] = max(peak_stage[a.stage], held_stage[a.stage])
            if a.stage + 1 < stages and (a.stage + 1) % pp == r:  # the next chunk is local (pp = 1)
                have.add((Kind.FORWARD, a.microbatch, a.stage + 1))
        else:
            if Action(Kind.FORWARD, a.microbatch, a.stage) not in done:
                raise _fail(r, a, f"runs before the forward of microbatch {a.microbatch} on stage {a.stage}")
            if a.stage < stages - 1 and (Kind.BACKWARD, a.microbatch, a.stage) not in have:
                raise _fail(r, a, f"has no output gradient: no RECV_GRAD for microbatch {a.microbatch} before it")
            cost = costs.backward
            held[r] -= 1
            held_stage[a.stage] -= 1
            if a.stage > 0 and (a.stage - 1) % pp == r:
                have.add((Kind.BACKWARD, a.microbatch, a.stage - 1))
        done.add(a)
        timeline[r].append((clock[r], clock[r] + cost, a))
        clock[r] += cost
        busy[r] += cost

    def check_send(rank: int, send: Action) -> None:
        produced = Action(Kind.FORWARD if send.kind == Kind.SEND_ACT else Kind.BACKWARD, send.microbatch, send.stage)
        if produced not in done:
            raise _fail(rank, send, f"sends before {produced} ran")
        if send in sent:
            raise _fail(rank, send, "sends a second time")
        sent.add(send)

    def receive(recv: Action) -> None:
        have.add((Kind.FORWARD if recv.kind == Kind.RECV_ACT else Kind.BACKWARD, recv.microbatch, recv.stage))

    def try_buffered(r: int, a: Action) -> bool:
        q = a.peer
        assert q is not None
        if a.is_send:
            check_send(r, a)
            channels.setdefault((r, q), deque()).append((clock[r] + costs.transfer, a))
            timeline[r].append((clock[r], clock[r], a))
            pos[r] += 1
            return True
        queue = channels.get((q, r))
        if not queue:
            return False
        arrival, b = queue[0]
        if b != a.counterpart(r):
            raise _fail(r, a, f"gets {b} from rank {q}: expected {a.counterpart(r)}")
        queue.popleft()
        receive(a)
        start = max(clock[r], arrival)
        timeline[r].append((start, start, a))
        clock[r] = start
        pos[r] += 1
        return True

    def try_transfer(r: int, a: Action) -> bool:
        if sends == "buffered":
            return try_buffered(r, a)
        q = a.peer
        assert q is not None
        if pos[q] >= len(lists[q]):
            return False
        b = lists[q][pos[q]]
        if not b.is_transfer or b.peer != r:
            return False  # the peer is busy with something else, or talks to another rank
        if b.is_send == a.is_send:
            return False  # both send or both receive: wait (a deadlock if it never changes)
        if b != a.counterpart(r):
            raise _fail(r, a, f"meets {b} on rank {q}: expected {a.counterpart(r)} there")
        (send, send_rank), recv = ((a, r), b) if a.is_send else ((b, q), a)
        check_send(send_rank, send)
        receive(recv)
        start = max(clock[r], clock[q])
        end = start + costs.transfer
        timeline[r].append((start, end, a))
        timeline[q].append((start, end, b))
        clock[r] = clock[q] = end
        pos[r] += 1
        pos[q] += 1
        return True

    while any(pos[r] < len(lists[r]) for r in range(pp)):
        progressed = False
        for r in range(pp):
            while pos[r] < len(lists[r]):
                a = lists[r][pos[r]]
                if a.is_transfer:
                    if not try_transfer(r, a):
                        break
                else:
                    run_compute(r, a)
                    pos[r] += 1
                progressed = True
        if not progressed:
            waits = "; ".join(f"rank {r} waits at {lists[r][pos[r]]}" for r in range(pp) if pos[r] < len(lists[r]))
            raise ScheduleCheckError(f"deadlock: {waits}")

    for (src, _), queue in channels.items():
        if queue:
            raise _fail(src, queue[0][1], "is never received")
    for s in range(stages):
        for i in range(m):
            for kind in (Kind.FORWARD, Kind.BACKWARD):
                a = Action(kind, i, s)
                if a not in done:
                    raise _fail(s % pp, a, f"never runs: microbatch {i} has no {kind.value} on stage {s}")
    makespan = max(clock)
    return Simulation(
        makespan=makespan,
        busy=busy,
        idle=[makespan - b for b in busy],
        peak_in_flight=peak,
        peak_in_flight_per_stage=peak_stage,
        timeline=timeline,
    )


def _check_static(r: int, a: Action, pp: int, m: int, stages: int) -> None:
    """What one action can get wrong on its own: ranges, the rank it belongs to, its peer."""
    if not 0 <= a.microbatch < m:
        raise _fail(r, a, f"microbatch {a.microbatch} is out of range 0..{m - 1}")
    if not 0 <= a.stage < stages:
        raise _fail(r, a, f"stage {a.stage} is out of range 0..{stages - 1}")
    if a.stage % pp != r:
        raise _fail(r, a, f"stage {a.stage} lives on rank {a.stage % pp}, not rank {r}")
    if not a.is_transfer:
        if a.peer is not None:
            raise _fail(r, a, "a compute action has a peer")
        return
    other = a.stage + (1 if a.kind in (Kind.SEND_ACT, Kind.RECV_GRAD) else -1)
    if not 0 <= other < stages:
        raise _fail(r, a, f"no stage {other} to talk to (stages 0..{stages - 1})")
    if other % pp == r:
        raise _fail(r, a, f"stage {other} is on this rank too: no transfer is needed")
    if a.peer != other % pp:
        raise _fail(r, a, f"the peer must be rank {other % pp} (stage {other}), got {a.peer}")
