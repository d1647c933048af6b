"""Streaming GB/s of block-format linears, one process alone and two at once (one per core),
to compare builds of the native kernels side by side (docs/benchmarks/native-kernels.md,
"2026-12-06"): 12 matrices of 8192 x 2048 (beyond the L3) one after another, n activation
rows, each format for 1.5 s starting at a shared wall-clock time so that two processes run
together. "sum" is a torch sum of the same bytes (the machine's own bandwidth then).

    # a build of the extension outside the tree, then alone and two at once, pinned:
    CFLAGS="..." .venv/bin/python setup.py build_ext --build-lib /tmp/v/A --build-temp /tmp/t/A --force -q
    S=$(python3 -c "import time; print(time.time() + 12)")
    SWSO=/tmp/v/A/shardwise/kernels/_native*.so OMP_NUM_THREADS=1 taskset -c 0 \\
        .venv/bin/python benchmarks/bench_stream_concurrent.py sum,Q8_0,Q4_K,Q6_K $S 1 &
    SWSO=... OMP_NUM_THREADS=1 taskset -c 1 .venv/bin/python benchmarks/bench_stream_concurrent.py sum,Q8_0,Q4_K,Q6_K $S 1

SWSO: load that build of shardwise.kernels._native instead of the installed one; SWISA: force
an ISA level (portable, avx2, avx512). Prints "FORMAT GB/s | ..." on one line.
"""

import os
import sys
import time

import torch

if os.environ.get("SWSO"):
    import importlib.util

    spec = importlib.util.spec_from_file_location("shardwise.kernels._native", os.environ["SWSO"])
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    sys.modules["shardwise.kernels._native"] = mod

from shardwise.kernels import BlockWeight, native, quantize_rows  # noqa: E402

if os.environ.get("SWISA"):
    native._current = native.ISAS.index(os.environ["SWISA"])


class _Sum:
    def __init__(self, buf: torch.Tensor) -> None:
        self.buf = buf

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        return self.buf.sum()


def main() -> None:
    fmts, start = sys.argv[1].split(","), float(sys.argv[2])
    n = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    torch.manual_seed(0)
    res = []
    for i, fmt in enumerate(fmts):
        if fmt == "sum":
            parts = [_Sum(torch.ones(8192 * 2048 // 8, dtype=torch.int64)) for _ in range(12)]
            nbytes = 12 * 8192 * 2048
        else:
            q = quantize_rows(torch.randn(8192, 2048) * 0.02, fmt)
            parts = [BlockWeight.of([(fmt, q.clone())], 2048) for _ in range(12)]
            nbytes = sum(p.nbytes for p in parts)
        x = torch.randn(n, 2048)
        for p in parts:
            p.linear(x)
        while time.time() < start + 2.0 * i:
            pass
        k, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < 1.5:
            for p in parts:
                p.linear(x)
            k += 1
        res.append(f"{fmt} {nbytes * k / (time.perf_counter() - t0) / 1e9:.1f}")
    print(" | ".join(res), flush=True)


if __name__ == "__main__":
    main()
