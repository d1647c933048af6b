"""`shardwise train`: train a model on a tp x pp x dp mesh from a TOML config.

    shardwise train --config configs/austen-tp2.toml
    shardwise train --config configs/austen-tp2.toml --tp 4 --resume latest --steps 400
    shardwise train --config configs/tiny-pp2.toml --layout tp=2,pp=2,dp=1 --schedule gpipe --microbatches 8
    shardwise train --config configs/austen-tp2.toml --sequence-parallel --recompute selective
    shardwise train --config configs/tiny-moe.toml --tp 2 --dp 2 --ep 2

The config is read and checked, the tp size and the layer split checked against the
model, the layout against an external launcher's ranks, and a text corpus tokenized, all
here in the parent before any rank starts; then tp * pp * dp ranks train (or join
torchrun / mpiexec ranks), rank 0 showing progress, and the job ends with a summary, the
last checkpoint and the loss curve.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from shardwise.cli.common import add_host_args, fail, job
from shardwise.cli.memcheck import add_force_arg, check_training
from shardwise.comm import Communicator

__all__ = [
    "add_parser",
    "run",
    "run_training",
    "prepare",
    "train_backend",
    "parse_layout",
    "parse_pp_layers",
    "pipeline_summary",
    "startup_line",
    "summary_lines",
]

LAYOUT_KEYS = ("tp", "pp", "dp")
_LAYOUT_FORM = "the form is tp=N,pp=N,dp=N (any of the three, as `shardwise plan` prints), e.g. tp=2,pp=2,dp=1"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train on a tp x pp x dp mesh from a TOML config")
    p.add_argument("--config", type=Path, required=True, help="TOML file (see configs/ and docs/training.md)")
    p.add_argument("--tp", type=int, default=None, help="override parallel.tp")
    p.add_argument("--pp", type=int, default=None, help="override parallel.pp (pipeline stages)")
    p.add_argument("--dp", type=int, default=None, help="override parallel.dp")
    p.add_argument("--ep", type=int, default=None, help="override parallel.ep: expert-parallel size (MoE; divides dp)")
    p.add_argument("--layout", default=None, help="tp=N,pp=N,dp=N (any subset): the layout `shardwise plan` recommends")
    p.add_argument(
        "--schedule", choices=["1f1b", "gpipe", "interleaved"], default=None, help="override parallel.schedule"
    )
    p.add_argument(
        "--virtual-stages", type=int, default=None, help="override parallel.virtual_stages (interleaved: >= 2)"
    )
    p.add_argument(
        "--microbatches",
        type=int,
        default=None,
        help="micro-batches per dp rank per step (m), instead of data.micro_batch_size",
    )
    p.add_argument("--pp-layers", default=None, help="decoder layers per (virtual) stage, e.g. 5,3 (default: balanced)")
    p.add_argument(
        "--p2p-check",
        action="store_true",
        help="check each stage-to-stage message's shape and dtype (a mismatch fails naming both stages)",
    )
    p.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="set parallel.sequence_parallel: norms and residuals on seq_len/tp positions per tp rank (less memory)",
    )
    p.add_argument(
        "--recompute",
        choices=["none", "selective", "full"],
        default=None,
        help="override run.recompute: recompute each attention core (selective) or each layer (full) in backward",
    )
    p.add_argument(
        "--distributed-optimizer",
        action="store_true",
        help="set optim.distributed: AdamW moments (and bf16 weights' fp32 master) split over dp, grads reduce-scattered (ZeRO-2)",
    )
    p.add_argument(
        "--dtype", choices=["fp32", "bf16"], default=None, help="override run.dtype: bf16 weights keep an fp32 master"
    )
    p.add_argument(
        "--grad-reduce-dtype", choices=["fp32", "bf16"], default=None, help="override optim.grad_reduce_dtype"
    )
    p.add_argument("--steps", type=int, default=None, help="override run.steps")
    p.add_argument("--out", type=Path, default=None, help="override run.out_dir")
    p.add_argument("--resume", default=None, help='override run.resume: a checkpoint directory or "latest"')
    p.add_argument("--no-progress", action="store_true", help="no progress bar (log lines only)")
    p.add_argument("--backend", choices=["auto", "mpi", "gloo", "nccl"], default=None, help="override parallel.backend")
    p.add_argument("--timeout", type=float, default=None, help="override parallel.timeout_s")
    p.add_argument("--json", action="store_true", help="print one JSON summary object on stdout")
    # accepted only to be refused with the reason (quantized weights are for inference)
    p.add_argument("--quantize", default=None, help=argparse.SUPPRESS)
    p.add_argument("--comm-dtype", default=None, help=argparse.SUPPRESS)  # likewise (compression is inference's)
    add_host_args(p)
    add_force_arg(p)


def _train_rank(world: Communicator, cfg, p2p_check: bool = False) -> dict:
    from shardwise.checkpoint import Checkpointer
    from shardwise.log import setup_logging
    from shardwise.train import train

    setup_logging(world.rank, world.size)
    if p2p_check:
        world.p2p_check = True  # before the mesh is split from it: every group inherits it
    result = train(world, cfg, Checkpointer())
    last = result.stats[-1] if result.stats else None
    return {
        "step": result.step,
        "loss": last.loss if last else None,
        "first_loss": result.stats[0].loss if result.stats else None,
        "steps_run": len(result.stats),
        "tokens_per_s": round(result.tokens_per_s, 1),
        "ms_per_step": round(1e3 * sum(s.seconds for s in result.stats) / max(len(result.stats), 1), 2),
        "step_ms": [round(1e3 * s.seconds, 2) for s in result.stats],
        "checkpoint": result.checkpoint,
        "plot": result.plot,
        "tp": cfg.parallel.tp,
        "dp": cfg.parallel.dp,
        "ep": cfg.parallel.ep,
        "backend": world.backend,
        "dp_sync": "reduce-scatter"
        if cfg.optim.distributed
        else cfg.parallel.dp_sync
        if cfg.parallel.pp == 1 and not _is_moe(cfg)
        else "bucketed",
        "distributed_optimizer": cfg.optim.distributed,
        "dtype": cfg.run.dtype,
        "sequence_parallel": cfg.parallel.sequence_parallel and cfg.parallel.tp > 1,
        "recompute": cfg.run.recompute,
        **pipeline_summary(cfg),
        "p2p_check": p2p_check,
    }


def _is_moe(cfg) -> bool:
    from shardwise.train import model_config

    return bool(model_config(cfg).num_experts)


def _train_rank_p2p_check(world: Communicator, cfg) -> dict:
    return _train_rank(world, cfg, p2p_check=True)


def pipeline_summary(cfg, num_layers: int | None = None) -> dict:
    """pp, layout, schedule, virtual_stages, microbatches (m per dp rank per step),
    micro_batch_size, pp_layers (layers per virtual stage) and bubble: the schedule's idle
    fraction at equal stage times and free transfers, simulated ((p-1)/(m+p-1) for 1f1b
    and gpipe); schedule and bubble are None at pp = 1."""
    from shardwise.pipeline import build_schedule, simulate
    from shardwise.train import model_config

    par = cfg.parallel
    m = cfg.data.grad_accum(par.dp)
    layout = cfg.check_stages(num_layers if num_layers is not None else model_config(cfg).num_layers)
    bubble = None
    if par.pp > 1:
        bubble = round(simulate(build_schedule(par.schedule, par.pp, m, par.virtual_stages)).bubble, 4)
    return {
        "pp": par.pp,
        "layout": par.layout(),
        "schedule": par.schedule if par.pp > 1 else None,
        "virtual_stages": par.virtual_stages,
        "microbatches": m,
        "micro_batch_size": cfg.data.micro_batch_size,
        "pp_layers": list(layout.layers),
        "bubble": bubble,
    }


def parse_layout(text: str) -> dict[str, int]:
    """ "tp=2,pp=2,dp=1" (any subset of the keys, in any order) -> {"tp": 2, "pp": 2, "dp": 1};
    ValueError (one line, the valid form named) on anything else."""
    out: dict[str, int] = {}
    for part in text.split(","):
        key, sep, value = part.strip().partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not key:
            raise ValueError(f"--layout {text!r}: {part.strip()!r} is not key=value; {_LAYOUT_FORM}")
        if key not in LAYOUT_KEYS:
            raise ValueError(f"--layout {text!r}: unknown key {key!r}; valid keys: tp, pp, dp; {_LAYOUT_FORM}")
        if key in out:
            raise ValueError(f"--layout {text!r}: {key} is given twice; {_LAYOUT_FORM}")
        if not value.isdigit() or int(value) < 1:
            raise ValueError(f"--layout {text!r}: {key} must be a positive integer, got {value!r}; {_LAYOUT_FORM}")
        out[key] = int(value)
    return out


def parse_pp_layers(text: str) -> list[int]:
    """ "5,3" -> [5, 3]; ValueError (one line) on anything else."""
    parts = [p.strip() for p in text.split(",")]
    if not all(p.isdigit() and int(p) >= 1 for p in parts):
        raise ValueError(
            f"--pp-layers {text!r}: give the decoder layers of each stage as positive integers separated by "
            "commas, e.g. 5,3 for pp=2"
        )
    return [int(p) for p in parts]


def load_config(args: argparse.Namespace):
    """The TrainConfig with command-line overrides applied; ConfigError on bad input."""
    from shardwise.train import ConfigError, TrainConfig

    cfg = TrainConfig.from_toml(args.config)
    flags = {k: getattr(args, k) for k in LAYOUT_KEYS if getattr(args, k) is not None}
    parallel = dict(flags)
    if args.layout is not None:
        try:
            layout = parse_layout(args.layout)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        for key, value in layout.items():
            if key in flags and flags[key] != value:
                raise ConfigError(
                    f"--layout {args.layout} sets {key}={value} but --{key} {flags[key]} sets {key}={flags[key]}; "
                    f"give one of them, or make them agree"
                )
        parallel.update(layout)
    for key in ("backend", "schedule", "virtual_stages"):
        if getattr(args, key) is not None:
            parallel[key] = getattr(args, key)
    if args.pp_layers is not None:
        try:
            parallel["pp_layers"] = parse_pp_layers(args.pp_layers)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    if args.ep is not None:
        parallel["ep"] = args.ep
    if args.timeout is not None:
        parallel["timeout_s"] = args.timeout
    if args.sequence_parallel:
        parallel["sequence_parallel"] = True
    data = {"microbatches": args.microbatches} if args.microbatches is not None else {}
    run = {}
    if args.steps is not None:
        run["steps"] = args.steps
    if args.out is not None:
        run["out_dir"] = str(args.out.resolve())
    if args.resume is not None:
        run["resume"] = args.resume if args.resume == "latest" else str(Path(args.resume).resolve())
    if args.no_progress:
        run["progress"] = False
    if args.recompute is not None:
        run["recompute"] = args.recompute
    if args.dtype is not None:
        run["dtype"] = args.dtype
    optim = {"distributed": True} if args.distributed_optimizer else {}
    if args.grad_reduce_dtype is not None:
        optim["grad_reduce_dtype"] = args.grad_reduce_dtype
    raw = cfg.to_dict()  # overrides applied as data, then the combination validated once
    for section, values in (("parallel", parallel), ("data", data), ("run", run), ("optim", optim)):
        raw[section].update(values)
    return type(cfg).from_dict(raw)


def train_backend(name: str, *, world_size: int = 1) -> str:
    """The backend to train with: `auto` as elsewhere (MPI when installed, else gloo), except
    that training runs on CPU tensors, so a CUDA machine's NCCL is not chosen."""
    from shardwise.launch.env import resolve_backend

    if name == "nccl":
        raise ValueError("parallel.backend='nccl': training runs on CPU tensors for now; use gloo or mpi")
    resolved = resolve_backend(name, world_size=world_size)
    return "gloo" if resolved == "nccl" else resolved


def check_world(cfg, environ: dict[str, str] | None = None) -> None:
    """Under torchrun / mpiexec, the layout must use exactly the ranks the launcher started
    (ConfigError naming both and the layouts that fit); on ranks we start, it always does."""
    from shardwise.launch.env import external_rank
    from shardwise.train import ConfigError

    ext = external_rank(environ)
    par = cfg.parallel
    if ext is None or ext.world_size == par.world_size:
        return
    n = ext.world_size
    fits = [
        f"tp={t},pp={p},dp={n // (t * p)}" for t in range(1, n + 1) for p in range(1, n // t + 1) if n % (t * p) == 0
    ]
    shown = "; ".join(fits[:8]) + ("; ..." if len(fits) > 8 else "")
    raise ConfigError(
        f"tp={par.tp} x pp={par.pp} x dp={par.dp} = {par.world_size} ranks, but {ext.launcher} started {n}; "
        f"layouts for {n} ranks (--layout): {shown}"
    )


def prepare(cfg) -> tuple:
    """Check the tp size and the layer split against the model, and the layout against an
    external launcher's ranks, then tokenize the text (once), before any rank starts;
    (ModelConfig, token file, backend). Raises on bad input."""
    from shardwise.sharding.plans import check_tp
    from shardwise.train import ConfigError, model_config, token_file
    from shardwise.train.distopt import check_dtype

    model_cfg = model_config(cfg)
    cfg.check_stages(model_cfg.num_layers)  # a pretrained model's layers are known only now
    cfg.check_experts(model_cfg)
    check_tp(model_cfg, cfg.parallel.tp)
    try:
        check_dtype(cfg.run.dtype, "cpu")  # training runs on CPU tensors
    except ValueError as e:
        raise ConfigError(str(e)) from None
    check_world(cfg)
    check_resume(cfg, model_cfg)
    backend = train_backend(cfg.parallel.backend, world_size=cfg.parallel.world_size)
    return model_cfg, token_file(cfg), backend


def check_resume(cfg, model_cfg) -> None:
    """run.resume's checkpoint, from its manifest alone, before any rank starts: the same
    architecture, every tensor the model needs (weights and both moments) present, and each
    one's chunks covering its rows exactly once; ConfigError (one line) naming what is not."""
    if cfg.run.resume is None:
        return
    from shardwise.checkpoint import CheckpointError, CheckpointReader, check_compatible
    from shardwise.train import ConfigError, rank_specs

    source = Path(cfg.run.out_dir) / "checkpoints" if cfg.run.resume == "latest" else Path(cfg.run.resume)
    try:
        check_compatible(CheckpointReader(source), model_cfg, list(rank_specs(model_cfg, 1, 0)))
    except CheckpointError as e:
        raise ConfigError(f"run.resume: {e}") from None


def run_training(
    cfg, *, timeout_s: float | None = None, p2p_check: bool = False, allow_cross_host_tp: bool = False
) -> dict | None:
    """The Python API of `shardwise train`: check the config and tokenize the text here
    (`prepare`), then train on tp * pp * dp ranks started here (or joined: torchrun, mpiexec).

    Returns rank 0's summary: step, loss, first_loss, steps_run, tokens_per_s,
    ms_per_step, checkpoint, plot, tp, dp, backend, dp_sync, sequence_parallel (in effect:
    False at tp = 1), recompute, and the pipeline's pp,
    layout, schedule, virtual_stages, microbatches, micro_batch_size, pp_layers, bubble
    (see pipeline_summary), p2p_check (None on an external launcher's other ranks).
    timeout_s (default parallel.timeout_s) bounds each collective and point-to-point
    message; p2p_check sends a (shape, dtype) header with each stage-to-stage message.
    Raises on bad input before any rank starts, RankFailedError if a rank fails; under
    torchrun / mpiexec, LaunchError if a tp group spans hosts, unless allow_cross_host_tp.
    """
    from shardwise.launch import run_job

    _, _, backend = prepare(cfg)
    timeout = timeout_s if timeout_s is not None else cfg.parallel.timeout_s
    return run_job(
        _train_rank,
        cfg.parallel.world_size,
        args=(cfg, p2p_check),
        backend=backend,
        timeout_s=timeout,
        # NOTE: no job deadline (launch's default, 4 x timeout + 60 s, cut long runs short): every
        # step has collectives, so a stuck rank still fails the job within the collective timeout.
        job_timeout_s=math.inf,
        tp=cfg.parallel.tp,
        allow_cross_host_tp=allow_cross_host_tp,
    )


def summary_lines(result: dict, cfg) -> list[str]:
    """What the command prints at the end, from rank 0's summary (`run_training`'s dict)."""
    lines = []
    if result["steps_run"]:
        lines.append(
            f"trained steps {result['step'] - result['steps_run'] + 1}..{result['step']}: loss "
            f"{result['first_loss']:.4f} -> {result['loss']:.4f}, {result['tokens_per_s']:,.0f} tokens/s, "
            f"{result['ms_per_step']:.1f} ms/step"
        )
    else:
        lines.append(f"nothing to do: already at step {result['step']} (run.steps={cfg.run.steps})")
    if result["pp"] > 1:
        lines.append(
            f"pipeline: {result['layout']}, {result['schedule']} schedule, m={result['microbatches']}, layers "
            f"{result['pp_layers']}; bubble at equal stage times {result['bubble']:.2f}"
        )
    if result["checkpoint"]:
        lines.append(f"checkpoint: {result['checkpoint']}")
    if result["plot"]:
        lines.append(f"loss curve: {result['plot']}")
    return lines


def startup_line(cfg, model_cfg, tokens, backend: str) -> str:
    """The command's first line: the model, the data and the layout (before any rank starts)."""
    par = cfg.parallel
    line = (
        f"train: {model_cfg.family} ({model_cfg.num_layers} layers, hidden {model_cfg.hidden_size}, "
        f"vocab {model_cfg.vocab_size}) on {tokens}, tp={par.tp} x pp={par.pp} x dp={par.dp} ({backend})"
    )
    if par.pp > 1:
        pipe = pipeline_summary(cfg, model_cfg.num_layers)
        chunks = f" ({par.virtual_stages} virtual stages per rank)" if par.virtual_stages > 1 else ""
        line += (
            f", {par.schedule} schedule{chunks}, m={pipe['microbatches']} micro-batches of "
            f"{pipe['micro_batch_size']}, layers {pipe['pp_layers']}"
        )
    if par.sequence_parallel and par.tp > 1:
        line += f", sequence parallel ({cfg.data.seq_len // par.tp} of {cfg.data.seq_len} positions per tp rank)"
    if cfg.run.recompute != "none":
        line += f", recompute {cfg.run.recompute}"
    if cfg.optim.distributed:
        line += f", distributed optimizer over dp={par.dp}"
    if cfg.run.dtype == "bf16":
        line += ", bf16 weights (fp32 master)"
    if model_cfg.num_experts:
        line += f", {model_cfg.num_experts} experts (top-{model_cfg.experts_per_token})"
        if par.ep > 1:
            line += f" over ep={par.ep}"
        if model_cfg.router_aux_loss_coef:
            line += f", aux loss coef {model_cfg.router_aux_loss_coef:g}"
    return line + f", steps to {cfg.run.steps}, out {cfg.run.out_dir}"


def run(args: argparse.Namespace) -> int:
    from shardwise.hf import CheckpointError
    from shardwise.layers import ShardError
    from shardwise.quant import QuantizeError, check_quantize
    from shardwise.train import ConfigError, DataError

    if args.comm_dtype not in (None, "fp32"):
        return fail(
            f"--comm-dtype {args.comm_dtype} is for inference (generate, serve, eval-ppl): training "
            "keeps its all-reduces exact (compressing activations and their gradients would bias the gradients)"
        )
    try:
        check_quantize(args.quantize, training=True)
        cfg = load_config(args)
        model_cfg, tokens, backend = prepare(cfg)
    except (ConfigError, DataError, ShardError, CheckpointError, OSError, ValueError, QuantizeError) as e:
        return fail(str(e))
    check_training(cfg, model_cfg, force=args.force)
    if not args.json:
        print(startup_line(cfg, model_cfg, tokens, backend), flush=True)
    fn = _train_rank_p2p_check if args.p2p_check else _train_rank
    result = job(
        fn,
        cfg.parallel.world_size,
        cfg,
        backend=backend,
        timeout_s=cfg.parallel.timeout_s,
        tp=cfg.parallel.tp,
        allow_cross_host_tp=args.allow_cross_host_tp,
    )
    if result is None:  # a non-zero rank under an external launcher
        return 0
    if args.json:
        print(json.dumps(result))
        return 0
    for line in summary_lines(result, cfg):
        print(line)
    return 0
