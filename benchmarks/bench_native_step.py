"""The native decode step (shardwise.kernels.step) against the per-op path it replaces, at tp 1
and 2, beside llama.cpp on the same GGUF files and the weight-streaming ceiling, in one run
(issue 36). Where a step's time goes, per rank, from the program's own clocks.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_native_step.py \\
        --models /tmp/smol/smollm2.q8_0.gguf /tmp/smol-shape --quantize none int8 \\
        --tp 1 2 --step on off --llama --out docs/benchmarks/native_step.json
    .venv/bin/python benchmarks/bench_native_step.py --table docs/benchmarks/native_step.json

--models: GGUF files (their own formats) and Hugging Face directories (converted by each
--quantize; a GGUF file takes none). Each configuration runs in fresh ranks (shardwise.launch,
one thread each): load, a 32-token prompt, --warm decode steps, then --steps timed ones as
generate() runs them (decode_step, rank 0's argmax, the token broadcast, tolist), at --batch
prompts (1 by default; prompt i is the ids + 7 i, modulo the vocabulary).
Per rank, ms per step (medians of wall and thread time; the program's parts as means):

    wall, cpu      the whole step
    linears, attention, other
                   inside the program (SHARDWISE_STEP_PROFILE's clocks): the projections, the
                   attention, and the norms, activation quantization, gated activation and
                   residual adds between them
    allreduce      inside the program's all-reduces (copy in, spin for the peer, sum), and of
    spin           that, spinning for the peer
    wait           waiting for a peer later than SPIN_NS, in Python (wall time, not in the rest)
    head           the LM head (at tp > 1 with its all-gather of the logits), thread time
    python         the forward's thread time less the program and the head: embedding, final
                   norm, Python (with the program off: the whole forward but the head)
    sample+bcast   rank 0's argmax and the token broadcast
    ops/layer      top-level aten ops and native calls a step makes, over the layers
                   (torch.profiler, one extra pass of the same steps)
    ceiling        this rank's weight bytes over the memory bandwidth measured in the same
                   processes (every rank streaming a buffer of that size at once, best of 10)

--llama: llama.cpp (llama-cpp-python, benchmarks/llama_cpp_decode.py under --llama-python) on
each GGUF file at 1 and 2 threads, batch 1, the same prompt.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from shardwise.comm import tp_only
from shardwise.launch import launch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode_step import OPS, _Profiled  # noqa: E402
from bench_native import LLAMA_VENV, _machine, _now, llama_cpp  # noqa: E402

PROMPT = [(37 * i + 300) % 49152 for i in range(32)]
PARTS = ("linears", "attention", "other", "allreduce", "spin", "wait")


def _rank(world, opts: dict) -> dict:
    from torch.profiler import ProfilerActivity, profile

    from shardwise.engine.generate import decode_step, prefill
    from shardwise.hf import load_pretrained
    from shardwise.kernels import native, step

    torch.set_num_threads(1)
    step.ENABLED, step.PROFILE = opts["step"], True
    tp = tp_only(world)
    model, report = load_pretrained(opts["model"], comm=tp, quantize=opts["quantize"])
    batch = opts["batch"]
    vocab = model.cfg.vocab_size  # the ids wrap around a vocabulary smaller than them (the built-in model's 512)
    ids = torch.tensor([[(t + 7 * i) % vocab for t in PROMPT] for i in range(batch)])  # prompt i = ids + 7 i
    n = opts["warm"] + 2 * opts["steps"] + 1
    caches = model.new_caches(batch, len(PROMPT) + n)
    rows = []

    def one(tok: torch.Tensor, pos: int) -> torch.Tensor:
        c0, w0 = time.thread_time(), time.perf_counter()
        logits = decode_step(model, tok.view(batch, 1), None, caches, pos)  # (B, V)
        c1, w1 = time.thread_time(), time.perf_counter()
        nxt = logits.argmax(-1) if tp.rank == 0 else torch.empty(batch, dtype=torch.long)
        nxt = tp.broadcast(nxt, src=0)
        nxt.tolist()
        c2, w2 = time.thread_time(), time.perf_counter()
        rows.append((w2 - w0, c2 - c0, c1 - c0, w2 - w1))
        return nxt

    def times() -> dict:
        progs = [e.program for e in model.__dict__.get("_step_programs", {}).values() if e]
        return {k: sum(p.times[k] for p in progs) for k in PARTS}

    head = [0.0]  # thread time in the LM head (final norm excluded; at tp > 1 with its gather)
    lm_forward = model.lm_head.forward

    def timed_head(x):
        c = time.thread_time()
        try:
            return lm_forward(x)
        finally:
            head[0] += time.thread_time() - c

    model.lm_head.forward = timed_head
    tokens = []
    with torch.no_grad():
        tok = tp.broadcast(prefill(model, ids, torch.ones_like(ids), caches).argmax(-1), src=0)
        pos = len(PROMPT)
        for s in range(opts["warm"] + opts["steps"]):
            if s == opts["warm"]:
                rows.clear()
                t0, head[0] = times(), 0.0
            tok, pos = one(tok, pos), pos + 1
            tokens.append(tok.tolist())
        t1, head_s = times(), head[0]
        timed = list(rows)
        real_lib = native.lib
        native.lib = _Profiled(real_lib) if real_lib is not None else None
        try:
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(4):
                    tok, pos = one(tok, pos), pos + 1
        finally:
            native.lib = real_lib
    top = sum(1 for e in prof.events() if e.name.startswith(OPS) and not _nested(e))
    refused, layers = model.__dict__.get("_step_refused"), model.cfg.num_layers
    model = caches = None  # the weights' memory back before the bandwidth buffer
    buf = torch.ones(report.param_bytes // 4)  # fp32: torch's sum streams it faster than int64 here
    best = float("inf")
    for _ in range(10):
        world.barrier()
        t = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t)
    steps = opts["steps"]
    return {
        "wall": 1e3 * statistics.median(r[0] for r in timed),
        "cpu": 1e3 * statistics.median(r[1] for r in timed),
        "fwd_cpu": 1e3 * statistics.mean(r[2] for r in timed),
        "sample_bcast": 1e3 * statistics.median(r[3] for r in timed),
        "head": 1e3 * head_s / opts["steps"],
        **{k: (t1[k] - t0[k]) / steps / 1e6 for k in PARTS},
        "ops_per_layer": top / 4 / layers,
        "bytes": report.param_bytes,
        "ceiling": best * 1e3,
        "tokens": tokens,
        "refused": refused if opts["step"] else None,
    }


def _nested(e) -> bool:
    p = e.cpu_parent
    while p is not None:
        if p.name.startswith(OPS):
            return True
        p = p.cpu_parent
    return False


def run(args) -> dict:
    out = {"machine": _machine(), "start": _now(), "shardwise": [], "llama": []}
    for model in args.models:
        quants = ["none"] if model.endswith(".gguf") else args.quantize
        for q in quants:
            for tp in args.tp:
                for st in args.step:
                    opts = {"model": model, "quantize": None if q == "none" else q, "step": st == "on",
                            "warm": args.warm, "steps": args.steps, "batch": args.batch}  # fmt: skip
                    ranks = launch(_rank, tp, args=(opts,), timeout_s=1800)
                    row = {"model": Path(model).name, "quantize": q, "tp": tp, "step": st, "batch": args.batch,
                           "ranks": ranks}  # fmt: skip
                    out["shardwise"].append(row)
                    r0 = ranks[0]
                    print(f"{row['model']} {q} tp={tp} step {st} batch {args.batch}: {r0['wall']:.2f} ms/step "
                          f"(ceiling {max(r['ceiling'] for r in ranks):.2f}){' ' + r0['refused'] if r0['refused'] else ''}",
                          flush=True)  # fmt: skip
        if args.llama and model.endswith(".gguf"):
            for threads in (1, 2):
                r = llama_cpp(args.llama_python, Path(model), threads, args.warm, args.steps)
                out["llama"].append(
                    {"model": Path(model).name, "threads": threads, "ms": r["ms"]["1"], "greedy": r["greedy"]}
                )
                print(f"{Path(model).name} llama.cpp {threads} threads: {r['ms']['1']:.2f} ms/token", flush=True)
    out["end"] = _now()
    return out


def table(res: dict) -> str:
    m = res["machine"]
    lines = [f"Machine: {m['model']}, {m['cores']} cores; flags {' '.join(m['flags'])}; torch {m['torch']}; "
             f"kernels: {m['kernels']}. Start {res['start']['date']} (load {' '.join(res['start']['load'])}), "
             f"end {res['end']['date']} (load {' '.join(res['end']['load'])}).", "",
             "| model | weights | tp | step | batch | wall | cpu | linears | attention | other | allreduce | spin | wait | head | python "
             "| sample+bcast | ops/layer | ceiling | ceiling/wall |",
             "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for row in res["shardwise"]:
        r = row["ranks"][0]
        inside = sum(r[k] for k in ("linears", "attention", "other", "allreduce"))
        ceiling = max(x["ceiling"] for x in row["ranks"])
        wall = max(x["wall"] for x in row["ranks"])
        lines.append(
            f"| {row['model']} | {row['quantize']} | {row['tp']} | {row['step']} | {row.get('batch', 1)} | {wall:.2f} | {r['cpu']:.2f} "
            f"| {r['linears']:.2f} | {r['attention']:.2f} | {r['other']:.2f} | {r['allreduce']:.2f} | {r['spin']:.2f} "
            f"| {r['wait']:.2f} | {r.get('head', 0):.2f} "
            f"| {r['fwd_cpu'] - inside - r.get('head', 0):.2f} | {r['sample_bcast']:.2f} | {r['ops_per_layer']:.1f} | {ceiling:.2f} "
            f"| {ceiling / wall:.2f} |"
        )
    if res["llama"]:
        lines += ["", "| model | llama.cpp threads | ms/token |", "|---|---:|---:|"]
        lines += [f"| {r['model']} | {r['threads']} | {r['ms']:.2f} |" for r in res["llama"]]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["/tmp/smol-shape"])
    ap.add_argument("--quantize", nargs="+", default=["none", "int8"])
    ap.add_argument("--tp", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--step", nargs="+", default=["on", "off"], choices=["on", "off"])
    ap.add_argument("--warm", type=int, default=4)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--batch", type=int, default=1, help="prompts decoded at once (prompt i: the ids + 7 i)")
    ap.add_argument("--llama", action="store_true", help="llama.cpp on each GGUF file at 1 and 2 threads")
    ap.add_argument("--llama-python", default=str(LLAMA_VENV if LLAMA_VENV.exists() else sys.executable))
    ap.add_argument("--out", type=Path)
    ap.add_argument("--table", type=Path, help="print the table of an earlier run's JSON and stop")
    args = ap.parse_args()
    if args.table:
        print(table(json.loads(args.table.read_text())))
        return
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    res = run(args)
    if args.out:
        args.out.write_text(json.dumps(res, indent=1))
    print(table(res))


if __name__ == "__main__":
    main()
