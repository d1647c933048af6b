"""Two or more builds of the native kernels (shardwise.kernels._native) in ONE process, their
calls interleaved: a kernel change measured against the code before it on a machine whose
speed drifts between (and within) processes. A VM here runs a whole process fast or slow
(the same kernel 58 or 90 us); alternating launches cannot separate a 5% change from that,
interleaving calls in one process can.

    # the .so of each build, copied aside (each in a folder of its own: the file name stays _native...so)
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_kernel_ab.py --format Q4_K --rows 1,4,16 \\
        /tmp/before/_native.so /tmp/after/_native.so

For each build, each n (activation rows) and each weight shape: "hot", the best of --repeats
rounds of 3 calls on one 1024 x 2048 weight that stays in cache; "cold", the best of 4 rounds
of one call on each copy of the weight in a pool of --cold-mib (from DRAM, as in a model's
decode step), at 8192 x 2048 and 2048 x 8192 (the MLP's shapes of a 1B model). Random blocks
(timing only: the results are not checked here; tests/unit/test_native_*.py do).
"""

from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import time
from pathlib import Path

import numpy as np
import torch

from shardwise.kernels import _native as native

FORMATS = {"Q8_0": (8, 34, 32), "Q4_K": (12, 144, 256), "Q5_K": (13, 176, 256), "Q6_K": (14, 210, 256)}


def load(path: str):
    """A build of the extension as a module of its own (dlopen'ed from its own path)."""
    loader = importlib.machinery.ExtensionFileLoader("_native", path)
    spec = importlib.util.spec_from_file_location("_native", path, loader=loader)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod


def weight(fmt: str, rows: int, k: int, rng: np.random.Generator) -> np.ndarray:
    t, nbytes, block = FORMATS[fmt]
    w = rng.integers(0, 256, (rows, k // block, nbytes), dtype=np.uint8)
    w[:, :, 0:2] = rng.uniform(1e-3, 1e-1, (rows, k // block, 1)).astype(np.float16).view(np.uint8)
    return w.reshape(rows, -1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("builds", nargs="+", help="paths of _native .so files")
    ap.add_argument("--format", default="Q4_K", choices=FORMATS)
    ap.add_argument("--rows", default="1,4,8,16", help="activation rows, comma-separated")
    ap.add_argument("--repeats", type=int, default=40)
    ap.add_argument("--cold-mib", type=int, default=512)
    ap.add_argument("--isa", default="avx512")
    args = ap.parse_args()
    mods, ns = [load(p) for p in args.builds], [int(v) for v in args.rows.split(",")]
    names = [Path(p).parent.name for p in args.builds]
    isa = native.ISA_NAMES.index(args.isa)
    t, _, block = FORMATS[args.format]
    rng = np.random.default_rng(0)
    for label, rows, k in (("hot", 1024, 2048), ("cold", 8192, 2048), ("cold", 2048, 8192)):
        kb = k // block
        w = weight(args.format, rows, k, rng)
        copies = max(2, -(-args.cold_mib * 2**20 // w.nbytes)) if label == "cold" else 1
        pool = np.tile(w, (copies, 1)) if copies > 1 else w
        x = torch.randn(max(ns), k)
        xqs = []  # each build's own activation blocks (their layout may differ between builds)
        for mod in mods:
            xq = torch.empty(max(ns) * kb * (mod.A32_BYTES if block == 32 else mod.A256_BYTES), dtype=torch.uint8)
            mod.quantize(block, isa, x.data_ptr(), k, max(ns), k, xq.data_ptr())
            xqs.append(xq)
        y = torch.empty(max(ns), rows)
        calls = 3 if label == "hot" else 1
        best = {(m, n): float("inf") for m in range(len(mods)) for n in ns}
        for _ in range(args.repeats if label == "hot" else 4):
            for n in ns:
                for mi, mod in enumerate(mods):
                    t0 = time.thread_time_ns()
                    for c in range(copies):
                        for _ in range(calls):
                            mod.gemm(t, isa, pool.ctypes.data + c * w.nbytes, w.shape[1], rows, kb, xqs[mi].data_ptr(), n,
                                     y.data_ptr(), rows)  # fmt: skip
                    best[mi, n] = min(best[mi, n], (time.thread_time_ns() - t0) / 1e3 / (copies * calls))
        for mi, name in enumerate(names):
            cells = " ".join(f"n={n} {best[mi, n]:.0f} us ({n * rows * k / best[mi, n] / 1e3:.0f} GMAC/s)" for n in ns)
            print(f"{label} {rows}x{k} {args.format} {name}: {cells}", flush=True)


if __name__ == "__main__":
    main()
