"""Greedy sampling's argmax: shardwise.kernels.ops.argmax (native, csrc/norm.c) against
torch.argmax on one thread, for decode batches of logits over a 128256-token vocabulary.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_argmax.py

ms a call, the best of 5 rounds of 20 calls; the two alternate each round.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from shardwise.kernels import native, ops


def main() -> None:
    torch.set_num_threads(1)
    model = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                  if ln.startswith("model name")), "?")  # fmt: skip
    print(f"# {model}; {native.describe()}; torch {torch.__version__}")
    for rows in (1, 4, 16):
        x = torch.randn(rows, 128256)
        assert torch.equal(ops.argmax(x), x.argmax(-1))
        best = {"native": float("inf"), "torch": float("inf")}
        for _ in range(5):
            for name, f in (("native", lambda x=x: ops.argmax(x)), ("torch", lambda x=x: x.argmax(-1))):
                t0 = time.perf_counter()
                for _ in range(20):
                    f()
                best[name] = min(best[name], (time.perf_counter() - t0) / 20 * 1e3)
        print(f"({rows}, 128256): native {best['native']:.2f} ms, torch.argmax {best['torch']:.2f} ms")


if __name__ == "__main__":
    main()
