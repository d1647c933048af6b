"""The planner on hosts joined by links: a shaped link's bytes beyond its bucket, the
shared-memory all-reduce under gloo inside a host, gloo across a veth between hosts
(Calibration.hosts), the wire format across them, and what it recommends for 2 hosts. Fake
calibration data: nothing here depends on how fast this machine is."""

from __future__ import annotations

import pytest

from shardwise.bench.calibrate import Calibration
from shardwise.planner import InferenceWorkload, customize, model_preset, recommend
from shardwise.planner.predict import Layout, predict_inference, tp_wire
from shardwise.planner.specs import Link


def _link(latency_us: float, big_us: float, send_us: float | None = None) -> dict:
    pts = [{"size_bytes": 4096, "latency_us": latency_us}, {"size_bytes": 1 << 20, "latency_us": big_us}]
    return {"latency_us": latency_us, "busbw_gbps": 1.0, "points": pts, "send_us": send_us}


CAL = Calibration(
    host="fake", torch="0", devices=2, memory_gib=16.0, gemm_tflops={"float32": 0.05, "bfloat16": 0.1},
    mem_gbps=10.0, layer_overhead_us=200.0, step_overhead_us=200.0,
    links={"gloo": _link(300.0, 1300.0, 150.0), "shm": _link(20.0, 400.0), "veth": _link(700.0, 2500.0, 350.0)},
    created="fake",
)  # fmt: skip


def test_a_shaped_link_waits_for_the_bytes_beyond_its_bucket():
    base = Link("veth", 1.0, 700.0, ((4096, 700e-6), (1 << 20, 2500e-6)), send_us=350.0)
    slow = base.shaped(0.0125, 12500)  # 100 Mbit/s, a 1 ms bucket
    assert slow.all_reduce_s(4096, 2) == base.all_reduce_s(4096, 2)  # inside the bucket: the link's own cost
    big = 1 << 20
    assert slow.all_reduce_s(big, 2) == pytest.approx(2500e-6 + (big - 12500) / 12.5e6)
    assert slow.send_s(big) == pytest.approx(base.send_s(big) + (big - 12500) / 12.5e6)
    assert base.send_s(0) == pytest.approx(350e-6)  # a message's own time, not the all-reduce's
    line = base.shaped(0.0125)  # a line rate: every byte at the rate
    assert line.all_gather_s(4096, 2) == pytest.approx(base.all_gather_s(4096, 2) + 4096 / 12.5e6)


def test_inside_a_host_small_collectives_go_through_shared_memory_the_rest_through_gloo():
    intra = CAL.cluster().intra
    assert intra.carrier("all_reduce", 4096).name == "shm over gloo (measured)"
    assert intra.carrier("all_reduce", 8 << 20).name == "gloo (measured)"  # beyond the 4 MiB segment
    assert intra.carrier("all_gather", 4096).name == "shm over gloo (measured)"  # gathers and broadcasts too
    assert intra.carrier("all_to_all", 4096).name == "gloo (measured)"
    assert CAL.cluster(shm=False).intra.name == "gloo (measured)"
    no_shm = Calibration(**{**CAL.__dict__, "links": {"gloo": CAL.links["gloo"]}})
    assert no_shm.cluster().intra.name == "gloo (measured)"  # an older calibration: gloo alone


def test_hosts_joined_by_a_shaped_veth():
    cl = CAL.hosts(2, 2, rate_gbps=0.0125, bucket_bytes=12500)
    assert (cl.devices, cl.devices_per_node, cl.nodes) == (4, 2, 2)
    assert cl.link_for(2) is cl.intra and cl.link_for(4) is cl.inter
    assert cl.inter.send_us == 350.0 and cl.inter.rate_gbps == 0.0125
    with pytest.raises(Exception, match="backend 'veth' has no calibration on this host"):
        Calibration(**{**CAL.__dict__, "links": {"gloo": CAL.links["gloo"]}}).hosts(2, 1)
    # the command line's --inter-gbps on a measured link keeps its per-message costs, sets the rate
    fast = customize(cl, inter_gbps=1.25)
    assert fast.inter.rate_gbps == 1.25 and fast.inter.points == cl.inter.points


def test_tp_across_the_link_pays_its_messages_pp_one_send():
    cfg = model_preset("bench-156m")
    kw = dict(batch=1, prompt_len=16, output_len=40, width=4, dtype="float32")
    one = predict_inference(cfg, CAL.hosts(1, 2), Layout(2, 1, 1), **kw)
    across = predict_inference(cfg, CAL.hosts(2, 1, rate_gbps=0.0125, bucket_bytes=12500), Layout(2, 1, 1), **kw)
    pp = predict_inference(cfg, CAL.hosts(2, 1, rate_gbps=0.0125, bucket_bytes=12500), Layout(1, 2, 1), **kw)
    calls = sum(c.calls for c in across.collectives if c.op == "all_reduce")
    assert calls == 2 * cfg.num_layers + 1
    # every all-reduce pays the veth's 700 us instead of shared memory's 20
    ar = [sum(c.seconds for c in p.collectives if c.op == "all_reduce") for p in (across, one)]
    assert ar[0] - ar[1] == pytest.approx(calls * 680e-6, rel=0.05)
    sends = [c for c in pp.collectives if c.op == "send"]
    assert [c.calls for c in sends] == [1] and sends[0].seconds == pytest.approx(350e-6 + 1024 * 4 / 1e9, rel=0.01)
    assert pp.decode.comm_s < across.decode.comm_s / 5  # one send (and the token back) against 17 all-reduces


def test_the_wire_across_hosts_is_compressed_only_where_the_bytes_cost_more_than_the_messages():
    slow = CAL.hosts(2, 1, rate_gbps=0.0125)
    fast = CAL.hosts(2, 1, rate_gbps=1.25)
    assert tp_wire("auto", slow, 2, 64 * 1024) == "q8"  # 256 KiB an all-reduce at 100 Mbit/s
    assert tp_wire("auto", fast, 2, 1024) == "fp32"  # 4 KiB at 10 Gbit/s: two messages cost more
    assert tp_wire("auto", CAL.hosts(1, 2), 2, 64 * 1024) == "fp32"  # inside a host: never
    assert tp_wire("bf16", fast, 2, 1024) == "bf16"  # asked for


def _two_hosts(rate_gbps: float):
    # llama-3-8b in bf16 (16 GB) needs 4 of these devices (7 GiB each); 32 sequences a step
    wl = InferenceWorkload(batch=32, prompt_len=64, output_len=16)
    rec = recommend("llama-3-8b", model_preset("llama-3-8b"), wl, CAL.hosts(2, 2, rate_gbps=rate_gbps),
                    allow_cross_node_tp=True)  # fmt: skip
    line = next(x for x in rec.explanation if x.startswith("Across nodes:"))
    cross = next(c for c in rec.candidates if (c.layout.tp, c.layout.pp) == (4, 1))
    return rec.recommended.layout, line, cross


def test_a_slow_link_gets_tp_inside_the_hosts_pp_across_and_the_reason_weighs_compression():
    lay, line, cross = _two_hosts(0.0125)  # 100 Mbit/s
    assert (lay.tp, lay.pp) == (2, 2)
    assert "tp inside a node, the pipeline across the nodes" in line
    assert "compressed to q8" in line and "still loses to tp=2 pp=2" in line, line
    assert cross.cross_node_tp and cross.inference.wire == "q8"


def test_a_fast_link_with_slow_devices_gets_tp_across_the_hosts_uncompressed():
    lay, line, cross = _two_hosts(1.25)  # 10 Gbit/s: the compute dominates, the link is cheap
    assert (lay.tp, lay.pp) == (4, 1)
    assert "its tp group crosses the nodes" in line and "would not be faster" in line, line
    assert cross.inference.wire == "fp32"


def test_between_them_tp_across_the_hosts_compressed_to_q8_wins():
    lay, line, cross = _two_hosts(0.025)  # 200 Mbit/s: pp across loses, tp across wins with q8 on the wire
    assert (lay.tp, lay.pp) == (4, 1)
    assert cross.inference.wire == "q8"
    assert "compressed to q8" in line and "which is the layout recommended" in line, line
