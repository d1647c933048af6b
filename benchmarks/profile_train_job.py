"""Where a multi-rank training step's time goes, per operator: the --train-shape job of
benchmarks/bench_links.py (the same config, tp=2 on this host, gloo), `--steps` steps timed on
every rank (wall and thread seconds), then one more under torch.profiler on rank 0, its
operators by total CPU time. docs/benchmarks/links.md, "A 1B shape: a training step with the
fused weight gradients".

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/profile_train_job.py --shape 1b
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def rank(world, path: str, steps: int, rows: int) -> tuple[list, str]:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from shardwise.train import setup, train_step
    from shardwise.train.config import TrainConfig

    torch.set_num_threads(1)
    tr = setup(world, TrainConfig.from_toml(path))

    def timed() -> tuple[float, float]:
        t, c = time.perf_counter(), time.thread_time()
        train_step(tr)
        return round(time.perf_counter() - t, 2), round(time.thread_time() - c, 2)

    times = [timed() for _ in range(steps)]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        times.append(timed())
    table = prof.key_averages().table(sort_by="cpu_time_total", row_limit=rows) if world.rank == 0 else ""
    return times, table


def main() -> None:
    import bench_links

    from shardwise.launch import launch

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(bench_links.TRAIN_SHAPES), default="1b")
    ap.add_argument("--steps", type=int, default=3, help="timed steps before the profiled one (the first allocates)")
    ap.add_argument("--rows", type=int, default=25, help="operators shown")
    ap.add_argument("--dir", type=Path, default=Path("/tmp/shardwise-profile-train"))
    a = ap.parse_args()
    bench_links.TRAIN_SHAPE = a.shape
    a.dir.mkdir(parents=True, exist_ok=True)
    config = bench_links._train_config(a.dir, [], a.steps + 1)
    print(
        time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "load", *(f"{x:.2f}" for x in __import__("os").getloadavg())
    )
    res = launch(rank, 2, args=(str(config), a.steps, a.rows), backend="gloo", timeout_s=600)
    for r, (times, _) in enumerate(res):
        print(f"rank {r}: (wall s, thread s) a step, the last profiled: {times}")
    print(res[0][1])


if __name__ == "__main__":
    main()
