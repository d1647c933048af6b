"""The schedules: GPipe, 1F1B and interleaved 1F1B, as pure functions returning action lists.

Each generator decides only the order of forwards and backwards on every rank;
`transfers.add_transfers` places the sends and receives, the same way for all three.
The signature is `(pp, microbatches, virtual_stages=1) -> list[list[Action]]`, one list
per pp rank, in execution order.
"""

from __future__ import annotations

from collections.abc import Callable

from shardwise.pipeline.actions import Action, Kind
from shardwise.pipeline.config import ScheduleConfig
from shardwise.pipeline.transfers import add_transfers

__all__ = ["Schedule", "SCHEDULES", "build_schedule", "gpipe", "one_f_one_b", "interleaved"]

Schedule = Callable[..., list[list[Action]]]


def _F(mb: int, stage: int) -> Action:
    return Action(Kind.FORWARD, mb, stage)


def _B(mb: int, stage: int) -> Action:
    return Action(Kind.BACKWARD, mb, stage)


def _one_f_one_b(forwards: list[Action], backwards: list[Action], warmup: int) -> list[Action]:
    """`warmup` forwards, then alternate one forward and one backward, then the remaining
    backwards. Holds at most warmup + 1 forwards' activations."""
    order = forwards[:warmup]
    for f, b in zip(forwards[warmup:], backwards, strict=False):
        order += [f, b]
    order += backwards[len(forwards) - warmup :]
    return order


def gpipe(pp: int, microbatches: int, virtual_stages: int = 1) -> list[list[Action]]:
    """All forwards, then all backwards (backwards in the same micro-batch order).
    Every stage holds all m micro-batches' activations at the turn."""
    cfg = ScheduleConfig("gpipe", pp, microbatches, virtual_stages)
    m = cfg.microbatches
    compute = [[_F(i, s) for i in range(m)] + [_B(i, s) for i in range(m)] for s in range(pp)]
    return add_transfers(compute, stages=cfg.stages)


def one_f_one_b(pp: int, microbatches: int, virtual_stages: int = 1) -> list[list[Action]]:
    """1F1B (PipeDream-Flush): stage s runs min(p - s - 1, m) warm-up forwards, then one
    forward and one backward in turn, then the remaining backwards. Stage s holds at most
    min(p - s, m) micro-batches' activations."""
    cfg = ScheduleConfig("1f1b", pp, microbatches, virtual_stages)
    p, m = cfg.pp, cfg.microbatches
    compute = [
        _one_f_one_b([_F(i, s) for i in range(m)], [_B(i, s) for i in range(m)], warmup=min(p - s - 1, m))
        for s in range(p)
    ]
    return add_transfers(compute, stages=cfg.stages)


def interleaved(pp: int, microbatches: int, virtual_stages: int = 2) -> list[list[Action]]:
    """Interleaved 1F1B (Narayanan et al. 2021; Megatron-LM's schedule): rank r holds v model
    chunks, chunk c being virtual stage c * p + r. Micro-batches go in groups of p: a rank
    runs chunk 0 for the group's p micro-batches, then chunk 1 for the same p, ..., then the
    next group (backwards likewise, chunks in reverse). Rank r's warm-up is
    2 * (p - r - 1) + (v - 1) * p forwards, then 1F1B.

    NOTE: m must be a multiple of p (ScheduleConfig refuses others), as in Megatron-LM.
    With a short last group these orders wait on each other in a cycle for some (p, v, m)
    (e.g. p=4, v=3, m=5) and, where they finish, lose most of the gain over 1F1B.
    Megatron runs all m * v forwards as warm-up when m == p; the simulator shows the same
    bubble without it and fewer activations held on the later ranks, so there is no such case here."""
    cfg = ScheduleConfig("interleaved", pp, microbatches, virtual_stages)
    p, m, v = cfg.pp, cfg.microbatches, cfg.virtual_stages
    order = [(g + k, c) for g in range(0, m, p) for c in range(v) for k in range(min(p, m - g))]  # (microbatch, chunk)
    compute = []
    for r in range(p):
        forwards = [_F(i, c * p + r) for i, c in order]
        backwards = [_B(i, (v - 1 - c) * p + r) for i, c in order]
        compute.append(_one_f_one_b(forwards, backwards, warmup=min(2 * (p - r - 1) + (v - 1) * p, len(forwards))))
    return add_transfers(compute, stages=cfg.stages)


SCHEDULES: dict[str, Schedule] = {"gpipe": gpipe, "1f1b": one_f_one_b, "interleaved": interleaved}


def build_schedule(name: str, pp: int, microbatches: int, virtual_stages: int = 1) -> list[list[Action]]:
    """The action lists of the schedule called `name` ("gpipe" | "1f1b" | "interleaved").
    Raises ScheduleError (one line, the numbers named) before building anything."""
    cfg = ScheduleConfig(name, pp, microbatches, virtual_stages)
    return SCHEDULES[cfg.name](cfg.pp, cfg.microbatches, cfg.virtual_stages)
