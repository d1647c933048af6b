"""`shardwise bench comm`: all-reduce latency and bandwidth per backend, 4 KiB to 16 MiB.

The planner calibrates this host from these figures (shardwise plan --cluster this-host).
"""

from __future__ import annotations

import argparse
import json

from shardwise.bench.comm import DEFAULT_SIZES, available_backends, measure_all_reduce

__all__ = ["add_parser", "run"]


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="measure communication (bench comm)")
    what = p.add_subparsers(dest="what", required=True, metavar="WHAT")
    c = what.add_parser("comm", help="all-reduce latency and bandwidth for each available backend")
    c.add_argument("--ranks", type=int, default=2, help="local ranks (default 2)")
    c.add_argument("--backend", action="append", help="backend(s) to measure (default: every available one)")
    c.add_argument("--sizes", help="comma-separated sizes in bytes (default 4 KiB .. 16 MiB)")
    c.add_argument("--repeats", type=int, default=200, help="timed repeats for small sizes (fewer for large)")
    c.add_argument("--json", action="store_true", help="print one JSON object on stdout")


def run(args: argparse.Namespace) -> int:
    backends = args.backend or available_backends()
    sizes = [int(s) for s in args.sizes.split(",")] if args.sizes else DEFAULT_SIZES
    points = [p for b in backends for p in measure_all_reduce(b, args.ranks, sizes, args.repeats)]
    if args.json:
        print(json.dumps({"ranks": args.ranks, "points": [p.as_dict() for p in points]}))
        return 0
    print(f"all-reduce of fp32 tensors over {args.ranks} local ranks (median of timed repeats)\n")
    print(f"{'backend':<8} {'size':>10} {'latency us':>12} {'bus GB/s':>10}")
    for p in points:
        size = f"{p.size_bytes >> 10} KiB" if p.size_bytes < 1 << 20 else f"{p.size_bytes >> 20} MiB"
        print(f"{p.backend:<8} {size:>10} {p.latency_us:>12.1f} {p.busbw_gbps:>10.3f}")
    return 0
