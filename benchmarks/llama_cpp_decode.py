"""llama.cpp's decode speed on a GGUF file, for benchmarks/bench_native.py: run by an
interpreter with llama-cpp-python installed (its own venv; shardwise never imports it).

    /tmp/llamacpp/venv/bin/python benchmarks/llama_cpp_decode.py FILE --threads 2 [--batches 1 4 16]

Prints one JSON line: "ms" (per batch size, the median decode step of --new steps after
--warm), "argmax" (the next-token argmax at every position of the prompt, taken from one
batch that asks for every position's logits) and "greedy" (--warm + --new greedy tokens
of the batch-1 run). Through llama.cpp's C API (llama_decode on a llama_batch), as
llama-cli and llama-bench call it: no BOS is added, prompts are token ids. Batch b is b
sequences in one context (n_seq_max = b), prompt i of them the shared prompt's ids + 7 i,
each step one token a sequence: its own greedy pick (the argmax is inside the timed step,
as shardwise's generate samples inside its step).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import llama_cpp as L
import numpy as np

_QUIET = L.llama_log_callback(lambda level, text, data: None)
"""Drops llama.cpp's log lines; NOTE: ctypes must keep the callback alive while the library can call it."""


def _batch(seqs: list[list[int]], start: int, *, every_logit: bool = False) -> L.llama_batch:
    """One llama_batch of every sequence's tokens from position `start`; logits for each
    sequence's last token (or for every token)."""
    n = sum(len(s) for s in seqs)
    b = L.llama_batch_init(n, 0, 1)
    k = 0
    for sid, toks in enumerate(seqs):
        for j, t in enumerate(toks):
            b.token[k], b.pos[k], b.n_seq_id[k] = t, start + j, 1
            b.seq_id[k][0] = sid
            b.logits[k] = every_logit or j == len(toks) - 1
            k += 1
    b.n_tokens = n
    return b


class Context:
    """A llama.cpp context of `seqs` sequences of up to `per_seq` positions each."""

    def __init__(self, model, threads: int, seqs: int, per_seq: int, n_vocab: int) -> None:
        p = L.llama_context_default_params()
        p.n_ctx, p.n_seq_max = seqs * per_seq, seqs
        p.n_batch = p.n_ubatch = seqs * per_seq
        p.n_threads = p.n_threads_batch = threads
        self.ctx = L.llama_init_from_model(model, p)
        if not self.ctx:
            raise RuntimeError("llama_init_from_model failed")
        self.n_vocab = n_vocab

    def decode(self, seqs: list[list[int]], start: int, *, every_logit: bool = False) -> np.ndarray:
        """Logits (rows, vocab) of the positions asked for, in batch order."""
        b = _batch(seqs, start, every_logit=every_logit)
        try:
            rc = L.llama_decode(self.ctx, b)
            if rc != 0:
                raise RuntimeError(f"llama_decode returned {rc}")
            rows = [i for i in range(b.n_tokens) if b.logits[i]]
            return np.stack([np.ctypeslib.as_array(L.llama_get_logits_ith(self.ctx, i), (self.n_vocab,)) for i in rows])
        finally:
            L.llama_batch_free(b)

    def close(self) -> None:
        L.llama_free(self.ctx)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("file")
    ap.add_argument("--threads", type=int, required=True)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--prompt", type=int, nargs="+", required=True)
    ap.add_argument("--warm", type=int, default=3)
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument(
        "--no-extra-bufts",
        action="store_true",
        help="no extra buffer types (AMX, repacked weights): where the AMX path crashes (a VM without the AMX state)",
    )
    args = ap.parse_args()
    L.llama_log_set(_QUIET, None)
    L.llama_backend_init()
    mp = L.llama_model_default_params()
    mp.use_mmap = True
    if args.no_extra_bufts and hasattr(mp, "use_extra_bufts"):
        mp.use_extra_bufts = False  # no AMX or repacked buffers (llama-bench --no-extra-bufts)
    model = L.llama_model_load_from_file(args.file.encode(), mp)
    if not model:
        raise RuntimeError(f"llama.cpp could not load {args.file}")
    n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    steps = args.warm + args.new
    per_seq = len(args.prompt) + steps + 1
    system = f"llama-cpp-python {L.__version__}, {L.llama_print_system_info().decode().strip()}"
    out = {"threads": args.threads, "system": system, "ms": {}}

    ctx = Context(model, args.threads, 1, per_seq, n_vocab)
    out["argmax"] = ctx.decode([args.prompt], 0, every_logit=True).argmax(-1).tolist()
    ctx.close()
    for b in args.batches:
        seqs = [[(t + 7 * i) % n_vocab for t in args.prompt] for i in range(b)]
        ctx = Context(model, args.threads, b, per_seq, n_vocab)
        tok = ctx.decode(seqs, 0).argmax(-1)  # (b,)
        greedy, times = [int(tok[0])], []
        for s in range(steps):
            t0 = time.perf_counter()
            tok = ctx.decode([[int(t)] for t in tok], len(args.prompt) + s).argmax(-1)
            times.append((time.perf_counter() - t0) * 1e3)
            greedy.append(int(tok[0]))
        ctx.close()
        out["ms"][b] = statistics.median(times[args.warm :])
        if b == 1:
            out["greedy"] = greedy
    L.llama_model_free(model)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
