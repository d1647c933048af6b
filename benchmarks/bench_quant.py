"""`--quantize` speed, side by side in ONE run: shardwise fp32 / fp16 / int8 at tp=1 and tp=2
against llama.cpp F32 / Q8_0 at 1 and 2 threads on the same weights, the weight-streaming
ceiling of each, and serving throughput with fp32 and int8 weights.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_quant.py [--rounds 5] [--serve-rounds 3] [--quick]
        [--models bench-156m smol-shape] [--no-serve]
    .venv/bin/python benchmarks/bench_quant.py --render docs/benchmarks/bench_quant.json   # the tables again

Models: the benchmark model (benchmarks/bench_model.py: 156M, hidden 1024, 8 layers, untied)
and a random-weight Llama of SmolLM2-135M's shape (benchmarks/make_smol_shape.py: 30 layers,
width 576, vocab 49152, tied), both fp32 Hugging Face checkpoints.

Decode (batch 1): ms per token of 32 greedy tokens after a 128-token prompt.
- shardwise: shardwise.bench.measure.generation_rank (`load_pretrained(..., quantize=)`),
  MPI, one thread per rank; fp32, fp16, int8 at tp=1 and tp=2; fp32 twice: in the weight
  order `generate` picks for one sequence (shardwise.quant.layout: column-major where
  measured faster) and as loaded (row-major, "fp32-rowmajor");
- llama.cpp (llama-cpp-python) on the same weights, written as GGUF by
  benchmarks/gguf_export.py (F32 and Q8_0), 1 and 2 threads, in a process of its own:
  after the same prompt, each token is fed with `llm.eval([tok])` and timed alone.
  Before any timing, llama.cpp's F32 logits of a short id sequence are compared with
  transformers' on the same checkpoint; the run stops if they differ by more than 1e-3
  (relative norm per position): a wrong conversion is never timed.
Every configuration is one launch; all of them run in every round, the order rotated each
round (the machine is shared: a noisy neighbour hits every row alike), and the report gives
the median over rounds of each launch's median step.

Ceiling: the bytes one rank (or llama.cpp as a whole) reads per decode token, in that
format: every linear weight it holds (the LM head included; the embedding table, read one
row a token, left out) plus its KV cache at the mean decode position (shardwise's cache is
fp32, llama.cpp's fp16); divided by the streaming bandwidth of one core, measured in the
same run with 1 or 2 cores streaming at once (the faster of a copy, counted as read + write
as benchmarks/bench_kernels.py does, and a read-only sum). ceiling ms = the busiest
rank's bytes / that bandwidth; fraction of ceiling = ceiling ms / measured ms.

Serving: benchmarks/bench_serve.py's server and clients, the benchmark model at tp=2 (MPI),
fp32 and int8 alternated over `--serve-rounds` rounds; tokens/s summed over 1, 4 and 16
concurrent clients (each sends 2 requests of 32 random prompt ids and 32 greedy tokens).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

# NOTE: torch is imported where it is used, never at the top: the llama.cpp worker runs this
# file too, and should load no second OpenMP runtime beside llama.cpp's
sys.path.insert(0, str(Path(__file__).parent))

GGUF_ROOT = Path("/tmp/shardwise-bench/gguf")
PROMPT, NEW = 128, 32
FORMATS = ("fp32", "fp32-rowmajor", "fp16", "int8")  # fp32-rowmajor: as loaded (quant/layout.py)
LLAMA_TYPES = {"f32": "F32", "q8_0": "Q8_0"}
Q8_0_BYTES = 34 / 32  # a block: an fp16 scale and 32 int8 weights
CHECK_TOKENS, CHECK_RTOL = 16, 1e-3
SERVE_CLIENTS = (1, 4, 16)


def _prompt(vocab: int, n: int = PROMPT) -> list[int]:
    """generation_rank's prompt (batch row 0), so that both engines decode after the same ids."""
    return [(31 * i + 3) % vocab for i in range(n)]


def _load() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


# ---- what runs on the shardwise ranks ---------------------------------------------------------
def _streamed_bytes(model, position: int) -> dict:
    """Bytes this rank reads per decode token: its linear weights (in their stored format) and
    its KV cache (keys and values of `position` earlier tokens)."""
    import torch

    from shardwise.quant.convert import LINEARS

    seen, weights = set(), 0
    for m in model.modules():
        w = getattr(m, "weight", None) if isinstance(m, LINEARS) else None
        if w is not None and id(w) not in seen:
            seen.add(id(w))
            weights += w.nbytes if not isinstance(w, torch.Tensor) else w.numel() * w.element_size()
    per_position = sum(c.k.nbytes + c.v.nbytes for c in model.new_caches(1, 1))
    return {"weights": weights, "kv": per_position * position}


def _decode_rank(world, path: str, quantize: str | None, repeats: int, layout: bool = True) -> dict:
    """generation_rank's decode times with the weights converted to `quantize` (fp32: in the
    order `generate` picks when `layout`, as loaded otherwise), and the bytes this rank
    streams per token."""
    import shardwise.hf
    from shardwise.bench.measure import generation_rank

    load, loaded = shardwise.hf.load_pretrained, []

    def keep(*args, **kwargs):
        loaded.append(load(*args, **kwargs))
        return loaded[-1]

    # NOTE: generation_rank imports load_pretrained from shardwise.hf when called; this keeps
    # a reference to the model it loads, for the bytes below
    shardwise.hf.load_pretrained = keep
    try:
        opts = {"model": path, "batch": 1, "prompt_len": PROMPT, "output_len": NEW, "repeats": repeats}
        gen = generation_rank(world, opts | {"quantize": quantize, "decode_layout": layout})
    finally:
        shardwise.hf.load_pretrained = load
    model, report = loaded[0]
    return {
        "decode_ms": statistics.median(gen["decode_ms"]),
        "decode_comm_ms": statistics.median(gen["decode_comm_ms"]),
        "bytes": _streamed_bytes(model, PROMPT + NEW // 2),
        "param_bytes": report.param_bytes,
    }


def _bandwidth_rank(world, nbytes: int) -> dict:
    """Bytes/s one core streams while every rank of `world` streams too: a copy (read + write
    counted, benchmarks/bench_kernels.py) and a read-only sum; each the best of 5."""
    import torch
    from bench_kernels import copy_bandwidth

    world.barrier()
    copy = copy_bandwidth(nbytes)
    src = torch.ones(nbytes // 4)
    world.barrier()
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        src.sum()
        best = min(best, time.perf_counter() - t)
    return {"copy": copy, "read": nbytes / best}


# ---- llama.cpp, in a process of its own -------------------------------------------------------
def _llama_worker(job: dict) -> dict:
    """Run in `python bench_quant.py --llama-worker JSON`: decode times, or (job["check"]) the
    logits of the first CHECK_TOKENS prompt ids, written to job["out"] as .npy."""
    from llama_cpp import Llama

    check = job.get("check", False)
    llm = Llama(
        model_path=job["path"],
        n_threads=job["threads"],
        n_threads_batch=job["threads"],
        n_ctx=PROMPT + NEW + 16,
        logits_all=check,
        verbose=False,
    )
    prompt = _prompt(llm.n_vocab())
    if check:
        llm.eval(prompt[:CHECK_TOKENS])
        np.save(job["out"], np.asarray(llm.scores[:CHECK_TOKENS], dtype=np.float32))
        return {}
    steps = [(7 * i + 11) % llm.n_vocab() for i in range(NEW)]
    times = []
    for r in range(job["repeats"] + 1):  # the first is a warm-up
        llm.reset()
        llm.eval(prompt)
        for tok in steps:
            t0 = time.perf_counter()
            llm.eval([tok])
            if r:
                times.append((time.perf_counter() - t0) * 1e3)
    return {"decode_ms": statistics.median(times)}


def _run_llama(job: dict) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(job["threads"])}
    cmd = [sys.executable, __file__, "--llama-worker", json.dumps(job)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if out.returncode:
        raise RuntimeError(f"llama.cpp worker {job} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _hf_logits(path: Path) -> np.ndarray:
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.tensor([_prompt(model.config.vocab_size, CHECK_TOKENS)])
    with torch.no_grad():
        return model(ids).logits[0].numpy()


def check_conversion(path: Path, ggufs: dict[str, Path]) -> dict:
    """llama.cpp's logits against transformers' for the first CHECK_TOKENS prompt ids: the
    largest relative difference (norm per position) for each GGUF type. Raises if F32's
    exceeds CHECK_RTOL."""
    ref = _hf_logits(path)
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for kind, gguf in ggufs.items():
            npy = str(Path(tmp) / f"{kind}.npy")
            _run_llama({"path": str(gguf), "threads": 2, "check": True, "out": npy})
            got = np.load(npy)
            rel = np.linalg.norm(got - ref, axis=-1) / np.linalg.norm(ref, axis=-1)
            out[kind] = float(rel.max())
    if not out["f32"] <= CHECK_RTOL:
        raise SystemExit(
            f"{path}: llama.cpp F32 logits differ from transformers' by {out['f32']:.2e} (relative, "
            f"worst position; wanted <= {CHECK_RTOL:g}): the GGUF conversion is wrong; no timings reported"
        )
    return out


# ---- the decode run ---------------------------------------------------------------------------
def _gguf_bytes(path: Path, kind: str, position: int) -> int:
    """Bytes llama.cpp reads per decode token: every 2-D weight but the embedding table (the
    head is the tied table when there is no output.weight), and its fp16 KV cache."""
    cfg = json.loads((path / "config.json").read_text())
    h, heads, layers = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_hidden_layers"]
    kv, inter, vocab = cfg.get("num_key_value_heads") or heads, cfg["intermediate_size"], cfg["vocab_size"]
    hd = cfg.get("head_dim") or h // heads
    n = layers * (2 * h * heads * hd + 2 * h * kv * hd + 3 * h * inter) + vocab * h
    per = 4 if kind == "f32" else Q8_0_BYTES
    return int(n * per) + layers * 2 * kv * hd * 2 * position


def _configurations(models: dict[str, Path], ggufs: dict) -> list[tuple]:
    rows = [("bandwidth", None, None, n) for n in (1, 2)]
    for name in models:
        rows += [("shardwise", name, fmt, tp) for fmt in FORMATS for tp in (1, 2)]
        if name in ggufs:
            rows += [("llama.cpp", name, kind, t) for kind in LLAMA_TYPES for t in (1, 2)]
    return rows


def measure_decode(models: dict[str, Path], ggufs: dict, rounds: int, repeats: int, bw_bytes: int) -> dict:
    """{configuration key: [one result per round]}, the order rotated each round."""
    from shardwise.launch import launch

    configs = _configurations(models, ggufs)
    runs: dict[str, list] = {}
    for r in range(rounds):
        k = r * len(configs) // rounds
        for engine, name, fmt, n in configs[k:] + configs[:k]:
            key = "|".join(str(x) for x in (engine, name, fmt, n))
            print(f"round {r + 1}/{rounds}: {key} (load {_load():.2f})", file=sys.stderr, flush=True)
            if engine == "bandwidth":
                res = launch(_bandwidth_rank, n, args=(bw_bytes,), backend="mpi", timeout_s=600)
            elif engine == "shardwise":
                quantize = None if fmt.startswith("fp32") else fmt
                args = (str(models[name]), quantize, repeats, fmt != "fp32-rowmajor")
                res = launch(_decode_rank, n, args=args, backend="mpi", timeout_s=600)
            else:
                res = _run_llama({"path": str(ggufs[name][fmt]), "threads": n, "repeats": repeats})
            runs.setdefault(key, []).append(res)
    return runs


def summarise_decode(runs: dict, models: dict[str, Path]) -> dict:
    """Medians over rounds; the ceiling and the fraction of it each row reaches."""
    bw = {}
    for n in (1, 2):
        per_round = runs[f"bandwidth|None|None|{n}"]
        bw[n] = {
            kind: statistics.median(min(rank[kind] for rank in ranks) for ranks in per_round)
            for kind in ("copy", "read")
        }
        bw[n]["ceiling"] = max(bw[n]["copy"], bw[n]["read"])
    rows = []
    for key, per_round in runs.items():
        engine, name, fmt, n = key.split("|")
        if engine == "bandwidth":
            continue
        n = int(n)
        ms = [x[0]["decode_ms"] if engine == "shardwise" else x["decode_ms"] for x in per_round]
        if engine == "shardwise":
            ranks = per_round[0]
            busiest = max(x["bytes"]["weights"] + x["bytes"]["kv"] for x in ranks)
            ceiling_ms = busiest / bw[n]["ceiling"] * 1e3
            extra = {
                "bytes_per_rank": [x["bytes"] for x in ranks],
                "param_bytes_per_rank": [x["param_bytes"] for x in ranks],
                "comm_ms": statistics.median(x[0]["decode_comm_ms"] for x in per_round),
            }
        else:
            total = _gguf_bytes(models[name], fmt, PROMPT + NEW // 2)
            ceiling_ms = total / (n * bw[n]["ceiling"]) * 1e3  # n threads, each streaming its share
            extra = {"bytes": total}
        med = statistics.median(ms)
        rows.append(
            dict(
                engine=engine,
                model=name,
                format=fmt if engine == "shardwise" else LLAMA_TYPES[fmt],
                parallel=n,
                decode_ms=med,
                best_ms=min(ms),
                rounds_ms=ms,
                ceiling_ms=ceiling_ms,
                fraction_of_ceiling=ceiling_ms / med,
                **extra,
            )
        )
    return {"bandwidth_bytes_per_s": bw, "rows": rows}


# ---- serving ----------------------------------------------------------------------------------
def measure_serving(model: Path, rounds: int, requests: int, clients: tuple[int, ...]) -> dict:
    """tokens/s at each client count, fp32 and int8 servers at tp=2 alternated over rounds."""
    import bench_serve

    served = bench_serve.serving_copy(model)
    runs: dict[str, dict[int, list]] = {"fp32": {}, "int8": {}}
    for r in range(rounds):
        for fmt in ("fp32", "int8") if r % 2 == 0 else ("int8", "fp32"):
            print(f"serve round {r + 1}/{rounds}: {fmt} (load {_load():.2f})", file=sys.stderr, flush=True)
            proc, url = bench_serve.start(served, 2, "auto", quantize=None if fmt == "fp32" else fmt)
            try:
                bench_serve.run(url, 1, 1, 32, 4)  # warm-up
                for c in clients:
                    runs[fmt].setdefault(c, []).append(bench_serve.run(url, c, requests, 32, 32))
            finally:
                proc.terminate()
                proc.wait(30)
    return {
        fmt: {
            str(c): {
                "tokens_per_s": statistics.median(x["tokens_per_s"] for x in rs),
                "p50_s": statistics.median(x["p50"] for x in rs),
                "rounds_tokens_per_s": [x["tokens_per_s"] for x in rs],
            }
            for c, rs in by_c.items()
        }
        for fmt, by_c in runs.items()
    }


# ---- the report -------------------------------------------------------------------------------
def _row(rows: list, engine: str, model: str, fmt: str, n: int) -> dict | None:
    return next(
        (r for r in rows if (r["engine"], r["model"], r["format"], r["parallel"]) == (engine, model, fmt, n)), None
    )


def targets(data: dict) -> list[dict]:
    rows, out = data["decode"]["rows"], []
    for model in data["models"]:
        ours, theirs = _row(rows, "shardwise", model, "fp32", 1), _row(rows, "llama.cpp", model, "F32", 1)
        if ours and theirs:
            ratio = ours["decode_ms"] / theirs["decode_ms"]
            out.append(
                dict(
                    target=f"{model}: fp32 tp=1 / llama.cpp F32 1 thread (ms)",
                    measured=ratio,
                    wanted="<= 1.2",
                    met=ratio <= 1.2,
                )
            )
        ours, theirs = _row(rows, "shardwise", model, "int8", 2), _row(rows, "llama.cpp", model, "Q8_0", 2)
        if ours and theirs:
            ratio = ours["decode_ms"] / theirs["decode_ms"]
            out.append(
                dict(
                    target=f"{model}: int8 tp=2 / llama.cpp Q8_0 2 threads (ms)",
                    measured=ratio,
                    wanted="<= 1.0",
                    met=ratio <= 1.0,
                )
            )
    serve = data.get("serving")
    if serve and "16" in serve.get("int8", {}):
        ratio = serve["int8"]["16"]["tokens_per_s"] / serve["fp32"]["16"]["tokens_per_s"]
        out.append(
            dict(target="serving, 16 clients: int8 / fp32 tokens/s", measured=ratio, wanted=">= 3.0", met=ratio >= 3.0)
        )
    return out


def render(data: dict) -> str:
    models, rows, bw = data["models"], data["decode"]["rows"], data["decode"]["bandwidth_bytes_per_s"]
    lines = [
        f"Run {data['date']}, {data['cpu']}, torch {data['torch']}, llama-cpp-python {data['llama_cpp_python']}; "
        f"{data['rounds']} rounds, load average {data['load_start']:.2f} at start, {data['load_end']:.2f} at end.",
        "",
        "Decode, batch 1, ms/token (median over rounds, best round in brackets); ceiling = bytes the busiest rank reads per token / one "
        "core's streaming bandwidth with that many cores streaming; fraction = ceiling / median.",
        "",
        "| engine | format | tp / threads | "
        + " | ".join(f"{m} ms/token | {m} ceiling ms | {m} fraction" for m in models)
        + " |",
        "|---|---|---|" + "---|---|---|" * len(models),
    ]
    keys = [("shardwise", f, n) for f in FORMATS for n in (1, 2)] + [
        ("llama.cpp", t, n) for t in LLAMA_TYPES.values() for n in (1, 2)
    ]
    for engine, fmt, n in keys:
        cells = []
        for m in models:
            r = _row(rows, engine, m, fmt, n)
            cells.append(
                f"{r['decode_ms']:.1f} ({r['best_ms']:.1f}) | {r['ceiling_ms']:.1f} | {r['fraction_of_ceiling']:.0%}"
                if r
                else "- | - | -"
            )
        what = f"tp={n}" if engine == "shardwise" else f"{n} thread{'s' if n > 1 else ''}"
        lines.append(f"| {engine} | {fmt} | {what} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Streaming bandwidth of one core (GB/s; copy counts read + write): "
        + "; ".join(
            f"{n} core{'s' if int(n) > 1 else ''} streaming: copy {b['copy'] / 1e9:.1f}, read {b['read'] / 1e9:.1f}"
            for n, b in bw.items()
        )
        + ". Conversion check, llama.cpp vs transformers logits (relative, worst of "
        f"{CHECK_TOKENS} positions): "
        + "; ".join(
            f"{m}: F32 {c['f32']:.1e}, Q8_0 {c['q8_0']:.1e}" for m, c in data.get("conversion_check", {}).items()
        )
        + ".",
    ]
    serve = data.get("serving")
    if serve:
        lines += [
            "",
            f"Serving, benchmark model, tp=2 (MPI), tokens/s summed over clients (median of {data['serve_rounds']} rounds):",
            "",
            "| clients | fp32 tokens/s | int8 tokens/s | int8 / fp32 |",
            "|---|---|---|---|",
        ]
        for c in serve["fp32"]:
            a, b = serve["fp32"][c]["tokens_per_s"], serve["int8"][c]["tokens_per_s"]
            lines.append(f"| {c} | {a:.1f} | {b:.1f} | {b / a:.2f}x |")
    lines += ["", "| target | measured | wanted | met |", "|---|---|---|---|"]
    for t in targets(data):
        lines.append(f"| {t['target']} | {t['measured']:.2f} | {t['wanted']} | {'yes' if t['met'] else 'NO'} |")
    return "\n".join(lines)


def _cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip() + f" ({os.cpu_count()} cores)"
    return platform.machine()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=2, help="32-token decodes per launch")
    ap.add_argument("--serve-rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=2, help="serving: requests per client, one after another")
    ap.add_argument("--no-serve", action="store_true")
    ap.add_argument("--models", nargs="+", choices=("bench-156m", "smol-shape"), default=["bench-156m", "smol-shape"])
    ap.add_argument(
        "--quick", action="store_true", help="1 round of 1 repeat, small bandwidth buffers: checks the script"
    )
    ap.add_argument("--out", type=Path, default=Path("docs/benchmarks/bench_quant.json"))
    ap.add_argument("--render", type=Path, help="print the tables of this JSON; measure nothing")
    ap.add_argument("--llama-worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.llama_worker:
        return print(json.dumps(_llama_worker(json.loads(args.llama_worker))))
    if args.render:
        return print(render(json.loads(args.render.read_text())))
    rounds, repeats, serve_rounds = (1, 1, 1) if args.quick else (args.rounds, args.repeats, args.serve_rounds)

    import llama_cpp
    import torch
    from bench_model import ensure_bench_model
    from gguf_export import ensure_gguf
    from make_smol_shape import ensure_smol_shape

    makers = {"bench-156m": ensure_bench_model, "smol-shape": ensure_smol_shape}
    models = {name: makers[name]() for name in args.models}
    ggufs = {name: {kind: ensure_gguf(path, kind, GGUF_ROOT) for kind in LLAMA_TYPES} for name, path in models.items()}
    checks = {name: check_conversion(models[name], ggufs[name]) for name in ggufs}
    print(f"conversion check: {checks}", file=sys.stderr)

    data = {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu": _cpu(),
        "torch": torch.__version__,
        "llama_cpp_python": llama_cpp.__version__,
        "load_start": _load(),
        "loadavg_start": Path("/proc/loadavg").read_text().split()[:3],
        "models": {name: str(p) for name, p in models.items()},
        "prompt_tokens": PROMPT,
        "decode_tokens": NEW,
        "rounds": rounds,
        "repeats": repeats,
        "serve_rounds": serve_rounds,
        "conversion_check": checks,
    }
    runs = measure_decode(models, ggufs, rounds, repeats, 64 * 2**20 if args.quick else 512 * 2**20)
    data["decode"] = summarise_decode(runs, models)
    if not args.no_serve:
        data["serving"] = measure_serving(makers["bench-156m"](), serve_rounds, args.requests, SERVE_CLIENTS)
    data["load_end"] = _load()
    data["loadavg_end"] = Path("/proc/loadavg").read_text().split()[:3]
    data["targets"] = targets(data)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(data, indent=1))
    print(render(data))


if __name__ == "__main__":
    main()
