"""llama.cpp's own perplexity cost on a GGUF file, beside shardwise's: both engines against the
same file's blocks dequantized to fp32 (shardwise, fp32 activations), on the same tokens and
windows (eval-ppl's disjoint windows of --context). Is what the native kernels cost on a real
model (8-bit activation blocks) shardwise's alone, or the arithmetic both engines share?

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/ppl_llama_cpp.py /tmp/smolk/SmolLM2-135M-Instruct.Q6_K.gguf \\
        [--llama-python /tmp/llamacpp/venv/bin/python] [--tokens 4096] [--context 512] [--json out.json]

llama.cpp (llama-cpp-python, in its own venv: never a dependency of shardwise) runs in a child
process (`--worker`), one thread, each window evaluated with logits for every position; the
token ids are shardwise's tokenization of --text (the file's own tokenizer), passed as they are
(no BOS added by either engine). Per token: NLL differences against the dequantized model,
their mean as a perplexity ratio and its standard error (as ppl_native_vs_dequantized.py).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LLAMA_VENV = Path("/tmp/llamacpp/venv/bin/python")


def worker(path: str, ids_file: str, out_file: str, context: int, batch: int) -> None:
    """In llama-cpp-python's interpreter: per-token NLL of every window, to out_file (JSON)."""
    import llama_cpp
    import numpy as np

    data = json.loads(Path(ids_file).read_text())  # {"ids": [...], "windows": [[begin, end, first], ...]}
    llm = llama_cpp.Llama(model_path=path, n_ctx=context, n_batch=batch, n_threads=1, logits_all=True, verbose=False)
    nll = []
    for begin, end, first in data["windows"]:
        toks = data["ids"][begin:end]
        llm.reset()
        llm.eval(toks)
        logits = np.asarray(llm.scores[: len(toks)], dtype=np.float64)  # (T, V)
        lo, hi = first - begin, end - begin
        z = logits[lo - 1 : hi - 1]
        logp = z - z.max(-1, keepdims=True)
        logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
        nll += (-logp[np.arange(hi - lo), toks[lo:hi]]).tolist()
    Path(out_file).write_text(json.dumps(nll))


def stats(d, torch) -> tuple[float, float]:
    ratio = math.exp(d.mean().item())
    return ratio - 1, ratio * d.std().item() / math.sqrt(d.numel())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("file", type=Path)
    ap.add_argument("--llama-python", default=str(LLAMA_VENV if LLAMA_VENV.exists() else sys.executable))
    ap.add_argument("--text", type=Path, default=ROOT / "data" / "austen" / "heldout.txt")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--llama-batch", type=int, default=0,
                    help="llama.cpp's n_batch (default: --context; 1 runs every token through its decode path)")  # fmt: skip
    ap.add_argument("--worker", nargs=4, metavar=("IDS", "OUT", "CONTEXT", "BATCH"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(str(args.file), args.worker[0], args.worker[1], int(args.worker[2]), int(args.worker[3]))
        return

    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from ppl_native_vs_dequantized import token_nll

    from shardwise.comm import LocalCommunicator
    from shardwise.engine.perplexity import windows
    from shardwise.gguf import gguf_tokenizer
    from shardwise.hf import load_pretrained

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    ids = torch.tensor(gguf_tokenizer(args.file).encode(args.text.read_text()).ids[: args.tokens])
    model, _ = load_pretrained(args.file, comm=LocalCommunicator())
    native = token_nll(model, ids, args.context, None)
    deq = token_nll(model, ids, args.context, 1)
    del model
    with tempfile.TemporaryDirectory() as tmp:
        ids_file, out_file = Path(tmp) / "ids.json", Path(tmp) / "nll.json"
        wins = [[w.begin, w.end, w.first] for w in windows(ids.numel(), args.context)]
        ids_file.write_text(json.dumps({"ids": ids.tolist(), "windows": wins}))
        batch = args.llama_batch or args.context
        cmd = [args.llama_python, __file__, str(args.file), "--worker", str(ids_file), str(out_file), str(args.context)]
        cmd.append(str(batch))
        subprocess.run(cmd, check=True, timeout=3600)
        llama = torch.tensor(json.loads(out_file.read_text()), dtype=torch.float64)
    rows = {}
    for name, nll in (("shardwise native", native), ("llama.cpp", llama)):
        rel, se = stats(nll - deq, torch)
        rows[name] = {"ppl": math.exp(nll.mean().item()), "rel": rel, "se": se}
    rows["dequantized (shardwise, fp32)"] = {"ppl": math.exp(deq.mean().item())}
    rel, se = stats(native - llama, torch)
    rows["shardwise native against llama.cpp"] = {"rel": rel, "se": se}
    print(f"{args.file.name}, {deq.numel()} tokens, windows of {args.context}:")
    for name, r in rows.items():
        cells = [f"perplexity {r['ppl']:.3f}"] if "ppl" in r else []
        if "rel" in r:
            cells.append(f"{r['rel']:+.2%} (SE {r['se']:.2%})")
        print(f"  {name}: {', '.join(cells)}")
    if args.json:
        args.json.write_text(json.dumps({"file": args.file.name, "tokens": deq.numel(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
