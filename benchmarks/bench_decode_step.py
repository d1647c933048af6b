"""Where one decode step's time goes, per rank, at tp 1 and 2: thread time and wall time.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_decode_step.py [--model DIR|FILE.gguf]
        [--tp 1 2] [--quantize int8] [--backend mpi gloo] [--fused on off] [--steps 32] [--json OUT]
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_decode_step.py --collectives [--backend mpi gloo]

Each configuration runs in fresh ranks (shardwise.launch, one thread each): load, a 64-token
prompt, 4 warm-up steps, then `--steps` timed decode steps (batch 1, greedy), each split as
generate() runs it: the forward (decode_step), rank 0's sampling, the token broadcast. Every
collective the tp group issues is timed on entry and exit (wall, perf_counter, which all
ranks of a host share) and in thread time. Then as many steps again under torch.profiler
(CPU), for the ops: the matmul kernels' self time (aten::mm/addmm, the native gemm),
the other top-level ops' time, and how many ops a layer runs per step (top-level ops, the
ones Python calls, and every aten op including those they call inside). The native module's
calls (shardwise.kernels._native) are profiled as `shardwise::<name>` ranges, so a fused
kernel counts as one op. `--fused on off` runs each configuration with the fused decode
kernels (shardwise.kernels.decode) and on the plain path.

Per rank, ms per step (medians over steps):

    wall, cpu        the whole step, wall and thread time (time.thread_time)
    matmul, ops      profiled: matmul kernels; every other top-level op outside collectives
    python           cpu of the forward - matmul - ops - collectives' cpu: Python, module
                     calls, dispatch between ops (an estimate: profiled ops run a little slower)
    coll, wait       wall inside collectives; the part of it spent before the last rank arrived
                     (waiting for the slower rank); coll - wait is the message itself
    coll cpu         thread time inside collectives (MPI spins while it waits: wait costs CPU)
    sample, bcast    rank 0's sampling (argmax), and the token broadcast (every rank)

--collectives: the all-reduce alone at decode sizes (one row and 16 rows of 576 and 2048
fp32), back to back on 2 ranks, median us per call, per backend (and shared memory where the
communicator has it).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))

from shardwise.comm import tp_only  # noqa: E402
from shardwise.launch import launch  # noqa: E402

PROMPT, WARM = 64, 4
MATMULS = ("aten::mm", "aten::addmm", "quantized::linear_dynamic", "quantized::linear_dynamic_fp16", "shardwise::gemm")
OPS = ("aten::", "quantized::", "shardwise::")


def _timed(comm, calls: list, profiling: list):
    """Wrap comm's collectives: each call appends (op, entry, exit, thread seconds) to `calls`."""
    from torch.profiler import record_function

    run = comm._run

    def timed(op, nbytes, primitive, *args, peer=None):
        c0, t0 = time.thread_time(), time.perf_counter()
        if profiling:
            with record_function(f"comm:{op}"):
                out = run(op, nbytes, primitive, *args, peer=peer)
        else:
            out = run(op, nbytes, primitive, *args, peer=peer)
        calls.append((op, t0, time.perf_counter(), time.thread_time() - c0))
        return out

    comm._run = timed


class _Profiled:
    """The native module with each call under a profiler range `shardwise::<name>`: its kernel
    calls then count among a layer's ops, and its gemm among the matmuls."""

    def __init__(self, lib):
        from torch.profiler import record_function

        for name in dir(lib):
            f = getattr(lib, name)
            if callable(f) and not name.startswith("_"):

                def call(*a, _f=f, _n=f"shardwise::{name}"):
                    with record_function(_n):
                        return _f(*a)

                setattr(self, name, call)
            else:
                setattr(self, name, f)


def _stub_matmuls(stubbed: list) -> None:
    """While `stubbed` is non-empty, every projection (the kernel layer's one `linear`, in
    each shardwise module that imported it) returns zeros of its output's shape at no cost."""
    from shardwise.layers import linear as layer_linear

    real = layer_linear.linear

    def linear(x, w, bias=None):
        if not stubbed:
            return real(x, w, bias)
        # NOTE: a fresh tensor, as the kernel's own output: a cached one is modified in place
        # downstream (rotary, the in-place all-reduce) and drifts into denormals, which are slow
        return torch.zeros((*x.shape[:-1], w.shape[0]), dtype=x.dtype)

    for name, mod in list(sys.modules.items()):
        if name.startswith("shardwise.") and getattr(mod, "linear", None) is real:
            mod.linear = linear


def _rank(world, opts: dict) -> dict:
    from torch.profiler import ProfilerActivity, profile

    from shardwise.engine.generate import decode_step, prefill
    from shardwise.engine.sampling import SamplingParams, sample
    from shardwise.hf import load_pretrained
    from shardwise.quant.layout import decode_layout

    torch.set_num_threads(1)
    from shardwise.kernels import decode

    decode.FUSED = opts.get("fused", True)  # the fused decode kernels (kernels.decode), or the plain path
    tp = tp_only(world)
    model, _ = load_pretrained(opts["model"], comm=tp, quantize=opts["quantize"])
    decode_layout(model, rows=1)
    steps, layers = opts["steps"], model.cfg.num_layers
    calls: list = []
    profiling: list = []
    stubbed: list = []
    _timed(tp, calls, profiling)
    _stub_matmuls(stubbed)
    ids = torch.tensor([[(37 * i + 300) % model.cfg.vocab_size for i in range(PROMPT)]])  # (1, P)
    length = PROMPT + WARM + 2 * steps + 1
    caches, stub_caches = model.new_caches(1, length), model.new_caches(1, length)
    greedy = SamplingParams()
    rows, stub_rows, tokens = [], [], []

    def step(tok: torch.Tensor, pos: int, caches: list, rows: list) -> torch.Tensor:
        c0, w0, n0 = time.thread_time(), time.perf_counter(), len(calls)
        logits = decode_step(model, tok.view(1, 1), None, caches, pos)  # (1, V)
        c1, w1 = time.thread_time(), time.perf_counter()
        nxt = sample(logits, greedy) if tp.rank == 0 else torch.empty(1, dtype=torch.long)
        w2 = time.perf_counter()
        nxt = tp.broadcast(nxt, src=0)
        nxt.tolist()  # as generate() reads each step's tokens
        c3, w3 = time.thread_time(), time.perf_counter()
        rows.append((w3 - w0, c3 - c0, c1 - c0, w2 - w1, w3 - w2, n0, len(calls), w1 - w0))
        return nxt

    with torch.no_grad():
        for c in (caches, stub_caches):
            tok = tp.broadcast(sample(prefill(model, ids, torch.ones_like(ids), c), greedy), src=0)
        stub_tok, pos = tok, PROMPT
        for s in range(WARM + steps):  # real and stubbed steps take turns, so both see the same load
            if s == WARM:
                rows.clear(), stub_rows.clear(), tokens.clear()
            tok = step(tok, pos, caches, rows)
            tokens.append(int(tok))
            stubbed.append(True)
            stub_tok = step(stub_tok, pos, stub_caches, stub_rows)
            stubbed.clear()
            pos += 1
        profiling.append(True)
        prof_rows: list = []
        from shardwise.kernels import native

        real_lib = native.lib
        native.lib = _Profiled(real_lib) if real_lib is not None else None
        try:
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(steps):
                    tok, pos = step(tok, pos, caches, prof_rows), pos + 1
        finally:
            native.lib = real_lib
    return {
        "rows": rows,
        "stub_rows": stub_rows,
        "prof_rows": prof_rows,
        "calls": calls,
        "tokens": tokens,
        "ops": _ops(prof.events(), steps, layers),
        "layers": layers,
    }


def _ops(events, steps: int, layers: int) -> dict:
    """Profiled ms per step of the matmul kernels and of the other top-level ops, and op counts."""

    def chain(e):
        p = e.cpu_parent
        while p is not None:
            yield p
            p = p.cpu_parent

    matmul = other = 0.0
    top = all_ops = 0
    by_name: dict[str, list] = {}
    for e in events:
        if not e.name.startswith(OPS):
            continue
        parents = list(chain(e))
        if any(p.name.startswith("comm:") for p in parents):
            continue  # inside a collective: counted with the collectives
        all_ops += 1
        if e.name in MATMULS:
            matmul += e.self_cpu_time_total
        if not any(p.name.startswith(OPS) for p in parents):
            top += 1
            other += e.cpu_time_total
            agg = by_name.setdefault(e.name, [0, 0.0])
            agg[0] += 1
            agg[1] += e.cpu_time_total
    per = steps * 1e3
    heavy = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:10]
    return {
        "matmul_ms": matmul / per,
        "other_ms": (other - matmul) / per,
        "top_per_layer": top / steps / layers,
        "all_per_layer": all_ops / steps / layers,
        "heaviest": [(name, n / steps / layers, us / per) for name, (n, us) in heavy],
    }


def _summary(results: list[dict]) -> list[dict]:
    """Per rank: medians per step of each part (ms), the collectives' wait from every rank's clock."""
    calls = [r["calls"] for r in results]
    n = len(calls[0])
    if any(len(c) != n for c in calls):
        raise RuntimeError(f"ranks issued different numbers of collectives: {[len(c) for c in calls]}")
    last = [max(c[i][1] for c in calls) for i in range(n)]  # when the last rank entered call i
    out = []
    for r, res in enumerate(results):
        c = calls[r]

        def parts(rows: list, c: list = c) -> dict[str, float]:
            per: dict[str, list[float]] = {}
            for wall, cpu, fwd_cpu, samp, bcast, i0, i1, fwd_wall in rows:
                fwd = [i for i in range(i0, i1) if c[i][0] != "broadcast"]
                for k, v in (("wall", wall), ("cpu", cpu), ("fwd_cpu", fwd_cpu), ("fwd_wall", fwd_wall),
                             ("sample", samp), ("bcast", bcast), ("coll", sum(c[i][2] - c[i][1] for i in fwd)),
                             ("wait", sum(max(0.0, last[i] - c[i][1]) for i in fwd)),
                             ("coll_cpu", sum(c[i][3] for i in fwd))):  # fmt: skip
                    per.setdefault(k, []).append(v)
            return {k: 1e3 * statistics.median(v) for k, v in per.items()}

        fig, stub, prof, ops = parts(res["rows"]), parts(res["stub_rows"]), parts(res["prof_rows"]), res["ops"]
        fig["matmul"] = fig["fwd_cpu"] - stub["fwd_cpu"]
        fig["rest"] = stub["fwd_cpu"] - stub["coll_cpu"]
        fig["prof_ops"] = ops["other_ms"]
        fig["prof_gap"] = prof["fwd_wall"] - prof["coll"] - ops["matmul_ms"] - ops["other_ms"]
        fig["prof_matmul"] = ops["matmul_ms"]
        msg = [c[i][2] - max(c[i][1], last[i]) for i in range(n) if c[i][0] == "all_reduce"]
        fig["allreduce_us"] = 1e6 * statistics.median(msg) if msg else 0.0
        fig |= {k: ops[k] for k in ("top_per_layer", "all_per_layer", "heaviest")}
        out.append(fig)
    return out


COLUMNS = ("wall", "cpu", "matmul", "rest", "prof_ops", "prof_gap", "coll", "wait", "coll_cpu", "sample", "bcast")
HEAD = ("config", "rank", "wall", "cpu", "matmul", "rest", "ops (prof)", "gap (prof)", "coll", "wait", "coll cpu",
        "sample", "bcast", "ar us", "ops/layer")  # fmt: skip


def _print_rows(rows: list[tuple[str, int, dict]]) -> None:
    for name, rank, f in rows:
        cells = [name, str(rank)] + [f"{f[k]:.2f}" for k in COLUMNS]
        cells += [f"{f['allreduce_us']:.0f}", f"{f['top_per_layer']:.0f} ({f['all_per_layer']:.0f})"]
        print("| " + " | ".join(cells) + " |", flush=True)


def _collective_rank(world, sizes: list[tuple[int, int]], calls: int) -> list[float]:
    torch.set_num_threads(1)
    tp = tp_only(world)
    out = []
    for rows, width in sizes:
        t = torch.randn(rows, width, generator=torch.Generator().manual_seed(tp.rank))
        want = t.clone()
        for _ in range(20):
            got = tp.all_reduce(t)
        times = []
        for _ in range(calls):
            t0 = time.perf_counter()
            got = tp.all_reduce(t)
            times.append(time.perf_counter() - t0)
        parts = world.all_gather(want.unsqueeze(0), dim=0)  # (2, rows, width)
        if not torch.allclose(got, parts.sum(0), rtol=1e-6, atol=1e-6):
            raise RuntimeError(f"the all-reduce of {rows} x {width} is wrong on rank {tp.rank}")
        out.append(1e6 * statistics.median(times))
    return out


SIZES = [(1, 576), (1, 2048), (16, 576), (16, 2048)]


def collectives(backends: list[str], calls: int) -> dict:
    print("| backend | " + " | ".join(f"{r} x {w}" for r, w in SIZES) + " |")
    print("|" + "---|" * (len(SIZES) + 1))
    out = {}
    for backend in backends:
        us = launch(_collective_rank, 2, args=(SIZES, calls), backend=backend)[0]
        out[backend] = us
        print(f"| {backend} | " + " | ".join(f"{u:.1f}" for u in us) + " |", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a checkpoint directory or GGUF file (default: /tmp/smol-shape)")
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--quantize", nargs="+", default=["none", "int8"], help="none and/or int8 / fp16")
    ap.add_argument("--backend", nargs="+", default=["mpi", "gloo"])
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--fused", nargs="+", default=["on", "off"], help="the fused decode kernels on and/or off")
    ap.add_argument("--collectives", action="store_true", help="the all-reduce alone at decode sizes")
    ap.add_argument("--calls", type=int, default=2000, help="--collectives: timed calls per size")
    ap.add_argument("--json", type=Path, default=None, help="write every figure here")
    args = ap.parse_args()
    cpu = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("model name"))
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {cpu.split(':')[1].strip()}; "
          f"load {subprocess.run(['uptime'], capture_output=True, text=True).stdout.split('average:')[1].strip()}")  # fmt: skip
    if args.collectives:
        out = collectives(args.backend, args.calls)
        if args.json:
            args.json.write_text(json.dumps(out, indent=1))
        return
    if args.model is None:
        sys.path.insert(0, str(HERE))
        from make_smol_shape import ensure_smol_shape

        args.model = str(ensure_smol_shape())
    print(f"model {args.model}, batch 1, prompt {PROMPT}, {args.steps} steps; ms per step (all-reduce us per message)")
    print("| " + " | ".join(HEAD) + " |")
    print("|" + "---|" * len(HEAD))
    everything = {}
    for quantize in args.quantize:
        for tp in args.tp:
            for backend in args.backend if tp > 1 else ["local"]:
                for fused in args.fused:
                    opts = {"model": args.model, "quantize": None if quantize == "none" else quantize,
                            "steps": args.steps, "fused": fused == "on"}  # fmt: skip
                    results = launch(_rank, tp, args=(opts,), backend="gloo" if tp == 1 else backend, timeout_s=600)
                    name = f"{'fp32' if quantize == 'none' else quantize} tp={tp} {backend}"
                    name += " fused" if fused == "on" else " plain"
                    figs = _summary(results)
                    everything[name] = {"ranks": figs, "tokens": results[0]["tokens"]}
                    _print_rows([(name, r, f) for r, f in enumerate(figs)])
    print("\nheaviest top-level ops (rank 0): name, calls per layer per step, ms per step")
    for name, rec in everything.items():
        print(f"  {name}: " + "; ".join(f"{n} {c:.1f} {ms:.2f}" for n, c, ms in rec["ranks"][0]["heaviest"][:6]))
    if args.json:
        args.json.write_text(json.dumps(everything, indent=1))


if __name__ == "__main__":
    main()
