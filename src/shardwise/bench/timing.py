"""How the calibration and the benchmarks time a call: the fastest of several."""

from __future__ import annotations

import time
from collections.abc import Callable

from shardwise.comm import Communicator

__all__ = ["best_time"]


def best_time(fn: Callable[[], object], repeats: int, warmup: int = 1, sync: Communicator | None = None) -> float:
    """Fastest seconds of fn() over `repeats` calls, after `warmup` calls; with `sync`, every
    call starts after a barrier, so that all ranks run it at the same time.

    NOTE: the fastest, not the median: on a shared machine other processes only ever add
    time, and the planner predicts a machine that is not shared."""
    times = []
    for i in range(warmup + repeats):
        if sync is not None and sync.size > 1:
            sync.barrier()
        t0 = time.perf_counter()
        fn()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return min(times)
