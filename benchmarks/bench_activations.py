"""Activation memory and step time of sequence parallelism and recomputation, measured.

    python benchmarks/bench_activations.py [--rounds 6] [--backend mpi] [--out docs/benchmarks/bench_activations.json]

A Llama-shaped model (4 layers, hidden 512, 8 heads, 2 KV heads, gated MLP of 1376,
vocab 2048), random tokens, micro-batch 2 x seq 512, fp32 (and, for memory, bf16
autocast). In one run:

1. Activation bytes each decoder layer keeps for backward, per rank, for tp=1; tp=2;
   tp=2 + sequence parallelism; tp=2 + sp + selective recompute; full recompute (tp=1
   and tp=2 + sp). Measured with saved-tensor hooks while one micro-batch goes forward
   through the real training model (shardwise.train.setup), by shardwise.train.saved:
   each tensor autograd saves is attributed to the layer running, once per storage,
   parameters and their autocast casts left out; a recomputed region's inputs, which
   torch.utils.checkpoint holds instead of saving, are counted at its entry. The
   per-layer figure is the mean over layers 1..L-1 (layer 0 also sees the rotary tables
   and mask every layer shares).
   Beside it the formula for our layer (shardwise.planner.activations) and the paper's
   (Korthikanti et al. 2022, Table 2); each ratio to tp=1 is checked against the formula's.
2. Step time (median and minimum of interleaved rounds, after a warm-up step) of every
   mode, with the overheads the targets name: selective over none, full over none, sp over
   plain tp, as the median over rounds of the ratio of the two modes' steps in the same
   round (both felt the same load from other processes on this shared machine) and as the
   ratio of their fastest steps; beside each, what the added work alone costs: the attention
   core's forward times the layers (selective), the layers' forward (full), the extra
   seconds inside collectives, from the accounting (sp).
3. The collectives alone at the boundary size (B x T x H fp32): one all-reduce against a
   reduce-scatter plus an all-gather, on the same tp communicator: what sequence
   parallelism's exchange costs on this machine before any compute.

Writes JSON (--out) and prints Markdown tables.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from shardwise.comm import LocalCommunicator  # noqa: E402
from shardwise.launch import launch  # noqa: E402
from shardwise.layers import vocab_parallel_cross_entropy  # noqa: E402
from shardwise.planner.activations import layer_activation_bytes, paper_layer_bytes  # noqa: E402
from shardwise.train import TrainConfig, setup, train_step, write_token_file  # noqa: E402
from shardwise.train.saved import SavedBytes  # noqa: E402

MODEL = dict(
    vocab_size=2048,
    hidden_size=512,
    intermediate_size=1376,
    num_layers=4,
    num_heads=8,
    num_kv_heads=2,
    max_positions=512,
)
SEQ, MICRO = 512, 2
MODES = {  # name: (tp, sequence_parallel, recompute)
    "tp=1": (1, False, "none"),
    "tp=1 selective": (1, False, "selective"),
    "tp=1 full": (1, False, "full"),
    "tp=2": (2, False, "none"),
    "tp=2 selective": (2, False, "selective"),
    "tp=2+sp": (2, True, "none"),
    "tp=2+sp+selective": (2, True, "selective"),
    "tp=2+sp+full": (2, True, "full"),
}
MEMORY_ROWS = (
    "tp=1",
    "tp=2",
    "tp=2+sp",
    "tp=2+sp+selective",
    "tp=1 full",
    "tp=2+sp+full",
    "tp=1 selective",
    "tp=2 selective",
)
"""The paper's five (tp=1; tp=2; tp=2 + sp; tp=2 + sp + selective; full recompute), then the rest."""
TOLERANCE = 0.15


def _config(tokens: str, out: str, tp: int, sp: bool, recompute: str) -> TrainConfig:
    return TrainConfig.from_dict(
        {
            "model": MODEL,
            "data": {"tokens": tokens, "seq_len": SEQ, "global_batch_size": MICRO, "micro_batch_size": MICRO},
            "optim": {"lr": 1e-4, "min_lr": 1e-5, "schedule": "constant"},
            "parallel": {"tp": tp, "sequence_parallel": sp, "timeout_s": 600},
            "run": {"steps": 10**6, "recompute": recompute, "progress": False, "plot": False, "out_dir": out},
        }
    )


# ---- memory ---------------------------------------------------------------------------------
def saved_per_layer(tr, bf16: bool) -> float:
    """Mean bytes kept for backward by decoder layers 1..L-1 for one micro-batch (this rank)."""
    x, y = tr.data.batch(tr.sampler.micro_batches(0)[0])
    with SavedBytes(tr.model) as saved, torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        logits = tr.model(x)
    vocab_parallel_cross_entropy(logits, y, comm=tr.mesh.tp).mean().backward()
    tr.optimizer.zero_grad(set_to_none=True)
    return saved.mean_layer()


# ---- one job per tp size ----------------------------------------------------------------------
def _run(world, tokens: str, out: str, names: list[str], rounds: int) -> dict:
    trainers = {n: setup(world, _config(tokens, out, *MODES[n])) for n in names}
    result: dict = {"backend": world.backend, "modes": {}}
    for name, tr in trainers.items():
        result["modes"][name] = {
            "fp32_bytes": saved_per_layer(tr, bf16=False),
            "bf16_bytes": saved_per_layer(tr, bf16=True),
        }
        train_step(tr)  # warm-up
    times: dict[str, list[float]] = {n: [] for n in names}
    comm: dict[str, list[float]] = {n: [] for n in names}
    for _ in range(rounds):
        for name, tr in trainers.items():
            world.barrier()
            before = world.stats.copy()
            times[name].append(train_step(tr).seconds)
            comm[name].append((world.stats - before).seconds())
    for name, tr in trainers.items():
        m = result["modes"][name]
        m["step_s"], m["step_s_min"], m["step_s_all"] = statistics.median(times[name]), min(times[name]), times[name]
        m["comm_s"] = statistics.median(comm[name])
        m["core_fwd_s"], m["fwd_s"] = _forward_costs(tr)
    if world.size > 1:
        result["collectives"] = _collectives(trainers[names[0]].mesh.tp, rounds=20)
    return result


def _forward_costs(tr, reps: int = 5) -> tuple[float, float]:
    """Median seconds of what recomputation repeats, without autograd: one layer's attention
    core at this rank's heads (selective repeats it per layer), and the decoder layers'
    forward for one micro-batch (full repeats it)."""
    model, cfg = tr.model, tr.model_cfg
    tp = tr.mesh.tp.size
    a, kv, d = cfg.num_heads // tp, max(cfg.num_kv_heads // tp, 1), cfg.head_dim
    q, k, v = torch.randn(MICRO, a, SEQ, d), torch.randn(MICRO, kv, SEQ, d), torch.randn(MICRO, kv, SEQ, d)
    x, _ = tr.data.batch(tr.sampler.micro_batches(0)[0])
    core = model.layers[0].attn
    with torch.no_grad():
        hidden, rope, mask = model.prelude(x)
        cost = {}
        for name, fn in (
            ("core", lambda: core.core(q, k, v, mask)),
            ("layers", lambda: model.run_layers(hidden, rope, mask)),
        ):
            fn()
            samples = []
            for _ in range(reps):
                tr.mesh.tp.barrier()
                t0 = time.perf_counter()
                fn()
                samples.append(time.perf_counter() - t0)
            cost[name] = statistics.median(samples)
    return cost["core"], cost["layers"]


def _collectives(tp, rounds: int) -> dict:
    """Median seconds of one all-reduce of a (B, T, H) fp32 tensor against a reduce-scatter of
    it plus an all-gather of a (B, T/tp, H) shard, and of the backward's extra all-gather."""
    full = torch.randn(MICRO, SEQ, MODEL["hidden_size"])
    shard = full[:, : SEQ // tp.size].contiguous()
    ops = {
        "all_reduce": lambda: tp.all_reduce(full),
        "reduce_scatter + all_gather": lambda: (tp.reduce_scatter(full, dim=1), tp.all_gather(shard, dim=1)),
        "all_gather": lambda: tp.all_gather(shard, dim=1),
    }
    out = {}
    for name, op in ops.items():
        op()
        samples = []
        for _ in range(rounds):
            tp.barrier()
            t0 = time.perf_counter()
            op()
            samples.append(time.perf_counter() - t0)
        out[name] = statistics.median(samples)
    return out


# ---- report -----------------------------------------------------------------------------------
def analyse(tp1: dict, tp2: dict) -> dict:
    from shardwise.train import model_config

    cfg = model_config(_config("t", "o", 1, False, "none"))
    modes = {**tp1["modes"], **tp2["modes"]}
    memory = {}
    for dtype, e in (("fp32", 4), ("bf16", 2)):
        base_measured = modes["tp=1"][f"{dtype}_bytes"]
        base_formula = layer_activation_bytes(cfg, tp=1, micro_batch=MICRO, seq=SEQ, act_bytes=e)
        base_paper = paper_layer_bytes(cfg, tp=1, micro_batch=MICRO, seq=SEQ)
        rows = []
        for name in MEMORY_ROWS:
            tp, sp, rc = MODES[name]
            kw = dict(tp=tp, micro_batch=MICRO, seq=SEQ, sequence_parallel=sp, recompute=rc)
            formula = layer_activation_bytes(cfg, act_bytes=e, **kw)
            measured = modes[name][f"{dtype}_bytes"]
            ratio, f_ratio = measured / base_measured, formula / base_formula
            rows.append(
                {
                    "mode": name,
                    "measured_mib": measured / 2**20,
                    "formula_mib": formula / 2**20,
                    "ratio": ratio,
                    "formula_ratio": f_ratio,
                    "paper_ratio": paper_layer_bytes(cfg, **kw) / base_paper,
                    "within": abs(ratio / f_ratio - 1) <= TOLERANCE,
                }
            )
        memory[dtype] = rows
    pairs = {  # (mode, its reference, target, what bounds it physically)
        "tp=1 selective vs tp=1": ("tp=1 selective", "tp=1", 0.10, "selective"),
        "tp=2 selective vs tp=2": ("tp=2 selective", "tp=2", 0.10, "selective"),
        "tp=2+sp+selective vs tp=2+sp": ("tp=2+sp+selective", "tp=2+sp", 0.10, "selective"),
        "tp=1 full vs tp=1": ("tp=1 full", "tp=1", None, "full"),
        "tp=2+sp+full vs tp=2+sp": ("tp=2+sp+full", "tp=2+sp", None, "full"),
        "tp=2+sp vs tp=2": ("tp=2+sp", "tp=2", 0.05, "comm"),
    }
    overhead = []
    for label, (mode, ref, target, kind) in pairs.items():
        m, b = modes[mode], modes[ref]
        if kind == "selective":  # the attention core's forward, once more per layer
            floor = MODEL["num_layers"] * b["core_fwd_s"] / b["step_s"]
        elif kind == "full":  # the layers' forward, once more
            floor = b["fwd_s"] / b["step_s"]
        else:  # the extra time inside collectives
            floor = (m["comm_s"] - b["comm_s"]) / b["step_s"]
        paired = [x / y - 1 for x, y in zip(m["step_s_all"], b["step_s_all"], strict=True)]
        overhead.append(
            {
                "what": label,
                "paired": statistics.median(paired),  # the same round: both felt the same load
                "min": m["step_s_min"] / b["step_s_min"] - 1,
                "expected": floor,
                "target": target,
            }
        )
    return {
        "model": MODEL,
        "seq": SEQ,
        "micro_batch": MICRO,
        "backend": tp2["backend"],
        "memory": memory,
        "steps": {
            n: {k: modes[n][k] for k in ("step_s", "step_s_min", "comm_s", "core_fwd_s", "fwd_s")} for n in MODES
        },
        "overhead": overhead,
        "collectives_s": tp2.get("collectives"),
    }


def markdown(r: dict) -> str:
    lines = []
    for dtype, rows in r["memory"].items():
        lines += [
            f"\n{dtype}: activations kept for backward per layer per rank (micro-batch {r['micro_batch']} x seq {r['seq']})\n",
            "| mode | measured MiB | formula MiB | measured / tp=1 | formula / tp=1 | paper / tp=1 | within 15% |",
            "|---|---|---|---|---|---|---|",
        ]
        for x in rows:
            lines.append(
                f"| {x['mode']} | {x['measured_mib']:.2f} | {x['formula_mib']:.2f} | {x['ratio']:.3f} | "
                f"{x['formula_ratio']:.3f} | {x['paper_ratio']:.3f} | {'yes' if x['within'] else 'NO'} |"
            )
    lines += [
        f"\nstep time ({r['backend']} at tp=2; fp32)\n",
        "| mode | s/step median | min | in collectives | layers' forward | one attention core |",
        "|---|---|---|---|---|---|",
    ]
    for n, x in r["steps"].items():
        lines.append(
            f"| {n} | {x['step_s']:.3f} | {x['step_s_min']:.3f} | {x['comm_s']:.3f} | {x['fwd_s']:.3f} | "
            f"{x['core_fwd_s'] * 1e3:.1f} ms |"
        )
    lines += [
        "",
        "| overhead | median of per-round ratios | ratio of minima | expected from the work added | target |",
        "|---|---|---|---|---|",
    ]
    for o in r["overhead"]:
        target = f"<= {o['target']:.0%}" if o["target"] is not None else "-"
        lines.append(f"| {o['what']} | {o['paired']:+.1%} | {o['min']:+.1%} | {o['expected']:+.1%} | {target} |")
    if r["collectives_s"]:
        lines += ["", "| collective at (B, T, H) fp32 | ms |", "|---|---|"]
        lines += [f"| {n} | {v * 1e3:.2f} |" for n, v in r["collectives_s"].items()]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=6, help="timed steps per mode, interleaved")
    ap.add_argument("--backend", default="mpi", choices=["gloo", "mpi"])
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks" / "bench_activations.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp(prefix="bench-act-"))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, MODEL["vocab_size"], (100_000,), generator=g)
    tokens = str(write_token_file(tmp / "tokens.safetensors", ids, vocab_size=MODEL["vocab_size"]))
    one = [n for n, m in MODES.items() if m[0] == 1]
    two = [n for n, m in MODES.items() if m[0] == 2]
    tp1 = _run(LocalCommunicator(), tokens, str(tmp), one, args.rounds)
    tp2 = launch(_run, 2, args=(tokens, str(tmp), two, args.rounds), backend=args.backend, timeout_s=3600)[0]
    report = analyse(tp1, tp2)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(markdown(report))


if __name__ == "__main__":
    main()
