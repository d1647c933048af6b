"""The planner: which tp size and which tp x pp x dp layout, from a calibrated cost model.

    from shardwise.planner import recommend, model_preset, cluster_preset, InferenceWorkload
    rec = recommend("llama-3-70b", model_preset("llama-3-70b"), InferenceWorkload(batch=8),
                    cluster_preset("dgx-a100-80gb"))
    rec.recommended.layout         # Layout(tp=2, pp=1, dp=4)

specs (typed inputs) -> presets (data) -> footprint, cost (formulas), schedule (the pipeline:
schedule, m, layer split, simulated) -> predict (one layout) -> search (every layout, ranked)
-> explain (words) -> recommend (the answer) -> report (text, JSON, plot). The `this-host`
cluster is measured by shardwise.bench.calibrate, which builds a specs.Cluster; the planner
never imports bench.

Training layouts with pp > 1 are recommended like any other, with the schedule, m and layer
split `shardwise train` runs (Recommendation.command). Inference layouts with pp > 1 are
predicted and shown but never recommended: `generate --pp` and `serve --pp` run them, but
the pipeline predictions are not validated yet (search.NOT_RUNNABLE; Recommendation.pipeline says when one would win).

Inference plans may store the weights quantized (InferenceWorkload.quantize, `--quantize
fp16|int8`): footprint.weight_bytes counts them, predict times the projections at the
quantized kernels' measured rates (Device.quantized_rows_tflops: this host's calibration),
and recommend picks a format itself when nothing fits or no layout meets the latency target
without one.
"""

from shardwise.planner.predict import Layout
from shardwise.planner.presets import CLUSTER_PRESETS, MODEL_PRESETS, cluster_preset, customize, model_preset
from shardwise.planner.recommend import Recommendation, recommend
from shardwise.planner.schedule import PipelineSchedule
from shardwise.planner.search import NOT_RUNNABLE, Candidate, evaluate
from shardwise.planner.specs import Cluster, Device, InferenceWorkload, Link, PlannerError, TrainingWorkload

__all__ = [
    "recommend",
    "evaluate",
    "Recommendation",
    "Candidate",
    "Layout",
    "PipelineSchedule",
    "NOT_RUNNABLE",
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
    "PlannerError",
]
