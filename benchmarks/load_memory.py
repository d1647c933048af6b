"""Peak anonymous memory per rank while loading the benchmark model, at tp=1 and tp=2.

Each rank measures RssAnon above its own baseline after imports, while it builds the
model on the meta device, shards it and reads its slices from the safetensors file.
Both tp sizes run in this one invocation; the result goes to stdout as a Markdown table.

    .venv/bin/python benchmarks/load_memory.py [--model DIR] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_model import DEFAULT_DIR, ensure_bench_model  # noqa: E402

from shardwise.comm import tp_only  # noqa: E402
from shardwise.launch import launch  # noqa: E402

MiB = 2**20


def _load_rank(world, path: str) -> dict:
    import gc

    from shardwise.hf import load_pretrained
    from shardwise.memory import PeakAnonMemory, import_meta_kernels

    tp = tp_only(world)
    import_meta_kernels()  # part of the baseline after imports
    gc.collect()
    t0 = time.perf_counter()
    with PeakAnonMemory() as mem:
        model, report = load_pretrained(path, comm=tp)
    return {
        "peak": mem.peak_above_baseline,
        "params": report.param_bytes,
        "read": report.bytes_read,
        "seconds": time.perf_counter() - t0,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=DEFAULT_DIR)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    path = ensure_bench_model(args.model)
    rows = {}
    for tp in (1, 2):
        runs = [launch(_load_rank, tp, args=(str(path),), timeout_s=600) for _ in range(args.repeats)]
        rows[tp] = {
            "peak": [statistics.median(r[rank]["peak"] for r in runs) for rank in range(tp)],
            "params": runs[0][0]["params"],
            "read": runs[0][0]["read"],
            "seconds": statistics.median(max(x["seconds"] for x in r) for r in runs),
        }
    base = max(rows[1]["peak"])
    print(
        "| tp | peak anonymous MiB per rank (median) | parameter MiB per rank | MiB read per rank | load s | peak / tp=1 |"
    )
    print("|---|---|---|---|---|---|")
    for tp, r in rows.items():
        peaks = ", ".join(f"{p / MiB:.0f}" for p in r["peak"])
        ratio = max(r["peak"]) / base
        print(
            f"| {tp} | {peaks} | {r['params'] / MiB:.0f} | {r['read'] / MiB:.0f} | {r['seconds']:.2f} | {ratio:.2f} |"
        )
    verdict = "PASS" if max(rows[2]["peak"]) < 0.6 * base else "FAIL"
    print(f"\n{verdict}: tp=2 peak is {max(rows[2]['peak']) / base:.2f}x the tp=1 peak (target < 0.6x)")


if __name__ == "__main__":
    main()
