"""Pipeline parallelism, as data: schedules (per-rank action lists) and a simulator that checks them.

Pure logic (stdlib only): nothing here imports torch or shardwise.comm. The runtime that
executes these lists on a pp mesh is a later step of issue 13.
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
