"""What the progress board costs on the hot path (shardwise.comm.progress).

    python benchmarks/bench_progress.py [--ops 5000] [--repeats 5]

1. In one process, no communication: the time Communicator._run adds per operation with a
   board attached (its heartbeat thread running) and without, on a communicator whose
   primitive does nothing: the bookkeeping alone, in nanoseconds.
2. Two ranks (tp=2) on gloo and on MPI: `--ops` in-place all-reduces of 256 floats (1 KiB,
   the size of one decode-step all-reduce of a hidden-256 model), with the board and with
   it detached, alternated `--repeats` times; the median microseconds per all-reduce.
3. dp=2 training on gloo (DistributedDataParallel, a 27M-parameter decoder, 8 layers x 512,
   two micro-batches of 2 x 128 tokens per step): ms per step with shardwise's comm hook
   (which notes each bucket's all-reduce with the dp Communicator) and with DDP's own,
   alternated `--repeats` times, 25 MB buckets; the median of each.

Prints one JSON object.
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

from shardwise.comm.dryrun import DryRunCommunicator  # noqa: E402
from shardwise.comm.progress import Board, DirSink  # noqa: E402
from shardwise.launch import launch  # noqa: E402


def bookkeeping_ns(ops: int, repeats: int) -> dict[str, float]:
    """ns per all_reduce_ of a communicator whose primitive returns at once, board on and off."""
    t = torch.zeros(256)
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for label in ("off", "on", "off", "on"):
            comm = DryRunCommunicator(2)
            comm.members = (0, 1)
            board = Board(0, 2, DirSink(tmp)).start() if label == "on" else None
            comm.attach_board(board)
            runs = []
            for _ in range(repeats):
                start = time.perf_counter_ns()
                for _ in range(ops):
                    comm.all_reduce_(t)
                runs.append((time.perf_counter_ns() - start) / ops)
            if board is not None:
                board.stop()
            out[label] = min(out.get(label, float("inf")), statistics.median(runs))
    return {"off_ns": round(out["off"], 1), "on_ns": round(out["on"], 1), "added_ns": round(out["on"] - out["off"], 1)}


def _all_reduces(world, ops: int, repeats: int) -> dict[str, float]:
    """Rank function: median us per 1 KiB in-place all-reduce, board on and detached."""
    board = world._board
    t = torch.ones(256)
    runs: dict[str, list[float]] = {"on": [], "off": []}
    for i in range(repeats):
        for label in ("on", "off") if i % 2 else ("off", "on"):
            world.attach_board(board if label == "on" else None)
            world.barrier()
            start = time.perf_counter()
            for _ in range(ops):
                world.all_reduce_(t)
            runs[label].append((time.perf_counter() - start) / ops * 1e6)
    return {k: statistics.median(v) for k, v in runs.items()}


MODEL = dict(
    vocab_size=2048,
    hidden_size=512,
    intermediate_size=1408,
    num_layers=8,
    num_heads=8,
    num_kv_heads=4,
    max_positions=128,
)


def _ddp_step_ms(world, tokens: str, out: str, own_hook: bool, steps: int) -> float:
    """Rank function: median ms per dp=2 training step (the first is warm-up)."""
    from shardwise.train import TrainConfig, setup, train_step

    if own_hook:  # DDP's default all-reduce: leave the comm hook unregistered
        torch.nn.parallel.DistributedDataParallel.register_comm_hook = lambda self, state, hook: None
    cfg = TrainConfig.from_dict(
        {
            "model": MODEL,
            "data": {"tokens": tokens, "seq_len": 128, "global_batch_size": 8, "micro_batch_size": 2},
            "optim": {"lr": 1e-3, "schedule": "constant"},
            "parallel": {"dp": 2, "dp_sync": "ddp", "timeout_s": 600},
            "run": {"steps": steps, "progress": False, "plot": False, "out_dir": out, "log_every": 1000},
        }
    )
    tr = setup(world, cfg)
    return 1e3 * statistics.median([train_step(tr).seconds for _ in range(steps)][1:])


def ddp_hook_ms(repeats: int) -> dict[str, float]:
    from shardwise.train import write_token_file

    runs: dict[str, list[float]] = {"shardwise_hook_ms": [], "ddp_own_hook_ms": []}
    with tempfile.TemporaryDirectory() as tmp:
        tokens = str(write_token_file(f"{tmp}/tokens.safetensors", torch.randint(0, 2048, (100_000,)), vocab_size=2048))
        for i in range(repeats):
            for own in (False, True) if i % 2 else (True, False):
                ms = max(launch(_ddp_step_ms, 2, args=(tokens, tmp, own, 5), timeout_s=600))
                runs["ddp_own_hook_ms" if own else "shardwise_hook_ms"].append(ms)
    out = {k: round(statistics.median(v), 1) for k, v in runs.items()}
    out["added_percent"] = round(100 * (out["shardwise_hook_ms"] / out["ddp_own_hook_ms"] - 1), 1)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ops", type=int, default=5000)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    result = {"bookkeeping": bookkeeping_ns(200_000, args.repeats), "all_reduce_1KiB_tp2": {}}
    for backend in ("gloo", "mpi"):
        ranks = launch(_all_reduces, 2, args=(args.ops, args.repeats), backend=backend, timeout_s=60)
        on, off = max(r["on"] for r in ranks), max(r["off"] for r in ranks)
        result["all_reduce_1KiB_tp2"][backend] = {
            "board_us": round(on, 2),
            "no_board_us": round(off, 2),
            "added_percent": round(100 * (on - off) / off, 1),
        }
    result["ddp_dp2_step"] = ddp_hook_ms(args.repeats)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
