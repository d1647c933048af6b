"""Mixture of experts: decode and prefill of a Mixtral-shaped model at tp=1, at tp=2 with
tensor-parallel experts, at tp=2 with expert parallelism, and transformers (tp=1, same
checkpoint, one thread), side by side in ONE run, with the load each rank's experts receive.

The model: Mixtral-shaped, random weights, hidden 1024, 4 layers, 16 heads / 4 KV heads,
8 experts of width 1408, top-2, vocab 32000, fp32: 214.5M parameters, of which 77.9M are
active per token (attention, router, 2 of 8 experts, LM head; the embedding row not counted).

Each launch (one thread per rank, MPI when available: launch's `auto`) times a prefill of
512 tokens and decode steps at batch 1 and batch 8 (16 new tokens after a 32-token prompt),
records which experts every MoE layer routed each (token, choice) pair to, and replays that
routing as the rank's matmul floor: only the matmuls of the weights this rank holds and the
routing makes it use (attention, router, the experts it received tokens for, with those
tokens' rows; the LM head with one row), every rank at once. floor(tp=1) / floor(busiest
rank) is the most a tp=2 step of that placement can gain on this machine.

The same launch then repeats the timings with a skewed router (`--skew B`: a forward hook
adds B to the router logits of experts 0 and 1, so they receive most pairs; both sit on
rank 0 under expert parallelism).

Rounds interleave the configurations (order rotated each round); medians over rounds.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_moe.py [--rounds 3] [--quick]
    .venv/bin/python benchmarks/bench_moe.py --render docs/benchmarks/bench_moe.json   # table and plot again
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

DIR = Path("/tmp/shardwise-bench/mixtral-214m")
CONFIG = dict(
    hidden_size=1024,
    num_hidden_layers=4,
    num_attention_heads=16,
    num_key_value_heads=4,
    intermediate_size=1408,
    num_local_experts=8,
    num_experts_per_tok=2,
    vocab_size=32000,
    max_position_embeddings=2048,
    tie_word_embeddings=False,
)
PROMPT, SHORT, NEW, BATCH = 512, 32, 16, 8
ROWS = ("tp=1", "tp=2 tensor-parallel experts", "tp=2 expert-parallel", "transformers tp=1")
STEPS = ("decode_b1", "decode_b8", "prefill")


def ensure_model(path: Path = DIR) -> Path:
    """The Mixtral-shaped checkpoint at `path` (written once)."""
    if (path / "config.json").exists() and (path / "model.safetensors").exists():
        return path
    import transformers

    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(transformers.MixtralConfig(**CONFIG, initializer_range=0.02))
    path.mkdir(parents=True, exist_ok=True)
    model.to(torch.float32).save_pretrained(path, max_shard_size="4GB")
    print(f"wrote {path}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters", file=sys.stderr)
    return path


def param_counts() -> dict:
    """Total and active-per-token parameters of CONFIG (the embedding row not counted as active)."""
    c = CONFIG
    h, layers, v = c["hidden_size"], c["num_hidden_layers"], c["vocab_size"]
    hd = h // c["num_attention_heads"]
    attn = 2 * h * h + 2 * h * c["num_key_value_heads"] * hd
    expert = 3 * h * c["intermediate_size"]
    router, norms = h * c["num_local_experts"], 2 * h
    total = 2 * v * h + h + layers * (attn + router + norms + c["num_local_experts"] * expert)
    active = v * h + layers * (attn + router + c["num_experts_per_tok"] * expert)
    return {"total": total, "active_per_token": active}


def _ids(n: int, batch: int = 1) -> list[list[int]]:
    return [[(31 * i + 7 * b + 3) % CONFIG["vocab_size"] for i in range(n)] for b in range(batch)]


# ---- what runs on the ranks ---------------------------------------------------------------
class _Recorder:
    """Forward hooks on every MoE block: the routed expert ids (N, k) of each forward while on."""

    def __init__(self, blocks) -> None:
        self.on, self.steps = False, []  # steps: per forward, per layer, idx (N, k)
        self.blocks = blocks
        for i, b in enumerate(blocks):
            b.register_forward_hook(lambda m, a, out, i=i: self._hook(i, m))

    def _hook(self, i: int, m) -> None:
        if self.on:
            if i == 0:
                self.steps.append([])
            self.steps[-1].append(m.routed.clone())


def _floor_ms(tp, model, blocks, routing: list[list[torch.Tensor]], rows: int) -> float:
    """Median ms over the recorded steps of the matmuls this rank's weights get in each:
    every 2-D weight outside the experts with `rows` rows (the LM head with one), and each
    held expert that received pairs with that many rows; every rank starting together."""
    expert_params = {id(p) for b in blocks for p in b.experts.parameters()}
    dense = [m.weight for name, m in model.named_modules() if name and hasattr(m, "weight") and m.weight.dim() == 2]
    dense = [
        w for w in dense if id(w) not in expert_params and (w is not model.embed.weight or model.cfg.tie_embeddings)
    ]
    xs = [torch.randn(1 if w is model.lm_head.weight else rows, w.shape[1]) for w in dense]
    H = model.cfg.hidden_size
    times = []
    with torch.no_grad():
        for step in [routing[0], *routing]:  # the first is a warm-up
            work = []
            for b, idx in zip(blocks, step, strict=True):
                E = b.experts.num_local
                up, down = b.experts.up.view(E, -1, H), b.experts.down.view(E, H, -1)
                counts = b.experts.tokens_per_expert(idx).tolist()
                work += [(torch.randn(n, H), up[e], down[e]) for e, n in enumerate(counts) if n]
            tp.barrier()
            t0 = time.perf_counter()
            for x, w in zip(xs, dense, strict=True):
                torch.nn.functional.linear(x, w)
            for x, up, down in work:
                torch.nn.functional.linear(torch.nn.functional.linear(x, up)[:, : down.shape[1]], down)
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times[1:])


def _measure_rank(tp, model, blocks, rec: _Recorder, repeats: int) -> dict:
    """Timings, per-step routing counts and floors of the three steps on this rank."""
    from shardwise.engine import generate

    out = {}
    prompt = torch.tensor(_ids(PROMPT))
    with torch.no_grad():
        ms, routing = [], None
        for _ in range(repeats + 1):
            caches = model.new_caches(1, PROMPT + 1)
            rec.on, rec.steps = True, []
            tp.barrier()
            t0 = time.perf_counter()
            model(prompt, caches=caches, last_only=True)
            ms.append((time.perf_counter() - t0) * 1e3)
            rec.on, routing = False, rec.steps
        out["prefill"] = {"ms": statistics.median(ms[1:]), "routing": routing, "rows": PROMPT}
    for name, batch in (("decode_b1", 1), ("decode_b8", BATCH)):
        steps, tokens = [], None
        for i in range(repeats + 1):
            rec.on, rec.steps = True, []
            r = generate(model, _ids(SHORT, batch), comm=tp, max_new_tokens=NEW)
            rec.on = False
            if i:
                steps += r.decode_ms
            tokens = tokens or r.tokens[0]
        out[name] = {"ms": statistics.median(steps), "routing": rec.steps[1:], "rows": batch, "tokens": tokens}
    result = {}
    for name, o in out.items():
        held = [range(b.experts.first, b.experts.first + b.experts.num_local) for b in blocks]
        counts = [
            [torch.bincount(idx.reshape(-1), minlength=blocks[0].num_experts).tolist() for idx in s]
            for s in o["routing"]
        ]
        result[name] = {
            "ms": o["ms"],
            "floor_ms": _floor_ms(tp, model, blocks, o["routing"], o["rows"]),
            "counts": counts,  # per step, per layer, per expert: routed (token, choice) pairs
            "held": [[r.start, r.stop] for r in held],
            "tokens": o.get("tokens"),
        }
    return result


def _rank(world, path: str, expert_parallel: bool, repeats: int, skew: float) -> dict:
    from shardwise.comm import tp_only
    from shardwise.hf import load_pretrained
    from shardwise.models.moe import moe_blocks

    torch.manual_seed(0)
    tp = tp_only(world)
    model, _ = load_pretrained(path, comm=tp, expert_parallel=expert_parallel)
    model.eval()
    blocks = moe_blocks(model)
    rec = _Recorder(blocks)
    even = _measure_rank(tp, model, blocks, rec, repeats)
    bias = torch.zeros(blocks[0].num_experts)
    bias[:2] = skew
    for b in blocks:  # the skewed router: experts 0 and 1 favoured
        b.gate.register_forward_hook(lambda m, a, out: out + bias)
    return {"even": even, "skewed": _measure_rank(tp, model, blocks, rec, repeats)}


def _hf_rank(world, path: str, repeats: int) -> dict:
    """transformers' MixtralForCausalLM on one thread: the same three steps."""
    from transformers import AutoModelForCausalLM, DynamicCache

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = {}
    with torch.no_grad():
        ids = torch.tensor(_ids(PROMPT))
        ms = []
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            model(ids, use_cache=True, past_key_values=DynamicCache(), logits_to_keep=1)
            ms.append((time.perf_counter() - t0) * 1e3)
        out["prefill"] = {"ms": statistics.median(ms[1:])}
        for name, batch in (("decode_b1", 1), ("decode_b8", BATCH)):
            steps, tokens = [], None
            for i in range(repeats + 1):
                o = model(
                    torch.tensor(_ids(SHORT, batch)), use_cache=True, past_key_values=DynamicCache(), logits_to_keep=1
                )
                past, tok, toks = o.past_key_values, o.logits[:, -1].argmax(-1, keepdim=True), []
                for _ in range(NEW - 1):
                    toks.append(tok[0, 0].item())
                    t0 = time.perf_counter()
                    o = model(tok, past_key_values=past, use_cache=True)
                    tok = o.logits[:, -1].argmax(-1, keepdim=True)
                    if i:
                        steps.append((time.perf_counter() - t0) * 1e3)
                tokens = tokens or [*toks, tok[0, 0].item()]
            out[name] = {"ms": statistics.median(steps), "tokens": tokens}
    return {"even": out}


# ---- the run ------------------------------------------------------------------------------
def _measure(path: Path, rounds: int, repeats: int, skew: float) -> dict:
    from shardwise.launch import launch
    from shardwise.launch.env import resolve_backend

    backend = resolve_backend("auto")  # what the commands use: MPI when mpi4py is installed
    jobs = {
        ROWS[0]: lambda: launch(_rank, 1, args=(str(path), False, repeats, skew)),
        ROWS[1]: lambda: launch(_rank, 2, args=(str(path), False, repeats, skew), backend=backend, timeout_s=600),
        ROWS[2]: lambda: launch(_rank, 2, args=(str(path), True, repeats, skew), backend=backend, timeout_s=600),
        ROWS[3]: lambda: launch(_hf_rank, 1, args=(str(path), repeats)),
    }
    runs: dict[str, list] = {n: [] for n in ROWS}
    loads = []
    for r in range(rounds):
        for name in ROWS[r % 4 :] + ROWS[: r % 4]:
            print(f"round {r + 1}/{rounds}: {name}", file=sys.stderr, flush=True)
            loads.append(float(Path("/proc/loadavg").read_text().split()[0]))
            runs[name].append(jobs[name]())
    return {"runs": runs, "loads": loads, "backend": backend}


def _load_stats(ranks: list[dict], case: str, step: str) -> dict:
    """Routed pairs per expert per step (mean over steps and layers) and per rank: each
    rank's pairs to experts it holds (all of them, sliced, under tensor-parallel experts),
    and sum over steps and layers of the busiest rank's / of the mean rank's (the slowest
    rank sets each layer's pace)."""
    counts = ranks[0][case][step]["counts"]  # the same on every rank: the router is replicated
    n_steps, n_layers, E = len(counts), len(counts[0]), len(counts[0][0])
    per_expert = [sum(layer[e] for c in counts for layer in c) / (n_steps * n_layers) for e in range(E)]
    held = [r[case][step]["held"][0] for r in ranks]  # every layer holds the same range
    busiest = mean = 0.0
    per_rank = [0.0] * len(ranks)
    for c in counts:
        for layer in c:
            got = [sum(layer[a:b]) for a, b in held]
            busiest += max(got)
            mean += sum(got) / len(got)
            per_rank = [p + g / (n_steps * n_layers) for p, g in zip(per_rank, got, strict=True)]
    return {"per_expert": per_expert, "per_rank": per_rank, "max_over_mean": busiest / mean if mean else 1.0}


def summarise(raw: dict) -> dict:
    rows = {}
    for name, per_round in raw["runs"].items():
        row = {}
        for case in ("even", "skewed"):
            if case not in per_round[0][0]:
                continue
            row[case] = {}
            for step in STEPS:
                rec = {"ms": statistics.median(rr[0][case][step]["ms"] for rr in per_round)}
                if "floor_ms" in per_round[0][0][case][step]:
                    rec["floor_ms"] = statistics.median(max(x[case][step]["floor_ms"] for x in rr) for rr in per_round)
                    rec["load"] = _load_stats(per_round[0], case, step)
                if step != "prefill":
                    rec["tokens"] = per_round[0][0][case][step]["tokens"]
                row[case][step] = rec
        rows[name] = row
    ratios = {}
    for case in ("even", "skewed"):
        t1 = rows[ROWS[0]][case]
        ratios[case] = {
            name: {
                step: {
                    "speedup": t1[step]["ms"] / rows[name][case][step]["ms"],
                    "ceiling": t1[step]["floor_ms"] / rows[name][case][step]["floor_ms"],
                    "fraction": (t1[step]["ms"] / rows[name][case][step]["ms"])
                    / (t1[step]["floor_ms"] / rows[name][case][step]["floor_ms"]),
                }
                for step in STEPS
            }
            for name in ROWS[1:3]
        }
    ref = {s: rows[ROWS[0]]["even"][s]["tokens"] for s in ("decode_b1", "decode_b8")}
    same = all(rows[n]["even"][s]["tokens"] == ref[s] for n in ROWS for s in ref)
    return {"rows": rows, "ratios": ratios, "same_tokens": same}


def render(data: dict) -> str:
    rows, q = data["rows"], data["ratios"]
    pc = data["params"]
    lines = [
        f"Mixtral-shaped, {pc['total'] / 1e6:.1f}M parameters ({pc['active_per_token'] / 1e6:.1f}M active per token), "
        f"fp32, one thread per rank, tp=2 on {data.get('backend', 'gloo')}; medians of {data['rounds']} rounds; "
        "load average during the run "
        f"{min(data['loads']):.1f}-{max(data['loads']):.1f}.",
        "",
        "| configuration | decode ms/token b=1 | decode ms/step b=8 | b=8 tok/s | prefill 512 ms |",
        "|---|---|---|---|---|",
    ]
    for name in ROWS:
        r = rows[name]["even"]
        lines.append(
            f"| {name} | {r['decode_b1']['ms']:.1f} | {r['decode_b8']['ms']:.1f} | "
            f"{BATCH * 1e3 / r['decode_b8']['ms']:.0f} | {r['prefill']['ms']:.0f} |"
        )
    for case in ("even", "skewed"):
        title = "random router" if case == "even" else f"skewed router (+{data['skew']} on experts 0 and 1)"
        lines += [
            "",
            f"tp=2 against tp=1, {title}: speed-up / ceiling (floor tp=1 / busiest rank's floor) / fraction "
            "of it reached; busiest rank's routed pairs / mean rank's",
            "",
            "| placement | step | tp=1 ms | tp=2 ms | speed-up | ceiling | fraction | busiest/mean pairs |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for name in ROWS[1:3]:
            for step in STEPS:
                s, r = q[case][name][step], rows[name][case][step]
                lines.append(
                    f"| {name.removeprefix('tp=2 ')} | {step} | {rows[ROWS[0]][case][step]['ms']:.1f} | {r['ms']:.1f} | "
                    f"{s['speedup']:.2f}x | {s['ceiling']:.2f}x | {s['fraction']:.0%} | {r['load']['max_over_mean']:.2f} |"
                )
    lines += [
        "",
        "Routed (token, choice) pairs per expert per layer per step (mean), and per rank under expert parallelism:",
        "",
    ]
    lines += ["| router | step | experts 0-7 | rank 0 / rank 1 |", "|---|---|---|---|"]
    for case in ("even", "skewed"):
        for step in STEPS:
            ld = rows[ROWS[2]][case][step]["load"]
            lines.append(
                f"| {case} | {step} | {' '.join(f'{x:.1f}' for x in ld['per_expert'])} | "
                f"{' / '.join(f'{x:.1f}' for x in ld['per_rank'])} |"
            )
    lines += ["", f"Same greedy tokens on every row (random router): {'yes' if data['same_tokens'] else 'NO'}."]
    return "\n".join(lines)


def _plot(data: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 3.6), sharey=True)
    for ax, case in zip(axes, ("even", "skewed"), strict=True):
        q = data["ratios"][case]
        x = range(len(STEPS))
        for j, name in enumerate(ROWS[1:3]):
            xs = [i + (j - 0.5) * 0.38 for i in x]
            ax.bar(xs, [q[name][s]["speedup"] for s in STEPS], 0.36, label=f"{name} measured")
            ax.scatter(xs, [q[name][s]["ceiling"] for s in STEPS], marker="_", s=400, color="k", zorder=3)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xticks(list(x), ["decode b=1", "decode b=8", "prefill 512"])
        ax.set_title("random router" if case == "even" else f"skewed router (+{data['skew']} on experts 0, 1)")
    top = max(v for c in data["ratios"].values() for n in c.values() for s in n.values() for v in s.values())
    axes[0].set_ylim(0, 1.3 * top)  # room for the legend above the bars and ceilings
    axes[0].set_ylabel("speed-up over tp=1 (bars); ceiling (black)")
    axes[0].legend(fontsize=8, loc="upper left", ncol=2)
    fig.suptitle("Mixtral-shaped MoE (fp32), tp=2 on one CPU host, 1 thread per rank (higher is better)")
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=DIR, help="where the checkpoint is written (once)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--repeats", type=int, default=1, help="timed prefills and generations per launch (after a warm-up)"
    )
    ap.add_argument(
        "--skew", type=float, default=2.0, help="added to experts 0 and 1's router logits in the skewed case"
    )
    ap.add_argument("--quick", action="store_true", help="1 round, to check the script works")
    ap.add_argument("--render", type=Path, help="print the tables and redraw --png from this JSON; measure nothing")
    ap.add_argument("--out", type=Path, default=Path("docs/benchmarks/bench_moe.json"))
    ap.add_argument("--png", default="docs/benchmarks/bench_moe.png", help="the plot ('' for none)")
    args = ap.parse_args()
    if args.render:
        data = json.loads(args.render.read_text())
    else:
        rounds = 1 if args.quick else args.rounds
        path = ensure_model(args.model)
        t0 = time.time()
        raw = _measure(path, rounds, args.repeats, args.skew)
        data = {
            **summarise(raw),
            "loads": raw["loads"],
            "backend": raw["backend"],
            "params": param_counts(),
            "rounds": rounds,
            "repeats": args.repeats,
            "skew": args.skew,
            "model": str(path),
            "config": CONFIG,
            "seconds": time.time() - t0,
            "machine": f"{platform.machine()}, torch {torch.__version__}",
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(data, indent=1))
    if args.png:
        _plot(data, Path(args.png))
    print(render(data))


if __name__ == "__main__":
    main()
