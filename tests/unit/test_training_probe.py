"""The calibration's training probe and the planner's training micro-step agree with each other.

train_probe.training_probe fits a host's training terms from a few timed micro-steps (fixed times
per layer and per micro-step, whole and as a tp=2 shard; the element-wise work around the
products per activation value, which a tp group does not split; the products' share of the
matmul rate). The planner must price the probe's own micro-steps back at the times they took,
and a tp=2 shard at its own fixed times with all of that element-wise work: here with the
micro-steps' times made up from known terms, so each term is checked on its own.
"""

from __future__ import annotations

import pytest
import torch

from shardwise.bench import train_probe
from shardwise.comm.dryrun import DryRunCommunicator
from shardwise.models.config import ModelConfig
from shardwise.planner.predict import Layout, _micro_batch
from shardwise.planner.specs import Cluster, Device, Link, TrainingWorkload

GEMM = 50e9  # the matmul probe's FLOP/s
TRUE = dict(rate=40e9, unsplit=30e-9, layer={1: 1e-3, 2: 1.6e-3}, step={1: 0.8e-3, 2: 1.1e-3})


def _time(true: dict, cfg, batch: int, tokens: int, tp: int = 1) -> float:
    """A micro-step's time from `true`'s terms: products at its rate, element-wise work per
    activation value (all of it at any tp), fixed times per layer and per micro-step."""
    flops, values, layers = train_probe.step_terms(cfg, batch, tokens, tp)
    return flops / true["rate"] + true["unsplit"] * values + layers * true["layer"][tp] + true["step"][tp]


def _made_up(cfg, batch: int, tokens: int, repeats: int, optimizer: bool = False, tp: int = 1):
    """train_s with TRUE's times."""
    t = _time(TRUE, cfg, batch, tokens, tp)
    return (t, 1e-3) if optimizer else t


def _device(probe: dict, **kw) -> Device:
    terms = ("train_efficiency", "train_layer_overhead_us", "train_step_overhead_us", "train_tp_layer_overhead_us",
             "train_tp_step_overhead_us", "train_unsplit_ns")  # fmt: skip
    return Device("core", 16, {"float32": GEMM / 1e12}, 1e6, matmul_efficiency=1.0, mem_efficiency=1.0,
                  **{k: probe[k] for k in terms}, **kw)  # fmt: skip


def _micro_s(cfg, dev: Device, tp: int, batch: int, tokens: int, **wl) -> float:
    cluster = Cluster("c", dev, tp, tp, Link("l", 10.0, 10.0))
    w = TrainingWorkload(global_batch=batch, micro_batch=batch, seq_len=tokens, precision="fp32", **wl)
    f, b, _ = _micro_batch(cfg, cluster, Layout(tp, 1, 1), w, layers=cfg.num_layers, first=True, last=True,
                           stage=0, transfers=0)  # fmt: skip
    return f.compute_s + b.compute_s


def test_the_probe_recovers_each_term_and_the_planner_prices_its_steps_back(monkeypatch):
    monkeypatch.setattr(train_probe, "train_s", _made_up)
    probe = train_probe.training_probe(1, GEMM)
    assert probe["train_unsplit_ns"] == pytest.approx(TRUE["unsplit"] * 1e9)
    assert probe["train_layer_overhead_us"] == pytest.approx(TRUE["layer"][1] * 1e6)
    assert probe["train_tp_layer_overhead_us"] == pytest.approx(TRUE["layer"][2] * 1e6)
    assert probe["train_step_overhead_us"] == pytest.approx(TRUE["step"][1] * 1e6)
    assert probe["train_tp_step_overhead_us"] == pytest.approx(TRUE["step"][2] * 1e6)
    assert probe["train_efficiency"] == pytest.approx(TRUE["rate"] / GEMM)
    dev = _device(probe)
    h1024 = ModelConfig("llama", 4096, 1024, 2816, 2, 16, 4, 64)  # the probe's own shape
    assert _micro_s(h1024, dev, 1, 2, 128) == pytest.approx(probe["train_s"])
    # a shape it never ran, whole and as a tp=2 shard (alone: no busy penalty set)
    builtin = ModelConfig("llama", 512, 256, 512, 4, 8, 4, 32)
    for tp in (1, 2):
        assert _micro_s(builtin, dev, tp, 2, 128) == pytest.approx(_time(TRUE, builtin, 2, 128, tp))


def test_a_shards_unsplit_work_and_fixed_times_by_hand():
    probe = dict(train_efficiency=0.5, train_layer_overhead_us=300.0, train_step_overhead_us=600.0,
                 train_tp_layer_overhead_us=500.0, train_tp_step_overhead_us=700.0, train_unsplit_ns=40.0)  # fmt: skip
    bare = dict.fromkeys(("train_tp_layer_overhead_us", "train_tp_step_overhead_us", "train_unsplit_ns"))
    cfg = ModelConfig("llama", 4096, 1024, 2816, 8, 16, 4, 64)
    values = 128 * 1024 * 8  # tokens x hidden x layers
    # tp=1: the element-wise work, all of it, once per pass (a third of the probe's forward and backward each)
    assert _micro_s(cfg, _device(probe), 1, 1, 128) - _micro_s(cfg, _device(probe | bare), 1, 1, 128) == (
        pytest.approx(40e-9 * values)
    )
    # tp=2, every core busy at 0.8 of its pace alone: the shard's own fixed times and all the element-wise work
    busy = _device(probe, busy_train=0.8)
    more = _micro_s(cfg, busy, 2, 1, 128) - _micro_s(cfg, _device(probe | bare, busy_train=0.8), 2, 1, 128)
    assert more == pytest.approx((8 * (500 - 300) + (700 - 600)) * 1e-6 + 40e-9 * values / 0.8)
    # sequence parallelism: each rank's norms and residuals see 1/tp of the tokens
    sp = _micro_s(cfg, busy, 2, 1, 128, sequence_parallel=True)
    assert _micro_s(cfg, busy, 2, 1, 128) - sp == pytest.approx(40e-9 * values / 0.8 / 2)
    # full recompute: one more forward's share of it
    full = _micro_s(cfg, busy, 2, 1, 128, recompute="full") - _micro_s(cfg, busy, 2, 1, 128)
    assert full > 40e-9 * values / 0.8 / 3


def test_the_probe_runs_the_trainers_micro_step_whole_and_as_a_shard():
    """train_s runs what shardwise.train runs, at tp 1 and as rank 0 of a dry-run tp=2 group: a
    shard's step takes time, and its model is the shard (half the heads and the MLP)."""
    cfg = ModelConfig("llama", 256, 64, 128, 2, 4, 2, 16)
    torch.manual_seed(0)
    for tp in (1, 2):
        t = train_probe.train_s(cfg, 1, 8, 1, tp=tp)
        assert 0 < t < 5
    from shardwise.train.layout import build_model

    shard = build_model(cfg, DryRunCommunicator(2, 0), init_std=0.02)
    whole = build_model(cfg, DryRunCommunicator(1, 0), init_std=0.02)
    assert sum(p.numel() for p in shard.parameters()) < sum(p.numel() for p in whole.parameters())


def test_the_fit_keeps_its_bounds_and_names_what_it_lacks():
    tiny1, tiny5, flat, wide = (train_probe.TINY[1], 1, 8), (train_probe.TINY[5], 1, 8), (train_probe.FLAT, 8, 32), (
        train_probe.WIDE, 2, 128)  # fmt: skip
    # products faster than the matmul probe: efficiency 1, the rest of the time to the other terms
    fast = dict(TRUE, rate=2 * GEMM)
    rows = [(*r, tp, _time(fast, *r, tp)) for r in (tiny1, tiny5) for tp in (1, 2)]
    rows += [(*r, 1, _time(fast, *r)) for r in (flat, wide)]
    fit = train_probe.fit_training(rows, GEMM)
    assert fit["train_efficiency"] == 1.0
    assert fit["train_unsplit_ns"] >= 0 and fit["train_layer_overhead_us"] >= 0 and fit["train_step_overhead_us"] >= 0
    # a step with no element-wise work at all: unsplit pinned at 0, never negative
    none = dict(TRUE, unsplit=-5e-9)
    rows = [(*r, 1, _time(none, *r)) for r in (tiny1, tiny5, flat, wide)]
    assert train_probe.fit_training(rows, GEMM)["train_unsplit_ns"] == 0.0
    # steps faster than their products at the matmul probe's rate: every term at its bound
    instant = train_probe.fit_training([(*r[:4], 1e-9) for r in rows], GEMM)
    assert instant == {"train_efficiency": 1.0, "train_unsplit_ns": 0.0, "train_layer_overhead_us": 0.0,
                       "train_step_overhead_us": 0.0}  # fmt: skip
    with pytest.raises(ValueError, match="4 micro-steps at tp=1 to fit 4 terms, got 3"):
        train_probe.fit_training(rows[:3], GEMM)
    with pytest.raises(ValueError, match="tp=2 micro-steps at 2 layer counts"):
        train_probe.fit_training(rows + [(*tiny1, 2, 0.01)], GEMM)
