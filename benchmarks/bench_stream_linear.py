"""Activation rows through block-format weights too large for the last-level cache: the
bandwidth a decode step's matmuls stream at (bench_block_linear.py's one matrix fits in L3
here), against plain streaming of the same bytes in the same process.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_stream_linear.py Q8_0,Q4_1,Q4_K [--rows 1,4,16]

Eight 2048 x 4096 matrices (71 MB in Q8_0) one after another, n activation rows, best of
7 passes in thread time (the time this thread ran: on a shared machine descheduling is left
out, the other processes' memory traffic is not); prints ms per pass and GB/s of weight
bytes for each n (at n rows the weights are read once for all of them, so GB/s may pass
the ceiling only if the kernel is not bound by its multiplies). The ceiling: a torch int64 buffer of the largest format's
bytes summed, best of 7 in thread time (bench_native.py's ceiling, one process).
"""

import argparse
import time

import torch

from shardwise.kernels import BlockWeight, native, quantize_rows


def best(f, reps: int = 7) -> float:
    t = float("inf")
    for _ in range(reps):
        t0 = time.thread_time()
        f()
        t = min(t, time.thread_time() - t0)
    return t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("formats", help="comma-separated block formats, e.g. Q8_0,Q4_K")
    ap.add_argument("--rows", default="1", help="comma-separated activation row counts (default 1)")
    args = ap.parse_args()
    print(native.describe(), flush=True)
    torch.manual_seed(0)
    most = 0
    for fmt in args.formats.split(","):
        w = torch.randn(16384, 4096) * 0.02
        parts = [
            BlockWeight.of([(fmt, quantize_rows(w[i * 2048 : (i + 1) * 2048], fmt))], 4096) for i in range(8)
        ]  # 8 x 2048 rows: ~8x17 MB, beyond L3
        nbytes = sum(p.nbytes for p in parts)
        most = max(most, nbytes)
        for n in (int(r) for r in args.rows.split(",")):
            x = torch.randn(n, 4096)
            for p in parts:
                p.linear(x)
            t = best(lambda x=x, parts=parts: [p.linear(x) for p in parts])
            print(fmt, f"n={n}", f"{t * 1e3:.2f} ms", f"{nbytes / t / 1e9:.1f} GB/s", flush=True)
    buf = torch.ones(most // 8, dtype=torch.int64)
    t = best(buf.sum)
    print(f"ceiling: {most / 1e6:.0f} MB summed in {t * 1e3:.2f} ms, {most / t / 1e9:.1f} GB/s")


if __name__ == "__main__":
    main()
