"""What every subcommand shares: model and run options, early validation, one-line errors,
and starting the job's ranks."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from shardwise.comm import DEFAULT_TIMEOUT_S
from shardwise.engine.text import DEFAULT_MODEL
from shardwise.launch import JobTimeoutError, LaunchError, RankFailedError, external_rank, run_job
from shardwise.launch.hosts import ALLOW_FLAG
from shardwise.log import setup_logging

__all__ = [
    "add_model_args",
    "add_quantize_arg",
    "add_run_args",
    "add_host_args",
    "add_pp_arg",
    "add_expert_parallel_arg",
    "add_comm_dtype_arg",
    "resolve_model",
    "resolve_stages",
    "resolve_auto",
    "fail",
    "job",
    "CliError",
]


class CliError(SystemExit):
    """A one-line error for the user; exits with status 2."""


def fail(message: str, code: int = 2) -> int:
    print(f"shardwise: error: {message}", file=sys.stderr)
    return code


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model", type=Path, default=None, help="Hugging Face model directory (default: the built-in model)"
    )
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel size: ranks to start (default 2)")
    p.add_argument(
        "--dtype", choices=["float32", "bfloat16", "float16"], default=None, help="default: the checkpoint's"
    )
    add_quantize_arg(p)


def quantize_scheme(text: str) -> str:
    """argparse type of --quantize: the scheme if this machine can run it (one-line error otherwise)."""
    import torch

    from shardwise.quant import QuantizeError, check_quantize

    try:
        return check_quantize(text, device="cuda" if torch.cuda.is_available() else "cpu")
    except QuantizeError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_quantize_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--quantize",
        type=quantize_scheme,
        default=None,
        metavar="{int8,q8_0,q4_k,...,fp16,none}",
        help="store the projections, experts, LM head and embedding table as int8 (GGUF's Q8_0 on CPU), "
        "a GGUF block format (q8_0, q4_0, q4_1, q5_0, q5_1, q4_k, q5_k, q6_k: CPU) or fp16; each rank converts "
        "its own slices as it loads them; inference only. A GGUF file runs in its own formats without it; "
        "'none' dequantizes its blocks to --dtype (see docs/models.md)",
    )


def add_run_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--backend",
        choices=["auto", "mpi", "gloo", "nccl"],
        default="auto",
        help="auto: NCCL on CUDA, else MPI when installed, else gloo",
    )
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="collective timeout, seconds")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    add_host_args(p)


def add_host_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        ALLOW_FLAG,
        action="store_true",
        help="under torchrun / mpiexec on several hosts, run even if a tp group spans hosts (slow; see docs/multihost.md)",
    )


def add_comm_dtype_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--comm-dtype",
        choices=["auto", "fp32", "bf16", "q8"],
        default="auto",
        help="what the tp group's all-reduces of activations carry: fp32 (exact), bf16, or q8 (8-bit "
        "blocks of 32 values with a scale, 1.125 bytes a value); auto (default): fp32, unless the tp "
        "group spans hosts and a compressed all-reduce of the step's size measures faster on its link "
        "(docs/multihost.md)",
    )


def add_pp_arg(p: argparse.ArgumentParser, *names: str) -> None:
    p.add_argument(
        *(names or ("--pp",)),
        dest="pp",
        type=int,
        default=1,
        help="pipeline stages, each holding a run of the layers: tp * pp ranks (default 1)",
    )
    p.add_argument(
        "--pp-layers",
        type=lambda text: [int(x) for x in text.split(",")],
        default=None,
        metavar="N,N,..",
        help="layers per stage, e.g. 5,3 (default: balanced by the weights each stage reads, the LM head included)",
    )


def add_expert_parallel_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--expert-parallel",
        action="store_true",
        help="mixture-of-experts models: each tp rank holds whole experts (tp <= experts) instead of "
        "a slice of every expert",
    )


def resolve_stages(cfg, tp: int, pp: int, pp_layers: list[int] | None = None):
    """The StageLayout of `pp` inference stages (None at pp 1), after checking pp against the
    model's layers and tp * pp against an external launcher's world; exits with a one-line error."""
    from shardwise.engine.pipeline import stage_layout
    from shardwise.pipeline.stage import StageError

    if pp == 1:
        if pp_layers is not None and list(pp_layers) != [cfg.num_layers]:
            raise CliError(fail(f"--pp-layers {','.join(map(str, pp_layers))} needs --pp {len(pp_layers)}"))
        return None
    try:
        if pp < 1:
            raise StageError(f"--pp must be >= 1, got {pp}")
        layout = stage_layout(cfg, pp, pp_layers)
    except StageError as e:
        raise CliError(fail(str(e))) from None
    ext = external_rank()
    if ext is not None and ext.world_size != tp * pp:
        raise CliError(fail(f"tp({tp}) * pp({pp}) = {tp * pp} but {ext.launcher} started {ext.world_size} ranks"))
    return layout


def resolve_model(
    model: Path | None, tp: int, *, auto: bool = False, expert_parallel: bool = False, quantize: str | None = None
):
    """(model dir, ModelConfig) after checking the directory and the tp size (shardwise.hf.resolve_model);
    exits with a one-line error. auto=True also accepts a model for the automatic plan (ModelConfig None).
    expert_parallel: tp is checked against whole experts; a model without experts is refused.
    A GGUF file without --quantize (`quantize`) is computed in its own block formats: the
    config is the one the load builds (shardwise.hf.loaded_config: the MLP cut on whole
    blocks, the bytes per weight the planner counts), and a tp that would cut a row-parallel
    tensor inside a block is refused here, for every rank, before any starts."""
    from shardwise.gguf import is_gguf
    from shardwise.hf import CheckpointError
    from shardwise.hf import resolve_model as resolve
    from shardwise.layers import ShardError

    model_dir = DEFAULT_MODEL if model is None else model
    try:
        if is_gguf(model_dir):  # llama.cpp's format: one file, its metadata the config
            if not model_dir.is_file():
                raise CheckpointError(f"model file {model_dir} does not exist")
        elif not model_dir.is_dir():  # commands load weights: a config.json alone will not do
            raise CheckpointError(f"model directory {model_dir} does not exist")
        if tp < 1:
            raise ShardError(f"--tp must be >= 1, got {tp}")
        resolved = resolve(model_dir, tp=tp, auto=auto, expert_parallel=expert_parallel)
        cfg = resolved.config
        if cfg is not None and is_gguf(model_dir) and quantize is None:
            from shardwise.hf import loaded_config
            from shardwise.hf.stored import check_block_cuts

            cfg = loaded_config(model_dir, cfg)
            if cfg.stored_bytes_per_weight:
                check_block_cuts(model_dir, cfg, tp=tp, expert_parallel=expert_parallel)
    except (CheckpointError, ShardError, NotImplementedError) as e:
        raise CliError(fail(str(e))) from None
    return model_dir, cfg


def resolve_auto(model_dir: Path, pp: int, pp_layers: list[int] | None, *, command: str):
    """The AutoModelInfo of a model of the automatic plan (resolve_model's config None) for a
    command that runs a causal LM; exits with a one-line error when it is not one, or when
    pipeline stages are asked for (the automatic plan is tp only, in verify's words)."""
    from shardwise.engine.auto import AutoModelInfo

    if pp != 1:
        raise CliError(fail(f"--pp {pp}: pipeline stages need a decoder family, not the automatic plan; use --pp 1"))
    if pp_layers is not None:
        raise CliError(fail("--pp-layers: pipeline stages need a decoder family, not the automatic plan"))
    try:
        info = AutoModelInfo.load(model_dir)
    except (ValueError, OSError) as e:
        raise CliError(fail(f"{model_dir / 'config.json'}: {e}")) from None
    if not info.causal:
        raise CliError(
            fail(f"{command} needs a causal LM; transformers builds model_type {info.model_type!r} without an LM head")
        )
    return info


def job(
    fn: Callable[..., Any],
    world_size: int,
    opts: Any,
    *,
    backend: str = "auto",
    timeout_s: float = DEFAULT_TIMEOUT_S,
    job_timeout_s: float | None = None,
    tp: int | None = None,
    allow_cross_host_tp: bool = False,
) -> Any:
    """Run fn(world, opts) on `world_size` ranks (ours, or torchrun's / mpiexec's); rank 0's
    result, None on an external launcher's other ranks. A failed rank, or ranks that do not
    fit the job (a tp group across hosts among them: tp defaults to world_size), end the
    command with the error (CliError). See shardwise.launch.run_job."""
    setup_logging()
    try:
        return run_job(
            fn,
            world_size,
            args=(opts,),
            backend=backend,
            timeout_s=timeout_s,
            job_timeout_s=job_timeout_s,
            tp=tp,
            allow_cross_host_tp=allow_cross_host_tp,
        )
    except RankFailedError as e:
        print(f"shardwise: error: rank {e.rank} failed: {e.summary}", file=sys.stderr)
        print(e.detail, file=sys.stderr)
        raise CliError(1) from None
    except JobTimeoutError as e:
        print(f"shardwise: error: {e}", file=sys.stderr)
        raise CliError(1) from None
    except LaunchError as e:
        raise CliError(2 if e.quiet else fail(str(e))) from None
