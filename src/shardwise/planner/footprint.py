"""Memory per device: weights, KV cache or activations, gradients and optimizer state.

Parameter counts per rank follow shardwise's own plan (sharding/plans/decoder.py): the
embedding and head split by (padded) vocabulary, attention by heads (KV heads
replicated when tp > KV heads), the MLP by its intermediate size; norms and biases of
row-parallel layers replicated. tests/unit/test_planner_formulas.py checks these counts
against the real sharded model built on the meta device.

A mixture-of-experts layer (cfg.is_moe_layer) holds, instead of the dense MLP: the router
(hidden x E, replicated), the routed experts (3 x hidden x width each) and the shared expert
(split by its width like a dense MLP) with its gate (replicated). The routed experts are
placed one of three ways (shardwise.layers.moe, shardwise.layers.dispatch):

    tensor-parallel experts   every rank holds all E experts at width I / tp
    expert_parallel           whole experts over the tp group: the busiest rank ceil(E / tp)
    ep_dp = d                 (training) whole experts over the d data-parallel ranks, each
                              split over tp: the busiest rank ceil(E / d) experts at width I / tp

tests/unit/test_planner_moe.py checks these counts against the real sharded MoE model.

Weights stored quantized (`--quantize`, inference only; weight_bytes): every projection of
the blocks (attention qkv and o, the MLP's up/gate and down, routed and shared experts) and
the LM head at 2 bytes a weight (fp16) or a block format's bytes per weight (int8 is Q8_0 on
the CPU: 34 bytes per 32 weights; Q4_K 144 per 256, ...); the input embedding table in the
same format. A tied head and table are two copies in fp16, one block-format matrix. A GGUF
file loaded without --quantize holds its matrices in their own formats: at the file's average
bytes per weight (ModelConfig.stored_bytes_per_weight, shardwise.hf.load.stored_config).
Norms, biases, routers (and the shared expert's gate) and learned positions stay in the
model's dtype. tests/unit/test_planner_quantize.py checks these bytes against the real
sharded model.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace

from shardwise.kernels.blocks import FORMATS
from shardwise.kernels.rows import BLOCK_SCHEMES
from shardwise.layers.partition import HeadLayout, largest_share, padded_size, split_ranges
from shardwise.models.config import ModelConfig
from shardwise.planner.activations import layer_activation_bytes, recompute_mode

__all__ = [
    "Footprint",
    "StageLoad",
    "Projections",
    "projections",
    "quantized_bytes",
    "weight_bytes",
    "layer_params",
    "moe_params",
    "moe_layer_count",
    "expert_share",
    "touched_experts",
    "expert_params",
    "layers_params",
    "moe_token_width",
    "stage_params",
    "streamed_params",
    "kv_cache_bytes",
    "kv_bytes_per_token",
    "state_bytes",
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


def _attention_params(cfg: ModelConfig, tp: int) -> tuple[int, int]:
    """(attention and the layer's norms on the busiest rank, of which matmul weights)."""
    heads = HeadLayout(cfg.num_heads, cfg.num_kv_heads, tp)
    h, hd = cfg.hidden_size, cfg.head_dim
    qkv_out = (heads.max_heads + 2 * heads.max_kv_heads) * hd
    matmul = h * qkv_out + heads.max_heads * hd * h
    biases = (qkv_out if cfg.qkv_bias else 0) + (h if cfg.o_bias else 0)
    norms = 2 * _norm_params(cfg, h) + (2 * hd if cfg.qk_norm else 0)
    return matmul + biases + norms, matmul


def _dense_mlp_params(cfg: ModelConfig, tp: int) -> tuple[int, int]:
    """(the dense MLP on the busiest rank, of which matmul weights)."""
    h, inter = cfg.hidden_size, largest_share(cfg.intermediate_size, tp)
    up_out = (2 if cfg.gated_mlp else 1) * inter
    matmul = h * up_out + inter * h
    return matmul + ((up_out + h) if cfg.mlp_bias else 0), matmul


def layer_params(cfg: ModelConfig, tp: int, *, moe: bool = False, expert_parallel: bool = False,
                 ep_dp: int = 1) -> tuple[int, int]:  # fmt: skip
    """(parameters of one layer on one rank, of which matmul weights): the busiest rank's,
    when tp splits the heads or the MLP width unevenly. moe: a mixture-of-experts layer
    (moe_params, with the placement expert_parallel / ep_dp), else a dense one."""
    a, am = _attention_params(cfg, tp)
    m, mm = moe_params(cfg, tp, expert_parallel=expert_parallel, ep_dp=ep_dp) if moe else _dense_mlp_params(cfg, tp)
    return a + m, am + mm


def expert_share(cfg: ModelConfig, tp: int, *, expert_parallel: bool = False, ep_dp: int = 1) -> tuple[int, int]:
    """(experts, width of each) the busiest rank holds of one MoE layer: all E at I / tp
    (tensor-parallel experts), ceil(E / tp) whole ones (expert_parallel), or ceil(E / ep_dp)
    at I / tp (experts dealt over ep_dp data-parallel ranks, training)."""
    E, width = cfg.num_experts, cfg.expert_size
    if expert_parallel:
        return largest_share(E, tp, unit=1), width
    return (largest_share(E, ep_dp, unit=1) if ep_dp > 1 else E), largest_share(width, tp)


def _expert_counts(cfg: ModelConfig, group: int) -> list[int]:
    return [e - s for s, e in split_ranges(cfg.num_experts, group, unit=1)]


def moe_params(cfg: ModelConfig, tp: int, *, expert_parallel: bool = False, ep_dp: int = 1) -> tuple[int, int]:
    """(one MoE block on the busiest rank, of which matmul weights): router H x E (replicated),
    its experts (expert_share) at 3 x H x width each, the shared expert 3 x H x its width / tp,
    the shared expert's gate H (replicated). All of them are matmul weights."""
    h = cfg.hidden_size
    n, width = expert_share(cfg, tp, expert_parallel=expert_parallel, ep_dp=ep_dp)
    matmul = h * cfg.num_experts + n * 3 * h * width
    if cfg.shared_expert_size:
        matmul += 3 * h * largest_share(cfg.shared_expert_size, tp) + (h if cfg.shared_expert_gate else 0)
    return matmul, matmul


def moe_layer_count(cfg: ModelConfig, layers: int | None = None) -> int:
    """MoE layers among `layers` decoder layers (default all). NOTE: for a part of the model
    whose layer ids are not given (a pipeline stage) it is the busiest case: as many of
    them MoE as the model has (exact for pp = 1 and for models whose every layer is MoE)."""
    layers = cfg.num_layers if layers is None else layers
    if not cfg.num_experts:
        return 0
    return layers if cfg.moe_layers is None else min(layers, len(cfg.moe_layers))


def expert_params(cfg: ModelConfig, tp: int, layers: int | None = None, *, expert_parallel: bool = False,
                  ep_dp: int = 1) -> int:  # fmt: skip
    """The routed experts' weights the busiest rank holds in `layers` layers (default all)."""
    if not cfg.num_experts:
        return 0
    n, width = expert_share(cfg, tp, expert_parallel=expert_parallel, ep_dp=ep_dp)
    return moe_layer_count(cfg, layers) * n * 3 * cfg.hidden_size * width


def layers_params(cfg: ModelConfig, tp: int, layers: int | None = None, *, expert_parallel: bool = False,
                  ep_dp: int = 1) -> int:  # fmt: skip
    """Parameters of `layers` decoder layers (default all) on the busiest rank, dense and MoE."""
    layers = cfg.num_layers if layers is None else layers
    n_moe = moe_layer_count(cfg, layers)
    moe = layer_params(cfg, tp, moe=True, expert_parallel=expert_parallel, ep_dp=ep_dp)[0] if n_moe else 0
    return (layers - n_moe) * layer_params(cfg, tp)[0] + n_moe * moe


def _expected_max_binomial(counts: list[int], p: float) -> float:
    """E[max_r X_r], X_r ~ Binomial(counts[r], p) independent: sum over x >= 1 of P(max >= x)."""
    cdf: dict[int, list[float]] = {}
    for n in set(counts):
        pmf = [math.comb(n, x) * p**x * (1 - p) ** (n - x) for x in range(n + 1)]
        cdf[n] = list(itertools.accumulate(pmf))
    top = max(counts)
    return sum(1 - math.prod(cdf[n][x - 1] if x - 1 < n else 1.0 for n in counts) for x in range(1, top + 1))


def touched_experts(cfg: ModelConfig, tp: int, rows: float | None, *, expert_parallel: bool = False,
                    ep_dp: int = 1) -> float:  # fmt: skip
    """Experts of one MoE layer the busiest rank computes (and reads from memory) when `rows`
    tokens are routed, under uniform routing (NOTE: an assumption; a trained router is
    skewed, which only makes the busiest expert-parallel rank busier).

    Each token picks k of E experts, so an expert is touched with p = 1 - (1 - k/E)^rows
    (GShard / Switch Transformer's top-k routing): E p experts in all. Tensor-parallel
    experts: every rank computes a slice of each of them, E p. Expert parallel: rank r's n_r
    experts are each touched with p; the busiest rank's is the expected maximum over the
    ranks of Binomial(n_r, p) (independent ranks): at rows = 1, k = 2, E = 8, tp = 2 it is
    1.46 where the mean is 1. rows None: every expert held (training)."""
    n, _ = expert_share(cfg, tp, expert_parallel=expert_parallel, ep_dp=ep_dp)
    if rows is None:
        return float(n)
    p = 1 - (1 - cfg.experts_per_token / cfg.num_experts) ** rows
    if not expert_parallel and ep_dp == 1:
        return cfg.num_experts * p
    return _expected_max_binomial(_expert_counts(cfg, tp if expert_parallel else ep_dp), p)


def _vocab_rows(cfg: ModelConfig, tp: int) -> int:
    return padded_size(cfg.vocab_size, tp) // tp


def stage_params(cfg: ModelConfig, tp: int, pp: int = 1, stage: int = 0, *, layers: int | None = None,
                 expert_parallel: bool = False, ep_dp: int = 1) -> int:  # fmt: skip
    """Parameters one rank of pipeline stage `stage` (of pp) holds at tensor-parallel size tp,
    with `layers` decoder layers (default: num_layers / pp); a mixture of experts' routed
    experts placed as expert_parallel / ep_dp say (expert_share).

    The first stage holds the embedding (and learned positions), the last the final norm
    and the head; with tied embeddings and pp > 1 the last stage keeps its own copy
    (Megatron-LM), with pp = 1 the head is the embedding.
    """
    h, rows = cfg.hidden_size, _vocab_rows(cfg, tp)
    n = layers_params(cfg, tp, cfg.num_layers // pp if layers is None else layers, expert_parallel=expert_parallel,
                      ep_dp=ep_dp)  # fmt: skip
    first, last = stage == 0, stage == pp - 1
    if first:
        n += rows * h + (cfg.max_positions * h if cfg.positions == "learned" else 0)
    if last:
        n += _norm_params(cfg, h)
        if not cfg.tie_embeddings or not first:
            n += rows * h
    return n


def streamed_params(cfg: ModelConfig, tp: int, pp: int = 1, stage: int = 0, *, layers: int | None = None,
                    rows: float | None = None, expert_parallel: bool = False, ep_dp: int = 1) -> float:  # fmt: skip
    """Parameters a forward reads whole from memory: every layer's (`layers` of them, default
    num_layers / pp), and the head's (the embedding is a lookup of a few rows). A mixture of
    experts reads only the experts its `rows` routed tokens touch (touched_experts: the
    busiest rank's expected count; rows None: all it holds)."""
    layers = cfg.num_layers // pp if layers is None else layers
    kw = dict(expert_parallel=expert_parallel, ep_dp=ep_dp)
    n = float(layers_params(cfg, tp, layers, **kw))
    if cfg.num_experts and rows is not None:
        held, width = expert_share(cfg, tp, **kw)
        unread = held - touched_experts(cfg, tp, rows, **kw)
        n -= moe_layer_count(cfg, layers) * unread * 3 * cfg.hidden_size * width
    if stage == pp - 1:
        n += _norm_params(cfg, cfg.hidden_size) + _vocab_rows(cfg, tp) * cfg.hidden_size
    return n


@dataclass(frozen=True)
class Projections:
    """The matmul weights `--quantize` converts in some decoder layers on the busiest rank."""

    dense: float
    """Weights every token runs through: attention's qkv and o, the dense MLP, shared experts."""
    routed: float
    """The routed experts' weights counted (all held, or those a forward touches)."""
    rows: float
    """Output rows of all those matrices: int8 keeps one fp32 scale per row."""

    @property
    def params(self) -> float:
        return self.dense + self.routed


def projections(cfg: ModelConfig, tp: int, layers: int | None = None, *, experts: float | None = None,
                expert_parallel: bool = False, ep_dp: int = 1) -> Projections:  # fmt: skip
    """The projections of `layers` decoder layers (default all) on the busiest rank, as the
    model stores them: fused qkv ((q + 2 kv heads) x head_dim rows), o (hidden rows), up (and
    gate) and down; each routed expert's up (2 x width rows) and down (hidden rows), `experts`
    of them per MoE layer (default: all it holds, expert_share); the shared expert like a
    dense MLP. The router and the shared expert's gate are not projections."""
    layers = cfg.num_layers if layers is None else layers
    h = cfg.hidden_size
    heads = HeadLayout(cfg.num_heads, cfg.num_kv_heads, tp)
    qkv_out = (heads.max_heads + 2 * heads.max_kv_heads) * cfg.head_dim
    attn, attn_rows = _attention_params(cfg, tp)[1], qkv_out + h
    inter = largest_share(cfg.intermediate_size, tp)
    mlp, mlp_rows = _dense_mlp_params(cfg, tp)[1], (2 if cfg.gated_mlp else 1) * inter + h
    n_moe = moe_layer_count(cfg, layers)
    dense = layers * attn + (layers - n_moe) * mlp
    rows = layers * attn_rows + (layers - n_moe) * mlp_rows
    routed = 0.0
    if n_moe:
        held, width = expert_share(cfg, tp, expert_parallel=expert_parallel, ep_dp=ep_dp)
        n = held if experts is None else experts
        routed = n_moe * n * 3 * h * width
        rows += n_moe * n * (2 * width + h)
        if cfg.shared_expert_size:
            shared = largest_share(cfg.shared_expert_size, tp)
            dense += n_moe * 3 * h * shared
            rows += n_moe * (2 * shared + h)
    return Projections(dense, routed, rows)


def quantized_bytes(quantize: str, params: float, rows: float) -> float:
    """Bytes of `params` weights in `rows` output rows stored as `quantize`: fp16 2 a weight;
    a block format (int8 is Q8_0 on CPU) its bytes per block over its weights per block
    (Q8_0 34 / 32, Q4_K 144 / 256, ...)."""
    if quantize == "fp16":
        return 2 * params
    f = FORMATS[BLOCK_SCHEMES[quantize]]
    return params * f.nbytes / f.block


def weight_bytes(cfg: ModelConfig, tp: int, pp: int = 1, stage: int = 0, *, width: int, quantize: str | None = None,
                 layers: int | None = None, expert_parallel: bool = False) -> float:  # fmt: skip
    """Bytes of the weights one rank of pipeline stage `stage` holds (stage_params): all in
    `width` bytes, or with the projections, the head and the embedding table stored as
    `quantize` (the module docstring), the rest in `width`."""
    n = stage_params(cfg, tp, pp, stage, layers=layers, expert_parallel=expert_parallel)
    stored = cfg.stored_bytes_per_weight if quantize is None else 0.0  # a GGUF file computed as stored
    if quantize in (None, "none") and not stored:
        return n * width
    layers = cfg.num_layers // pp if layers is None else layers
    proj = projections(cfg, tp, layers, expert_parallel=expert_parallel)
    vocab = _vocab_rows(cfg, tp)
    first, last = stage == 0, stage == pp - 1
    counted = first + (last and (not cfg.tie_embeddings or not first))  # table copies in stage_params
    copies = first + last  # quantized, a tied head is a copy of its own (fp16) ...
    if cfg.tie_embeddings and first and last and (stored or quantize in BLOCK_SCHEMES):
        copies = 1  # ... but one block-format matrix serves the head and the lookup
    plain = n - proj.params - counted * vocab * cfg.hidden_size
    matrices = proj.params + copies * vocab * cfg.hidden_size
    if stored:  # the file's own blocks, at its matrices' average bytes per weight
        return plain * width + stored * matrices
    return plain * width + quantized_bytes(quantize, matrices, proj.rows + copies * vocab)


def kv_bytes_per_token(cfg: ModelConfig, tp: int, width: int, layers: int | None = None) -> int:
    """K and V of one token, all layers (or `layers`), on one rank: 2 * L * local KV heads * head_dim * width."""
    local_kv = HeadLayout(cfg.num_heads, cfg.num_kv_heads, tp).max_kv_heads  # the busiest rank's
    return 2 * (cfg.num_layers if layers is None else layers) * local_kv * cfg.head_dim * width


def kv_cache_bytes(cfg: ModelConfig, tp: int, pp: int, batch: int, tokens: int, width: int) -> int:
    return batch * tokens * kv_bytes_per_token(cfg, tp, width, cfg.num_layers // pp)


def moe_token_width(cfg: ModelConfig) -> int:
    """The MLP width one token runs through in an MoE layer: k x expert width + shared width
    (at least the dense MLP's, when the model has dense layers too)."""
    moe = cfg.experts_per_token * cfg.expert_size + cfg.shared_expert_size
    return max(moe, cfg.intermediate_size) if moe_layer_count(cfg) < cfg.num_layers else moe


def state_bytes(
    cfg: ModelConfig, tp: int, pp: int = 1, stage: int = 0, *, layers: int | None = None, width: int,
    optimizer: str = "adam", dp: int = 1, ep_dp: int = 1, distributed_optimizer: bool = False,
) -> tuple[float, float, float]:  # fmt: skip
    """(weights, gradients, optimizer state) bytes one rank of stage `stage` holds at its peak,
    as the runtime holds them: shardwise.train.distopt.bytes_per_param (the one formula; the
    training log and the memory pre-check use it too) with the weights `width` bytes wide
    (2: bf16 weights and an fp32 master; 4: fp32), Adam's two fp32 moments (SGD's momentum:
    one). Under the distributed optimizer the dense parameters' state is split over dp, the
    routed experts' over their expert-data-parallel ranks (dp / ep_dp: the ranks holding the
    same experts)."""
    from shardwise.train.distopt import bytes_per_param

    n = stage_params(cfg, tp, pp, stage, layers=layers, ep_dp=ep_dp)
    experts = expert_params(cfg, tp, layers if layers is not None else cfg.num_layers // pp, ep_dp=ep_dp)
    dtype, moments = ("bf16" if width == 2 else "fp32"), (8 if optimizer == "adam" else 4)
    dense = bytes_per_param(dtype, distributed_optimizer, dp, moments=moments)
    routed = bytes_per_param(dtype, distributed_optimizer, max(dp // ep_dp, 1), moments=moments)
    parts = [(n - experts) * dense[k] + experts * routed[k] for k in ("weights", "grads", "optimizer")]
    return parts[0], parts[1], parts[2]


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
    if cfg.num_experts:  # the k experts' (and the shared expert's) intermediates of every token
        cfg = replace(cfg, intermediate_size=moe_token_width(cfg), gated_mlp=True)
    return layer_activation_bytes(
        cfg, tp=tp, micro_batch=micro_batch, seq=seq, sequence_parallel=sequence_parallel, recompute=recompute,
        act_bytes=width, stream_bytes=width, flash=flash,
    )  # fmt: skip


def inference_memory(
    cfg: ModelConfig, tp: int, pp: int, *, batch: int, prompt_len: int, output_len: int, width: int,
    flash: bool, budget: float, expert_parallel: bool = False, quantize: str | None = None,
) -> Footprint:  # fmt: skip
    """The busiest stage: weights (in `width` bytes, or quantized: weight_bytes), KV cache for
    prompt + output tokens, and the transient activations of a prefill (one layer's
    intermediates and the logits; a mixture of experts: each token's k experts and the shared
    expert, moe_token_width / tp)."""
    heads = HeadLayout(cfg.num_heads, cfg.num_kv_heads, tp)
    inter = largest_share(moe_token_width(cfg) if cfg.num_experts else cfg.intermediate_size, tp)
    qkv_out = (heads.max_heads + 2 * heads.max_kv_heads) * cfg.head_dim
    bs = batch * prompt_len
    act = bs * (3 * cfg.hidden_size + qkv_out + (3 if cfg.gated_mlp else 2) * inter) * width
    act += batch * padded_size(cfg.vocab_size, tp) * 4  # logits of the last position, gathered, fp32
    if not flash:
        act += batch * heads.max_heads * prompt_len * prompt_len * width
    kv = kv_cache_bytes(cfg, tp, pp, batch, prompt_len + output_len, width)
    kw = dict(width=width, quantize=quantize, expert_parallel=expert_parallel)
    weights = max(weight_bytes(cfg, tp, pp, s, **kw) for s in {0, pp - 1})
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
    weight_bytes: int, optimizer: str, recompute: str | bool, flash: bool,
    budget: float, sequence_parallel: bool = False, loads: list[StageLoad] | None = None, stage: int | None = None,
    ep_dp: int = 1, dp: int = 1, distributed_optimizer: bool = False,
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
    peaks of real training runs. ep_dp: a mixture of experts' experts dealt over ep_dp
    data-parallel ranks (expert_share). Weights, gradients and optimizer state: state_bytes
    (weight_bytes 2: bf16 weights with an fp32 master; distributed_optimizer: split over dp,
    the experts' over dp / ep_dp)."""
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
        w, g, opt = state_bytes(cfg, tp, pp, ld.stage, layers=ld.layers, width=weight_bytes, optimizer=optimizer,
                                dp=dp, ep_dp=ep_dp, distributed_optimizer=distributed_optimizer)  # fmt: skip
        out.append(Footprint(w, 0.0, act, g, opt, budget))
    return max(out, key=lambda m: m.total)
