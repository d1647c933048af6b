"""The pipeline a training layout with pp > 1 assumes, and what its schedule costs.

    s = PipelineSchedule.build("1f1b", num_layers=32, pp=4, microbatches=16)
    s.layers                              # (8, 8, 8, 8): StageLayout.build's balanced split
    s.makespan(forward_s, backward_s, transfer_s)   # the pipeline part of one step
    s.profile().in_flight                 # per rank: micro-batch x chunk activations held at most
    s.loads()                             # per rank: layers and activations held (footprint.StageLoad)

What is valid is decided by the runtime's own checks (ScheduleConfig, StageLayout.build), so
the planner offers only what `shardwise train` runs, at every pp up to the layer count. Times
are shardwise.pipeline.simulate's on the schedule's own action lists, with every action timed
as the busiest rank's (uniform costs: a pipeline runs at the pace of its slowest stage);
sends are rendezvous, as gloo and MPI send activations of this size. They come from
planner/replay.py, which replays the same global sequence on integers (the simulator's
numbers exactly, tests/unit/test_planner_replay.py; a 64-stage interleaved schedule in well
under a second where building its action lists took seconds).

NOTE: past p + 1 micro-batches (interleaved: 3p) the makespan, the transfers per rank and
the activations held grow by the same amount per micro-batch (per group of p for
interleaved), so the schedule is replayed at p and p + 1 (interleaved: 2p and 3p) and
extrapolated linearly in m (tests/unit/test_planner_pipeline.py checks this against a
direct simulation).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

from shardwise.pipeline import ScheduleConfig, ScheduleError
from shardwise.pipeline.stage import StageError, StageLayout
from shardwise.planner.footprint import StageLoad
from shardwise.planner.replay import Replay

__all__ = ["PipelineSchedule", "schedule_options", "INTERLEAVED_CHUNKS", "train_flags"]

INTERLEAVED_CHUNKS = 2
"""Model chunks per rank (virtual_stages) the planner assumes for the interleaved schedule."""

DIRECT_PP = 8
"""GPipe and 1F1B deeper than this are not replayed: at any m their makespan is linear in p
from p = 3 on (tests/unit/test_planner_replay.py checks it against the simulator up to
p = 24), so it is replayed at p = 3 and 4 and extrapolated; their transfers and activations
held have closed forms (_closed_profile)."""


def _simulated_sizes(name: str, pp: int, m: int) -> tuple[int, int] | None:
    """The two micro-batch counts to simulate and extrapolate from, or None to simulate m itself."""
    a, step = (2 * pp, pp) if name == "interleaved" else (pp, 1)
    return None if m <= a + step else (a, a + step)


@dataclass(frozen=True)
class Profile:
    """What a schedule does, independent of how long an action takes (unit costs)."""

    transfers: tuple[float, ...]
    """Per rank: sends and receives per step."""
    in_flight: tuple[float, ...]
    """Per rank: most micro-batch x chunk activations held at once."""
    head_in_flight: float
    """Micro-batches whose logits the last virtual stage holds at once."""
    messages: float
    """Stage-to-stage messages per step, all ranks (each send counted once)."""


@dataclass(frozen=True)
class PipelineSchedule:
    """A schedule, its micro-batch count and the layer split, as `shardwise train` runs them."""

    name: str
    """"gpipe", "1f1b" or "interleaved"."""
    pp: int
    microbatches: int
    """m: micro-batches per optimizer step on each dp rank."""
    virtual_stages: int
    """Model chunks per rank (1, or INTERLEAVED_CHUNKS for interleaved)."""
    layers: tuple[int, ...]
    """Decoder layers per virtual stage (len = pp * virtual_stages): the runtime's default split."""

    @classmethod
    def build(cls, name: str, num_layers: int, pp: int, microbatches: int, virtual_stages: int | None = None):
        """The schedule as the runtime would run it. Raises ScheduleError or StageError (one line,
        the numbers named) for what `shardwise train` refuses."""
        v = virtual_stages if virtual_stages is not None else (INTERLEAVED_CHUNKS if name == "interleaved" else 1)
        ScheduleConfig(name, pp, microbatches, v)
        split = StageLayout.build(num_layers, pp, v)
        return cls(name, pp, microbatches, v, split.layers)

    @property
    def stage_layout(self) -> StageLayout:
        return StageLayout(sum(self.layers), self.pp, self.virtual_stages, self.layers)

    def rank_layers(self, rank: int) -> int:
        """Decoder layers on pp rank `rank` (all its chunks)."""
        return sum(self.layers[s] for s in self.stage_layout.stages_of(rank))

    def chunk_layers(self, rank: int) -> int:
        """Layers of the largest chunk on `rank`."""
        return max(self.layers[s] for s in self.stage_layout.stages_of(rank))

    def holds_head(self, rank: int) -> bool:
        return self.stage_layout.holds_head(rank)

    def describe(self) -> str:
        return self.stage_layout.describe()

    def replay(self, m: int | None = None) -> Replay:
        """The schedule at m micro-batches (default its own), replayed (planner/replay.py)."""
        return Replay.build(self.name, self.pp, self.microbatches if m is None else m, self.virtual_stages)

    def _extrapolate(self, f) -> float | tuple[float, ...]:
        """f(m') for the schedule's m: directly, or linear in m from two simulated sizes."""
        sizes = _simulated_sizes(self.name, self.pp, self.microbatches)
        if sizes is None:
            return f(self.microbatches)
        a, b = sizes
        ya, yb = f(a), f(b)
        k = (self.microbatches - a) / (b - a)
        if isinstance(ya, tuple):
            return tuple(x + k * (y - x) for x, y in zip(ya, yb, strict=True))
        return ya + k * (yb - ya)

    def profile(self) -> Profile:
        return _profile(self.name, self.pp, self.microbatches, self.virtual_stages)

    def loads(self) -> list[StageLoad]:
        """Per rank: its layers and the activations it holds at most (footprint.training_memory)."""
        prof = self.profile()
        return [
            StageLoad(r, self.rank_layers(r), self.chunk_layers(r), prof.in_flight[r],
                      prof.head_in_flight if self.holds_head(r) else 0.0)
            for r in range(self.pp)
        ]  # fmt: skip

    def makespan(self, forward_s: float, backward_s: float, transfer_s: float) -> float:
        """Seconds from the first forward to the last backward, every action of every rank
        timed as one chunk of the busiest rank: forward_s and backward_s are a whole rank's
        (all its chunks) for one micro-batch; transfer_s one send/receive pair."""
        v = self.virtual_stages
        if self.name != "interleaved" and self.pp > DIRECT_PP:  # linear in p from p = 3 (DIRECT_PP)
            a, b = (replace(self, pp=p).makespan(forward_s, backward_s, transfer_s) for p in (3, 4))
            return a + (self.pp - 3) * (b - a)
        return self._extrapolate(lambda m: self.replay(m).makespan(forward_s / v, backward_s / v, transfer_s))

    def bubble(self, forward_s: float, backward_s: float) -> float:
        """The schedule's idle fraction with free transfers (simulate's `bubble`)."""
        return 1 - self.microbatches * (forward_s + backward_s) / self.makespan(forward_s, backward_s, 0.0)


def _closed_profile(name: str, p: int, m: int) -> Profile:
    """GPipe and 1F1B (one chunk per rank): every micro-batch's activation goes down and its
    gradient up each of the p - 1 links, so an end rank sends or receives 2m times and a
    middle rank 4m; 1F1B's rank r holds min(p - r, m) micro-batches (its warm-up
    min(p - r - 1, m) plus one), GPipe's all m; the last stage's logits likewise."""
    transfers = tuple(float(2 * m if r in (0, p - 1) else 4 * m) for r in range(p))
    held = tuple(float(min(p - r, m) if name == "1f1b" else m) for r in range(p))
    return Profile(transfers, held, held[-1], float(2 * m * (p - 1)))


@lru_cache(maxsize=256)
def _profile(name: str, pp: int, m: int, v: int) -> Profile:
    if name != "interleaved":
        return _closed_profile(name, pp, m)
    s = PipelineSchedule(name, pp, m, v, (1,) * (pp * v))

    def counts(mm: int) -> tuple[float, ...]:
        r = s.replay(mm)
        in_flight = (*map(float, r.transfers), *map(float, r.peak_in_flight))
        return (*in_flight, float(r.peak_in_flight_per_stage[-1]), float(r.messages))

    x = s._extrapolate(counts)
    return Profile(tuple(x[:pp]), tuple(x[pp : 2 * pp]), x[2 * pp], x[2 * pp + 1])


def schedule_options(num_layers: int, pp: int, microbatches: int, wanted: str | None) -> tuple[list, str | None]:
    """([PipelineSchedule, ...] the runtime can run for this pp and m, 1f1b first; why none
    can, or None). `wanted`: one schedule name, or None for 1F1B and interleaved. pp = 1: [None]."""
    if pp == 1:
        return [None], None
    # GPipe only when asked: it has 1F1B's bubble (with transfers a little more) and holds all m
    names = [wanted] if wanted is not None else ["1f1b", "interleaved"]
    out, why = [], []
    for name in names:
        try:
            out.append(PipelineSchedule.build(name, num_layers, pp, microbatches))
        except (ScheduleError, StageError) as e:
            why.append(str(e))
    return out, (None if out else "; ".join(why))


def train_flags(layout_arg: str, schedule: PipelineSchedule | None, microbatches: int) -> str:
    """The `shardwise train` flags that run this layout."""
    flags = f"--layout {layout_arg}"
    if schedule is not None:
        flags += f" --schedule {schedule.name}"
        if schedule.virtual_stages > 1:
            flags += f" --virtual-stages {schedule.virtual_stages}"
    return flags + f" --microbatches {microbatches}"
