"""`shardwise embed`: sentence embeddings from an encoder (BERT) on N tensor-parallel ranks.

The texts are tokenized in the parent with the model directory's tokenizer.json (through
`tokenizers`), right-padded into one batch and checked against the model before any rank
starts; the ranks run the sharded encoder and rank 0 returns the mean of the last hidden
state over each text's real tokens (shardwise.models.pooling.mean_pool), optionally
scaled to unit L2 norm.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from shardwise.cli.common import add_model_args, add_pp_arg, add_run_args, fail, job, resolve_model
from shardwise.cli.memcheck import add_force_arg, check_inference
from shardwise.comm import Communicator, tp_only
from shardwise.engine.text import load_tokenizer
from shardwise.models.pooling import mean_pool

__all__ = ["add_parser", "run"]

SHOWN = 8  # values of each embedding printed in the human output


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("embed", help="mean-pooled sentence embeddings from an encoder (BERT) on N ranks")
    add_model_args(p)
    add_pp_arg(p)
    p.add_argument("--text", action="append", required=True, help="text to embed (repeat for a batch)")
    p.add_argument("--normalize", action="store_true", help="scale each embedding to unit L2 norm")
    add_run_args(p)
    add_force_arg(p)


def _batch(tokenizer, texts: list[str], pad_id: int) -> tuple[list[list[int]], list[list[int]], list[int]]:
    """Right-padded ids and attention mask, each (B, T) as lists, and each text's token count."""
    tokenizer.no_padding()  # we pad, on the right, as BERT expects
    rows = [enc.ids for enc in tokenizer.encode_batch(texts)]
    T = max(len(r) for r in rows)
    ids = [r + [pad_id] * (T - len(r)) for r in rows]  # (B, T)
    mask = [[1] * len(r) + [0] * (T - len(r)) for r in rows]  # (B, T)
    return ids, mask, [len(r) for r in rows]


def _embed_rank(world: Communicator, opts: dict) -> dict:
    from shardwise.hf import load_pretrained

    tp = tp_only(world)
    model, report = load_pretrained(opts["model"], comm=tp, dtype=opts["dtype"], quantize=opts.get("quantize"))
    ids = torch.tensor(opts["ids"])  # (B, T)
    mask = torch.tensor(opts["mask"])  # (B, T)
    with torch.no_grad():
        hidden = model(ids, attention_mask=mask)  # (B, T, H), token types 0
    emb = mean_pool(hidden, mask, normalize=opts["normalize"])  # (B, H)
    return {
        "tp": tp.size,
        "backend": tp.backend,
        "dtype": report.config.dtype,
        "embeddings": emb.float().tolist(),
    }


def run(args: argparse.Namespace) -> int:
    model_dir, cfg = resolve_model(args.model, args.tp, quantize=args.quantize)
    if args.pp != 1:  # NOTE: stages are cut from a DecoderLM (shardwise.pipeline.stage); BertEncoder has none
        return fail(f"--pp {args.pp}: pipeline stages need a decoder family; embed's encoders (bert) run at --pp 1")
    if cfg.causal:
        return fail(
            f"{model_dir}: a {cfg.family} model is a decoder; embed needs an encoder (supported: bert), "
            "e.g. `shardwise generate` for decoders"
        )
    tokenizer = load_tokenizer(model_dir)
    if tokenizer is None:
        return fail(f"{model_dir} has no tokenizer.json; embed needs it to tokenize --text")
    try:
        pad_id = int(json.loads((model_dir / "config.json").read_text()).get("pad_token_id") or 0)
    except (OSError, ValueError, TypeError):
        pad_id = 0
    ids, mask, lengths = _batch(tokenizer, args.text, pad_id)
    for i, (row, n) in enumerate(zip(ids, lengths, strict=True)):
        if n == 0:
            return fail(f"--text {i} ({args.text[i]!r}) has no tokens")
        if n > cfg.max_positions:
            return fail(f"--text {i} has {n} tokens; the model takes at most {cfg.max_positions}")
        bad = [t for t in row[:n] if not 0 <= t < cfg.vocab_size]
        if bad:
            return fail(f"--text {i}: token id {bad[0]} is outside the model's vocabulary of {cfg.vocab_size}")
    opts = {
        "model": str(model_dir),
        "dtype": args.dtype,
        "quantize": args.quantize,
        "ids": ids,
        "mask": mask,
        "normalize": args.normalize,
    }
    check_inference(
        cfg, tp=args.tp, pp_layers=None, dtype=args.dtype, quantize=args.quantize, expert_parallel=False,
        batch=len(ids), prompt_len=max(lengths), kv_tokens=0, backend=args.backend, force=args.force,
    )  # fmt: skip
    r = job(
        _embed_rank,
        args.tp,
        opts,
        backend=args.backend,
        timeout_s=args.timeout,
        allow_cross_host_tp=args.allow_cross_host_tp,
    )
    if r is None:  # a non-zero rank under an external launcher
        return 0
    emb = r["embeddings"]
    dim = len(emb[0])
    if args.json:
        out = {"tp": r["tp"], "backend": r["backend"], "dim": dim, "normalized": args.normalize, "embeddings": emb}
        print(json.dumps(out))
        return 0
    how = "mean-pooled over real tokens" + (", L2-normalized" if args.normalize else "")
    print(f"embed: {cfg.family} model at {model_dir}, tp={r['tp']} ({r['backend']}), {r['dtype']}, {how}\n")
    for i, (text, n, e) in enumerate(zip(args.text, lengths, emb, strict=True)):
        shown = ", ".join(f"{v:+.4f}" for v in e[:SHOWN])
        more = ", ..." if dim > SHOWN else ""
        print(f"[{i}] {text!r} ({n} tokens): dim {dim}: [{shown}{more}]")
    if len(emb) > 1:
        unit = F.normalize(torch.tensor(emb), dim=-1)  # (B, H)
        cos = (unit @ unit.T).tolist()  # (B, B)
        print("\ncosine similarity:")
        print("     " + "".join(f"{f'[{j}]':>8}" for j in range(len(emb))))
        for i, row in enumerate(cos):
            print(f"{f'[{i}]':<5}" + "".join(f"{c:>8.4f}" for c in row))
    return 0
