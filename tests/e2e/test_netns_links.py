"""The calibration's two host paths (shardwise.bench.hostlinks): the shared-memory all-reduce
inside a host and a tp group's collectives across a veth link between namespace hosts (direct
TCP, shardwise.comm.tcp), measured for real, and the planner's hosts built from them. Skipped, with the reason, where namespaces cannot be made."""

from __future__ import annotations

import os
import subprocess

import pytest

from shardwise.bench import netns

WHY = netns.unavailable()
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"no network namespaces here: {WHY}")


def test_shared_memory_and_veth_paths_are_measured_and_make_hosts_for_the_planner():
    from shardwise.bench.calibrate import Calibration
    from shardwise.bench.hostlinks import SIZES, measure_paths

    links, missing = measure_paths(flops=50e9, tries=1, veth_launches=2, log=lambda msg: None)
    assert set(links) == {"shm", "veth"}, missing
    for name, rec in links.items():
        assert [p["size_bytes"] for p in rec["points"]] == SIZES, name
        assert rec["send_us"] > 0 and rec["latency_us"] > 0 and rec["busbw_gbps"] > 0, (name, rec)
        assert [p["size_bytes"] for p in rec["after_compute_big"]] == [262144] * 3, name
        assert rec["after_compute"] and all(p["burst_us"] > 0 and p["extra_us"] >= 0 for p in rec["after_compute"])
    # each path's decode step: its collectives with the step's spill; across hosts the q8 wire's too
    # (greedy: the choice's all-gather, no token broadcast; engine.argmax)
    ops = {name: {d["op"]: d for d in rec["decode"]} for name, rec in links.items()}
    assert {"all_reduce", "all_gather"} <= set(ops["shm"]) and "broadcast" not in ops["shm"]
    assert {"q8 all_to_all", "q8 all_gather"} <= set(ops["veth"]), ops["veth"]
    # the native decode step ran on both paths (across hosts it hands each all-reduce to comm.tcp)
    assert all(links[n]["native_all_reduce"]["us"] > 0 for n in ("shm", "veth")), links
    assert all(d["us"] > 0 and d["burst_us"] > 0 and d["spill_us"] >= 0 for o in ops.values() for d in o.values())
    # across hosts, pp=2's decode step: one message between the stages (measure.pipeline_step_rank)
    # at three stage sizes (measure.PP_HOP_CONFIGS), by how long each message's receiver waited
    hops = links["veth"]["decode_hop"]
    assert links["veth"]["launches"] == 2 and len(links["veth"]["per_launch"]["decode_pp_step_us"]) == 2
    assert len(links["veth"]["per_launch"]["decode_pp_512_step_us"]) == 2
    assert [h["bytes"] for h in sorted(hops, key=lambda h: h["bytes"])] == [256, 1024, 2048], hops
    assert [h["idle_us"] for h in hops] == sorted(h["idle_us"] for h in hops) and "decode_hop" not in links["shm"]
    assert all(h["hop_us"] >= 0 and h["step_us"] > h["alone_us"] == pytest.approx(2 * h["idle_us"]) for h in hops)
    hop = min(hops, key=lambda h: h["bytes"])
    # NOTE: no order between the two paths' 4 KiB all-reduces: over direct TCP the link's (tens of
    # us) may beat the shared memory's on a loaded machine (CI, 2026-12-07: 172 against 186 us)
    gloo = {**links["veth"], "send_us": None}  # any gloo link will do for the cluster's other operations
    cal = Calibration(host="h", torch="0", devices=2, memory_gib=16.0, gemm_tflops={"float32": 0.05}, mem_gbps=10.0,
                      layer_overhead_us=100.0, step_overhead_us=100.0, links={"gloo": gloo, **links})  # fmt: skip
    cl = cal.hosts(2, 1, rate_gbps=0.0125, bucket_bytes=netns.bucket_bytes("100mbit"))
    assert cl.inter.send_us == links["veth"]["send_us"] and cl.intra.via is not None
    assert (hop["idle_us"] * 1e-6, hop["bytes"], hop["hop_us"] * 1e-6) in cl.inter.decode_hop
    ours = f"{netns.PREFIX}{os.getpid()}c"  # this process's namespaces: all deleted
    assert ours not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
