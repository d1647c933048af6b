"""What one small message costs gloo inside a decode step, and why: loopback against a veth link.

    python benchmarks/bench_gloo_message.py [--out docs/benchmarks/gloo_message.json]

Needs root (two hosts as network namespaces: shardwise.bench.netns, unshaped). Two ranks,
one thread each, on each path: both on host 0 over its loopback, and one per host across
the veth link. Every figure is a median, in microseconds, of rank 0:

- tcp_nodelay / tcp_nagle: a 4 KiB ping-pong (one way) over a plain Python TCP socket, with
  TCP_NODELAY set and not (Nagle's algorithm and delayed ACKs would show as ~40 ms);
- gloo_nodelay: whether gloo's own sockets have TCP_NODELAY set (read from this process's fds);
- gloo_idle: a 4 KiB all-reduce, back to back;
- gloo_send: a 4 KiB send/recv ping-pong, one way;
- gloo_step[_pinned]: a decode-like step, 11 bursts of ~0.3 ms of compute each followed by a 4 KiB
  all-reduce, less the same bursts without them, per all-reduce (as measure.after_compute_rank);
  _pinned with each rank on a core of its own (sched_setaffinity), to separate the cost of
  waking a rank whose core another thread took from the message's.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

PORT, TCP_PORT = 29531, 29532


def _pingpong(rank: int, peer: str, nodelay: bool, n: int = 300) -> float:
    msg = b"\0" * 4096
    if rank == 0:
        srv = socket.create_server(("0.0.0.0", TCP_PORT + nodelay))
        conn, _ = srv.accept()
    else:
        for _ in range(100):
            try:
                conn = socket.create_connection((peer, TCP_PORT + nodelay))
                break
            except OSError:
                time.sleep(0.05)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, int(nodelay))

    def recv_all() -> None:
        got = 0
        while got < len(msg):
            got += len(conn.recv(len(msg) - got))

    times = []
    for i in range(n + 20):
        t0 = time.perf_counter()
        if rank == 0:
            conn.sendall(msg)
            recv_all()
        else:
            recv_all()
            conn.sendall(msg)
        if i >= 20:
            times.append(time.perf_counter() - t0)
    conn.close()
    return statistics.median(times) / 2 * 1e6


def _gloo_nodelay() -> list[int]:
    """TCP_NODELAY of every TCP socket this process holds (gloo's pairs and its store's)."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                continue
            s = socket.socket(fileno=os.dup(int(fd)))
        except OSError:
            continue
        try:
            if s.type == socket.SOCK_STREAM and s.family in (socket.AF_INET, socket.AF_INET6):
                out.append(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
        except OSError:
            pass
        finally:
            s.close()
    return out


def _rank(rank: int, master: str, iface: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    torch.set_num_threads(1)
    os.environ["GLOO_SOCKET_IFNAME"] = iface
    res = {"tcp_nagle": _pingpong(rank, master, False), "tcp_nodelay": _pingpong(rank, master, True)}
    dist.init_process_group("gloo", init_method=f"tcp://{master}:{PORT}", rank=rank, world_size=2)
    x = torch.ones(1024)
    for _ in range(20):
        dist.all_reduce(x)
    res["gloo_nodelay"] = _gloo_nodelay()

    def med(f, n: int = 300) -> float:
        ts = []
        for _ in range(n):
            t0 = time.perf_counter()
            f()
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts) * 1e6

    res["gloo_idle"] = med(lambda: dist.all_reduce(x))

    def send() -> None:
        if rank == 0:
            dist.send(x, 1)
            dist.recv(x, 1)
        else:
            dist.recv(x, 0)
            dist.send(x, 0)

    res["gloo_send"] = med(send) / 2
    w = torch.randn(256, 1024)
    a = torch.randn(1, 1024)
    t0 = time.perf_counter()
    for _ in range(200):
        F.linear(a, w)
    rows = max(1, round(300e-6 / ((time.perf_counter() - t0) / 200)))  # ~0.3 ms a burst
    a = torch.randn(rows, 1024)

    def step(collectives: bool) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(11):
            F.linear(a, w)
            if collectives:
                dist.all_reduce(x)
        if not collectives:
            dist.all_reduce(x)
        return time.perf_counter() - t0

    for key, cpus in (("gloo_step", None), ("gloo_step_pinned", {rank % os.cpu_count()})):
        if cpus is not None:
            os.sched_setaffinity(0, cpus)
        with_ = statistics.median(step(True) for _ in range(60))
        without = statistics.median(step(False) for _ in range(60))
        res[key] = (with_ - without) / 10 * 1e6
        res[key.replace("gloo_step", "burst")] = without / 11 * 1e6
    dist.destroy_process_group()
    if rank == 0:
        print(json.dumps(res), flush=True)


def main() -> None:
    from shardwise.bench import netns

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=ROOT / "docs/benchmarks/gloo_message.json")
    a = ap.parse_args()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    me = [sys.executable, __file__, "_rank"]
    out = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "load_start": os.getloadavg()}
    with netns.make_hosts(2, None) as cluster:
        h0, h1 = cluster.hosts
        for path, hosts, master, iface in (("loopback", (h0, h0), "127.0.0.1", "lo"),
                                           ("veth", (h0, h1), h0.addr, "eth0")):  # fmt: skip
            procs = [h.popen([*me, str(r), master, iface], env=env, stdout=subprocess.PIPE, text=True)
                     for r, h in enumerate(hosts)]  # fmt: skip
            res = procs[0].communicate(timeout=600)[0]
            procs[1].wait(timeout=60)
            out[path] = json.loads(res.strip().splitlines()[-1])
            print(path, json.dumps(out[path]), flush=True)
    out["load_end"] = os.getloadavg()
    a.out.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_rank":
        _rank(int(sys.argv[2]), sys.argv[3], sys.argv[4])
    else:
        main()
