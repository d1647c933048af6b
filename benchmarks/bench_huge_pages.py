"""Weights on transparent huge pages (shardwise.memory.empty_huge), against 4 KiB pages:
one row through the Q8_0 kernel alone, and decode of GGUF files with SHARDWISE_HUGE_PAGES=0
and =1 alternated in pairs (the VM this runs on changes speed for minutes at a time: a pair
shares its moment). docs/benchmarks/native-kernels.md, "Weights on transparent huge pages".

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_huge_pages.py \\
        --files /tmp/shardwise-bench/random-llama-1b-v2.q8_0.gguf /tmp/shardwise-bench/random-llama-1b-v2.q4_k_m.gguf \\
        --pairs 6 --out docs/benchmarks/huge_pages.json

Kernel: 16 Q8_0 matrices of Llama-3.2-1B's layer shapes (qkv 3h x h, o h x h, gate|up 8h x h,
down h x 4h; h 2048: 285 MB), one activation row through each with the native kernel
(lib.gemm, activations quantized once), one thread, GB/s of weight bytes, best of 10, in
three placements: an allocation per matrix (torch.empty), one allocation for all on 4 KiB
pages, one on huge pages. Decode: `shardwise generate --tp 1 --max-new-tokens 48 --json`,
its median decode step (ms/token), per file, off then on, --pairs times.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_native import _machine  # noqa: E402

H = 2048
SHAPES = ((3 * H, H), (H, H), (8 * H, H), (H, 4 * H))


def kernel_gbps(rounds: int = 3) -> dict[str, list[float]]:
    """GB/s of one row through the 16 matrices, per placement, each round's best of 10."""
    import torch

    from shardwise.kernels import native
    from shardwise.kernels.block import GGML_IDS, _fmt, quantize_activations
    from shardwise.kernels.quantize import quantize_rows
    from shardwise.memory import empty_huge

    if native.lib is None:
        raise SystemExit("the native kernels are not built here: nothing to measure")
    f = _fmt("Q8_0")
    mats = [(quantize_rows(torch.randn(256, c), "Q8_0").repeat(r // 256, 1), r, c) for _ in range(4) for r, c in SHAPES]
    total = sum(d.numel() for d, _, _ in mats)
    acts = {c: quantize_activations(torch.randn(1, c), 1, c, f.block) for c in {c for _, _, c in mats}}
    ys = {r: torch.empty(1, r) for r in {r for _, r, _ in mats}}

    def placed(buf: torch.Tensor | None) -> list:
        out, o = [], 0
        for d, r, c in mats:
            v = d.clone() if buf is None else buf[o : o + d.numel()].view(d.shape).copy_(d)
            out.append((v, r, c))
            o += d.numel()
        return out

    def run(ws) -> None:
        for d, r, c in ws:
            lib_args = (d.data_ptr(), d.stride(0), r, c // f.block, acts[c].data_ptr(), 1, ys[r].data_ptr(), r)
            native.lib.gemm(GGML_IDS["Q8_0"], native.isa(), *lib_args)

    placements = {
        "an allocation per matrix": lambda: placed(None),
        "one allocation, 4 KiB pages": lambda: placed(torch.empty(total, dtype=torch.uint8)),
        "one allocation, huge pages": lambda: placed(empty_huge((total,), torch.uint8)),
    }
    out: dict[str, list[float]] = {k: [] for k in placements}
    for _ in range(rounds):
        for name, make in placements.items():
            ws = make()
            times = []
            for _ in range(11):
                t0 = time.perf_counter()
                run(ws)
                times.append(time.perf_counter() - t0)
            out[name].append(round(total / min(times[1:]) / 1e9, 2))
            del ws
    return out


def decode_ms(path: str, huge: bool) -> float:
    env = {**os.environ, "SHARDWISE_HUGE_PAGES": "1" if huge else "0", "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, "-m", "shardwise", "generate", "--tp", "1", "--backend", "gloo", "--model", path,
            "--prompt-ids", "100,107,114,121,128,135,142,149", "--max-new-tokens", "48", "--ignore-eos", "--json"]  # fmt: skip
    done = subprocess.run(argv, env=env, capture_output=True, text=True, check=True, cwd=ROOT)
    return json.loads(done.stdout.strip().splitlines()[-1])["decode_ms_per_token"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--files", nargs="*", default=[], help="GGUF files to decode (none: the kernel only)")
    ap.add_argument("--pairs", type=int, default=6, help="off/on pairs per file")
    ap.add_argument("--out", type=Path, default=ROOT / "docs/benchmarks/huge_pages.json")
    a = ap.parse_args()
    start = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "load": os.getloadavg()}
    kernel = kernel_gbps()
    for name, v in kernel.items():
        print(f"kernel, {name:28s} {', '.join(f'{x:.1f}' for x in v)} GB/s", flush=True)
    decode = {}
    for path in a.files:
        pairs = [(decode_ms(path, False), decode_ms(path, True)) for _ in range(a.pairs)]
        off, on = [p[0] for p in pairs], [p[1] for p in pairs]
        decode[Path(path).name] = {"off_ms": off, "on_ms": on, "on_faster_pairs": sum(b < x for x, b in pairs),
                                   "median_off": statistics.median(off), "median_on": statistics.median(on)}  # fmt: skip
        d = decode[Path(path).name]
        print(f"{Path(path).name}: off {off}, on {on}: medians {d['median_off']:.1f} -> {d['median_on']:.1f} ms, "
              f"{d['on_faster_pairs']} of {len(pairs)} pairs faster on", flush=True)  # fmt: skip
    end = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "load": os.getloadavg()}
    a.out.write_text(json.dumps({"machine": _machine(), "start": start, "end": end, "command": " ".join(sys.argv),
                                 "kernel_gbps": kernel, "decode": decode}, indent=1) + "\n")  # fmt: skip


if __name__ == "__main__":
    main()
