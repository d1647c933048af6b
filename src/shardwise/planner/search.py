"""Enumerate the valid tp x pp x dp layouts, predict each, and rank them.

Ranks are ordered tp fastest, then dp, then pp (Megatron-LM's order), so a tp group is
tp consecutive devices: inside one node whenever tp <= devices per node. Layouts with tp
across nodes are left out unless allowed.

The cost model's order (model_key): inference: one replica is tp x pp devices, dp
replicas fill the cluster; best is the smallest replica that fits with headroom (and
meets the latency target, if any), the fastest of those: with pp = 1 that is the smallest
tp that fits. Training: every layout uses all devices; best is the smallest tp that fits,
with the best throughput among its layouts.

Any tp up to the query heads is a candidate, even where it splits the heads or the MLP
unevenly: the busiest rank's share sets its memory and time (footprint, cost), and an
uneven tp is ranked ahead of the even layouts only where it is faster than all of them.

Training layouts are the ones `shardwise train` runs: tp a size the model splits into, pp
at most the number of layers (the runtime's balanced split when pp does not divide them),
m = global_batch / (micro_batch x dp) micro-batches, and for pp > 1 a schedule the runtime
accepts for that m (schedule.schedule_options: the fastest that fits, or the one asked for).

A mixture of experts gets each layout twice where both placements can run (Layout.ep):
inference with the experts split over tp (tensor-parallel experts) or dealt out whole over
tp (`--expert-parallel`, tp <= E); training with the experts split over tp and replicated
over dp, or dealt over all dp ranks (ep = dp <= E, tokens dispatched by all_to_all). The
cost model picks between them like between any two layouts: by time at the same size.

Inference layouts with pp > 1 are candidates like any other: `generate --pp` and `serve --pp`
run them, a server keeps up to pp steps in flight (predict.predict_inference), and those
predictions are checked against measurement (benchmarks/validate_planner.py, serving part).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from shardwise.models.config import ModelConfig
from shardwise.planner.footprint import Footprint, inference_memory, training_memory
from shardwise.planner.predict import (
    InferencePrediction,
    Layout,
    TrainingPrediction,
    predict_inference,
    predict_training,
)
from shardwise.planner.schedule import PipelineSchedule, schedule_options
from shardwise.planner.specs import (
    DTYPE_BYTES,
    GIB,
    QUANTIZE,
    Cluster,
    InferenceWorkload,
    PlannerError,
    TrainingWorkload,
)
from shardwise.sharding.plans import Balance, balance, model_tp_sizes

__all__ = ["Candidate", "evaluate", "compute_dtype", "model_key", "quantize_options", "NOT_RUNNABLE"]

Workload = InferenceWorkload | TrainingWorkload

NOT_RUNNABLE = "pp>1: not recommended for inference until validated"
"""The label an inference pipeline carried until its decode and serving predictions were
checked against `generate --pp` and `serve --pp` (benchmarks/validate_planner.py, the serving
part: within ±25%); no layout carries it now. Kept for readers of older JSON plans."""


@dataclass(frozen=True)
class Candidate:
    layout: Layout
    memory: Footprint
    fits: bool
    """Fits in the device's budget with the requested headroom left free."""
    cross_node_tp: bool
    inference: InferencePrediction | None = None
    training: TrainingPrediction | None = None
    meets_target: bool | None = None
    why_not: str | None = None
    """Why shardwise cannot run this layout (NOT_RUNNABLE), or None."""
    balance: Balance | None = None
    """How evenly tp splits the model (None at tp=1)."""
    outrun: bool = False
    """An uneven tp that a fitting even layout is at least as fast as: ranked after the even ones."""

    @property
    def time_s(self) -> float:
        """Inference: one request (prefill + decode); training: one step."""
        return self.inference.request_s if self.inference else self.training.step.total_s

    @property
    def tokens_per_s(self) -> float:
        return self.inference.tokens_per_s if self.inference else self.training.tokens_per_s

    @property
    def runnable(self) -> bool:
        """shardwise can run this layout today: any training layout listed, inference at pp = 1."""
        return self.why_not is None

    @property
    def schedule(self) -> PipelineSchedule | None:
        """Training at pp > 1: the schedule, m and layer split the prediction assumes."""
        return self.training.schedule if self.training is not None else None

    @property
    def microbatches(self) -> int | None:
        """Training: micro-batches per step on each dp rank (m); None for inference."""
        return self.training.micro_batches if self.training is not None else None


def compute_dtype(cfg: ModelConfig, wl: Workload) -> str:
    return (wl.dtype or cfg.dtype) if isinstance(wl, InferenceWorkload) else wl.prec.compute


def quantize_options(cluster: Cluster) -> list[str]:
    """The `--quantize` formats the planner can plan on this cluster: those whose linear kernel
    was measured on its device (this host's calibration: fbgemm's fp16, the Q8_0 blocks of int8;
    none for the GPU presets,
    whose CUDA paths, a half-precision F.linear and int8 dequantized into the product, are
    not measured)."""
    return [q for q in QUANTIZE if q in cluster.device.quantized_rows_tflops]


def check_context(cfg: ModelConfig, wl: Workload) -> None:
    """The workload's tokens fit the model's context (a check that needs no cluster: `plan` makes
    it before it calibrates this host)."""
    if isinstance(wl, InferenceWorkload):
        if wl.prompt_len + wl.output_len > cfg.max_positions:
            raise PlannerError(
                f"prompt_len={wl.prompt_len} + output_len={wl.output_len} = {wl.prompt_len + wl.output_len} "
                f"exceeds the model's context of {cfg.max_positions} tokens"
            )
    elif wl.seq_len > cfg.max_positions:
        raise PlannerError(f"seq_len={wl.seq_len} exceeds the model's context of {cfg.max_positions} tokens")


def check_inputs(cfg: ModelConfig, wl: Workload, headroom: float, cluster: Cluster) -> None:
    if not 0 <= headroom < 1:
        raise PlannerError(f"headroom must be a fraction in [0, 1), got {headroom}")
    if isinstance(wl, InferenceWorkload) and wl.quantize is not None and wl.quantize not in quantize_options(cluster):
        raise PlannerError(
            f"--quantize {wl.quantize}: {cluster.device.name} has no measured {wl.quantize} linear kernel to "
            "predict its speed with; the planner plans quantized weights where the calibration measured the kernels "
            "(--cluster this-host)"
        )
    check_context(cfg, wl)
    if not isinstance(wl, InferenceWorkload) and wl.sequence_parallel and cfg.num_experts:
        raise PlannerError("sequence parallelism is not supported for mixture-of-experts models")


def _layouts(cfg: ModelConfig, wl: Workload, cluster: Cluster, allow_cross: bool) -> tuple[list[Layout], list[str]]:
    skipped: list[str] = []
    tps = [t for t in model_tp_sizes(cfg) if t <= cluster.devices]
    if not allow_cross:
        crossing = [t for t in tps if t > cluster.devices_per_node]
        if crossing:
            skipped.append(
                f"tp={', '.join(map(str, crossing))}: would cross a node boundary ({cluster.devices_per_node} devices "
                "per node); --allow-cross-node-tp to consider"
            )
        tps = [t for t in tps if t <= cluster.devices_per_node]
    training = isinstance(wl, TrainingWorkload)
    # pp divides the layers; training also takes any pp <= layers that divides the devices
    # (the runtime splits the layers unevenly then: StageLayout.build)
    pps = [
        p for p in range(1, cfg.num_layers + 1) if cfg.num_layers % p == 0 or (training and cluster.devices % p == 0)
    ]
    out = []
    for tp in tps:
        for pp in pps:
            if tp * pp > cluster.devices:
                continue
            dp = cluster.devices // (tp * pp)
            if training:
                if tp * pp * dp != cluster.devices:
                    skipped.append(f"tp={tp} pp={pp}: tp x pp = {tp * pp} does not divide {cluster.devices} devices")
                    continue
                if wl.global_batch % (wl.micro_batch * dp):
                    skipped.append(
                        f"tp={tp} pp={pp} dp={dp}: global_batch={wl.global_batch} is not a multiple of "
                        f"micro_batch x dp = {wl.micro_batch * dp}"
                    )
                    continue
                why = schedule_options(cfg.num_layers, pp, wl.global_batch // (wl.micro_batch * dp), wl.schedule)[1]
                if why is not None:
                    skipped.append(f"tp={tp} pp={pp} dp={dp}: {why}")
                    continue
            out.append(Layout(tp, pp, dp))
            if cfg.num_experts and training and 1 < dp <= cfg.num_experts:
                out.append(Layout(tp, pp, dp, ep="dp"))
    if cfg.num_experts and not training:  # whole experts over the tp group
        ep_tps = set(model_tp_sizes(cfg, expert_parallel=True))
        out += [Layout(x.tp, x.pp, x.dp, ep="tp") for x in out if x.tp > 1 and x.tp in ep_tps]
        extra = [
            t for t in ep_tps - set(tps) if 1 < t <= cluster.devices and (allow_cross or t <= cluster.devices_per_node)
        ]
        out += [
            Layout(t, p, cluster.devices // (t * p), ep="tp")
            for t in sorted(extra)
            for p in pps
            if t * p <= cluster.devices
        ]
    return out, skipped


def _candidate(cfg: ModelConfig, wl: Workload, cluster: Cluster, lay: Layout, headroom: float) -> Candidate:
    cross = lay.tp > cluster.devices_per_node
    if isinstance(wl, InferenceWorkload):
        dtype = compute_dtype(cfg, wl)
        width = DTYPE_BYTES[dtype]
        budget = cluster.memory_budget_gib(lay.replica) * GIB
        kw = dict(batch=wl.batch, prompt_len=wl.prompt_len, output_len=wl.output_len, width=width,
                  quantize=wl.quantize)  # fmt: skip
        mem = inference_memory(
            cfg, lay.tp, lay.pp, flash=wl.flash_attention, budget=budget, expert_parallel=lay.expert_parallel, **kw
        )
        fits = mem.fits(headroom)
        if cluster.shared_memory and fits:  # replicas share the node's memory too
            node = cluster.memory_budget_gib(1) * GIB * (1 - headroom)
            lay = replace(lay, dp=max(1, min(lay.dp, int(node // (lay.replica * mem.total)))))
        # the runtime's --comm-dtype auto: fp32 inside a node, the fastest wire across nodes
        pred = predict_inference(cfg, cluster, lay, dtype=dtype, comm_dtype="auto", **kw)
        meets = None if wl.target_latency_ms is None else pred.request_s * 1e3 <= wl.target_latency_ms
        why_not = None  # pp > 1 too: generate/serve --pp run it, and its predictions are validated
        return Candidate(lay, mem, fits, cross, inference=pred, meets_target=meets, why_not=why_not)
    return _training_candidate(cfg, wl, cluster, lay, headroom, cross)


def _training_candidate(
    cfg: ModelConfig, wl: TrainingWorkload, cluster: Cluster, lay: Layout, headroom: float, cross: bool
) -> Candidate:
    """The layout with the schedule that fits and is fastest (1F1B on a tie: it holds less)."""
    p = wl.prec
    budget = cluster.memory_budget_gib(cluster.devices) * GIB
    m = wl.global_batch // (wl.micro_batch * lay.dp)
    options, _ = schedule_options(cfg.num_layers, lay.pp, m, wl.schedule)
    best: Candidate | None = None
    for sched in options:
        mem = training_memory(
            cfg, lay.tp, lay.pp, micro_batches=m, micro_batch=wl.micro_batch, seq=wl.seq_len, width=p.weight_bytes,
            weight_bytes=p.weight_bytes, optimizer=wl.optimizer,
            recompute=wl.recompute, flash=wl.flash_attention, budget=budget,
            sequence_parallel=wl.sequence_parallel and lay.tp > 1,
            loads=sched.loads() if sched is not None else None, ep_dp=lay.ep_dp,
            dp=lay.dp, distributed_optimizer=wl.distributed_optimizer,
        )  # fmt: skip
        c = Candidate(lay, mem, mem.fits(headroom), cross, training=predict_training(cfg, cluster, lay, wl, sched))
        if best is None or (not c.fits, c.time_s, mem.total) < (not best.fits, best.time_s, best.memory.total):
            best = c
    return best


def model_key(c: Candidate) -> tuple:
    """The cost model's order, best first, whether shardwise can run the layout or not.
    An uneven tp goes first only where it is faster than every fitting even layout."""
    if c.inference is not None:
        return (not c.fits, c.meets_target is False, c.outrun, c.layout.replica, c.time_s, c.layout.tp, c.layout.ep)
    return (not c.fits, c.outrun, c.layout.tp, c.time_s, c.layout.pp, c.layout.ep)


def rank_key(c: Candidate) -> tuple:
    """The order shown and recommended from: fitting layouts shardwise can run first."""
    return (not c.fits, not c.runnable, *model_key(c)[1:])


def evaluate(
    cfg: ModelConfig, wl: Workload, cluster: Cluster, *, headroom: float = 0.1, allow_cross_node_tp: bool = False
) -> tuple[list[Candidate], list[str]]:
    """Every valid layout, predicted and ranked (rank_key: best first, the fitting layouts
    shardwise can run before those it cannot), and the layouts left out, with why."""
    check_inputs(cfg, wl, headroom, cluster)
    layouts, skipped = _layouts(cfg, wl, cluster, allow_cross_node_tp)
    cands = [_candidate(cfg, wl, cluster, lay, headroom) for lay in layouts]
    cands = [
        replace(c, balance=balance(cfg, c.layout.tp, expert_parallel=c.layout.expert_parallel))
        if c.layout.tp > 1
        else c
        for c in cands
    ]
    even = [c.time_s for c in cands if c.fits and c.runnable and (c.balance is None or c.balance.even)]
    fastest_even = min(even, default=float("inf"))
    cands = [replace(c, outrun=True) if _uneven(c) and c.time_s >= fastest_even else c for c in cands]
    return sorted(cands, key=rank_key), skipped


def _uneven(c: Candidate) -> bool:
    return c.balance is not None and not c.balance.even
