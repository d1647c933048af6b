"""One BlockWeight linear per format, rows and path: the integer kernels against tiles of
dequantized rows through MKL, and fp32 F.linear, thread time, best of 5, one thread.
What PREFILL_ROWS (shardwise.kernels.block) was chosen from.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_block_linear.py [--isa portable] [--formats Q4_K,Q6_K]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

import shardwise.kernels.block as block
from shardwise.kernels import BlockWeight, native, quantize_rows


def bench(f, reps: int = 5) -> float:
    best = float("inf")
    for _ in range(reps):
        t = time.thread_time()
        f()
        best = min(best, time.thread_time() - t)
    return best * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--isa", default=None, help=f"the kernels' ISA variant (default: the highest of {native.ISAS})")
    ap.add_argument("--formats", default="Q8_0,Q4_K,Q5_K,Q6_K", help="comma-separated block formats")
    ap.add_argument("--rows", default="1,4,16,32,64", help="comma-separated activation row counts")
    ap.add_argument("--shapes", default="1536x576,2048x2048,8192x2048", help="comma-separated OUTxIN weights")
    args = ap.parse_args()
    rows = [int(n) for n in args.rows.split(",")]
    shapes = [tuple(int(d) for d in s.split("x")) for s in args.shapes.split(",")]
    if args.isa is not None:
        with native.use_isa(args.isa):
            run(args.formats.split(","), rows, shapes)
    else:
        run(args.formats.split(","), rows, shapes)


def run(formats: list[str], rows: list[int], shapes: list[tuple[int, int]]) -> None:
    torch.manual_seed(0)
    cpu = next(
        ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines() if "model name" in ln
    )
    print(
        f"{cpu}; {native.describe()}; load {Path('/proc/loadavg').read_text().split()[:3]}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
    )
    saved = block.PREFILL_ROWS
    for fmt in formats:
        for o, k in shapes:
            if k % (256 if fmt.endswith("K") else 32):
                continue
            w = BlockWeight.of([(fmt, quantize_rows(torch.randn(o, k), fmt))], k)
            wf = torch.randn(o, k)
            for n in rows:
                x = torch.randn(n, k)
                block.PREFILL_ROWS = None  # the integer kernels
                ti = bench(lambda w=w, x=x: w.linear(x))
                block.PREFILL_ROWS = 1  # tiles of dequantized rows through MKL
                td = bench(lambda w=w, x=x: w.linear(x))
                tf = bench(lambda wf=wf, x=x: torch.nn.functional.linear(x, wf))
                print(
                    f"{fmt} {o}x{k} n={n}: integer {ti:.3f} ms  dequantized+MKL {td:.3f} ms  fp32 {tf:.3f} ms",
                    flush=True,
                )
    block.PREFILL_ROWS = saved


if __name__ == "__main__":
    main()
