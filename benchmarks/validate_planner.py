"""The planner's predictions against measurements on this machine: the table in docs/planner.md.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/validate_planner.py [--repeats 3] [--cached] [--no-write]

1. Calibrates this host (unless --cached: then the cached calibration is used).
2. For the benchmark model (benchmarks/bench_model.py) at tp=1 and at tp=2 on every
   calibrated backend (gloo; mpi when it is available), predicts prefill and decode
   latency with the planner's this-host cluster, and measures them with the engine:
   batch 1, a 128-token prompt, 32 new tokens; one warm-up generation, then `repeats`
   timed ones (median prefill, median decode step).
3. Prints the table and writes it into docs/planner.md between the validation markers.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from bench_model import ensure_bench_model  # noqa: E402

from shardwise.hf import read_config  # noqa: E402
from shardwise.launch import launch  # noqa: E402
from shardwise.planner.calibrate import load_calibration  # noqa: E402
from shardwise.planner.measure import generation_rank  # noqa: E402
from shardwise.planner.predict import Layout, predict_inference  # noqa: E402

DOC = Path(__file__).parent.parent / "docs" / "planner.md"
START, END = "<!-- validation:start -->", "<!-- validation:end -->"
WORKLOAD = dict(batch=1, prompt_len=128, output_len=32)
TARGET = 0.25


def _err(pred: float, meas: float) -> str:
    e = pred / meas - 1
    return f"{e:+.0%}" + ("" if abs(e) <= TARGET else " **miss**")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cached", action="store_true", help="use the cached calibration instead of measuring again")
    ap.add_argument("--no-write", action="store_true", help="print the table only")
    args = ap.parse_args()

    model = ensure_bench_model()
    _, cfg = read_config(model)
    cal = load_calibration(recalibrate=not args.cached)
    runs = [(1, "gloo")] + [(2, b) for b in ("gloo", "mpi") if b in cal.links]
    missing = [f"{b}: {why}" for b, why in cal.unavailable.items()]
    opts = dict(model=str(model), repeats=args.repeats, **WORKLOAD)
    rows, misses = [], 0
    t0 = time.time()
    for tp, backend in runs:
        cluster = cal.cluster(backend)
        p = predict_inference(cfg, cluster, Layout(tp, 1, 1), width=4, dtype="float32", **WORKLOAD)
        print(f"measuring tp={tp} {backend} ...", file=sys.stderr)
        m = launch(generation_rank, tp, args=(opts,), backend=backend)[0]
        pre, dec = p.prefill.total_s * 1e3, p.decode.total_s * 1e3
        for pred, meas in ((pre, m["prefill_ms"]), (dec, m["decode_ms"])):
            misses += abs(pred / meas - 1) > TARGET
        comm = f"{p.decode.comm_s * 1e3:.1f}" if tp > 1 else "-"
        rows.append(
            f"| {tp} | {backend if tp > 1 else '-'} | {pre:.1f} | {m['prefill_ms']:.1f} | {_err(pre, m['prefill_ms'])} "
            f"| {m['cold_prefill_ms']:.1f} | {dec:.2f} | {m['decode_ms']:.2f} | {_err(dec, m['decode_ms'])} | {comm} |"
        )
    c = cal
    lines = [
        f"Measured {time.strftime('%Y-%m-%d')} in {time.time() - t0:.0f} s (`benchmarks/validate_planner.py`, "
        f"repeats={args.repeats}): benchmark model, fp32, batch {WORKLOAD['batch']}, prompt {WORKLOAD['prompt_len']} "
        f"tokens, {WORKLOAD['output_len']} new tokens; 1 thread per rank.",
        "",
        f"Calibration ({c.created}, {c.devices} cores busy): matmul "
        + ", ".join(f"{k} {v * 1e3:.0f} GFLOP/s" for k, v in c.gemm_tflops.items())
        + f"; weight streaming {c.mem_gbps:.1f} GB/s; overhead {c.layer_overhead_us:.0f} us/layer + "
        f"{c.step_overhead_us:.0f} us/forward; all-reduce "
        + "; ".join(f"{b}: {v['latency_us']:.0f} us + n / {v['busbw_gbps']:.2f} GB/s" for b, v in c.links.items())
        + (f"; not measured: {'; '.join(missing)}" if missing else "")
        + ".",
        "",
        "| tp | backend | prefill ms predicted | prefill ms measured | error | cold prefill ms | "
        "decode ms/token predicted | decode measured | error | predicted comm ms/token |",
        "|---|---|---|---|---|---|---|---|---|---|",
        *rows,
        "",
        f"{'PASS' if not misses else 'MISS'}: {len(rows) * 2 - misses} of {len(rows) * 2} predictions within "
        f"±{TARGET:.0%} (error = predicted / measured - 1; cold prefill = the first prefill after loading, not predicted).",
    ]
    table = "\n".join(lines)
    print(table)
    if not args.no_write:
        text = DOC.read_text()
        if START not in text or END not in text:
            raise SystemExit(f"{DOC} has no {START} ... {END} section")
        pattern = re.compile(re.escape(START) + ".*?" + re.escape(END), re.S)
        DOC.write_text(pattern.sub(lambda _: f"{START}\n{table}\n{END}", text))
        print(f"wrote {DOC}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
