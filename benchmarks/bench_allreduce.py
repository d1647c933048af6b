"""The tp=2 all-reduce per call, through MPI, gloo and the shared-memory path over each
(shardwise.comm.shm), and the SmolLM2-shaped decode's ms/token with that path on and off.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_allreduce.py [--calls 2000] [--repeats 5] [--tokens 32]

Per backend, one job of fresh ranks (one thread each) builds its tp group twice, plain and
through shared memory; per size, the two take turns: `--repeats` runs each of `--calls`
back-to-back all-reduces (after a barrier). The figure is the best run's mean per call on
rank 0, in wall time (perf_counter) and thread time (thread_time); every result is checked
against the exact sum.

Decode: `shardwise.engine.generate` on the SmolLM2-135M shape (benchmarks/make_smol_shape.py,
random weights, fp32), batch 1, a 64-token prompt, greedy, --tokens new tokens; the median
decode step's wall time on rank 0, per run; both paths load the model in one job and take
turns, --rounds runs each. The tokens must be the same with the path on and off.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from make_smol_shape import ensure_smol_shape  # noqa: E402

from shardwise.comm import ParallelDims  # noqa: E402
from shardwise.comm.shm import ShmCommunicator  # noqa: E402
from shardwise.launch import launch  # noqa: E402

SIZES = [(1, 576), (1, 2048), (16, 576), (16, 2048)]
PROMPT = 64


def _tp(world, shm: str):
    tp = ParallelDims(world_size=world.size, tp=world.size).build(world, shm_allreduce=shm).tp
    if (shm == "on") != isinstance(tp, ShmCommunicator):
        raise RuntimeError(f"shm={shm} but the tp group is a {type(tp).__name__}")
    return tp


def _collective_rank(world, calls: int, repeats: int) -> dict[str, list[tuple[float, float]]]:
    """Per size, the backend's all-reduce and the shared-memory one take turns, repeat by repeat."""
    torch.set_num_threads(1)
    tps = {shm: _tp(world, shm) for shm in ("off", "on")}
    out: dict[str, list[tuple[float, float]]] = {shm: [] for shm in tps}
    for rows, width in SIZES:
        t = torch.randn(rows, width, generator=torch.Generator().manual_seed(world.rank))  # (rows, width)
        exact = world.all_gather(t.unsqueeze(0), dim=0).sum(0)  # (rows, width)
        runs: dict[str, list[tuple[float, float]]] = {shm: [] for shm in tps}
        for tp in tps.values():
            for _ in range(50):
                tp.all_reduce(t)
        for _ in range(repeats):
            for shm, tp in tps.items():
                tp.barrier()
                w0, c0 = time.perf_counter(), time.thread_time()
                for _ in range(calls):
                    got = tp.all_reduce(t)
                runs[shm].append(((time.perf_counter() - w0) / calls, (time.thread_time() - c0) / calls))
                if not torch.allclose(got, exact, rtol=1e-6, atol=1e-6):
                    raise RuntimeError(f"the all-reduce of {rows} x {width} (shm {shm}) is wrong on rank {tp.rank}")
        for shm in tps:
            out[shm].append(min(runs[shm]))
    return out


def _decode_rank(world, model: str, tokens: int, rounds: int) -> dict:
    """Both paths in one job, taking turns (so that the machine's load moves both alike)."""
    from shardwise.engine import generate
    from shardwise.hf import load_pretrained

    torch.set_num_threads(1)
    tps = {shm: _tp(world, shm) for shm in ("off", "on")}
    lms = {shm: load_pretrained(model, comm=tp)[0] for shm, tp in tps.items()}
    prompt = [(37 * i + 300) % lms["on"].cfg.vocab_size for i in range(PROMPT)]
    out: dict = {shm: {"ms": [], "tokens": None} for shm in tps}
    with torch.no_grad():
        for shm in tps:
            generate(lms[shm], [prompt], comm=tps[shm], max_new_tokens=4)  # warm up
        for _ in range(rounds):
            for shm, tp in tps.items():
                res = generate(lms[shm], [prompt], comm=tp, max_new_tokens=tokens)
                out[shm]["ms"].append(statistics.median(res.decode_ms))
                out[shm]["tokens"], out[shm]["comm"] = res.tokens[0], res.comm_per_step
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=32, help="decode: new tokens (0: skip the decode)")
    ap.add_argument("--rounds", type=int, default=3, help="decode: runs of each path, taking turns")
    ap.add_argument("--backend", nargs="+", default=["mpi", "gloo"])
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    report: dict = {"sizes": SIZES, "allreduce_us": {}, "decode_ms": {}}
    print("all-reduce at tp=2, us per call, best of repeats: wall / thread")
    print("| path | " + " | ".join(f"{r} x {w}" for r, w in SIZES) + " |")
    print("|" + "---|" * (len(SIZES) + 1))
    for backend in args.backend:
        both = launch(_collective_rank, 2, args=(args.calls, args.repeats), backend=backend)[0]
        for shm, figs in both.items():
            name = f"shm over {backend}" if shm == "on" else backend
            report["allreduce_us"][name] = [(1e6 * w, 1e6 * c) for w, c in figs]
            print(f"| {name} | " + " | ".join(f"{1e6 * w:.1f} / {1e6 * c:.1f}" for w, c in figs) + " |", flush=True)
    if args.tokens:
        model = str(ensure_smol_shape())
        print(f"\ndecode at tp=2, SmolLM2 shape fp32, {args.tokens} tokens, {args.rounds} rounds: ms/token (rank 0)")
        print("| backend | shm | best | median of rounds | all-reduces per step |")
        print("|---|---|---|---|---|")
        tokens = {}
        for backend in args.backend:
            r = launch(_decode_rank, 2, args=(model, args.tokens, args.rounds), backend=backend, timeout_s=600)[0]
            for shm, fig in r.items():
                tokens[(backend, shm)] = fig["tokens"]
                report["decode_ms"][f"{backend} shm={shm}"] = fig["ms"]
                calls = fig["comm"].get("all_reduce/tp", {}).get("calls")
                best, mid = min(fig["ms"]), statistics.median(fig["ms"])
                print(f"| {backend} | {shm} | {best:.2f} | {mid:.2f} | {calls} |", flush=True)
        if len({tuple(t) for t in tokens.values()}) != 1:
            raise SystemExit(f"the tokens differ between configurations: {tokens}")
        print("same tokens in every configuration")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
