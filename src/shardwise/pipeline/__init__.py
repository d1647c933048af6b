"""Pipeline parallelism: schedules as data (per-rank action lists), a simulator that checks
them, the stage split, and the runtime that executes a rank's list.

What this package exports is pure logic (stdlib only: the planner imports it without
torch). The torch parts are imported from their modules:

    shardwise.pipeline.stage     StageLayout (layers per stage), keep_stage (cut a model to a stage)
    shardwise.pipeline.runtime   PipelineRunner (run one rank's actions on its stage)
"""

from shardwise.pipeline.actions import TRANSFERS, Action, Kind
from shardwise.pipeline.config import SCHEDULE_NAMES, ScheduleConfig, ScheduleError
from shardwise.pipeline.schedules import SCHEDULES, Schedule, build_schedule, gpipe, interleaved, one_f_one_b
from shardwise.pipeline.simulate import Costs, ScheduleCheckError, Simulation, simulate
from shardwise.pipeline.transfers import add_transfers

__all__ = [
    "TRANSFERS",
    "Action",
    "Kind",
    "SCHEDULE_NAMES",
    "ScheduleConfig",
    "ScheduleError",
    "SCHEDULES",
    "Schedule",
    "build_schedule",
    "gpipe",
    "interleaved",
    "one_f_one_b",
    "Costs",
    "ScheduleCheckError",
    "Simulation",
    "simulate",
    "add_transfers",
]
