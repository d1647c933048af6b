"""Pipeline parallelism for training, measured at world size 2 on this machine.

    python benchmarks/bench_pipeline.py [--steps 4] [--out docs/benchmarks/bench_pipeline.json]

A Llama-shaped model (8 layers, hidden 512, 8 heads, 4 KV heads, intermediate 1408,
vocab 2048), randomly initialised, trained on random tokens (seq 128, micro-batch 2).
One run measures, side by side:

1. idle fraction of each stage (time in sends and receives, waiting included, over the
   step's wall time) for GPipe and 1F1B at m in {1, 2, 4, 8}, beside (p - 1) / (m + p - 1);
2. peak bytes of activations saved for backward on each stage, GPipe against 1F1B,
   beside the formula: A_s * (m for GPipe, min(p - s, m) for 1F1B), A_s being one
   micro-batch's saved bytes on stage s (measured at m = 1);
3. point-to-point bytes per step from the collective accounting (send/pp), beside
   2 * m * (p - 1) * micro_batch * seq * hidden * 4;
4. tokens/s of pp=2 (1F1B, m=8), tp=2 and dp=2 against tp=1, for the same model and
   global batch (16 sequences).

Writes the numbers as JSON and a two-panel plot (docs/benchmarks/bench_pipeline.png).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from shardwise.comm import LocalCommunicator  # noqa: E402
from shardwise.launch import launch  # noqa: E402
from shardwise.train import TrainConfig, setup, train_step, write_token_file  # noqa: E402

MODEL = dict(
    vocab_size=2048,
    hidden_size=512,
    intermediate_size=1408,
    num_layers=8,
    num_heads=8,
    num_kv_heads=4,
    max_positions=128,
)
SEQ, MICRO, GLOBAL = 128, 2, 16
MS = (1, 2, 4, 8)


def _config(tokens: str, out: str, *, tp=1, pp=1, dp=1, schedule="1f1b", m=8, steps=4) -> TrainConfig:
    return TrainConfig.from_dict(
        {
            "model": MODEL,
            "data": {"tokens": tokens, "seq_len": SEQ, "global_batch_size": MICRO * m * dp, "microbatches": m},
            "optim": {"lr": 1e-3, "schedule": "constant"},
            "parallel": {"tp": tp, "pp": pp, "dp": dp, "schedule": schedule, "timeout_s": 600},
            "run": {"steps": steps, "progress": False, "plot": False, "out_dir": out, "log_every": 1000},
        }
    )


def _measure(world, cfg: TrainConfig) -> dict:
    """Train cfg.run.steps steps; the first is warm-up. Per-rank stage stats of the last step."""
    tr = setup(world, cfg)
    if tr.pipeline is not None:
        tr.pipeline.measure_memory = True
    times = []
    for i in range(cfg.run.steps):
        before = world.stats.copy()
        stats = train_step(tr)
        if i:
            times.append(stats.seconds)
        sent = (world.stats - before).bytes("send", "pp")
    out = {"step_s": statistics.median(times), "tokens": stats.tokens, "sent_bytes": sent}
    if tr.pipeline is not None:
        s = tr.pipeline.stats
        out |= {
            "stage": tr.mesh.pp_rank,
            "idle": s.idle_fraction,
            "peak_bytes": s.peak_activation_bytes,
            "peak_in_flight": s.peak_in_flight,
        }
    return out


def _pipeline_runs(world, tokens: str, out: str, steps: int) -> list[dict]:
    """Every (schedule, m) at pp=2, then tp=2 and dp=2, on the same two ranks."""
    rows = []
    for schedule in ("gpipe", "1f1b"):
        for m in MS:
            per_rank = world_gather(
                world, _measure(world, _config(tokens, out, pp=2, schedule=schedule, m=m, steps=steps))
            )
            rows.append({"kind": "pp=2", "schedule": schedule, "m": m, "ranks": per_rank})
    for kind, par in (("tp=2", {"tp": 2}), ("dp=2", {"dp": 2})):
        m = GLOBAL // MICRO // par.get("dp", 1)
        per_rank = world_gather(world, _measure(world, _config(tokens, out, m=m, steps=steps, **par)))
        rows.append({"kind": kind, "schedule": None, "m": m, "ranks": per_rank})
    return rows


def world_gather(world, item: dict) -> list[dict]:
    """Every rank's dict, on every rank (small JSON through an all-gather of bytes)."""
    data = torch.tensor(list(json.dumps(item).encode()), dtype=torch.uint8)
    n = world.all_gather(torch.tensor([data.numel()]), dim=0)
    buf = torch.zeros(int(n.max()), dtype=torch.uint8)
    buf[: data.numel()] = data
    rows = world.all_gather(buf.view(1, -1), dim=0)
    return [json.loads(bytes(rows[r, : int(n[r])].tolist())) for r in range(world.size)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=4, help="steps per configuration (the first is warm-up)")
    ap.add_argument("--backend", default="gloo", choices=["gloo", "mpi"])
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks" / "bench_pipeline.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp(prefix="bench-pp-"))
    g = torch.Generator().manual_seed(0)
    tokens = str(
        write_token_file(
            tmp / "tokens.safetensors",
            torch.randint(0, MODEL["vocab_size"], (200_000,), generator=g),
            vocab_size=MODEL["vocab_size"],
        )
    )
    single = _measure(LocalCommunicator(), _config(tokens, str(tmp), m=GLOBAL // MICRO, steps=args.steps))
    rows = launch(_pipeline_runs, 2, args=(tokens, str(tmp), args.steps), backend=args.backend)[0]
    report = analyse(rows, single)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    plot(report, args.out.with_suffix(".png"))
    print(markdown(report))


def analyse(rows: list[dict], single: dict) -> dict:
    p, act_bytes = 2, 4
    boundary = MICRO * SEQ * MODEL["hidden_size"] * act_bytes
    one = {
        r["stage"]: r["peak_bytes"]
        for row in rows
        if row["schedule"] == "gpipe" and row["m"] == 1
        for r in row["ranks"]
    }
    pipeline = []
    for row in rows:
        if row["kind"] != "pp=2":
            continue
        m, sched = row["m"], row["schedule"]
        stages = sorted(row["ranks"], key=lambda r: r["stage"])

        def held(s: int, m: int = m, sched: str = sched) -> int:
            return m if sched == "gpipe" else min(p - s, m)

        pipeline.append(
            {
                "schedule": sched,
                "m": m,
                "step_s": max(r["step_s"] for r in stages),
                "idle": [round(r["idle"], 3) for r in stages],
                "idle_formula": round((p - 1) / (m + p - 1), 3),
                "peak_mib": [round(r["peak_bytes"] / 2**20, 2) for r in stages],
                "peak_mib_formula": [round(one[s] * held(s) / 2**20, 2) for s in range(p)],
                "in_flight": [r["peak_in_flight"] for r in stages],
                "p2p_bytes": sum(r["sent_bytes"] for r in stages),
                "p2p_bytes_formula": 2 * m * (p - 1) * boundary,
            }
        )
    tokens = GLOBAL * SEQ
    speed = {"tp=1": round(tokens / single["step_s"], 1)}
    for row in rows:
        if row["kind"] in ("tp=2", "dp=2"):
            speed[row["kind"]] = round(tokens / max(r["step_s"] for r in row["ranks"]), 1)
    pp8 = next(r for r in pipeline if r["schedule"] == "1f1b" and r["m"] == 8)
    speed["pp=2 (1f1b, m=8)"] = round(tokens / pp8["step_s"], 1)
    return {
        "model": MODEL,
        "seq": SEQ,
        "micro_batch": MICRO,
        "global_batch": GLOBAL,
        "pipeline": pipeline,
        "tokens_per_s": speed,
    }


def markdown(report: dict) -> str:
    lines = [
        "| schedule | m | idle stage 0 / 1 | formula | activations MiB stage 0 / 1 | formula | p2p bytes | formula |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in report["pipeline"]:
        lines.append(
            f"| {r['schedule']} | {r['m']} | {r['idle'][0]:.2f} / {r['idle'][1]:.2f} | {r['idle_formula']:.2f} | "
            f"{r['peak_mib'][0]:.1f} / {r['peak_mib'][1]:.1f} | {r['peak_mib_formula'][0]:.1f} / "
            f"{r['peak_mib_formula'][1]:.1f} | {r['p2p_bytes']:,} | {r['p2p_bytes_formula']:,} |"
        )
    base = report["tokens_per_s"]["tp=1"]
    lines += ["", "| layout (world 2, global batch 16 x 128) | tokens/s | vs tp=1 |", "|---|---|---|"]
    for k, v in report["tokens_per_s"].items():
        lines.append(f"| {k} | {v:,.0f} | {v / base:.2f}x |")
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4), dpi=110)
    for sched, marker in (("gpipe", "o"), ("1f1b", "s")):
        rows = [r for r in report["pipeline"] if r["schedule"] == sched]
        ms = [r["m"] for r in rows]
        a.plot(ms, [r["idle"][0] for r in rows], marker=marker, label=f"{sched}, stage 0 (embedding, 4 layers)")
        a.plot(
            ms, [r["idle"][1] for r in rows], marker=marker, ls="--", label=f"{sched}, stage 1 (4 layers, head, loss)"
        )
        b.plot(ms, [r["peak_mib"][0] for r in rows], marker=marker, label=f"{sched}, stage 0")
        b.plot(ms, [r["peak_mib"][1] for r in rows], marker=marker, ls="--", label=f"{sched}, stage 1")
    ms = list(MS)
    a.plot(ms, [1 / (m + 1) for m in ms], "k:", label="(p-1)/(m+p-1)")
    a.set(
        xlabel="micro-batches m",
        ylabel="idle fraction of the step",
        title="pipeline bubble, pp=2",
        xscale="log",
        xticks=ms,
    )
    a.set_xticklabels(ms)
    b.set(
        xlabel="micro-batches m",
        ylabel="MiB saved for backward (peak)",
        title="activation memory per stage",
        xscale="log",
        xticks=ms,
    )
    b.set_xticklabels(ms)
    for ax in (a, b):
        ax.minorticks_off()
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


if __name__ == "__main__":
    main()
