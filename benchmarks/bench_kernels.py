"""Which kernel runs a decode-sized linear fastest on this CPU: fp32, bf16, fp16 and int8
weights, side by side in one run, against the weight-streaming ceiling measured in the same run.

    OMP_NUM_THREADS=1 python benchmarks/bench_kernels.py --json docs/benchmarks/bench_kernels.json

For each weight shape (out x in) and each number of rows (1 = one sequence decoding; 4, 16,
64 = batched decode and serving), every kernel is timed (median of --repeats calls after a
warm-up) on the same activations. Each is reported with its relative error against an fp64
product and the fraction of the ceiling it reaches: the weight's bytes in that format over
the copy bandwidth of one core, measured first. The groundwork for `--quantize` (issue
"Decode at the hardware's limit"): the kernel matters more than the format, and must be measured.

Kernels (all stock PyTorch):
- fp32:       F.linear (MKL here)
- fp32-t:     x @ W^T with W^T stored contiguous (in x out): another GEMM layout for small rows
- bf16:       F.linear on bf16 weights and activations
- fp16-fbgemm: torch.ops.quantized.linear_dynamic_fp16 on a prepacked fp16 weight
- int8-fbgemm: torch.ops.quantized.linear_dynamic (per-output-channel int8 weights,
               activations quantized per call, reduce_range as fbgemm requires on AVX2)
- int8-wo:    torch._weight_int8pack_mm (weight-only int8, per-channel scales)
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F

SHAPES = {"7b-mlp-up": (11008, 4096), "smollm2-mlp-up": (1536, 576)}
ROWS = (1, 4, 16, 64)


def copy_bandwidth(nbytes: int = 512 * 2**20, repeats: int = 5) -> float:
    """Bytes per second one core streams (read + write of a copy counted as 2 x nbytes)."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return 2 * nbytes / best


def _int8_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: (q (out, in) int8, scale (out,) fp32)."""
    scale = w.abs().amax(dim=1).clamp(min=1e-8) / 127
    return torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8), scale


def kernels(w: torch.Tensor) -> dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], int]]:
    """name -> (fn(x fp32 (rows, in)) -> (rows, out) fp32, weight bytes it streams)."""
    out_f, in_f = w.shape
    bias = torch.zeros(out_f)
    wt = w.t().contiguous()  # (in, out)
    wb = w.to(torch.bfloat16)
    p16 = torch.ops.quantized.linear_prepack_fp16(w, bias)
    q, scale = _int8_channel(w)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # quantized tensor creation is deprecated, still the fbgemm input
        qw = torch.quantize_per_channel(w, scale.double(), torch.zeros(out_f, dtype=torch.long), 0, torch.qint8)
    p8 = torch.ops.quantized.linear_prepack(qw, bias)
    n = out_f * in_f
    return {
        "fp32": (lambda x: F.linear(x, w), 4 * n),
        "fp32-t": (lambda x: x @ wt, 4 * n),
        "bf16": (lambda x: F.linear(x.to(torch.bfloat16), wb).float(), 2 * n),
        "fp16-fbgemm": (lambda x: torch.ops.quantized.linear_dynamic_fp16(x, p16), 2 * n),
        "int8-fbgemm": (lambda x: torch.ops.quantized.linear_dynamic(x, p8, True), n + 4 * out_f),
        "int8-wo": (lambda x: torch._weight_int8pack_mm(x, q, scale), n + 4 * out_f),
    }


def time_ms(fn: Callable[[], torch.Tensor], repeats: int) -> float:
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--rows", default=",".join(map(str, ROWS)))
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"of {', '.join(SHAPES)}")
    ap.add_argument("--json", help="write every row here")
    args = ap.parse_args()
    torch.manual_seed(0)
    bw = copy_bandwidth()
    print(f"threads {torch.get_num_threads()}, copy bandwidth {bw / 1e9:.1f} GB/s (one core)")
    rows_out = []
    for shape in args.shapes.split(","):
        out_f, in_f = SHAPES[shape]
        w = torch.randn(out_f, in_f) / in_f**0.5
        ks = kernels(w)
        print(f"\n{shape}: {out_f} x {in_f}")
        print(f"{'rows':>4} {'kernel':<12} {'ms':>8} {'x fp32':>7} {'ceiling ms':>10} {'reached':>8} {'rel err':>8}")
        for rows in map(int, args.rows.split(",")):
            x = torch.randn(rows, in_f)
            ref = (x.double() @ w.double().t()).float()
            base = None
            for name, (fn, nbytes) in ks.items():
                ms = time_ms(lambda fn=fn, x=x: fn(x), args.repeats)
                err = ((fn(x) - ref).norm() / ref.norm()).item()
                base = base or ms
                ceil = nbytes / bw * 1e3
                rows_out.append(
                    dict(shape=shape, out=out_f, inp=in_f, rows=rows, kernel=name, ms=ms, ceiling_ms=ceil, rel_err=err)
                )
                print(f"{rows:>4} {name:<12} {ms:>8.2f} {base / ms:>6.2f}x {ceil:>10.2f} {ceil / ms:>7.0%} {err:>8.1e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"copy_bandwidth_bytes_per_s": bw, "threads": torch.get_num_threads(), "rows": rows_out}, f, indent=1
            )


if __name__ == "__main__":
    main()
