"""Placing the sends and receives: each rank's compute order in, full action lists out.

A schedule chooses only the order of forwards and backwards on each rank. This module adds
the transfers, so that every schedule gets them by the same rule, one that cannot deadlock
with blocking point-to-point (gloo's and MPI's send/recv, no batched isend/irecv):

1. Run the compute orders on an ideal clock (unit cost, free transfers, buffered).
   Each cross-rank dependency (a forward's output, a backward's input gradient) becomes a
   message, timed when its producer finishes.
2. Sort every compute and every message into ONE global sequence by that time (a message
   before a compute starting at the same instant; ties broken by a fixed key).
3. Each rank's list is that sequence seen from the rank: its computes, and its end of
   each message (SEND_* on the producer, RECV_* on the consumer).

NOTE: why this cannot deadlock, even if a send blocks until its receive is posted
(rendezvous, the strictest semantics): executing the global sequence in order is a valid
run. When it reaches a message, both ranks have finished everything before it in their
lists (which is everything before it in the sequence) and stand at its send and its
receive. So the lists never wait in a cycle. Within one pair of neighbours this comes
down to "both agree which of two crossing messages goes first", the job rank parity does
in other systems, here for every pattern at once (interleaved included).
"""

from __future__ import annotations

from shardwise.pipeline.actions import Action, Kind

__all__ = ["add_transfers"]


def _ideal_times(compute: list[list[Action]], pp: int, stages: int) -> dict[Action, tuple[float, float]]:
    """(start, end) of every compute action on a unit-cost clock with free, buffered transfers."""
    done: dict[Action, tuple[float, float]] = {}
    clock = [0.0] * pp
    pos = [0] * pp
    while any(pos[r] < len(compute[r]) for r in range(pp)):
        progressed = False
        for r in range(pp):
            while pos[r] < len(compute[r]):
                a = compute[r][pos[r]]
                deps = _dependencies(a, stages)
                if any(d not in done for d in deps):
                    break
                start = max([clock[r], *(done[d][1] for d in deps)])
                done[a] = (start, start + 1.0)
                clock[r] = start + 1.0
                pos[r] += 1
                progressed = True
        if not progressed:
            stuck = "; ".join(f"rank {r} at {compute[r][pos[r]]}" for r in range(pp) if pos[r] < len(compute[r]))
            raise RuntimeError(f"compute orders wait on each other in a cycle: {stuck}")
    return done


def _dependencies(a: Action, stages: int) -> list[Action]:
    """The computes `a` needs the result of."""
    if a.kind == Kind.FORWARD:
        return [Action(Kind.FORWARD, a.microbatch, a.stage - 1)] if a.stage > 0 else []
    deps = [Action(Kind.FORWARD, a.microbatch, a.stage)]
    if a.stage < stages - 1:
        deps.append(Action(Kind.BACKWARD, a.microbatch, a.stage + 1))
    return deps


def add_transfers(compute: list[list[Action]], *, stages: int) -> list[list[Action]]:
    """The full action lists: `compute[r]` (FORWARD/BACKWARD only, in order) plus every
    send and receive, placed as the module docstring explains."""
    pp = len(compute)
    times = _ideal_times(compute, pp, stages)
    # Sort key: (time, 0 = message | 1 = compute, tie-breakers). A producer starts strictly
    # before its message (unit cost) and a consumer at or after it, so both ends fall on the
    # right side of the compute they belong with.
    events: list[tuple[tuple, Action, int]] = []
    for r, actions in enumerate(compute):
        for a in actions:
            events.append(((times[a][0], 1, r), a, r))
            for d in _dependencies(a, stages):
                if d.stage % pp != r:  # a cross-rank input: one message from d's rank to r
                    events.append(((times[d][1], 0, d.stage, a.kind == Kind.BACKWARD, a.microbatch), a, r))
    events.sort(key=lambda e: e[0])
    lists: list[list[Action]] = [[] for _ in range(pp)]
    for key, a, r in events:
        if key[1] == 1:
            lists[r].append(a)
            continue
        src = (a.stage - 1 if a.kind == Kind.FORWARD else a.stage + 1) % pp
        if a.kind == Kind.FORWARD:
            lists[src].append(Action(Kind.SEND_ACT, a.microbatch, a.stage - 1, peer=r))
            lists[r].append(Action(Kind.RECV_ACT, a.microbatch, a.stage, peer=src))
        else:
            lists[src].append(Action(Kind.SEND_GRAD, a.microbatch, a.stage + 1, peer=r))
            lists[r].append(Action(Kind.RECV_GRAD, a.microbatch, a.stage, peer=src))
    return lists
