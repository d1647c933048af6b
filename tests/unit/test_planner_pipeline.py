"""The pipeline's terms of the cost model: the bubble, the stage-to-stage transfers and the
activations each stage holds, against their formulas and against shardwise.pipeline.simulate
run on the schedules' own action lists."""

from __future__ import annotations

import pytest

from shardwise.pipeline import SCHEDULE_NAMES, Costs, build_schedule, simulate
from shardwise.pipeline.stage import StageLayout
from shardwise.planner.cost import (
    interleaved_bubble_fraction,
    p2p_bytes_per_message,
    p2p_messages_per_step,
    pipeline_bubble_fraction,
    pipeline_in_flight,
)
from shardwise.planner.footprint import (
    layer_params,
    stage_params,
    training_activation_bytes_per_layer,
    training_memory,
)
from shardwise.planner.predict import Layout, predict_training
from shardwise.planner.presets import model_preset
from shardwise.planner.schedule import PipelineSchedule, schedule_options
from shardwise.planner.specs import PRECISIONS, SCHEDULES, Cluster, Device, Link, TrainingWorkload

BENCH = model_preset("bench-156m")  # 8 layers, hidden 1024, vocab 32000
FP32 = PRECISIONS["fp32"]


def _cluster(busbw=10.0, latency=10.0, devices=8) -> Cluster:
    dev = Device("d", 64, {"float32": 1.0}, 100, matmul_efficiency=1.0, mem_efficiency=1.0)
    return Cluster("c", dev, devices, devices, Link("l", busbw, latency))


FREE = _cluster(busbw=1e15, latency=0.0)  # transfers cost nothing


def _wl(m: int, dp: int = 1, **kw) -> TrainingWorkload:
    return TrainingWorkload(global_batch=2 * m * dp, micro_batch=2, seq_len=128, precision="fp32", **kw)


def _pipeline_s(t) -> float:
    """The pipeline part of a step: all of it but the optimizer update (tp=1, dp=1, untied:
    nothing else; compute = m micro-batches + the update)."""
    s = t.step
    return s.total_s - (s.compute_s - t.micro_batches * (t.forward_s + t.backward_s))


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("p", "m"), [(2, 1), (2, 2), (2, 8), (4, 3), (4, 16), (8, 8)])
def test_bubble_is_p_minus_1_over_m_plus_p_minus_1_and_simulates(name, p, m):
    sched = PipelineSchedule.build(name, BENCH.num_layers, p, m)
    t = predict_training(BENCH, FREE, Layout(1, p, 1), _wl(m), sched)
    f, b = t.forward_s, t.backward_s
    formula = pipeline_bubble_fraction(p, m)
    assert t.bubble_fraction == pytest.approx(formula, rel=1e-12)
    assert t.bubble_fraction == pytest.approx(simulate(build_schedule(name, p, m), costs=Costs(f, b)).bubble)
    # in the step: the bubble is (p - 1) of the busiest rank's micro-batches, (p-1)/(m+p-1) of the pipeline
    assert t.step.bubble_s == pytest.approx((p - 1) * (f + b), rel=1e-9)
    assert t.step.bubble_s / _pipeline_s(t) == pytest.approx(formula, rel=1e-9)


@pytest.mark.parametrize(("p", "m"), [(2, 2), (2, 6), (4, 4), (4, 8)])
def test_interleaved_bubble_simulates_and_matches_megatron_when_forward_equals_backward(p, m):
    sched = PipelineSchedule.build("interleaved", 16, p, m)
    assert sched.virtual_stages == 2 and sched.layers == StageLayout.build(16, p, 2).layers
    assert sched.bubble(1.0, 1.0) == pytest.approx(interleaved_bubble_fraction(p, m, 2), rel=1e-12)
    t = predict_training(BENCH, FREE, Layout(1, p, 1), _wl(m), PipelineSchedule.build("interleaved", 8, p, m))
    lists = build_schedule("interleaved", p, m, 2)
    costs = Costs(t.forward_s / 2, t.backward_s / 2)  # one chunk: half a rank's layers
    assert t.bubble_fraction == pytest.approx(simulate(lists, costs=costs).bubble, rel=1e-12)


def test_transfers_per_step_their_bytes_and_time():
    m, p = 4, 2
    link = Link("l", 10.0, 10.0)
    t = predict_training(BENCH, _cluster(), Layout(1, p, 1), _wl(m), PipelineSchedule.build("1f1b", 8, p, m))
    each = p2p_bytes_per_message(2, 128, 1024, 4)
    assert each == 2 * 128 * 1024 * 4
    (send,) = [c for c in t.collectives if c.key() == "send/pp"]
    # p = 2: each rank sends or receives every micro-batch's activation and its gradient
    assert send.calls == 2 * m and send.bytes == 2 * m * each
    assert send.seconds == pytest.approx(2 * m * link.send_s(each))
    assert p2p_messages_per_step(p, m) == 2 * m * (p - 1) == 8
    for name, pp, mm, v in (("gpipe", 4, 6, 1), ("1f1b", 3, 5, 1), ("interleaved", 2, 4, 2)):
        lists = build_schedule(name, pp, mm, v)
        sends = sum(a.is_send for r in lists for a in r if a.is_transfer)
        assert sends == p2p_messages_per_step(pp, mm, v) == PipelineSchedule.build(name, 8, pp, mm).profile().messages
    # the pipeline part is the simulated makespan with those transfers, every action at the busiest rank's costs
    sim = simulate(build_schedule("1f1b", p, m), costs=Costs(t.forward_s, t.backward_s, send.seconds / send.calls))
    assert _pipeline_s(t) == pytest.approx(sim.makespan, rel=1e-9)
    free = predict_training(BENCH, FREE, Layout(1, p, 1), _wl(m))
    assert t.step.total_s > free.step.total_s and t.step.bubble_s > free.step.bubble_s  # rendezvous sends wait


@pytest.mark.parametrize(
    ("name", "p", "m"),
    [("1f1b", 4, 23), ("gpipe", 3, 17), ("1f1b", 2, 40), ("interleaved", 2, 14), ("interleaved", 3, 21)],
)
def test_large_m_is_extrapolated_exactly(name, p, m):
    """Past p + 1 micro-batches (interleaved: 3p) the planner simulates two smaller m and
    extrapolates; the result is the direct simulation's."""
    sched = PipelineSchedule.build(name, 24, p, m)
    v = sched.virtual_stages
    lists = build_schedule(name, p, m, v)
    for f, b, x in ((1.0, 2.0, 0.1), (0.3, 1.1, 0.7), (2.0, 1.0, 0.0)):
        direct = simulate(lists, costs=Costs(f / v, b / v, x))
        assert sched.makespan(f, b, x) == pytest.approx(direct.makespan, rel=1e-12)
    direct = simulate(lists)
    prof = sched.profile()
    assert prof.in_flight == tuple(map(float, direct.peak_in_flight))
    assert prof.head_in_flight == direct.peak_in_flight_per_stage[-1]
    assert prof.transfers == tuple(float(sum(a.is_transfer for a in r)) for r in lists)


@pytest.mark.parametrize(("p", "m"), [(2, 1), (2, 5), (4, 2), (4, 9)])
def test_activations_held_per_stage(p, m):
    """1F1B holds at most min(p - s, m) micro-batches on stage s, GPipe all m; the last stage's
    logits likewise; the first stage carries the embedding, the last the norm and head."""
    for name in ("1f1b", "gpipe"):
        loads = PipelineSchedule.build(name, 8, p, m).loads()
        assert [ld.in_flight for ld in loads] == [pipeline_in_flight(name, p, s, m) for s in range(p)]
        assert [ld.head_in_flight for ld in loads] == [0] * (p - 1) + [pipeline_in_flight(name, p, p - 1, m)]
    kw = dict(micro_batches=m, micro_batch=2, seq=128, width=4, weight_bytes=4, optimizer="adam",
              recompute=False, flash=True, budget=64 * 2**30)  # fmt: skip
    per_layer = training_activation_bytes_per_layer(BENCH, 1, 2, 128, 4, recompute=False, flash=True)
    logits = 3 * 4.0 * 128 * 2 * 32000  # the loss's fp32 logits, shifted logits, exponentials (this rank's vocabulary)
    layer = layer_params(BENCH, 1)[0]
    # the first stage carries the embedding, the last the final norm and the head (untied)
    assert stage_params(BENCH, 1, p, 0) == 8 // p * layer + 32000 * 1024
    assert stage_params(BENCH, 1, p, p - 1) == 8 // p * layer + 32000 * 1024 + 1024
    for name in ("1f1b", "gpipe"):
        got = training_memory(BENCH, 1, p, loads=PipelineSchedule.build(name, 8, p, m).loads(), **kw)
        stages = []
        for s in range(p):
            held = pipeline_in_flight(name, p, s, m)
            act = per_layer * (8 // p) * held + (logits * held if s == p - 1 else 0.0)
            n = stage_params(BENCH, 1, p, s)
            stages.append((n * (4 + 4 + 8) + act, act, n))
        total, act, n = max(stages)
        assert (got.total, got.activations, got.weights) == pytest.approx((total, act, 4 * n)), name


def test_an_uneven_split_is_the_runtimes():
    # 8 layers over 3 stages: earlier stages take the leftover layers, as StageLayout.build does
    sched = PipelineSchedule.build("1f1b", 8, 3, 6)
    assert sched.layers == StageLayout.build(8, 3).layers == (3, 3, 2)
    assert [sched.rank_layers(r) for r in range(3)] == [3, 3, 2]
    assert "stage 0: layers 0-2 + embed" in sched.describe()
    # the busiest rank is the one with 3 layers plus embedding or head
    loads = sched.loads()
    assert [ld.layers for ld in loads] == [3, 3, 2]
    assert stage_params(BENCH, 1, 3, 1, layers=3) == 3 * layer_params(BENCH, 1)[0]


def test_schedule_options_follow_the_runtimes_rules():
    assert schedule_options(8, 1, 5, None) == ([None], None)
    names = [s.name for s in schedule_options(8, 2, 4, None)[0]]
    assert names == ["1f1b", "interleaved"]  # GPipe only when asked: 1F1B's bubble, more memory
    assert [s.name for s in schedule_options(8, 2, 3, None)[0]] == ["1f1b"]  # interleaved: m % pp
    opts, why = schedule_options(8, 2, 3, "interleaved")
    assert opts == [] and "microbatches to be a multiple of pp=2" in why
    opts, why = schedule_options(4, 4, 8, "interleaved")
    assert opts == [] and "8 stages is more than the model's 4 layers" in why
    assert schedule_options(4, 4, 8, "gpipe")[0][0].name == "gpipe"
    assert [s.name for s in schedule_options(64, 48, 48, None)[0]] == ["1f1b"]  # 96 chunks > 64 layers
    assert set(SCHEDULES) == set(SCHEDULE_NAMES)
