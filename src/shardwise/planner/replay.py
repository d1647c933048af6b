"""A schedule replayed on integers: the makespan, the transfers and the activations held of
shardwise.pipeline's schedules, the same numbers shardwise.pipeline.simulate gives on
build_schedule's action lists, fast enough for pipelines as deep as the model has layers.

    r = Replay.build("interleaved", pp=64, microbatches=128, virtual_stages=2)   # ~0.3 s
    r.makespan(forward=0.5, backward=1.0, transfer=0.05)                            # ~20 ms
    r.peak_in_flight, r.transfers, r.messages

Why it is the simulator's answer (tests/unit/test_planner_replay.py checks it over many
(schedule, pp, micro-batches, virtual stages) and random costs):

1. The compute orders are the schedules' own (pipeline/schedules.py: GPipe, 1F1B, and
   interleaved 1F1B's groups of pp and warm-up of 2 (p - r - 1) + (v - 1) p forwards).
2. transfers.add_transfers places every send and receive by ONE global sequence: computes
   and messages sorted by their time on an ideal unit-cost clock. The same sequence is
   built here, with the same sort key.
3. A blocking (rendezvous) send makes the simulator a max-plus system: a compute starts
   when its rank is free; a transfer starts when both ranks have reached it and holds both.
   Its times do not depend on the order the simulator visits the ranks in, and the global
   sequence is a valid execution order, so one pass over it gives the same times.

The activations held depend on the order alone: counted once, in the same pass.

NOTE: the replay trusts the schedules to be valid (the simulator checks them; tests run
the simulator on the same sizes); it is the planner's clock, not a checker.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from shardwise.pipeline import ScheduleConfig

__all__ = ["Replay", "compute_orders"]

FWD, BWD = 0, 1


def _one_f_one_b(forwards: list, backwards: list, warmup: int) -> list:
    order = forwards[:warmup]
    for f, b in zip(forwards[warmup:], backwards, strict=False):
        order += [f, b]
    return order + backwards[len(forwards) - warmup :]


def compute_orders(name: str, pp: int, m: int, v: int) -> list[list[tuple[int, int, int]]]:
    """Per rank, its (FWD | BWD, micro-batch, virtual stage) in the order the schedule runs
    them: pipeline/schedules.py's orders, without the transfers."""
    if name == "gpipe":
        return [[(FWD, i, s) for i in range(m)] + [(BWD, i, s) for i in range(m)] for s in range(pp)]
    if name == "1f1b":
        return [
            _one_f_one_b([(FWD, i, s) for i in range(m)], [(BWD, i, s) for i in range(m)], min(pp - s - 1, m))
            for s in range(pp)
        ]
    order = [(g + k, c) for g in range(0, m, pp) for c in range(v) for k in range(min(pp, m - g))]
    out = []
    for r in range(pp):
        forwards = [(FWD, i, c * pp + r) for i, c in order]
        backwards = [(BWD, i, (v - 1 - c) * pp + r) for i, c in order]
        out.append(_one_f_one_b(forwards, backwards, min(2 * (pp - r - 1) + (v - 1) * pp, len(forwards))))
    return out


@dataclass(frozen=True)
class Replay:
    """One schedule's global sequence, ready to be timed with any costs."""

    pp: int
    microbatches: int
    virtual_stages: int
    events: tuple[tuple[int, int], ...]
    """The global sequence: (rank, -1) a forward, (rank, -2) a backward, (src, dst) a message."""
    peak_in_flight: tuple[int, ...]
    """Per rank: most micro-batch x chunk activations held at once (simulate's peak_in_flight)."""
    peak_in_flight_per_stage: tuple[int, ...]
    transfers: tuple[int, ...]
    """Per rank: its sends and receives."""
    messages: int
    """Stage-to-stage messages, all ranks (each send once)."""

    @classmethod
    def build(cls, name: str, pp: int, microbatches: int, virtual_stages: int = 1) -> Replay:
        return _build(name, pp, microbatches, virtual_stages)

    def makespan(self, forward: float, backward: float, transfer: float) -> float:
        """simulate(...).makespan with Costs(forward, backward, transfer): one action's costs."""
        clock = [0.0] * self.pp
        for a, b in self.events:
            if b == -1:
                clock[a] += forward
            elif b == -2:
                clock[a] += backward
            else:
                end = (clock[a] if clock[a] > clock[b] else clock[b]) + transfer
                clock[a] = clock[b] = end
        return max(clock)


@lru_cache(maxsize=64)
def _build(name: str, pp: int, m: int, v: int) -> Replay:
    cfg = ScheduleConfig(name, pp, m, v)  # the runtime's refusals, one line
    stages = cfg.stages
    orders = compute_orders(name, pp, m, v)
    # 1. the ideal clock (unit costs, free buffered transfers): each compute's start
    f_end = [[-1] * m for _ in range(stages)]
    b_end = [[-1] * m for _ in range(stages)]
    starts = [[0] * len(o) for o in orders]
    clock, pos, left = [0] * pp, [0] * pp, sum(len(o) for o in orders)
    while left:
        progressed = False
        for r in range(pp):
            order, p, t = orders[r], pos[r], clock[r]
            while p < len(order):
                kind, i, s = order[p]
                if kind == FWD:
                    if s > 0:
                        dep = f_end[s - 1][i]
                        if dep < 0:
                            break
                        t = dep if dep > t else t
                    f_end[s][i] = t + 1
                else:
                    dep = f_end[s][i]
                    if dep < 0:
                        break
                    t = dep if dep > t else t
                    if s < stages - 1:
                        dep = b_end[s + 1][i]
                        if dep < 0:
                            break
                        t = dep if dep > t else t
                    b_end[s][i] = t + 1
                starts[r][p] = t
                t += 1
                p += 1
                left -= 1
                progressed = True
            pos[r], clock[r] = p, t
        if not progressed:
            raise RuntimeError(f"{name} pp={pp} m={m} v={v}: compute orders wait on each other in a cycle")
    # 2. one global sequence, sorted as transfers.add_transfers sorts it:
    # (time, 0 = message | 1 = compute, tie-breakers)
    keyed = []
    for r, order in enumerate(orders):
        for (kind, i, s), t in zip(order, starts[r], strict=True):
            keyed.append(((t, 1, r), (r, -1 - kind)))
            if kind == FWD:
                if s > 0 and (s - 1) % pp != r:
                    keyed.append(((f_end[s - 1][i], 0, s - 1, False, i), ((s - 1) % pp, r)))
            elif s < stages - 1 and (s + 1) % pp != r:
                keyed.append(((b_end[s + 1][i], 0, s + 1, True, i), ((s + 1) % pp, r)))
            # (a backward's own forward is on this rank: no message)
    keyed.sort(key=lambda e: e[0])
    events = tuple(e for _, e in keyed)
    # 3. what the order alone decides: activations held, transfers
    held, peak = [0] * pp, [0] * pp
    held_s, peak_s = [0] * stages, [0] * stages
    transfers, messages = [0] * pp, 0
    at = [0] * pp
    for a, b in events:
        if b >= 0:
            transfers[a] += 1
            transfers[b] += 1
            messages += 1
            continue
        kind, _, s = orders[a][at[a]]
        at[a] += 1
        step = 1 if kind == FWD else -1
        held[a] += step
        held_s[s] += step
        peak[a] = max(peak[a], held[a])
        peak_s[s] = max(peak_s[s], held_s[s])
    return Replay(pp, m, v, events, tuple(peak), tuple(peak_s), tuple(transfers), messages)
