"""A decode step through the paged KV cache (engine/paged.py) against the slot cache
(engine/slots.py): the same model, batch and history, the two caches taking turns step by
step in one process, one thread, thread CPU time (the machine may be shared).

    env -u PYTHONDONTWRITEBYTECODE OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_paged.py \
        [--model DIR] [--batches 1 4 16] [--past 64 512] [--steps 24]

Every step's logits of the two caches must agree to 1e-5, or the run stops.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch


def measure(model_dir: str | None, batches: list[int], pasts: list[int], steps: int) -> list[dict]:
    from shardwise.comm import LocalCommunicator
    from shardwise.engine.paged import BlockTables, PagedCaches, blocks_for
    from shardwise.engine.slots import SlotCaches, StepBatch
    from shardwise.engine.text import DEFAULT_MODEL
    from shardwise.hf import load_pretrained

    torch.set_num_threads(1)
    model, _ = load_pretrained(model_dir or DEFAULT_MODEL, comm=LocalCommunicator())
    vocab = model.cfg.vocab_size
    out = []
    for past in pasts:
        for B in batches:
            max_len = past + steps + 1
            slots = SlotCaches(model, B, max_len)
            paged = PagedCaches(model, B * blocks_for(max_len))
            tables = BlockTables(paged.num_blocks)
            g = torch.Generator().manual_seed(B)
            prompt = [(s, 0, torch.randint(2, vocab, (past,), generator=g).tolist()) for s in range(B)]
            tables.reserve({s: past for s in range(B)})
            slots.forward(model, StepBatch.build(prompt))
            paged.forward(model, StepBatch.build(prompt, tables=tables.rows(list(range(B)))))
            times: dict[str, list[float]] = {"slots": [], "paged": []}
            for i in range(steps):
                rows = [(s, past + i, [(7 * s + i) % vocab]) for s in range(B)]
                tables.reserve({s: past + i + 1 for s in range(B)})
                batches = {
                    "slots": StepBatch.build(rows),
                    "paged": StepBatch.build(rows, tables=tables.rows(list(range(B)))),
                }
                logits = {}
                for name in ("slots", "paged") if i % 2 == 0 else ("paged", "slots"):
                    cache = slots if name == "slots" else paged
                    c0 = time.thread_time()
                    logits[name] = cache.forward(model, batches[name])
                    times[name].append((time.thread_time() - c0) * 1e3)
                if not torch.allclose(logits["slots"], logits["paged"], rtol=1e-5, atol=1e-5):
                    raise SystemExit(f"batch {B}, past {past}, step {i}: the caches' logits differ")
            row = {
                "batch": B,
                "past": past,
                "slots_ms": statistics.median(times["slots"]),
                "paged_ms": statistics.median(times["paged"]),
            }
            print(row, file=sys.stderr, flush=True)
            out.append(row)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a checkpoint directory (default: the built-in model)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--past", type=int, nargs="+", default=[64, 448])
    ap.add_argument("--steps", type=int, default=24)
    args = ap.parse_args()
    rows = measure(args.model, args.batches, args.past, args.steps)
    print("| batch | cached tokens per sequence | slots ms/step | paged ms/step | paged / slots |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['batch']} | {r['past']} | {r['slots_ms']:.2f} | {r['paged_ms']:.2f} | {r['paged_ms'] / r['slots_ms']:.2f} |"
        )


if __name__ == "__main__":
    main()
