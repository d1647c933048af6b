"""`shardwise generate`: text generation on N tensor-parallel ranks (times --pp pipeline stages).

Everything that can be wrong with the input (model directory, tp size, prompts) is
checked here, in the parent, before any rank starts; then the ranks are started
(or joined, under torchrun / mpiexec) and rank 0 streams the text.

A model without shardwise code runs through the automatic plan (shardwise.hf.auto) at any
tp `verify` accepts, on transformers' own KV cache (shardwise.engine.auto); it has no
pipeline stages (--pp 1).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

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
from shardwise.cli.memcheck import add_force_arg, check_inference
from shardwise.comm import Communicator, ParallelDims, tp_only
from shardwise.engine import PromptError, SamplingParams, StageForward, generate, validate_prompts
from shardwise.engine.auto import AutoLM
from shardwise.engine.pipeline import gather_snapshots
from shardwise.engine.text import DEFAULT_MODEL, StreamDecoder, load_tokenizer, stop_ids
from shardwise.launch.env import resolve_backend
from shardwise.log import get_logger, setup_logging
from shardwise.memory import PeakAnonMemory
from shardwise.pipeline.stage import StageLayout

__all__ = ["add_parser", "run"]

DEFAULT_PROMPT = "Tensor parallelism splits each layer"
log = get_logger("generate")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text on N tensor-parallel ranks")
    add_model_args(p)
    add_pp_arg(p)
    add_expert_parallel_arg(p)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", action="append", help="prompt text (repeat for a batch)")
    src.add_argument("--prompt-ids", action="append", help="prompt token ids, comma-separated (repeat for a batch)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at the end-of-sequence token")
    p.add_argument("--compare-tp1", action="store_true", help="also run at tp=1 and report whether the tokens match")
    p.add_argument("--debug-fail-rank", type=int, default=None, help=argparse.SUPPRESS)  # fault injection for tests
    add_run_args(p)
    add_comm_dtype_arg(p)
    add_force_arg(p)


def _prompts(args, model_dir: Path) -> list[list[int]]:
    if args.prompt_ids:
        try:
            return [[int(x) for x in s.split(",") if x.strip()] for s in args.prompt_ids]
        except ValueError:
            raise PromptError(f"--prompt-ids takes comma-separated integers, got {args.prompt_ids}") from None
    texts = args.prompt or [DEFAULT_PROMPT]
    tok = load_tokenizer(model_dir)
    if tok is None:
        raise PromptError(f"{model_dir} has no tokenizer.json; pass --prompt-ids instead of --prompt")
    return [tok.encode(t).ids for t in texts]


def _generate_rank(world: Communicator, opts: dict) -> dict:
    setup_logging(world.rank, world.size)
    from shardwise.hf import load_pretrained
    from shardwise.planner.wire import choose_wire
    from shardwise.quant.layout import decode_layout

    pp = opts.get("pp", 1)
    mesh = stage = None
    if pp == 1:
        tp = tp_only(world)
    else:
        mesh = ParallelDims(world_size=world.size, tp=world.size // pp, pp=pp).build(world)
        tp, stage = mesh.tp, (StageLayout.build(opts["num_layers"], pp, pp_layers=opts["pp_layers"]), mesh.pp_rank)
    with PeakAnonMemory() as mem:
        model, report = load_pretrained(
            opts["model"],
            comm=tp,
            dtype=opts["dtype"],
            progress=world.rank == 0 and opts["progress"],
            stage=stage,
            expert_parallel=opts.get("expert_parallel", False),
            quantize=opts.get("quantize"),
        )
    if opts.get("auto"):  # transformers' module: driven through DecoderLM's calls
        model = AutoLM(model)
    tp.wire = choose_wire(
        opts.get("comm_dtype", "auto"), tp, world, values=len(opts["prompts"]) * model.cfg.hidden_size
    )
    decode_layout(model, rows=len(opts["prompts"]))  # fp32 on CPU: the weight order measured fastest
    log.debug("rank %d/%d holds %.1f MiB of parameters", world.rank, world.size, report.param_bytes / 2**20)
    if opts["fail_rank"] == world.rank:  # after loading, so the others are already in a collective
        raise RuntimeError(f"injected failure on rank {world.rank} (--debug-fail-rank)")
    stages = StageForward(model, mesh) if mesh is not None else None
    tokenizer = load_tokenizer(opts["model"])
    stream = None
    if world.rank == 0 and opts["stream"] and tokenizer is not None and len(opts["prompts"]) == 1:
        decoder = StreamDecoder(tokenizer)

        def stream(step_tokens):
            if step_tokens[0] is not None:
                sys.stdout.write(decoder.push(step_tokens[0]))
                sys.stdout.flush()

    res = generate(
        model,
        opts["prompts"],
        comm=tp,
        max_new_tokens=opts["max_new_tokens"],
        sampling=SamplingParams(**opts["sampling"]),
        stop_ids=opts["stop_ids"],
        on_tokens=stream,
        stages=stages,
    )
    per_rank = world.all_gather(torch.tensor([report.param_bytes, mem.peak_above_baseline]), dim=0).view(-1, 2)
    per_token = res.comm_per_step
    by_stage = None
    if mesh is not None:  # one token along the pipeline: tp rank 0's collectives on every stage, added up
        by_stage = gather_snapshots(mesh.pp, per_token)
        per_token = {}
        for snap in by_stage:
            for key, c in snap.items():
                total = per_token.setdefault(key, {"calls": 0, "bytes": 0})
                total["calls"] += c["calls"]
                total["bytes"] += c["bytes"]
        per_token = dict(sorted(per_token.items()))
    out = {
        "tokens": res.tokens,
        "text": [tokenizer.decode(t) for t in res.tokens] if tokenizer is not None else None,
        "finish_reasons": res.finish_reasons,
        "tp": tp.size,
        "pp": pp,
        "backend": tp.backend,
        "model": opts["model_name"],
        "family": report.family,
        "dtype": model.cfg.dtype,
        "quantize": opts.get("quantize"),
        "comm_dtype": tp.wire,
        "prefill_ms": round(res.prefill_ms, 3),
        "decode_ms_per_token": round(statistics.median(res.decode_ms), 3) if res.decode_ms else None,
        "param_bytes_per_rank": per_rank[:, 0].tolist(),
        "bytes_by_format": report.bytes_by_format,  # rank 0's
        "peak_load_anon_bytes_per_rank": per_rank[:, 1].tolist(),
        "collectives_per_token": per_token,
    }
    if mesh is not None:
        out["collectives_per_token_by_stage"] = by_stage
        out["stages"] = stage[0].describe().replace(", loss", "")  # inference computes no loss
    return out


def run(args: argparse.Namespace) -> int:
    model_dir, cfg = resolve_model(  # auto: models without shardwise code (cfg None)
        args.model, args.tp, auto=True, expert_parallel=args.expert_parallel, quantize=args.quantize
    )
    if cfg is None:  # the automatic plan
        sizes, layout = resolve_auto(model_dir, args.pp, args.pp_layers, command="generate"), None
    else:
        sizes, layout = cfg, resolve_stages(cfg, args.tp, args.pp, args.pp_layers)
    try:
        prompts = _prompts(args, model_dir)
        validate_prompts(prompts, sizes.vocab_size, sizes.max_positions, args.max_new_tokens)
        sampling = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    except (PromptError, ValueError) as e:
        return fail(str(e))
    opts = {
        "model": str(model_dir),
        "model_name": "default (trained on Jane Austen)" if model_dir == DEFAULT_MODEL else str(model_dir),
        "dtype": args.dtype,
        "quantize": args.quantize,
        "prompts": prompts,
        "max_new_tokens": args.max_new_tokens,
        "sampling": {
            "temperature": sampling.temperature,
            "top_k": sampling.top_k,
            "top_p": sampling.top_p,
            "seed": sampling.seed,
        },
        "stop_ids": [] if args.ignore_eos else stop_ids(model_dir),
        "stream": not args.json,
        "progress": not args.json,
        "fail_rank": args.debug_fail_rank,
        "pp": args.pp,
        "auto": cfg is None,
        "num_layers": cfg.num_layers if cfg is not None else 0,
        "pp_layers": layout.layers if layout is not None else None,
        "expert_parallel": args.expert_parallel,
        "comm_dtype": args.comm_dtype,
    }
    longest = max(map(len, prompts))
    if cfg is not None:  # the automatic plan's models have no formulas: not checked (as in verify)
        check_inference(
            cfg, tp=args.tp, pp_layers=opts["pp_layers"], dtype=args.dtype, quantize=args.quantize,
            expert_parallel=args.expert_parallel, batch=len(prompts), prompt_len=longest,
            kv_tokens=longest + args.max_new_tokens, backend=args.backend, force=args.force,
        )  # fmt: skip
    # NOTE: `auto` resolved before the prompt is echoed, so that its note (gloo for lack of MPI)
    # is not printed in the middle of the streamed text
    backend = resolve_backend(args.backend, world_size=args.tp * args.pp)
    if not args.json:
        if model_dir == DEFAULT_MODEL:
            print("model: the default model shipped with shardwise, trained on Jane Austen's novels (see its README)\n")
        if len(prompts) == 1 and args.prompt_ids is None:  # rank 0 streams the continuation after it
            print(args.prompt[0] if args.prompt else DEFAULT_PROMPT, end="", flush=True)
    run_opts = {"backend": backend, "timeout_s": args.timeout, "allow_cross_host_tp": args.allow_cross_host_tp}
    result = job(_generate_rank, args.tp * args.pp, opts, tp=args.tp, **run_opts)
    if result is None:  # a non-zero rank under an external launcher
        return 0
    if args.compare_tp1:
        tp1 = {**opts, "stream": False, "progress": False, "pp": 1, "expert_parallel": False, "comm_dtype": "fp32"}
        ref = job(_generate_rank, 1, tp1, **run_opts)
        result["matches_tp1"] = ref["tokens"] == result["tokens"]
    if args.json:
        print(json.dumps(result))
        return 0
    if len(prompts) > 1 or result["text"] is None:
        for i, toks in enumerate(result["tokens"]):
            shown = result["text"][i] if result["text"] is not None else toks
            print(f"[{i}] {shown}")
    print("\n")
    ar = result["collectives_per_token"]
    calls = sum(v["calls"] for v in ar.values())
    n = sum(len(t) for t in result["tokens"])
    where = f"tp={result['tp']}" if result["pp"] == 1 else f"tp={result['tp']} x pp={result['pp']}"
    where += ", expert-parallel" if args.expert_parallel else ""
    print(
        f"{where} ({result['backend']}), {result['dtype']}"
        + (f", automatic plan ({result['family']})" if opts["auto"] else "")
        + (f", {result['quantize']} weights" if result["quantize"] else "")
        + (f", {result['comm_dtype']} on the wire" if result["comm_dtype"] != "fp32" else "")
        + f": {n} tokens, "
        f"prefill {result['prefill_ms']:.1f} ms, decode {result['decode_ms_per_token'] or 0:.2f} ms/token (median), "
        f"{calls} collectives/token" + (" along the pipeline" if result["pp"] > 1 else "")
    )
    if result["pp"] > 1:
        print(f"stages: {result['stages']}")
        p2p = {k: v for k, v in ar.items() if k.endswith("/pp")}
        print("point-to-point per token: " + ", ".join(f"{k} x{v['calls']} ({v['bytes']} B)" for k, v in p2p.items()))
    mib = 2**20
    params = ", ".join(f"{b / mib:.1f}" for b in result["param_bytes_per_rank"])
    peaks = ", ".join(f"{b / mib:.1f}" for b in result["peak_load_anon_bytes_per_rank"])
    formats = result.get("bytes_by_format") or {}
    held = f" (rank 0: {', '.join(f'{f} {b / mib:.1f}' for f, b in formats.items())})" if len(formats) > 1 else ""
    print(
        f"{'weights' if result['quantize'] else 'parameters'} MiB per rank: {params}{held}; "
        f"peak anonymous MiB while loading, per rank: {peaks}"
    )
    if args.compare_tp1:
        verdict = "yes" if result["matches_tp1"] else "NO"
        print(f"same tokens as tp=1: {verdict}")
        return 0 if result["matches_tp1"] else 1
    return 0
