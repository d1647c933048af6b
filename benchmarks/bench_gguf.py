"""Loading a GGUF file sharded: load time and peak memory per rank at tp=1 and tp=2, against
transformers' own GGUF load (which dequantizes the whole file in one process).

    .venv/bin/python benchmarks/bench_gguf.py [--file PATH] [--layers 16] [--dtype float32]
    .venv/bin/python benchmarks/bench_gguf.py --decode --skip-load     # decode against llama.cpp

The file is a Llama-3.2-1B-shaped model (hidden 2048, MLP 8192, 32 query / 8 KV heads of 64,
vocabulary 128256, tied embeddings: 1.24B parameters) in Q8_0, made here once from random
valid blocks (random int8 weights, fp16 scales of 0.01/127) with the `gguf` package's writer;
no download. Each configuration runs once, in fresh processes: shardwise through
shardwise.launch (one process per rank), transformers in one spawned process. Peak memory is
RssAnon above the process's baseline after imports (shardwise.memory.PeakAnonMemory); the
file's pages are shared page cache, not anonymous memory, and the file is read once before
timing so that both loaders start from a warm cache.

--decode: decode ms per token on the same file, shardwise (fp32 and --quantize int8, tp 1
and 2, one thread per rank) against llama.cpp (llama-cpp-python, 1 and 2 threads), batch 1,
a 32-token prompt of fixed ids, the median of 16 steps after a warm-up. The file carries a
placeholder SentencePiece-style vocabulary (<unk>, <s>, </s>, the 256 byte tokens, then
<tN>) only because llama.cpp refuses a file without one; prompts are token ids.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from shardwise.comm import tp_only
from shardwise.launch import launch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from gguf_files import add_spm_vocabulary, placeholder_vocabulary, write_metadata  # noqa: E402

MiB = 2**20
SHAPE = dict(hidden=2048, inter=8192, heads=32, kv=8, head_dim=64, vocab=128256)


def _matrices(layers: int) -> list[tuple[str, int, int]]:
    """(GGUF name, rows, cols) of every matrix of the file, the embedding first."""
    h, i, nq, nkv, hd, v = (SHAPE[k] for k in ("hidden", "inter", "heads", "kv", "head_dim", "vocab"))
    out = [("token_embd.weight", v, h)]
    for b in range(layers):
        for name, rows, cols in (
            ("attn_q", nq * hd, h),
            ("attn_k", nkv * hd, h),
            ("attn_v", nkv * hd, h),
            ("attn_output", h, nq * hd),
            ("ffn_gate", i, h),
            ("ffn_up", i, h),
            ("ffn_down", h, i),
        ):
            out.append((f"blk.{b}.{name}.weight", rows, cols))
    return out


def make_file(path: Path, layers: int) -> Path:
    """A Llama-shaped Q8_0 GGUF file of random valid blocks of `layers` layers, made once:
    written beside `path` and renamed over it, so that a killed run leaves no partial file.
    An existing file is used if its size fits `layers` (its tensors alone are 34 bytes a
    32 weights, plus a few MiB of vocabulary and padding); else ValueError."""
    import gguf

    tensors = sum(r * c // 32 * 34 for _, r, c in _matrices(layers)) + (2 * layers + 1) * SHAPE["hidden"] * 4
    if path.exists():
        size = path.stat().st_size
        if not tensors < size < tensors + 16 * MiB:
            raise ValueError(
                f"{path} has {size} bytes, not the {tensors} bytes of tensors (+ under 16 MiB of metadata) "
                f"of a {layers}-layer file: another layer count or a partial file; remove it to remake it"
            )
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    h, i, nq, nkv, hd, v = (SHAPE[k] for k in ("hidden", "inter", "heads", "kv", "head_dim", "vocab"))
    tmp = path.with_name(path.name + ".tmp")
    w = gguf.GGUFWriter(str(tmp), "llama")
    w.add_name("random-llama-1b")
    cfg = dict(model_type="llama", hidden_size=h, intermediate_size=i, num_hidden_layers=layers,
               num_attention_heads=nq, num_key_value_heads=nkv, head_dim=hd, max_position_embeddings=8192,
               rms_norm_eps=1e-5, rope_theta=500000.0)  # fmt: skip
    write_metadata(w, cfg)
    w.add_vocab_size(v)
    add_spm_vocabulary(w, placeholder_vocabulary(v))
    rng = np.random.default_rng(0)
    q8 = gguf.GGMLQuantizationType.Q8_0
    scale = np.frombuffer(np.float16(0.01 / 127).tobytes(), np.uint8)

    def q8_0(rows: int, cols: int) -> np.ndarray:
        blocks = rng.integers(0, 256, size=(rows, cols // 32, 34), dtype=np.uint8)
        blocks[:, :, 0:2] = scale
        return blocks.reshape(rows, -1)

    [embedding, *matrices] = _matrices(layers)
    w.add_tensor(embedding[0], q8_0(v, h), raw_dtype=q8)
    w.add_tensor("output_norm.weight", np.ones(h, np.float32))
    for b in range(layers):
        for name, rows, cols in matrices[7 * b : 7 * b + 7]:
            w.add_tensor(name, q8_0(rows, cols), raw_dtype=q8)
        w.add_tensor(f"blk.{b}.attn_norm.weight", np.ones(h, np.float32))
        w.add_tensor(f"blk.{b}.ffn_norm.weight", np.ones(h, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tmp.rename(path)
    return path


def _shardwise_rank(world, path: str, dtype: str, quantize: str | None = None) -> dict:
    import gc

    from shardwise.hf import load_pretrained
    from shardwise.memory import PeakAnonMemory, import_meta_kernels

    import_meta_kernels()
    gc.collect()
    t0 = time.perf_counter()
    with PeakAnonMemory() as mem:
        model, report = load_pretrained(path, comm=tp_only(world), dtype=dtype, quantize=quantize)
    return {
        "seconds": time.perf_counter() - t0,
        "peak": mem.peak_above_baseline,
        "params": report.param_bytes,
        "read": report.bytes_read,
    }


def _transformers(path: str, dtype: str, out) -> None:
    import gc

    import torch
    import transformers

    from shardwise.memory import PeakAnonMemory

    transformers.logging.set_verbosity_error()
    gc.collect()
    t0 = time.perf_counter()
    with PeakAnonMemory() as mem:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(Path(path).parent), gguf_file=Path(path).name, dtype=getattr(torch, dtype)
        )
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    out.put({"seconds": time.perf_counter() - t0, "peak": mem.peak_above_baseline, "params": params})


PROMPT = [(37 * i + 300) % SHAPE["vocab"] for i in range(32)]
NEW = 16


def _decode_rank(world, path: str, quantize: str | None) -> float:
    from shardwise.engine import generate
    from shardwise.hf import load_pretrained

    tp = tp_only(world)
    model, _ = load_pretrained(path, comm=tp, quantize=quantize)
    generate(model, [PROMPT], comm=tp, max_new_tokens=4)  # warm-up
    return statistics.median(generate(model, [PROMPT], comm=tp, max_new_tokens=NEW + 1).decode_ms)


def _llama_cpp(path: str, threads: int, out) -> None:
    from llama_cpp import Llama

    llm = Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=128, verbose=False)
    times = []
    for r in range(2):  # the first is a warm-up
        llm.reset()
        llm.eval(PROMPT)
        for i in range(NEW):
            t0 = time.perf_counter()
            llm.eval([(11 * i + 500) % SHAPE["vocab"]])
            if r:
                times.append((time.perf_counter() - t0) * 1e3)
    out.put(statistics.median(times))


def decode_table(path: Path) -> None:
    print("\ndecode ms per token (median of 16 steps, batch 1, 32-token prompt)\n")
    print("| engine | weights | ranks x threads | ms/token |")
    print("|---|---|---|---|")
    for quantize in (None, "int8"):
        for tp in (1, 2):
            [ms, *_] = launch(_decode_rank, tp, args=(str(path), quantize), timeout_s=1800)
            print(f"| shardwise | {quantize or 'fp32'} | {tp} x 1 | {ms:.1f} |", flush=True)
    ctx = mp.get_context("spawn")
    for threads in (1, 2):
        q = ctx.Queue()
        p = ctx.Process(target=_llama_cpp, args=(str(path), threads, q))
        p.start()
        print(f"| llama.cpp | Q8_0 | 1 x {threads} | {q.get(timeout=1800):.1f} |", flush=True)
        p.join()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--file", type=Path, default=Path("/tmp/shardwise-bench/random-llama-1b-v2.q8_0.gguf"))
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--quantize", choices=["int8", "fp16"], default=None, help="shardwise only")
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2], help="tensor-parallel sizes of the load table")
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--skip-load", action="store_true", help="no load table")
    ap.add_argument("--decode", action="store_true", help="decode speed against llama.cpp")
    args = ap.parse_args()
    t0 = time.perf_counter()
    path = make_file(args.file, args.layers)
    print(f"file: {path} ({path.stat().st_size / MiB:.0f} MiB, made/found in {time.perf_counter() - t0:.0f} s)")
    with path.open("rb") as f:  # warm the page cache for every loader alike
        while f.read(1 << 26):
            pass
    if not args.skip_load:
        load_table(path, args)
    if args.decode:
        decode_table(path)


def load_table(path: Path, args) -> None:
    rows = []
    for tp in args.tp:
        r = launch(_shardwise_rank, tp, args=(str(path), args.dtype, args.quantize), timeout_s=1200)
        rows.append((f"shardwise tp={tp}", r))
    if not args.skip_transformers and args.quantize is None:
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        p = ctx.Process(target=_transformers, args=(str(path), args.dtype, q))
        p.start()
        rows.append(("transformers (one process)", [q.get(timeout=3600)]))
        p.join()
    what = f"--quantize {args.quantize}" if args.quantize else f"{args.dtype} weights"
    print(f"\n{what}, Q8_0 file, each configuration run once\n")
    print(
        "| loader | load s (slowest rank) | peak anonymous MiB per rank | parameter MiB per rank | MiB read per rank |"
    )
    print("|---|---|---|---|---|")
    for label, r in rows:
        peaks = ", ".join(f"{x['peak'] / MiB:.0f}" for x in r)
        params = ", ".join(f"{x['params'] / MiB:.0f}" for x in r)
        read = ", ".join(f"{x['read'] / MiB:.0f}" for x in r) if "read" in r[0] else "whole file"
        print(f"| {label} | {max(x['seconds'] for x in r):.1f} | {peaks} | {params} | {read} |")


if __name__ == "__main__":
    main()
