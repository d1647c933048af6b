"""The trained model at a tp size: building it, where each rank's shards sit, and who owns what.

`rank_specs(cfg, tp, rank)` gives the ShardSpecs of any rank of any tp size on one
process, with no communication (a meta-device model sharded through a dry-run
communicator). From those:

- ownership: a global row held by several tp ranks (a replicated tensor, or a KV head
  replicated when tp > num_kv_heads) is *owned* by the lowest of them. Owned rows are
  counted once in the gradient norm and written once in a checkpoint.
- `full_state`: the unsharded tensors, gathered by summing owned rows over tp (exact:
  every element has one non-zero contribution).
"""

from __future__ import annotations

import hashlib

import torch
from torch import nn

from shardwise.comm import Communicator
from shardwise.comm.dryrun import DryRunCommunicator
from shardwise.layers import ShardSpec, model_shard_specs
from shardwise.models.config import ModelConfig
from shardwise.models.decoder import DecoderLM
from shardwise.models.meta import materialize, on_meta
from shardwise.models.modules import Norm
from shardwise.models.moe import Experts, MoE
from shardwise.pipeline.stage import StageLayout, keep_stage, stage_plan
from shardwise.sharding import parallelize
from shardwise.sharding.plan import Plan
from shardwise.sharding.plans.decoder import decoder_plan

__all__ = [
    "train_plan",
    "build_model",
    "init_weights",
    "rank_specs",
    "all_rank_specs",
    "owned_intervals",
    "owned_mask",
    "local_segments",
    "full_state",
    "gather_tp",
    "plan_summary",
]


def train_plan(cfg: ModelConfig, *, sequence_parallel: bool = False) -> Plan:
    """decoder_plan with vocab-parallel logits, for vocab_parallel_cross_entropy.

    Sequence parallelism changes the collectives, not the parameters: both plans shard
    every parameter alike (the specs, checkpoints and plan_summary below are the same)."""
    if cfg.family == "bert" or not cfg.causal:
        raise NotImplementedError(f"training supports decoder families; {cfg.family!r} is an encoder")
    return decoder_plan(cfg, gather_logits=False, sequence_parallel=sequence_parallel)


def plan_summary(cfg: ModelConfig) -> dict[str, str]:
    """The plan as strings, for a checkpoint manifest."""
    return {
        pattern: str(style) if isinstance(style, str) else repr(style) for pattern, style in train_plan(cfg).items()
    }


def init_weights(model: nn.Module, std: float, seed: int = 0) -> None:
    """Normal(0, std) for every linear and embedding weight and the stacked expert weights,
    zero biases, norms at their identity (in place, on unsharded modules).

    Each weight draws from its own generator, seeded from (seed, its name), so a tensor's
    initial values do not depend on which other tensors this rank builds: a pipeline
    stage initialises only its own layers and gets the same weights as the whole model."""
    seen: set[int] = set()  # a tied weight is drawn once, under its first name ("embed.weight")
    with torch.no_grad():
        for prefix, module in model.named_modules():
            if isinstance(module, (nn.Linear, nn.Embedding)) and id(module.weight) not in seen:
                seen.add(id(module.weight))
                g = torch.Generator().manual_seed(_name_seed(seed, f"{prefix}.weight"))
                module.weight.copy_(torch.randn(module.weight.shape, generator=g) * std)
                if getattr(module, "bias", None) is not None:
                    module.bias.zero_()
            elif isinstance(module, Experts):  # stacked expert weights: plain Parameters, not Linears
                for name in ("up", "down"):
                    weight = getattr(module, name)
                    g = torch.Generator().manual_seed(_name_seed(seed, f"{prefix}.{name}"))
                    weight.copy_(torch.randn(weight.shape, generator=g) * std)
            elif isinstance(module, Norm):
                module.weight.fill_(1.0 - module.offset)
                if module.bias is not None:
                    module.bias.zero_()


def _name_seed(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()) % (2**63 - 1)


def build_model(
    cfg: ModelConfig,
    tp: Communicator,
    *,
    init_std: float | None,
    seed: int = 0,
    stage: tuple[StageLayout, int] | None = None,
    sequence_parallel: bool = False,
    ep: Communicator | None = None,
) -> nn.Module:
    """This rank's shard of a DecoderLM, in train mode.

    stage = (layout, pp rank): only that pipeline stage's part is built (keep_stage).
    init_std set: the rank's part is built unsharded on CPU and initialised (init_weights:
    the same values at every tp and pp), then sliced to its tp shard.
    init_std None: parameters stay on the meta device, for a checkpoint loader to fill.
    sequence_parallel: shard by train_plan(cfg, sequence_parallel=True).
    ep: an expert-parallel group of more than one rank: each MoE block becomes an
    ExpertParallelMoE over tp and ep (shardwise.train.experts) instead of the plan's style.
    """
    with on_meta():
        model = DecoderLM(cfg)
    if stage is not None:
        keep_stage(model, *stage)
    if init_std is not None:
        materialize(model, "cpu")
        init_weights(model, init_std, seed)
    plan = stage_plan(train_plan(cfg, sequence_parallel=sequence_parallel), model)
    if ep is not None and ep.size > 1:
        from shardwise.layers.moe_ep import ExpertParallelMoE
        from shardwise.sharding.styles import MixtureOfExperts

        plan = {k: v for k, v in plan.items() if not isinstance(v, MixtureOfExperts)}
        layers = model.layers.values() if isinstance(model.layers, nn.ModuleDict) else model.layers
        for layer in layers:  # a stage's layers are a ModuleDict (keep_stage)
            if isinstance(layer.mlp, MoE):
                layer.mlp = ExpertParallelMoE(layer.mlp, tp=tp, ep=ep)
    return parallelize(model, plan, comm=tp).train()


def rank_specs(cfg: ModelConfig, tp: int, rank: int) -> dict[str, ShardSpec]:
    """The ShardSpec of every parameter on `rank` of a tp-sized job; no communication."""
    with on_meta():
        model = DecoderLM(cfg)
    parallelize(model, train_plan(cfg), comm=DryRunCommunicator(tp, rank))
    return model_shard_specs(model)


def all_rank_specs(cfg: ModelConfig, tp: int) -> dict[str, list[ShardSpec]]:
    """{parameter: [spec of tp rank 0, 1, ...]}."""
    per_rank = [rank_specs(cfg, tp, r) for r in range(tp)]
    return {name: [specs[name] for specs in per_rank] for name in per_rank[0]}


def _span(spec: ShardSpec) -> int:
    return spec.global_shape[spec.dim] if spec.dim is not None else (spec.global_shape[0] if spec.global_shape else 1)


def _subtract(intervals: list[tuple[int, int]], taken: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """(start, length) intervals minus the union of `taken`."""
    out = []
    for start, length in intervals:
        pieces = [(start, start + length)]
        for t_start, t_len in taken:
            t_end = t_start + t_len
            pieces = [q for a, b in pieces for q in ((a, min(b, t_start)), (max(a, t_end), b)) if q[1] > q[0]]
        out += [(a, b - a) for a, b in pieces]
    return out


def owned_intervals(specs: list[ShardSpec], rank: int) -> list[tuple[int, int]]:
    """Global (start, length) ranges along the split dim that `rank` owns (held by no lower rank).

    A replicated tensor is one range along dim 0 (the whole tensor; a 0-d tensor counts
    as length 1), owned by rank 0 alone.
    """
    spec = specs[rank]
    if spec.dim is None:
        return [(0, _span(spec))] if rank == 0 else []
    lower = [piece for r in range(rank) for piece in specs[r].pieces if piece[1]]
    return _subtract([p for p in spec.pieces if p[1]], lower)


def local_segments(spec: ShardSpec) -> list[tuple[int, int, int]]:
    """(local_start, global_start, length) of each piece, along the split dim."""
    out, local = [], 0
    for start, length in spec.pieces:
        out.append((local, start, length))
        local += length
    return out


def owned_mask(specs: list[ShardSpec], rank: int) -> torch.Tensor | None:
    """Bool mask over this rank's local rows (along the split dim) that it owns;
    None = owns everything (a replicated tensor on rank 0, or an unshared shard)."""
    spec = specs[rank]
    owned = owned_intervals(specs, rank)
    if spec.dim is None:
        return None if owned else torch.zeros(_span(spec), dtype=torch.bool)
    mask = torch.zeros(spec.local_shape[spec.dim], dtype=torch.bool)
    for local, start, length in local_segments(spec):
        for o_start, o_len in owned:
            a, b = max(start, o_start), min(start + length, o_start + o_len)
            if b > a:
                mask[local + a - start : local + b - start] = True
    return None if bool(mask.all()) else mask


def full_state(model: nn.Module, tp: Communicator, specs: dict[str, list[ShardSpec]]) -> dict[str, torch.Tensor]:
    """Every parameter, unsharded, on every tp rank (collective: one all-reduce per tensor)."""
    params = dict(model.named_parameters())
    return {name: gather_tp(params[name].detach(), per_rank, tp) for name, per_rank in specs.items()}


def gather_tp(local: torch.Tensor, per_rank: list[ShardSpec], tp: Communicator) -> torch.Tensor:
    """One tensor, unsharded, from every tp rank's `local` (its spec per_rank[rank]), on every
    tp rank: the owned rows summed over tp (collective: one all-reduce)."""
    spec = per_rank[tp.rank]
    full = local.new_zeros(spec.global_shape)
    if spec.dim is None:
        if tp.rank == 0:
            full.copy_(local)
    else:
        for o_start, o_len in owned_intervals(per_rank, tp.rank):
            for l_start, g_start, length in local_segments(spec):
                a, b = max(g_start, o_start), min(g_start + length, o_start + o_len)
                if b > a:
                    src = local.narrow(spec.dim, l_start + a - g_start, b - a)
                    full.narrow(spec.dim, a, b - a).copy_(src)
    return tp.all_reduce(full)
