"""Perplexity of one GGUF file computed natively (8-bit activation blocks, integer kernels)
against the same file's blocks dequantized to fp32 (fp32 activations), with per-token
log-likelihood differences and their standard error: the activation quantization's own cost.

    OMP_NUM_THREADS=1 python benchmarks/ppl_native_vs_dequantized.py FILE.gguf [FILE ...]
        [--quantize q4_k,q6_k] [--requantize Q4_K_M,Q5_K_M,Q6_K --dir /tmp/smolk]
        [--text data/austen/heldout.txt] [--tokens 4096] [--context 512]
        [--isa portable|avx2|avx512] [--json out.json]

Each model is loaded once and scored twice over the same disjoint windows (eval-ppl's): on the
integer kernels at every row count (the default, decode's arithmetic) and with every block-format
part dequantized a tile of rows at a time and multiplied in fp32 (SHARDWISE_PREFILL_ROWS=1: the
same weights as `--quantize none`, summed in another order). --quantize SCHEME,...: also each
file converted by shardwise's own quantizer (from its dequantized weights) and scored both ways.
--requantize KIND,...: score, instead of each file, the files llama.cpp's quantizer makes from it
(llama-cpp-python's llama_model_quantize, allow_requantize; made once into --dir; benchmarks
only). Each row lists the model's bytes per format as loaded.

For each: both perplexities, their ratio - 1, and the standard error of that ratio from the
per-token NLL differences d_t (native minus dequantized): ratio = exp(mean d), SE ~ ratio * sd(d) / sqrt(N).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import time
from pathlib import Path

import torch

import shardwise.kernels.block as block
from shardwise.comm import LocalCommunicator
from shardwise.engine.perplexity import window_nll, windows
from shardwise.gguf import gguf_tokenizer
from shardwise.hf import load_pretrained
from shardwise.kernels import native
from shardwise.quant.convert import bytes_by_format

ROOT = Path(__file__).resolve().parents[1]


def requantized(src: Path, kind: str, out_dir: Path) -> Path:
    """`src` re-quantized by llama.cpp's quantizer to `kind` (Q4_K_M, Q5_K_M, Q6_K, ...), made once."""
    import ctypes

    import llama_cpp

    out = out_dir / f"{src.name.split('.')[0]}.{kind}.gguf"
    if not out.exists():
        out_dir.mkdir(parents=True, exist_ok=True)
        p = llama_cpp.llama_model_quantize_default_params()
        p.ftype, p.allow_requantize, p.nthread = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{kind}"), True, 1
        tmp = out.with_suffix(".tmp")
        if llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), ctypes.byref(p)) != 0:
            raise SystemExit(f"llama.cpp could not quantize {src} to {kind}")
        tmp.rename(out)
    return out


def token_nll(model, ids: torch.Tensor, context: int, prefill_rows: int | None) -> torch.Tensor:
    """(scored tokens,) fp64 NLL over eval-ppl's disjoint windows, one window per forward."""
    saved, block.PREFILL_ROWS = block.PREFILL_ROWS, prefill_rows
    try:
        out = []
        with torch.no_grad():
            for w in windows(ids.numel(), context):
                x = ids[w.begin : w.end]
                out.append(window_nll(model(x[None])[0], x, w))
        return torch.cat(out)
    finally:
        block.PREFILL_ROWS = saved


def compare(model, ids: torch.Tensor, context: int) -> dict:
    t0 = time.perf_counter()
    native_nll = token_nll(model, ids, context, None)
    t1 = time.perf_counter()
    deq_nll = token_nll(model, ids, context, 1)
    t2 = time.perf_counter()
    d = native_nll - deq_nll
    ratio = math.exp(d.mean().item())
    return {
        "tokens": d.numel(),
        "ppl_native": math.exp(native_nll.mean().item()),
        "ppl_dequantized": math.exp(deq_nll.mean().item()),
        "rel": ratio - 1,
        "se": ratio * d.std().item() / math.sqrt(d.numel()),
        "native_s": t1 - t0,
        "dequantized_s": t2 - t1,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+", type=Path)
    ap.add_argument("--quantize", default="", help="comma-separated schemes to convert each file to as well")
    ap.add_argument("--requantize", default="", help="comma-separated llama.cpp types to make from each file")
    ap.add_argument("--dir", type=Path, default=Path("/tmp/smolk"), help="where --requantize writes")
    ap.add_argument("--text", type=Path, default=ROOT / "data" / "austen" / "heldout.txt")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--isa", default=None, help="force a kernel path (portable, avx2, avx512)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    rows = []
    isa = native.use_isa(args.isa) if args.isa else contextlib.nullcontext()
    with isa:
        print(f"# {platform.processor() or platform.machine()}; torch {torch.__version__} "
              f"{torch.backends.cpu.get_cpu_capability()}; kernels {native.describe()}; load {os.getloadavg()}")  # fmt: skip
        kinds = list(filter(None, args.requantize.split(",")))
        files = [requantized(f, k, args.dir) for f in args.files for k in kinds] if kinds else args.files
        for path in files:
            ids = torch.tensor(gguf_tokenizer(path).encode(args.text.read_text()).ids[: args.tokens])
            for scheme in [None, *filter(None, args.quantize.split(","))]:
                model, _ = load_pretrained(path, comm=LocalCommunicator(), quantize=scheme)
                mib = {k: round(v / 2**20, 1) for k, v in bytes_by_format(model).items()}
                r = {"file": path.name, "quantize": scheme or "(the file's own)", "MiB": mib}
                r |= compare(model, ids, args.context)
                del model
                rows.append(r)
                print(
                    f"{r['file']} {r['quantize']}: native {r['ppl_native']:.3f}, dequantized {r['ppl_dequantized']:.3f}, "
                    f"{r['rel']:+.2%} (SE {r['se']:.2%}) over {r['tokens']} tokens "
                    f"[{r['native_s']:.0f} s + {r['dequantized_s']:.0f} s; load {os.getloadavg()[0]:.1f}] MiB {mib}",
                    flush=True,
                )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
