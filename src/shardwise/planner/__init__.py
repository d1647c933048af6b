"""The planner: which tp size and which tp x pp x dp layout, from a calibrated cost model.

    from shardwise.planner import make_plan, model_preset, cluster_preset, InferenceWorkload
    plan = make_plan("llama-3-70b", model_preset("llama-3-70b"), InferenceWorkload(batch=8),
                     cluster_preset("dgx-a100-80gb"))
    plan.recommended.layout        # Layout(tp=2, pp=1, dp=4)

specs (typed inputs) -> presets (data) -> memory, cost (formulas) -> predict (one layout)
-> search (every layout, ranked) -> explain (words) -> report (text, JSON, plot);
calibrate + measure build the `this-host` cluster from measurements.
"""

from shardwise.planner.predict import Layout
from shardwise.planner.presets import CLUSTER_PRESETS, MODEL_PRESETS, cluster_preset, customize, model_preset
from shardwise.planner.search import Candidate, Plan, evaluate, make_plan
from shardwise.planner.specs import Cluster, Device, InferenceWorkload, Link, PlanError, TrainingWorkload

__all__ = [
    "make_plan",
    "evaluate",
    "Plan",
    "Candidate",
    "Layout",
    "model_preset",
    "cluster_preset",
    "customize",
    "MODEL_PRESETS",
    "CLUSTER_PRESETS",
    "Cluster",
    "Device",
    "Link",
    "InferenceWorkload",
    "TrainingWorkload",
    "PlanError",
]
