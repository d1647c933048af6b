"""The training loop on one rank: set up, step, report, checkpoint, plot.

    from shardwise.checkpoint import Checkpointer
    from shardwise.launch import launch
    launch(train, 4, args=(cfg, Checkpointer()))      # cfg.parallel: tp=2, dp=2

`train(world, cfg)` runs on every rank of a tp x dp job (started by `launch`, by
`run_job`, torchrun or mpiexec). Checkpointing is passed in (any object with `save` and
`resume`, normally shardwise.checkpoint.Checkpointer), so this package does not depend
on the checkpoint format.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from tqdm.auto import tqdm

from shardwise.comm import Communicator, ParallelDims, agree
from shardwise.kernels import wgrad
from shardwise.layers import ExpertParallelMoE, ParallelMoE
from shardwise.log import get_logger
from shardwise.models.meta import materialize
from shardwise.pipeline import build_schedule
from shardwise.pipeline.runtime import PipelineRunner, RouterAux
from shardwise.pipeline.stage import stage_plan
from shardwise.sharding import enable_sequence_parallel, partial_grad_names
from shardwise.train.config import TrainConfig
from shardwise.train.data import DataError, DPSampler, TokenFile, tokenize_text
from shardwise.train.distopt import DTYPES, DistributedOptimizer, autocast, bytes_per_param
from shardwise.train.experts import ep_groups, expert_layout, unsharded_state
from shardwise.train.layout import all_rank_specs, build_model, train_plan
from shardwise.train.optim import GradNorm, build_optimizer
from shardwise.train.recompute import apply_recompute
from shardwise.train.rng import RNGTracker
from shardwise.train.step import StepStats, Trainer, train_step
from shardwise.train.sync import DDPSync, ExpertParallelSync, make_grad_sync

__all__ = ["Checkpointing", "TrainResult", "setup", "train", "token_file", "model_config", "plot_losses"]

log = get_logger("train")


class Checkpointing(Protocol):
    """What train() needs from a checkpoint implementation (shardwise.checkpoint.Checkpointer)."""

    def resume(self, tr: Trainer, source: str) -> None:
        """Fill tr.model (allocated, uninitialised), the optimizer state, tr.step, tr.history, tr.rng."""

    def save(self, tr: Trainer) -> Path:
        """Commit a checkpoint of tr (collective); return its directory."""


@dataclass
class TrainResult:
    history: list[tuple[int, float]]
    """(step, loss) of every step, including those before a resume."""
    step: int
    """Steps taken in total."""
    stats: list[StepStats] = field(default_factory=list)
    """This run's steps."""
    checkpoint: str | None = None
    """The last checkpoint committed by this run."""
    plot: str | None = None
    """The loss-curve PNG (rank 0)."""
    tokens_per_s: float = 0.0
    state: dict | None = None
    """The unsharded parameters at the end, when asked for (return_state=True)."""


def token_file(cfg: TrainConfig) -> Path:
    """The token file to read: data.tokens, or data.text tokenized into out_dir (done once)."""
    if cfg.data.tokens is not None:
        return Path(cfg.data.tokens)
    if cfg.model.tokenizer is None:
        raise DataError("data.text needs model.tokenizer (a tokenizer.json) to tokenize it")
    out = Path(cfg.run.out_dir) / "tokens.safetensors"
    return tokenize_text(cfg.data.text, cfg.model.tokenizer, out, vocab_size=_vocab_size(cfg))


def _vocab_size(cfg: TrainConfig) -> int:
    if cfg.model.pretrained is None:
        return cfg.model.vocab_size
    from shardwise.hf import read_config

    return read_config(cfg.model.pretrained)[1].vocab_size


def setup(world: Communicator, cfg: TrainConfig, *, checkpointer: Checkpointing | None = None) -> Trainer:
    """Mesh, data, model, optimizer, RNG; resumed from cfg.run.resume if set. Collective."""
    par = cfg.parallel
    cfg.check_experts(model_config(cfg))  # before any collective
    mesh = ParallelDims(world_size=world.size, tp=par.tp, dp=par.dp, pp=par.pp).build(world)
    tp, dp = mesh.tp, mesh.dp
    ep = edp = None
    if par.ep > 1:
        ep_g, edp_g = ep_groups(mesh.dims, par.ep)
        ep, edp = world.split(ep_g, name="ep"), world.split(edp_g, name="edp")
    # Rank 0 tokenizes data.text (once); then every rank opens the token file, failing together.
    agree(world, lambda: token_file(cfg) if world.rank == 0 else None, catch=(DataError, OSError))
    tokens = Path(cfg.data.tokens) if cfg.data.tokens is not None else Path(cfg.run.out_dir) / "tokens.safetensors"
    data = agree(world, lambda: TokenFile(tokens, cfg.data.seq_len), catch=(DataError,))

    resuming = cfg.run.resume is not None
    model_cfg = model_config(cfg)
    layout = cfg.check_stages(model_cfg.num_layers)
    stage = (layout, mesh.pp_rank) if par.pp > 1 else None
    sp = par.sequence_parallel and tp.size > 1
    if cfg.model.pretrained is not None and not resuming:
        from shardwise.hf import load_pretrained

        model, report = load_pretrained(cfg.model.pretrained, comm=tp, stage=stage)
        model_cfg = report.config
        if model.lm_head is not None:
            model.lm_head.gather_output = False  # vocab-parallel logits for the loss
        if ep is not None:  # the experts loaded tensor-parallel, cut down to this ep rank's
            for layer in model.layers.values() if isinstance(model.layers, dict) else model.layers:
                if isinstance(layer.mlp, ParallelMoE):
                    layer.mlp = ExpertParallelMoE.from_tensor_parallel(layer.mlp, ep=ep)
        if sp:
            enable_sequence_parallel(model, stage_plan(train_plan(model_cfg, sequence_parallel=True), model), comm=tp)
        model.train()
    else:
        model = build_model(
            model_cfg,
            tp,
            init_std=None if resuming else cfg.model.init_std,
            seed=cfg.run.seed,
            stage=stage,
            sequence_parallel=sp,
            ep=ep,
        )
        if resuming:
            materialize(model, "cpu")  # this rank's shards only; the checkpoint fills them
    apply_recompute(model, cfg.run.recompute)
    if data.vocab_size is not None and data.vocab_size > model_cfg.vocab_size:
        raise DataError(
            f"{tokens}: token ids up to {data.vocab_size} exceed the model's vocab_size={model_cfg.vocab_size}"
        )

    sampler = DPSampler(
        data.num_samples,
        global_batch=cfg.data.global_batch_size,
        micro_batch=cfg.data.micro_batch_size,
        dp=dp.size,
        dp_rank=dp.rank,
        seed=cfg.data.seed,
    )
    params = dict(model.named_parameters())
    specs = {n: per_rank for n, per_rank in all_rank_specs(model_cfg, tp.size).items() if n in params}
    experts = expert_layout(model, ep, edp) if ep is not None else None
    if experts is not None:  # an expert weight's tp slices within this ep rank's block of experts
        specs |= experts.tp_specs(model_cfg, tp.size)
    # At pp > 1 a tied embedding has a copy on the first and the last stage; the first owns it
    # (counted once in the gradient norm, written once in a checkpoint).
    copies = {"embed.weight"} if stage is not None and model_cfg.tie_embeddings and mesh.pp_rank != 0 else set()
    master = cfg.optim.distributed or cfg.run.dtype == "bf16"
    if master:  # fp32 master slices (whole at dp = 1 or without optim.distributed), before a bf16 cast
        optimizer = DistributedOptimizer(
            model, cfg.optim, specs, tp=tp, dp=dp, pp=mesh.pp, skip=copies, ep=ep, edp=edp,
            experts=experts.names if experts else frozenset(), bucket_mb=par.bucket_mb,
            shard=cfg.optim.distributed, reduce_dtype=DTYPES[cfg.optim.grad_reduce_dtype],
            weights_are_master=cfg.run.dtype == "fp32",
        )  # fmt: skip
        if cfg.run.dtype != "fp32":
            model.to(DTYPES[cfg.run.dtype])  # NOTE: fp32 weights are views of the optimizer's buffer
    else:
        optimizer = build_optimizer(model, cfg.optim)
    tr = Trainer(
        cfg=cfg,
        mesh=mesh,
        model_cfg=model_cfg,
        model=model,
        specs=specs,
        optimizer=optimizer,
        sync=optimizer if master else None,  # type: ignore[arg-type]  - set below, after resuming
        grad_norm=optimizer
        if master
        else GradNorm(
            model, specs, tp, pp=mesh.pp, skip=copies, ep=ep, experts=experts.names if experts else frozenset()
        ),
        data=data,
        sampler=sampler,
        rng=RNGTracker(cfg.run.seed, tp_rank=tp.rank, dp_rank=dp.rank, pp_rank=mesh.pp_rank),
        layout=layout,
        copies=copies,
        experts=experts,
        partial_grads=partial_grad_names(model, stage_plan(train_plan(model_cfg, sequence_parallel=sp), model))
        + head_norm_names(model, tp.size),
        extra={
            "tokenizer": cfg.model.tokenizer,
            "bos_token_id": cfg.model.bos_token_id,
            "eos_token_id": cfg.model.eos_token_id,
        },
    )
    if resuming:
        if checkpointer is None:
            raise ValueError("run.resume is set but no checkpointer was given to train()/setup()")
        checkpointer.resume(tr, cfg.run.resume)
    # A pipeline stage's forward does not go through the module, so DDP cannot wrap it: bucketed.
    # MoE: bucketed (an expert that gets no token would leave DDP waiting for its gradient).
    mode = par.dp_sync if stage is None and not model_cfg.num_experts else "bucketed"
    if master:
        pass  # the DistributedOptimizer reduces the gradients itself
    elif experts is not None:
        tr.sync = ExpertParallelSync(model, dp, experts.edp, experts.names, par.bucket_mb)
    else:
        tr.sync = make_grad_sync(model, dp, mode=mode, bucket_mb=par.bucket_mb)
    if not isinstance(tr.sync, DDPSync):  # DDP's reducer watches AccumulateGrad, which the fused path skips
        wgrad.fuse(p for p in model.parameters() if p.dim() == 2)  # dW accumulated in the product (kernels.wgrad)
    if stage is not None:
        tr.pipeline = PipelineRunner(
            model,
            layout,
            mesh.pp,
            build_schedule(par.schedule, par.pp, sampler.grad_accum, par.virtual_stages)[mesh.pp_rank],
            hidden_size=model_cfg.hidden_size,
            autocast=lambda: autocast(model, cfg.run),
            seq_shards=tp.size if sp else 1,
            router=RouterAux(model_cfg.num_experts, model_cfg.experts_per_token, model_cfg.router_aux_loss_coef, dp)
            if model_cfg.num_experts and model_cfg.router_aux_loss_coef
            else None,
        )
    return tr


def head_norm_names(model, tp: int) -> list[str]:
    """The q/k norm weights (Qwen3, per head_dim, replicated): each tp rank applies them to
    its own heads only, so its gradient is a partial sum over tp, summed with the sequence
    parallel ones. Empty at tp = 1 or without q/k norms."""
    if tp == 1:
        return []
    return [n for n, _ in model.named_parameters() if ".attn.q_norm." in n or ".attn.k_norm." in n]


def _experts_share(tr) -> str:
    return f" (experts' over edp={tr.experts.edp.size})" if tr.experts is not None else ""


def model_config(cfg: TrainConfig):
    """The ModelConfig to train: from [model], or from the pretrained directory's config.json."""
    if cfg.model.pretrained is None:
        return cfg.model.model_config()
    from shardwise.hf import read_config

    return read_config(cfg.model.pretrained)[1]


def train(
    world: Communicator,
    cfg: TrainConfig,
    checkpointer: Checkpointing | None = None,
    *,
    return_state: bool = False,
) -> TrainResult:
    """Train to cfg.run.steps on this rank; checkpoint and plot as configured. Collective."""
    tr = setup(world, cfg, checkpointer=checkpointer)
    run, lead = cfg.run, world.rank == 0
    log.info(
        "training %s: %d layers, hidden %d, %s parameters per rank; tp=%d x pp=%d x dp=%d, %d micro-step(s) of "
        "%d x %d tokens per rank per step; from step %d to %d",
        tr.model_cfg.family,
        tr.model_cfg.num_layers,
        tr.model_cfg.hidden_size,
        f"{sum(p.numel() for p in tr.model.parameters()):,}",
        tr.mesh.tp.size,
        tr.mesh.pp.size,
        tr.mesh.dp.size,
        tr.sampler.grad_accum,
        cfg.data.micro_batch_size,
        cfg.data.seq_len,
        tr.step,
        run.steps,
    )
    n = sum(p.numel() for p in tr.model.parameters())
    per = bytes_per_param(run.dtype, cfg.optim.distributed, tr.mesh.dp.size)
    if tr.experts is not None and cfg.optim.distributed:  # experts' state over edp: the mean per parameter
        n_exp = sum(p.numel() for name, p in tr.model.named_parameters() if name in tr.experts.names)
        routed = bytes_per_param(run.dtype, True, tr.experts.edp.size)
        per = {k: ((n - n_exp) * per[k] + n_exp * routed[k]) / n for k in per}
    log.info(
        "training state per rank: %s weights + %s grads + %s optimizer = %s bytes/parameter, %.1f MiB (%s)",
        *(f"{per[k]:.4g}" for k in ("weights", "grads", "optimizer", "total")), per["total"] * n / 2**20,
        (f"distributed optimizer: moments{' and fp32 master' if run.dtype == 'bf16' else ''} split over "
         f"dp={tr.mesh.dp.size}{_experts_share(tr)}{'' if run.dtype == 'bf16' else ', fp32 weights stepped in place'}")
        if cfg.optim.distributed else "bf16 weights, fp32 master" if run.dtype == "bf16" else "plain AdamW",
    )  # fmt: skip
    if cfg.parallel.sequence_parallel or run.recompute != "none":
        log.info(
            "activations: sequence parallelism %s, recompute %s",
            f"on ({cfg.data.seq_len // tr.mesh.tp.size} of {cfg.data.seq_len} positions per tp rank)"
            if cfg.parallel.sequence_parallel and tr.mesh.tp.size > 1
            else "off" + (" (tp=1)" if cfg.parallel.sequence_parallel else ""),
            run.recompute,
        )
    if tr.experts is not None:
        log.info(
            "experts: ep=%d (%d edp replica%s of each expert); this rank holds %s per MoE layer",
            tr.experts.ep.size, tr.experts.edp.size, "" if tr.experts.edp.size == 1 else "s",
            _held(tr),
        )  # fmt: skip
    if tr.pipeline is not None:
        log.info(
            "pipeline: %s schedule, %d micro-batch%s; %s",
            cfg.parallel.schedule, tr.sampler.grad_accum, "" if tr.sampler.grad_accum == 1 else "es",
            tr.layout.describe(),
        )  # fmt: skip
    bar = tqdm(total=run.steps, initial=tr.step, desc="train", unit="step", disable=not (lead and run.progress))
    result = TrainResult(history=tr.history, step=tr.step)
    start, saved_at = time.perf_counter(), None
    while tr.step < run.steps:
        stats = train_step(tr)
        result.stats.append(stats)
        tok_s = stats.tokens / stats.seconds
        bar.update(1)
        bar.set_postfix(loss=f"{stats.loss:.4f}", tok_s=f"{tok_s:,.0f}", ms=f"{stats.seconds * 1e3:.0f}")
        if stats.step % run.log_every == 0 or stats.step == run.steps:
            parts = (
                ""
                if stats.aux_loss is None
                else (f" (ce {stats.ce_loss:.4f} + {tr.model_cfg.router_aux_loss_coef:g} x aux {stats.aux_loss:.4f})")
            )
            log.info(
                "step %d/%d  loss %.4f%s  grad norm %.3f  lr %.2e  %s tok/s  %.0f ms/step",
                stats.step, run.steps, stats.loss, parts, stats.grad_norm, stats.lr, f"{tok_s:,.0f}",
                stats.seconds * 1e3,
            )  # fmt: skip
        if checkpointer is not None and run.save_every and stats.step % run.save_every == 0:
            result.checkpoint, saved_at = str(checkpointer.save(tr)), tr.step
    bar.close()
    elapsed = time.perf_counter() - start
    if result.stats:
        result.tokens_per_s = sum(s.tokens for s in result.stats) / elapsed
    if checkpointer is not None and run.save_at_end and result.stats and saved_at != tr.step:
        result.checkpoint = str(checkpointer.save(tr))
    result.step = tr.step
    if run.plot and lead and tr.history:
        result.plot = str(plot_losses(tr.history, Path(run.out_dir) / "loss.png", title=_title(tr)))
    if return_state:
        result.state = unsharded_state(tr)
    return result


def _held(tr: Trainer) -> str:
    """ "experts 0-2 of 5" for this rank."""
    from shardwise.layers import expert_ranges

    first, end = expert_ranges(tr.model_cfg.num_experts, tr.experts.ep.size)[tr.experts.ep.rank]
    return f"experts {first}-{end - 1} of {tr.model_cfg.num_experts}"


def _title(tr: Trainer) -> str:
    c = tr.model_cfg
    return (
        f"{c.family}, {c.num_layers} layers x {c.hidden_size}, "
        f"tp={tr.mesh.tp.size} x pp={tr.mesh.pp.size} x dp={tr.mesh.dp.size}, "
        f"batch {tr.cfg.data.global_batch_size} x {tr.cfg.data.seq_len} tokens"
    )


def plot_losses(history: list[tuple[int, float]], path: Path, *, title: str = "") -> Path:
    """The loss curve as a PNG (matplotlib, headless)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps, losses = zip(*history, strict=True)
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    ax.plot(steps, losses, lw=1.2, label="training loss (mean over the global batch)")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
