"""What each activation quantization costs a real model, simulated in torch: a GGUF file's
blocks dequantized to fp32 (`--quantize none`'s weights), and before each linear of a chosen
weight format its input rounded as the kernels would round it, in blocks of 32 (one scale a
block), or of 256 with sub-scales m_j in 1 .. M for each 32 (csrc/sw.h's sw_a256; M = 1 is one
scale per 256, llama.cpp's Q8_K). Perplexity on held-out text against the unrounded model, with
the standard error of the per-token log-likelihood differences (as ppl_native_vs_dequantized.py).

    OMP_NUM_THREADS=1 python benchmarks/ppl_activation_blocks.py FILE.gguf \\
        Q8_0=32,Q6_K=256:1 Q8_0=32,Q6_K=256:8 Q8_0=32,Q6_K=32 [--tokens 4096] [--json out.json]

Each scheme is FORMAT=BLOCK[:M],... (formats not named keep fp32 activations). Not the kernels
(their rounding order differs): the quantization's own cost, to choose the kernels' scheme by.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import shardwise.kernels.block as block
from shardwise.comm import LocalCommunicator
from shardwise.engine.perplexity import window_nll, windows
from shardwise.gguf import gguf_tokenizer
from shardwise.hf import load_pretrained

ROOT = Path(__file__).resolve().parents[1]


class Rounding:
    """Wraps kernels.block's dequantized-tile path: each tile's F.linear sees its input rounded
    by the scheme of the format it dequantized."""

    def __init__(self) -> None:
        self.scheme: dict[str, tuple[int, int]] = {}
        self._fmt: str | None = None
        self._dequantize, self._linear = block._dequantize, F.linear
        block._dequantize = self.dequantize
        block.F = type("RoundingF", (), {"linear": staticmethod(self.linear)})

    def dequantize(self, fmt, data):
        self._fmt = fmt
        return self._dequantize(fmt, data)

    def linear(self, x, w, bias=None):
        fmt, self._fmt = self._fmt, None
        if fmt in self.scheme:
            x = block.fake_quantize(x.contiguous(), *self.scheme[fmt])
        return self._linear(x, w, bias)


def parse(spec: str) -> dict[str, tuple[int, int]]:
    out = {}
    for part in filter(None, spec.split(",")):
        fmt, how = part.split("=")
        length, _, m = how.partition(":")
        out[fmt] = (int(length), int(m or 1))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("file", type=Path)
    ap.add_argument("schemes", nargs="+")
    ap.add_argument("--text", type=Path, default=ROOT / "data" / "austen" / "heldout.txt")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    ids = torch.tensor(gguf_tokenizer(args.file).encode(args.text.read_text()).ids[: args.tokens])
    model, _ = load_pretrained(args.file, comm=LocalCommunicator())
    hook = Rounding()
    block.PREFILL_ROWS = 1  # every row through the dequantized tiles (and the hook)

    def nll() -> torch.Tensor:
        out = []
        with torch.no_grad():
            for w in windows(ids.numel(), args.context):
                x = ids[w.begin : w.end]
                out.append(window_nll(model(x[None])[0], x, w))
        return torch.cat(out)

    base = nll()
    rows = []
    for spec in args.schemes:
        hook.scheme = parse(spec)
        t0 = time.perf_counter()
        d = nll() - base
        r = math.exp(d.mean().item())
        row = {"scheme": spec, "rel": r - 1, "se": r * d.std().item() / math.sqrt(d.numel()), "tokens": d.numel()}
        rows.append(row)
        print(f"{spec}: {row['rel']:+.3%} (SE {row['se']:.3%}) over {row['tokens']} tokens "
              f"[{time.perf_counter() - t0:.0f} s]", flush=True)  # fmt: skip
    if args.json:
        args.json.write_text(
            json.dumps({"file": args.file.name, "ppl_fp32": math.exp(base.mean().item()), "rows": rows}, indent=1)
        )


if __name__ == "__main__":
    main()
