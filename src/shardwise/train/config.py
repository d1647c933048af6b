"""Training configuration: typed dataclasses, loaded from TOML, that validate themselves.

    [model]     the architecture (or a Hugging Face directory to start from) and its tokenizer
    [data]      the token file or text, sequence length, global and micro batch sizes
    [optim]     AdamW, learning-rate schedule, gradient clipping
    [parallel]  tp x pp x dp layout, sequence parallelism, backend, how dp gradients are averaged
    [run]       steps, seed, bf16, activation recomputation, logging, checkpoints, resuming

Paths in a TOML file are relative to that file. Every error names the field and the
numbers involved. See configs/*.toml and docs/training.md for examples.
"""

from __future__ import annotations

import dataclasses
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from shardwise.models.config import ModelConfig
from shardwise.train.fields import ConfigError, build_section

PATH_FIELDS = {
    ("model", "pretrained"),
    ("model", "tokenizer"),
    ("data", "tokens"),
    ("data", "text"),
    ("run", "out_dir"),
}
"""Fields holding paths: relative ones are taken from the TOML file's directory."""

__all__ = ["ModelSection", "DataSection", "OptimSection", "ParallelSection", "RunSection", "TrainConfig", "ConfigError"]


def _positive(obj, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if value is not None and value <= 0:
            raise ConfigError(f"{type(obj).__name__}.{name} must be > 0, got {value}")


@dataclass(frozen=True)
class ModelSection:
    """The model to train: a Llama-shaped decoder of these sizes, or a Hugging Face directory."""

    pretrained: str | None = None
    """A Hugging Face directory to start from (its config.json decides the architecture and
    the size fields below are ignored); None = random initialisation of the sizes below."""
    vocab_size: int = 512
    """Tokens in the vocabulary; must match the tokenizer."""
    hidden_size: int = 256
    """Width of the residual stream."""
    intermediate_size: int = 512
    """Width of the gated MLP's hidden layer (gate and up each)."""
    num_layers: int = 4
    """Decoder layers."""
    num_heads: int = 8
    """Query heads; any tp from 1 to num_heads splits them (unevenly when tp does not divide
    them: the first ranks take one more)."""
    num_kv_heads: int = 4
    """Key/value heads (grouped-query attention). Each rank holds the KV heads its query heads
    use; a KV head whose query heads span two ranks is held by both, its gradient summed."""
    head_dim: int | None = None
    """Per-head width; None = hidden_size // num_heads."""
    max_positions: int = 512
    """Longest sequence the rotary embedding is configured for (>= data.seq_len)."""
    rope_theta: float = 10000.0
    """Rotary embedding base."""
    tie_embeddings: bool = False
    """Share one matrix between the token embedding and the LM head."""
    init_std: float = 0.02
    """Standard deviation of the normal initialisation of every linear and embedding weight."""
    tokenizer: str | None = None
    """A tokenizer.json: tokenizes data.text, and is copied into checkpoints and exports."""
    bos_token_id: int | None = None
    """Written into exported configs; None = unset."""
    eos_token_id: int | None = None
    """Written into exported configs and used by `shardwise generate` to stop; None = unset."""
    num_experts: int = 0
    """Mixture of experts: routed experts in every layer's MLP (0 = a dense model). A model
    with experts is a Mixtral (or, with shared_expert_size, a Qwen2-MoE) of these sizes."""
    experts_per_token: int = 2
    """Experts each token is routed to (top-k)."""
    expert_size: int | None = None
    """Each expert's intermediate size; None = intermediate_size."""
    shared_expert_size: int = 0
    """A shared expert (with a sigmoid gate) every token goes through, Qwen2-MoE; 0 = none."""
    norm_topk_prob: bool = True
    """Renormalize the top-k routing weights to sum to 1 (Mixtral)."""
    router_aux_loss_coef: float = 0.0
    """Weight of the router's load-balancing loss added to the training loss (0 = off)."""

    def __post_init__(self) -> None:
        _positive(self, "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads")
        _positive(self, "num_kv_heads", "head_dim", "max_positions", "rope_theta", "init_std")
        if self.head_dim is None and self.hidden_size % self.num_heads:
            raise ConfigError(
                f"model.hidden_size={self.hidden_size} is not a multiple of model.num_heads={self.num_heads}; "
                "set model.head_dim"
            )
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"model.num_heads={self.num_heads} is not a multiple of model.num_kv_heads={self.num_kv_heads}"
            )
        _positive(self, "expert_size")
        if self.num_experts < 0 or self.shared_expert_size < 0 or self.router_aux_loss_coef < 0:
            raise ConfigError(
                f"model.num_experts={self.num_experts}, shared_expert_size={self.shared_expert_size} and "
                f"router_aux_loss_coef={self.router_aux_loss_coef} must be >= 0"
            )
        if self.num_experts and not 1 <= self.experts_per_token <= self.num_experts:
            raise ConfigError(
                f"model.experts_per_token={self.experts_per_token} must be in [1, model.num_experts={self.num_experts}]"
            )

    def model_config(self) -> ModelConfig:
        """The ModelConfig of a randomly initialised model (not used when `pretrained` is set)."""
        return ModelConfig(
            **{"family": "llama", **self._moe_fields()},
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_layers=self.num_layers,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim or self.hidden_size // self.num_heads,
            max_positions=self.max_positions,
            rope_theta=self.rope_theta,
            tie_embeddings=self.tie_embeddings,
        )

    def _moe_fields(self) -> dict:
        if not self.num_experts:
            return {}
        shared = self.shared_expert_size
        return {
            "family": "qwen2_moe" if shared else "mixtral",
            "num_experts": self.num_experts,
            "experts_per_token": self.experts_per_token,
            "expert_size": self.expert_size or self.intermediate_size,
            "shared_expert_size": shared,
            "shared_expert_gate": bool(shared),
            "norm_topk_prob": self.norm_topk_prob,
            "router_aux_loss_coef": self.router_aux_loss_coef,
        }


@dataclass(frozen=True)
class DataSection:
    """What to train on, and how it is batched."""

    tokens: str | None = None
    """A token file (see shardwise.train.data): a safetensors file with one 1-D `tokens` tensor."""
    text: str | None = None
    """A UTF-8 text file, tokenized with model.tokenizer into `<run.out_dir>/tokens.safetensors`
    (once; reused while the text and tokenizer are unchanged). Exactly one of tokens/text."""
    seq_len: int = 128
    """Tokens per training sequence (each sample reads seq_len + 1 tokens: inputs and targets)."""
    global_batch_size: int = 16
    """Sequences per optimizer step, over all dp ranks; the same at any tp x dp layout."""
    micro_batch_size: int = 4
    """Sequences per forward/backward on one dp rank. Gradient accumulation steps (the
    pipeline's micro-batches m) = global_batch_size / (micro_batch_size * dp), which must be
    a whole number."""
    microbatches: int | None = None
    """Micro-batches per optimizer step on each dp rank (m), instead of micro_batch_size:
    when set, micro_batch_size becomes global_batch_size / (dp * microbatches)."""
    seed: int = 0
    """Seed of the sample order (a new permutation of the samples every epoch)."""

    def __post_init__(self) -> None:
        _positive(self, "seq_len", "global_batch_size", "micro_batch_size", "microbatches")
        if (self.tokens is None) == (self.text is None):
            raise ConfigError("set exactly one of data.tokens and data.text")

    def grad_accum(self, dp: int) -> int:
        """Micro-steps per optimizer step on each dp rank."""
        per_step = self.micro_batch_size * dp
        if self.global_batch_size % per_step:
            raise ConfigError(
                f"data.global_batch_size={self.global_batch_size} is not a multiple of data.micro_batch_size="
                f"{self.micro_batch_size} * dp={dp} (= {per_step})"
            )
        return self.global_batch_size // per_step


@dataclass(frozen=True)
class OptimSection:
    """AdamW with warmup and cosine (or constant) learning rate, and global-norm clipping."""

    lr: float = 3e-3
    """Peak learning rate."""
    min_lr: float = 3e-4
    """Learning rate at the end of the cosine decay."""
    warmup_steps: int = 0
    """Steps of linear warmup from lr / warmup_steps to lr."""
    schedule: Literal["cosine", "constant"] = "cosine"
    """After warmup: cosine decay to min_lr, or constant lr."""
    decay_steps: int | None = None
    """Step at which the cosine reaches min_lr; None = run.steps. Set it when a run will be
    stopped and resumed with more steps, so the schedule does not depend on where it stops."""
    beta1: float = 0.9
    """AdamW first-moment decay."""
    beta2: float = 0.95
    """AdamW second-moment decay."""
    eps: float = 1e-8
    """AdamW denominator epsilon."""
    weight_decay: float = 0.1
    """Decoupled weight decay, applied to matrices and embeddings only (not norms or biases)."""
    grad_clip: float | None = 1.0
    """Clip the global gradient norm (across all shards, replicated parameters once) to this;
    None = no clipping (the norm is still computed and logged)."""
    distributed: bool = False
    """The distributed optimizer (ZeRO-2): AdamW's moments (and with bf16 weights the fp32
    master) of each (tp, pp, ep) position split over its dp ranks, fp32 weights stepped in
    place as their own master; gradients reduce-scattered, updated weights all-gathered (see
    shardwise.train.distopt). Same results."""
    grad_reduce_dtype: Literal["fp32", "bf16"] = "fp32"
    """The dtype gradients travel and are summed in over dp, under the distributed optimizer
    or with bf16 weights (run.dtype); the master copy and the moments stay fp32."""

    def __post_init__(self) -> None:
        _positive(self, "lr", "eps", "grad_clip", "decay_steps")
        if self.grad_reduce_dtype not in ("fp32", "bf16"):
            raise ConfigError(f"optim.grad_reduce_dtype must be 'fp32' or 'bf16', got {self.grad_reduce_dtype!r}")
        if self.min_lr < 0 or self.min_lr > self.lr:
            raise ConfigError(f"optim.min_lr={self.min_lr} must be in [0, optim.lr={self.lr}]")
        if self.warmup_steps < 0 or self.weight_decay < 0:
            raise ConfigError(f"optim.warmup_steps={self.warmup_steps} and weight_decay must be >= 0")
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ConfigError(f"optim.{name}={getattr(self, name)} must be in [0, 1)")
        if self.schedule not in ("cosine", "constant"):
            raise ConfigError(f"optim.schedule must be 'cosine' or 'constant', got {self.schedule!r}")


@dataclass(frozen=True)
class ParallelSection:
    """The tp x pp x dp layout: tp ranks hold a slice of every layer of one pipeline stage,
    pp stages hold one copy of the model, dp copies take different batches."""

    tp: int = 1
    """Tensor-parallel size."""
    dp: int = 1
    """Data-parallel size. The job runs tp * pp * dp ranks."""
    pp: int = 1
    """Pipeline-parallel size: stages, each holding a contiguous run of the decoder layers."""
    schedule: Literal["1f1b", "gpipe", "interleaved"] = "1f1b"
    """Pipeline schedule (pp > 1): "1f1b", "gpipe" (all forwards, then all backwards; holds
    every micro-batch's activations) or "interleaved" (1F1B over virtual_stages chunks per rank)."""
    virtual_stages: int = 1
    """Model chunks per pp rank: 1, or >= 2 with schedule "interleaved"."""
    pp_layers: list[int] | None = None
    """Decoder layers per (virtual) stage, e.g. [5, 3]; None = balanced (earlier stages take
    the leftover layers)."""
    backend: Literal["auto", "mpi", "gloo", "nccl"] = "auto"
    """Communication backend: "auto" = NCCL on CUDA, else MPI when installed, else gloo (as
    every shardwise command). "mpi" runs the ranks under mpiexec."""
    dp_sync: Literal["auto", "ddp", "bucketed"] = "auto"
    """How gradients are averaged over dp: "ddp" = PyTorch DistributedDataParallel on the dp
    process group (gloo, nccl); "bucketed" = flattened buckets all-reduced through the
    Communicator (any backend; the one MPI uses); "auto" = ddp on gloo/nccl, else bucketed."""
    bucket_mb: float = 25.0
    """Bucket size of the bucketed all-reduce, MiB."""
    sequence_parallel: bool = False
    """Sequence parallelism (Korthikanti et al., 2022): between the tp-split matmuls, each tp
    rank holds and computes data.seq_len / tp positions (norms, residual adds, the stage
    boundary at pp > 1) instead of all of them; each all-reduce becomes a reduce-scatter and
    an all-gather of the same volume. Same results; less activation memory. data.seq_len
    must be a multiple of tp. No effect at tp = 1."""
    ep: int = 1
    """Expert-parallel size (mixture-of-experts models): each block of ep dp ranks deals the
    experts out among its ranks (a contiguous range each, every expert's width still split
    over tp) and exchanges routed tokens with all_to_all; expert gradients are averaged over
    the dp / ep ranks holding the same experts. Must divide dp and be <= num_experts."""
    timeout_s: float = 120.0
    """Collective timeout, seconds."""

    def __post_init__(self) -> None:
        _positive(self, "tp", "dp", "pp", "ep", "virtual_stages", "bucket_mb", "timeout_s")
        if self.dp % self.ep:
            valid = ", ".join(str(k) for k in range(1, self.dp + 1) if self.dp % k == 0)
            raise ConfigError(f"parallel.ep={self.ep} must divide parallel.dp={self.dp}; valid ep: {valid}")
        if self.dp_sync not in ("auto", "ddp", "bucketed"):
            raise ConfigError(f"parallel.dp_sync must be auto, ddp or bucketed, got {self.dp_sync!r}")
        if self.pp > 1 and self.dp_sync == "ddp":
            raise ConfigError(
                f"parallel.dp_sync='ddp' runs forward through DistributedDataParallel, which a pipeline "
                f"stage does not (pp={self.pp}); use 'auto' or 'bucketed'"
            )
        if self.pp == 1 and (self.virtual_stages != 1 or self.schedule == "interleaved"):
            raise ConfigError(
                f"parallel.schedule={self.schedule!r} with virtual_stages={self.virtual_stages} needs pp > 1; "
                "at pp=1 there is no pipeline"
            )
        if self.pp_layers is not None and len(self.pp_layers) != self.pp * self.virtual_stages:
            raise ConfigError(
                f"parallel.pp_layers={self.pp_layers} has {len(self.pp_layers)} entries; pp={self.pp} x "
                f"virtual_stages={self.virtual_stages} needs {self.pp * self.virtual_stages}"
            )

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    def layout(self) -> str:
        """ "tp=2,pp=2,dp=1", the form `--layout` takes."""
        return f"tp={self.tp},pp={self.pp},dp={self.dp}"


@dataclass(frozen=True)
class RunSection:
    """How long to train, and what to write."""

    steps: int = 100
    """Optimizer steps to reach (a resumed run counts from its checkpoint's step)."""
    seed: int = 0
    """Seed of the weight initialisation and of the dropout RNG streams."""
    bf16: bool = False
    """Run forward and backward under bfloat16 autocast (weights and optimizer stay fp32)."""
    dtype: Literal["fp32", "bf16"] = "fp32"
    """The model's weights: "fp32", or "bf16" with an fp32 master copy (and fp32 AdamW
    moments) that the optimizer steps and writes back as bf16 (the master split over dp under
    optim.distributed). Checkpoints store the fp32 master."""
    log_every: int = 10
    """Log a line (loss, tokens/s, step time) every this many steps."""
    progress: bool = True
    """Show a tqdm progress bar on rank 0."""
    out_dir: str = "runs/default"
    """Where checkpoints, the token cache and the loss curve go."""
    save_every: int = 0
    """Save a checkpoint every this many steps (0 = only at the end)."""
    save_at_end: bool = True
    """Save a checkpoint after the last step."""
    keep_last: int = 3
    """Committed checkpoints to keep under out_dir/checkpoints (older ones are deleted)."""
    resume: str | None = None
    """Checkpoint to resume from: a checkpoint directory, a directory with a `latest`
    pointer, or "latest" (= out_dir/checkpoints). Any tp x dp layout can resume it."""
    plot: bool = True
    """Write the loss curve to out_dir/loss.png at the end (needs matplotlib)."""
    recompute: Literal["none", "selective", "full"] = "none"
    """Activation recomputation: "selective" recomputes each attention core (scores, softmax,
    weighted sum) in backward, "full" each whole decoder layer, keeping only its input.
    Same results; less activation memory for more compute (see docs/training.md)."""

    def __post_init__(self) -> None:
        _positive(self, "steps", "log_every", "keep_last")
        if self.save_every < 0:
            raise ConfigError(f"run.save_every must be >= 0, got {self.save_every}")
        if self.recompute not in ("none", "selective", "full"):
            raise ConfigError(f"run.recompute must be none, selective or full, got {self.recompute!r}")
        if self.dtype not in ("fp32", "bf16"):
            raise ConfigError(f"run.dtype must be 'fp32' or 'bf16', got {self.dtype!r}")


@dataclass(frozen=True)
class TrainConfig:
    """A whole training job."""

    data: DataSection
    model: ModelSection = field(default_factory=ModelSection)
    optim: OptimSection = field(default_factory=OptimSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    run: RunSection = field(default_factory=RunSection)

    def __post_init__(self) -> None:
        if self.data.microbatches is not None:
            dp, m, g = self.parallel.dp, self.data.microbatches, self.data.global_batch_size
            if g % (dp * m):
                raise ConfigError(
                    f"data.global_batch_size={g} does not split into dp={dp} x data.microbatches={m} "
                    f"micro-batches; valid microbatches: {', '.join(str(k) for k in range(1, g // dp + 1) if g % (dp * k) == 0)}"
                )
            object.__setattr__(self, "data", dataclasses.replace(self.data, micro_batch_size=g // (dp * m)))
        self.data.grad_accum(self.parallel.dp)  # raises if the batch does not split
        if self.parallel.pp > 1:
            from shardwise.pipeline import ScheduleConfig, ScheduleError

            par, m = self.parallel, self.data.grad_accum(self.parallel.dp)
            try:
                ScheduleConfig(par.schedule, par.pp, m, par.virtual_stages)
            except ScheduleError as e:
                if par.schedule == "interleaved" and par.virtual_stages > 1 and m % par.pp:
                    per_rank = self.data.global_batch_size // par.dp  # sequences per dp rank per step
                    valid = [k for k in range(par.pp, per_rank + 1, par.pp) if per_rank % k == 0]
                    raise ConfigError(
                        f"parallel.schedule='interleaved' needs the micro-batches per step (m={m}) to be a multiple "
                        f"of pp={par.pp}; valid data.microbatches for global_batch_size="
                        f"{self.data.global_batch_size} at dp={par.dp}: {', '.join(map(str, valid)) or 'none'}; "
                        "or use '1f1b', which takes any"
                    ) from None
                raise ConfigError(f"parallel.schedule: {e}") from None
        par, seq = self.parallel, self.data.seq_len
        if par.sequence_parallel and seq % par.tp:
            lower, upper = seq - seq % par.tp, seq + par.tp - seq % par.tp
            near = f"{lower} or {upper}" if lower else f"{upper}"
            raise ConfigError(
                f"parallel.sequence_parallel splits each sequence over tp={par.tp} ranks, but data.seq_len={seq} is "
                f"not a multiple of {par.tp}; use data.seq_len={near}, or sequence_parallel = false"
            )
        if self.optim.distributed and par.dp_sync == "ddp":
            raise ConfigError(
                "optim.distributed reduce-scatters the gradients itself; parallel.dp_sync='ddp' would all-reduce "
                "them too: use 'auto' or 'bucketed'"
            )
        if self.model.pretrained is None:
            self.check_stages(self.model.num_layers)
            self.check_experts(self.model.model_config())
        if self.model.pretrained is None and self.data.seq_len > self.model.max_positions:
            raise ConfigError(
                f"data.seq_len={self.data.seq_len} exceeds model.max_positions={self.model.max_positions}"
            )

    def check_experts(self, model_cfg: ModelConfig) -> None:
        """ConfigError (one line, before any collective) for what mixture-of-experts training
        does not support at this layout (see shardwise.train.experts)."""
        from shardwise.train.experts import check_moe_training

        par = self.parallel
        check_moe_training(model_cfg, ep=par.ep, dp=par.dp, pp=par.pp)
        if model_cfg.num_experts and par.sequence_parallel:
            raise ConfigError("parallel.sequence_parallel is not supported for mixture-of-experts models")
        if model_cfg.num_experts and par.dp_sync == "ddp" and par.dp > 1:
            raise ConfigError(
                "parallel.dp_sync='ddp' is not supported for mixture-of-experts models (an expert that gets no "
                "token leaves DDP waiting); use 'auto' or 'bucketed'"
            )

    def check_stages(self, num_layers: int):
        """The StageLayout of [parallel] for a model of num_layers layers; ConfigError if it cannot be built."""
        from shardwise.pipeline.stage import StageError, StageLayout

        par = self.parallel
        try:
            return StageLayout.build(num_layers, par.pp, par.virtual_stages, par.pp_layers)
        except StageError as e:
            raise ConfigError(f"parallel: {e}") from None

    @classmethod
    def from_toml(cls, path: str | Path) -> TrainConfig:
        path = Path(path)
        try:
            raw = tomllib.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file {path} does not exist") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path}: invalid TOML ({e})") from None
        try:
            return cls.from_dict(raw, base_dir=path.parent)
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from None

    @classmethod
    def from_dict(cls, raw: dict, *, base_dir: str | Path | None = None) -> TrainConfig:
        """Build from nested dicts (TOML tables); relative paths are taken from base_dir."""
        unknown = set(raw) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ConfigError(
                f"unknown section(s) [{'], ['.join(sorted(unknown))}]; known: data, model, optim, parallel, run"
            )
        sections = {}
        for f in dataclasses.fields(cls):
            section_cls = typing.get_type_hints(cls)[f.name]
            sections[f.name] = build_section(section_cls, raw.get(f.name, {}), f.name, base_dir, PATH_FIELDS)
        return cls(**sections)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def replace(self, **sections: dict) -> TrainConfig:
        """A copy with some fields changed: replace(parallel={"tp": 4}, run={"steps": 20})."""
        changed = {name: dataclasses.replace(getattr(self, name), **values) for name, values in sections.items()}
        return dataclasses.replace(self, **changed)
