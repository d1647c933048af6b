"""The cost model's formulas: FLOPs, collectives, the pipeline's bubble, messages and activations held. Sources in docs/planner-validation.md.

FLOPs count a multiply-add as 2. Attention counts the full context for every query (as
Megatron-LM does, and as shardwise's masked attention computes it).
"""

from __future__ import annotations

from dataclasses import dataclass

from shardwise.layers.partition import HeadLayout, padded_size
from shardwise.models.config import ModelConfig
from shardwise.planner.footprint import layer_params

__all__ = [
    "Collective",
    "layer_flops_per_token",
    "attention_core_flops_per_token",
    "head_flops_per_token",
    "forward_flops_per_token",
    "training_flops_per_token",
    "megatron_flops_per_iteration",
    "pipeline_bubble_fraction",
    "interleaved_bubble_fraction",
    "pipeline_in_flight",
    "p2p_messages_per_step",
    "p2p_bytes_per_message",
    "tp_forward_collectives",
    "tp_backward_collectives",
]


@dataclass(frozen=True)
class Collective:
    """`calls` collectives of one kind on one group, their total payload and time."""

    op: str
    """all_reduce, all_gather, broadcast or send."""
    group: str
    """tp, pp or dp."""
    calls: int
    bytes: int
    """Total payload over the calls: each rank's input tensor, as shardwise's accounting counts it."""
    link: str = ""
    seconds: float = 0.0

    def key(self) -> str:
        return f"{self.op}/{self.group}"


def layer_flops_per_token(cfg: ModelConfig, context: int, tp: int = 1) -> float:
    """Forward FLOPs of one layer for one token attending to `context` tokens, on one rank:
    2 x matmul weights + 4 x context x query heads x head_dim (QK^T and AV)."""
    matmul = layer_params(cfg, tp)[1]
    return 2.0 * matmul + attention_core_flops_per_token(cfg, context, tp)


def attention_core_flops_per_token(cfg: ModelConfig, context: int, tp: int = 1) -> float:
    """The attention core's forward FLOPs for one token on one rank, 4 x context x query
    heads x head_dim (QK^T and AV): what selective recomputation repeats in backward."""
    heads = HeadLayout(cfg.num_heads, cfg.num_kv_heads, tp).max_heads  # the busiest rank's
    return 4.0 * context * heads * cfg.head_dim


def head_flops_per_token(cfg: ModelConfig, tp: int = 1) -> float:
    """2 x hidden x vocab (per rank: its padded slice of the vocabulary)."""
    return 2.0 * cfg.hidden_size * (padded_size(cfg.vocab_size, tp) // tp)


def forward_flops_per_token(cfg: ModelConfig, context: int) -> float:
    """Whole-model forward FLOPs for one token (no tensor parallelism)."""
    return cfg.num_layers * layer_flops_per_token(cfg, context) + head_flops_per_token(cfg)


def training_flops_per_token(cfg: ModelConfig, seq: int, *, recompute: bool) -> float:
    """Forward + backward (2x forward) per token; full recomputation adds one more forward
    of the layers (not of the head): Narayanan et al. 2021, appendix."""
    passes = 4 if recompute else 3
    return passes * cfg.num_layers * layer_flops_per_token(cfg, seq) + 3 * head_flops_per_token(cfg)


def megatron_flops_per_iteration(B: int, s: int, l: int, h: int, V: int, *, recompute: bool = True) -> float:  # noqa: E741
    """Narayanan et al. 2021, eq. (3) for GPT: 96 B s l h^2 (1 + s/(6h) + V/(16 l h)) with
    activation recomputation; 72 B s l h^2 (1 + s/(6h) + V/(12 l h)) without."""
    if recompute:
        return 96.0 * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h))
    return 72.0 * B * s * l * h * h * (1 + s / (6 * h) + V / (12 * l * h))


def pipeline_bubble_fraction(pp: int, micro_batches: int) -> float:
    """Idle fraction of a GPipe / 1F1B pipeline step: (p - 1) / (m + p - 1)."""
    return (pp - 1) / (micro_batches + pp - 1)


def interleaved_bubble_fraction(pp: int, micro_batches: int, virtual_stages: int) -> float:
    """Idle fraction of interleaved 1F1B with v chunks per rank, m a multiple of p, when a
    forward and a backward cost the same: (p - 1) / (v m + p - 1) (Narayanan et al. 2021:
    bubble / ideal time = (p - 1) / (v m)). With a backward twice a forward, as in training,
    this runtime's interleaved orders idle more: the planner simulates them instead."""
    return (pp - 1) / (virtual_stages * micro_batches + pp - 1)


def pipeline_in_flight(schedule: str, pp: int, stage: int, micro_batches: int) -> int:
    """Micro-batches whose activations stage `stage` holds at most: GPipe all m; 1F1B
    min(p - s, m) (Narayanan et al. 2021)."""
    return micro_batches if schedule == "gpipe" else min(pp - stage, micro_batches)


def p2p_messages_per_step(pp: int, micro_batches: int, virtual_stages: int = 1) -> int:
    """Stage-to-stage messages of one step: every micro-batch's activation forward and its
    gradient backward across each of the p v - 1 boundaries between (virtual) stages:
    2 m (p v - 1); 2 m (p - 1) without interleaving."""
    return 2 * micro_batches * (pp * virtual_stages - 1)


def p2p_bytes_per_message(micro_batch: int, seq: int, hidden: int, width: int) -> int:
    """One stage-boundary tensor: (micro_batch, seq, hidden) values of `width` bytes."""
    return micro_batch * seq * hidden * width


def tp_forward_collectives(
    cfg: ModelConfig, tp: int, *, batch: int, tokens: int, width: int, layers: int, first: bool, last: bool,
    logit_rows: int = 1,
) -> list[Collective]:  # fmt: skip
    """The tensor-parallel collectives of one forward of `layers` layers on one rank, as
    shardwise's layers issue them: 2 all-reduces per layer (after attention's and the MLP's
    row-parallel matmul) of (batch, tokens, hidden), 1 for the vocab-parallel embedding
    (first stage), and 1 all-gather of the logits of `logit_rows` positions (last stage;
    0 when the logits stay split, as for the vocab-parallel loss in training)."""
    if tp == 1:
        return []
    act = batch * tokens * cfg.hidden_size * width
    calls = 2 * layers + (1 if first else 0)
    out = [Collective("all_reduce", "tp", calls, calls * act)] if calls else []
    if last and logit_rows:
        rows = padded_size(cfg.vocab_size, tp) // tp
        out.append(Collective("all_gather", "tp", 1, batch * logit_rows * rows * width))
    return out


def tp_backward_collectives(
    cfg: ModelConfig, tp: int, *, batch: int, tokens: int, width: int, layers: int, last: bool, recompute: bool,
    sequence_parallel: bool = False,
) -> list[Collective]:  # fmt: skip
    """Backward: 2 all-reduces per layer (the input gradients of the column-parallel
    matmuls) and 1 for the head's input on the last stage; recomputation repeats the
    forward's 2 per layer. The vocab-parallel loss adds 2 small all-reduces of fp32
    values per token (max; target logit and sum of exponentials). Under sequence
    parallelism each all-reduce is a reduce-scatter and an all-gather of the same bytes on
    the wire (counted as the all-reduce), and the column-parallel layers all-gather their
    saved input shards again: 2 more all-gathers of (batch, tokens / tp, hidden) per layer."""
    if tp == 1:
        return []
    act = batch * tokens * cfg.hidden_size * width
    calls = (4 if recompute else 2) * layers + (1 if last else 0)
    out = [Collective("all_reduce", "tp", calls, calls * act)]
    if sequence_parallel:
        out.append(Collective("all_gather", "tp", 2 * layers, 2 * layers * act // tp))
    if last:
        out.append(Collective("all_reduce", "tp", 2, batch * tokens * 4 * 3))
    return out
