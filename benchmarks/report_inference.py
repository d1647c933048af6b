"""Turn bench_inference.py's JSON into the docs: a table, the target ratios, a plot.

    .venv/bin/python benchmarks/report_inference.py docs/benchmarks/bench_inference.json

Rewrites the section between the inference markers in docs/benchmarks/inference.md and writes
docs/benchmarks/bench_inference.png.
"""

from __future__ import annotations

import json
import platform
import sys
from pathlib import Path

import torch

DOC = Path("docs/benchmarks/inference.md")
PNG = Path("docs/benchmarks/bench_inference.png")
BEGIN, END = "<!-- inference:begin -->", "<!-- inference:end -->"
MiB = 2**20


def _targets(rows: dict) -> list[tuple[str, float, float, str]]:
    """(what, measured ratio, target, unit) for each target of the speed issue."""
    t1, mpi = rows["shardwise tp=1"], rows["shardwise tp=2 mpi"]
    hf2, hftp, native = (
        rows["transformers 2 threads"],
        rows["transformers tp_plan=auto tp=2"],
        rows["PyTorch native TP tp=2 (gloo)"],
    )
    out = [
        ("decode, tp=2 MPI vs shardwise tp=1", t1["decode_ms"] / mpi["decode_ms"], 1.8, "x faster"),
        ("decode, tp=2 MPI vs transformers 2 threads", hf2["decode_ms"] / mpi["decode_ms"], 1.0, "x faster"),
        (
            "prefill 128, tp=2 MPI vs transformers 2 threads",
            hf2["prefill_128_ms"] / mpi["prefill_128_ms"],
            1.0,
            "x faster",
        ),
        (
            "prefill 512, tp=2 MPI vs transformers 2 threads",
            hf2["prefill_512_ms"] / mpi["prefill_512_ms"],
            1.0,
            "x faster",
        ),
        ("prefill 512, tp=2 MPI vs shardwise tp=1", t1["prefill_512_ms"] / mpi["prefill_512_ms"], 1.8, "x faster"),
        ("parameter bytes per rank, tp=2 vs tp=1", max(mpi["param_bytes"]) / t1["param_bytes"][0], 0.52, "x (at most)"),
    ]
    if "error" not in hftp:
        out.append(("decode, tp=2 MPI vs transformers tp_plan", hftp["decode_ms"] / mpi["decode_ms"], 2.0, "x faster"))
    if "error" not in native:
        out.append(("decode, tp=2 MPI vs PyTorch native TP", native["decode_ms"] / mpi["decode_ms"], 4.0, "x faster"))
    return out


def _ceiling(data: dict) -> list[str]:
    """The most tp=2 can gain at batch-1 decode on this machine, from the weight floors."""
    rows, floors = data["rows"], data.get("floors")
    t1, mpi = rows["shardwise tp=1"], rows["shardwise tp=2 mpi"]
    if not floors or "error" in t1 or "error" in mpi:
        return []
    f1, f2 = floors["tp1_ms"], floors["tp2_ms"]
    ceiling, got = f1 / f2, t1["decode_ms"] / mpi["decode_ms"]
    spread = ", ".join(f"{a:.1f}/{b:.1f}" for a, b in zip(floors["tp1_all"], floors["tp2_all"], strict=True))
    return [
        f"Weight-streaming floor (`_weight_floor`): the matrix-vector products of every weight a decode "
        f"step reads and nothing else, on every rank at once, medians of 64 steps, tp=1 and tp=2 "
        f"alternated {len(floors['tp1_all'])} times (ms, tp=1/tp=2: {spread}): **{f1:.1f} ms at tp=1, "
        f"{f2:.1f} ms per rank at tp=2**. Half the bytes per rank, but the two cores share one "
        f"memory bus, so no tp=2 decode at batch 1 on this machine can be more than "
        f"**{ceiling:.2f}x** faster than tp=1, even with no communication and no framework "
        f"overhead at all. shardwise on MPI reaches {got:.2f}x, {got / ceiling:.0%} of that ceiling.",
    ]


def _plot(rows: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = {k: v for k, v in rows.items() if "error" not in v}
    names = list(ok)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.8))
    for ax, key, title in zip(
        axes,
        ("decode_ms", "prefill_128_ms", "prefill_512_ms"),
        ("decode, ms/token (batch 1)", "prefill 128 tokens, ms", "prefill 512 tokens, ms"),
        strict=True,
    ):
        vals = [ok[n][key] for n in names]
        colors = ["tab:blue" if n.startswith("shardwise") else "tab:gray" for n in names]
        ax.barh(names, vals, color=colors)
        ax.invert_yaxis()
        ax.set_title(title)
        for i, v in enumerate(vals):
            ax.text(v, i, f" {v:.1f}", va="center", fontsize=8)
    for ax in axes[1:]:
        ax.set_yticklabels([])
    fig.suptitle("156M-parameter Llama-shaped model, fp32, 1 thread per rank (lower is better)")
    fig.tight_layout()
    fig.savefig(PNG, dpi=110)


def render(data: dict) -> str:
    rows = data["rows"]
    lines = [
        BEGIN,
        f"Run on {platform.machine()} ({torch.get_num_threads()} threads available to torch, 2 cores), "
        f"torch {torch.__version__}, {data['repeats']} repeats per figure, medians.",
        "",
        "| configuration | decode ms/token (b=1) | prefill 128 ms | prefill 512 ms | decode tok/s (b=8) | param MiB/rank | peak anon MiB/rank (load) | same tokens |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, r in rows.items():
        if "error" in r:
            lines.append(f"| {name} | failed: {r['error']} | | | | | | |")
            continue
        params = ", ".join(f"{b / MiB:.0f}" for b in r["param_bytes"])
        peaks = ", ".join(f"{b / MiB:.0f}" for b in r["peak_anon_bytes"])
        lines.append(
            f"| {name} | {r['decode_ms']:.1f} | {r['prefill_128_ms']:.0f} | {r['prefill_512_ms']:.0f} | "
            f"{r['batch8_tok_s']:.0f} | {params} | {peaks} | {'yes' if r['same_tokens'] else 'NO'} |"
        )
    lines += ["", "Targets (ratios from this run):", "", "| target | measured | wanted | met |", "|---|---|---|---|"]
    for what, got, want, unit in _targets(rows):
        met = got <= want if "most" in unit else got >= want
        lines.append(
            f"| {what} | {got:.2f}{unit.split(' ')[0]} | {'<=' if 'most' in unit else '>='} {want} | {'yes' if met else 'NO'} |"
        )
    lines += [
        "",
        "Where a decode step's time goes (batch 1, measured with the torch profiler on, so the step is slower):",
        "",
    ]
    lines += [
        "| configuration | step ms (profiled) | GEMM + attention kernels | collectives | everything else |",
        "|---|---|---|---|---|",
    ]
    for name, r in rows.items():
        p = r.get("profile")
        if p:
            lines.append(
                f"| {name} | {p['step_ms_profiled']:.1f} | {p['kernels_ms']:.1f} | {p['collectives_ms']:.2f} "
                f"| {p['other_ms']:.1f} |"
            )
    lines += ["", *_ceiling(data)]
    lines += ["", "![latency by configuration](bench_inference.png)", END]
    return "\n".join(lines)


def main() -> None:
    data = json.loads(Path(sys.argv[1] if len(sys.argv) > 1 else "docs/benchmarks/bench_inference.json").read_text())
    section = render(data)
    doc = DOC.read_text()
    if BEGIN in doc:
        doc = doc[: doc.index(BEGIN)] + section + doc[doc.index(END) + len(END) :]
    else:
        doc += "\n" + section + "\n"
    DOC.write_text(doc)
    _plot(data["rows"])
    print(section)


if __name__ == "__main__":
    main()
