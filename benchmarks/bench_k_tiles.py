"""The K-quant tiles (csrc/qk.c: k45_tile16, q6_tile16) on and off, side by side in one run:
decode ms/step of the Llama-3.2-1B-shaped K-quant files at tp 1 and 2, batch 1, 4 and 16,
`--pairs` launches of each setting alternated (on, off, on, off, ...: the machine's speed
drifts), each figure the median decode step of one launch, the row the median launch.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_k_tiles.py --out docs/benchmarks/k_tiles.json

The files are bench_native.py's (made there, or here, once, with llama.cpp's quantizer run by
--llama-python). Off is SHARDWISE_K_TILES=0, read by the kernels at import (each launch in a
process of its own): the row-at-a-time avx512 path of before. Batch 16's tokens/s over batch 1's is issue 35's batch target (>= 6x).
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gguf import make_file  # noqa: E402
from bench_native import LLAMA_VENV, _machine, _now, q8_file, quantized  # noqa: E402


def _launch(path: Path, tp: int, warm: int, new: int, tiles: bool) -> dict[str, float]:
    """bench_native's decode steps in a process of its own: the kernels read SHARDWISE_K_TILES
    once, at import, and launch's forkserver keeps the first import for every later rank."""
    env = {**os.environ, "SHARDWISE_K_TILES": "1" if tiles else "0"}
    code = (f"import sys, json; sys.path.insert(0, {str(Path(__file__).resolve().parent)!r}); "
            f"from bench_native import shardwise; from pathlib import Path; "
            f"print(json.dumps(shardwise(Path({str(path)!r}), {tp}, {warm}, {new})['ms']))")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"{path.name} tp={tp} tiles={tiles}: exit {out.returncode}\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", type=Path, default=Path("/tmp/shardwise-bench"))
    ap.add_argument("--formats", nargs="+", default=["Q4_K_M", "Q5_K_M"])
    ap.add_argument("--tp", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--pairs", type=int, default=2, help="launches of each setting, alternated")
    ap.add_argument("--warm", type=int, default=3)
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--llama-python", default=str(LLAMA_VENV if LLAMA_VENV.exists() else sys.executable))
    ap.add_argument("--out", type=Path, default=Path("docs/benchmarks/k_tiles.json"))
    a = ap.parse_args()
    q8 = make_file(q8_file(a.dir, 16), 16)
    result = {"machine": _machine(), "start": _now(), "command": " ".join(sys.argv), "rows": []}
    for fmt in a.formats:
        path = quantized(a.llama_python, q8, fmt)
        for tp in a.tp:
            runs: dict[str, list[dict]] = {"on": [], "off": []}
            for _ in range(a.pairs):
                for setting in ("on", "off"):
                    runs[setting].append(_launch(path, tp, a.warm, a.new, setting == "on"))
            row = {"format": fmt, "tp": tp}
            for setting, launches in runs.items():
                row[setting] = {b: statistics.median(r[b] for r in launches) for b in launches[0]}
                row[f"{setting}_launches"] = launches
            b1, b16 = row["on"]["1"], row["on"]["16"]
            row["on_b16_over_b1_tokens"] = 16 * b1 / b16
            row["off_b16_over_b1_tokens"] = 16 * row["off"]["1"] / row["off"]["16"]
            result["rows"].append(row)
            print(fmt, f"tp={tp}", "on", {b: round(v, 1) for b, v in row["on"].items()}, "off",
                  {b: round(v, 1) for b, v in row["off"].items()},
                  f"b16/b1 tokens/s on {row['on_b16_over_b1_tokens']:.2f}x off {row['off_b16_over_b1_tokens']:.2f}x",
                  flush=True)  # fmt: skip
    result["end"] = _now()
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {a.out} ({time.strftime('%H:%M UTC', time.gmtime())})")


if __name__ == "__main__":
    main()
