"""Layouts with pp > 1: predicted and shown, never recommended, until shardwise runs
pipeline parallelism; when one would win, the answer says so."""

from __future__ import annotations

import json

from shardwise.planner import (
    NOT_RUNNABLE,
    InferenceWorkload,
    TrainingWorkload,
    cluster_preset,
    evaluate,
    model_preset,
    recommend,
)
from shardwise.planner.report import render_text, to_json
from shardwise.planner.specs import Cluster, Device, Link

# 8B training with Adam on 80 GiB devices: tp=1 pp=1 does not fit (about 129 GiB), tp=1 pp=2
# does, and the cost model's order (smallest tp first) picks it.
TRAIN = TrainingWorkload(global_batch=64, micro_batch=1, seq_len=2048)


def _rec(model: str, cluster, wl, **kw):
    return recommend(model, model_preset(model), wl, cluster, **kw)


def test_a_pipeline_that_would_win_is_named_but_not_recommended():
    rec = _rec("llama-3-8b", cluster_preset("dgx-h100"), TRAIN)
    r, p = rec.recommended, rec.pipeline
    assert r.runnable and r.layout.pp == 1 and r.fits
    assert not p.runnable and p.layout.pp > 1 and p.fits and p.layout.tp < r.layout.tp
    warning = [w for w in rec.warnings if w.startswith(f"{p.layout} would be recommended")]
    assert len(warning) == 1 and NOT_RUNNABLE in warning[0] and f"{r.layout} is the best" in warning[0]
    assert "without a pipeline" in " ".join(rec.explanation)
    # the recommendation is the first row; pipelines are still shown, each labelled
    text = render_text(rec, top=len(rec.candidates))
    table = text.split("\ncommunication per")[0]
    rows = [line for line in table.splitlines() if line[2:5] == "tp="]
    assert len(rows) == len(rec.candidates)
    assert rows[0].startswith(f"> {r.layout}")
    for c in rec.candidates:
        (row,) = [line for line in rows if line[2:].startswith(str(c.layout) + " ")]
        assert (f"({NOT_RUNNABLE})" in row) == (c.layout.pp > 1), row
    d = json.loads(json.dumps(to_json(rec)))
    assert d["recommended"]["layout"]["pp"] == 1 and d["recommended"]["runnable"] is True
    assert d["pipeline"]["layout"] == {"tp": p.layout.tp, "pp": p.layout.pp, "dp": p.layout.dp}
    assert {x["runnable"] for x in d["layouts"]} == {True, False}
    assert all(x["runnable"] == (x["layout"]["pp"] == 1) for x in d["layouts"])


def test_no_pipeline_note_when_a_runnable_layout_wins():
    rec = _rec("llama-3-70b", cluster_preset("dgx-a100-80gb"), InferenceWorkload(batch=8))
    assert rec.recommended.layout.tp == 2 and rec.pipeline is None
    assert any(c.layout.pp > 1 for c in rec.candidates)  # shown all the same
    assert not any(NOT_RUNNABLE in w for w in rec.warnings)
    assert to_json(rec)["pipeline"] is None


def test_every_preset_recommendation_is_runnable():
    for model, cluster, wl in (
        ("llama-3-70b", "pcie-8x-rtx4090", InferenceWorkload()),
        ("llama-3-8b", "dgx-h100", TRAIN),
        ("mistral-7b", "dgx-a100-80gb", InferenceWorkload(batch=32, prompt_len=4096)),
        ("llama-3-70b", "dgx-h100", TrainingWorkload(global_batch=64, recompute=True)),
    ):
        rec = _rec(model, cluster_preset(cluster), wl)
        assert rec.recommended is None or rec.recommended.layout.pp == 1, (model, cluster)


def test_fitting_runnable_layouts_rank_before_fitting_pipelines():
    ranked, _ = evaluate(model_preset("llama-3-8b"), TRAIN, cluster_preset("dgx-h100"))
    fitting = [c.runnable for c in ranked if c.fits]
    assert fitting == sorted(fitting, reverse=True) and True in fitting and False in fitting
    assert [c.fits for c in ranked] == sorted((c.fits for c in ranked), reverse=True)


def test_only_a_pipeline_fits():
    # one device per node and tp across nodes not allowed: only tp=1, and 8B needs two stages
    one_per_node = Cluster(
        "singles", Device("gpu", 12, {"bfloat16": 100}, 1000), 4, 1, Link("nvlink", 200, 5), Link("ib", 100, 5)
    )
    rec = _rec("llama-3-8b", one_per_node, InferenceWorkload())
    assert rec.recommended is None and rec.pipeline.layout.pp == 2
    assert rec.nothing_fits.startswith("nothing fits on 4 x gpu without a pipeline: the smallest footprint, tp=1 pp=1")
    assert rec.alternatives[0] == f"a pipeline, once shardwise runs one ({NOT_RUNNABLE}): {rec.pipeline.layout}"
    nodes = [a for a in rec.alternatives if " nodes (" in a]
    assert nodes == [] or nodes[0].endswith(f"({NOT_RUNNABLE})"), nodes
    text = render_text(rec)
    assert "Nothing fits on 4 x gpu without a pipeline" in text and NOT_RUNNABLE in text
