"""Small all-reduces between two namespace hosts (shardwise.bench.netns), back to back, each
after `burst` microseconds of busy compute: their median, 10th and 90th percentile and mean,
per link rate. What a decode step's or a small training step's collectives meet across the
link, next to the calibration's veth probes (medians). docs/benchmarks/links.md, "The built-in
model on the same Intel Xeon".

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/veth_tail.py --rates none,1gbit,100mbit --paths gloo,tcp

Each rank: torch.distributed on gloo (torchrun's rendezvous across the hosts), a 1 KiB fp32
tensor, 20 warm-up all-reduces, then 200 (60 from 1 ms bursts on) timed ones: gloo's own
all_reduce, or shardwise's over direct TCP connections (shardwise.comm.tcp).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

TORCHRUN = str(Path(sys.executable).parent / "torchrun")
BURSTS_US = (0, 100, 300, 1000, 3000)


def rank(path: str) -> None:
    import os

    import torch
    import torch.distributed as dist

    from shardwise.comm.tcp import across_hosts
    from shardwise.comm.torch_dist import init_torch_distributed

    world = init_torch_distributed(rank=int(os.environ["RANK"]), world_size=2, master_port=0, init_method="env://")
    # gloo: torch.distributed's own all_reduce; tcp: shardwise's communicator over direct TCP connections
    comm = across_hosts(world.split([[0, 1]], "tp"), parent=world, mode="on") if path == "tcp" else None
    all_reduce = dist.all_reduce if comm is None else comm.all_reduce_
    t = torch.ones(256)  # 1 KiB

    def spin(us: float) -> None:
        end = time.perf_counter() + us * 1e-6
        while time.perf_counter() < end:
            pass

    out = {}
    for burst in BURSTS_US:
        for _ in range(20):
            all_reduce(t)
        ts = []
        for _ in range(200 if burst < 1000 else 60):
            spin(burst)
            t0 = time.perf_counter()
            all_reduce(t)
            ts.append((time.perf_counter() - t0) * 1e6)
        ts.sort()
        n = len(ts)
        out[burst] = {"median": ts[n // 2], "p10": ts[n // 10], "p90": ts[9 * n // 10], "mean": statistics.mean(ts)}
    if dist.get_rank() == 0:
        print(json.dumps(out), flush=True)
    world.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rates", default="none,1gbit,100mbit", help="comma-separated; none: unshaped")
    ap.add_argument("--no-pin", dest="pin", action="store_false", help="hosts not pinned to cores of their own")
    ap.add_argument("--paths", default="gloo,tcp", help="gloo: torch.distributed's all_reduce; tcp: shardwise.comm.tcp")
    ap.add_argument("--rank", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.rank:
        rank(a.rank)
        return
    from shardwise.bench import netns

    print(time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "pinned" if a.pin else "unpinned", flush=True)
    for rate in a.rates.split(","):
        for path in a.paths.split(","):
            with netns.make_hosts(2, None if rate == "none" else rate, pin=a.pin) as cluster:
                procs = cluster.torchrun(TORCHRUN, 1, [__file__, "--rank", path], stdout=subprocess.PIPE,
                                         stderr=subprocess.PIPE, text=True)  # fmt: skip
                out, err = procs[0].communicate(timeout=600)
                procs[1].wait(timeout=60)
            if not out.strip():
                print(f"{rate} {path}: failed: {err[-1500:]}", flush=True)
                continue
            for burst, s in json.loads(out).items():
                print(f"{rate:8s} {path:4s} after {int(burst):5d} us of compute: all_reduce of 1 KiB median "
                      f"{s['median']:7.0f} us, p10 {s['p10']:6.0f}, p90 {s['p90']:6.0f}, mean {s['mean']:6.0f}",
                      flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
