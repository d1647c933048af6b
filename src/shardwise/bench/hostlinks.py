"""The two paths a job's collectives take besides gloo over loopback, measured for the planner:
the shared-memory all-reduce of a group inside one host, and a tp group's collectives across a link between hosts.

    links, unavailable = measure_paths(flops=86e9)   # {"shm": {...}, "veth": {...}}, {path: why}

Each path gets what shardwise.bench.calibrate records for a backend: all-reduce times of idle
ranks by size (bench.comm's probe), what a small one costs more inside a step, after a burst
of compute (measure.after_compute_rank), one point-to-point message's time (send_probe), and
each collective's time per call inside a real decode step (measure.decode_step_rank: op by op,
and inside the native step too, where the shared memory's all-reduces are C calls and the tcp
path's are the step handing each back to Python; across hosts with the q8 wire too, its all-reduces an all_to_all and an all_gather of 8-bit blocks),
and across hosts the message of pp=2's decode step (measure.pipeline_step_rank: the two stages
take turns, so the hidden state's send and the token's broadcast are a ping-pong with compute
between, priced from none of the above; at three stage sizes, as a message costs more the
longer its receiver waited for it):

- "shm": 2 local ranks, their world wrapped by shardwise.comm.shm (what a tp group inside one
  host uses by default); every other operation is the gloo link's.
- "veth": 2 hosts made as network namespaces (shardwise.bench.netns, unshaped: root only),
  one rank on each, over the veth link between them, each host pinned to a core of its own
  (netns.make_hosts(pin=True), as benchmarks/bench_links.py runs them): the collectives over
  direct TCP connections (shardwise.comm.tcp, what a tp group across hosts runs by default),
  point-to-point and pp=2's step over gloo. The planner adds a link's rate on top
  (specs.Link.shaped): these are the costs a message pays whatever the rate.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

import torch

from shardwise.comm import Communicator

__all__ = ["measure_paths", "send_probe", "path_rank", "SIZES"]

SIZES = [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20]
"""All-reduce sizes of the idle probe (up to the shared-memory segment's 1 MiB)."""
_PORT = 29471


def send_probe(world: Communicator, repeats: int = 200) -> float:
    """One point-to-point message of 4 KiB between ranks 0 and 1, one way, microseconds: the
    median round trip of a ping-pong, halved (the slower rank's view: both time the same trips)."""
    x = torch.zeros(1024)
    times = []
    for i in range(20 + repeats):
        t0 = time.perf_counter()
        if world.rank == 0:
            world.send(x, 1)
            world.recv(x.shape, x.dtype, 1)
        else:
            world.recv(x.shape, x.dtype, 0)
            world.send(x, 0)
        if i >= 20:
            times.append(time.perf_counter() - t0)
    return statistics.median(times) / 2 * 1e6


def path_rank(world: Communicator, opts: dict) -> dict:
    """One rank's probes on `world` (2 ranks), wrapped in shared memory when opts["shm"]."""
    from shardwise.bench.comm import _rank as idle_all_reduces
    from shardwise.bench.measure import AFTER_COMPUTE_BIG, after_compute_rank

    comm = world
    if opts.get("shm"):
        from shardwise.comm.shm import intra_host

        comm = intra_host(world, mode="on")
    elif opts.get("tcp", "auto") != "off":  # across hosts: what a tp group there runs (shardwise.comm.tcp)
        from shardwise.comm.tcp import across_hosts

        comm = across_hosts(world, mode=opts.get("tcp", "auto"))
    from shardwise.bench.measure import PP_HOP_CONFIGS, decode_step_rank, pipeline_step_rank

    idle = idle_all_reduces(comm, SIZES, opts.get("repeats", 50))
    after = after_compute_rank(comm, {"flops": opts["flops"]})["points"]
    values, bursts = AFTER_COMPUTE_BIG
    after_big = after_compute_rank(comm, {"flops": opts["flops"], "values": values, "bursts_ms": bursts})["points"]
    # a decode step's collectives where they run: op by op, and (shared memory) inside the native step
    # the same step with no collectives (each rank its own size-1 group, both at once): its compute
    decode = {"alone": decode_step_rank(world.split([[0], [1]], "alone"), {"native": False})}
    decode["per_op"] = decode_step_rank(comm, {"native": False})
    decode["native"] = decode_step_rank(comm, {})  # across hosts too: the step stops at each for comm.tcp
    if not opts.get(
        "shm"
    ):  # across hosts: with the tp all-reduces as 8-bit blocks too (--comm-dtype q8), and pp=2's step
        decode["q8"] = decode_step_rank(comm, {"native": False, "wire": "q8"})
        for key, config in PP_HOP_CONFIGS.items():  # stages of several sizes: a hop costs more after a longer wait
            decode[key] = pipeline_step_rank(world, {"config": config})
    return {"idle": idle, "after": after, "after_big": after_big, "send_us": send_probe(world), "decode": decode}


def _record(out: dict) -> dict:
    """A rank's probes in the calibration's format (calibrate.Calibration.links)."""
    from shardwise.bench.fits import after_compute_extra_us, fit_link
    from shardwise.bench.measure import AFTER_COMPUTE_BIG

    pts = sorted((n, s) for n, s in out["idle"])
    lat, bw = fit_link(pts)
    idle = pts[0][1] * 1e6  # NOTE: the step probe's all-reduces are 4 KiB, SIZES[0]
    return {
        "latency_us": lat,
        "busbw_gbps": bw,
        "send_us": out["send_us"],
        "points": [{"size_bytes": n, "latency_us": s * 1e6} for n, s in pts],
        "after_compute": [
            {
                "burst_us": p["burst_us"],
                "per_call_us": p["per_call_us"],
                "extra_us": after_compute_extra_us(p["per_call_us"], idle),
            }
            for p in out["after"]
        ],  # fmt: skip
        "after_compute_big": [
            {"burst_us": p["burst_us"], "per_call_us": p["per_call_us"], "size_bytes": AFTER_COMPUTE_BIG[0] * 4}
            for p in out.get("after_big", ())
        ],
        **_decode_record(out.get("decode", {})),
        **{k: out[k] for k in ("launches", "per_launch") if k in out},
    }


def _decode_record(decode: dict) -> dict:
    """The decode probes' collectives (measure.decode_step_rank) in the calibration's format:
    "decode": [{"op", "bytes", "us", "burst_us"}, ...] of the per-op path (burst: the step's
    compute between two of its collectives: the same step alone, with no collectives, over
    its calls; each call's time includes its share of what the step's compute took beyond
    that, "spill_us"), with the q8 wire's ops as "q8 all_to_all", "q8
    all_gather", "q8 broadcast" where measured; "native_all_reduce": {"bytes",
    "us", "spill_us", "step_us", "inside_us", "calls", "layers"} of the all-reduces inside the
    native step, where it ran (its spill as the per-op path's, over the native step; the step,
    its collectives' calls and their time, for the calibration to price against a tp rank's
    fixed times, calibrate.Calibration.link); "decode_hop": [{"bytes",
    "hop_us", "step_us", "alone_us", "idle_us"}, ...] of pp=2's decode step
    (measure.pipeline_step_rank: one message between two stages that take turns), one per stage
    size (measure.PP_HOP_CONFIGS), by idle_us, where measured."""
    from shardwise.bench.measure import DECODE_CONFIG, calls_us
    from shardwise.planner.wire import CODEC_US

    out = {"decode": []}
    for path, prefix in (("per_op", ""), ("q8", "q8 ")):
        if path not in decode:
            continue
        ops = decode[path]["ops"]
        calls = sum(v["calls"] for v in ops.values())
        inside = calls_us(ops)
        alone = decode.get("alone", {}).get("step_us")
        if alone is None:  # older probes: the compute between two collectives, the step less theirs
            burst, spill = max(0.0, decode[path]["step_us"] - inside) / max(calls, 1), 0.0
        else:
            # NOTE: the step outside its collectives is slower than the same step alone (after
            # each wait the rank resumes cold); that spill is the collectives' too, shared per
            # call (less the q8 wire's encoding and decoding, which the planner adds itself)
            codec = CODEC_US["q8"] * ops.get("all_to_all", {}).get("calls", 0) if prefix else 0.0
            spill = max(0.0, decode[path]["step_us"] - inside - alone - codec) / max(calls, 1)
            burst = alone / max(calls, 1)
        out["decode"] += [{"op": prefix + op, "bytes": v["bytes"], "us": v["us"] + spill, "burst_us": burst,
                           "spill_us": spill} for op, v in ops.items()]  # fmt: skip
    if not out["decode"]:
        del out["decode"]
    hops = [v for k, v in decode.items() if k == "pp" or k.startswith("pp_")]
    if hops:
        keys = ("bytes", "hop_us", "step_us", "alone_us", "idle_us")
        out["decode_hop"] = sorted(({k: pp[k] for k in keys if k in pp} for pp in hops),
                                   key=lambda h: h.get("idle_us", 0.0))  # fmt: skip
    native = decode.get("native")
    if native and native["native"] and "all_reduce" in native["ops"]:
        # as the per-op path's: what the step took beyond its calls and the same step alone (the
        # ranks resuming after each wait, and each wait for the slower rank's compute), shared
        # among its calls and added to the all-reduce's
        ops, alone = native["ops"], decode.get("alone", {}).get("step_us")
        calls = sum(v["calls"] for v in ops.values())
        inside = calls_us(ops)
        spill = 0.0 if alone is None else max(0.0, native["step_us"] - inside - alone) / max(calls, 1)
        ar = ops["all_reduce"]
        out["native_all_reduce"] = {"bytes": ar["bytes"], "us": ar["us"] + spill, "spill_us": spill,
                                    "step_us": native["step_us"], "inside_us": inside, "calls": calls,
                                    "layers": DECODE_CONFIG[4]}  # fmt: skip
    return out


def _better(a: dict, b: dict) -> dict:
    """The faster of two launches' probes, figure by figure (load elsewhere only adds time)."""
    idle = [(n, min(x, y)) for (n, x), (_, y) in zip(a["idle"], b["idle"], strict=True)]
    after = [min(p, q, key=lambda pt: pt["per_call_us"]) for p, q in zip(a["after"], b["after"], strict=True)]
    decode = {k: min(a["decode"][k], b["decode"][k], key=lambda r: r["step_us"]) for k in a.get("decode", {})}
    big = [min(p, q, key=lambda pt: pt["per_call_us"]) for p, q in zip(a["after_big"], b["after_big"], strict=True)]
    return {
        "idle": idle,
        "after": after,
        "after_big": big,
        "send_us": min(a["send_us"], b["send_us"]),
        "decode": decode,
    }


def _median(outs: list[dict]) -> dict:
    """The median of several launches' probes, figure by figure; each decode probe whole, from
    the launch whose step is the median (its calls belong together). NOTE: across the veth,
    gloo runs in a fast or a slow regime fixed per launch (docs/benchmarks/links.md: 4 KiB
    idle 0.5 ms in one launch, 2.2 ms in the next): the fastest launch prices the fast regime
    only, the median the launch a job most likely gets."""

    def mid(values, key=lambda v: v):
        return sorted(values, key=key)[(len(values) - 1) // 2]

    idle = [(pts[0][0], mid([s for _, s in pts])) for pts in zip(*(o["idle"] for o in outs), strict=True)]
    per_call = lambda pt: pt["per_call_us"]  # noqa: E731
    after = [mid(list(pts), per_call) for pts in zip(*(o["after"] for o in outs), strict=True)]
    big = [mid(list(pts), per_call) for pts in zip(*(o["after_big"] for o in outs), strict=True)]
    decode = {k: mid([o["decode"][k] for o in outs], lambda r: r["step_us"]) for k in outs[0].get("decode", {})}
    out = {"idle": idle, "after": after, "after_big": big, "send_us": mid([o["send_us"] for o in outs]),
           "decode": decode}  # fmt: skip
    # each launch's headline figures, kept to show the spread between launches
    spread = {"idle_4k_us": [o["idle"][0][1] * 1e6 for o in outs]}
    spread.update({f"decode_{k}_step_us": [o["decode"][k]["step_us"] for o in outs] for k in decode})
    return {**out, "launches": len(outs), "per_launch": spread}


def _veth(flops: float, tries: int) -> dict:
    from shardwise.bench import netns

    outs = []
    for _ in range(tries):
        with netns.make_hosts(2, None, pin=True) as cluster:  # each host on a core of its own, as bench_links
            env = {**os.environ, "OMP_NUM_THREADS": "1", **cluster.env()}
            argv = [sys.executable, "-m", "shardwise.bench.hostlinks", cluster.hosts[0].addr, str(flops)]
            procs = [
                h.popen([*argv, str(h.index)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                for h in cluster.hosts
            ]
            done = [p.communicate(timeout=600) for p in procs]
            if any(p.returncode for p in procs):
                raise RuntimeError("veth probe failed: " + " | ".join(e.strip().splitlines()[-1] for _, e in done if e))
            outs.append(json.loads(done[0][0].strip().splitlines()[-1]))
    return _median(outs)


def measure_paths(
    *, flops: float, tries: int = 2, veth_launches: int = 3, log=None, quiet=lambda: None
) -> tuple[dict, dict]:
    """({"shm": record, "veth": record}, {path: why not measured}); see the module docstring.
    The shared memory: the faster of `tries` launches, figure by figure (load elsewhere only adds
    time); the veth: the median of `veth_launches` (_median: its per-launch regimes)."""
    from shardwise.bench import netns
    from shardwise.comm.shm_segment import supported
    from shardwise.launch import launch

    log = log or (lambda msg: print(msg, file=sys.stderr))
    links, unavailable = {}, {}
    if supported():
        log("calibrating: the shared-memory all-reduce over 2 ranks")
        outs = []
        for _ in range(tries):
            quiet()
            outs.append(launch(path_rank, 2, args=({"flops": flops, "shm": True},))[0])
        links["shm"] = _record(_better(*outs) if len(outs) > 1 else outs[0])
    else:
        unavailable["shm"] = "no shared-memory all-reduce on this machine (shardwise.comm.shm_segment.supported)"
    why = netns.unavailable()
    if why is None:
        log("calibrating: across a veth link between two namespace hosts (tcp collectives, gloo point-to-point)")
        quiet()
        try:
            links["veth"] = _record(_veth(flops, veth_launches))
        except (RuntimeError, subprocess.TimeoutExpired, ValueError) as e:
            unavailable["veth"] = str(e)[:200]
    else:
        unavailable["veth"] = why
    return links, unavailable


def _main(addr: str, flops: float, rank: int) -> None:
    """One rank of the veth probe, on its namespace host: gloo with rank 0's host as master."""
    from shardwise.comm.torch_dist import init_torch_distributed

    torch.set_num_threads(1)
    world = init_torch_distributed(rank=rank, world_size=2, master_addr=addr, master_port=_PORT)
    out = path_rank(world, {"flops": flops})
    world.close()
    if rank == 0:
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    _main(sys.argv[1], float(sys.argv[2]), int(sys.argv[3]))
