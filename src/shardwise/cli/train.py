"""`shardwise train`: train a model on a tp x dp mesh from a TOML config.

    shardwise train --config configs/austen-tp2.toml
    shardwise train --config configs/austen-tp2.toml --tp 4 --resume latest --steps 400

The config is read and checked, the tp size checked against the model, and a text
corpus tokenized, all here in the parent before any rank starts; then tp * dp ranks
train (or join torchrun / mpiexec ranks), rank 0 showing progress, and the job ends
with a summary, the last checkpoint and the loss curve.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from shardwise.cli.common import fail, job
from shardwise.comm import Communicator

__all__ = ["add_parser", "run", "run_training", "prepare", "train_backend"]


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train on a tp x dp mesh from a TOML config")
    p.add_argument("--config", type=Path, required=True, help="TOML file (see configs/ and docs/training.md)")
    p.add_argument("--tp", type=int, default=None, help="override parallel.tp")
    p.add_argument("--dp", type=int, default=None, help="override parallel.dp")
    p.add_argument("--steps", type=int, default=None, help="override run.steps")
    p.add_argument("--out", type=Path, default=None, help="override run.out_dir")
    p.add_argument("--resume", default=None, help='override run.resume: a checkpoint directory or "latest"')
    p.add_argument("--no-progress", action="store_true", help="no progress bar (log lines only)")
    p.add_argument("--backend", choices=["auto", "mpi", "gloo", "nccl"], default=None, help="override parallel.backend")
    p.add_argument("--timeout", type=float, default=None, help="override parallel.timeout_s")
    p.add_argument("--json", action="store_true", help="print one JSON summary object on stdout")


def _train_rank(world: Communicator, cfg) -> dict:
    from shardwise.checkpoint import Checkpointer
    from shardwise.log import setup_logging
    from shardwise.train import train

    setup_logging(world.rank, world.size)
    result = train(world, cfg, Checkpointer())
    last = result.stats[-1] if result.stats else None
    return {
        "step": result.step,
        "loss": last.loss if last else None,
        "first_loss": result.stats[0].loss if result.stats else None,
        "steps_run": len(result.stats),
        "tokens_per_s": round(result.tokens_per_s, 1),
        "ms_per_step": round(1e3 * sum(s.seconds for s in result.stats) / max(len(result.stats), 1), 2),
        "checkpoint": result.checkpoint,
        "plot": result.plot,
        "tp": cfg.parallel.tp,
        "dp": cfg.parallel.dp,
        "backend": world.backend,
        "dp_sync": cfg.parallel.dp_sync,
    }


def load_config(args: argparse.Namespace):
    """The TrainConfig with command-line overrides applied; ConfigError on bad input."""
    from shardwise.train import TrainConfig

    cfg = TrainConfig.from_toml(args.config)
    parallel = {k: v for k, v in (("tp", args.tp), ("dp", args.dp), ("backend", args.backend)) if v is not None}
    if args.timeout is not None:
        parallel["timeout_s"] = args.timeout
    run = {}
    if args.steps is not None:
        run["steps"] = args.steps
    if args.out is not None:
        run["out_dir"] = str(args.out.resolve())
    if args.resume is not None:
        run["resume"] = args.resume if args.resume == "latest" else str(Path(args.resume).resolve())
    if args.no_progress:
        run["progress"] = False
    cfg = cfg.replace(parallel=parallel, run=run)
    return type(cfg).from_dict(cfg.to_dict())  # re-validate the combination


def train_backend(name: str) -> str:
    """The backend to train with: `auto` as elsewhere (MPI when installed, else gloo), except
    that training runs on CPU tensors, so a CUDA machine's NCCL is not chosen."""
    from shardwise.launch.env import resolve_backend

    if name == "nccl":
        raise ValueError("parallel.backend='nccl': training runs on CPU tensors for now; use gloo or mpi")
    resolved = resolve_backend(name)
    return "gloo" if resolved == "nccl" else resolved


def prepare(cfg) -> tuple:
    """Check the tp size against the model and tokenize the text (once), before any rank
    starts; (ModelConfig, token file, backend). Raises on bad input."""
    from shardwise.sharding.plans import check_tp
    from shardwise.train import model_config, token_file

    model_cfg = model_config(cfg)
    check_tp(model_cfg, cfg.parallel.tp)
    return model_cfg, token_file(cfg), train_backend(cfg.parallel.backend)


def run_training(cfg, *, timeout_s: float | None = None) -> dict | None:
    """The Python API of `shardwise train`: check the config and tokenize the text here
    (`prepare`), then train on tp * dp ranks started here (or joined: torchrun, mpiexec).

    Returns rank 0's summary: step, loss, first_loss, steps_run, tokens_per_s,
    ms_per_step, checkpoint, plot, tp, dp, backend, dp_sync (None on an external
    launcher's other ranks). timeout_s (default parallel.timeout_s) bounds each
    collective. Raises on bad input before any rank starts, RankFailedError if a rank fails.
    """
    from shardwise.launch import run_job

    _, _, backend = prepare(cfg)
    timeout = timeout_s if timeout_s is not None else cfg.parallel.timeout_s
    return run_job(_train_rank, cfg.parallel.world_size, args=(cfg,), backend=backend, timeout_s=timeout)


def run(args: argparse.Namespace) -> int:
    from shardwise.hf import CheckpointError
    from shardwise.layers import ShardError
    from shardwise.train import ConfigError, DataError

    try:
        cfg = load_config(args)
        model_cfg, tokens, backend = prepare(cfg)
    except (ConfigError, DataError, ShardError, CheckpointError, OSError, ValueError) as e:
        return fail(str(e))
    if not args.json:
        print(
            f"train: {model_cfg.family} ({model_cfg.num_layers} layers, hidden {model_cfg.hidden_size}, "
            f"vocab {model_cfg.vocab_size}) on {tokens}, tp={cfg.parallel.tp} x dp={cfg.parallel.dp} "
            f"({backend}), steps to {cfg.run.steps}, out {cfg.run.out_dir}",
            flush=True,
        )
    result = job(_train_rank, cfg.parallel.world_size, cfg, backend=backend, timeout_s=cfg.parallel.timeout_s)
    if result is None:  # a non-zero rank under an external launcher
        return 0
    if args.json:
        print(json.dumps(result))
        return 0
    if result["steps_run"]:
        print(
            f"trained steps {result['step'] - result['steps_run'] + 1}..{result['step']}: loss "
            f"{result['first_loss']:.4f} -> {result['loss']:.4f}, {result['tokens_per_s']:,.0f} tokens/s, "
            f"{result['ms_per_step']:.1f} ms/step"
        )
    else:
        print(f"nothing to do: already at step {result['step']} (run.steps={cfg.run.steps})")
    if result["checkpoint"]:
        print(f"checkpoint: {result['checkpoint']}")
    if result["plot"]:
        print(f"loss curve: {result['plot']}")
    return 0
