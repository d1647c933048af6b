"""`shardwise serve`: an OpenAI-compatible HTTP server on tp x pp ranks (pp pipeline stages,
each sharded over tp ranks).

Everything that can be wrong with the command line (model directory, tp and pp sizes, limits,
a port already taken) is refused with one line before any rank starts. Then the ranks
are started (or joined, under torchrun) and serve until the process is stopped
(SIGINT/SIGTERM: exit 0) or a rank fails (exit 1, with the failing rank's error).

A model without shardwise code is served through the automatic plan (shardwise.hf.auto) at
any tp `verify` accepts, one request at a time on transformers' own KV cache (serve/auto.py):
the paged pool, batching and prefix caching need shardwise's attention layers, so
--kv-cache-memory, --max-batch-size above 1 and --pp above 1 are refused for it.
"""

from __future__ import annotations

import argparse
import math
import signal
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from shardwise.cli.common import (
    CliError,
    add_comm_dtype_arg,
    add_expert_parallel_arg,
    add_host_args,
    add_pp_arg,
    add_quantize_arg,
    fail,
    job,
    resolve_auto,
    resolve_model,
    resolve_stages,
)
from shardwise.cli.memcheck import add_force_arg, check_inference
from shardwise.comm import DEFAULT_TIMEOUT_S
from shardwise.engine.paged import BLOCK_SIZE, blocks_for
from shardwise.engine.text import DEFAULT_MODEL, load_tokenizer
from shardwise.serve.budget import DEFAULT_FRACTION, BudgetTooSmall, KVBudget

__all__ = ["add_parser", "run"]

MIB = 2**20
DEFAULT_BATCH = 16


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server on N tensor-parallel ranks")
    p.add_argument(
        "--model", type=Path, default=None, help="Hugging Face model directory (default: the built-in model)"
    )
    p.add_argument(
        "--tensor-parallel-size",
        "--tp",
        dest="tp",
        type=int,
        default=2,
        help="ranks to shard the model over (default 2)",
    )
    add_pp_arg(p, "--pipeline-parallel-size", "--pp")
    add_expert_parallel_arg(p)
    p.add_argument(
        "--dtype", choices=["float32", "bfloat16", "float16"], default=None, help="default: the checkpoint's"
    )
    add_quantize_arg(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1, loopback only)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (default 8000; 0 = any free port)")
    p.add_argument(
        "--max-batch-size",
        type=int,
        default=DEFAULT_BATCH,
        help=f"sequences decoded together (default {DEFAULT_BATCH})",
    )
    p.add_argument("--max-model-len", type=int, default=None, help="prompt + completion tokens (default: the model's)")
    p.add_argument("--max-queue", type=int, default=64, help="requests waiting for a slot before 429s (default 64)")
    p.add_argument(
        "--kv-cache-memory",
        default=None,
        metavar="SIZE|FRACTION",
        help="the paged KV cache of each rank, in blocks of 16 tokens shared by every sequence: a size "
        "(2GiB, 512MiB), or a fraction (0-1] of the memory a rank may use (the host's or cgroup's room over its "
        "ranks; a GPU's free memory) less its weights, capped at --max-batch-size x --max-model-len tokens "
        f"(default {DEFAULT_FRACTION}); a --max-model-len the pool cannot hold is refused",
    )
    p.add_argument(
        "--no-prefix-caching",
        dest="prefix_caching",
        action="store_false",
        help="do not share the KV blocks of identical prompt prefixes between requests",
    )
    p.add_argument(
        "--served-model-name",
        default=None,
        help="the `model` name clients use (default: `default` for the built-in model, else the directory's name)",
    )
    p.add_argument("--max-body-bytes", type=int, default=MIB, help="request bodies over this get 413 (default 1 MiB)")
    p.add_argument(
        "--backend",
        choices=["auto", "mpi", "gloo", "nccl"],
        default="auto",
        help="auto (default): NCCL on CUDA, else MPI when installed (the fastest on CPU), else gloo. On "
        "each, a failed rank turns /health 503 and ends requests with an error before the server exits 1",
    )
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="collective timeout, seconds")
    p.add_argument(
        "--health-timeout", type=float, default=3.0, help="/health is 503 when no step completed for this long (s)"
    )
    add_host_args(p)
    add_comm_dtype_arg(p)
    add_force_arg(p)
    p.add_argument("--debug-fail-rank", type=int, default=None, help=argparse.SUPPRESS)  # fault injection for tests
    p.add_argument("--debug-fail-after", type=int, default=0, help=argparse.SUPPRESS)


def _check(args: argparse.Namespace, model_dir: Path, cfg) -> list[str]:
    """Every problem with the options, as one-line messages."""
    from shardwise.hf import read_config
    from shardwise.models.decoder import DecoderLM

    family, _ = read_config(model_dir)
    if family.model is not DecoderLM or not cfg.causal:
        return [f"{model_dir} is a {family.name} model; serve needs a decoder (causal language model)"]
    return _check_limits(args, model_dir, cfg.max_positions)


def _check_auto(args: argparse.Namespace, model_dir: Path, max_positions: int) -> list[str]:
    """_check for a model of the automatic plan: the options only the paged engine has, then the limits."""
    why = "the automatic plan serves one request at a time on transformers' KV cache (serve/auto.py)"
    if args.kv_cache_memory is not None:
        return [f"--kv-cache-memory {args.kv_cache_memory}: {why}, not the paged pool; leave it out"]
    if args.max_batch_size not in (1, DEFAULT_BATCH):
        return [f"--max-batch-size {args.max_batch_size}: {why}, without batching; leave it out"]
    return _check_limits(args, model_dir, max_positions)


def _check_limits(args: argparse.Namespace, model_dir: Path, max_positions: int) -> list[str]:
    """The problems of any served model: tokenizer, lengths, limits, the port."""
    from shardwise.serve.http import bind
    from shardwise.serve.worker import HEARTBEAT_S

    problems = []
    if not (model_dir / "tokenizer.json").exists() and load_tokenizer(model_dir) is None:
        problems.append(f"{model_dir} has no tokenizer.json; serve needs the checkpoint's tokenizer")
    if args.max_model_len is not None and not 1 <= args.max_model_len <= max_positions:
        problems.append(
            f"--max-model-len must be in [1, {max_positions}] (the model's context), got {args.max_model_len}"
        )
    for name, low in (("max_batch_size", 1), ("max_queue", 0), ("max_body_bytes", 1024)):
        if getattr(args, name) < low:
            problems.append(f"--{name.replace('_', '-')} must be >= {low}, got {getattr(args, name)}")
    if args.timeout <= 2 * HEARTBEAT_S:
        problems.append(f"--timeout must be over {2 * HEARTBEAT_S:g}s (idle ranks wait {HEARTBEAT_S:g}s per heartbeat)")
    if args.health_timeout <= HEARTBEAT_S:
        problems.append(f"--health-timeout must be over the {HEARTBEAT_S:g}s heartbeat, got {args.health_timeout:g}")
    if not 0 <= args.port <= 65535:
        problems.append(f"--port must be in [0, 65535], got {args.port}")
    elif not problems:
        try:
            bind(args.host, args.port).close()
        except OSError as e:
            problems.append(f"cannot listen on {args.host}:{args.port}: {e.strerror or e}")
    return problems


@dataclass(frozen=True)
class PoolSize:
    """The paged KV pool as the ranks will size it (serve/budget.py), predicted from the config:
    `blocks` per rank, decided by the stage that fits fewest (its bytes per block and the bytes
    its ranks hold besides the pool, `other`); `activations`: one prefill's, kept free on each rank."""

    budget: KVBudget
    blocks: int
    per_block: int
    other: float
    activations: float

    def check(self, max_model_len: int, tp: int) -> None:
        """CliError, one line naming the longest length that fits, when the pool cannot hold one sequence."""
        try:
            self.budget.check(self.blocks, self.per_block, self.other, max_model_len, tp)
        except BudgetTooSmall as e:
            raise CliError(fail(str(e))) from None


def kv_blocks(args: argparse.Namespace, cfg, layers: list[int] | None, max_model_len: int) -> PoolSize:
    """The paged pool's blocks per rank for these options (a budget that is neither a size nor a
    fraction is refused, CliError)."""
    from shardwise.cli.memcheck import allowance
    from shardwise.planner.fit import RUNTIME_BYTES, WIDTH, inference_need
    from shardwise.planner.footprint import kv_bytes_per_token

    stages = layers or [cfg.num_layers]
    try:
        budget = KVBudget.parse(args.kv_cache_memory, cap_blocks=args.max_batch_size * blocks_for(max_model_len))
    except ValueError as e:
        raise CliError(fail(f"--kv-cache-memory: {e}")) from None
    if budget.fraction is not None:  # a fraction of what one rank may use
        try:
            found = allowance(args.tp * len(stages), args.backend)
        except ValueError as e:  # SHARDWISE_MEMORY_LIMIT that is not a size
            raise CliError(fail(str(e))) from None
        if found is not None:
            allow, local = found
            room = allow.bytes if allow.per_device else allow.bytes / local
            budget = replace(budget, room=room, room_source=allow.source)
    width = WIDTH[args.dtype or cfg.dtype]
    need = inference_need(  # weights and one prefill's activations, no KV: what a rank holds besides the pool
        cfg, tp=args.tp, pp_layers=layers, dtype=args.dtype, quantize=args.quantize,
        expert_parallel=args.expert_parallel, batch=1, prompt_len=max_model_len, kv_tokens=0, prefill_batch=1,
    )  # fmt: skip
    stage_sizes = []
    for s, n in enumerate(stages):
        per = BLOCK_SIZE * kv_bytes_per_token(cfg, args.tp, width, n)
        other = need.by_rank[s * args.tp] + RUNTIME_BYTES
        stage_sizes.append((budget.blocks(per, other), per, other))
    blocks, per, other = min(stage_sizes)
    return PoolSize(budget, blocks, per, other, need.parts.get("activations", 0.0))


def _stop(signum, frame) -> None:
    raise KeyboardInterrupt


def run(args: argparse.Namespace) -> int:
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        return fail("serve needs fastapi and uvicorn: pip install 'shardwise[serve]'")
    from shardwise.serve.worker import ServeOptions, serve_rank

    model_dir, cfg = resolve_model(  # auto: models without shardwise code (cfg None)
        args.model, args.tp, auto=True, expert_parallel=args.expert_parallel, quantize=args.quantize
    )
    if cfg is None:  # the automatic plan: one request at a time (serve/auto.py)
        return _run_auto(args, model_dir)
    layout = resolve_stages(cfg, args.tp, args.pp, args.pp_layers)
    problems = _check(args, model_dir, cfg)
    if problems:
        return fail(problems[0])
    max_model_len = args.max_model_len or cfg.max_positions
    layers = layout.layers if layout is not None else None
    pool = kv_blocks(args, cfg, layers, max_model_len)
    check_inference(  # the weights and the paged KV pool (at least one sequence of max_model_len)
        cfg, tp=args.tp, pp_layers=layers, dtype=args.dtype, quantize=args.quantize,
        expert_parallel=args.expert_parallel, batch=1, prompt_len=max_model_len,
        kv_tokens=max(pool.blocks, blocks_for(max_model_len)) * BLOCK_SIZE, backend=args.backend, force=args.force,
        serving=True, kv_budget_bytes=pool.budget.bytes is not None,
    )  # fmt: skip
    pool.check(max_model_len, args.tp)
    default = model_dir == DEFAULT_MODEL
    opts = ServeOptions(
        **_common_options(args, model_dir, "default" if default else model_dir.resolve().name),
        max_batch_size=args.max_batch_size,
        max_model_len=max_model_len,
        pp=args.pp,
        num_layers=cfg.num_layers,
        pp_layers=layout.layers if layout is not None else None,
        expert_parallel=args.expert_parallel,
        kv_budget=pool.budget,
        activation_bytes=pool.activations,
        prefix_caching=args.prefix_caching,
    )
    if default:
        print(
            "model: the default model shipped with shardwise, trained on Jane Austen's novels (see its README)",
            file=sys.stderr,
        )
    return _serve(args, serve_rank, opts)


def _run_auto(args: argparse.Namespace, model_dir: Path) -> int:
    """serve for a model of the automatic plan (resolve_model gave no ModelConfig)."""
    from shardwise.serve.auto import serve_auto_rank
    from shardwise.serve.worker import ServeOptions

    sizes = resolve_auto(model_dir, args.pp, args.pp_layers, command="serve")
    problems = _check_auto(args, model_dir, sizes.max_positions)
    if problems:
        return fail(problems[0])
    opts = ServeOptions(
        **_common_options(args, model_dir, model_dir.resolve().name),
        max_batch_size=1,
        max_model_len=args.max_model_len or sizes.max_positions,
        auto=True,
    )
    return _serve(args, serve_auto_rank, opts)


def _common_options(args: argparse.Namespace, model_dir: Path, name: str) -> dict:
    """The ServeOptions fields every model's server takes from the command line alike."""
    return dict(
        model=str(model_dir),
        model_name=args.served_model_name or name,
        dtype=args.dtype,
        quantize=args.quantize,
        host=args.host,
        port=args.port,
        max_queue=args.max_queue,
        max_body_bytes=args.max_body_bytes,
        health_timeout=args.health_timeout,
        fail_rank=args.debug_fail_rank,
        fail_after=args.debug_fail_after,
        comm_dtype=args.comm_dtype,
    )


def _serve(args: argparse.Namespace, rank_fn, opts) -> int:
    """Start the ranks and serve until stopped (a server has no job deadline)."""
    signal.signal(signal.SIGTERM, _stop)
    try:
        job(
            rank_fn,
            args.tp * args.pp,
            opts,
            tp=args.tp,
            backend=args.backend,
            timeout_s=args.timeout,
            job_timeout_s=math.inf,
            allow_cross_host_tp=args.allow_cross_host_tp,
        )
    except KeyboardInterrupt:
        print("shardwise serve: stopped", file=sys.stderr)
    return 0
