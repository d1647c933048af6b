"""Memory per device: weights, KV cache or activations, gradients and optimizer state.

Parameter counts per rank follow shardwise's own plan (sharding/plans/decoder.py): the
embedding and head split by (padded) vocabulary, attention by heads (KV heads
replicated when tp > KV heads), the MLP by its intermediate size; norms and biases of
row-parallel layers replicated. tests/unit/test_planner_formulas.py checks these counts
against the real sharded model built on the meta device.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardwise.layers.partition import HeadLayout, largest_share, padded_size
from shardwise.models.config import ModelConfig
from shardwise.planner.activations import layer_activation_bytes, recompute_mode

__all__ = [
    "Footprint",
    "StageLoad",
    "layer_params",
    "stage_params",
    "streamed_params",
    "kv_cache_bytes",
    "kv_bytes_per_token",
    "optimizer_bytes_per_param",
    "training_activation_bytes_per_layer",
    "inference_memory",
    "training_memory",
    "one_f_one_b_loads",
]


@dataclass(frozen=True)
class Footprint:
    """Bytes one device holds (its busiest pipeline stage), and the bytes it may use."""

    weights: float
    kv_cache: float
    activations: float
    grads: float
    optimizer: float
    budget: float
    """Device memory less what the runtime reserves (and, for shared memory, less the other ranks' share)."""

    @property
    def total(self) -> float:
        return self.weights + self.kv_cache + self.activations + self.grads + self.optimizer

    @property
    def free(self) -> float:
        return self.budget - self.total

    def fits(self, headroom: float) -> bool:
        """Fits and leaves `headroom` (a fraction of the budget) free."""
        return self.free >= headroom * self.budget


def _norm_params(cfg: ModelConfig, size: int) -> int:
    return size if cfg.norm == "rms" else 2 * size


def layer_params(cfg: ModelConfig, tp: int) -> tuple[int, int]:
    """(parameters of one layer on one rank, of which matmul weights): the busiest rank's,
    when tp splits the heads or the MLP width unevenly."""
    heads = HeadLayout(cfg.num_heads, cfg.num_kv_heads, tp)
    h, hd, inter = cfg.hidden_size, cfg.head_dim, largest_share(cfg.intermediate_size, tp)
    qkv_out = (heads.max_heads + 2 * heads.max_kv_heads) * hd
    up_out = (2 if cfg.gated_mlp else 1) * inter
    matmul = h * qkv_out + heads.max_heads * hd * h + h * up_out + inter * h
    biases = (qkv_out if cfg.qkv_bias else 0) + (h if cfg.o_bias else 0) + ((up_out + h) if cfg.mlp_bias else 0)
    norms = 2 * _norm_params(cfg, h) + (2 * hd if cfg.qk_norm else 0)
    return matmul + biases + norms, matmul


def _vocab_rows(cfg: ModelConfig, tp: int) -> int:
    return padded_size(cfg.vocab_size, tp) // tp


def stage_params(cfg: ModelConfig, tp: int, pp: int = 1, stage: int = 0, *, layers: int | None = None) -> int:
    """Parameters one rank of pipeline stage `stage` (of pp) holds at tensor-parallel size tp,
    with `layers` decoder layers (default: num_layers / pp).

    The first stage holds the embedding (and learned positions), the last the final norm
    and the head; with tied embeddings and pp > 1 the last stage keeps its own copy
    (Megatron-LM), with pp = 1 the head is the embedding.
    """
    h, rows = cfg.hidden_size, _vocab_rows(cfg, tp)
    n = (cfg.num_layers // pp if layers is None else layers) * layer_params(cfg, tp)[0]
    first, last = stage == 0, stage == pp - 1
    if first:
        n += rows * h + (cfg.max_positions * h if cfg.positions == "learned" else 0)
    if last:
        n += _norm_params(cfg, h)
        if not cfg.tie_embeddings or not first:
            n += rows * h
    return n


def streamed_params(cfg: ModelConfig, tp: int, pp: int = 1, stage: int = 0, *, layers: int | None = None) -> int:
    """Parameters a forward reads whole from memory: every layer's (`layers` of them, default
    num_layers / pp), and the head's (the embedding is a lookup of a few rows)."""
    n = (cfg.num_layers // pp if layers is None else layers) * layer_params(cfg, tp)[0]
    if stage == pp - 1:
        n += _norm_params(cfg, cfg.hidden_size) + _vocab_rows(cfg, tp) * cfg.hidden_size
    return n


def kv_bytes_per_token(cfg: ModelConfig, tp: int, width: int, layers: int | None = None) -> int:
    """K and V of one token, all layers (or `layers`), on one rank: 2 * L * local KV heads * head_dim * width."""
    local_kv = HeadLayout(cfg.num_heads, cfg.num_kv_heads, tp).max_kv_heads  # the busiest rank's
    return 2 * (cfg.num_layers if layers is None else layers) * local_kv * cfg.head_dim * width


def kv_cache_bytes(cfg: ModelConfig, tp: int, pp: int, batch: int, tokens: int, width: int) -> int:
    return batch * tokens * kv_bytes_per_token(cfg, tp, width, cfg.num_layers // pp)


def optimizer_bytes_per_param(optimizer: str, master_bytes: int) -> int:
    """Optimizer state per parameter: fp32 master copy (mixed precision) + Adam's m and v
    (2 x 4 bytes) or SGD's momentum (4 bytes). Mixed-precision Adam: 2 + 2 + 12 = 16 bytes
    per parameter with weights and gradients (ZeRO, Rajbhandari et al. 2020, section 3.1)."""
    return master_bytes + (8 if optimizer == "adam" else 4)


def training_activation_bytes_per_layer(
    cfg: ModelConfig, tp: int, micro_batch: int, seq: int, width: int, *, recompute: str | bool, flash: bool,
    sequence_parallel: bool = False,
) -> float:  # fmt: skip
    """Activations one layer keeps for backward, per micro-batch, on one rank: shardwise's
    layer as planner/activations.py counts it (Korthikanti et al. 2022 adapted: gated MLP,
    GQA, no dropout, a fused attention kernel unless flash=False; checked against the bytes
    autograd keeps), activations and residual stream `width` bytes wide.
    recompute: "none", "selective" or "full" (True = "full"); sequence_parallel divides what
    runs between the split matmuls by tp."""
    return layer_activation_bytes(
        cfg, tp=tp, micro_batch=micro_batch, seq=seq, sequence_parallel=sequence_parallel, recompute=recompute,
        act_bytes=width, stream_bytes=width, flash=flash,
    )  # fmt: skip


def inference_memory(
    cfg: ModelConfig, tp: int, pp: int, *, batch: int, prompt_len: int, output_len: int, width: int,
    flash: bool, budget: float,
) -> Footprint:  # fmt: skip
    """The busiest stage: weights, KV cache for prompt + output tokens, and the transient
    activations of a prefill (one layer's intermediates and the logits)."""
    heads = HeadLayout(cfg.num_heads, cfg.num_kv_heads, tp)
    inter = largest_share(cfg.intermediate_size, tp)
    qkv_out = (heads.max_heads + 2 * heads.max_kv_heads) * cfg.head_dim
    bs = batch * prompt_len
    act = bs * (3 * cfg.hidden_size + qkv_out + (3 if cfg.gated_mlp else 2) * inter) * width
    act += batch * padded_size(cfg.vocab_size, tp) * 4  # logits of the last position, gathered, fp32
    if not flash:
        act += batch * heads.max_heads * prompt_len * prompt_len * width
    kv = kv_cache_bytes(cfg, tp, pp, batch, prompt_len + output_len, width)
    weights = max(stage_params(cfg, tp, pp, s) for s in {0, pp - 1}) * width
    return Footprint(weights, kv, act, 0.0, 0.0, budget)


@dataclass(frozen=True)
class StageLoad:
    """What one pipeline rank keeps while training: its layers and how many micro-batches'
    activations it holds at most (the schedule's; see planner/schedule.py)."""

    stage: int
    """The pp rank (0: holds the embedding; pp - 1: the final norm and the head)."""
    layers: int
    """Decoder layers on this rank (all its chunks)."""
    chunk_layers: int
    """Layers of its largest chunk (= layers, unless interleaved)."""
    in_flight: float
    """Micro-batch x chunk activations held at once, at most: 1F1B min(p - s, m), GPipe m."""
    head_in_flight: float
    """Micro-batches whose fp32 logits it holds at once (0 unless it holds the head)."""


def one_f_one_b_loads(cfg: ModelConfig, pp: int, micro_batches: int) -> list[StageLoad]:
    """The loads of 1F1B with num_layers / pp layers per stage: stage s holds min(p - s, m)
    micro-batches (Narayanan et al. 2021); the last stage one micro-batch's logits."""
    layers = cfg.num_layers // pp
    return [StageLoad(s, layers, layers, min(pp - s, micro_batches), 1 if s == pp - 1 else 0) for s in range(pp)]


def training_memory(
    cfg: ModelConfig, tp: int, pp: int, *, micro_batches: int, micro_batch: int, seq: int, width: int,
    weight_bytes: int, grad_bytes: int, optimizer: str, master_bytes: int, recompute: str | bool, flash: bool,
    budget: float, sequence_parallel: bool = False, loads: list[StageLoad] | None = None, stage: int | None = None,
) -> Footprint:  # fmt: skip
    """The busiest pipeline rank (or pipeline stage `stage`'s): weights, gradients and optimizer
    state of its layers (and of the embedding on the first, the norm and head on the last), and
    the activations of the micro-batches it holds (`loads`, default one_f_one_b_loads: stage k
    holds up to min(p - k, m) micro-batches, Narayanan et al. 2021), each with its chunk's
    layers, plus the loss's fp32 logits, shifted logits and exponentials of those the head holds.

    Activations per layer: training_activation_bytes_per_layer (recompute: "none",
    "selective" or "full"; sequence_parallel). While a layer is recomputed in backward it
    holds again what recomputation dropped: one layer's worth (full) or its attention
    core's (selective). benchmarks/validate_planner.py checks the total against measured
    peaks of real training runs."""
    kw = dict(width=width, flash=flash, sequence_parallel=sequence_parallel)
    per_layer = training_activation_bytes_per_layer(cfg, tp, micro_batch, seq, recompute=recompute, **kw)
    full_layer = training_activation_bytes_per_layer(cfg, tp, micro_batch, seq, recompute="none", **kw)
    extra = 0.0 if recompute_mode(recompute) == "none" else full_layer - per_layer  # the layer being recomputed
    logits = 3 * 4.0 * seq * micro_batch * _vocab_rows(cfg, tp)
    out = []
    for ld in loads if loads is not None else one_f_one_b_loads(cfg, pp, micro_batches):
        if stage is not None and ld.stage != stage:
            continue
        act = per_layer * ld.chunk_layers * ld.in_flight + extra + logits * ld.head_in_flight
        n = stage_params(cfg, tp, pp, ld.stage, layers=ld.layers)
        opt = n * optimizer_bytes_per_param(optimizer, master_bytes)
        out.append(Footprint(n * weight_bytes, 0.0, act, n * grad_bytes, opt, budget))
    return max(out, key=lambda m: m.total)
