"""Layouts, the recommendation, the warnings and bad input. this-host uses fake calibration
data: nothing here depends on how fast this machine is."""

from __future__ import annotations

import json

import pytest

from shardwise.bench.calibrate import Calibration, fit_link, load_calibration
from shardwise.planner import (
    InferenceWorkload,
    PlannerError,
    TrainingWorkload,
    cluster_preset,
    customize,
    model_preset,
    recommend,
)
from shardwise.planner.presets import resolve_model
from shardwise.planner.report import plot, render_text, to_json
from shardwise.planner.specs import Cluster, Device, Link

FAKE = Calibration(
    host="fake", torch="0", devices=2, memory_gib=16.0, gemm_tflops={"float32": 0.05, "bfloat16": 0.1},
    mem_gbps=10.0, layer_overhead_us=200.0, step_overhead_us=200.0,
    links={
        "gloo": {"latency_us": 300.0, "busbw_gbps": 1.0, "points": [{"size_bytes": 4096, "latency_us": 300.0},
                                                                  {"size_bytes": 1 << 20, "latency_us": 1300.0}]},
        "mpi": {"latency_us": 6.0, "busbw_gbps": 1.2, "points": []},
    },
    unavailable={"nccl": "not available here"}, created="fake",
)  # fmt: skip


def plan(model: str, cluster, wl=None, **kw):
    cluster = cluster_preset(cluster) if isinstance(cluster, str) else cluster
    return recommend(model, model_preset(model), wl or InferenceWorkload(), cluster, **kw)


def test_a_model_that_fits_on_one_device_gets_tp1():
    for model, cluster in (("llama-3-8b", "dgx-a100-80gb"), ("mistral-7b", "dgx-h100"), ("bench-156m", FAKE.cluster())):
        p = plan(model, cluster)
        assert (p.recommended.layout.tp, p.recommended.layout.pp) == (1, 1), model
        assert p.recommended.layout.dp == p.cluster.devices or p.cluster.shared_memory
        assert "so tp=1" in p.explanation[1]


def test_smallest_tp_that_fits_with_headroom():
    # 70B in bf16: 131 GiB of weights -> two 80 GiB A100s (68.4 GiB each, under 90% of 79 GiB)
    assert plan("llama-3-70b", "dgx-a100-80gb", InferenceWorkload(batch=8)).recommended.layout.tp == 2
    # 24 GiB cards: 8 of them, and tp=8 decodes faster than any mix with pp
    p = plan("llama-3-70b", "pcie-8x-rtx4090")
    assert (p.recommended.layout.tp, p.recommended.layout.pp) == (8, 1)
    assert "needed for memory" in " ".join(p.explanation)
    # more headroom asked, more devices needed
    assert plan("llama-3-70b", "dgx-a100-80gb", headroom=0.3).recommended.layout.replica == 4


def test_latency_target_raises_tp_or_says_it_cannot_be_met():
    base = plan("llama-3-8b", "dgx-h100", InferenceWorkload(prompt_len=2048, output_len=256))
    t1 = base.recommended.time_s * 1e3
    faster = plan(
        "llama-3-8b", "dgx-h100", InferenceWorkload(prompt_len=2048, output_len=256, target_latency_ms=0.8 * t1)
    )
    assert faster.recommended.layout.tp > 1 and faster.recommended.meets_target
    never = plan("llama-3-8b", "dgx-h100", InferenceWorkload(target_latency_ms=1.0))
    assert never.recommended.layout.tp == 1
    assert any("no layout meets the target of 1 ms" in w for w in never.warnings)


def test_warns_when_tp_cannot_pay_off():
    p = plan("bench-156m", FAKE.cluster("gloo"), InferenceWorkload(prompt_len=128, output_len=32))
    assert p.recommended.layout.tp == 1
    slow = customize(cluster_preset("pcie-8x-rtx4090"), intra_latency_us=2000)
    w = plan("bench-156m", slow, InferenceWorkload(prompt_len=128, output_len=32)).warnings
    assert any("tensor parallelism cannot pay off" in x for x in w), w


def test_warns_when_tp_crosses_a_node_boundary():
    two = Cluster("pairs", Device("gpu", 12, {"bfloat16": 100}, 1000), 4, 1, Link("nvlink", 200, 5), Link("ib", 100, 5))
    p = plan("llama-3-8b", two, allow_cross_node_tp=True)
    r = p.recommended
    assert r.cross_node_tp and r.layout.tp == 2
    assert any("crosses a node boundary" in w for w in p.warnings)
    # not allowed: the cost model picks a pipeline instead, which `serve --pp` runs
    no_cross = plan("llama-3-8b", two)
    assert no_cross.recommended.layout.pp == 2 and not no_cross.recommended.cross_node_tp
    assert no_cross.pipeline is None and no_cross.nothing_fits is None
    assert any("would cross a node boundary" in s for s in plan("llama-3-8b", two).skipped)


def test_nothing_fits_says_by_how_much_and_what_would():
    p = plan("gpt3-175b", "pcie-8x-rtx4090")
    assert p.recommended is None
    assert "GiB short" in p.nothing_fits and "tp=8 pp=1" in p.nothing_fits
    assert any(a.startswith("2 nodes (16 devices)") for a in p.alternatives), p.alternatives
    text = render_text(p)
    assert "Nothing fits on" in text and "what would fit instead" in text
    t = plan("llama-3-8b", "pcie-8x-rtx4090", TrainingWorkload(global_batch=64, micro_batch=4, seq_len=1024))
    assert t.recommended is None
    assert any(a.startswith("activation recomputation (--recompute): tp=") for a in t.alternatives), t.alternatives
    assert any(a.startswith("micro-batch 1: tp=") for a in t.alternatives), t.alternatives


@pytest.mark.full  # 10 s here; make test keeps the planner's other search tests
def test_training_plan_uses_every_device_and_explains():
    wl = TrainingWorkload(global_batch=256, micro_batch=2, seq_len=2048, recompute=True)
    p = plan("llama-3-70b", cluster_preset("dgx-h100", nodes=4), wl)
    r = p.recommended  # only a pipeline fits: training runs it
    assert p.pipeline is None and r.layout.pp > 1 and r.runnable
    assert r.layout.tp * r.layout.pp * r.layout.dp == 32 and r.fits
    assert all(c.layout.tp * c.layout.pp * c.layout.dp == 32 for c in p.candidates)
    assert 0 < r.training.mfu < 1 and r.training.micro_batches == 256 // (2 * r.layout.dp)
    assert any("does not divide" in s or "not a multiple" in s for s in p.skipped)
    assert any(line.startswith(f"Pipeline: {r.schedule.name} schedule, m={r.microbatches}") for line in p.explanation)
    d = json.loads(json.dumps(to_json(p)))
    assert d["recommended"]["layout"] == d["layout"] == f"tp={r.layout.tp},pp={r.layout.pp},dp={r.layout.dp}"
    assert d["recommended"]["pp_layers"] == list(r.schedule.layers) and sum(r.schedule.layers) == 80


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: model_preset("llama-4-8b"), "unknown model preset 'llama-4-8b' (did you mean 'llama-3-8b'?)"),
        (lambda: cluster_preset("dgx-b200"), "unknown cluster preset 'dgx-b200'"),
        (lambda: resolve_model("/no/such/dir"), "/no/such/dir: no such file or directory"),
        (lambda: customize(cluster_preset("dgx-h100", nodes=2), devices=12), "devices=12 is not a multiple of"),
        (lambda: customize(cluster_preset("dgx-h100"), memory_gib=-1), "memory_gib must be > 0, got -1"),
        (lambda: TrainingWorkload(global_batch=10, micro_batch=4), "global_batch=10 is not a multiple of micro_batch=4"),
        (lambda: InferenceWorkload(batch=0), "batch must be > 0, got 0"),
        (lambda: plan("llama-3-8b", "dgx-h100", InferenceWorkload(prompt_len=8000, output_len=500)),
         "prompt_len=8000 + output_len=500 = 8500 exceeds the model's context of 8192"),
        (lambda: plan("llama-3-8b", "dgx-h100", headroom=1.5), "headroom must be a fraction in [0, 1), got 1.5"),
        (lambda: FAKE.cluster("nccl"), "backend 'nccl' has no calibration on this host (not available here)"),
    ],
)  # fmt: skip
def test_bad_input_names_the_numbers(build, message):
    with pytest.raises(PlannerError) as e:
        build()
    assert message in str(e.value)


def test_calibration_cache_round_trip_and_fit(tmp_path, monkeypatch):
    import platform

    import torch

    from shardwise.bench import calibrate

    cal = Calibration(**{**FAKE.__dict__, "host": platform.node() or "localhost", "torch": torch.__version__})
    cal.devices = calibrate._cores()
    path = tmp_path / "calibration.json"
    path.write_text(cal.to_json())
    monkeypatch.setattr(calibrate, "calibrate", lambda **kw: pytest.fail("must not measure: the cache is valid"))
    assert load_calibration(path=path).links == cal.links
    c = load_calibration(path=path).cluster("mpi")
    assert c.intra.latency_us == 6.0 and c.shared_memory and "gloo" in c.other_links
    # time = 50 us + n / 2 GB/s, recovered from its own points
    lat, bw = fit_link([(n, 50e-6 + n / 2e9) for n in (4096, 65536, 1 << 20, 4 << 20)])
    assert lat == pytest.approx(50, rel=1e-6) and bw == pytest.approx(2, rel=1e-6)


def test_calibration_carries_extra_after_compute_and_refreshes_old_files(tmp_path, monkeypatch):
    import json
    import platform

    import torch

    from shardwise.bench import calibrate

    gloo = {**FAKE.links["gloo"], "after_compute": [{"burst_us": 100.0, "extra_us": 200.0},
                                                    {"burst_us": 1000.0, "extra_us": 500.0}]}  # fmt: skip
    cal = Calibration(**{**FAKE.__dict__, "links": {**FAKE.links, "gloo": gloo}})
    flat = [x for pt in cal.cluster("gloo").intra.after_compute for x in pt]  # (burst s, extra s) points
    assert flat == pytest.approx([1e-4, 2e-4, 1e-3, 5e-4])
    assert cal.cluster("gloo").intra.latency_us == 300.0  # the idle figure: the extra depends on the burst
    assert cal.cluster("mpi").intra.after_compute == ()
    # a file from before the step-level probe (no version) is measured again
    old = {**json.loads(cal.to_json()), "host": platform.node() or "localhost", "torch": torch.__version__}
    old["devices"] = calibrate._cores()
    del old["version"]
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps(old))
    monkeypatch.setattr(calibrate, "calibrate", lambda **kw: cal)
    assert load_calibration(path=path) is cal


def test_text_and_plot(tmp_path):
    p = plan("llama-3-70b", "dgx-a100-80gb", InferenceWorkload(batch=8))
    text = render_text(p, top=3)
    assert "> tp=2 pp=1 dp=4" in text and "all_reduce/tp x161" in text and "more layouts" in text
    out = tmp_path / "p.png"
    plot(p, str(out))
    assert out.read_bytes()[:4] == b"\x89PNG"


def test_calibration_carries_the_training_terms():
    from shardwise.bench.calibrate import VERSION

    measured = dict(train_efficiency=0.8, train_layer_overhead_us=500.0, train_step_overhead_us=400.0,
                    train_tp_layer_overhead_us=700.0, train_tp_step_overhead_us=450.0, train_unsplit_ns=30.0,
                    busy_train=0.9, optimizer_gbps=6.0)  # fmt: skip
    cal = Calibration(**{**FAKE.__dict__, **measured})
    d = cal.cluster("gloo").device
    assert {k: getattr(d, k) for k in measured} == measured
    assert Calibration.from_json(cal.to_json()).cluster().device == d
    assert VERSION >= 20  # files without the training terms (version 2; a shard's, 19) are measured again
    assert FAKE.cluster().device.train_layer_overhead_us is None  # not measured: the decode overheads


def test_an_uneven_tp_is_recommended_where_it_wins_and_says_what_it_costs():
    # Qwen2-7B: 28 query heads / 4 KV heads, so 8 devices split it unevenly (4 or 3 heads a rank)
    wl = InferenceWorkload(prompt_len=2048, output_len=256, target_latency_ms=815)
    p = plan("qwen2-7b", "dgx-h100", wl)
    best = p.recommended
    assert best.layout.tp == 8 and not best.balance.even and best.balance.heads == (4, 3) * 4
    evens = [c for c in p.candidates if c.fits and c.runnable and (c.balance is None or c.balance.even)]
    assert evens and all(best.time_s < c.time_s for c in evens), "an uneven tp must beat every fitting even one"
    text = render_text(p)
    assert "tp=8 does not divide the 28 query heads: query heads 4/3/4/3/4/3/4/3 per rank" in text
    assert "(uneven: 4/3 heads per rank)" in text
    row = next(c for c in to_json(p)["layouts"] if c["layout"] == best.layout.arg())
    assert row["uneven"]["query_heads"] == [4, 3] * 4 and row["uneven"]["outrun"] is False


def test_an_uneven_tp_that_fits_on_fewer_devices_but_is_slower_is_not_recommended():
    p = plan("llama-3-70b", "pcie-8x-rtx4090")  # 64 heads: tp=7 fits (10/9 heads a rank), tp=8 is faster
    seven = next(c for c in p.candidates if c.layout.tp == 7 and c.layout.pp == 1)
    assert seven.fits and seven.outrun and seven.time_s > p.recommended.time_s
    assert p.recommended.layout.tp == 8
    assert "tp=7 would fit on fewer devices but splits unevenly" in render_text(p)


def test_uneven_memory_is_the_busiest_ranks():
    from shardwise.planner.footprint import layer_params

    cfg = model_preset("qwen2-7b")
    total = layer_params(cfg, 1)[1]
    # tp=8: the busiest rank holds 4 of 28 query heads, 1 KV head, 1/8 of the MLP (18944 = 8 x 2368)
    hd, h = cfg.head_dim, cfg.hidden_size
    busiest = (4 + 2 * 1) * hd * h + 4 * hd * h + 3 * 2368 * h
    assert layer_params(cfg, 8)[1] == busiest and busiest > total / 8
