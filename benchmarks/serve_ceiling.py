"""The most a tp=1 x pp server can gain over tp=1 here: each stage's decode step, timed with
every stage running at once (one process per stage, as the server runs them), against tp=1's.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/serve_ceiling.py --pp 2 --clients 16

With C clients, tp=1 decodes all C sequences in each step, while pp stages keep up to pp
steps in flight: the sequences form g = min(pp, C) groups of C / g, and a sequence's next
token comes after its group's pass through every stage, or after g of the slowest stage's
steps, whichever is longer (the planner's model). The ceiling is

    C / max(sum_s t_s(C / g), g * max_s t_s(C / g))   against   C / t_tp1(C)

with no scheduling, sampling, HTTP or messages: what the serving run's ratio is measured
against. On a CPU whose cores share one memory bus, and where a batch of C / pp rows
reads each weight as often per token as pp times fewer rows would, this ceiling can be
below 1: pipeline stages then add memory, not throughput.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_model import DEFAULT_DIR, ensure_bench_model  # noqa: E402

CONTEXT = 48  # cached positions when the timed steps start (prompt 32 + a few tokens)


def _stage_steps(path: str, pp: int, stage: int, batch: int, steps: int, barrier, out) -> None:
    import torch

    from shardwise.comm import LocalCommunicator
    from shardwise.engine.pipeline import stage_layout
    from shardwise.hf import load_pretrained, read_config

    torch.set_num_threads(1)
    _, cfg = read_config(path)
    layout = stage_layout(cfg, pp)
    model, _ = load_pretrained(path, comm=LocalCommunicator(), stage=(layout, stage))
    layers = model.layer_indices()
    caches = dict(zip(layers, model.new_caches(batch, CONTEXT + steps + 8), strict=True))
    first, last = stage == 0, stage == pp - 1
    g = torch.Generator().manual_seed(stage)
    ids = torch.randint(0, cfg.vocab_size, (batch, 1), generator=g)
    hidden = torch.randn(batch, 1, cfg.hidden_size, generator=g)
    times = []
    barrier.wait()
    with torch.no_grad():
        for i in range(steps):
            t0 = time.perf_counter()
            x, rope, mask = model.prelude(ids, None, None, True, CONTEXT + i, hidden=None if first else hidden)
            x = model.run_layers(x, rope, mask, caches, CONTEXT + i)
            if last:
                model.head(x, last_only=True)
            times.append(time.perf_counter() - t0)
    out.put((stage, statistics.median(times[2:])))


def stage_times(path: Path, pp: int, batch: int, steps: int = 24) -> list[float]:
    """Median seconds of one decode step of each of pp stages at `batch` rows, all stages
    running at once in their own processes (pp = 1: the whole model alone)."""
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(pp), ctx.Queue()
    procs = [ctx.Process(target=_stage_steps, args=(str(path), pp, s, batch, steps, barrier, out)) for s in range(pp)]
    for p in procs:
        p.start()
    found = dict(out.get(timeout=600) for _ in procs)
    for p in procs:
        p.join(60)
    return [found[s] for s in range(pp)]


def ceiling(path: Path, pp: int, clients: int, rounds: int = 3) -> dict:
    """tokens/s of tp=1 and of tp=1 x pp without serving overheads, and their ratio
    (medians over `rounds` interleaved measurements)."""
    groups = min(pp, clients)
    per = -(-clients // groups)
    tp1, staged = [], []
    for _ in range(rounds):
        tp1.append(clients / stage_times(path, 1, clients)[0])
        st = stage_times(path, pp, per)
        staged.append(clients / max(sum(st), groups * max(st)))
    a, b = statistics.median(tp1), statistics.median(staged)
    return {"tp1_tokens_per_s": a, "pp_tokens_per_s": b, "ratio": b / a, "rows_per_step": per}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=DEFAULT_DIR)
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16])
    args = ap.parse_args()
    path = ensure_bench_model(args.model)
    for c in args.clients:
        r = ceiling(path, args.pp, c)
        print(
            f"clients={c}: tp=1 {r['tp1_tokens_per_s']:.1f} tokens/s (batch {c}), pp={args.pp} "
            f"{r['pp_tokens_per_s']:.1f} (batch {r['rows_per_step']} per stage step): ceiling {r['ratio']:.2f}x"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
