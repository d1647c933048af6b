"""A decode step across hosts, priced from what its probe measured (shardwise.bench.hostlinks):
each collective's mean call plus its share of the step's spill (the compute outside the
collectives running slower than the same step alone), the q8 wire's all-reduces from its own
decode step (an all_to_all and an all_gather of 8-bit blocks), and the weights of a small
model streamed from the last-level cache when they fit in it. Fake calibration data."""

from __future__ import annotations

import dataclasses

import pytest

from shardwise.bench.calibrate import Calibration
from shardwise.bench.hostlinks import _decode_record
from shardwise.planner import model_preset
from shardwise.planner.predict import Layout, predict_inference
from shardwise.planner.specs import Device, Link
from shardwise.planner.wire import CODEC_NS, CODEC_US, encoded_decode_s


def _probe(step_us: float, ops: dict[str, tuple[int, float]]) -> dict:
    return {"native": False, "step_us": step_us,
            "ops": {op: {"calls": n, "bytes": 256.0, "us": us} for op, (n, us) in ops.items()}}  # fmt: skip


def test_the_record_adds_the_steps_spill_to_every_call_and_keeps_the_q8_wires_ops_apart():
    alone = _probe(500.0, {})
    per_op = _probe(12_000.0, {"all_reduce": (9, 1000.0), "all_gather": (1, 900.0), "broadcast": (1, 600.0)})
    q8 = _probe(20_000.0, {"all_to_all": (9, 800.0), "all_gather": (10, 900.0), "broadcast": (1, 600.0)})
    rec = {d["op"]: d for d in _decode_record({"alone": alone, "per_op": per_op, "q8": q8})["decode"]}
    # per-op: 12000 - (9000 + 900 + 600) inside - 500 alone = 1000 us of spill over 11 calls
    spill = 1000.0 / 11
    assert rec["all_reduce"]["us"] == pytest.approx(1000.0 + spill)
    assert rec["broadcast"]["spill_us"] == pytest.approx(spill)
    assert rec["all_reduce"]["burst_us"] == pytest.approx(500.0 / 11)  # the step alone, between its calls
    # q8: 20000 - (7200 + 9000 + 600) - 500 - the encoding of its 9 all-reduces (the planner adds it)
    q8_spill = (20_000.0 - 16_800.0 - 500.0 - 9 * CODEC_US["q8"]) / 20
    assert rec["q8 all_to_all"]["us"] == pytest.approx(800.0 + q8_spill)
    assert rec["q8 all_gather"]["us"] == pytest.approx(900.0 + q8_spill)
    # without the step alone (an older probe): the burst is the step less its calls, no spill
    old = {d["op"]: d for d in _decode_record({"per_op": per_op})["decode"]}
    assert old["all_reduce"]["us"] == 1000.0 and old["all_reduce"]["burst_us"] == pytest.approx(1500.0 / 11)


VETH_DECODE = (("all_reduce", 256.0, 1000e-6, 20e-6), ("all_gather", 256.0, 900e-6, 20e-6),
               ("broadcast", 8.0, 600e-6, 20e-6), ("q8 all_to_all", 72.0, 700e-6, 20e-6),
               ("q8 all_gather", 36.0, 800e-6, 20e-6))  # fmt: skip


def test_a_q8_all_reduce_in_a_decode_step_is_its_two_measured_messages_and_the_codec():
    link = Link("veth", 1.0, 300.0, ((4096, 300e-6), (1 << 20, 2500e-6)), decode=VETH_DECODE)
    values = 64  # the probe's size: no extra bytes
    want = 700e-6 + 800e-6 + (CODEC_US["q8"] + values * CODEC_NS["q8"] * 1e-3) * 1e-6
    assert encoded_decode_s(link, values, 2, "q8", 0.0) == pytest.approx(want)
    assert encoded_decode_s(dataclasses.replace(link, decode=VETH_DECODE[:3]), values, 2, "q8", 0.0) is None


def _cal(links: dict | None = None, **extra) -> Calibration:
    pts = [{"size_bytes": 4096, "latency_us": 300.0}, {"size_bytes": 1 << 20, "latency_us": 2500.0}]
    veth = {"latency_us": 300.0, "busbw_gbps": 1.0, "points": pts, "send_us": 80.0,
            "decode": [{"op": o, "bytes": n, "us": s * 1e6, "burst_us": b * 1e6} for o, n, s, b in VETH_DECODE]}  # fmt: skip
    return Calibration(host="fake", torch="0", devices=2, memory_gib=16.0, gemm_tflops={"float32": 0.1},
                       mem_gbps=10.0, layer_overhead_us=80.0, step_overhead_us=100.0,
                       links=links or {"gloo": {**veth, "decode": []}, "veth": veth}, created="fake", **extra)  # fmt: skip


def test_the_planner_prices_a_q8_decode_step_across_hosts_from_the_q8_probe():
    cfg = dataclasses.replace(model_preset("bench-156m"), num_layers=4)
    across = _cal().hosts(2, 1, rate_gbps=1.25, bucket_bytes=125_000)
    kw = dict(batch=1, prompt_len=16, output_len=40, width=4, dtype="float32")
    p = predict_inference(cfg, across, Layout(2, 1, 1), comm_dtype="q8", **kw)
    ar = next(c for c in p.collectives if c.op == "all_reduce")
    link = across.inter.carrier("all_gather", cfg.hidden_size * 4)
    burst = p.decode.compute_s / sum(c.calls for c in p.collectives)
    assert ar.wire == "q8"
    assert ar.seconds == pytest.approx(ar.calls * encoded_decode_s(link, cfg.hidden_size, 2, "q8", burst), rel=1e-6)
    assert ar.seconds / ar.calls > 1.5e-3  # two messages, each near its measured 0.7-0.8 ms


def test_weights_that_fit_in_the_last_level_cache_stream_at_its_rate():
    dev = Device("cpu", 16.0, {"float32": 0.1}, 10.0, 1.0, 1.0, cache_gbps=40.0, busy_cache=0.5,
                 cache_bytes=32 * 2**20)  # fmt: skip
    assert dev.stream_bytes_per_s(8 * 2**20) == pytest.approx(40e9)
    assert dev.stream_bytes_per_s(8 * 2**20, busy=True) == pytest.approx(20e9)
    assert dev.stream_bytes_per_s(64 * 2**20) == pytest.approx(10e9)  # beyond it: memory
    assert Device("cpu", 16.0, {"float32": 0.1}, 10.0, 1.0, 1.0).stream_bytes_per_s(1.0) == pytest.approx(10e9)
    # the planner: a small model's decode step at tp=2 inside a host (both ranks' weights in the cache)
    small = dataclasses.replace(model_preset("bench-156m"), num_layers=1, hidden_size=256, intermediate_size=512,
                                vocab_size=512, num_heads=4, num_kv_heads=2, head_dim=64)  # fmt: skip
    kw = dict(batch=1, prompt_len=16, output_len=40, width=4, dtype="float32")
    slow = predict_inference(small, _cal().hosts(1, 2), Layout(2, 1, 1), **kw)
    fast = predict_inference(small, _cal(cache_gbps=100.0, cache_bytes=32 * 2**20).hosts(1, 2), Layout(2, 1, 1), **kw)
    assert fast.decode.compute_s < slow.decode.compute_s
    big = predict_inference(small, _cal(cache_gbps=100.0, cache_bytes=1024).hosts(1, 2), Layout(2, 1, 1), **kw)
    assert big.decode.compute_s == pytest.approx(slow.decode.compute_s)  # does not fit: from memory


def test_a_slow_small_idle_figure_does_not_set_the_links_small_messages_or_its_extras():
    from shardwise.bench.fits import monotone_times

    assert monotone_times([(4096, 2.2e-3), (16384, 0.5e-3), (65536, 0.48e-3), (262144, 0.7e-3)]) == [
        (4096, 0.48e-3), (16384, 0.48e-3), (65536, 0.48e-3), (262144, 0.7e-3)]  # fmt: skip
    pts = [{"size_bytes": 4096, "latency_us": 2200.0}, {"size_bytes": 16384, "latency_us": 500.0}]
    after = [{"burst_us": 200.0, "per_call_us": 900.0, "extra_us": 0.0}, {"burst_us": 2000.0, "extra_us": 50.0}]
    cal = _cal(links={"gloo": {"latency_us": 300.0, "busbw_gbps": 1.0, "points": pts, "after_compute": after}})
    link = cal.link("gloo")
    assert link.all_reduce_s(4096, 2) == pytest.approx(500e-6)
    # the extra against the monotone idle 4 KiB time (900 - 500), the written one where no per-call time is kept
    assert link.after_compute == (pytest.approx((200e-6, 400e-6)), pytest.approx((2000e-6, 50e-6)))


def test_a_big_all_reduces_extra_after_compute_is_its_own_measured_one():
    link = Link("veth", 1.0, 300.0, ((4096, 500e-6), (262144, 700e-6)), ((1e-3, 600e-6),),
                after_compute_big=((1e-3, 2000e-6),), after_big_bytes=262144)  # fmt: skip
    assert link.extra_after_s(1e-3) == pytest.approx(600e-6)  # 4 KiB
    assert link.extra_after_s(1e-3, 262144) == pytest.approx(2000e-6)
    assert link.extra_after_s(1e-3, 4 << 20) == pytest.approx(2000e-6)  # beyond: the big one's
    assert link.extra_after_s(1e-3, 32768) == pytest.approx(600e-6 + 0.5 * 1400e-6)  # log-linear in the size
    assert Link("x", 1.0, 1.0, after_compute=((1e-3, 600e-6),)).extra_after_s(1e-3, 262144) == pytest.approx(600e-6)
    # the calibration: the big probe's extra against the (monotone) idle 256 KiB time
    pts = [{"size_bytes": 4096, "latency_us": 500.0}, {"size_bytes": 262144, "latency_us": 700.0}]
    big = [{"burst_us": 1000.0, "per_call_us": 2700.0, "size_bytes": 262144}]
    cal = _cal(links={"gloo": {"latency_us": 300.0, "busbw_gbps": 1.0, "points": pts, "after_compute_big": big}})
    assert cal.link("gloo").after_compute_big == (pytest.approx((1e-3, 2000e-6)),)
    assert cal.link("gloo").after_big_bytes == 262144
