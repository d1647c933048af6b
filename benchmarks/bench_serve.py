"""Serving throughput and latency: `shardwise serve` on the benchmark model, N concurrent clients.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_serve.py [--layouts 1x1 2x1 1x2 2x1:gloo] [--clients 1 4 16]
        [--quantize fp16|int8]

For each layout, tp x pp on a backend (default `auto`, the server's default, shown with what it
resolved to; `2x1:gloo` names one), one server is started (--max-batch-size 16); for each client count,
that many clients each send `--requests` completions one after another (a prompt of
`--prompt-tokens` random token ids, `--max-tokens` greedy tokens, ignore_eos) and wait
for each answer. Throughput = generated tokens / wall time of the run; latency = one
request's wall time. Prints a Markdown table: tokens/s against tp=1 at the same number of
clients (tp=1 is measured in the same run), each pipeline stage's idle share of the run (from /metrics), and
for tp=1 x pp rows the ceiling (benchmarks/serve_ceiling.py: what pp stages computing at
once, with no serving overheads, gain over tp=1 at that many clients) and the share of it
reached. `--quantize` starts every server with weights in that format (`shardwise serve
--quantize`); benchmarks/bench_quant.py alternates fp32 and int8 servers through start().

The benchmark model (benchmarks/bench_model.py) has no tokenizer; its serving copy
links the weights and borrows the built-in model's tokenizer.json (prompts are token
ids, so the tokenizer only turns the output into text).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from bench_model import DEFAULT_DIR, ensure_bench_model  # noqa: E402
from serve_ceiling import ceiling  # noqa: E402

from shardwise.engine.text import DEFAULT_MODEL  # noqa: E402
from shardwise.launch import free_port  # noqa: E402
from shardwise.launch.env import resolve_backend  # noqa: E402


def serving_copy(src: Path) -> Path:
    dst = src.with_name(src.name + "-serve")
    dst.mkdir(exist_ok=True)
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        if (src / name).exists() and not (dst / name).exists():
            (dst / name).symlink_to(src / name)
    shutil.copy(DEFAULT_MODEL / "tokenizer.json", dst / "tokenizer.json")
    return dst


def start(
    model: Path, tp: int, backend: str, pp: int = 1, *, quantize: str | None = None
) -> tuple[subprocess.Popen, str]:
    """A server; backend "auto" passes no --backend (the server's default); quantize: the
    weights' format (None: the checkpoint's)."""
    port = free_port()
    cmd = [sys.executable, "-m", "shardwise", "serve", "--model", str(model), "--tp", str(tp), "--port", str(port)]
    cmd += ["--pp", str(pp)] if pp > 1 else []
    cmd += ["--max-batch-size", "16", "--max-queue", "256", "--health-timeout", "30"]
    cmd += [] if backend == "auto" else ["--backend", backend]
    cmd += ["--quantize", quantize] if quantize else []
    proc = subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"tp={tp} pp={pp}: the server did not start")


def stage_busy(url: str) -> list[float]:
    """Every pipeline stage's cumulative compute seconds, from /metrics (empty at pp=1)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    found = re.findall(r'shardwise_stage_busy_seconds_total\{stage="(\d+)"\} ([0-9.]+)', text)
    return [float(v) for _, v in sorted(found, key=lambda kv: int(kv[0]))]


def run(url: str, clients: int, requests: int, prompt_tokens: int, max_tokens: int) -> dict:
    rng = random.Random(clients)
    prompts = [[rng.randrange(2, 32000) for _ in range(prompt_tokens)] for _ in range(clients * requests)]
    latencies: list[float] = []
    tokens = 0

    def client(i: int) -> None:
        nonlocal tokens
        with httpx.Client(timeout=600) as http:
            for p in prompts[i * requests : (i + 1) * requests]:
                t0 = time.perf_counter()
                body = {"prompt": p, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
                r = http.post(f"{url}/v1/completions", json=body)
                r.raise_for_status()
                latencies.append(time.perf_counter() - t0)
                tokens += r.json()["usage"]["completion_tokens"]

    busy0 = stage_busy(url)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(client, range(clients)))
    wall = time.perf_counter() - t0
    busy1 = stage_busy(url)
    lat = sorted(latencies)
    return {
        "stage_idle": [round(1 - (b - a) / wall, 3) for a, b in zip(busy0, busy1, strict=True)],
        "tokens_per_s": tokens / wall,
        "p50": statistics.median(lat),
        "p99": lat[min(len(lat) - 1, round(0.99 * (len(lat) - 1)))],
        "requests": len(lat),
    }


def parse_layout(text: str) -> tuple[int, int, str]:
    """'2x1' -> (tp 2, pp 1, backend auto); '2x1:gloo' names the backend."""
    shape, _, backend = text.partition(":")
    tp, _, pp = shape.partition("x")
    return int(tp), int(pp or 1), backend or "auto"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=DEFAULT_DIR)
    ap.add_argument(
        "--layouts", nargs="+", default=["1x1", "2x1", "1x2", "2x1:gloo"],
        help="tp x pp[:backend] per server; backend auto (the server's default), gloo or mpi",
    )  # fmt: skip
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--requests", type=int, default=2, help="requests per client, one after another")
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--quantize", choices=["fp16", "int8"], help="every server's weights in this format")
    ap.add_argument("--json", type=Path, help="also write the rows here")
    ap.add_argument(
        "--no-ceiling", action="store_true",
        help="skip the ceiling of the pp > 1 rows (benchmarks/serve_ceiling.py: each stage's decode step, stages "
        "running at once, against tp=1's; no serving overheads)",
    )  # fmt: skip
    args = ap.parse_args()
    model = serving_copy(ensure_bench_model(args.model))
    rows = []
    for tp, pp, backend in map(parse_layout, args.layouts):
        proc, url = start(model, tp, backend, pp, quantize=args.quantize)
        try:
            run(url, 1, 1, args.prompt_tokens, 4)  # warm-up
            for c in args.clients:
                r = run(url, c, args.requests, args.prompt_tokens, args.max_tokens)
                rows.append((tp, pp, backend, c, r))
                print(f"tp={tp} pp={pp} backend={backend} clients={c}: {r}", file=sys.stderr)
        finally:
            proc.terminate()
            proc.wait(30)
    ceilings = {}
    if not args.no_ceiling:
        for pp in sorted({p for t, p, _ in map(parse_layout, args.layouts) if p > 1 and t == 1}):
            for c in args.clients:
                ceilings[(pp, c)] = ceiling(model, pp, c)
                print(f"ceiling pp={pp} clients={c}: {ceilings[(pp, c)]}", file=sys.stderr)
    if args.json:
        keys = ("tp", "pp", "backend", "clients")
        rows_out = [dict(zip(keys, row[:4], strict=True), quantize=args.quantize, **row[4]) for row in rows]
        args.json.write_text(json.dumps(rows_out, indent=1))
    print(
        "| tp | pp | backend | clients | requests | tokens/s | p50 latency s | p99 latency s | stage idle "
        "| tokens/s vs tp=1 | ceiling vs tp=1 | share of ceiling |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for tp, pp, backend, c, r in rows:
        tp1 = next((x for t, p, _, k, x in rows if (t, p) == (1, 1) and k == c), None)
        vs_tp1 = f"{r['tokens_per_s'] / tp1['tokens_per_s']:.2f}x" if tp1 else "-"
        shown = f"auto ({resolve_backend('auto')})" if backend == "auto" else backend
        idle = " / ".join(f"{x:.0%}" for x in r["stage_idle"]) or "-"
        ceil = ceilings.get((pp, c)) if tp == 1 else None
        ceil_text = f"{ceil['ratio']:.2f}x" if ceil else "-"
        share = f"{r['tokens_per_s'] / tp1['tokens_per_s'] / ceil['ratio']:.0%}" if ceil and tp1 else "-"
        print(
            f"| {tp} | {pp} | {shown} | {c} | {r['requests']} | {r['tokens_per_s']:.1f} | {r['p50']:.2f} "
            f"| {r['p99']:.2f} | {idle} | {vs_tp1} | {ceil_text} | {share} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
