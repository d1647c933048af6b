"""Uneven tensor parallelism: decode and prefill at tp=2 on a model whose 9 heads 2 does not
divide, against tp=1 and against the same model padded to an even layout, side by side in ONE run.

The model (`--size`): Llama-shaped, random weights, 9 query heads, 3 KV heads, an odd
intermediate size, vocab 16000, fp32:
    122m (default): hidden 1152, 6 layers, heads of 128, intermediate 3073;
    300m: hidden 2304, 4 layers, heads of 256, intermediate 6145 (a decode step's matmuls
          dwarf its fixed per-step costs even more; a round takes 3x as long).
At tp=2 shardwise deals the query heads 5/4 (rank 0 holds KV heads 0-1, rank 1 holds 1-2:
KV head 1 is replicated) and the MLP width in two near-halves (1537/1536, 3073/3072).

The padded twin is what a system that only splits evenly needs: 9 query heads / 3 KV heads
cannot be padded to 10 (query heads must be a multiple of the KV heads), so the smallest
even layout is 12 query heads / 4 KV heads, one whole zero group, and the intermediate
size plus one.
The added rows and columns are zero, so it computes the same function (the run checks that
every row produces the same greedy tokens).

Rows: tp=1; tp=2 uneven; tp=2 padded; all on MPI, one thread per rank, configurations
interleaved over `--rounds` rounds (order rotated each round); medians and best over rounds. Each
launch times prefill of a 512-token prompt and 32 decode steps after it at batch 1
(shardwise.bench.measure.generation_rank), then the rank's weight floors: only the matmuls
of the weights this rank holds, every rank at once, with 1 row (a decode step: the
memory-bus bound) and with 512 rows (a prefill: the compute bound). floor(tp=1) /
floor(busiest tp=2 rank) is the most any tp=2 step of that layout can gain on this machine.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_uneven.py [--size 122m|300m] [--rounds 7] [--quick]
    .venv/bin/python benchmarks/bench_uneven.py --render docs/benchmarks/bench_uneven.json   # table and plot again
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path("/tmp/shardwise-bench")
_LLAMA9 = dict(
    num_attention_heads=9,
    num_key_value_heads=3,
    vocab_size=16000,
    max_position_embeddings=2048,
    tie_word_embeddings=False,
)
SIZES = {
    "122m": dict(_LLAMA9, hidden_size=1152, num_hidden_layers=6, head_dim=128, intermediate_size=3073),
    "300m": dict(_LLAMA9, hidden_size=2304, num_hidden_layers=4, head_dim=256, intermediate_size=6145),
}
DIRS = {"122m": "llama-9h", "300m": "llama-9h-300m"}
PROMPT, NEW = 512, 32
ROWS = ("tp=1", "tp=2 uneven (9 heads)", "tp=2 padded (12 heads)")


# ---- the checkpoints ----------------------------------------------------------------------
def _pad(w: torch.Tensor, rows: int | None = None, cols: int | None = None) -> torch.Tensor:
    """w with zero rows / columns appended up to `rows` x `cols`."""
    out = w.new_zeros(rows or w.shape[0], cols or w.shape[1])
    out[: w.shape[0], : w.shape[1]] = w
    return out


def ensure_models(size: str = "122m", root: Path = ROOT) -> tuple[Path, Path]:
    """The 9-head checkpoint of SIZES[size] and its zero-padded 12-head twin under `root` (written once)."""
    config = SIZES[size]
    padded_config = dict(config, num_attention_heads=12, num_key_value_heads=4)
    padded_config["intermediate_size"] += 1
    nine, twelve = root / DIRS[size], root / f"{DIRS[size]}-padded12"
    if all((p / "config.json").exists() and (p / "model.safetensors").exists() for p in (nine, twelve)):
        return nine, twelve
    import transformers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config, initializer_range=0.02))
    padded = transformers.LlamaForCausalLM(transformers.LlamaConfig(**padded_config, initializer_range=0.02))
    hd, q, kv, inter = (
        padded_config[k] for k in ("head_dim", "num_attention_heads", "num_key_value_heads", "intermediate_size")
    )
    new = {}
    for name, w in model.state_dict().items():
        if name.endswith("q_proj.weight"):
            w = _pad(w, rows=q * hd)  # query heads 9-11: zero, and they use the zero KV head 3
        elif name.endswith(("k_proj.weight", "v_proj.weight")):
            w = _pad(w, rows=kv * hd)
        elif name.endswith("o_proj.weight"):
            w = _pad(w, cols=q * hd)
        elif name.endswith(("gate_proj.weight", "up_proj.weight")):
            w = _pad(w, rows=inter)
        elif name.endswith("down_proj.weight"):
            w = _pad(w, cols=inter)
        new[name] = w
    padded.load_state_dict(new, strict=True)
    for path, m in ((nine, model), (twelve, padded)):
        path.mkdir(parents=True, exist_ok=True)
        m.to(torch.float32).save_pretrained(path, max_shard_size="2GB")
        n = sum(p.numel() for p in m.parameters())
        print(f"wrote {path}: {n / 1e6:.1f}M parameters", file=sys.stderr)
    return nine, twelve


# ---- what runs on the ranks ---------------------------------------------------------------
def _floor_ms(tp, model, rows: int, steps: int) -> float:
    """Median ms of the matmuls of every weight this rank holds, every rank starting together:
    `rows` rows through each layer's weights, one row through the LM head (generation needs
    only the last position's logits); the embedding, read one row at a time, is left out."""
    weights = [m.weight for name, m in model.named_modules() if name and hasattr(m, "weight") and m.weight.dim() == 2]
    weights = [w for w in weights if w is not model.embed.weight or model.cfg.tie_embeddings]
    inputs = [torch.randn(1 if w is model.lm_head.weight else rows, w.shape[1]) for w in weights]
    times = []
    with torch.no_grad():
        for _ in range(steps + 1):  # the first is a warm-up
            tp.barrier()
            t0 = time.perf_counter()
            for x, w in zip(inputs, weights, strict=True):
                torch.nn.functional.linear(x, w)
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times[1:])


def _rank(world, path: str, repeats: int) -> dict:
    """Prefill and decode times (generation_rank), then this rank's weight floors and the
    greedy tokens of a short generation."""
    from shardwise.bench.measure import generation_rank
    from shardwise.comm import tp_only
    from shardwise.engine import generate
    from shardwise.hf import load_pretrained

    gen = generation_rank(
        world, {"model": path, "batch": 1, "prompt_len": PROMPT, "output_len": NEW, "repeats": repeats}
    )
    tp = tp_only(world)
    model, report = load_pretrained(path, comm=tp)
    prompt = [(31 * i + 3) % _LLAMA9["vocab_size"] for i in range(64)]
    return {
        "prefill_ms": statistics.median(gen["prefill_ms"]),
        "decode_ms": statistics.median(gen["decode_ms"]),
        "decode_comm_ms": statistics.median(gen["decode_comm_ms"]),
        "floor_decode_ms": _floor_ms(tp, model, 1, 2 * NEW),
        "floor_prefill_ms": _floor_ms(tp, model, PROMPT, 3),
        "param_bytes": report.param_bytes,
        "tokens": generate(model, [prompt], comm=tp, max_new_tokens=16).tokens[0],
    }


# ---- the run ------------------------------------------------------------------------------
def _measure(nine: Path, twelve: Path, rounds: int, repeats: int) -> dict[str, list[list[dict]]]:
    """Every row's per-rank results, round by round, the order rotated each round."""
    from shardwise.launch import launch

    jobs = {ROWS[0]: (nine, 1), ROWS[1]: (nine, 2), ROWS[2]: (twelve, 2)}
    runs: dict[str, list[list[dict]]] = {name: [] for name in ROWS}
    for r in range(rounds):
        for name in ROWS[r % 3 :] + ROWS[: r % 3]:
            path, tp = jobs[name]
            print(f"round {r + 1}/{rounds}: {name}", file=sys.stderr, flush=True)
            load = float(Path("/proc/loadavg").read_text().split()[0])  # other processes on the machine
            ranks = launch(_rank, tp, args=(str(path), repeats), backend="mpi", timeout_s=600)
            runs[name].append([{**ranks[0], "load_before": load}, *ranks[1:]])
    return runs


METRICS = ("decode_ms", "prefill_ms", "floor_decode_ms", "floor_prefill_ms")


def _summarise(runs: dict[str, list[list[dict]]]) -> dict[str, dict]:
    """Per row: every round's figures, and their median and best (fastest) over rounds.
    Timings are rank 0's (collectives keep the ranks in step); floors the slowest rank's
    (it sets the pace).

    NOTE: both statistics are kept: the machine is shared, and another process only ever
    adds time, so a round that ran beside one shows as an outlier the median ignores and
    the best leaves out."""
    rows = {}
    for name, per_round in runs.items():
        rounds = [
            {
                "decode_ms": ranks[0]["decode_ms"],
                "prefill_ms": ranks[0]["prefill_ms"],
                "decode_comm_ms": ranks[0]["decode_comm_ms"],
                "load_before": ranks[0]["load_before"],
                "floor_decode_ms": max(x["floor_decode_ms"] for x in ranks),
                "floor_prefill_ms": max(x["floor_prefill_ms"] for x in ranks),
                "floor_decode_by_rank_ms": [x["floor_decode_ms"] for x in ranks],
                "floor_prefill_by_rank_ms": [x["floor_prefill_ms"] for x in ranks],
            }
            for ranks in per_round
        ]
        rows[name] = {
            "median": {m: statistics.median(r[m] for r in rounds) for m in (*METRICS, "decode_comm_ms")},
            "best": {m: min(r[m] for r in rounds) for m in METRICS},
            "rounds": rounds,
            "param_bytes": [x["param_bytes"] for x in per_round[0]],
            "tokens": per_round[0][0]["tokens"],
            "same_tokens_every_round": all(x["tokens"] == per_round[0][0]["tokens"] for x in sum(per_round, [])),
        }
    return rows


def _ratios(rows: dict, nine: Path) -> dict:
    """Speed-ups against tp=1, the ceilings the largest share allows and the fraction reached,
    from the medians and from the best rounds."""
    from shardwise.hf.load import read_config
    from shardwise.sharding.plans import balance

    _, cfg = read_config(nine)
    bal = balance(cfg, 2)
    out = {"balance": bal.describe(), "slowdown": bal.slowdown, "arithmetic_ceiling": 2 / bal.slowdown}
    for stat in ("median", "best"):
        t1, un, pad = (rows[n][stat] for n in ROWS)
        out[stat] = {}
        for step in ("decode", "prefill"):
            got = t1[f"{step}_ms"] / un[f"{step}_ms"]
            ceiling = t1[f"floor_{step}_ms"] / un[f"floor_{step}_ms"]
            out[stat][step] = {
                "speedup_uneven": got,
                "speedup_padded": t1[f"{step}_ms"] / pad[f"{step}_ms"],
                "ceiling_uneven": ceiling,
                "ceiling_padded": t1[f"floor_{step}_ms"] / pad[f"floor_{step}_ms"],
                "fraction_of_ceiling": got / ceiling,
                "uneven_over_padded": pad[f"{step}_ms"] / un[f"{step}_ms"],
            }
    t1 = rows[ROWS[0]]["tokens"]
    out["same_tokens"] = all(r["tokens"] == t1 and r["same_tokens_every_round"] for r in rows.values())
    return out


def render(data: dict) -> str:
    """The markdown tables (what docs/benchmarks/uneven.md shows)."""
    rows, q = data["rows"], data["ratios"]
    mib = 2**20
    lines = [
        "Medians over rounds, with the best round in brackets:",
        "",
        "| configuration | decode ms/token (b=1) | decode tok/s | prefill 512 ms | decode floor ms | prefill floor ms | param MiB/rank |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in rows.items():
        m, b = r["median"], r["best"]
        params = ", ".join(f"{x / mib:.0f}" for x in r["param_bytes"])
        lines.append(
            f"| {name} | {m['decode_ms']:.1f} ({b['decode_ms']:.1f}) | {1e3 / m['decode_ms']:.1f} "
            f"({1e3 / b['decode_ms']:.1f}) | {m['prefill_ms']:.0f} ({b['prefill_ms']:.0f}) | "
            f"{m['floor_decode_ms']:.1f} ({b['floor_decode_ms']:.1f}) | "
            f"{m['floor_prefill_ms']:.0f} ({b['floor_prefill_ms']:.0f}) | {params} |"
        )
    lines += [
        "",
        "| tp=2 uneven, from | step | speed-up over tp=1 | ceiling (floor tp=1 / busiest rank's floor) "
        "| fraction of ceiling | padded tp=2 speed-up | uneven vs padded |",
        "|---|---|---|---|---|---|---|",
    ]
    for stat in ("median", "best"):
        for step in ("decode", "prefill"):
            s = q[stat][step]
            lines.append(
                f"| {stat} | {step} | {s['speedup_uneven']:.2f}x | {s['ceiling_uneven']:.2f}x | "
                f"{s['fraction_of_ceiling']:.0%} | {s['speedup_padded']:.2f}x | {s['uneven_over_padded']:.2f}x |"
            )
    lines += [
        "",
        f"balance(cfg, 2): {q['balance']}; 2 / slowdown = {q['arithmetic_ceiling']:.2f}x with no shared memory bus. "
        f"Same greedy tokens on every row and round: {'yes' if q['same_tokens'] else 'NO'}.",
    ]
    return "\n".join(lines)


def _plot(data: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, q = data["rows"], data["ratios"]["median"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.6))
    for ax, step, title in zip(axes, ("decode", "prefill"), ("decode (batch 1)", "prefill 512 tokens"), strict=True):
        t1 = rows[ROWS[0]]["median"][f"{step}_ms"]
        speed = [t1 / rows[n]["median"][f"{step}_ms"] for n in ROWS]
        ceil = [1.0, q[step]["ceiling_uneven"], q[step]["ceiling_padded"]]
        ax.barh(ROWS, speed, color=["tab:gray", "tab:blue", "tab:orange"])
        ax.scatter(ceil, ROWS, marker="|", s=400, color="black", label="ceiling (weight floors)")
        ax.invert_yaxis()
        ax.set_xlim(0, max(ceil + speed) * 1.25)
        ax.set_title(f"{title}: speed-up over tp=1 (medians)")
        for i, v in enumerate(speed):
            ax.text(v, i, f" {v:.2f}x", va="center", fontsize=8)
        ax.legend(loc="upper right", fontsize=8)
    for ax in axes[1:]:
        ax.set_yticklabels([])
    size = data.get("size", "122m").upper()
    fig.suptitle(f"9-head Llama-shaped model ({size}, fp32), MPI, 1 thread per rank (higher is better)")
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="122m", help="the model (see above)")
    ap.add_argument("--root", type=Path, default=ROOT, help="where the two checkpoints are written (once)")
    ap.add_argument("--render", type=Path, help="print the table and redraw --png from this JSON; measure nothing")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--repeats", type=int, default=2, help="prefills and 32-token decodes per launch")
    ap.add_argument("--quick", action="store_true", help="1 round of 1 repeat, to check the script works")
    ap.add_argument("--out", type=Path, default=Path("docs/benchmarks/bench_uneven.json"))
    ap.add_argument("--png", default="docs/benchmarks/bench_uneven.png", help="the plot ('' for none)")
    args = ap.parse_args()
    rounds, repeats = (1, 1) if args.quick else (args.rounds, args.repeats)
    if args.render:
        data = json.loads(args.render.read_text())
        if args.png:
            _plot(data, Path(args.png))
        return print(render(data))

    nine, twelve = ensure_models(args.size, args.root)
    runs = _measure(nine, twelve, rounds, repeats)
    rows = _summarise(runs)
    data = {
        "rows": rows,
        "ratios": _ratios(rows, nine),
        "size": args.size,
        "rounds": rounds,
        "repeats": repeats,
        "models": [str(nine), str(twelve)],
        "machine": f"{platform.machine()}, torch {torch.__version__}",
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(data, indent=1))
    if args.png:
        _plot(data, Path(args.png))
    print(render(data))


if __name__ == "__main__":
    main()
