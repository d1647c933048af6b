"""The planner's answer: every layout ranked, the one to run, and why (or, when nothing
fits, by how much and what would fit instead).

NOTE: the recommendation is always a layout shardwise can run today: for training any
layout the search lists (with its schedule, m and layer split, and the `shardwise train`
flags that run it), for inference pp = 1 only. When the cost model would pick an inference
pipeline (pp > 1), that layout is kept in `pipeline` and the answer says so.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shardwise.models.config import ModelConfig
from shardwise.planner.explain import diagnose, explain
from shardwise.planner.schedule import train_flags
from shardwise.planner.search import Candidate, Workload, compute_dtype, evaluate, model_key
from shardwise.planner.specs import Cluster, PlannerError

__all__ = ["Recommendation", "recommend"]


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

    @property
    def command(self) -> str | None:
        """Training: the `shardwise train` line that runs the recommendation (its config's
        data.global_batch_size and data.seq_len as planned; sequence parallelism and
        recomputation as planned); None otherwise."""
        r = self.recommended
        if r is None or r.training is None:
            return None
        wl = self.workload
        extra = " --sequence-parallel" if wl.sequence_parallel and r.layout.tp > 1 else ""
        extra += f" --recompute {wl.recompute}" if wl.recompute != "none" else ""
        return f"shardwise train --config CONFIG.toml {train_flags(r.layout.arg(), r.schedule, r.microbatches)}{extra}"


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
    run fits, by how much and what would fit instead."""
    ranked, skipped = evaluate(cfg, wl, cluster, headroom=headroom, allow_cross_node_tp=allow_cross_node_tp)
    if not ranked:
        raise PlannerError(f"no valid layout of {model} on {cluster.devices} devices: " + "; ".join(skipped))
    best = ranked[0] if ranked[0].fits and ranked[0].runnable else None
    winner = min(ranked, key=model_key)
    pipeline = winner if winner.fits and not winner.runnable else None
    rec = Recommendation(
        model, cfg, wl, cluster, headroom, compute_dtype(cfg, wl), ranked, best, skipped, pipeline=pipeline
    )
    if best is None:
        rec.candidates.sort(key=lambda c: c.memory.total)  # the closest to fitting first
        rec.nothing_fits, rec.alternatives = diagnose(rec, allow_cross_node_tp)
    else:
        rec.explanation, rec.warnings = explain(rec)
    return rec
