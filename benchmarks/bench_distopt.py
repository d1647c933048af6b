"""Training state per rank with and without the distributed optimizer, at dp = 1, 2, 4, fp32
and bf16 weights, and the step time and dp traffic of each.

For every (dtype, dp, distributed) the ranks are launched (gloo, one thread each), set up a
Llama-shaped model (hidden 256, 4 layers, vocab 8192: 7.1M parameters, every rank a whole
copy: tp = pp = 1), take one step, then the next step's backward; at that point each rank
counts the bytes of the tensors it holds (shardwise.train.distopt.held_bytes: weights,
whole gradients, the optimizer's state) and compares them with the formula
(bytes_per_param). Then `--steps` more steps are timed (median over the steps and the
ranks; `--rounds 2` runs plain, distributed, distributed, plain and prints both medians),
with the bytes the dp collectives moved per step from the communicator's accounting
(small scalar all-reduces left out), and the peak RSS of the rank over the whole run
(ru_maxrss, minus the RSS before setup; every configuration in its own processes).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_distopt.py [--steps 6] [--dp 1,2,4] [--dtypes fp32,bf16]
        [--bucket-mb 25]

The plain optimizer runs the Communicator's bucketed all-reduce (the path MPI uses), so both
columns move their gradients through the same code. bf16 matmuls are very slow on this
AVX2 CPU (no native bf16): time bf16 with --steps 1, for its memory columns.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
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


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def rank(world, cfg, steps: int) -> dict:
    from shardwise.train import setup, train_step
    from shardwise.train.distopt import bytes_per_param, held_bytes
    from shardwise.train.step import _micro_steps

    rss0 = _rss_kib()
    tr = setup(world, cfg)
    train_step(tr)
    _micro_steps(tr, tr.sampler.micro_batches(tr.step))
    held = held_bytes(tr.model, tr.optimizer)
    tr.optimizer.zero_grad(set_to_none=True)
    n = sum(p.numel() for p in tr.model.parameters())
    times = []
    world.stats.reset()
    for _ in range(steps):
        t = time.perf_counter()
        train_step(tr)
        times.append(time.perf_counter() - t)
    dp_bytes = {op: world.stats.bytes(op, "dp") / steps for op in ("all_reduce", "reduce_scatter", "all_gather")}
    return {
        "held": held,
        "params": n,
        "formula": bytes_per_param(cfg.run.dtype, cfg.optim.distributed, tr.mesh.dp.size),
        "ms": 1e3 * statistics.median(times),
        "dp_bytes": dp_bytes,
        "peak_rss_mib": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) / 1024,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--dp", default="1,2,4")
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--rounds", type=int, default=2, help="runs of each optimizer (2: plain, dist, dist, plain)")
    ap.add_argument("--bucket-mb", type=float, default=25.0, help="parallel.bucket_mb (both optimizers)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from shardwise.launch import launch
    from shardwise.train import TrainConfig
    from train_helpers import write_tiny_tokens

    tmp = Path(tempfile.mkdtemp(prefix="bench-distopt-"))
    tokens = write_tiny_tokens(tmp / "tokens.safetensors", chars=200_000)
    rows = []
    print(
        "| dtype | dp | optimizer | weights | grads | optimizer state | total B/param (formula) | peak RSS MiB "
        "| ms/step | dp bytes/step |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for dtype in args.dtypes.split(","):
        for dp in map(int, args.dp.split(",")):
            runs: dict[bool, list] = {False: [], True: []}
            order = [False, True, True, False][: 2 * args.rounds] if args.rounds > 1 else [False, True]
            for distributed in order:  # ABBA: a drift in the machine's load hits both alike
                cfg = TrainConfig.from_dict(
                    {
                        "model": MODEL,
                        "data": {
                            "tokens": str(tokens),
                            "seq_len": 64,
                            "global_batch_size": 8,
                            "micro_batch_size": 8 // dp,
                        },
                        "optim": {"distributed": distributed},
                        "parallel": {"dp": dp, "dp_sync": "bucketed", "bucket_mb": args.bucket_mb},
                        "run": {"steps": 100, "dtype": dtype, "progress": False, "plot": False, "out_dir": str(tmp)},
                    }
                )
                runs[distributed].append(launch(rank, dp, args=(cfg, args.steps)))  # own processes: own peak RSS
            for distributed in (False, True):
                res = runs[distributed][0]
                r = res[0]
                n, h = r["params"], r["held"]
                per = {k: v / n for k, v in h.items()}
                total = sum(per.values())
                moved = sum(r["dp_bytes"].values())
                ops = " + ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in r["dp_bytes"].items() if v >= 2**16)
                ms = [statistics.median(x["ms"] for x in job) for job in runs[distributed]]
                row = {"dtype": dtype, "dp": dp, "distributed": distributed, "per_param": per, "total": total,
                       "formula": r["formula"]["total"], "peak_rss_mib": max(x["peak_rss_mib"] for x in res),
                       "ms": ms, "dp_bytes": r["dp_bytes"]}  # fmt: skip
                rows.append(row)
                print(
                    f"| {dtype} | {dp} | {'distributed' if distributed else 'plain'} | {per['weights']:.2f} | "
                    f"{per['grads']:.2f} | {per['optimizer']:.2f} | {total:.2f} ({r['formula']['total']:.4g}) | "
                    f"{row['peak_rss_mib']:.0f} | {', '.join(f'{m:.0f}' for m in ms)} | {ops or '-'} "
                    f"({moved / 2**20:.1f} MiB) |",
                    flush=True,
                )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
