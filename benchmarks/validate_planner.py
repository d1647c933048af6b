"""The planner's predictions against measurements on this machine: the tables in docs/benchmarks/planner-validation.md.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/validate_planner.py [--rounds 3] [--cached] [--no-write]
        [--skip-inference] [--skip-training] [--skip-memory] [--skip-pipeline] [--skip-serving]

1. Calibrates this host (unless --cached: then the cached calibration is used).
2. Inference: for the benchmark model (benchmarks/bench_model.py) at tp=1 and at tp=2 on
   every calibrated backend (gloo; mpi when it is available), predicts prefill and decode
   latency with the planner's this-host cluster, and measures them with the engine:
   batch 1, a 128-token prompt, 32 new tokens. Each configuration is launched `rounds`
   times, interleaved; each launch does one warm-up generation, then `repeats` timed ones.
   The planner predicts a machine nobody else uses, while this one is shared (2 cores,
   and at tp=2 a rank that loses its core stalls the other at the next collective), so
   the figure compared is the fastest prefill and the 10th percentile of the decode steps
   over all rounds; medians are shown next to them. Before the calibration and before
   each launch it waits (up to --idle-wait s) until no other process is runnable.
3. Training: a small Llama-shaped model (TRAIN_MODEL, random weights, random tokens)
   trained with shardwise.train (AdamW, fp32) at tp=1, tp=2 and dp=2 on every calibrated
   backend; predicted step time against the median step time after --train-warmup steps.
4. Training memory: the planner's predicted peak per rank (weights, gradients, AdamW state,
   the activations of the micro-batches a stage holds, with sequence parallelism and
   recompute none/selective/full, and the loss's logits) against the measured peak of real
   training runs (shardwise.train.saved.training_peak: resident memory above a warmed-up
   baseline, freed blocks returned at once) at tp 1 and 2, sp on and off, pp 1 and 2.
5. Pipeline: the same model and global batch at world size 2: pp=2 with GPipe and 1F1B at
   m = 2 and m = 8 micro-batches, beside tp=2 and dp=2, on every calibrated backend, launched
   interleaved in one run; predicted step time (bubble, stage-to-stage transfers included)
   against the median measured step.
6. Serving: decode latency of tp=1 x pp=2 (`generate --pp 2`, stages one after the other),
   and `shardwise serve` at tp=1, tp=2 and tp=1 x pp=2 (up to pp steps in flight) with 1, 4
   and 16 clients: predicted tokens/s (prefill included) and stage idle against measured.
7. Prints the tables and writes them into docs/benchmarks/planner-validation.md between their markers
   (a skipped part keeps its old table).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from bench_model import ensure_bench_model  # noqa: E402

from shardwise.bench.calibrate import Calibration, load_calibration, wait_idle  # noqa: E402
from shardwise.bench.measure import generation_rank, training_rank  # noqa: E402
from shardwise.hf import read_config  # noqa: E402
from shardwise.launch import launch  # noqa: E402
from shardwise.planner.predict import Layout, predict_inference, predict_training  # noqa: E402
from shardwise.planner.specs import TrainingWorkload  # noqa: E402

DOC = Path(__file__).parent.parent / "docs" / "benchmarks" / "planner-validation.md"
MARKERS = {
    "inference": ("<!-- validation:start -->", "<!-- validation:end -->"),
    "training": ("<!-- training:start -->", "<!-- training:end -->"),
    "memory": ("<!-- memory:start -->", "<!-- memory:end -->"),
    "pipeline": ("<!-- pipeline:start -->", "<!-- pipeline:end -->"),
    "serving": ("<!-- serving:start -->", "<!-- serving:end -->"),
}
SERVE_LAYOUTS = ((1, 1), (2, 1), (1, 2))
"""tp x pp of the serving part (the server's default backend, MPI here)."""
SERVE_CLIENTS = (1, 4, 16)
SERVE_WORKLOAD = dict(prompt_len=32, output_len=32)
WORKLOAD = dict(batch=1, prompt_len=128, output_len=32)
TARGET = 0.25
MEMORY_TARGET = 0.15

# NOTE: sized so that compute dominates (about 1 s per step at tp=1 on one core; a tp=2
# all-reduce carries 1 MiB, the dp=2 gradient all-reduce 59 MB) and a run of 8 steps
# takes seconds: 14.7M parameters.
TRAIN_MODEL = dict(
    vocab_size=2048,
    hidden_size=512,
    intermediate_size=1536,
    num_layers=4,
    num_heads=8,
    num_kv_heads=4,
    max_positions=256,
)
TRAIN_DATA = dict(seq_len=128, global_batch_size=8, micro_batch_size=4)
PIPELINE_MICROBATCHES = (2, 8)
"""m for the pp=2 rows: 8 sequences in 2 micro-batches of 4 (bubble 1/3) or 8 of 1 (bubble 1/9)."""


def _err(pred: float, meas: float, target: float = TARGET) -> str:
    e = pred / meas - 1
    return f"{e:+.0%}" + ("" if abs(e) <= target else " **miss**")


def _quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _load() -> float:
    return os.getloadavg()[0]


def _machine(cal: Calibration, load0: float, idle: list[bool], wait_s: float) -> str:
    return (
        f"Machine: {cal.devices} cores, shared; 1-minute load average {load0:.1f} before, {_load():.1f} after; "
        f"{sum(idle)} of {len(idle)} launches started on an idle machine (the others after waiting {wait_s:.0f} s)."
    )


def _calibration_line(c: Calibration) -> str:
    missing = [f"{b}: {why}" for b, why in c.unavailable.items()]
    return (
        f"Calibration ({c.created}, {c.seconds:.0f} s, {c.busy_launches} probe(s) started on a busy machine): "
        "one core alone: matmul "
        + ", ".join(f"{k} {v * 1e3:.0f} GFLOP/s" for k, v in c.gemm_tflops.items())
        + f", weight streaming {c.mem_gbps:.1f} GB/s, overhead {c.layer_overhead_us:.0f} us/layer + "
        f"{c.step_overhead_us:.0f} us/forward; with every core busy a core keeps {c.busy_compute:.0%} of its "
        f"FLOP/s and {c.busy_memory:.0%} of its bandwidth; a training forward and backward reaches "
        f"{c.train_efficiency:.0%} of the matmul FLOP/s ({_busy_train(c)}) with "
        f"{c.train_layer_overhead_us or 0:.0f} us/layer + {c.train_step_overhead_us or 0:.0f} us/micro-step fixed, "
        f"AdamW updates at {c.optimizer_gbps or 0:.1f} GB/s (one read and write of its state); all-reduce over 2 ranks "
        + "; ".join(
            f"{b}: {v['latency_us']:.0f} us + n / {v['busbw_gbps']:.2f} GB/s, inside a step after "
            + ", ".join(
                f"{pt['burst_us'] / 1e3:.2g} ms of compute +{pt['extra_us']:.0f} us" for pt in v["after_compute"]
            )
            for b, v in c.links.items()
        )
        + (f"; not measured: {'; '.join(missing)}" if missing else "")
        + "."
    )


def _busy_train(c: Calibration) -> str:
    return "not measured busy" if c.busy_train is None else f"{c.busy_train:.0%} of that with every core busy"


def validate_inference(cal: Calibration, args, load0: float) -> tuple[str, int, int]:
    """The inference table; (text, predictions, misses)."""
    model = ensure_bench_model()
    _, cfg = read_config(model)
    runs = [(1, "gloo")] + [(2, b) for b in ("gloo", "mpi") if b in cal.links]
    opts = dict(model=str(model), repeats=args.repeats, **WORKLOAD)
    t0, idle = time.time(), []
    measured: dict[tuple, list[dict]] = {r: [] for r in runs}
    for i in range(args.rounds):  # interleaved, so that a burst of load elsewhere hits every row alike
        for tp, backend in runs:
            idle.append(wait_idle(args.idle_wait))
            print(f"inference round {i + 1}/{args.rounds}: tp={tp} {backend} (load {_load():.1f})", file=sys.stderr)
            measured[(tp, backend)].append(launch(generation_rank, tp, args=(opts,), backend=backend)[0])
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
    lines = [
        f"Measured {time.strftime('%Y-%m-%d %H:%M')} in {time.time() - t0:.0f} s by `benchmarks/validate_planner.py` "
        f"(rounds={args.rounds}, repeats={args.repeats}): benchmark model, fp32, batch {WORKLOAD['batch']}, prompt "
        f"{WORKLOAD['prompt_len']} tokens, {WORKLOAD['output_len']} new tokens, 1 thread per rank. "
        + _machine(cal, load0, idle, args.idle_wait),
        "",
        _calibration_line(cal),
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
    return "\n".join(lines), len(rows) * 2, misses


def validate_training(cal: Calibration, args, load0: float) -> tuple[str, int, int]:
    """The training table; (text, predictions, misses)."""
    import torch

    from shardwise.train import TrainConfig, write_token_file

    work = Path(tempfile.mkdtemp(prefix="shardwise-validate-"))
    vocab = TRAIN_MODEL["vocab_size"]
    ids = torch.randint(0, vocab, (100_000,), generator=torch.Generator().manual_seed(0))
    tokens = write_token_file(work / "tokens.safetensors", ids, vocab_size=vocab)
    steps = args.train_warmup + args.train_steps
    base = {
        "model": TRAIN_MODEL,
        "data": {"tokens": str(tokens), **TRAIN_DATA},
        "run": {"steps": steps, "progress": False, "plot": False, "save_at_end": False, "out_dir": str(work)},
    }
    runs = [(1, 1, "gloo")] + [(tp, dp, b) for b in ("gloo", "mpi") if b in cal.links for tp, dp in ((2, 1), (1, 2))]
    runs = [r for r in runs if r[0] * r[1] <= cal.devices]
    cfg = TrainConfig.from_dict(base).model.model_config()
    wl = TrainingWorkload(
        global_batch=TRAIN_DATA["global_batch_size"],
        micro_batch=TRAIN_DATA["micro_batch_size"],
        seq_len=TRAIN_DATA["seq_len"],
        optimizer="adam",
        precision="fp32",
    )
    t0, idle = time.time(), []
    measured: dict[tuple, list[dict]] = {r: [] for r in runs}
    for i in range(args.train_rounds):
        for tp, dp, backend in runs:
            idle.append(wait_idle(args.idle_wait))
            print(f"training round {i + 1}/{args.train_rounds}: tp={tp} dp={dp} {backend}", file=sys.stderr)
            raw = {**base, "parallel": {"tp": tp, "dp": dp}}
            measured[(tp, dp, backend)].append(
                launch(training_rank, tp * dp, args=({"config": raw},), backend=backend)[0]
            )
    shutil.rmtree(work, ignore_errors=True)
    rows, misses = [], 0
    for tp, dp, backend in runs:
        ms = measured[(tp, dp, backend)]
        step_ms = [x for m in ms for x in m["step_ms"][args.train_warmup :]]
        comm_ms = [x for m in ms for x in m["comm_ms"][args.train_warmup :]]
        p = predict_training(cfg, cal.cluster(backend), Layout(tp, 1, dp), wl)
        pred, med = p.step.total_s * 1e3, statistics.median(step_ms)
        misses += abs(pred / med - 1) > TARGET
        rows.append(
            f"| {tp} | {dp} | {backend if tp * dp > 1 else '-'} | {ms[0]['sync']} | {pred:.0f} | "
            f"{p.step.compute_s * 1e3:.0f} + {p.step.comm_s * 1e3:.0f} | {med:.0f} | {_err(pred, med)} | "
            f"{min(step_ms):.0f} | {statistics.median(comm_ms):.0f} |"
        )
    lines = [
        f"Measured {time.strftime('%Y-%m-%d %H:%M')} in {time.time() - t0:.0f} s by the same command "
        f"(train rounds={args.train_rounds}, {args.train_warmup} warm-up + {args.train_steps} timed steps per "
        f"launch): shardwise.train on a Llama-shaped model with random weights and tokens ({cfg.num_layers} "
        f"layers, hidden {cfg.hidden_size}, intermediate {cfg.intermediate_size}, {cfg.num_heads} heads, "
        f"{cfg.num_kv_heads} KV heads, vocab {cfg.vocab_size}: {_params(cfg) / 1e6:.1f}M parameters), AdamW, fp32, "
        f"sequence {TRAIN_DATA['seq_len']}, global batch {TRAIN_DATA['global_batch_size']} in micro-batches of "
        f"{TRAIN_DATA['micro_batch_size']}, 1 thread per rank; predicted with the calibration of {cal.created}. "
        + _machine(cal, load0, idle, args.idle_wait),
        "",
        "| tp | dp | backend | dp sync | step ms predicted | = compute + comm | measured (median) | error | "
        "fastest | comm ms measured (median) |",
        "|---|---|---|---|---|---|---|---|---|---|",
        *rows,
        "",
        f"{'PASS' if not misses else 'MISS'}: {len(rows) - misses} of {len(rows)} predictions within ±{TARGET:.0%}. "
        "Error = predicted / measured - 1, measured = the median step time after the warm-up steps; measured comm "
        "= time inside shardwise's collectives per step (tp all-reduces, the bucketed dp all-reduce; DDP's "
        "all-reduces run inside torch and are not counted), waiting for the other rank included.",
    ]
    return "\n".join(lines), len(rows), misses


# NOTE: long sequences, so that activations (several hundred MiB) weigh as much as the
# weights and AdamW state (13M parameters: 200 MiB at 16 bytes each) and the options show.
MEMORY_MODEL = dict(TRAIN_MODEL, intermediate_size=1376, num_kv_heads=2, max_positions=1024)
MEMORY_DATA = dict(seq_len=1024, micro_batch=2)
MEMORY_RUNS = [  # (tp, pp, sequence_parallel, recompute, micro-batches per step)
    (1, 1, False, "none", 1),
    (1, 1, False, "selective", 1),
    (1, 1, False, "full", 1),
    (2, 1, False, "none", 1),
    (2, 1, True, "none", 1),
    (2, 1, True, "selective", 1),
    (2, 1, True, "full", 1),
    (1, 2, False, "none", 2),
    (2, 2, False, "none", 2),
    (2, 2, True, "selective", 2),
]


def validate_memory(cal: Calibration | None, args, load0: float) -> tuple[str, int, int]:
    """Predicted against measured training peaks per rank; (text, predictions, misses)."""
    import torch

    from shardwise.planner.footprint import training_memory
    from shardwise.train import TrainConfig, write_token_file
    from shardwise.train.saved import training_peak

    work = Path(tempfile.mkdtemp(prefix="shardwise-validate-mem-"))
    vocab = MEMORY_MODEL["vocab_size"]
    ids = torch.randint(0, vocab, (100_000,), generator=torch.Generator().manual_seed(0))
    tokens = write_token_file(work / "tokens.safetensors", ids, vocab_size=vocab)
    seq, b = MEMORY_DATA["seq_len"], MEMORY_DATA["micro_batch"]
    if cal is not None:
        backend = "mpi" if "mpi" in cal.links else "gloo"
    else:  # memory alone needs no calibration: MPI where installed, as shardwise train picks
        from shardwise.launch.env import resolve_backend

        backend = "gloo" if resolve_backend("auto") == "nccl" else resolve_backend("auto")

    def config(tp, pp, sp, recompute, m) -> dict:
        return {
            "model": MEMORY_MODEL,
            "data": {"tokens": str(tokens), "seq_len": seq, "global_batch_size": b * m, "microbatches": m},
            "parallel": {"tp": tp, "pp": pp, "sequence_parallel": sp},
            "run": {"steps": 3, "recompute": recompute, "progress": False, "plot": False, "save_at_end": False,
                    "out_dir": str(work)},
        }  # fmt: skip

    cfg = TrainConfig.from_dict(config(1, 1, False, "none", 1)).model.model_config()
    t0, rows, misses, n = time.time(), [], 0, 0
    for tp, pp, sp, recompute, m in MEMORY_RUNS:
        print(f"memory: tp={tp} pp={pp} sp={sp} recompute={recompute} m={m} ({backend})", file=sys.stderr)
        ranks = launch(training_peak, tp * pp, args=(config(tp, pp, sp, recompute, m),), backend=backend)
        for stage in range(pp):
            measured = [r["peak_bytes"] for r in ranks if r["pp_rank"] == stage]
            mem = training_memory(
                cfg, tp, pp, micro_batches=m, micro_batch=b, seq=seq, width=4, weight_bytes=4,
                optimizer="adam", recompute=recompute, flash=True, budget=float("inf"),
                sequence_parallel=sp, stage=stage,
            )  # fmt: skip
            worst = max(measured)
            n += 1
            misses += abs(mem.total / worst - 1) > MEMORY_TARGET
            state = mem.weights + mem.grads + mem.optimizer
            rows.append(
                f"| tp={tp} pp={pp} | {'yes' if sp else 'no'} | {recompute} | {m} | {stage} | {state / 2**20:.0f} + "
                f"{mem.activations / 2**20:.0f} | {mem.total / 2**20:.0f} | "
                f"{' / '.join(f'{x / 2**20:.0f}' for x in measured)} | {_err(mem.total, worst, MEMORY_TARGET)} |"
            )
    shutil.rmtree(work, ignore_errors=True)
    lines = [
        f"Measured {time.strftime('%Y-%m-%d %H:%M')} in {time.time() - t0:.0f} s by the same command: shardwise.train "
        f"on a Llama-shaped model ({cfg.num_layers} layers, hidden {cfg.hidden_size}, intermediate "
        f"{cfg.intermediate_size}, {cfg.num_heads} heads, {cfg.num_kv_heads} KV heads, vocab {cfg.vocab_size}: "
        f"{_params(cfg) / 1e6:.1f}M parameters), AdamW, fp32, micro-batches of {b} x {seq} tokens, 3 steps, on "
        f"{backend}; each layout launched once (memory does not vary between runs). Measured: each rank's peak "
        "resident anonymous memory above its baseline after a warm-up (large freed blocks returned to the system at "
        "once, so the peak follows the live tensors), sampled every 0.5 ms (shardwise.train.saved.training_peak).",
        "",
        "| layout | sp | recompute | m | stage | predicted MiB: weights + grads + AdamW, activations | predicted "
        "total | measured per tp rank | error |",
        "|---|---|---|---|---|---|---|---|---|",
        *rows,
        "",
        f"{'PASS' if not misses else 'MISS'}: {n - misses} of {n} predicted peaks within ±{MEMORY_TARGET:.0%}. "
        "Error = predicted / measured - 1 for the stage's larger measured peak. Predicted = "
        "shardwise.planner.footprint.training_memory for that stage: activations per layer from "
        "shardwise.planner.activations (1F1B: stage s holds min(pp - s, m) micro-batches), the layer being "
        "recomputed, and on the last stage the loss's fp32 logits, shifted logits and exponentials.",
    ]
    return "\n".join(lines), n, misses


PIPELINE_RUNS = [
    # (tp, pp, dp, schedule, m): world size 2 (and one device, for reference), the training model and global batch above
    (1, 1, 1, None, TRAIN_DATA["global_batch_size"] // TRAIN_DATA["micro_batch_size"]),
    *[(1, 2, 1, schedule, m) for m in PIPELINE_MICROBATCHES for schedule in ("gpipe", "1f1b")],
    (2, 1, 1, None, TRAIN_DATA["global_batch_size"] // TRAIN_DATA["micro_batch_size"]),
    (1, 1, 2, None, TRAIN_DATA["global_batch_size"] // (2 * TRAIN_DATA["micro_batch_size"])),
]


def _token_file(work: Path) -> Path:
    import torch

    from shardwise.train import write_token_file

    vocab = TRAIN_MODEL["vocab_size"]
    ids = torch.randint(0, vocab, (100_000,), generator=torch.Generator().manual_seed(0))
    return write_token_file(work / "tokens.safetensors", ids, vocab_size=vocab)


def validate_pipeline(cal: Calibration, args, load0: float) -> tuple[str, int, int]:
    """Pipeline training steps (pp=2, GPipe and 1F1B, two micro-batch counts) beside tp=2 and
    dp=2 at world size 2, measured side by side in one run; (text, predictions, misses)."""
    from shardwise.planner.schedule import PipelineSchedule
    from shardwise.train import TrainConfig

    work = Path(tempfile.mkdtemp(prefix="shardwise-validate-pp-"))
    tokens = _token_file(work)
    steps = args.train_warmup + args.train_steps
    g, seq = TRAIN_DATA["global_batch_size"], TRAIN_DATA["seq_len"]
    backends = [b for b in ("gloo", "mpi") if b in cal.links]
    runs = [(*r, b) for b in backends for r in PIPELINE_RUNS if r[0] * r[1] * r[2] > 1 or b == backends[0]]

    def config(tp, pp, dp, schedule, m) -> dict:
        parallel = {"tp": tp, "pp": pp, "dp": dp} | ({"schedule": schedule} if schedule else {})
        return {
            "model": TRAIN_MODEL,
            "data": {"tokens": str(tokens), "seq_len": seq, "global_batch_size": g, "microbatches": m},
            "parallel": parallel,
            "run": {"steps": steps, "progress": False, "plot": False, "save_at_end": False, "out_dir": str(work)},
        }

    cfg = TrainConfig.from_dict(config(1, 1, 1, None, 1)).model.model_config()
    t0, idle = time.time(), []
    measured: dict[tuple, list[dict]] = {r: [] for r in runs}
    for i in range(args.train_rounds):  # interleaved, so that load elsewhere hits every row alike
        for run in runs:
            tp, pp, dp, schedule, m, backend = run
            idle.append(wait_idle(args.idle_wait))
            print(f"pipeline round {i + 1}/{args.train_rounds}: tp={tp} pp={pp} dp={dp} {schedule or ''} m={m} "
                  f"{backend} (load {_load():.1f})", file=sys.stderr)  # fmt: skip
            raw = config(tp, pp, dp, schedule, m)
            measured[run].append(launch(training_rank, tp * pp * dp, args=({"config": raw},), backend=backend)[0])
    shutil.rmtree(work, ignore_errors=True)
    rows, misses = [], 0
    for run in runs:
        tp, pp, dp, schedule, m, backend = run
        step_ms = [x for r in measured[run] for x in r["step_ms"][args.train_warmup :]]
        wl = TrainingWorkload(global_batch=g, micro_batch=g // (dp * m), seq_len=seq, precision="fp32")
        sched = PipelineSchedule.build(schedule, cfg.num_layers, pp, m) if pp > 1 else None
        p = predict_training(cfg, cal.cluster(backend), Layout(tp, pp, dp), wl, sched)
        pred, med = p.step.total_s * 1e3, statistics.median(step_ms)
        misses += abs(pred / med - 1) > TARGET
        s = p.step
        rows.append(
            f"| {Layout(tp, pp, dp).arg()} | {schedule or '-'} | {m} | {g // (dp * m)} | "
            f"{backend if tp * pp * dp > 1 else '-'} | {pred:.0f} | "
            f"{s.compute_s * 1e3:.0f} + {s.comm_s * 1e3:.0f} + {s.bubble_s * 1e3:.0f} | "
            f"{p.bubble_fraction:.0%} | {med:.0f} | {_err(pred, med)} | {min(step_ms):.0f} |"
        )
    lines = [
        f"Measured {time.strftime('%Y-%m-%d %H:%M')} in {time.time() - t0:.0f} s by the same command "
        f"(train rounds={args.train_rounds}, {args.train_warmup} warm-up + {args.train_steps} timed steps per "
        f"launch, the rows' launches interleaved): the training model above ({_params(cfg) / 1e6:.1f}M parameters, "
        f"{cfg.num_layers} layers: 2 per stage at pp=2), AdamW, fp32, sequence {seq}, global batch {g} in m "
        f"micro-batches per dp rank, world size 2, 1 thread per rank; predicted with the calibration of "
        f"{cal.created}. " + _machine(cal, load0, idle, args.idle_wait),
        "",
        "| layout | schedule | m | micro-batch | backend | step ms predicted | = compute + comm + bubble | "
        "schedule's bubble | measured (median) | error | fastest |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
        *rows,
        "",
        f"{'PASS' if not misses else 'MISS'}: {len(rows) - misses} of {len(rows)} predictions within ±{TARGET:.0%}. "
        "Error = predicted / measured - 1, measured = the median step time after the warm-up steps. The schedule's "
        "bubble: its idle fraction with free transfers ((p - 1) / (m + p - 1)); the bubble column in ms is what "
        "the simulated schedule adds beyond the busiest rank's own compute, collectives and sends/receives.",
    ]
    return "\n".join(lines), len(rows), misses


def validate_serving(cal: Calibration, args, load0: float) -> tuple[str, int, int]:
    """Pipeline inference: decode latency of `generate --pp 2` (batch 1, stages one after the
    other) and a server's throughput at 1, 4 and 16 clients for tp=1, tp=2 and tp=1 x pp=2
    (up to pp steps in flight), predicted against measured; (text, predictions, misses)."""
    from bench_serve import run as serve_run
    from bench_serve import serving_copy
    from bench_serve import start as serve_start

    from shardwise.launch.env import resolve_backend

    model = ensure_bench_model()
    _, cfg = read_config(model)
    backend = resolve_backend("auto")
    t0, idle, rows, misses, n = time.time(), [], [], 0, 0
    # decode latency at pp = 2: the engine, batch 1, as the inference part measures tp
    opts = dict(model=str(model), repeats=args.repeats, pp=2, **WORKLOAD)
    runs = []
    for i in range(args.rounds):
        idle.append(wait_idle(args.idle_wait))
        print(f"serving round {i + 1}/{args.rounds}: generate tp=1 x pp=2 (load {_load():.1f})", file=sys.stderr)
        runs.append(launch(generation_rank, 2, args=(opts,), backend=backend)[-1])  # the last stage's view
    dec_m = _quantile([x for r in runs for x in r["decode_ms"]], 0.1)
    p = predict_inference(cfg, cal.cluster(backend), Layout(1, 2, 1), width=4, dtype="float32", **WORKLOAD)
    dec = p.decode.total_s * 1e3
    misses += abs(dec / dec_m - 1) > TARGET
    n += 1
    decode_line = (
        f"Decode at tp=1 x pp=2 ({backend}, `generate`, batch {WORKLOAD['batch']}, prompt {WORKLOAD['prompt_len']}): "
        f"predicted {dec:.1f} ms/token, measured {dec_m:.1f} (p10 of {args.rounds} launches), error {_err(dec, dec_m)}."
    )
    served = serving_copy(model)
    for tp, pp in SERVE_LAYOUTS:
        idle.append(wait_idle(args.idle_wait))
        print(f"serving: tp={tp} x pp={pp} server (load {_load():.1f})", file=sys.stderr)
        proc, url = serve_start(served, tp, "auto", pp)
        try:
            serve_run(url, 1, 1, SERVE_WORKLOAD["prompt_len"], 4)  # warm-up
            for c in SERVE_CLIENTS:
                best = max(
                    (serve_run(url, c, 2, SERVE_WORKLOAD["prompt_len"], SERVE_WORKLOAD["output_len"])
                     for _ in range(args.rounds)),
                    key=lambda r: r["tokens_per_s"],
                )  # fmt: skip
                lay = Layout(tp, pp, 1)
                pred = predict_inference(cfg, cal.cluster(backend), lay, batch=c, width=4, dtype="float32",
                                         **SERVE_WORKLOAD)  # fmt: skip
                got, want = best["tokens_per_s"], pred.serving_tokens_per_s
                misses += abs(want / got - 1) > TARGET
                n += 1
                idle_m = " / ".join(f"{x:.0%}" for x in best["stage_idle"]) or "-"
                idle_p = f"{pred.idle_fraction:.0%}" if pp > 1 else "-"
                rows.append(f"| {tp} | {pp} | {c} | {want:.1f} | {got:.1f} | {_err(want, got)} | {idle_p} | {idle_m} |")
        finally:
            proc.terminate()
            proc.wait(30)
    lines = [
        f"Measured {time.strftime('%Y-%m-%d %H:%M')} in {time.time() - t0:.0f} s by `benchmarks/validate_planner.py` "
        f"(rounds={args.rounds}): benchmark model, fp32, backend {backend}. "
        + _machine(cal, load0, idle, args.idle_wait),
        "",
        decode_line,
        "",
        f"Serving (`shardwise serve`, --max-batch-size 16): each client sends 2 requests one after another, a "
        f"{SERVE_WORKLOAD['prompt_len']}-token prompt and {SERVE_WORKLOAD['output_len']} greedy tokens; "
        "measured = the best of the rounds' tokens/s over the run's wall time; predicted = clients x tokens / "
        "(prefill + decode steps), at pp > 1 with the clients in pp groups whose steps are in flight at once.",
        "",
        "| tp | pp | clients | tokens/s predicted | measured (best) | error | stage idle predicted | measured |",
        "|---|---|---|---|---|---|---|---|",
        *rows,
        "",
        f"{'PASS' if not misses else 'MISS'}: {n - misses} of {n} predictions within ±{TARGET:.0%}.",
    ]
    return "\n".join(lines), n, misses


def _params(cfg) -> int:
    from shardwise.planner.footprint import stage_params

    return stage_params(cfg, 1, 1, 0)


def _write(part: str, table: str) -> None:
    start, end = MARKERS[part]
    text = DOC.read_text()
    if start not in text or end not in text:
        raise SystemExit(f"{DOC} has no {start} ... {end} section")
    pattern = re.compile(re.escape(start) + ".*?" + re.escape(end), re.S)
    DOC.write_text(pattern.sub(lambda _: f"{start}\n{table}\n{end}", text))
    print(f"wrote the {part} table into {DOC}", file=sys.stderr)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3, help="inference: launches per configuration, interleaved")
    ap.add_argument("--repeats", type=int, default=3, help="inference: timed generations per launch")
    ap.add_argument("--train-rounds", type=int, default=1, help="training: launches per configuration")
    ap.add_argument("--train-warmup", type=int, default=2, help="training: steps per launch before timing")
    ap.add_argument("--train-steps", type=int, default=6, help="training: timed steps per launch")
    ap.add_argument("--skip-inference", action="store_true", help="leave the inference table as it is")
    ap.add_argument("--skip-training", action="store_true", help="leave the training table as it is")
    ap.add_argument("--skip-memory", action="store_true", help="leave the training memory table as it is")
    ap.add_argument("--skip-pipeline", action="store_true", help="leave the pipeline table as it is")
    ap.add_argument("--skip-serving", action="store_true", help="leave the serving table as it is")
    ap.add_argument("--cached", action="store_true", help="use the cached calibration instead of measuring again")
    ap.add_argument("--no-write", action="store_true", help="print the tables only")
    ap.add_argument("--idle-wait", type=float, default=60.0, help="seconds to wait for an idle machine per launch")
    args = ap.parse_args()

    load0 = _load()
    wait_idle(args.idle_wait)
    timed = not (args.skip_inference and args.skip_training and args.skip_pipeline and args.skip_serving)
    cal = load_calibration(recalibrate=not args.cached) if timed else None  # memory needs no calibration
    parts = [
        (name, fn)
        for name, fn, skip in (
            ("inference", validate_inference, args.skip_inference),
            ("training", validate_training, args.skip_training),
            ("memory", validate_memory, args.skip_memory),
            ("pipeline", validate_pipeline, args.skip_pipeline),
            ("serving", validate_serving, args.skip_serving),
        )
        if not skip
    ]
    total = missed = 0
    for name, fn in parts:
        table, n, misses = fn(cal, args, load0)
        total, missed = total + n, missed + misses
        print(table + "\n")
        if not args.no_write:
            _write(name, table)
    print(f"{total - missed} of {total} predictions within target (time ±{TARGET:.0%}, memory ±{MEMORY_TARGET:.0%})",
          file=sys.stderr)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
