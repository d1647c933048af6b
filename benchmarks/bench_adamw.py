"""AdamW on one CPU core: torch's per-operation loop (its CPU default), foreach, and the fused
kernel shardwise.train uses (train.optim.fused_ok); and with --profile, one rank's share of a
tp=2 training step of the 1B shape of benchmarks/bench_links.py --train-shape 1b (hidden
2048, its heads and MLP halved, 16 layers, half the 32000-token vocabulary, 2 micro-batches
of 1 x 128 tokens) in one process: forward, backward, clipping and the update, timed apart.
docs/benchmarks/links.md, "A 1B shape: a training step".

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_adamw.py --profile --out docs/benchmarks/adamw.json

ns per parameter of one update of 6 fp32 tensors of 2^24 elements (100M parameters, 1.6 GB
of weights, gradients and moments: beyond every cache), the best of 4 after one.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_native import _machine  # noqa: E402


def update_ns() -> dict[str, float]:
    import torch

    params = [torch.nn.Parameter(torch.randn(2**24)) for _ in range(6)]
    for p in params:
        p.grad = torch.randn_like(p)
    n = sum(p.numel() for p in params)
    out = {}
    for name, kw in (("loop (torch's CPU default)", {"foreach": False}), ("foreach", {"foreach": True}),
                     ("fused (shardwise.train)", {"fused": True})):  # fmt: skip
        opt = torch.optim.AdamW(params, lr=1e-4, **kw)
        opt.step()
        times = []
        for _ in range(4):
            t0 = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - t0)
        out[name] = round(min(times) / n * 1e9, 3)
        del opt
    return out


def profile_rank(steps: int = 3, fused_wgrad: bool = True) -> list[dict[str, float]]:
    """Seconds of each part of `steps` steps (the first allocates the moments). fused_wgrad: as
    shardwise.train runs it (kernels.wgrad: the weight gradients accumulated in their products,
    their buffers kept between steps); False: autograd's own linear backward."""
    import torch
    import torch.nn.functional as F

    from shardwise.comm import LocalCommunicator
    from shardwise.kernels import wgrad
    from shardwise.train.config import ModelSection, OptimSection
    from shardwise.train.layout import build_model
    from shardwise.train.optim import build_optimizer

    torch.manual_seed(0)
    cfg = ModelSection(vocab_size=16000, hidden_size=2048, intermediate_size=4096, num_layers=16, num_heads=16,
                       num_kv_heads=4, head_dim=64, tie_embeddings=True).model_config()  # fmt: skip
    model = build_model(cfg, LocalCommunicator(), init_std=0.02)  # the layers shardwise.train runs
    opt = build_optimizer(model, OptimSection())
    if fused_wgrad:
        wgrad.fuse(p for p in model.parameters() if p.dim() == 2)
    ids = torch.randint(0, cfg.vocab_size, (1, 128))
    out = []
    for _ in range(steps):
        t: dict[str, float] = {}
        wgrad.release(model.parameters())  # zero_grad(set_to_none=True), the fused path's buffers kept
        for mb in range(2):
            t0 = time.perf_counter()
            loss = F.cross_entropy(model(ids).flatten(0, 1), ids.flatten())  # (the head's logits: tp=1, whole)
            t1 = time.perf_counter()
            loss.backward()
            t[f"forward {mb}"], t[f"backward {mb}"] = t1 - t0, time.perf_counter() - t1
        t0 = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        t1 = time.perf_counter()
        opt.step()
        t["clip"], t["update"] = t1 - t0, time.perf_counter() - t1
        out.append({k: round(v, 3) for k, v in t.items()})
        print({**out[-1], "total": round(sum(t.values()), 2)}, flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--profile", action="store_true", help="also one rank's share of the 1B tp=2 step")
    ap.add_argument("--out", type=Path, default=ROOT / "docs/benchmarks/adamw.json")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument(
        "--wgrad",
        choices=["fused", "autograd", "both"],
        default="fused",
        help="the profile's linear backward: shardwise.train's (kernels.wgrad) or autograd's; both: one after the other in one process",
    )
    a = ap.parse_args()
    start = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "load": os.getloadavg()}
    ns = update_ns()
    for k, v in ns.items():
        print(f"AdamW, {k:28s} {v:.2f} ns a parameter", flush=True)
    prof = {}
    if a.profile:
        modes = ["fused", "autograd"] if a.wgrad == "both" else [a.wgrad]
        for mode in modes:
            print(f"one rank's share of the 1B tp=2 step, linear backward: {mode}", flush=True)
            prof[mode] = profile_rank(a.steps, fused_wgrad=mode == "fused")
    # the process's peak resident memory (with --wgrad both: the larger of the two; run one mode a process to compare)
    peak_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"peak resident memory {peak_gib:.2f} GiB", flush=True)
    a.out.write_text(json.dumps({"machine": _machine(), "start": start, "command": " ".join(sys.argv),
                                 "update_ns_per_param": ns, "rank_step_s": prof, "peak_rss_gib": peak_gib},
                                indent=1) + "\n")  # fmt: skip


if __name__ == "__main__":
    main()
