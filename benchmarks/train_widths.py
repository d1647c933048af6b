"""A training micro-step on one core at several widths, against this host's calibration: how much
of it the products at the calibrated matmul rate explain, and what is left per activation value.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/train_widths.py      # about 2 minutes

Up to calibration version 19 the training probe priced a forward and backward as its products
at train_efficiency times the fp32 matmul rate, plus a fixed time per layer and per micro-step,
all measured at hidden 1024 (and a tiny model for the fixed times); version 20
(shardwise.bench.train_probe) adds the element-wise work per activation value (train_unsplit_ns).
The element-wise work of a layer (norms, residual adds, the gated activation, attention's
softmax, copies) grows with tokens x width while the products grow with tokens x width^2, so
at a narrower width that split prices it lower. This runs the same forward and backward
(train_probe.train_s: as shardwise.train runs a micro-step, best of 5, twice) at hidden 1024,
512 and 256 and at the built-in model's shape (bench_links.py's TRAIN_SHAPES["builtin"], one
micro-batch of 2 x 128), and prints for each: the step, its products at the calibrated rate,
the step less the calibrated fixed times, and what is left after the products, per activation
value (tokens x layers x (2 hidden + intermediate)). docs/benchmarks/links.md cites its output.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

from shardwise.bench.train_probe import train_s
from shardwise.models.config import ModelConfig
from shardwise.planner.cost import training_flops_per_token

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_native import _machine  # noqa: E402  (the CPU's model and SIMD flags, as every table records them)

SHAPES = {  # name: (config, batch, tokens)
    "hidden 1024 (the calibration's probe)": (ModelConfig("llama", 4096, 1024, 2816, 2, 16, 4, 64), 2, 128),
    "hidden 512": (ModelConfig("llama", 4096, 512, 1408, 2, 8, 4, 64), 2, 128),
    "hidden 256": (ModelConfig("llama", 4096, 256, 704, 2, 4, 2, 64), 2, 128),
    "built-in shape (hidden 256, 4 layers, vocabulary 512)": (ModelConfig("llama", 512, 256, 512, 4, 8, 4, 32), 2, 128),
}


def main() -> None:
    torch.set_num_threads(1)
    cache = Path(os.environ.get("SHARDWISE_CACHE_DIR", Path.home() / ".cache/shardwise"))
    cal = json.loads((cache / "calibration.json").read_text())
    gemm = cal["gemm_tflops"]["float32"] * 1e12
    layer, step = cal["train_layer_overhead_us"] * 1e-6, cal["train_step_overhead_us"] * 1e-6
    m = _machine()
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load {os.getloadavg()}")
    print(f"CPU: {m['model']}, {m['cores']} cores; flags {' '.join(m['flags'])}; torch {m['torch']}")
    print(f"calibration of {cal.get('created')} (v{cal.get('version')}): fp32 matmul {gemm / 1e9:.1f} GFLOP/s, "
          f"train_efficiency {cal.get('train_efficiency'):.2f}, per layer {layer * 1e6:.0f} us, per micro-step {step * 1e6:.0f} us")  # fmt: skip
    for name, (cfg, batch, tokens) in SHAPES.items():
        s = min(train_s(cfg, batch, tokens, 5) for _ in range(2))
        products = batch * tokens * training_flops_per_token(cfg, tokens, recompute=False) / gemm
        rest = s - cfg.num_layers * layer - step
        values = batch * tokens * cfg.num_layers * (2 * cfg.hidden_size + cfg.intermediate_size)
        print(
            f"{name}: step {s * 1e3:.2f} ms; products at the calibrated rate {products * 1e3:.2f} ms; "
            f"less the fixed times {rest * 1e3:.2f} ms; left after the products {(rest - products) * 1e3:.2f} ms "
            f"({(rest - products) / values * 1e9:.2f} ns an activation value)"
        )


if __name__ == "__main__":
    main()
