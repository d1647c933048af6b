"""Decode on GGUF block formats computed as stored (shardwise.kernels), side by side with
llama.cpp on the same files and with the weight-streaming ceiling, in one run.

    .venv/bin/python benchmarks/bench_native.py [--layers 16] [--out docs/benchmarks/native.json]

Files: a Llama-3.2-1B-shaped model (benchmarks/bench_gguf.py's random Q8_0 file: hidden
2048, MLP 8192, 32/8 heads of 64, vocabulary 128256, tied), and the same weights re-quantized
by llama.cpp's own quantizer (llama-cpp-python's llama_model_quantize) to Q4_K_M and Q5_K_M.
shardwise: tp 1 and 2 (one process and one thread per rank), batch 1, 4 and 16 (prompts of
32 fixed ids; the median decode step of 16 after a warm-up). llama.cpp: batch 1, 1 and 2
threads (the median of 16 steps after a warm-up). Ceiling: the rank's weight bytes over the
memory bandwidth measured in the same run by that many processes each streaming their own
buffer of that size at once (ms/token if decode did nothing but read its weights once).
llama.cpp is for benchmarks only; it is never imported by shardwise or its tests.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from shardwise.comm import tp_only
from shardwise.launch import launch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gguf import PROMPT, SHAPE, make_file  # noqa: E402

NEW = 16
BATCHES = (1, 4, 16)


def _cpu() -> dict:
    info = Path("/proc/cpuinfo").read_text()
    model = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")), "?")
    flags = next((ln.split(":", 1)[1].split() for ln in info.splitlines() if ln.startswith("flags")), [])
    keep = [f for f in flags if f.startswith(("avx", "amx", "fma", "f16c"))]
    import torch

    from shardwise.kernels import native

    return {"model": model, "flags": keep, "torch": torch.backends.cpu.get_cpu_capability(),
            "kernels": native.describe(), "load": Path("/proc/loadavg").read_text().split()[:3],
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "python": platform.python_version()}  # fmt: skip


def quantized(python: str, src: Path, kind: str) -> Path:
    """`src` re-quantized by llama.cpp to `kind` (Q4_K_M, Q5_K_M), made once."""
    out = src.with_name(src.stem.replace("q8_0", kind.lower()) + ".gguf")
    if out.exists():
        return out
    code = (
        "import llama_cpp, sys;"
        "p = llama_cpp.llama_model_quantize_default_params();"
        f"p.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_{kind}; p.nthread = 2; p.allow_requantize = True;"
        f"sys.exit(llama_cpp.llama_model_quantize(b'{src}', b'{out}.tmp', p))"
    )
    subprocess.run([python, "-c", code], check=True)
    Path(f"{out}.tmp").rename(out)
    return out


def _decode_rank(world, path: str) -> dict:
    from shardwise.engine import generate
    from shardwise.hf import load_pretrained

    tp = tp_only(world)
    model, report = load_pretrained(path, comm=tp)
    out = {"bytes": report.param_bytes}
    for b in BATCHES:
        prompts = [[(t + 7 * i) % SHAPE["vocab"] for t in PROMPT] for i in range(b)]
        generate(model, prompts, comm=tp, max_new_tokens=4)  # warm-up
        out[b] = statistics.median(generate(model, prompts, comm=tp, max_new_tokens=NEW + 1).decode_ms)
    return out


def _stream_rank(world, nbytes: int) -> float:
    """Seconds to read `nbytes` of this process's own memory once (best of 5), every rank at once."""
    import torch

    buf = torch.ones(nbytes // 8, dtype=torch.int64)
    best = float("inf")
    for _ in range(5):
        world.barrier() if hasattr(world, "barrier") else None
        t0 = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t0)
    return best


LLAMA_SCRIPT = """
import statistics, sys, time
from llama_cpp import Llama
path, threads, prompt, new, vocab = sys.argv[1], int(sys.argv[2]), eval(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
llm = Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=128, verbose=False)
times = []
for r in range(2):  # the first is a warm-up
    llm.reset()
    llm.eval(prompt)
    for i in range(new):
        t0 = time.perf_counter()
        llm.eval([(11 * i + 500) % vocab])
        if r:
            times.append((time.perf_counter() - t0) * 1e3)
print(statistics.median(times))
"""


def llama_cpp(python: str, path: Path, threads: int) -> float:
    """llama.cpp's median decode ms on `path` (llama-cpp-python in the interpreter `python`)."""
    args = [python, "-c", LLAMA_SCRIPT, str(path), str(threads), repr(PROMPT), str(NEW), str(SHAPE["vocab"])]
    out = subprocess.run(args, check=True, capture_output=True, text=True, timeout=1800)
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--file", type=Path, default=Path("/tmp/shardwise-bench/random-llama-1b-v2.q8_0.gguf"))
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--formats", nargs="+", default=["Q8_0", "Q4_K_M", "Q5_K_M"])
    ap.add_argument("--out", type=Path, default=Path("docs/benchmarks/native.json"))
    ap.add_argument("--llama-python", default=sys.executable, help="an interpreter with llama-cpp-python installed")
    args = ap.parse_args()
    q8 = make_file(args.file, args.layers)
    files = {f: (q8 if f == "Q8_0" else quantized(args.llama_python, q8, f)) for f in args.formats}
    result = {"cpu": _cpu(), "rows": []}
    print(json.dumps(result["cpu"]), flush=True)
    for fmt, path in files.items():
        row = {"format": fmt, "file_bytes": path.stat().st_size}
        for tp in (1, 2):
            ranks = launch(_decode_rank, tp, args=(str(path),), timeout_s=1800)
            row[f"tp{tp}"] = {b: max(r[b] for r in ranks) for b in BATCHES}
            row[f"tp{tp}_bytes"] = max(r["bytes"] for r in ranks)
            secs = max(launch(_stream_rank, tp, args=(row[f"tp{tp}_bytes"],), timeout_s=600))
            row[f"tp{tp}_ceiling"] = secs * 1e3
            print(fmt, f"tp={tp}", row[f"tp{tp}"], f"ceiling {row[f'tp{tp}_ceiling']:.1f} ms", flush=True)
        for threads in (1, 2):
            row[f"llama_{threads}"] = llama_cpp(args.llama_python, path, threads)
            print(fmt, f"llama.cpp {threads} threads {row[f'llama_{threads}']:.1f} ms", flush=True)
        result["rows"].append(row)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
    print(report(result))


def report(result: dict) -> str:
    c = result["cpu"]
    lines = [f"CPU: {c['model']} ({' '.join(c['flags'])}; torch {c['torch']}; {c['kernels']}); "
             f"load {' '.join(c['load'])} at start; {c['date']}", "",
             "| file | MiB | rank MiB tp1 / tp2 | llama.cpp 1 t | 2 t | tp=1 b1 | tp=2 b1 | tp2/tp1 | ceiling tp1 / tp2 | "
             "tp=1 b4 | b16 | tp=2 b16 | b16 tokens/s over b1 |", "|" + "---|" * 13]  # fmt: skip
    for r in result["rows"]:
        t1, t2 = r["tp1"], r["tp2"]
        b = {k: v for k, v in t1.items()}
        lines.append(
            f"| {r['format']} | {r['file_bytes'] / 2**20:.0f} | {r['tp1_bytes'] / 2**20:.0f} / {r['tp2_bytes'] / 2**20:.0f} "
            f"| {r['llama_1']:.1f} | {r['llama_2']:.1f} | {b['1']:.1f} | {t2['1']:.1f} | {b['1'] / t2['1']:.2f}x "
            f"| {r['tp1_ceiling']:.1f} / {r['tp2_ceiling']:.1f} | {b['4']:.1f} | {b['16']:.1f} | {t2['16']:.1f} "
            f"| {16 * b['1'] / b['16']:.1f}x |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
