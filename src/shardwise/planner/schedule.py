"""The pipeline a training layout with pp > 1 assumes, and what its schedule costs.

    s = PipelineSchedule.build("1f1b", num_layers=32, pp=4, microbatches=16)
    s.layers                              # (8, 8, 8, 8): StageLayout.build's balanced split
    s.makespan(forward_s, backward_s, transfer_s)   # the pipeline part of one step
    s.profile().in_flight                 # per rank: micro-batch x chunk activations held at most
    s.loads()                             # per rank: layers and activations held (footprint.StageLoad)

What is valid is decided by the runtime's own checks (ScheduleConfig, StageLayout.build), so
the planner offers only what `shardwise train` runs. Times come from shardwise.pipeline.simulate
run on the schedule's own action lists, with every action timed as the busiest rank's
(uniform costs: a pipeline runs at the pace of its slowest stage); sends are rendezvous, as
gloo and MPI send activations of this size.

NOTE: simulating m micro-batches takes O(p m) actions, and building the lists more; past
p + 1 micro-batches (interleaved: 3p) the makespan, the transfers per rank and the
activations held grow by the same amount per micro-batch (per group of p for interleaved),
so the schedule is simulated at p and p + 1 (interleaved: 2p and 3p) and extrapolated
linearly in m (tests/unit/test_planner_pipeline.py checks this against a direct
simulation). Pipelines deeper than MAX_PP stages are not planned (the lists would take
seconds to build).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from shardwise.pipeline import Costs, ScheduleConfig, ScheduleError, build_schedule, simulate
from shardwise.pipeline.actions import Action
from shardwise.pipeline.stage import StageError, StageLayout
from shardwise.planner.footprint import StageLoad

__all__ = ["PipelineSchedule", "schedule_options", "MAX_PP", "INTERLEAVED_CHUNKS", "train_flags"]

MAX_PP = 32
"""The deepest pipeline the planner simulates."""

INTERLEAVED_CHUNKS = 2
"""Model chunks per rank (virtual_stages) the planner assumes for the interleaved schedule."""


@lru_cache(maxsize=256)
def _lists(name: str, pp: int, m: int, v: int) -> tuple[tuple[Action, ...], ...]:
    return tuple(tuple(a) for a in build_schedule(name, pp, m, v))


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
        if pp > MAX_PP:
            raise ScheduleError(f"pp={pp}: the planner simulates pipelines of at most {MAX_PP} stages")
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

    def lists(self, m: int | None = None) -> tuple[tuple[Action, ...], ...]:
        return _lists(self.name, self.pp, self.microbatches if m is None else m, self.virtual_stages)

    def _sim(self, m: int, costs: Costs):
        return simulate(
            [list(x) for x in self.lists(m)], microbatches=m, virtual_stages=self.virtual_stages, costs=costs
        )

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
        costs = Costs(forward=forward_s / v, backward=backward_s / v, transfer=transfer_s)
        return self._extrapolate(lambda m: self._sim(m, costs).makespan)

    def bubble(self, forward_s: float, backward_s: float) -> float:
        """The schedule's idle fraction with free transfers (simulate's `bubble`)."""
        return 1 - self.microbatches * (forward_s + backward_s) / self.makespan(forward_s, backward_s, 0.0)


@lru_cache(maxsize=256)
def _profile(name: str, pp: int, m: int, v: int) -> Profile:
    s = PipelineSchedule(name, pp, m, v, (1,) * (pp * v))

    def counts(mm: int) -> tuple[float, ...]:
        lists = s.lists(mm)
        sim = simulate([list(x) for x in lists], microbatches=mm, virtual_stages=v)
        transfers = tuple(float(sum(a.is_transfer for a in r)) for r in lists)
        sends = float(sum(a.is_send for r in lists for a in r if a.is_transfer))
        return (*transfers, *map(float, sim.peak_in_flight), float(sim.peak_in_flight_per_stage[-1]), sends)

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
