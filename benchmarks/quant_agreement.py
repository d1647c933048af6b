"""Greedy tokens under --quantize at tp 2, 3 and 4 against tp=1 with the same scheme, and
each scheme at tp=1 against fp32: how far greedy decoding runs before the first token that
differs, over 8 prompts from held-out text (the opening of Emma, data/austen/heldout.txt).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/quant_agreement.py [--model DIR] [--tokens 32]
        [--json docs/benchmarks/quant_agreement.json]

Why tokens can differ with int8 and tp: a column-parallel slice computes exactly what tp=1
computes (whole rows, the same per-row scales, the same replicated input), but a
row-parallel slice (attention's output projection, the MLP's down projection) quantizes its
own input slice per call and scales each row over its own columns, so its partial sums
round differently from the whole row's. fp16 weights have no per-call rounding: their
tokens match tp=1 exactly.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _prompts(n: int = 8) -> list[str]:
    text = (ROOT / "data/austen/heldout.txt").read_text()
    paras = [p.replace("\n", " ").strip() for p in text.split("\n\n") if len(p) > 200]
    return [" ".join(p.split()[:12]) for p in paras[:n]]


def generate(model: str | None, tp: int, scheme: str | None, prompts: list[str], tokens: int) -> list[list[int]]:
    cmd = [sys.executable, "-m", "shardwise", "generate", "--json", "--tp", str(tp), "--max-new-tokens", str(tokens)]
    cmd += ["--ignore-eos"] + (["--model", model] if model else []) + (["--quantize", scheme] if scheme else [])
    for p in prompts:
        cmd += ["--prompt", p]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)["tokens"]


def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    """Tokens before the first difference, per prompt; and how many prompts agree entirely."""
    first = [
        next((i for i, (x, y) in enumerate(zip(s, t, strict=True)) if x != y), len(s))
        for s, t in zip(a, b, strict=True)
    ]
    return {"first_difference": first, "identical": sum(f == len(s) for f, s in zip(first, a, strict=True))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--tps", default="1,2,3,4")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    prompts = _prompts()
    tps = [int(t) for t in args.tps.split(",")]
    runs = {(tp, s): generate(args.model, tp, s, prompts, args.tokens) for s in (None, "fp16", "int8") for tp in tps}
    rows = []
    for s in ("fp16", "int8"):
        rows.append({"compare": f"{s} tp=1 vs fp32 tp=1", **agreement(runs[(1, s)], runs[(1, None)])})
        for tp in tps[1:]:
            rows.append({"compare": f"{s} tp={tp} vs {s} tp=1", **agreement(runs[(tp, s)], runs[(1, s)])})
    for tp in tps[1:]:
        rows.append({"compare": f"fp32 tp={tp} vs fp32 tp=1", **agreement(runs[(tp, None)], runs[(1, None)])})
    print(f"{len(prompts)} prompts, {args.tokens} greedy tokens each\n")
    print("| compared | prompts identical | tokens before the first difference (per prompt) |")
    print("|---|---|---|")
    for r in rows:
        print(f"| {r['compare']} | {r['identical']} of {len(prompts)} | {', '.join(map(str, r['first_difference']))} |")
    if args.json:
        args.json.write_text(json.dumps({"prompts": prompts, "tokens": args.tokens, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
