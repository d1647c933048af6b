"""What the planner recommends, shardwise runs: every training layout (pipelines included) is
one `shardwise train` accepts, with the schedule, m and layer split the runtime would use;
inference layouts with pp > 1 are predicted and shown but never recommended (inference does
not run pipelines yet), and when one would win, the answer says so."""

from __future__ import annotations

import json

import pytest

from shardwise.pipeline import SCHEDULE_NAMES
from shardwise.planner import (
    NOT_RUNNABLE,
    InferenceWorkload,
    TrainingWorkload,
    cluster_preset,
    customize,
    evaluate,
    model_preset,
    recommend,
)
from shardwise.planner.report import render_text, to_json
from shardwise.planner.specs import SCHEDULES, Cluster, Device, Link
from shardwise.sharding.plans.tp import check_tp
from shardwise.train import TrainConfig
from shardwise.train.config import ParallelSection

# 8B training with Adam on 80 GiB devices: tp=1 pp=1 does not fit (about 129 GiB), tp=1 pp=2
# does, and the cost model's order (smallest tp first) picks it.
TRAIN = TrainingWorkload(global_batch=64, micro_batch=1, seq_len=2048)


def _rec(model: str, cluster, wl, **kw):
    return recommend(model, model_preset(model), wl, cluster, **kw)


def _small(devices: int, memory_gib: float) -> Cluster:
    dev = Device("dev", memory_gib, {"bfloat16": 100.0, "float32": 50.0}, 1000.0)
    return Cluster("small", dev, devices, devices, Link("l", 10.0, 10.0))


def _train_config(cfg, candidate_json: dict) -> TrainConfig:
    """The TrainConfig `shardwise train` builds for the model and a plan's layout."""
    model = dict(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_layers=cfg.num_layers, num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
        max_positions=cfg.max_positions, tie_embeddings=cfg.tie_embeddings,
    )  # fmt: skip
    run = candidate_json["train_config"]
    data = {"tokens": "tokens.safetensors", **run["data"]}
    return TrainConfig.from_dict({"model": model, "data": data, "parallel": run["parallel"]})


# (model, cluster, workload): training plans that recommend pp = 1, pipelines, uneven splits,
# interleaved and gpipe when asked, tied embeddings, tp > 1 with pp > 1
TRAINING_PLANS = [
    ("llama-3-8b", cluster_preset("dgx-h100"), TRAIN),
    ("llama-3-8b", cluster_preset("dgx-h100"), TrainingWorkload(global_batch=64, micro_batch=2, seq_len=1024)),
    ("llama-3-70b", cluster_preset("dgx-h100", nodes=2), TrainingWorkload(global_batch=64, recompute=True)),
    ("mistral-7b", cluster_preset("pcie-8x-rtx4090"), TrainingWorkload(global_batch=32, seq_len=1024, recompute=True)),
    ("debug", _small(6, 0.06), TrainingWorkload(global_batch=24, seq_len=256, precision="fp32")),
    ("debug", _small(4, 1.0), TrainingWorkload(global_batch=16, seq_len=256, schedule="interleaved")),
    ("debug", _small(4, 1.0), TrainingWorkload(global_batch=8, seq_len=256, schedule="gpipe")),
    ("gpt3-175b", cluster_preset("dgx-a100-80gb", nodes=8), TrainingWorkload(global_batch=64, recompute=True)),
]


@pytest.mark.parametrize(("model", "cluster", "wl"), TRAINING_PLANS, ids=lambda x: getattr(x, "name", str(x))[:24])
def test_every_training_layout_is_one_shardwise_train_accepts(model, cluster, wl):
    rec = _rec(model, cluster, wl)
    cfg = rec.cfg
    d = json.loads(json.dumps(to_json(rec)))
    assert rec.candidates and all(c.runnable for c in rec.candidates)
    for c, cj in zip(rec.candidates, d["layouts"], strict=True):
        lay, s = c.layout, c.schedule
        tc = _train_config(cfg, cj)  # raises ConfigError for anything the runtime refuses
        par = tc.parallel
        assert cj["layout"] == lay.arg() == par.layout() == ParallelSection(tp=lay.tp, pp=lay.pp, dp=lay.dp).layout()
        assert par.world_size == cluster.devices
        check_tp(cfg, lay.tp)  # the sharding plan splits the model at this tp
        assert tc.data.grad_accum(lay.dp) == c.microbatches == cj["microbatches"]
        assert tc.data.micro_batch_size == wl.micro_batch
        stages = tc.check_stages(cfg.num_layers)  # the runtime's layer split
        if lay.pp == 1:
            assert s is None and cj["schedule"] is None and cj["pp_layers"] is None
            continue
        assert s.name == par.schedule == cj["schedule"] and s.name in SCHEDULE_NAMES
        assert wl.schedule in (None, s.name)
        assert stages.layers == s.layers and cj["pp_layers"] == list(s.layers)
        assert s.virtual_stages == par.virtual_stages and lay.pp <= cfg.num_layers
        if s.name == "interleaved":
            assert c.microbatches % lay.pp == 0
    if rec.recommended is not None:
        r = rec.recommended
        assert d["layout"] == r.layout.arg() and d["microbatches"] == r.microbatches
        assert d["schedule"] == (r.schedule.name if r.schedule else None)
        assert f"--layout {r.layout.arg()}" in rec.command and f"--microbatches {r.microbatches}" in rec.command
        assert ("--schedule" in rec.command) == (r.layout.pp > 1)
        assert rec.command in render_text(rec)


def test_the_plans_above_cover_pipelines_splits_and_schedules():
    recs = [_rec(m, c, w) for m, c, w in TRAINING_PLANS]
    picked = [r.recommended for r in recs if r.recommended is not None]
    assert any(r.layout.pp > 1 for r in picked) and any(r.layout.pp == 1 for r in picked)
    assert any(r.layout.pp > 1 and r.layout.tp > 1 for r in picked)
    shown = [c for r in recs for c in r.candidates]
    assert any(len(set(c.schedule.layers)) > 1 for c in shown if c.schedule)  # an uneven split
    assert {c.schedule.name for c in shown if c.schedule} == set(SCHEDULE_NAMES)
    assert set(SCHEDULES) == set(SCHEDULE_NAMES)
    assert any(r.cfg.tie_embeddings and r.recommended.layout.pp > 1 for r in recs if r.recommended)


def test_interleaved_needs_m_a_multiple_of_pp_and_two_layers_per_rank():
    # debug: 4 layers; interleaved runs 2 chunks per rank, so pp=4 would need 8 layers
    rec = _rec("debug", _small(4, 1.0), TrainingWorkload(global_batch=12, seq_len=64, schedule="interleaved"))
    assert {c.layout.pp for c in rec.candidates} == {1, 2}
    assert any(
        "tp=1 pp=4 dp=1: pp=4 x virtual_stages=2 = 8 stages is more than the model's 4 layers" in s for s in rec.skipped
    ), rec.skipped
    # m = 3 micro-batches cannot go through 2 stages in groups of 2; 1F1B takes them
    odd = _rec("debug", _small(2, 1.0), TrainingWorkload(global_batch=3, seq_len=64, schedule="interleaved"))
    assert {str(c.layout) for c in odd.candidates} == {"tp=2 pp=1 dp=1"}
    assert any("tp=1 pp=2 dp=1: interleaved 1F1B needs microbatches to be a multiple of pp=2" in s for s in odd.skipped)
    free = _rec("debug", _small(2, 1.0), TrainingWorkload(global_batch=3, seq_len=64))
    (pipe,) = [c for c in free.candidates if c.layout.pp == 2]
    assert pipe.schedule.name in ("1f1b", "gpipe") and pipe.microbatches == 3
    with pytest.raises(ValueError, match="schedule must be one of gpipe, 1f1b, interleaved"):
        TrainingWorkload(schedule="zb")


def test_inference_pipelines_are_runnable_candidates():
    rec = _rec("llama-3-70b", cluster_preset("dgx-a100-80gb"), InferenceWorkload(batch=8))
    assert rec.recommended.layout == rec.recommended.layout.__class__(2, 1, 4) and rec.pipeline is None
    pipes = [c for c in rec.candidates if c.layout.pp > 1]
    assert pipes and all(c.runnable and c.why_not is None for c in pipes)
    assert all(c.schedule is None and c.microbatches is None for c in rec.candidates)
    assert rec.command == "shardwise serve --model MODEL --tp 2 --max-batch-size 8 --max-model-len 640"
    text = render_text(rec, top=len(rec.candidates))
    assert NOT_RUNNABLE not in text
    d = json.loads(json.dumps(to_json(rec)))
    assert all(x["runnable"] for x in d["layouts"])
    assert d["layout"] == "tp=2,pp=1,dp=4" and d["schedule"] is None and d["command"] == rec.command
    assert "run it (MODEL: the checkpoint directory; 4 replicas: one server each):\n  shardwise serve" in text


def test_an_inference_pipeline_that_wins_is_recommended():
    # 70B needs 2 devices; over a link with 2 ms all-reduces tp=2 decodes slower than 2 stages
    slow = customize(cluster_preset("dgx-a100-80gb"), intra_latency_us=2000)
    rec = _rec("llama-3-70b", slow, InferenceWorkload(batch=8))
    r = rec.recommended
    assert r.runnable and r.layout.pp > 1 and r.fits and rec.pipeline is None
    (tp2,) = [c for c in rec.candidates if (c.layout.tp, c.layout.pp, c.layout.dp) == (2, 1, 4)]
    assert r.inference.decode.total_s < tp2.inference.decode.total_s
    assert to_json(rec)["layout"] == r.layout.arg()


def test_fitting_inference_layouts_rank_before_the_ones_that_do_not_fit():
    ranked, _ = evaluate(model_preset("llama-3-70b"), InferenceWorkload(batch=8), cluster_preset("dgx-a100-80gb"))
    assert all(c.runnable for c in ranked)
    assert [c.fits for c in ranked] == sorted((c.fits for c in ranked), reverse=True)


def test_only_an_inference_pipeline_fits():
    # one device per node and tp across nodes not allowed: only tp=1, and 8B needs two stages
    one_per_node = Cluster(
        "singles", Device("gpu", 12, {"bfloat16": 100}, 1000), 4, 1, Link("nvlink", 200, 5), Link("ib", 100, 5)
    )
    rec = _rec("llama-3-8b", one_per_node, InferenceWorkload())
    assert rec.recommended.layout.pp == 2 and rec.pipeline is None and rec.nothing_fits is None
    text = render_text(rec)
    assert "recommended: tp=1 pp=2" in text and NOT_RUNNABLE not in text
    # training the same model there runs the pipeline
    train = _rec("llama-3-8b", one_per_node, TrainingWorkload(global_batch=8, seq_len=512, recompute=True))
    assert train.pipeline is None
    assert train.recommended is None or train.recommended.layout.pp > 1
