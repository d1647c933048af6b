"""Which wire format a tensor-parallel group's all-reduces carry (shardwise.comm.compress).

    all_reduce_s(link, values, p, "q8")   # predicted seconds of one all-reduce of `values`
    best_wire(link, values, p)            # ("q8", {"fp32": ..., "bf16": ..., "q8": ...})
    choose_wire("auto", tp, world, values=batch * hidden)   # at run time, every rank of tp

fp32 is one all-reduce on the link (specs.Link's alpha-beta time). bf16 and q8 are an
all_to_all and an all_gather (each rank sends (p - 1) / p of the payload twice, as a ring
all-reduce does) of 2 or 1.125 bytes a value, plus the encoding and decoding on the CPU:
CODEC_US per call and CODEC_NS a value (measured on this host, one core per rank). On a fast
link the two extra latencies and the codec cost more than the bytes saved; on a slow one
(a tp group across hosts) the bytes win.

At run time `auto` is fp32 unless this tp group spans hosts (the ranks' host labels, as
shardwise.launch.hosts gathers them); then the group times one all-reduce of the step's size
in each format (measure_wires: the slowest rank's, a pause before each as a step's compute
leaves between two) and takes the fastest. Timed at the step's own size, not extrapolated
from a large message: a shaped link (a token bucket) passes a message that fits its bucket
at the speed of the wire beneath, so a 1 MiB probe's rate would price a decode step's 8 KiB
all-reduces as slow as a long transfer and pick a compressed format where fp32 is faster.
"""

from __future__ import annotations

import math
import time

import torch

from shardwise.comm import Communicator
from shardwise.comm.compress import WIRES, compressed_all_reduce
from shardwise.log import get_logger
from shardwise.planner.specs import Link

__all__ = [
    "WIRE_BYTES",
    "CODEC_US",
    "CODEC_NS",
    "all_reduce_s",
    "encoded_decode_s",
    "best_wire",
    "measure_wires",
    "choose_wire",
]

log = get_logger("wire")

WIRE_BYTES = {"fp32": 4.0, "bf16": 2.0, "q8": 36 / 32}
"""Bytes a value on the wire."""
CODEC_US = {"fp32": 0.0, "bf16": 23.0, "q8": 70.0}
"""Encoding and decoding one all-reduce, fixed part (microseconds; measured at 576 values)."""
CODEC_NS = {"fp32": 0.0, "bf16": 0.7, "q8": 1.7}
"""... and per value (nanoseconds; the slope between 576 and 65536 values)."""


def all_reduce_s(link: Link, values: float, p: int, wire: str) -> float:
    """Predicted seconds of one all-reduce of `values` values over p ranks on `link`."""
    if p <= 1:
        return 0.0
    if wire == "fp32":
        return link.all_reduce_s(values * 4, p)
    share = values * WIRE_BYTES[wire] / p  # one rank's chunk
    return 2 * link.all_gather_s(share, p) + (CODEC_US[wire] + values * CODEC_NS[wire] * 1e-3) * 1e-6


def encoded_decode_s(link: Link, values: float, p: int, wire: str, burst_s: float) -> float | None:
    """Seconds of one encoded all-reduce of `values` inside a per-op decode step, from the
    link's decode figures for that wire (specs.Link.decode_s of "q8 all_to_all" and "q8
    all_gather": measure.decode_step_rank with the wire set), plus the encoding and decoding;
    None where the wire's decode step was not measured on this link."""
    if p <= 1:
        return 0.0
    a2a = link.decode_s(f"{wire} all_to_all", values * WIRE_BYTES[wire], p, burst_s=burst_s)
    gather = link.decode_s(f"{wire} all_gather", values * WIRE_BYTES[wire] / p, p, burst_s=burst_s)
    if a2a is None or gather is None:
        return None
    return a2a + gather + (CODEC_US[wire] + values * CODEC_NS[wire] * 1e-3) * 1e-6


def best_wire(link: Link, values: float, p: int) -> tuple[str, dict[str, float]]:
    """The fastest wire format for an all-reduce of `values` over p ranks, and each one's seconds."""
    times = {w: all_reduce_s(link, values, p, w) for w in WIRES}
    return min(times, key=times.get), times


WIRE_GAP_S = 0.002
"""Pause before each timed all-reduce in measure_wires: about what a decode layer's compute
leaves between two all-reduces, so that a shaped link's token bucket refills as in a step."""


def measure_wires(tp: Communicator, values: int, repeats: int = 5) -> dict[str, float]:
    """Seconds of one all-reduce of `values` fp32 values on `tp` in each wire format: the
    fastest of `repeats` (after one untimed), each after WIRE_GAP_S; the slowest rank's, so
    that every rank gets the same figures and picks the same format."""
    x = torch.randn(values, generator=torch.Generator().manual_seed(tp.rank))
    times = []
    for wire in WIRES:
        best = math.inf
        for i in range(repeats + 1):
            time.sleep(WIRE_GAP_S)
            t0 = time.perf_counter()
            if wire == "fp32":
                tp.all_reduce(x.clone())
            else:
                compressed_all_reduce(x, tp, wire)
            if i:
                best = min(best, time.perf_counter() - t0)
        times.append(best)
    worst = tp.all_reduce(torch.tensor(times, dtype=torch.float64), op="max").tolist()
    return dict(zip(WIRES, worst, strict=True))


def choose_wire(requested: str, tp: Communicator, world: Communicator, *, values: int) -> str:
    """The wire format for `tp` (--comm-dtype): `requested`, or for "auto" the planner's choice
    (see the module docstring) for all-reduces of `values` values. Collective on `world` when
    auto and the job's ranks are on several hosts; every rank of the job must call it."""
    if requested != "auto":
        if requested not in WIRES:
            raise ValueError(f"--comm-dtype {requested!r} is not one of auto, {', '.join(WIRES)}")
        return requested
    from shardwise.launch.env import external_rank
    from shardwise.launch.hosts import gather_hosts

    ext = external_rank()
    if tp.size == 1 or ext is None or ext.local_world_size == ext.world_size:
        return "fp32"  # one host: its links are fast
    hosts = gather_hosts(world, ext.host)
    if len({hosts.labels[r] for r in tp.members}) == 1:
        return "fp32"
    times = measure_wires(tp, values)
    wire = min(times, key=times.get)
    if tp.rank == 0:
        shown = ", ".join(f"{w} {s * 1e3:.3f} ms" for w, s in times.items())
        log.info(
            "tp group %s spans hosts; an all-reduce of %d values measured %s -> --comm-dtype %s",
            list(tp.members), values, shown, wire,
        )  # fmt: skip
    return wire
