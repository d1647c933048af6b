"""The planner's answer: every layout ranked, the one to run, and why (or, when nothing
fits, by how much and what would fit instead).

NOTE: the recommendation is always a layout shardwise can run today: for training any
layout the search lists (with its schedule, m and layer split, and the `shardwise train`
flags that run it), for inference pp = 1 only. When the cost model would pick an inference
pipeline (pp > 1), that layout is kept in `pipeline` and the answer says so.

Inference may store weights quantized (`--quantize fp16|int8`, specs.QUANTIZE): planned as
asked, or chosen here when nothing fits, or no layout meets the latency target, in the
model's dtype (_quantized_pick); otherwise the dtype's plan stands and says what quantizing
would give. Training is never quantized.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from shardwise.models.config import ModelConfig
from shardwise.planner.explain import diagnose, explain
from shardwise.planner.predict import Layout
from shardwise.planner.schedule import train_flags
from shardwise.planner.search import Candidate, Workload, compute_dtype, evaluate, model_key, quantize_options
from shardwise.planner.specs import Cluster, InferenceWorkload, PlannerError

__all__ = ["Recommendation", "recommend", "serve_command"]


@dataclass
class Recommendation:
    model: str
    cfg: ModelConfig
    workload: Workload
    cluster: Cluster
    headroom: float
    dtype: str
    candidates: list[Candidate]
    """Ranked, best first (search.rank_key); when nothing fits, the closest to fitting first."""
    recommended: Candidate | None
    """The best fitting layout shardwise can run; None when none fits."""
    skipped: list[str] = field(default_factory=list)
    pipeline: Candidate | None = None
    """Inference: a fitting layout with pp > 1 that the cost model ranks first: what would be
    recommended once inference runs pipelines (search.NOT_RUNNABLE). None when a runnable layout wins."""
    explanation: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    nothing_fits: str | None = None
    alternatives: list[str] = field(default_factory=list)
    """When nothing fits: what would."""
    quantize_why: str | None = None
    """Inference, when the planner chose `--quantize` itself: "memory" (nothing fits in the
    dtype) or "latency" (no layout meets the target in the dtype); None when asked for or not chosen."""
    unquantized: Recommendation | None = None
    """The plan in the model's dtype: the one quantization replaced (quantize_why), or the one
    recommended, when quantized weights were planned beside it (quantized)."""
    quantized: list[Recommendation] = field(default_factory=list)
    """Inference with weights in the dtype: the same workload with each `--quantize` format
    this cluster's device has a measured kernel for (search.quantize_options)."""

    @property
    def quantize(self) -> str | None:
        """The weight format planned (`--quantize`), None for the dtype's."""
        return getattr(self.workload, "quantize", None)

    @property
    def command(self) -> str | None:
        """The line that runs the recommendation: training, `shardwise train` (its config's
        data.global_batch_size and data.seq_len as planned; sequence parallelism and
        recomputation as planned); inference, `shardwise serve` with the layout, the weight
        format and the batch and context planned for (MODEL: the checkpoint). None when
        nothing fits."""
        r = self.recommended
        if r is None:
            return None
        wl = self.workload
        if r.training is None:
            return serve_command(self.model, r.layout, wl)
        extra = " --sequence-parallel" if wl.sequence_parallel and r.layout.tp > 1 else ""
        extra += f" --recompute {wl.recompute}" if wl.recompute != "none" else ""
        return f"shardwise train --config CONFIG.toml {train_flags(r.layout.arg(), r.schedule, r.microbatches)}{extra}"


def serve_command(model: str, layout: Layout, wl: InferenceWorkload) -> str:
    """`shardwise serve` for one replica of `layout`, with wl's dtype, weight format, batch and
    context; the model's directory when `model` is one (or its config.json), else MODEL."""
    path = Path(model)
    where = str(path.parent if path.name == "config.json" else path) if path.exists() else "MODEL"
    flags = [f"--model {where}", f"--tp {layout.tp}"]
    flags += [f"--pp {layout.pp}"] if layout.pp > 1 else []
    flags += ["--expert-parallel"] if layout.expert_parallel else []
    flags += [f"--dtype {wl.dtype}"] if wl.dtype else []
    flags += [f"--quantize {wl.quantize}"] if wl.quantize else []
    flags += [f"--max-batch-size {wl.batch}", f"--max-model-len {wl.prompt_len + wl.output_len}"]
    return "shardwise serve " + " ".join(flags)


def _ranked(model: str, cfg: ModelConfig, wl: Workload, cluster: Cluster, headroom: float,
            allow_cross_node_tp: bool) -> Recommendation:  # fmt: skip
    """The ranked layouts and the recommendation, without the words."""
    ranked, skipped = evaluate(cfg, wl, cluster, headroom=headroom, allow_cross_node_tp=allow_cross_node_tp)
    if not ranked:
        raise PlannerError(f"no valid layout of {model} on {cluster.devices} devices: " + "; ".join(skipped))
    best = ranked[0] if ranked[0].fits and ranked[0].runnable else None
    winner = min(ranked, key=model_key)
    pipeline = winner if winner.fits and not winner.runnable else None
    return Recommendation(
        model, cfg, wl, cluster, headroom, compute_dtype(cfg, wl), ranked, best, skipped, pipeline=pipeline
    )


def _quantized_pick(rec: Recommendation) -> tuple[Recommendation | None, str | None]:
    """The quantized plan to recommend instead of `rec` (weights in the dtype), and why: when
    nothing fits in the dtype, the first format (fp16 before int8: the smaller quality cost)
    that fits, one meeting the latency target first; when layouts fit but none meets the
    target, the first format that meets it. Otherwise none: quantization costs quality."""
    fits = [q for q in rec.quantized if q.recommended is not None]
    target = rec.workload.target_latency_ms
    meets = [q for q in fits if target is None or q.recommended.meets_target]
    if rec.recommended is None and fits:
        return (meets or fits)[0], "memory"
    if rec.recommended is not None and target is not None and not rec.recommended.meets_target and meets:
        return meets[0], "latency"
    return None, None


def recommend(
    model: str,
    cfg: ModelConfig,
    wl: Workload,
    cluster: Cluster,
    *,
    headroom: float = 0.1,
    allow_cross_node_tp: bool = False,
) -> Recommendation:
    """The ranked layouts, the recommendation and its explanation; when nothing shardwise can
    run fits, by how much and what would fit instead.

    Inference with weights in the dtype (wl.quantize None) is planned with each measured
    `--quantize` format too (search.quantize_options): a quantized plan is recommended instead
    when nothing fits in the dtype, or when no layout meets the latency target in the dtype
    (_quantized_pick); otherwise the explanation says what quantizing would give. A format
    asked for (wl.quantize) is planned alone. Training never quantizes."""
    rec = _ranked(model, cfg, wl, cluster, headroom, allow_cross_node_tp)
    if isinstance(wl, InferenceWorkload) and wl.quantize is None:
        rec.quantized = [
            _ranked(model, cfg, replace(wl, quantize=q), cluster, headroom, allow_cross_node_tp)
            for q in quantize_options(cluster)
        ]
        pick, why = _quantized_pick(rec)
        if pick is not None:
            pick.quantize_why, pick.unquantized, rec = why, rec, pick
            pick.quantized = [q for q in rec.unquantized.quantized if q is not pick]
    if rec.recommended is None:
        rec.candidates.sort(key=lambda c: c.memory.total)  # the closest to fitting first
        rec.nothing_fits, rec.alternatives = diagnose(rec, allow_cross_node_tp)
    else:
        rec.explanation, rec.warnings = explain(rec)
    return rec
