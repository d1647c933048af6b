"""The planner prices a decode step by the path it takes: its layers as one native call
(shardwise.kernels.step) where that runs, with the tp all-reduces in C over the shared memory,
and op by op elsewhere (across hosts, a model the native step does not run, --quantize), with
each collective at what it was measured to cost inside a decode step on that link. Fake
calibration data: nothing here depends on how fast this machine is."""

from __future__ import annotations

import dataclasses

import pytest

from shardwise.bench.calibrate import Calibration
from shardwise.bench.hostlinks import _decode_record
from shardwise.planner import model_preset
from shardwise.planner.predict import Layout, native_step_runs, predict_inference
from shardwise.planner.specs import Link, PlannerError


def _link(latency_us: float, big_us: float, send_us: float | None = None, **extra) -> dict:
    pts = [{"size_bytes": 4096, "latency_us": latency_us}, {"size_bytes": 1 << 20, "latency_us": big_us}]
    return {"latency_us": latency_us, "busbw_gbps": 1.0, "points": pts, "send_us": send_us, **extra}


def _decode(us: dict[str, float]) -> list[dict]:
    return [{"op": op, "bytes": 256.0, "us": v, "burst_us": 20.0} for op, v in us.items()]


SHM = _link(20.0, 400.0, decode=_decode({"all_reduce": 9.0, "all_gather": 12.0, "broadcast": 10.0}),
            native_all_reduce={"bytes": 256.0, "us": 2.0})  # fmt: skip
VETH = _link(300.0, 2500.0, 80.0, decode=_decode({"all_reduce": 1000.0, "all_gather": 900.0, "broadcast": 800.0}))
CAL = Calibration(
    host="fake", torch="0", devices=2, memory_gib=16.0, gemm_tflops={"float32": 0.1}, mem_gbps=10.0,
    layer_overhead_us=80.0, step_overhead_us=100.0, native_layer_overhead_us=10.0, native_step_overhead_us=60.0,
    links={"gloo": _link(300.0, 1300.0, 70.0), "shm": SHM, "veth": VETH}, created="fake",
)  # fmt: skip
KW = dict(batch=1, prompt_len=16, output_len=40, width=4, dtype="float32")


def _cfg():
    return dataclasses.replace(model_preset("bench-156m"), num_layers=4)


def test_the_calibration_carries_the_decode_figures_to_the_links():
    shm = CAL.link("shm")
    assert shm.native_all_reduce == pytest.approx((256.0, 2e-6))
    assert shm.decode_s("all_reduce", 256, 2) == pytest.approx(9e-6)
    assert shm.decode_s("all_reduce", 256, 2, native=True) == pytest.approx(2e-6)
    assert shm.decode_s("all_gather", 256, 2, native=True) == pytest.approx(12e-6)  # gathers stay Python calls
    assert CAL.link("gloo").decode_s("all_reduce", 256, 2) is None  # not measured: the old figures price it
    assert shm.decode_s("all_reduce", 256, 4) is None  # measured over 2 ranks only
    dev = CAL.cluster().device
    assert (dev.native_layer_overhead_us, dev.native_step_overhead_us) == (10.0, 60.0)


def test_a_bigger_message_than_the_probes_pays_its_extra_bytes_and_the_shaping():
    veth = CAL.link("veth")
    n = 256 + 1_000_000
    assert veth.decode_s("all_reduce", n, 2) == pytest.approx(1000e-6 + 1_000_000 / 1e9)  # ring: 2 (p-1)/p
    assert veth.decode_s("all_gather", n, 2) == pytest.approx(900e-6 + 1_000_000 / 1e9)
    shaped = veth.shaped(0.0125, 12500)
    assert shaped.decode_s("all_reduce", 256, 2) == veth.decode_s("all_reduce", 256, 2)  # inside the bucket
    assert shaped.decode_s("all_reduce", n, 2) == pytest.approx(
        veth.decode_s("all_reduce", n, 2) + (n - 12500) / 12.5e6
    )


def test_the_decode_probes_records():
    op = {"calls": 9, "bytes": 256.0, "us": 8.0}
    rec = _decode_record({"per_op": {"native": False, "step_us": 1.0, "ops": {"all_reduce": op}},
                          "native": {"native": True, "step_us": 1.0, "ops": {"all_reduce": {**op, "us": 2.0}}}})  # fmt: skip
    # the burst: the step's time less its collectives', over them: (1 us - 9 x 8 us) floored at 0
    assert rec == {"decode": [{"op": "all_reduce", "bytes": 256.0, "us": 8.0, "burst_us": 0.0, "spill_us": 0.0}],
                   "native_all_reduce": {"bytes": 256.0, "us": 2.0, "spill_us": 0.0, "step_us": 1.0,
                                         "inside_us": 18.0, "calls": 9, "layers": 4}}  # fmt: skip
    # with the step alone measured: the native step's time beyond its calls and that, per call, on its all-reduce
    native = {"native": True, "step_us": 100.0, "ops": {"all_reduce": {**op, "us": 2.0}}}
    rec = _decode_record({"alone": {"step_us": 46.0}, "native": native})
    assert rec["native_all_reduce"] == pytest.approx(
        {"bytes": 256.0, "us": 2.0 + 4.0, "spill_us": 4.0, "step_us": 100.0, "inside_us": 18.0, "calls": 9, "layers": 4}
    )  # (100 - 18 - 46) / 9
    refused = {"native": False, "step_us": 1.0, "ops": {"all_reduce": op}}  # the native step did not run
    assert "native_all_reduce" not in _decode_record({"native": refused})
    with pytest.raises(PlannerError, match="decode figures"):
        Link("x", 1.0, 1.0, decode=(("all_reduce", 256.0, 0.0, 0.0),))
    probe = {"native": False, "step_us": 200.0, "ops": {"all_reduce": {"calls": 10, "bytes": 256.0, "us": 10.0}}}
    assert _decode_record({"per_op": probe})["decode"][0]["burst_us"] == pytest.approx(10.0)  # (200 - 100) / 10


def test_a_longer_burst_than_the_decode_probes_adds_only_the_after_compute_probes_growth():
    # decode probe: 1000 us a call after 20 us of compute; the synthetic probe: +0 after 200 us, +400 after 2 ms
    # (its idle 4 KiB level, 3000 us here, is never used: it swings between launches)
    link = Link("veth", 1.0, 300.0, ((4096, 3000e-6), (1 << 20, 4000e-6)), ((200e-6, 0.0), (2e-3, 400e-6)),
                decode=(("all_reduce", 256.0, 1000e-6, 20e-6),))  # fmt: skip
    assert link.decode_s("all_reduce", 256, 2, burst_s=10e-6) == pytest.approx(1000e-6)  # shorter: the probe's
    assert link.decode_s("all_reduce", 256, 2, burst_s=100e-6) == pytest.approx(1000e-6)  # before its first point
    mid = (200e-6 * 2e-3) ** 0.5  # log-linear in the burst between its points
    assert link.decode_s("all_reduce", 256, 2, burst_s=mid) == pytest.approx(1200e-6)
    assert link.decode_s("all_reduce", 256, 2, burst_s=1.0) == pytest.approx(1400e-6)  # beyond: the last point


def test_the_token_broadcast_is_on_a_pipelines_path_every_token():
    cfg = _cfg()
    across = CAL.hosts(2, 1, rate_gbps=1.25, bucket_bytes=125_000)
    p = predict_inference(cfg, across, Layout(1, 2, 1), **KW)
    bc = next(c for c in p.collectives if c.op == "broadcast")
    assert p.stage_s[-1] > bc.seconds  # the last stage samples, then broadcasts (800 us here)
    assert p.decode.total_s == pytest.approx(sum(p.stage_s), rel=1e-6)  # batch 1: one stage at a time


def test_inside_a_host_decode_runs_the_native_step_and_its_all_reduces_in_c():
    cfg, one = _cfg(), CAL.hosts(1, 2)
    assert native_step_runs(cfg, one, 2, tokens=1, batch=1, width=4, quantize=None)
    assert not native_step_runs(cfg, one, 2, tokens=16, batch=1, width=4, quantize=None)  # prefill: op by op
    assert not native_step_runs(cfg, one, 2, tokens=1, batch=1, width=4, quantize="int8")
    assert not native_step_runs(dataclasses.replace(cfg, qk_norm=True), one, 2, tokens=1, batch=1, width=4,
                                quantize=None)  # fmt: skip
    p = predict_inference(cfg, one, Layout(2, 1, 1), **KW)
    ar = next(c for c in p.collectives if c.op == "all_reduce")
    extra = (cfg.hidden_size * 4 - 256) / 1e9  # the bytes beyond the probe's message, at the bus bandwidth
    assert ar.seconds == pytest.approx(ar.calls * (2e-6 + extra), rel=1e-3)  # the native all-reduce's, no more
    off = dataclasses.replace(cfg, qk_norm=True)  # the native step refuses it: op by op
    q = predict_inference(off, one, Layout(2, 1, 1), **KW)
    ar_q = next(c for c in q.collectives if c.op == "all_reduce")
    assert ar_q.seconds == pytest.approx(ar_q.calls * (9e-6 + extra), rel=1e-3)
    # the layers' fixed costs: the native step's against the per-op path's
    fixed = (80.0 - 10.0) * cfg.num_layers + (100.0 - 60.0)
    assert q.decode.compute_s - p.decode.compute_s == pytest.approx(fixed * 1e-6, rel=0.05)


def test_across_hosts_decode_runs_op_by_op_at_the_collectives_measured_in_a_decode_step():
    cfg = _cfg()
    across = CAL.hosts(2, 1, rate_gbps=1.25, bucket_bytes=125_000)
    assert not native_step_runs(cfg, across, 2, tokens=1, batch=1, width=4, quantize=None)
    p = predict_inference(cfg, across, Layout(2, 1, 1), **KW)
    byop = {c.op: c for c in p.collectives}
    act = cfg.hidden_size * 4 - 256  # beyond the probe's message, at the veth's bus bandwidth
    assert byop["all_reduce"].seconds == pytest.approx(byop["all_reduce"].calls * (1000e-6 + act / 1e9), rel=1e-3)
    # greedy: the choice's all-gather (16 bytes) at the decode probe's all-gather, and no token broadcast
    assert byop["all_gather"].bytes == 16 and "broadcast" not in byop
    assert byop["all_gather"].seconds == pytest.approx(900e-6, rel=1e-3)
    # pp=2 across: each stage's layers in one native call (tp=1), the token broadcast at the veth's decode figure
    pp = predict_inference(cfg, across, Layout(1, 2, 1), **KW)
    assert native_step_runs(cfg, across, 1, tokens=1, batch=1, width=4, quantize=None)
    assert next(c for c in pp.collectives if c.op == "broadcast").seconds == pytest.approx(800e-6, rel=1e-3)


def test_an_older_calibration_prices_decode_as_before():
    old = Calibration(**{**CAL.__dict__, "native_layer_overhead_us": None, "native_step_overhead_us": None,
                         "links": {k: {x: y for x, y in v.items() if x not in ("decode", "native_all_reduce")}
                                   for k, v in CAL.links.items()}})  # fmt: skip
    cfg = _cfg()
    assert not native_step_runs(cfg, old.hosts(1, 2), 2, tokens=1, batch=1, width=4, quantize=None)
    p = predict_inference(cfg, old.hosts(1, 2), Layout(2, 1, 1), **KW)
    ar = next(c for c in p.collectives if c.op == "all_reduce")
    assert ar.seconds > ar.calls * 15e-6  # the shared memory's idle 4 KiB figure (20 us), not a decode one


def test_a_pipelines_decode_messages_are_priced_as_its_measured_hop():
    # pp=2: the stages take turns, so the hidden state's send and the token's broadcast are a
    # ping-pong; the calibration's pipeline step (measure.pipeline_step_rank) prices each message
    probe = {"bytes": 256, "hop_us": 250.0, "step_us": 700.0, "alone_us": 200.0}
    assert _decode_record({"pp": probe})["decode_hop"] == [probe]
    veth = {**VETH, "decode_hop": [probe]}  # before v21: one probe, its idle not recorded
    cal = dataclasses.replace(CAL, links={**CAL.links, "veth": veth})
    cfg = _cfg()
    across = cal.hosts(2, 1, rate_gbps=1.25, bucket_bytes=125_000)
    assert len(across.inter.decode_hop) == 1 and across.inter.decode_hop[0] == pytest.approx((0.0, 256, 250e-6))
    p = predict_inference(cfg, across, Layout(1, 2, 1), **KW)
    byop = {c.op: c for c in p.collectives}
    beyond = (cfg.hidden_size * 4 - 256) / 1e9  # the hidden state's bytes beyond the probe's, at the bus bandwidth
    assert byop["send"].seconds == pytest.approx(250e-6 + beyond, rel=1e-6)
    # not the tp step's broadcast (800 us); 8 bytes, 248 fewer than the probe's message
    assert byop["broadcast"].seconds == pytest.approx(250e-6 - 248 / 1e9, rel=1e-6)
    # without the figure (an older calibration): the idle send plus the after-compute extra, the tp broadcast
    old = predict_inference(cfg, CAL.hosts(2, 1, rate_gbps=1.25, bucket_bytes=125_000), Layout(1, 2, 1), **KW)
    old_byop = {c.op: c for c in old.collectives}
    assert old_byop["broadcast"].seconds == pytest.approx(800e-6, rel=1e-3)
    assert p.decode.total_s < old.decode.total_s
    # a tp group broadcasts no token (each rank chose it: engine.argmax); shaping still adds the bytes beyond the bucket
    tp = {c.op: c for c in predict_inference(cfg, across, Layout(2, 1, 1), **KW).collectives}
    assert "broadcast" not in tp
    shaped = cal.link("veth").shaped(1e-3, 0.0)  # 1 MB/s, no bucket
    assert shaped.hop_s(1024) == pytest.approx(250e-6 + 768 / 1e9 + 1024 / 1e6)
    assert CAL.link("veth").hop_s(1024) is None
    with pytest.raises(PlannerError, match="decode_hop"):
        Link("x", 1.0, 1.0, decode_hop=((0.0, 256.0, 0.0),))


def test_a_pipeline_message_costs_more_the_longer_its_receiver_waited():
    # v21: the pipeline probe at three stage sizes; a rank that waited longer resumes slower
    probes = [{"bytes": b, "hop_us": h, "step_us": 2 * h + 2 * i, "alone_us": 2 * i, "idle_us": i}
              for b, h, i in ((1024, 1400.0, 600.0), (256, 700.0, 300.0), (2048, 1800.0, 4000.0))]  # fmt: skip
    rec = _decode_record({k: p for k, p in zip(("pp_256", "pp", "pp_512"), probes, strict=True)})["decode_hop"]
    assert [h["idle_us"] for h in rec] == [300.0, 600.0, 4000.0]  # by idle
    link = dataclasses.replace(CAL, links={**CAL.links, "veth": {**VETH, "decode_hop": rec}}).link("veth")
    want = ((300e-6, 256, 700e-6), (600e-6, 1024, 1400e-6), (4000e-6, 2048, 1800e-6))
    assert [pytest.approx(w) for w in want] == list(link.decode_hop)
    bw = 1e9  # VETH's bus bandwidth: each point's bytes come off its fixed part, the message's go on
    assert link.hop_s(256, 300e-6) == pytest.approx(700e-6)
    assert link.hop_s(1024, 600e-6) == pytest.approx(1400e-6)
    assert link.hop_s(256, 100e-6) == pytest.approx(700e-6)  # below the shortest wait: its figure
    assert link.hop_s(2048, 1.0) == pytest.approx(1800e-6)  # beyond the longest: its figure
    noisy = dataclasses.replace(link, decode_hop=(*link.decode_hop[:2], (4000e-6, 2048, 500e-6)))
    assert noisy.hop_s(1024, 1.0) == pytest.approx(1400e-6)  # never cheaper after a longer wait
    mid = link.hop_s(0, (300e-6 * 600e-6) ** 0.5)  # half way in log(idle)
    assert mid == pytest.approx((700e-6 - 256 / bw + 1400e-6 - 1024 / bw) / 2)
    # the planner: each message at its receiver's wait, the other stage's compute
    cfg = _cfg()
    rec = [{"bytes": 256, "hop_us": h, "idle_us": i} for h, i in ((500.0, 1e3), (1000.0, 1e4), (2000.0, 1e5))]
    cal = dataclasses.replace(CAL, links={**CAL.links, "veth": {**VETH, "decode_hop": rec}})
    across = cal.hosts(2, 1, rate_gbps=1.25, bucket_bytes=125_000)
    p = predict_inference(cfg, across, Layout(1, 2, 1), **KW)
    byop = {c.op: c for c in p.collectives}
    first, last = (s - c for s, c in zip(p.stage_s, (byop["send"].seconds, byop["broadcast"].seconds), strict=True))
    assert byop["send"].seconds == pytest.approx(across.inter.hop_s(cfg.hidden_size * 4, first), rel=1e-6)
    assert byop["broadcast"].seconds == pytest.approx(across.inter.hop_s(8, last), rel=1e-6)
    # a smaller stage: a shorter wait, a cheaper message (here, both within the probes' waits)
    small = dataclasses.replace(cfg, vocab_size=1024, num_layers=2)
    short = predict_inference(small, across, Layout(1, 2, 1), **KW)
    assert 1e-3 < short.stage_s[1] < p.stage_s[1] < 0.1, (short.stage_s, p.stage_s)
    assert {c.op: c for c in short.collectives}["broadcast"].seconds < byop["broadcast"].seconds


def test_the_veths_probes_are_the_median_launch_not_the_fastest():
    # gloo across the veth runs fast or slow per launch: the calibration keeps the median launch
    from shardwise.bench.hostlinks import _median, _record

    def launch(idle_us: float, step_us: float, hop_us: float) -> dict:
        pts = [{"burst_us": 100.0, "per_call_us": idle_us * 1.5}]
        op = {"calls": 9, "bytes": 256.0, "us": step_us / 12}
        return {"idle": [(4096, idle_us * 1e-6), (1 << 20, 2 * idle_us * 1e-6)], "after": pts, "after_big": pts,
                "send_us": hop_us / 2, "decode": {"per_op": {"step_us": step_us, "ops": {"all_reduce": op}},
                                                  "pp": {"bytes": 256, "hop_us": hop_us, "step_us": 2 * hop_us + 200,
                                                         "alone_us": 200.0}}}  # fmt: skip

    outs = [launch(500.0, 12000.0, 250.0), launch(2200.0, 20000.0, 400.0), launch(600.0, 18000.0, 300.0)]
    m = _median(outs)
    assert m["idle"][0] == (4096, pytest.approx(600e-6)) and m["send_us"] == 150.0
    assert m["after"][0]["per_call_us"] == 900.0
    assert m["decode"]["per_op"]["step_us"] == 18000.0 and m["decode"]["pp"]["hop_us"] == 300.0
    rec = _record(m)
    assert rec["launches"] == 3 and rec["per_launch"]["idle_4k_us"] == pytest.approx([500.0, 2200.0, 600.0])
    assert rec["decode_hop"][0]["hop_us"] == 300.0 and rec["points"][0]["latency_us"] == pytest.approx(600.0)


def test_across_hosts_over_tcp_decode_runs_the_native_step_unless_the_wire_is_encoded():
    # calibration v15: the veth's native decode probe ran (the step hands each all-reduce to comm.tcp)
    veth = {**VETH, "native_all_reduce": {"bytes": 256.0, "us": 150.0}}
    cal = dataclasses.replace(CAL, links={**CAL.links, "veth": veth})
    cfg, across = _cfg(), cal.hosts(2, 1, rate_gbps=1.25, bucket_bytes=125_000)
    assert native_step_runs(cfg, across, 2, tokens=1, batch=1, width=4, quantize=None)
    p = predict_inference(cfg, across, Layout(2, 1, 1), **KW)
    ar = next(c for c in p.collectives if c.op == "all_reduce")
    extra = (cfg.hidden_size * 4 - 256) / 1e9
    assert ar.seconds == pytest.approx(ar.calls * (150e-6 + extra), rel=1e-3)  # the native step's all-reduce
    # --comm-dtype q8: the native step all-reduces fp32 only, so the layers run op by op
    q8 = predict_inference(cfg, across, Layout(2, 1, 1), **KW, comm_dtype="q8")
    op_by_op = predict_inference(cfg, CAL.hosts(2, 1, rate_gbps=1.25, bucket_bytes=125_000), Layout(2, 1, 1), **KW)
    fixed = (80.0 - 10.0) * cfg.num_layers + (100.0 - 60.0)
    assert q8.decode.compute_s == pytest.approx(op_by_op.decode.compute_s, rel=1e-6)
    assert q8.decode.compute_s - p.decode.compute_s == pytest.approx(fixed * 1e-6, rel=0.05)


def test_a_tp_groups_rank_pays_its_own_native_fixed_times():
    # v21: the native step's fixed times measured on a rank of a tp=2 group inside the host
    # (measure.decode_shard_rank, its collectives' calls taken out) price tp > 1; tp=1 keeps one core's
    cfg = _cfg()
    tp_cal = dataclasses.replace(CAL, native_tp_layer_overhead_us=25.0, native_tp_step_overhead_us=200.0)
    dev = tp_cal.cluster().device
    assert dev.native_overheads_us(1) == (10.0, 60.0) and dev.native_overheads_us(2) == (25.0, 200.0)
    assert CAL.cluster().device.native_overheads_us(2) == (10.0, 60.0)  # not measured: one core's
    for tp, extra in ((1, 0.0), (2, (200.0 - 60.0 + cfg.num_layers * (25.0 - 10.0)) * 1e-6)):
        before = predict_inference(cfg, CAL.hosts(1, 2), Layout(tp, 1, 1), **KW).decode
        after = predict_inference(cfg, tp_cal.hosts(1, 2), Layout(tp, 1, 1), **KW).decode
        assert after.compute_s - before.compute_s == pytest.approx(extra, abs=1e-12), tp
        assert after.comm_s == pytest.approx(before.comm_s), tp
    with pytest.raises(PlannerError, match="native_tp_step_overhead_us"):
        dataclasses.replace(dev, native_tp_step_overhead_us=-1.0)


def test_the_calibration_measures_a_tp_ranks_native_fixed_times(monkeypatch):
    # _native_step_overheads: one core's at 1 and 5 layers, then a tp=2 rank's (2 cores), each
    # the faster launch's step less its collectives' calls
    import shardwise.bench.calibrate as calibrate
    import shardwise.launch as launch_mod

    def fake(fn, ranks, args=()):
        layers = args[0]["layers"]
        fixed = {1: (400.0, 800.0), 5: (440.0, 1000.0)}[layers][ranks - 1]
        return [{"native": True, "step_us": fixed + 100.0 * (ranks - 1), "fixed_us": fixed, "ops": {}}]

    monkeypatch.setattr(launch_mod, "launch", fake)
    got = calibrate._native_step_overheads(lambda m: None, lambda: None, 2)
    assert got == pytest.approx({"native_layer_overhead_us": 10.0, "native_step_overhead_us": 390.0,
                                 "native_tp_layer_overhead_us": 50.0, "native_tp_step_overhead_us": 750.0})  # fmt: skip
    one = calibrate._native_step_overheads(lambda m: None, lambda: None, 1)
    assert set(one) == {"native_layer_overhead_us", "native_step_overhead_us"}


def test_the_native_all_reduce_carries_what_the_step_took_beyond_a_tp_ranks_fixed_times():
    # v21: the probe's native step less its collectives' calls and a tp rank's fixed times at its
    # layers, shared among the calls (across hosts the step stops and resumes at each all-reduce)
    native = {"bytes": 256.0, "us": 150.0, "spill_us": 0.0, "step_us": 2700.0, "inside_us": 1720.0, "calls": 10,
              "layers": 4}  # fmt: skip
    links = {**CAL.links, "veth": {**VETH, "native_all_reduce": native}}
    cal = dataclasses.replace(CAL, links=links, native_tp_step_overhead_us=700.0, native_tp_layer_overhead_us=10.0)
    beyond = 2700.0 - 1720.0 - 700.0 - 4 * 10.0  # 240 us over 10 calls
    assert cal.link("veth").native_all_reduce == pytest.approx((256.0, (150.0 + beyond / 10) * 1e-6))
    # nothing beyond: the call alone; no tp figures or an older record: the figure as recorded
    fast = dataclasses.replace(cal, native_tp_step_overhead_us=2000.0)
    assert fast.link("veth").native_all_reduce == pytest.approx((256.0, 150e-6))
    older = dataclasses.replace(
        CAL, links={**CAL.links, "veth": {**VETH, "native_all_reduce": {"bytes": 256.0, "us": 170.0}}}
    )
    assert older.link("veth").native_all_reduce == pytest.approx((256.0, 170e-6))
    assert dataclasses.replace(cal, native_tp_step_overhead_us=None).link("veth").native_all_reduce[1] == 150e-6
