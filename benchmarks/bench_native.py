"""Decode on GGUF block formats computed as stored (shardwise.kernels), side by side with
llama.cpp on the same files and with the weight-streaming ceiling, in one run (issue 35).

The run for the record, on a quiet machine (nothing else running): 3.4 minutes with the files
in place (204 s, 2026-12-02 16:56 UTC, load 0.4 at its start and 2.6 at its end), about 3
more when the two K-quant files must be made first (96 s and 64 s here) and 10 s for the Q8_0:

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_native.py --out docs/benchmarks/native.json

    .venv/bin/python benchmarks/bench_native.py --table docs/benchmarks/native.json   # the tables again
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_native.py --launches 3 ...      # each figure the
                                                                 # median of 3 launches (a VM runs a whole
                                                                 # process fast or slow), about 3x the time
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_native.py --layers 2 --warm 1 --new 3 \\
        --out /tmp/native_small.json                                                 # every part, small

Files (in --dir, made once): a Llama-3.2-1B-shaped model (benchmarks/bench_gguf.py's random
Q8_0 file: hidden 2048, MLP 8192, 32/8 heads of 64, vocabulary 128256, tied; 16 layers, or
--layers), and the same weights re-quantized by llama.cpp's own quantizer (llama-cpp-python's
llama_model_quantize) to Q4_K_M and Q5_K_M. shardwise: tp 1 and 2 (one process and one
thread per rank, shardwise.launch). llama.cpp: 1 and 2 threads of one process
(benchmarks/llama_cpp_decode.py, run by --llama-python: llama-cpp-python lives in its own
venv and is never a dependency of shardwise; built for the CPU at hand, one build job, e.g.

    python3 -m venv /tmp/llamacpp/venv
    CMAKE_ARGS=-DGGML_NATIVE=ON CMAKE_BUILD_PARALLEL_LEVEL=1 nice -n 19 /tmp/llamacpp/venv/bin/pip install \\
        --no-binary llama-cpp-python llama-cpp-python==0.3.36 numpy

about 20 minutes on 2 shared cores). Both at batch 1, 4 and 16 (b prompts of 32
fixed ids, prompt i = ids + 7 i, greedy), each batch one generation: the median decode step
of --new steps after --warm. Two ceilings, each measured in the same run. Streaming: the rank's weight bytes over the memory bandwidth
measured in the same processes, every rank streaming its own buffer of that size at once
(best of 10): the ms a step would take if it did nothing but read its weights once. For
llama.cpp at t threads the ceiling of tp=t is shown (the same bytes, read by t cores).
int8: the step's multiply-accumulates (batch x every linear's weights, the tied LM head
included, over the ranks) at the rate one core does 8-bit products with nothing else to do
(benchmarks/int8_peak.c, built with the machine's gcc; the instruction the kernels' ISA
variant is built on; as many copies at once as ranks): the compute floor a batched step
cannot beat, which bounds what batch 16 can gain over batch 1.

Both engines also give the next-token argmax at each of the prompt's 32 positions and the
greedy tokens of batch 1, compared under the tables. Random weights give near-ties (top two
logits within 0.01), and both engines round activations to 8 bits on these formats, so a
position or two may differ: on Q4_K_M each engine's logits are 0.004 rms from the file's
float32 dequantization (logits 0.26 rms), and llama.cpp's argmax matches that float model at
all 32 positions, shardwise's at 31 (position 0, a 0.008 margin).
"""

from __future__ import annotations

import argparse
import json
import os
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

BATCHES = (1, 4, 16)
FORMATS = ("Q8_0", "Q4_K_M", "Q5_K_M")
LLAMA_VENV = Path("/tmp/llamacpp/venv/bin/python")
LLAMA_SCRIPT = Path(__file__).resolve().parent / "llama_cpp_decode.py"
PEAK_SOURCE = Path(__file__).resolve().parent / "int8_peak.c"
MiB = 2**20


def _machine() -> dict:
    info = Path("/proc/cpuinfo").read_text().splitlines()
    model = next((ln.split(":", 1)[1].strip() for ln in info if ln.startswith("model name")), "?")
    flags = next((ln.split(":", 1)[1].split() for ln in info if ln.startswith("flags")), [])
    import torch

    from shardwise.kernels import native

    return {
        "model": model,
        "cores": os.cpu_count(),
        "flags": [f for f in flags if f.startswith(("avx", "amx", "fma", "f16c"))],
        "torch": f"{torch.__version__} ({torch.backends.cpu.get_cpu_capability()})",
        "kernels": native.describe(),
        "isa": native.isa_name(),
        "python": platform.python_version(),
    }


def _now() -> dict:
    return {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "load": _load()}


def _load() -> list[str]:
    return Path("/proc/loadavg").read_text().split()[:3]


def q8_file(folder: Path, layers: int) -> Path:
    """The random Q8_0 file's path: bench_gguf's name at 16 layers, the layer count in it else."""
    return folder / ("random-llama-1b-v2.q8_0.gguf" if layers == 16 else f"random-llama-1b-v2-{layers}l.q8_0.gguf")


def macs_per_row(layers: int) -> int:
    """Multiply-accumulates of one token's decode step (every linear, the tied LM head too)."""
    from bench_gguf import _matrices

    return sum(rows * cols for _, rows, cols in _matrices(layers))  # the embedding is the LM head


def int8_peak(ranks: int, isa: str) -> float | None:
    """8-bit products a second of one core doing nothing else (benchmarks/int8_peak.c, the
    instruction `isa`'s kernels are built on), `ranks` copies at once, the slowest: the compute
    ceiling of a batched step, as the streaming buffer is its memory ceiling. None without gcc."""
    exe = Path("/tmp/shardwise-bench/int8_peak")
    try:  # built once a source version (every format and tp of a run measures again)
        if not exe.exists() or exe.stat().st_mtime < PEAK_SOURCE.stat().st_mtime:
            exe.parent.mkdir(parents=True, exist_ok=True)
            subprocess.run(["gcc", "-O2", "-o", str(exe), str(PEAK_SOURCE)], check=True, capture_output=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    procs = [subprocess.Popen([str(exe)], stdout=subprocess.PIPE, text=True) for _ in range(ranks)]
    rates = []
    for p in procs:
        fields = p.communicate(timeout=120)[0].split()
        rates.append(dict(zip(fields[::2], map(float, fields[1::2]), strict=True)).get(isa))
    return None if None in rates else min(rates)


def quantized(python: str, src: Path, kind: str) -> Path:
    """`src` re-quantized by llama.cpp to `kind` (Q4_K_M, Q5_K_M), made once (about a
    minute each on two cores)."""
    out = src.with_name(src.name.replace("q8_0", kind.lower()))
    if out.exists():
        return out
    tmp = Path(f"{out}.tmp")
    code = (
        "import llama_cpp, sys;"
        "p = llama_cpp.llama_model_quantize_default_params();"
        f"p.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_{kind}; p.nthread = 2; p.allow_requantize = True;"
        f"sys.exit(llama_cpp.llama_model_quantize({str(src).encode()!r}, {str(tmp).encode()!r}, p))"
    )
    print(f"making {out.name} with llama.cpp's quantizer", flush=True)
    subprocess.run([python, "-c", code], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    tmp.rename(out)
    return out


def _shardwise_rank(world, path: str, warm: int, new: int) -> dict:
    """One rank: prompt argmax, then one generation per batch size, then the stream timing."""
    import torch

    from shardwise.engine import generate
    from shardwise.hf import load_pretrained

    tp = tp_only(world)
    model, report = load_pretrained(path, comm=tp)
    with torch.no_grad():
        ids = torch.tensor([PROMPT])
        logits = model(ids, attention_mask=torch.ones_like(ids), caches=model.new_caches(1, len(PROMPT)), start=0)
    out = {"bytes": report.param_bytes, "argmax": logits[0].argmax(-1).tolist(), "ms": {}}  # logits (1, L, V)
    generate(model, [PROMPT[:4]], comm=tp, max_new_tokens=2)  # the kernels' first calls
    for b in BATCHES:
        prompts = [[(t + 7 * i) % SHAPE["vocab"] for t in PROMPT] for i in range(b)]
        r = generate(model, prompts, comm=tp, max_new_tokens=warm + new + 1)
        out["ms"][str(b)] = statistics.median(r.decode_ms[warm:])
        if b == 1:
            out["greedy"] = r.tokens[0]
    del model
    buf = torch.ones(report.param_bytes // 8, dtype=torch.int64)  # this rank's weight bytes
    best = float("inf")
    for _ in range(10):
        world.barrier()  # every rank streams at once, as in a decode step
        t0 = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t0)
    out["ceiling_ms"] = best * 1e3
    return out


def shardwise(path: Path, tp: int, warm: int, new: int, launches: int = 1) -> dict:
    """`launches` launches of the ranks; each figure the median over them of the slowest rank's."""
    runs = []
    for _ in range(launches):
        ranks = launch(_shardwise_rank, tp, args=(str(path), warm, new), timeout_s=1800)
        runs.append({
            "ms": {b: max(r["ms"][b] for r in ranks) for b in ranks[0]["ms"]},  # the slowest rank's step
            "bytes": max(r["bytes"] for r in ranks),
            "ceiling_ms": max(r["ceiling_ms"] for r in ranks),
            "argmax": ranks[0]["argmax"],
            "greedy": ranks[0]["greedy"],
        })  # fmt: skip
    return _median_of(runs)


def _median_of(runs: list[dict]) -> dict:
    """The first run's answers; its ms (and ceiling) the median over the runs, each run's kept."""
    out = dict(runs[0])
    if len(runs) > 1:
        out["ms"] = {b: statistics.median(r["ms"][b] for r in runs) for b in runs[0]["ms"]}
        if "ceiling_ms" in out:
            out["ceiling_ms"] = statistics.median(r["ceiling_ms"] for r in runs)
        out["launches_ms"] = [r["ms"] for r in runs]
    return out


def llama_cpp(python: str, path: Path, threads: int, warm: int, new: int, launches: int = 1) -> dict:
    """llama.cpp's decode steps on `path` (benchmarks/llama_cpp_decode.py under `python`), the
    median of `launches` processes as shardwise()."""
    args = [python, str(LLAMA_SCRIPT), str(path), "--threads", str(threads), "--warm", str(warm), "--new", str(new)]
    args += ["--batches", *map(str, BATCHES), "--prompt", *map(str, PROMPT)]
    runs = []
    for _ in range(launches):
        out = subprocess.run(args, capture_output=True, text=True, timeout=1800)
        if out.returncode != 0:
            raise RuntimeError(
                f"llama.cpp on {path.name} at {threads} threads: exit {out.returncode}\n{out.stderr[-3000:]}"
            )
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    return _median_of(runs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, default=Path("/tmp/shardwise-bench"), help="where the files are made")
    ap.add_argument("--layers", type=int, default=16, help="16 is Llama-3.2-1B; fewer for a quick check")
    ap.add_argument("--formats", nargs="+", default=list(FORMATS), choices=FORMATS)
    ap.add_argument("--warm", type=int, default=3, help="decode steps left out of each median")
    ap.add_argument("--new", type=int, default=16, help="decode steps in each median")
    ap.add_argument("--launches", type=int, default=1,
                    help="launches of each engine and tp/threads; each figure their median (this VM runs a "
                    "whole process fast or slow)")  # fmt: skip
    ap.add_argument("--out", type=Path, default=Path("docs/benchmarks/native.json"))
    ap.add_argument("--llama-python", default=str(LLAMA_VENV if LLAMA_VENV.exists() else sys.executable),
                    help="an interpreter with llama-cpp-python (default: /tmp/llamacpp/venv's)")  # fmt: skip
    ap.add_argument("--table", type=Path, help="print the tables of an earlier run's JSON and stop")
    args = ap.parse_args()
    if args.table:
        print(report(json.loads(args.table.read_text())))
        return
    t0 = time.perf_counter()
    q8 = make_file(q8_file(args.dir, args.layers), args.layers)
    files = {f: (q8 if f == "Q8_0" else quantized(args.llama_python, q8, f)) for f in args.formats}
    result = {"machine": _machine(), "start": _now(), "layers": args.layers, "warm": args.warm, "new": args.new}
    result["launches"] = args.launches
    result["macs_per_row"] = macs_per_row(args.layers)
    result |= {"command": " ".join(sys.argv), "files_s": time.perf_counter() - t0, "rows": []}
    print(json.dumps(result), flush=True)
    for fmt, path in files.items():
        with path.open("rb") as f:  # into the page cache, for every engine alike
            while f.read(1 << 26):
                pass
        row = {"format": fmt, "file": path.name, "file_bytes": path.stat().st_size, "shardwise": {}, "llama": {}}
        for tp in (1, 2):
            row["shardwise"][str(tp)] = r = shardwise(path, tp, args.warm, args.new, args.launches)
            r["int8_macs_per_s"] = int8_peak(tp, result["machine"]["isa"])
            print(fmt, f"shardwise tp={tp}", {b: round(ms, 1) for b, ms in r["ms"].items()},
                  f"ceiling {r['ceiling_ms']:.1f} ms", flush=True)  # fmt: skip
        for threads in (1, 2):
            row["llama"][str(threads)] = r = llama_cpp(
                args.llama_python, path, threads, args.warm, args.new, args.launches
            )
            print(fmt, f"llama.cpp {threads} threads", {b: round(ms, 1) for b, ms in r["ms"].items()}, flush=True)
        result["rows"].append(row)
        result["end"] = _now()
        result["wall_s"] = time.perf_counter() - t0
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
    print(report(result))


def _same(a: list[int], b: list[int]) -> str:
    """'31/32 the same, the first difference at 0' for two token lists."""
    pairs = list(zip(a, b, strict=False))
    first = next((i for i, (x, y) in enumerate(pairs) if x != y), None)
    where = "" if first is None else f", the first difference at {first}"
    return f"{sum(x == y for x, y in pairs)}/{len(pairs)} the same{where}"


def report(result: dict) -> str:
    """Markdown: the machine and run, then one table per file and its targets (issue 35)."""
    n = result.get("launches", 1)
    launches = f", each figure the median of {n} launches" if n > 1 else ""
    m, s, e = result["machine"], result["start"], result.get("end", result["start"])
    llama_sys = next((r["llama"]["1"]["system"] for r in result["rows"] if "1" in r["llama"]), "?")
    lines = [
        f"CPU: {m['model']}, {m['cores']} cores; flags {' '.join(m['flags'])}",
        f"torch {m['torch']}; {m['kernels']}; llama.cpp: {llama_sys}",
        f"{s['date']} to {e['date']} ({result.get('wall_s', 0) / 60:.1f} min, "
        f"{result.get('files_s', 0) / 60:.1f} of them making or finding the files); load average "
        f"{' '.join(s['load'])} at the start, {' '.join(e['load'])} at the end",
        f"{result['layers']} layers; each median of {result['new']} decode steps after {result['warm']}{launches}; "
        f"`{result.get('command', '')}`",
    ]
    for r in result["rows"]:
        sw, ll = r["shardwise"], r["llama"]
        lines += ["", f"### {r['format']} ({r['file']}, {r['file_bytes'] / MiB:.0f} MiB)", ""]
        lines += [
            "| engine | ranks x threads | batch | ms/step | tokens/s | speed vs llama.cpp, same threads and batch "
            "| streaming ceiling ms | int8 ceiling ms | fraction of the higher |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for name, runs in (("shardwise", sw), ("llama.cpp", ll)):
            for n, run in runs.items():
                ceiling = sw.get(n, {}).get("ceiling_ms")
                for b, ms in run["ms"].items():
                    ref = ll.get(n, {}).get("ms", {}).get(b)
                    vs = f"{ref / ms:.2f}x" if name == "shardwise" and ref else "-"
                    shape = f"{n} x 1" if name == "shardwise" else f"1 x {n}"
                    floor = compute_ms(result, sw.get(n, {}), int(n), int(b))
                    top = max(ceiling or 0.0, floor or 0.0)
                    frac = f"{top / ms:.2f}" if top else "-"
                    ceil = f"{ceiling:.1f}" if ceiling else "-"
                    fl = f"{floor:.1f}" if floor else "-"
                    lines.append(
                        f"| {name} | {shape} | {b} | {ms:.1f} | {int(b) * 1e3 / ms:.1f} | {vs} | {ceil} | {fl} | {frac} |"
                    )
        lines.append("")
        lines.append(f"Rank weight MiB: tp=1 {sw['1']['bytes'] / MiB:.0f}, tp=2 {sw['2']['bytes'] / MiB:.0f}.")
        for n in ("1", "2"):
            if n in sw and n in ll:
                lines.append(
                    f"Agreement, shardwise tp={n} vs llama.cpp {n} threads: prompt argmax "
                    f"{_same(sw[n]['argmax'], ll[n]['argmax'])}, batch-1 greedy tokens {_same(sw[n]['greedy'], ll[n]['greedy'])}."
                )
        lines += ["", "Targets:"] + [f"- {t}" for t in targets(r, result)]
    return "\n".join(lines)


def compute_ms(result: dict, run: dict, ranks: int, batch: int) -> float | None:
    """The int8 ceiling of a step: its rank's multiply-accumulates at the core's int8 peak
    measured beside the run (each of `ranks` cores computes 1/ranks of them)."""
    peak, macs = run.get("int8_macs_per_s"), result.get("macs_per_row")
    return batch * macs / ranks / peak * 1e3 if peak and macs else None


def targets(r: dict, result: dict) -> list[str]:
    """Issue 35's speed targets on one file, each with its numbers and met / not met; the
    batch-16 one beside the most the two ceilings allow with batch 1 as measured."""
    sw, ll = r["shardwise"], r["llama"]

    def ok(good: bool) -> str:
        return "met" if good else "**not met**"

    out = []
    for b in sw["1"]["ms"]:
        t1, t2 = sw["1"]["ms"][b], sw["2"]["ms"][b]
        out.append(f"batch {b}: tp=2 {t1 / t2:.2f}x tp=1 (target >= 1.5x): {ok(t1 / t2 >= 1.5)}")
    for n in ("1", "2"):
        for b, ms in sw[n]["ms"].items():
            ref = ll.get(n, {}).get("ms", {}).get(b)
            if ref:
                out.append(
                    f"batch {b}: tp={n} {ms:.1f} ms against llama.cpp {n} threads {ref:.1f} ms "
                    f"(target: no slower): {ok(ms <= ref)}"
                )
    for n in ("1", "2"):
        ms = sw[n]["ms"]
        if "1" in ms and "16" in ms:
            gain = 16 * ms["1"] / ms["16"]
            top = max(compute_ms(result, sw[n], int(n), 16) or 0.0, sw[n].get("ceiling_ms") or 0.0)
            bound = f"; the ceilings allow at most {16 * ms['1'] / top:.1f}x" if top else ""
            out.append(f"tp={n}: batch 16 {gain:.1f}x the tokens/s of batch 1 (target >= 6x{bound}): {ok(gain >= 6)}")
    return out


if __name__ == "__main__":
    main()
