"""One decode step, split into the projection matmuls and everything else.

On the SmolLM2-135M-shaped model (benchmarks/make_smol_shape.py: 30 layers of width 576,
where the work between the matmuls weighs the most), tp=1, one thread, fp32, greedy:

    step_ms    wall time of one decode step of `generate` (the engine's Python included):
               (generate's wall - its prefill) / (decode steps)
    matmul_ms  torch.profiler self time of aten::mm and aten::addmm per step (every
               projection and the LM head), in a loop of decode_step + sample_on_rank0
    other_ms   step_ms - matmul_ms: norms, rotary, attention over the cache, cache writes,
               sampling, Python

at batch 1 and 4 (prompt 64 tokens, 32 new). With --compare REV the same measurement
runs on the source tree of git revision REV too (exported with `git archive`), and with
--compare REV NEW on two revisions instead of REV and this working tree; the trees
alternate in fresh processes, and must give the same greedy tokens. Medians of the
rounds' medians:

    env -u PYTHONDONTWRITEBYTECODE OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_step.py \
        --compare REV [NEW] [--rounds 5] [--model /tmp/smol-shape] [--overhead]

On a busy machine the wall times above move by tens of percent from process to process,
more than the work outside the matmuls weighs. --overhead adds a figure that load hardly
moves: the thread CPU time of a decode step with every projection replaced by a constant
of its shape (what is left is the work outside the matmuls), both trees imported into one
process under their own package names and taking turns step by step.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from io import BytesIO
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PROMPT, NEW, BATCHES = 64, 32, (1, 4)
MATMULS = ("aten::mm", "aten::addmm")


def _matmul_ms(model, ids, caches, comm) -> float:
    """Self ms of the matmuls per decode step, profiled in a loop of the engine's step.
    caches: already filled with ids' prefill (each loop rewrites the same decode slots)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from shardwise.engine.generate import decode_step
    from shardwise.engine.sampling import SamplingParams, sample_on_rank0

    greedy, P = SamplingParams(), ids.shape[1]
    tok = ids[:, -1]
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU]) as prof:
        for s in range(NEW - 1):
            tok = sample_on_rank0(decode_step(model, tok.unsqueeze(1), None, caches, P + s), greedy, None, comm)
            tok.tolist()
    return sum(e.self_cpu_time_total for e in prof.key_averages() if e.key in MATMULS) / 1e3 / (NEW - 1)


def _child(model_dir: str, repeats: int) -> dict:
    """Measure this process's shardwise (whatever PYTHONPATH points at) -> {batch: figures}."""
    import torch

    import shardwise
    from shardwise.comm import LocalCommunicator
    from shardwise.engine import generate
    from shardwise.engine.generate import prefill
    from shardwise.hf import load_pretrained

    torch.set_num_threads(1)
    comm = LocalCommunicator()
    model, _ = load_pretrained(model_dir, comm=comm)
    out = {"src": str(Path(shardwise.__file__).parent)}
    for B in BATCHES:
        prompts = torch.randint(10, 40000, (B, PROMPT), generator=torch.Generator().manual_seed(B)).tolist()
        ids = torch.tensor(prompts)
        caches = model.new_caches(B, PROMPT + NEW)
        with torch.no_grad():
            prefill(model, ids, torch.ones_like(ids), caches)
        generate(model, prompts, comm=comm, max_new_tokens=4)  # warm-up
        steps, mms = [], []
        for _ in range(repeats):  # timed and profiled runs alternate, so both see the same load
            t0 = time.perf_counter()
            res = generate(model, prompts, comm=comm, max_new_tokens=NEW)
            steps.append(((time.perf_counter() - t0) * 1e3 - res.prefill_ms) / (NEW - 1))
            mms.append(_matmul_ms(model, ids, caches, comm))
        step, mm = statistics.median(steps), statistics.median(mms)
        out[B] = {"step_ms": step, "matmul_ms": mm, "other_ms": step - mm, "tokens": res.tokens}
    return out


def _export(rev: str, dest: Path) -> Path:
    """The src/ tree of git revision `rev`, unpacked under dest."""
    blob = subprocess.run(["git", "archive", rev, "src"], cwd=ROOT, check=True, capture_output=True).stdout
    with tarfile.open(fileobj=BytesIO(blob)) as tar:
        tar.extractall(dest, filter="data")
    return dest / "src"


def _run(src: Path, model_dir: str, repeats: int) -> dict:
    env = dict(os.environ, PYTHONPATH=str(src), OMP_NUM_THREADS="1")
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    cmd = [sys.executable, __file__, "--child", "--model", model_dir, "--repeats", str(repeats)]
    done = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def _as_package(src: Path, name: str, dest: Path) -> None:
    """src/shardwise copied to dest/name, every `shardwise` import renamed to `name`."""
    shutil.copytree(src / "shardwise", dest / name, ignore=shutil.ignore_patterns("__pycache__"))
    for f in (dest / name).rglob("*.py"):
        f.write_text(re.sub(r"\bshardwise\b", name, f.read_text()))


def _overhead(trees: dict[str, Path], model_dir: str, tmp: Path, steps: int = 48, repeats: int = 3) -> dict:
    """{tree: {batch: CPU ms of a decode step with the matmuls stubbed}}, trees interleaved."""
    import importlib

    import torch
    from torch import nn

    torch.set_num_threads(1)

    def stub(self, x):  # a constant of the projection's output shape, one per input shape
        cache = self.__dict__.setdefault("_stub", {})
        key = tuple(x.shape[:-1])
        if key not in cache:
            cache[key] = torch.full((*key, self.out_features), 0.01)
        return cache[key]

    nn.Linear.forward = stub  # NOTE: the models below are plain DecoderLMs, unsharded: nn.Linear only
    models = {}
    for i, (name, src) in enumerate(trees.items()):
        _as_package(src, f"shardwise_{i}", tmp / "pkgs")
        sys.path.insert(0, str(tmp / "pkgs"))
        _, cfg = importlib.import_module(f"shardwise_{i}.hf").read_config(model_dir)
        models[name] = importlib.import_module(f"shardwise_{i}.models.decoder").DecoderLM(cfg).eval()
    out: dict = {name: {} for name in trees}
    for B in BATCHES:
        ids = torch.randint(10, 40000, (B, PROMPT), generator=torch.Generator().manual_seed(B))
        times: dict[str, list[float]] = {name: [] for name in trees}
        for _ in range(repeats):
            state = {}
            with torch.no_grad():
                for name, m in models.items():
                    caches = m.new_caches(B, PROMPT + steps)
                    m(ids, caches=caches, last_only=True)
                    state[name] = [caches, ids[:, -1:]]
                for s in range(steps):
                    for name in models if s % 2 == 0 else reversed(models):
                        caches, tok = state[name]
                        c0 = time.thread_time()
                        logits = models[name](tok, caches=caches, start=PROMPT + s, last_only=True)
                        state[name][1] = logits[:, -1].argmax(-1, keepdim=True)
                        times[name].append((time.thread_time() - c0) * 1e3)
        for name in trees:
            out[name][B] = statistics.median(times[name])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a Llama checkpoint directory (default: make /tmp/smol-shape)")
    ap.add_argument(
        "--compare",
        nargs="+",
        metavar="REV",
        help="REV [NEW]: measure REV's source tree against NEW's (default: this tree)",
    )
    ap.add_argument("--rounds", type=int, default=5, help="processes per tree, alternating trees")
    ap.add_argument("--repeats", type=int, default=3, help="timed generate calls per process and batch")
    ap.add_argument("--overhead", action="store_true", help="add the CPU ms outside the matmuls, trees interleaved")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.model is None:
        sys.path.insert(0, str(HERE))
        from make_smol_shape import ensure_smol_shape

        args.model = str(ensure_smol_shape())
    if args.child:
        print(json.dumps(_child(args.model, args.repeats)))
        return

    with tempfile.TemporaryDirectory() as tmp:
        trees = {"this tree": ROOT / "src"}
        if args.compare:
            if len(args.compare) > 2:
                ap.error("--compare takes one or two revisions")
            trees = {rev: _export(rev, Path(tmp) / str(i)) for i, rev in enumerate(args.compare)}
            if len(args.compare) == 1:
                trees["this tree"] = ROOT / "src"
        runs: dict[str, list[dict]] = {name: [] for name in trees}
        for r in range(args.rounds):
            for name, src in trees.items():
                runs[name].append(_run(src, args.model, args.repeats))
                print(f"round {r + 1}/{args.rounds} {name}: " + ", ".join(
                    f"b{B} {runs[name][-1][str(B)]['step_ms']:.1f} ms" for B in BATCHES), file=sys.stderr)  # fmt: skip
        overhead = _overhead(trees, args.model, Path(tmp)) if args.overhead else None
    if args.rounds:
        print(f"decode step on {args.model}, tp=1, 1 thread, prompt {PROMPT}, {NEW} new tokens; "
              f"medians of {args.rounds} processes x {args.repeats} runs")  # fmt: skip
        print(f"{'tree':<14} {'batch':>5} {'step ms':>8} {'matmul ms':>10} {'other ms':>9} {'other %':>8}")
        for B in BATCHES:
            for name, rs in runs.items():
                fig = {k: statistics.median(r[str(B)][k] for r in rs) for k in ("step_ms", "matmul_ms", "other_ms")}
                share = 100 * fig["other_ms"] / fig["step_ms"]
                print(f"{name:<14} {B:>5} {fig['step_ms']:>8.1f} {fig['matmul_ms']:>10.1f} "
                      f"{fig['other_ms']:>9.1f} {share:>7.0f}%")  # fmt: skip
    if overhead is not None:
        print("CPU ms of a decode step with the matmuls stubbed (the work outside them), trees interleaved:")
        for B in BATCHES:
            print(f"  batch {B}: " + ", ".join(f"{name} {overhead[name][B]:.2f}" for name in trees))
    if args.compare and args.rounds:
        a, b = (runs[n][0] for n in trees)
        same = all(a[str(B)]["tokens"] == b[str(B)]["tokens"] for B in BATCHES)
        print("greedy tokens identical across trees:", same)
        if not same:
            sys.exit(1)


if __name__ == "__main__":
    main()
