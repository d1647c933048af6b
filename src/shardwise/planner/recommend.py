"""The planner's answer: every layout ranked, the one to run, and why (or, when nothing
fits, by how much and what would fit instead).

NOTE: the recommendation is always a layout shardwise can run today (pp = 1). When the
cost model would pick a pipeline (pp > 1), that layout is kept in `pipeline` and the
answer says so: pipeline parallelism has its own issue.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shardwise.models.config import ModelConfig
from shardwise.planner.explain import diagnose, explain
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
    """The best fitting layout shardwise can run (pp = 1); None when none fits."""
    skipped: list[str] = field(default_factory=list)
    pipeline: Candidate | None = None
    """A fitting layout with pp > 1 that the cost model ranks first: what would be recommended
    once shardwise runs pipelines (search.NOT_RUNNABLE). None when a pp = 1 layout wins."""
    explanation: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    nothing_fits: str | None = None
    alternatives: list[str] = field(default_factory=list)
    """When nothing fits: what would."""


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
