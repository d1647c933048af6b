"""The planner's predictions against measurements on this machine: the table in docs/planner.md.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/validate_planner.py [--rounds 3] [--cached] [--no-write]

1. Calibrates this host (unless --cached: then the cached calibration is used).
2. For the benchmark model (benchmarks/bench_model.py) at tp=1 and at tp=2 on every
   calibrated backend (gloo; mpi when it is available), predicts prefill and decode
   latency with the planner's this-host cluster, and measures them with the engine:
   batch 1, a 128-token prompt, 32 new tokens. Each configuration is launched `rounds`
   times, interleaved; each launch does one warm-up generation, then `repeats` timed ones.
   The planner predicts a machine nobody else uses, while this one is shared (2 cores,
   and at tp=2 a rank that loses its core stalls the other at the next collective), so
   the figure compared is the fastest prefill and the 10th percentile of the decode steps
   over all rounds; medians are shown next to them. Before the calibration and before
   each launch it waits (up to --idle-wait s) until no other process is runnable.
3. Prints the table and writes it into docs/planner.md between the validation markers.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from bench_model import ensure_bench_model  # noqa: E402

from shardwise.hf import read_config  # noqa: E402
from shardwise.launch import launch  # noqa: E402
from shardwise.planner.calibrate import load_calibration, wait_idle  # noqa: E402
from shardwise.planner.measure import generation_rank  # noqa: E402
from shardwise.planner.predict import Layout, predict_inference  # noqa: E402

DOC = Path(__file__).parent.parent / "docs" / "planner.md"
START, END = "<!-- validation:start -->", "<!-- validation:end -->"
WORKLOAD = dict(batch=1, prompt_len=128, output_len=32)
TARGET = 0.25


def _err(pred: float, meas: float) -> str:
    e = pred / meas - 1
    return f"{e:+.0%}" + ("" if abs(e) <= TARGET else " **miss**")


def _quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _load() -> float:
    return os.getloadavg()[0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3, help="launches per configuration, interleaved")
    ap.add_argument("--repeats", type=int, default=3, help="timed generations per launch")
    ap.add_argument("--cached", action="store_true", help="use the cached calibration instead of measuring again")
    ap.add_argument("--no-write", action="store_true", help="print the table only")
    ap.add_argument("--idle-wait", type=float, default=60.0, help="seconds to wait for an idle machine per launch")
    args = ap.parse_args()

    model = ensure_bench_model()
    _, cfg = read_config(model)
    load0 = _load()
    idle = [wait_idle(args.idle_wait)]
    cal = load_calibration(recalibrate=not args.cached)
    runs = [(1, "gloo")] + [(2, b) for b in ("gloo", "mpi") if b in cal.links]
    missing = [f"{b}: {why}" for b, why in cal.unavailable.items()]
    opts = dict(model=str(model), repeats=args.repeats, **WORKLOAD)
    t0 = time.time()
    measured: dict[tuple, list[dict]] = {r: [] for r in runs}
    for i in range(args.rounds):  # interleaved, so that a burst of load elsewhere hits every row alike
        for tp, backend in runs:
            idle.append(wait_idle(args.idle_wait))
            print(f"round {i + 1}/{args.rounds}: tp={tp} {backend} (load {_load():.1f})", file=sys.stderr)
            measured[(tp, backend)].append(launch(generation_rank, tp, args=(opts,), backend=backend)[0])
    load1 = _load()
    rows, misses = [], 0
    for tp, backend in runs:
        ms = measured[(tp, backend)]
        pool = lambda key, ms=ms: [x for m in ms for x in m[key]]  # noqa: E731 - every round's steps
        pre_m, dec_m = min(pool("prefill_ms")), _quantile(pool("decode_ms"), 0.1)
        pre_med, dec_med = statistics.median(pool("prefill_ms")), statistics.median(pool("decode_ms"))
        comm_m = _quantile(pool("decode_comm_ms"), 0.1)
        p = predict_inference(cfg, cal.cluster(backend), Layout(tp, 1, 1), width=4, dtype="float32", **WORKLOAD)
        pre, dec = p.prefill.total_s * 1e3, p.decode.total_s * 1e3
        misses += sum(abs(a / b - 1) > TARGET for a, b in ((pre, pre_m), (dec, dec_m)))
        comm = f"{p.decode.comm_s * 1e3:.1f} / {comm_m:.1f}" if tp > 1 else "-"
        rows.append(
            f"| {tp} | {backend if tp > 1 else '-'} | {pre:.0f} | {pre_m:.0f} | {_err(pre, pre_m)} | {pre_med:.0f} "
            f"| {min(m['cold_prefill_ms'] for m in ms):.0f} | {dec:.1f} | {dec_m:.1f} | {_err(dec, dec_m)} "
            f"| {dec_med:.1f} | {comm} |"
        )
    c = cal
    lines = [
        f"Measured {time.strftime('%Y-%m-%d %H:%M')} in {time.time() - t0:.0f} s by `benchmarks/validate_planner.py` "
        f"(rounds={args.rounds}, repeats={args.repeats}): benchmark model, fp32, batch {WORKLOAD['batch']}, prompt "
        f"{WORKLOAD['prompt_len']} tokens, {WORKLOAD['output_len']} new tokens, 1 thread per rank. Machine: "
        f"{c.devices} cores, shared; 1-minute load average {load0:.1f} before, {load1:.1f} after; "
        f"{sum(idle)} of {len(idle)} launches started on an idle machine (the others after waiting "
        f"{args.idle_wait:.0f} s).",
        "",
        f"Calibration ({c.created}, {c.seconds:.0f} s, {c.busy_launches} probe(s) started on a busy machine): "
        "one core alone: matmul "
        + ", ".join(f"{k} {v * 1e3:.0f} GFLOP/s" for k, v in c.gemm_tflops.items())
        + f", weight streaming {c.mem_gbps:.1f} GB/s, overhead {c.layer_overhead_us:.0f} us/layer + "
        f"{c.step_overhead_us:.0f} us/forward; with every core busy a core keeps {c.busy_compute:.0%} of its "
        f"FLOP/s and {c.busy_memory:.0%} of its bandwidth; all-reduce over 2 ranks "
        + "; ".join(
            f"{b}: {v['latency_us']:.0f} us + n / {v['busbw_gbps']:.2f} GB/s, "
            f"+{v.get('in_forward_extra_us', 0):.0f} us inside a forward"
            for b, v in c.links.items()
        )
        + (f"; not measured: {'; '.join(missing)}" if missing else "")
        + ".",
        "",
        "| tp | backend | prefill ms predicted | measured (best) | error | median | cold | "
        "decode ms/token predicted | measured (p10) | error | median | comm ms/token predicted / measured (p10) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
        *rows,
        "",
        f"{'PASS' if not misses else 'MISS'}: {len(rows) * 2 - misses} of {len(rows) * 2} predictions within "
        f"±{TARGET:.0%}. Error = predicted / measured - 1, where measured is the fastest prefill and the 10th "
        "percentile of the decode steps over every round (the median is shown next to it); cold = the first "
        "prefill after loading (not predicted); measured comm = time inside collectives per decode step, "
        "waiting for the other rank included.",
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
