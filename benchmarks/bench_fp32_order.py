"""fp32 weight order for the native decode step: row-major (as loaded) against column-major (the
order quant.layout.decode_layout gives layers PyTorch runs), one row, one thread.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_fp32_order.py [--out FILE.json]

1. The fp32 linear kernels on their own, GB/s of weight (fastest of 20-100 calls, the weight hot
   in the cache for the small ones): the native kernel (csrc/f32.c, this CPU's best ISA)
   row-major and column-major, and PyTorch's F.linear (MKL) on the same two orders.
2. `generate` of the built-in model (60 new tokens, greedy) in one process per tp, the two
   orders taking turns --rounds times: column-major as decode_layout made it before the native
   step kept rows (decode_layout under kernels.step.off()), row-major as loaded; the median
   decode step of each turn, ms. Two launches per tp.
docs/benchmarks/links.md cites its output.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

SHAPES = ((512, 256), (256, 512), (1536, 576), (576, 1536), (4096, 1024), (8192, 2048), (2048, 8192))
"""(out, in): the built-in model's, a 576-wide model's, and 1B-sized ones (from memory)."""


def _rates(out_: int, in_: int) -> dict[str, float]:
    """GB/s of one row through an (out_, in_) fp32 weight, each kernel and order."""
    import torch.nn.functional as F

    from shardwise.bench.timing import best_time
    from shardwise.kernels import native

    lib, isa = native.lib, native.isa()
    w = torch.randn(out_, in_)
    wt = w.t().contiguous()  # (in, out): column-major W
    x, y, y2 = torch.randn(1, in_), torch.empty(1, out_), torch.empty(1, out_)
    reps = 100 if out_ * in_ < 4e6 else 20

    def row():
        lib.f32_gemm(isa, w.data_ptr(), in_, out_, in_, x.data_ptr(), in_, 1, y.data_ptr(), out_)

    def col():
        lib.f32_gemm(isa, wt.data_ptr(), out_, out_, in_, x.data_ptr(), in_, 1, y2.data_ptr(), out_, 1)

    row(), col()
    torch.testing.assert_close(y, y2, rtol=1e-4, atol=1e-3)  # the same product in both orders
    times = {
        "native row-major": best_time(row, reps),
        "native column-major": best_time(col, reps),
        "MKL row-major": best_time(lambda: F.linear(x, w), reps),
        "MKL column-major": best_time(lambda: F.linear(x, wt.t()), reps),
    }
    return {k: out_ * in_ * 4 / 1e9 / t for k, t in times.items()}


def kernels() -> list[dict]:
    return [{"shape": [o, i], **_rates(o, i)} for o, i in SHAPES]


def _generate_rank(world, rounds: int) -> dict[str, list[float]]:
    from shardwise.comm import tp_only
    from shardwise.engine.generate import generate
    from shardwise.engine.text import DEFAULT_MODEL
    from shardwise.hf import load_pretrained
    from shardwise.kernels import step
    from shardwise.quant.layout import decode_layout

    torch.set_num_threads(1)
    tp = tp_only(world)
    model, _ = load_pretrained(DEFAULT_MODEL, comm=tp)
    out: dict[str, list[float]] = {"column-major": [], "row-major": []}
    for _ in range(rounds):
        for order in out:
            if order == "column-major":
                with step.off():  # decode_layout's order for layers PyTorch runs
                    decode_layout(model, rows=1)
            else:
                decode_layout(model, rows=64)  # back to the loaded order
            res = generate(model, [[1, 2, 3, 4, 5]], comm=tp, max_new_tokens=60)
            out[order].append(statistics.median(res.decode_ms))
    return out


def main() -> None:
    from bench_native import _machine

    from shardwise.launch import launch

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--launches", type=int, default=2)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    torch.set_num_threads(1)
    m = _machine()
    date = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print(f"{date}; CPU: {m['model']}, {m['cores']} cores; flags {' '.join(m['flags'])}; torch {m['torch']}")
    table = kernels()
    names = [k for k in table[0] if k != "shape"]
    print("\none row, GB/s of weight\n| weight (out x in) | " + " | ".join(names) + " |")
    print("|---|" + "---:|" * len(names))
    for r in table:
        print(f"| {r['shape'][0]} x {r['shape'][1]} | " + " | ".join(f"{r[k]:.1f}" for k in names) + " |")
    steps = {}
    for tp in (1, 2):
        for i in range(a.launches):
            res = launch(_generate_rank, tp, args=(a.rounds,), backend="gloo")[0]
            steps[f"tp={tp} launch {i + 1}"] = res
            print(f"generate tp={tp} launch {i + 1}, median decode step ms: "
                  + "; ".join(f"{k} {' '.join(f'{x:.2f}' for x in v)}" for k, v in res.items()))  # fmt: skip
    if a.out:
        a.out.write_text(json.dumps({"date": date, "machine": m, "kernels": table, "generate": steps}, indent=1) + "\n")


if __name__ == "__main__":
    main()
