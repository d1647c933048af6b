"""One row through block-format weights too large for the last-level cache: the bandwidth a
decode step's matmuls stream at (bench_block_linear.py's one matrix fits in L3 here).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_stream_linear.py Q8_0,Q4_1,Q4_K

Eight 2048 x 4096 matrices (about 142 MB in Q8_0) one after another, one activation row, best
of 7 passes; prints ms per pass and GB/s of weight bytes.
"""

import sys
import time

import torch

from shardwise.kernels import BlockWeight, quantize_rows

torch.manual_seed(0)
for fmt in sys.argv[1].split(","):
    w = torch.randn(16384, 4096) * 0.02
    parts = [
        BlockWeight.of([(fmt, quantize_rows(w[i * 2048 : (i + 1) * 2048], fmt))], 4096) for i in range(8)
    ]  # 8 x 2048 rows: ~8x17 MB, beyond L3
    x = torch.randn(1, 4096)
    for p in parts:
        p.linear(x)
    best = 1e9
    for _ in range(7):
        t0 = time.perf_counter()
        for p in parts:
            p.linear(x)
        best = min(best, time.perf_counter() - t0)
    nbytes = sum(p.nbytes for p in parts)
    print(fmt, f"{best * 1e3:.2f} ms", f"{nbytes / best / 1e9:.1f} GB/s")
