"""Inference speed and memory of shardwise against the anchors, side by side in ONE run.

Rows: shardwise tp=1; shardwise tp=2 on MPI; shardwise tp=2 on gloo; transformers with
1 and with 2 threads; transformers `tp_plan="auto"` at tp=2 under torchrun; PyTorch native
tensor parallelism (parallelize_module) at tp=2 under torchrun (gloo). One thread per rank.

Figures: decode ms/token at batch 1 (32 tokens after a 128-token prompt), prefill ms for
128 and 512 tokens, decode tokens/s at batch 8, parameter bytes and peak anonymous memory
per rank. Every row must produce the same 32 greedy tokens; the script checks it.

    .venv/bin/python benchmarks/bench_inference.py [--quick] [--out docs/benchmarks/bench_inference.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_model import DEFAULT_DIR, ensure_bench_model  # noqa: E402

NEW, PROMPT, LONG, BATCH = 32, 128, 512, 8


def _ids(n: int, batch: int = 1, seed: int = 0) -> torch.Tensor:
    return torch.randint(10, 31000, (batch, n), generator=torch.Generator().manual_seed(seed))


def _time(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


# ---- shardwise rows ---------------------------------------------------------------------
def _shardwise(world, path: str, repeats: int) -> dict:
    from shardwise.comm import tp_only
    from shardwise.engine import generate
    from shardwise.hf import load_pretrained
    from shardwise.memory import PeakAnonMemory, import_meta_kernels

    tp = tp_only(world)
    import_meta_kernels()
    with PeakAnonMemory() as mem:
        model, report = load_pretrained(path, comm=tp)

    def prefill(n):
        ids = _ids(n)
        caches = model.new_caches(1, n + 1)
        return lambda: model(ids, caches=caches, last_only=True)

    with torch.no_grad():
        p128, p512 = _time(prefill(PROMPT), repeats), _time(prefill(LONG), repeats)
    one = [generate(model, _ids(PROMPT).tolist(), comm=tp, max_new_tokens=NEW) for _ in range(repeats + 1)][1:]
    many = [generate(model, _ids(PROMPT, BATCH).tolist(), comm=tp, max_new_tokens=NEW) for _ in range(2)][1]
    per_rank = tp.all_gather(torch.tensor([report.param_bytes, mem.peak_above_baseline]), dim=0).view(-1, 2)
    profile = _decode_profile(model, tp)
    return {
        "profile": profile,
        "prefill_128_ms": p128,
        "prefill_512_ms": p512,
        "decode_ms": statistics.median(statistics.median(g.decode_ms) for g in one),
        "batch8_tok_s": BATCH * 1e3 / statistics.median(many.decode_ms),
        "param_bytes": per_rank[:, 0].tolist(),
        "peak_anon_bytes": per_rank[:, 1].tolist(),
        "tokens": one[0].tokens[0],
        "comm_per_token": sum(v["calls"] for v in one[0].comm_per_step.values()),
    }


_KERNELS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_scaled_dot_product")


def _decode_profile(model, tp) -> dict:
    """Where one decode step's time goes (batch 1): GEMM and attention kernels (torch
    profiler self time), collectives (the communicator's own timing), and the rest."""
    from torch.profiler import ProfilerActivity, profile

    from shardwise.engine.generate import decode_step, prefill
    from shardwise.engine.sampling import SamplingParams, sample_on_rank0

    ids, greedy = _ids(PROMPT), SamplingParams()
    mask = torch.ones(1, PROMPT, dtype=torch.long)
    caches = model.new_caches(1, PROMPT + NEW + 1)
    with torch.no_grad():
        tok = sample_on_rank0(prefill(model, ids, mask, caches), greedy, None, tp)
        with tp.stats.track() as comm, profile(activities=[ProfilerActivity.CPU]) as prof:
            t0 = time.perf_counter()
            for step in range(NEW):
                tok = sample_on_rank0(
                    decode_step(model, tok.unsqueeze(1), None, caches, PROMPT + step), greedy, None, tp
                )
            total = (time.perf_counter() - t0) / NEW * 1e3
    kernels = sum(e.self_cpu_time_total for e in prof.key_averages() if e.key.startswith(_KERNELS)) / 1e3 / NEW
    collectives = comm.seconds() * 1e3 / NEW
    return {
        "step_ms_profiled": total,
        "kernels_ms": kernels,
        "collectives_ms": collectives,
        "other_ms": total - kernels - collectives,
    }


def _weight_floor(world, path: str) -> float:
    """The floor of a batch-1 decode step on this machine: only the matrix-vector products
    of this rank's weights (every projection and the LM head, the model's own tensors),
    run by every rank at once, as in a real step. Decode at batch 1 streams each weight
    once, so this is the memory-bandwidth bound; floor(tp=1) / floor(tp=2) is the most
    any tp=2 can gain here, whatever its communication and overhead. Runs on gloo, whose
    waiting rank sleeps and leaves the memory bus to the other."""
    from shardwise.comm import tp_only
    from shardwise.hf import load_pretrained

    tp = tp_only(world)
    model, _ = load_pretrained(path, comm=tp)
    weights = [m.weight for name, m in model.named_modules() if name and hasattr(m, "weight") and m.weight.dim() == 2]
    weights = [w for w in weights if w is not model.embed.weight or model.cfg.tie_embeddings]  # embed: one row
    inputs = [torch.randn(1, w.shape[1]) for w in weights]
    times = []
    with torch.no_grad():
        for _ in range(3 + 2 * NEW):
            tp.barrier()  # ranks stream their shards concurrently, sharing the memory bus
            t0 = time.perf_counter()
            for x, w in zip(inputs, weights, strict=True):
                torch.nn.functional.linear(x, w)
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times[3:])


def _floors(path: str, rounds: int) -> dict:
    """Weight-streaming floors at tp=1 and tp=2, alternated over `rounds`, medians."""
    from shardwise.launch import launch

    one, two = [], []
    for _ in range(rounds):
        one.append(launch(_weight_floor, 1, args=(path,))[0])
        two.append(max(launch(_weight_floor, 2, args=(path,), timeout_s=600)))  # the slower rank
    return {"tp1_ms": statistics.median(one), "tp2_ms": statistics.median(two), "tp1_all": one, "tp2_all": two}


# ---- transformers and PyTorch-native rows ----------------------------------------------------
def _hf_measure(model, repeats: int) -> dict:
    from transformers import DynamicCache

    def prefill(n):
        ids = _ids(n)
        return lambda: model(ids, use_cache=True, past_key_values=DynamicCache())

    def decode(batch):
        ids = _ids(PROMPT, batch)
        out = model(ids, use_cache=True, past_key_values=DynamicCache())
        past, tok, steps, toks = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True), [], []
        for _ in range(NEW - 1):
            toks.append(tok[0, 0].item())
            t0 = time.perf_counter()
            out = model(tok, past_key_values=past, use_cache=True)
            tok = out.logits[:, -1].argmax(-1, keepdim=True)
            steps.append((time.perf_counter() - t0) * 1e3)
        toks.append(tok[0, 0].item())
        return statistics.median(steps), toks

    with torch.no_grad():
        p128, p512 = _time(prefill(PROMPT), repeats), _time(prefill(LONG), repeats)
        runs = [decode(1) for _ in range(repeats + 1)][1:]
        batch_ms = [decode(BATCH)[0] for _ in range(2)][1]
    params = sum(
        p.to_local().numel() * p.element_size() if hasattr(p, "to_local") else p.numel() * p.element_size()
        for p in model.parameters()
    )
    return {
        "prefill_128_ms": p128,
        "prefill_512_ms": p512,
        "decode_ms": statistics.median(r[0] for r in runs),
        "batch8_tok_s": BATCH * 1e3 / batch_ms,
        "param_bytes": [params],
        "tokens": runs[0][1],
    }


def _hf_single(world, path: str, repeats: int) -> dict:
    from transformers import AutoModelForCausalLM

    from shardwise.memory import PeakAnonMemory, import_meta_kernels

    import_meta_kernels()
    with PeakAnonMemory() as mem:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return {**_hf_measure(model, repeats), "peak_anon_bytes": [mem.peak_above_baseline]}


def _torchrun_worker(kind: str, path: str, repeats: int, out: str) -> None:
    """Runs under torchrun: transformers tp_plan="auto", or PyTorch's parallelize_module."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from shardwise.memory import PeakAnonMemory, import_meta_kernels

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    import_meta_kernels()
    with PeakAnonMemory() as mem:
        if kind == "hf-tp":
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, tp_plan="auto").eval()
        else:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            mesh = init_device_mesh("cpu", (dist.get_world_size(),))
            plan = {f"self_attn.{p}_proj": ColwiseParallel() for p in "qkv"}
            plan |= {"self_attn.o_proj": RowwiseParallel(), "mlp.down_proj": RowwiseParallel()}
            plan |= {"mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel()}
            for layer in model.model.layers:
                parallelize_module(layer, mesh, plan)
    result = {**_hf_measure(model, repeats), "peak_anon_bytes": [mem.peak_above_baseline]}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, result)
    if dist.get_rank() == 0:
        merged = gathered[0] | {
            "param_bytes": [g["param_bytes"][0] for g in gathered],
            "peak_anon_bytes": [g["peak_anon_bytes"][0] for g in gathered],
        }
        Path(out).write_text(json.dumps(merged))
    dist.destroy_process_group()


def _torchrun(kind: str, path: Path, repeats: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "r.json"
        cmd = [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc-per-node", "2", __file__]
        cmd += ["--worker", kind, "--model", str(path), "--repeats", str(repeats), "--worker-out", str(out)]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800, check=False)
        if proc.returncode != 0 or not out.exists():
            return {"error": (proc.stderr.strip().splitlines() or ["failed"])[-1][:300]}
        return json.loads(out.read_text())


# ---- the run ------------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=DEFAULT_DIR)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="1 repeat, to check the script works")
    ap.add_argument("--out", type=Path, default=Path("docs/benchmarks/bench_inference.json"))
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    repeats = 1 if args.quick else args.repeats
    if args.worker:
        return _torchrun_worker(args.worker, str(args.model), repeats, args.worker_out)

    from shardwise.launch import launch

    path = str(ensure_bench_model(args.model))
    rows: dict[str, dict] = {}
    for name, run in [
        ("shardwise tp=1", lambda: launch(_shardwise, 1, args=(path, repeats))[0]),
        ("shardwise tp=2 mpi", lambda: launch(_shardwise, 2, args=(path, repeats), backend="mpi", timeout_s=600)[0]),
        ("shardwise tp=2 gloo", lambda: launch(_shardwise, 2, args=(path, repeats), timeout_s=600)[0]),
        ("transformers 1 thread", lambda: launch(_hf_single, 1, args=(path, repeats))[0]),
        ("transformers 2 threads", lambda: launch(_hf_single, 1, args=(path, repeats), threads_per_rank=2)[0]),
        ("transformers tp_plan=auto tp=2", lambda: _torchrun("hf-tp", Path(path), repeats)),
        ("PyTorch native TP tp=2 (gloo)", lambda: _torchrun("torch-tp", Path(path), repeats)),
    ]:
        print(f"running: {name}", file=sys.stderr, flush=True)
        try:
            rows[name] = run()
        except Exception as e:  # noqa: BLE001 - a failing anchor is reported, not fatal
            rows[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
    print("running: weight-streaming floors", file=sys.stderr, flush=True)
    floors = _floors(path, 3 if repeats > 1 else 1)
    reference = rows["shardwise tp=1"]["tokens"]
    for r in rows.values():
        if "error" not in r:
            r["same_tokens"] = r["tokens"] == reference
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"rows": rows, "floors": floors, "repeats": repeats, "model": path}, indent=1))
    print(json.dumps({k: {kk: vv for kk, vv in v.items() if kk != "tokens"} for k, v in rows.items()}, indent=1))


if __name__ == "__main__":
    main()
