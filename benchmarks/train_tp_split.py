"""Where a tp=2 training micro-step inside one host spends its time, against the planner's parts.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/train_tp_split.py [--shape builtin|h1024] [--rounds 4]

A forward and backward (vocab-parallel cross-entropy on every position, as shardwise.train's
micro-step) of bench_links.py's training shape, timed as measure.best_time does (fastest of 5
after one warm-up) in four forms, round after round so that the machine's slow and fast spells
fall on all of them:

- tp1 alone:  the unsharded model, one process on one core;
- dry2 alone: one tp=2 rank's shard, its collectives answered by a DryRunCommunicator (no data
              moves, nothing waits): the compute of a shard, without a partner;
- tp1 busy, dry2 busy: the same in two processes at once, one a core;
- tp2:        the real tp=2 job, its tp group built as shardwise.train builds it (ParallelDims:
              the shared-memory all-reduce inside one host), every step after a barrier.

Beside them, the planner's parts of the same micro-step (planner.predict._micro_batch, this
host's calibration): tp=1's compute, tp=2's compute and collectives, and the factor it slows a
core's training compute by while every core works (1 / busy_train). The
ratios separate what the planner misses: how far a shard's compute is from half (dry2 alone /
tp1 alone), what a core loses while the other works (busy / alone), and what the collectives
cost beyond the shard's compute (tp2 - dry2 busy). docs/benchmarks/links.md cites its output.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_links import TRAIN_SHAPES  # noqa: E402

_BUILTIN, _DATA, _ = TRAIN_SHAPES["builtin"]
SHAPES = {  # name: (vocab, hidden, intermediate, layers, heads, kv heads)
    "builtin": tuple(
        _BUILTIN[k]
        for k in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads")
    ),  # fmt: skip
    "h1024": (4096, 1024, 2816, 2, 16, 4),  # the calibration's training probe (measure._training_probe)
}
BATCH, TOKENS = _DATA["micro_batch_size"], _DATA["seq_len"]  # bench_links.py's micro-batch


def _config(shape: str):
    from shardwise.models.config import ModelConfig

    v, h, i, n, heads, kv = SHAPES[shape]
    return ModelConfig("llama", v, h, i, n, heads, kv, h // heads)


def rank(world, shape: str, rounds: int) -> dict[str, list[float]]:
    """ms of each form, round by round, on this rank."""
    import torch

    from shardwise.bench.measure import best_time
    from shardwise.comm.dims import ParallelDims
    from shardwise.comm.dryrun import DryRunCommunicator
    from shardwise.layers import vocab_parallel_cross_entropy
    from shardwise.train.layout import build_model

    torch.set_num_threads(1)
    cfg = _config(shape)
    ids = torch.randint(0, cfg.vocab_size, (BATCH, TOKENS), generator=torch.Generator().manual_seed(0))
    comms = {
        "tp1": world.split([[r] for r in range(world.size)], "solo"),
        "dry2": DryRunCommunicator(2, world.rank % 2),
    }
    if world.size == 2:
        comms["tp2"] = ParallelDims(world_size=2, tp=2).build(world).tp
    models = {k: build_model(cfg, c, init_std=0.02) for k, c in comms.items()}
    out: dict[str, list[float]] = {k: [] for k in comms}
    for _ in range(rounds):
        for k, model in models.items():

            def step(model=model, comm=comms[k]) -> None:
                model.zero_grad(set_to_none=True)
                logits = model(ids)  # (B, T, V / tp)
                vocab_parallel_cross_entropy(logits, ids, comm=comm).mean().backward()

            world.barrier()
            out[k].append(best_time(step, 5, sync=world if k == "tp2" else None) * 1e3)
    return out


def planner_parts(shape: str) -> dict[str, float]:
    """The planner's micro-step parts: tp=1's compute (one core working), tp=2's compute (every
    core working) and collectives, ms; and the factor it slows a core's training compute by while
    every core works (1 / busy_train, Device.train_flops)."""
    from shardwise.bench.calibrate import load_calibration
    from shardwise.planner.predict import Layout, _micro_batch
    from shardwise.planner.specs import TrainingWorkload

    cfg, cal = _config(shape), load_calibration()
    wl = TrainingWorkload(global_batch=BATCH, micro_batch=BATCH, seq_len=TOKENS, precision="fp32", optimizer="adam")
    parts = {}
    for name, tp in (("tp1", 1), ("tp2", 2)):
        f, b, _ = _micro_batch(cfg, cal.hosts(1, tp), Layout(tp, 1, 1), wl, layers=cfg.num_layers, first=True,
                               last=True, stage=0, transfers=0)  # fmt: skip
        parts[f"{name} compute"] = (f.compute_s + b.compute_s) * 1e3
        if tp > 1:
            parts[f"{name} collectives"] = (f.comm_s + b.comm_s) * 1e3
    dev = cal.hosts(1, 2).device
    parts["busy factor"] = dev.train_flops("float32") / dev.train_flops("float32", busy=True)
    return parts


def main() -> None:
    from bench_native import _machine

    from shardwise.launch import launch

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="builtin")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--out", type=Path, help="also write the figures as JSON")
    a = ap.parse_args()
    m = _machine()
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"CPU: {m['model']}, {m['cores']} cores; flags {' '.join(m['flags'])}; torch {m['torch']}")
    print(
        f"shape {a.shape} {SHAPES[a.shape]} (vocab, hidden, intermediate, layers, heads, kv), micro-batch {BATCH} x {TOKENS}"
    )
    rounds: dict[str, list[float]] = {}
    for world, label in ((1, "alone"), (2, "busy")):
        res = launch(rank, world, args=(a.shape, a.rounds), backend="gloo", timeout_s=900)
        for k in res[0]:
            name = k if k == "tp2" else f"{k} {label}"
            rounds[name] = [max(r[k][i] for r in res) for i in range(a.rounds)]  # the slower rank's
    med = {k: statistics.median(v) for k, v in rounds.items()}
    plan = planner_parts(a.shape)
    print("\nmeasured ms a micro-step (the slower rank's), round by round; median")
    for k, v in rounds.items():
        print(f"  {k:11s} {' '.join(f'{x:7.1f}' for x in v)}   median {med[k]:7.1f}")
    print("planner (this host's calibration): ms, and the busy factor")
    for k, v in plan.items():
        print(f"  {k:22s} {v:7.2f}")
    tp2_plan = plan["tp2 compute"] + plan["tp2 collectives"]
    busy = plan["busy factor"]  # the planner's tp=2 compute has it; a shard alone would not
    rows = [
        ("a shard's compute / tp=1's, alone", med["dry2 alone"] / med["tp1 alone"], plan["tp2 compute"] / busy / plan["tp1 compute"]),
        ("tp=1 busy / alone", med["tp1 busy"] / med["tp1 alone"], busy),
        ("a shard busy / alone", med["dry2 busy"] / med["dry2 alone"], busy),
        ("collectives, ms (tp2 - dry2 busy)", med["tp2"] - med["dry2 busy"], plan["tp2 collectives"]),
        ("tp2 / tp1 alone", med["tp2"] / med["tp1 alone"], tp2_plan / plan["tp1 compute"]),
        ("tp2, ms", med["tp2"], tp2_plan),
    ]  # fmt: skip
    print(f"\n{'':36s} {'measured':>9s} {'planner':>9s}")
    for name, meas, pred in rows:
        print(f"  {name:34s} {meas:9.2f} {pred:9.2f}")
    if a.out:
        a.out.write_text(json.dumps({"machine": m, "shape": a.shape, "rounds": rounds, "planner": plan,
                                     "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
