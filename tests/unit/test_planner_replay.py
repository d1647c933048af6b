"""The planner's pipeline clock against shardwise.pipeline.simulate on the schedules' own
action lists: planner/replay.py gives the simulator's makespan, activations held and
transfers exactly; GPipe and 1F1B deeper than DIRECT_PP are extrapolated in p from p = 3
and 4, and their closed-form profile; every pp up to the layer count is planned (Megatron's
530B at pp=35 and 1T at pp=64, Narayanan et al. 2021, table 1)."""

from __future__ import annotations

import random
import time

import pytest

from shardwise.pipeline import Costs, build_schedule, simulate
from shardwise.planner.predict import Layout, predict_training
from shardwise.planner.presets import cluster_preset, model_preset
from shardwise.planner.replay import Replay
from shardwise.planner.schedule import DIRECT_PP, PipelineSchedule, _closed_profile, schedule_options
from shardwise.planner.specs import TrainingWorkload


def _sizes(max_p: int):
    """(schedule, p, m, v): every schedule, p from 1, m from 1 to 2p + 1 (interleaved: the
    multiples of p up to 3p, 2 and 3 chunks)."""
    for p in range(1, max_p + 1):
        for m in range(1, 2 * p + 2):
            yield "gpipe", p, m, 1
            yield "1f1b", p, m, 1
        if p > 1:
            for m in (p, 2 * p, 3 * p):
                yield "interleaved", p, m, 2
                yield "interleaved", p, m, 3


def _check_replay(max_p: int, seed: int) -> int:
    rng, n = random.Random(seed), 0
    for name, p, m, v in _sizes(max_p):
        lists, r = build_schedule(name, p, m, v), Replay.build(name, p, m, v)
        what = f"{name} p={p} m={m} v={v}"
        for _ in range(3):  # forward < backward, forward > backward, transfers free, cheap or dearer than compute
            c = Costs(
                rng.uniform(0.1, 3), rng.uniform(0.1, 3), rng.choice([0.0, rng.uniform(0, 0.3), rng.uniform(1, 3)])
            )
            sim = simulate(lists, microbatches=m, virtual_stages=v, costs=c)
            assert r.makespan(c.forward, c.backward, c.transfer) == pytest.approx(sim.makespan, rel=1e-12), (what, c)
            n += 1
        assert list(r.peak_in_flight) == sim.peak_in_flight, what
        assert list(r.peak_in_flight_per_stage) == sim.peak_in_flight_per_stage, what
        assert list(r.transfers) == [sum(a.is_transfer for a in x) for x in lists], what
        assert r.messages == sum(a.is_send for x in lists for a in x if a.is_transfer), what
        if name != "interleaved" and p > 1:
            prof = _closed_profile(name, p, m)
            assert prof.transfers == tuple(map(float, r.transfers)), what
            assert prof.in_flight == tuple(map(float, r.peak_in_flight)), what
            assert prof.head_in_flight == r.peak_in_flight_per_stage[-1] and prof.messages == r.messages, what
    return n


def test_replay_is_the_simulator():
    assert _check_replay(5, seed=0) > 250


@pytest.mark.full
def test_replay_is_the_simulator_to_p10():
    assert _check_replay(10, seed=1) > 800


@pytest.mark.parametrize(
    ("name", "cases"),
    [
        ("1f1b", [(9, 1), (9, 2), (12, 5), (16, 40), (24, 3)]),
        ("gpipe", [(9, 9), (13, 2), (20, 33)]),
    ],
)
def test_deep_gpipe_and_1f1b_extrapolate_in_p_exactly(name, cases):
    """Past DIRECT_PP the makespan is replayed at p = 3 and 4 and extrapolated in p; at every
    m and any costs it is the direct simulation's (m < p, m = p, m > p all covered)."""
    rng = random.Random(2)
    for p, m in cases:
        assert p > DIRECT_PP
        sched = PipelineSchedule.build(name, 64, p, m)
        lists = build_schedule(name, p, m)
        for f, b, x in (
            (1.0, 2.0, 0.1),
            (2.0, 1.0, 0.0),
            (rng.uniform(0.1, 3), rng.uniform(0.1, 3), rng.uniform(0, 3)),
        ):
            want = simulate(lists, costs=Costs(f, b, x)).makespan
            assert sched.makespan(f, b, x) == pytest.approx(want, rel=1e-12), (name, p, m, f, b, x)
        sim = simulate(lists)
        prof = sched.profile()
        assert prof.in_flight == tuple(map(float, sim.peak_in_flight))
        assert prof.head_in_flight == sim.peak_in_flight_per_stage[-1]
        assert prof.transfers == tuple(float(sum(a.is_transfer for a in r)) for r in lists)


@pytest.mark.full
def test_deep_extrapolation_over_many_sizes():
    rng = random.Random(3)
    for name in ("1f1b", "gpipe"):
        for p in (9, 11, 17, 24):
            for m in (1, 2, 3, p - 1, p, p + 1, 2 * p + 3):
                lists = build_schedule(name, p, m)
                for _ in range(3):
                    f, b, x = rng.uniform(0.1, 3), rng.uniform(0.1, 3), rng.choice([0.0, rng.uniform(0, 3)])
                    want = simulate(lists, costs=Costs(f, b, x)).makespan
                    got = PipelineSchedule.build(name, 64, p, m).makespan(f, b, x)
                    assert got == pytest.approx(want, rel=1e-12), (name, p, m, f, b, x)


@pytest.mark.full  # 4 s here; the gate plans the paper layouts below
def test_the_deepest_pipelines_are_planned():
    """pp=64 (1F1B and interleaved, m=512) and pp=128 (one layer a stage) build and time
    in seconds; the free-transfer bubble of 1F1B is (p - 1) / (m + p - 1)."""
    start = time.process_time()
    opts, why = schedule_options(128, 64, 512, None)
    assert why is None and [s.name for s in opts] == ["1f1b", "interleaved"]
    for s in opts:
        assert s.makespan(1.0, 2.0, 0.05) > 512 * 3
        assert len(s.loads()) == 64
    deep = PipelineSchedule.build("1f1b", 128, 128, 512)
    assert deep.bubble(1.0, 2.0) == pytest.approx(127 / (512 + 127), rel=1e-12)
    assert [ld.in_flight for ld in deep.loads()][:3] == [128, 127, 126]
    assert time.process_time() - start < 20


@pytest.mark.parametrize(
    ("model", "layout", "nodes", "batch"),
    [
        ("megatron-530b", (8, 35, 9), 315, 2520),
        pytest.param("megatron-1t", (8, 64, 6), 384, 3072, marks=pytest.mark.full),  # 2.4 s here
    ],
)
def test_megatron_paper_layouts_are_predicted(model, layout, nodes, batch):
    """Narayanan et al. 2021, table 1: 530B at tp=8 x pp=35 on 2520 A100s, 1T at tp=8 x pp=64
    on 3072, batch = the GPU count, micro-batch 1, sequence 2048; the paper reached 52% of
    peak (163 TFLOP/s per GPU) with the interleaved schedule."""
    cfg, cluster = model_preset(model), cluster_preset("dgx-a100-80gb", nodes=nodes)
    wl = TrainingWorkload(global_batch=batch, micro_batch=1, seq_len=2048, recompute=True)
    tp, pp, dp = layout
    assert tp * pp * dp == cluster.devices
    m = batch // dp
    for sched in schedule_options(cfg.num_layers, pp, m, None)[0]:
        t = predict_training(cfg, cluster, Layout(tp, pp, dp), wl, sched)
        assert t.micro_batches == m and t.schedule.pp == pp
        assert 0.1 < t.mfu < 0.6 and 0 < t.bubble_fraction < 0.3, (sched.name, t.mfu, t.bubble_fraction)
