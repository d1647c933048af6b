"""fp32 weight order for decode (shardwise.quant.layout): a decode step with the weights as
loaded (row-major) against the same model after `decode_layout(model, rows=B)`, one process,
one thread, the two models taking turns step by step.

    env -u PYTHONDONTWRITEBYTECODE OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_layout.py \
        [--model /tmp/smol-shape] [--batches 1 2 4 16] [--steps 32]

Times are the thread CPU time of `decode_step` (median over steps): on a shared machine the
wall time moves with the neighbours, the thread time much less. Both models decode the same
prompt of 64 random ids from the same cache state; their logits must agree to 1e-4 (fp32
sums in another order) and their greedy tokens must be identical, or the run stops.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
PROMPT = 64


def measure(model_dir: str, batches: list[int], steps: int) -> dict:
    from shardwise.comm import LocalCommunicator
    from shardwise.engine.generate import decode_step, prefill
    from shardwise.hf import load_pretrained
    from shardwise.quant.layout import decode_layout

    torch.set_num_threads(1)
    comm = LocalCommunicator()
    out = {}
    for B in batches:
        models = {}
        for name in ("row-major", "decode_layout"):
            m, _ = load_pretrained(model_dir, comm=comm)
            moved = decode_layout(m, rows=B) if name == "decode_layout" else 0
            models[name] = (m.eval(), moved)
        ids = torch.randint(10, 40000, (B, PROMPT), generator=torch.Generator().manual_seed(B))  # (B, P)
        state, times = {}, {name: [] for name in models}
        with torch.no_grad():
            for name, (m, _) in models.items():
                caches = m.new_caches(B, PROMPT + steps + 1)
                prefill(m, ids, torch.ones_like(ids), caches)
                state[name] = [caches, ids[:, -1:]]
            for s in range(steps):
                logits = {}
                for name in models if s % 2 == 0 else reversed(models):
                    caches, tok = state[name]
                    c0 = time.thread_time()
                    logits[name] = decode_step(models[name][0], tok, None, caches, PROMPT + s)  # (B, V)
                    times[name].append((time.thread_time() - c0) * 1e3)
                a, b = logits.values()
                if not torch.allclose(a, b, rtol=1e-4, atol=1e-4):
                    raise SystemExit(f"batch {B}, step {s}: logits differ by {(a - b).abs().max():.2e}")
                nxt = [lg.argmax(-1, keepdim=True) for lg in logits.values()]  # (B, 1) each
                if not torch.equal(*nxt):
                    raise SystemExit(f"batch {B}, step {s}: greedy tokens differ")
                for name in models:
                    state[name][1] = nxt[0]
        med = {name: statistics.median(t) for name, t in times.items()}
        out[B] = {
            "row_major_ms": med["row-major"],
            "decode_layout_ms": med["decode_layout"],
            "weights_moved": models["decode_layout"][1],
            "change": med["decode_layout"] / med["row-major"] - 1,
        }
        print(f"batch {B}: {json.dumps(out[B])}", file=sys.stderr, flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a Llama checkpoint directory (default: make /tmp/smol-shape)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 16])
    ap.add_argument("--steps", type=int, default=32)
    args = ap.parse_args()
    if args.model is None:
        sys.path.insert(0, str(HERE))
        from make_smol_shape import ensure_smol_shape

        args.model = str(ensure_smol_shape())
    res = measure(args.model, args.batches, args.steps)
    print("| batch | weights re-strided | row-major ms/step | decode_layout ms/step | change |")
    print("|---|---|---|---|---|")
    for B, r in res.items():
        print(
            f"| {B} | {r['weights_moved']} | {r['row_major_ms']:.1f} | {r['decode_layout_ms']:.1f} | {r['change']:+.0%} |"
        )


if __name__ == "__main__":
    main()
