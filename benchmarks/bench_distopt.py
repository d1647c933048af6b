"""The distributed optimizer against plain AdamW: step time and dp traffic at dp = 2 and 4,
and the training state per rank at dp = 1, 2, 4 in fp32 and bf16.

Speed (`--part speed`): one launched job per dp (gloo, or `--backend mpi`) (one thread per rank) sets up BOTH
trainers in the same processes (a Llama-shaped model, hidden 256, 4 layers, vocab 8192:
7.1M parameters, every rank a whole copy: tp = pp = 1; fp32) and runs them in interleaved
rounds (plain, distributed, distributed, plain, ... `--steps` steps each), so a change in
the machine's load hits both alike. Each step is timed by the rank's own CPU time
(time.thread_time: the work this rank did, not the time it waited for the others or for
another process's core) and by wall time; the figures are medians over steps and ranks.
The bytes each collective moved per step come from the communicator's accounting
(reduce-scatter + all-gather against the plain optimizer's all-reduce; scalar all-reduces
of the loss and norm left out), with the wall time spent inside the dp collectives.

Memory (`--part memory`): every (dtype, dp, optimizer) in its own processes: one step, then
the next step's backward; each rank counts the tensors it holds then and again after the dp
reduction (shardwise.train.distopt.held_bytes; the larger is the peak) against the formula
(bytes_per_param), and the peak RSS of the rank over the run (ru_maxrss above the RSS
before setup).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_distopt.py [--part speed|memory|both]
        [--steps 4] [--rounds 4] [--dp 2,4] [--backend gloo|mpi] [--bucket-mb 25]

bf16 matmuls are very slow on this AVX2 CPU (no native bf16): the speed part runs fp32.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

MODEL = {
    "vocab_size": 8192,
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_layers": 4,
    "num_heads": 8,
    "num_kv_heads": 4,
    "max_positions": 128,
}
DP_OPS = ("all_reduce", "reduce_scatter", "all_gather")


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def _config(tokens: Path, out: Path, *, dp: int, dtype: str, distributed: bool, bucket_mb: float):
    from shardwise.train import TrainConfig

    return TrainConfig.from_dict(
        {
            "model": MODEL,
            "data": {"tokens": str(tokens), "seq_len": 64, "global_batch_size": 8, "micro_batch_size": 8 // dp},
            "optim": {"distributed": distributed},
            "parallel": {"dp": dp, "dp_sync": "bucketed", "bucket_mb": bucket_mb},
            "run": {"steps": 1000, "dtype": dtype, "progress": False, "plot": False, "out_dir": str(out)},
        }
    )


def speed_rank(world, cfgs: dict, rounds: int, steps: int) -> dict:
    """Both trainers in this process, stepped in rounds: plain, distributed, distributed, plain, ..."""
    from shardwise.train import setup, train_step

    trainers = {name: setup(world, cfg) for name, cfg in cfgs.items()}
    for tr in trainers.values():  # warm-up: AdamW's state, the allocator, gloo's buffers
        train_step(tr)
    names = list(trainers)
    order = [n for r in range(rounds) for n in (names if r % 2 == 0 else names[::-1])]
    out = {n: {"thread_ms": [], "wall_ms": [], "dp_bytes": dict.fromkeys(DP_OPS, 0), "dp_coll_ms": 0.0} for n in names}
    for name in order:
        tr, res = trainers[name], out[name]
        before = world.stats.copy()
        for _ in range(steps):
            t, w = time.thread_time(), time.perf_counter()
            train_step(tr)
            res["thread_ms"].append(1e3 * (time.thread_time() - t))
            res["wall_ms"].append(1e3 * (time.perf_counter() - w))
        moved = world.stats - before
        for op in DP_OPS:
            res["dp_bytes"][op] += sum(
                c.bytes for (o, g), c in moved.counts.items() if o == op and g == "dp" and c.bytes > 64 * c.calls
            )
        res["dp_coll_ms"] += 1e3 * sum(c.seconds for (o, g), c in moved.counts.items() if g == "dp")
    for res in out.values():
        n = len(res["thread_ms"])
        res["dp_bytes"] = {k: v / n for k, v in res["dp_bytes"].items()}
        res["dp_coll_ms"] /= n
    return out


def memory_rank(world, cfg) -> dict:
    from cases.distopt import memory_case

    rss0 = _rss_kib()
    r = memory_case(world, cfg)
    r["peak_rss_mib"] = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) / 1024
    return r


def _median(results: list[dict], name: str, key: str) -> float:
    return statistics.median(x for r in results for x in r[name][key])


def speed(args, tokens: Path, tmp: Path) -> list[dict]:
    from shardwise.launch import launch

    rows = []
    print(f"speed: {args.backend}, {args.rounds} rounds of {args.steps} steps per optimizer, alternating")
    print("| dp | optimizer | thread ms/step (median) | wall ms/step | in dp collectives ms | dp bytes/step |")
    print("|---|---|---|---|---|---|")
    for dp in map(int, args.dp.split(",")):
        cfgs = {
            f"{'distributed' if d else 'plain'}": _config(tokens, tmp, dp=dp, dtype="fp32", distributed=d,
                                                          bucket_mb=args.bucket_mb)
            for d in (False, True)
        }  # fmt: skip
        results = launch(speed_rank, dp, args=(cfgs, args.rounds, args.steps), backend=args.backend)
        ratio = {}
        for name in cfgs:
            th, wall = _median(results, name, "thread_ms"), _median(results, name, "wall_ms")
            coll = statistics.median(r[name]["dp_coll_ms"] for r in results)
            moved = results[0][name]["dp_bytes"]
            ops = " + ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in moved.items() if v)
            ratio[name] = (th, wall)
            rows.append({"dp": dp, "optimizer": name, "thread_ms": th, "wall_ms": wall, "dp_coll_ms": coll,
                         "dp_bytes": moved})  # fmt: skip
            print(
                f"| {dp} | {name} | {th:.1f} | {wall:.1f} | {coll:.1f} | {ops} ({sum(moved.values()) / 2**20:.1f} MiB) |"
            )
        (pt, pw), (dt, dw) = ratio["plain"], ratio["distributed"]
        print(f"| {dp} | distributed / plain | {dt / pt:.3f} | {dw / pw:.3f} | | |", flush=True)
    return rows


def memory(args, tokens: Path, tmp: Path) -> list[dict]:
    from shardwise.comm import LocalCommunicator
    from shardwise.launch import launch

    rows = []
    print("| dtype | dp | optimizer | weights | grads | optimizer state | total B/param (formula) | peak RSS MiB |")
    print("|---|---|---|---|---|---|---|---|")
    for dtype in args.dtypes.split(","):
        for dp in (1, 2, 4):
            for distributed in (False, True):
                cfg = _config(tokens, tmp, dp=dp, dtype=dtype, distributed=distributed, bucket_mb=args.bucket_mb)
                res = launch(memory_rank, dp, args=(cfg,)) if dp > 1 else [memory_rank(LocalCommunicator(), cfg)]
                r = res[0]
                per = {k: v / r["params"] for k, v in r["held"].items()}
                total = sum(per.values())
                rss = max(x["peak_rss_mib"] for x in res)
                rows.append({"dtype": dtype, "dp": dp, "distributed": distributed, "per_param": per, "total": total,
                             "formula": r["formula"]["total"], "peak_rss_mib": rss})  # fmt: skip
                print(
                    f"| {dtype} | {dp} | {'distributed' if distributed else 'plain'} | {per['weights']:.2f} | "
                    f"{per['grads']:.2f} | {per['optimizer']:.2f} | {total:.2f} ({r['formula']['total']:.4g}) | "
                    f"{rss:.0f} |",
                    flush=True,
                )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=("speed", "memory", "both"), default="both")
    ap.add_argument("--steps", type=int, default=4, help="steps per round")
    ap.add_argument("--rounds", type=int, default=4, help="rounds of each optimizer, alternating")
    ap.add_argument("--dp", default="2,4", help="speed: the dp sizes")
    ap.add_argument("--dtypes", default="fp32,bf16", help="memory: the weights' dtypes")
    ap.add_argument("--bucket-mb", type=float, default=25.0, help="parallel.bucket_mb (both optimizers)")
    ap.add_argument("--backend", default="gloo", choices=("gloo", "mpi"), help="speed: the communicator")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from train_helpers import write_tiny_tokens

    tmp = Path(tempfile.mkdtemp(prefix="bench-distopt-"))
    tokens = write_tiny_tokens(tmp / "tokens.safetensors", chars=200_000)
    with open("/proc/loadavg") as f:
        print(f"load average before: {f.read().split()[0]}")
    out = {}
    if args.part in ("speed", "both"):
        out["speed"] = speed(args, tokens, tmp)
    if args.part in ("memory", "both"):
        out["memory"] = memory(args, tokens, tmp)
    with open("/proc/loadavg") as f:
        print(f"load average after: {f.read().split()[0]}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
