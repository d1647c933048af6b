"""`shardwise eval-ppl`: perplexity of a causal LM on a text file, at any tp x pp layout.

The text is read and tokenized with the model's tokenizer here, in the parent, and every
input check (model, tp and pp sizes, file, length, context, stride) runs before any rank
starts; then the tp * pp ranks load the model as `generate` does and score the text with
sliding windows (shardwise.engine.perplexity: Hugging Face's recipe, each token scored
once from the window's tokens before it).

    $ shardwise eval-ppl --text data/austen/heldout.txt --tp 1
    eval-ppl: data/austen/heldout.txt, default model, tp=1 (local), float32
    34,482 tokens, 135 windows of 256 tokens (stride 256): 34,347 scored
    mean NLL 2.7136 nats/token, perplexity 15.084 (6.2 s, 5,550 tokens/s)

    $ shardwise eval-ppl --text data/austen/heldout.txt --tp 2
    eval-ppl: data/austen/heldout.txt, default model, tp=2 (mpi), float32
    34,482 tokens, 135 windows of 256 tokens (stride 256): 34,347 scored
    mean NLL 2.7136 nats/token, perplexity 15.084 (8.4 s, 4,100 tokens/s)

(the built-in model on *Emma*'s opening, a novel it was not trained on; tp=1 and tp=2
agree to 7e-10 relative; times on a 2-core CPU). NOTE: that model was trained on 128-token
sequences, so positions past 128 are new to it: at --context 128 its perplexity is 9.890
(--stride 64: 9.639). --json prints one object: the layout, context, stride, text_tokens,
windows, tokens_scored, nll (mean, nats), ppl and wall_s.

A model without shardwise code is scored through the automatic plan (shardwise.hf.auto) at
any tp `verify` accepts, with the same windows (shardwise.engine.auto: transformers' module
behind DecoderLM's calls); it has no pipeline stages (--pp 1).

Exit status: 0, or 2 for bad input (a one-line error), 1 when a rank fails.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from shardwise.cli.common import (
    add_comm_dtype_arg,
    add_expert_parallel_arg,
    add_model_args,
    add_pp_arg,
    add_run_args,
    fail,
    job,
    resolve_auto,
    resolve_model,
    resolve_stages,
)
from shardwise.comm import Communicator, ParallelDims, tp_only
from shardwise.engine.auto import AutoLM
from shardwise.engine.perplexity import check_windows, perplexity
from shardwise.engine.pipeline import StageForward
from shardwise.engine.text import DEFAULT_MODEL, load_tokenizer
from shardwise.log import setup_logging
from shardwise.pipeline.stage import StageLayout

__all__ = ["add_parser", "run"]

DEFAULT_CONTEXT = 256


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval-ppl", help="perplexity of a causal LM on a text file (sliding windows)")
    p.add_argument("--text", type=Path, required=True, help="UTF-8 text file to score")
    add_model_args(p)
    add_pp_arg(p)
    add_expert_parallel_arg(p)
    p.add_argument(
        "--context",
        type=int,
        default=None,
        help=f"tokens per window (default {DEFAULT_CONTEXT}, or the model's max positions if fewer)",
    )
    p.add_argument(
        "--stride", type=int, default=None, help="tokens between window starts, <= --context (default: --context)"
    )
    p.add_argument("--max-tokens", type=int, default=None, help="score only the text's first N tokens")
    p.add_argument("--batch", type=int, default=4, help="windows per forward (default 4)")
    add_run_args(p)
    add_comm_dtype_arg(p)


def _tokens(path: Path, model_dir: Path, max_tokens: int | None) -> list[int]:
    """The text's token ids (its first max_tokens); ValueError with a one-line reason."""
    if not path.is_file():
        raise ValueError(f"--text {path}: no such file")
    tok = load_tokenizer(model_dir)
    if tok is None:
        raise ValueError(f"{model_dir} has no tokenizer.json to tokenize --text with")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"--text {path} is not UTF-8 ({e.reason} at byte {e.start})") from None
    if max_tokens is not None and max_tokens < 2:
        raise ValueError(f"--max-tokens must be >= 2, got {max_tokens}")
    return tok.encode(text).ids[:max_tokens]


def _ppl_rank(world: Communicator, opts: dict) -> dict:
    setup_logging(world.rank, world.size)
    from shardwise.hf import load_pretrained
    from shardwise.planner.wire import choose_wire

    pp = opts["pp"]
    mesh = stage = None
    if pp == 1:
        tp = tp_only(world)
    else:
        mesh = ParallelDims(world_size=world.size, tp=world.size // pp, pp=pp).build(world)
        tp, stage = mesh.tp, (StageLayout.build(opts["num_layers"], pp, pp_layers=opts["pp_layers"]), mesh.pp_rank)
    # NOTE: passed only when set, so this runs with and without load_pretrained's quantize=
    quantize = {"quantize": opts["quantize"]} if opts.get("quantize") is not None else {}
    model, report = load_pretrained(
        opts["model"],
        comm=tp,
        dtype=opts["dtype"],
        progress=world.rank == 0 and opts["progress"],
        stage=stage,
        expert_parallel=opts["expert_parallel"],
        **quantize,
    )
    if opts.get("auto"):  # transformers' module: driven through DecoderLM's calls
        model = AutoLM(model)
    tp.wire = choose_wire(opts.get("comm_dtype", "auto"), tp, world, values=opts["batch"] * model.cfg.hidden_size)
    res = perplexity(
        model,
        opts["ids"],
        context=opts["context"],
        stride=opts["stride"],
        batch=opts["batch"],
        stages=StageForward(model, mesh) if mesh is not None else None,
        progress=world.rank == 0 and opts["progress"],
    )
    return {
        "text": opts["text"],
        "model": opts["model_name"],
        "family": report.family,
        "tp": tp.size,
        "pp": pp,
        "backend": tp.backend,
        "dtype": model.cfg.dtype,
        "quantize": opts.get("quantize"),
        "comm_dtype": tp.wire,
        "context": opts["context"],
        "stride": opts["stride"],
        "batch": opts["batch"],
        "text_tokens": len(opts["ids"]),
        "windows": res.windows,
        "tokens_scored": res.tokens,
        "nll": res.mean_nll,
        "ppl": res.ppl,
        "wall_s": round(res.wall_s, 3),
        "tokens_per_s": round(res.tokens / res.wall_s, 1),
    }


def run(args: argparse.Namespace) -> int:
    model_dir, cfg = resolve_model(  # auto: models without shardwise code (cfg None)
        args.model, args.tp, auto=True, expert_parallel=args.expert_parallel, quantize=args.quantize
    )
    if cfg is None:  # the automatic plan
        sizes, layout = resolve_auto(model_dir, args.pp, args.pp_layers, command="eval-ppl"), None
    elif not cfg.causal:
        return fail(f"eval-ppl needs a causal LM; {model_dir} is a {cfg.family} encoder")
    else:
        sizes, layout = cfg, resolve_stages(cfg, args.tp, args.pp, args.pp_layers)
    context = min(DEFAULT_CONTEXT, sizes.max_positions) if args.context is None else args.context
    stride = context if args.stride is None else args.stride
    try:
        if args.batch < 1:
            raise ValueError(f"--batch must be >= 1, got {args.batch}")
        ids = _tokens(args.text, model_dir, args.max_tokens)
        check_windows(len(ids), context, stride, sizes.max_positions)
    except ValueError as e:
        return fail(str(e))
    opts = {
        "model": str(model_dir),
        "model_name": "default" if model_dir == DEFAULT_MODEL else str(model_dir),
        "text": str(args.text),
        "dtype": args.dtype,
        "quantize": getattr(args, "quantize", None),  # add_model_args' --quantize, where it has one
        "ids": ids,
        "context": context,
        "stride": stride,
        "batch": args.batch,
        "progress": not args.json,
        "pp": args.pp,
        "auto": cfg is None,
        "num_layers": cfg.num_layers if cfg is not None else 0,
        "pp_layers": layout.layers if layout is not None else None,
        "expert_parallel": args.expert_parallel,
        "comm_dtype": args.comm_dtype,
    }
    r = job(
        _ppl_rank,
        args.tp * args.pp,
        opts,
        tp=args.tp,
        backend=args.backend,
        timeout_s=args.timeout,
        allow_cross_host_tp=args.allow_cross_host_tp,
    )
    if r is None:  # a non-zero rank under an external launcher
        return 0
    if args.json:
        print(json.dumps(r))
        return 0
    where = f"tp={r['tp']}" if r["pp"] == 1 else f"tp={r['tp']} x pp={r['pp']}"
    quant = f", automatic plan ({r['family']})" if opts["auto"] else ""
    quant += f", weights {r['quantize']}" if r["quantize"] else ""
    quant += f", {r['comm_dtype']} on the wire" if r["comm_dtype"] != "fp32" else ""
    print(f"eval-ppl: {r['text']}, {r['model']} model, {where} ({r['backend']}), {r['dtype']}{quant}")
    print(
        f"{r['text_tokens']:,} tokens, {r['windows']:,} windows of {r['context']} tokens "
        f"(stride {r['stride']}): {r['tokens_scored']:,} scored"
    )
    print(
        f"mean NLL {r['nll']:.4f} nats/token, perplexity {r['ppl']:.3f} "
        f"({r['wall_s']:.1f} s, {r['tokens_per_s']:,.0f} tokens/s)"
    )
    return 0
