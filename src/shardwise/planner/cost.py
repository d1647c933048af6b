"""The cost model's formulas: FLOPs, collectives, the pipeline's bubble, messages and activations held. Sources in docs/benchmarks/planner-validation.md.

FLOPs count a multiply-add as 2. Attention counts the full context for every query (as
Megatron-LM does, and as shardwise's masked attention computes it).

A mixture-of-experts layer computes, per token, the router, its k routed experts and the
shared expert, not all E experts (GShard, Lepikhin et al. 2020; Switch Transformer, Fedus
et al. 2021): moe_flops_per_token. Training with experts dealt over the data-parallel ranks
moves every routed (token, choice) pair to its expert's rank and back with all_to_alls
(ep_all_to_alls; shardwise.layers.dispatch).
"""

from __future__ import annotations

from dataclasses import dataclass

from shardwise.layers.partition import HeadLayout, largest_share, padded_size
from shardwise.models.config import ModelConfig
from shardwise.planner.footprint import (
    _dense_mlp_params,
    expert_share,
    layer_params,
    moe_layer_count,
    touched_experts,
)

__all__ = [
    "ARGMAX_BYTES",
    "Collective",
    "layer_flops_per_token",
    "layers_flops_per_token",
    "moe_flops_per_token",
    "routed_flops_per_token",
    "experts_computed",
    "all_to_all_s",
    "ep_all_to_alls",
    "EXPERT_LAUNCHES",
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
    """all_reduce, all_gather, reduce_scatter, all_to_all, broadcast or send."""
    group: str
    """tp, pp or dp."""
    calls: int
    bytes: int
    """Total payload over the calls: each rank's input tensor, as shardwise's accounting counts it."""
    link: str = ""
    seconds: float = 0.0
    wire: str = "fp32"
    """The payload's format on the wire (planner.wire: fp32, bf16, q8)."""

    def key(self) -> str:
        return f"{self.op}/{self.group}"


def layer_flops_per_token(cfg: ModelConfig, context: int, tp: int = 1) -> float:
    """Forward FLOPs of one layer for one token attending to `context` tokens, on one rank:
    2 x matmul weights + 4 x context x query heads x head_dim (QK^T and AV)."""
    matmul = layer_params(cfg, tp)[1]
    return 2.0 * matmul + attention_core_flops_per_token(cfg, context, tp)


def moe_flops_per_token(cfg: ModelConfig, tp: int = 1, *, expert_parallel: bool = False, ep_dp: int = 1) -> float:
    """Forward FLOPs of one MoE block per token on the busiest rank: 2 x (router H x E + the
    routed experts' 3 x H x width + the shared expert's 3 x H x shared width / tp + its gate H).

    The routed work of the k experts a token picks: tensor-parallel experts split each over
    tp (k x 3 H I / tp). Whole experts over tp (expert_parallel): the busiest rank, holding
    n of E, computes n / E of every token's k pairs at the full width. Over ep_dp data-parallel
    ranks (each expert split over tp): it computes the pairs of ep_dp ranks' tokens, ep_dp n / E
    per own token. Both under uniform routing."""
    h, E = cfg.hidden_size, cfg.num_experts
    shared = 0
    if cfg.shared_expert_size:
        shared = 3 * h * largest_share(cfg.shared_expert_size, tp) + (h if cfg.shared_expert_gate else 0)
    return 2.0 * (h * E + shared) + routed_flops_per_token(cfg, tp, expert_parallel=expert_parallel, ep_dp=ep_dp)


def routed_flops_per_token(cfg: ModelConfig, tp: int = 1, *, expert_parallel: bool = False, ep_dp: int = 1) -> float:
    """The routed experts' part of moe_flops_per_token: 2 x k x share x 3 x H x width, the
    busiest rank's share of every token's k (token, expert) pairs (moe_flops_per_token)."""
    k, E = cfg.experts_per_token, cfg.num_experts
    n, width = expert_share(cfg, tp, expert_parallel=expert_parallel, ep_dp=ep_dp)
    share = n / E if expert_parallel else (ep_dp * n / E if ep_dp > 1 else 1.0)
    return 2.0 * k * share * 3 * cfg.hidden_size * width


def layers_flops_per_token(cfg: ModelConfig, context: float, tp: int = 1, layers: int | None = None, *,
                           expert_parallel: bool = False, ep_dp: int = 1) -> float:  # fmt: skip
    """Forward FLOPs of `layers` layers (default all) for one token on the busiest rank: the
    dense ones as layer_flops_per_token, the MoE ones (moe_layer_count) with moe_flops_per_token
    in place of the dense MLP."""
    layers = cfg.num_layers if layers is None else layers
    dense = layer_flops_per_token(cfg, context, tp)
    n_moe = moe_layer_count(cfg, layers)
    if not n_moe:
        return layers * dense
    moe = (
        dense
        - 2.0 * _dense_mlp_params(cfg, tp)[1]
        + moe_flops_per_token(cfg, tp, expert_parallel=expert_parallel, ep_dp=ep_dp)
    )
    return (layers - n_moe) * dense + n_moe * moe


EXPERT_LAUNCHES = 0.125
"""The fixed cost of computing one expert on one rank, as a fraction of a layer's fixed
cost (Device.layer_overhead_us): its 4 kernel launches (2 matmuls, the activation, the
product; shardwise.models.moe.Experts) against about 32 for a dense decoder layer in eager
PyTorch. An assumption (not measured): it is what makes a rank that computes fewer experts
(expert parallelism) faster once every expert is touched."""


def experts_computed(cfg: ModelConfig, tp: int, layers: int, rows: float | None, *, expert_parallel: bool = False,
                     ep_dp: int = 1) -> float:  # fmt: skip
    """Experts the busiest rank computes in `layers` layers for `rows` routed tokens (each
    pays EXPERT_LAUNCHES of a layer's fixed time): touched_experts per MoE layer."""
    if not cfg.num_experts:
        return 0.0
    return moe_layer_count(cfg, layers) * touched_experts(cfg, tp, rows, expert_parallel=expert_parallel, ep_dp=ep_dp)


def all_to_all_s(link, nbytes: float, p: int) -> float:
    """Seconds for one all_to_all of `nbytes` per rank over p devices: each rank sends
    (p - 1) / p of its buffer and receives as much (alpha-beta, the link's bus bandwidth)."""
    return 0.0 if p <= 1 else link.latency_us * 1e-6 + (p - 1) / p * nbytes / (link.busbw_gbps * 1e9)


def ep_all_to_alls(cfg: ModelConfig, dp: int, *, tokens: int, width: int, layers: int) -> tuple[list, list]:
    """(forward, backward) all_to_alls of `layers` layers on one rank when the experts are
    dealt over dp ranks (shardwise.layers.dispatch): per MoE layer 4 forward (the counts, dp
    int64; the rows, tokens x k x H x width; the expert ids, tokens x k int64; the results,
    as the rows) and 2 backward (the results' and the rows' gradients)."""
    n_moe = moe_layer_count(cfg, layers)
    if dp == 1 or not n_moe:
        return [], []
    rows = tokens * cfg.experts_per_token * cfg.hidden_size * width
    ids = tokens * cfg.experts_per_token * 8
    fwd = n_moe * (8 * dp + 2 * rows + ids)
    return [Collective("all_to_all", "ep", 4 * n_moe, fwd)], [
        Collective("all_to_all", "ep", 2 * n_moe, 2 * n_moe * rows)
    ]


def attention_core_flops_per_token(cfg: ModelConfig, context: int, tp: int = 1) -> float:
    """The attention core's forward FLOPs for one token on one rank, 4 x context x query
    heads x head_dim (QK^T and AV): what selective recomputation repeats in backward."""
    heads = HeadLayout(cfg.num_heads, cfg.num_kv_heads, tp).max_heads  # the busiest rank's
    return 4.0 * context * heads * cfg.head_dim


def head_flops_per_token(cfg: ModelConfig, tp: int = 1) -> float:
    """2 x hidden x vocab (per rank: its padded slice of the vocabulary)."""
    return 2.0 * cfg.hidden_size * (padded_size(cfg.vocab_size, tp) // tp)


def forward_flops_per_token(cfg: ModelConfig, context: int) -> float:
    """Whole-model forward FLOPs for one token (no tensor parallelism; a mixture of experts:
    the k experts a token uses)."""
    return layers_flops_per_token(cfg, context) + head_flops_per_token(cfg)


def training_flops_per_token(cfg: ModelConfig, seq: int, *, recompute: bool) -> float:
    """Forward + backward (2x forward) per token; full recomputation adds one more forward
    of the layers (not of the head): Narayanan et al. 2021, appendix."""
    passes = 4 if recompute else 3
    return passes * layers_flops_per_token(cfg, seq) + 3 * head_flops_per_token(cfg)


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


ARGMAX_BYTES = 16
"""A sequence's share of the greedy choice's all-gather (engine.argmax): its best value and index, two float64."""


def p2p_bytes_per_message(micro_batch: int, seq: int, hidden: int, width: int) -> int:
    """One stage-boundary tensor: (micro_batch, seq, hidden) values of `width` bytes."""
    return micro_batch * seq * hidden * width


def tp_forward_collectives(
    cfg: ModelConfig, tp: int, *, batch: int, tokens: int, width: int, layers: int, first: bool, last: bool,
    logit_rows: int = 1, argmax: bool = False,
) -> list[Collective]:  # fmt: skip
    """The tensor-parallel collectives of one forward of `layers` layers on one rank, as
    shardwise's layers issue them: 2 all-reduces per layer (after attention's and the MLP's
    row-parallel matmul) of (batch, tokens, hidden), 1 for the vocab-parallel embedding
    (first stage), and 1 all-gather of the logits of `logit_rows` positions (last stage;
    0 when the logits stay split, as for the vocab-parallel loss in training). argmax: greedy
    decoding with the logits left split (shardwise.engine.argmax): that all-gather carries
    each rank's best (value, index) instead, 16 bytes a sequence."""
    if tp == 1:
        return []
    act = batch * tokens * cfg.hidden_size * width
    calls = 2 * layers + (1 if first else 0)
    out = [Collective("all_reduce", "tp", calls, calls * act)] if calls else []
    if last and logit_rows:
        rows = padded_size(cfg.vocab_size, tp) // tp
        each = ARGMAX_BYTES if argmax else logit_rows * rows * width
        out.append(Collective("all_gather", "tp", 1, batch * each))
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
    saved input shards again: 2 more all-gathers of (batch, tokens / tp, hidden) per layer.
    An MoE layer (shardwise.layers.moe) all-reduces, besides its input's gradient, those of
    the routing weights (batch, tokens, k) and of the shared expert's gate (batch, tokens, 1)."""
    if tp == 1:
        return []
    act = batch * tokens * cfg.hidden_size * width
    calls = (4 if recompute else 2) * layers + (1 if last else 0)
    out = [Collective("all_reduce", "tp", calls, calls * act)]
    n_moe = moe_layer_count(cfg, layers)
    if n_moe:
        small = (1 + (1 if cfg.shared_expert_gate else 0)) * n_moe
        nbytes = n_moe * batch * tokens * (cfg.experts_per_token + (1 if cfg.shared_expert_gate else 0)) * width
        out[0] = Collective("all_reduce", "tp", calls + small, calls * act + nbytes)
    if sequence_parallel:
        out.append(Collective("all_gather", "tp", 2 * layers, 2 * layers * act // tp))
    if last:
        out.append(Collective("all_reduce", "tp", 2, batch * tokens * 4 * 3))
    return out
