"""The native 32-weight block kernels (csrc/q32.c) per format x ISA, side by side in one run,
against an fp32 F.linear of the same shape and the weight-streaming ceiling.

    OMP_NUM_THREADS=1 python benchmarks/bench_native_q32.py [--json out.json] [--quick]

For each weight shape (rows x k) and n activation rows (1 = decode, 4 and 16 = batched decode),
each kernel is timed in thread time, best of --repeats calls on one weight (it stays in the
cache hierarchy: "hot"). At n = 1 every kernel is also timed "cold": one call on each of
enough copies of the weight to pass --cold-mib, the mean per call, so the bytes come from
DRAM as in a whole model's decode step. GB/s are the weight's bytes over that time. The
ceiling is a plain read of the same number of bytes (torch.sum over an fp32 tensor of that
size), hot and cold in the same way. The activation rows are quantized once, outside the
timing (their cost is listed on its own).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from shardwise.kernels import _native as native

SHAPES = ((2048, 2048), (8192, 2048), (2048, 8192), (1536, 576), (576, 1536))
FORMATS = {
    "Q8_0": (8, 34, False),
    "Q4_0": (2, 18, False),
    "Q4_1": (3, 20, True),
    "Q5_0": (6, 22, False),
    "Q5_1": (7, 24, True),
}
NS = (1, 4, 16)


def cpu() -> str:
    info = Path("/proc/cpuinfo").read_text().splitlines()
    model = next(
        (line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), platform.processor()
    )
    flags = next((line.split(":", 1)[1].split() for line in info if line.startswith("flags")), [])
    keep = [f for f in flags if f.startswith(("avx", "amx")) or f in ("fma", "f16c")]
    return f"{model}; flags: {' '.join(keep)}"


def best_time(fn: Callable[[], object], repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.thread_time()
        fn()
        best = min(best, time.thread_time() - t)
    return best


def mean_time(fns: list[Callable[[], object]]) -> float:
    fns[0]()
    t = time.thread_time()
    for fn in fns:
        fn()
    return (time.thread_time() - t) / len(fns)


def weights(fmt: str, rows: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Random blocks with sane fp16 scales (and mins): (rows, k / 32 * nbytes) uint8."""
    _, nbytes, has_min = FORMATS[fmt]
    nb = k // 32
    raw = rng.integers(0, 256, (rows, nb, nbytes), dtype=np.uint8)
    raw[:, :, 0:2] = rng.uniform(1e-3, 1e-1, (rows, nb, 1)).astype(np.float16).view(np.uint8)
    if has_min:
        raw[:, :, 2:4] = rng.uniform(-0.5, 0.5, (rows, nb, 1)).astype(np.float16).view(np.uint8)
    return raw.reshape(rows, nb * nbytes)


def bench_format(
    fmt: str,
    rows: int,
    k: int,
    x: torch.Tensor,
    xq: torch.Tensor,
    args: argparse.Namespace,
    rng: np.random.Generator,
    isas: list[str],
) -> list[dict]:
    """One format at one shape on every ISA; prints a table row each."""
    t, kb = FORMATS[fmt][0], k // 32
    w = weights(fmt, rows, k, rng)
    y = torch.empty(max(NS), rows)
    ones = torch.ones(w.nbytes // 4)
    ceil_hot = w.nbytes / best_time(ones.sum, args.repeats) / 1e9
    copies = 0 if args.quick else max(2, -(-args.cold_mib * 2**20 // w.nbytes))
    pool = np.tile(w, (copies, 1)) if copies else None
    ceil_cold = float("nan")
    if pool is not None:
        pool_ones = torch.ones(pool.nbytes // 4).view(copies, -1)
        ceil_cold = w.nbytes / mean_time([pool_ones[c].sum for c in range(copies)]) / 1e9
        del pool_ones
    out = []
    for isa_name in isas:
        isa = native.ISA_NAMES.index(isa_name)

        def call(n: int, ptr: int = w.ctypes.data, isa: int = isa) -> None:
            native.gemm(t, isa, ptr, w.shape[1], rows, kb, xq.data_ptr(), n, y.data_ptr(), rows)

        us = {n: best_time(lambda n=n: call(n), args.repeats) * 1e6 for n in NS}
        row = {
            "shape": [rows, k],
            "format": fmt,
            "isa": isa_name,
            "mb": w.nbytes / 1e6,
            "us": us,
            "ceiling_hot_gbs": ceil_hot,
        }
        cold = "|"
        if pool is not None:
            cold_us = mean_time([lambda p=pool.ctypes.data + c * w.nbytes: call(1, p) for c in range(copies)]) * 1e6
            row |= {"cold_us": cold_us, "ceiling_cold_gbs": ceil_cold}
            cold = f"{cold_us:.0f} | {w.nbytes / cold_us / 1e3:.1f}"
        print(
            f"| {fmt} | {isa_name} | {w.nbytes / 1e6:.2f} | {us[1]:.0f} | {w.nbytes / us[1] / 1e3:.1f} | {us[4]:.0f} | "
            f"{us[16]:.0f} | {us[16] / us[1]:.2f} | {cold} | {ceil_hot:.1f} / {ceil_cold:.1f} |",
            flush=True,
        )
        out.append(row)
    return out


def bench_shape(rows: int, k: int, args: argparse.Namespace, rng: np.random.Generator, isas: list[str]) -> list[dict]:
    kb = k // 32
    x = torch.randn(max(NS), k)
    xq = torch.empty(max(NS) * kb * native.A32_BYTES, dtype=torch.uint8)
    top = len(isas) - 1
    quant_us = {
        n: best_time(lambda n=n: native.quantize(32, top, x.data_ptr(), k, n, k, xq.data_ptr()), args.repeats) * 1e6
        for n in NS
    }
    wf = torch.randn(rows, k)
    fp32 = {n: best_time(lambda n=n: F.linear(x[:n], wf), args.repeats) * 1e6 for n in NS}
    print(
        f"\n## {rows} x {k}: fp32 F.linear {' / '.join(f'{fp32[n]:.0f}' for n in NS)} us at n = {NS}; "
        f"activation quantization ({isas[top]}) {' / '.join(f'{quant_us[n]:.1f}' for n in NS)} us"
    )
    print(
        "| format | ISA | MB | n=1 us | GB/s | n=4 us | n=16 us | n=16 / n=1 | cold n=1 us | cold GB/s | ceiling hot / cold GB/s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    out = []
    for fmt in FORMATS:
        for row in bench_format(fmt, rows, k, x, xq, args, rng, isas):
            out.append(row | {"fp32_us": fp32, "quant_us": quant_us})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--cold-mib", type=int, default=768, help="bytes of weight copies a cold pass reads")
    ap.add_argument("--quick", action="store_true", help="only the first two shapes, and no cold pass")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    isas = native.isas()
    load = os.getloadavg()
    gcc = subprocess.run(["gcc", "--version"], capture_output=True, text=True).stdout.splitlines()[0]
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; CPU {cpu()}; {os.cpu_count()} cores")
    print(f"# load {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; one thread; {gcc}; ISAs {isas}")
    results: list[dict] = []
    for rows, k in SHAPES[:2] if args.quick else SHAPES:
        results += bench_shape(rows, k, args, rng, isas)
    if args.json:
        args.json.write_text(json.dumps({"cpu": cpu(), "load": load, "results": results}, indent=1))


if __name__ == "__main__":
    main()
