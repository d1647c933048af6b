"""Does a token-bucket link (tc tbf, as shardwise.bench.netns shapes it) charge a decode step's
small messages its rate? Two namespace hosts (pinned, one core each) exchange N bytes both
ways at once over one TCP connection (TCP_NODELAY; what a direct-exchange all-reduce of two
ranks sends), each exchange after `gap` ms of spinning (a step's compute between two of its
all-reduces), 200 exchanges after 5 untimed; median and 90th percentile per host, in us.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_tbf_spacing.py \\
        --out docs/benchmarks/tbf_spacing_zen3.json

With no gap the messages queue behind each other and pay the rate past the bucket (1 ms of
the rate: 12.5 KB at 100 Mbit/s); spaced by a step's compute, a message that fits the
bucket should pass as on an unshaped link, which is what the planner prices
(specs.Link._wait_s: only the bytes beyond the bucket, at the rate). Root only.
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))


def _peer(rank: int, addr: str, port: int, nbytes: int, gap_ms: float, reps: int) -> dict:
    if rank == 0:
        srv = socket.socket()
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind((addr, port))
        srv.listen(1)
        srv.settimeout(60)
        s, _ = srv.accept()
        srv.close()
    else:
        deadline = time.time() + 60
        while True:
            try:
                s = socket.create_connection((addr, port), timeout=60)
                break
            except OSError:
                if time.time() > deadline:
                    raise
                time.sleep(0.05)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf, times = b"x" * nbytes, []
    for i in range(reps + 5):
        end = time.perf_counter() + gap_ms / 1e3
        while time.perf_counter() < end:  # compute: the core stays busy, as in a step
            pass
        t0 = time.perf_counter()
        s.sendall(buf)
        got = 0
        while got < nbytes:
            chunk = s.recv(nbytes - got)
            if not chunk:
                raise RuntimeError("peer closed the connection")
            got += len(chunk)
        if i >= 5:
            times.append(time.perf_counter() - t0)
    s.close()
    times.sort()
    return {"median_us": statistics.median(times) * 1e6, "p90_us": times[int(0.9 * len(times))] * 1e6}


def main() -> None:
    from shardwise.bench import netns

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rates", default="100mbit,1gbit,none")
    ap.add_argument("--sizes", default="4096,8192,16384")
    ap.add_argument("--gaps-ms", default="0,2")
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    lines = Path("/proc/cpuinfo").read_text().splitlines()
    cpu = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), "?")
    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpu": cpu, "load_start": os.getloadavg(),
            "command": " ".join(sys.argv), "bucket_bytes": {}}  # fmt: skip
    rows, port = [], 29611
    for rate in a.rates.split(","):
        shaped = None if rate == "none" else rate
        if shaped:
            meta["bucket_bytes"][rate] = netns.bucket_bytes(rate)
        with netns.make_hosts(2, shaped, pin=True) as cl:
            for nbytes in map(int, a.sizes.split(",")):
                for gap in map(float, a.gaps_ms.split(",")):
                    port += 1
                    argv = [sys.executable, __file__, "--peer", cl.hosts[0].addr, str(port), str(nbytes), str(gap),
                            str(a.reps)]  # fmt: skip
                    procs = [h.popen([*argv, str(h.index)], stdout=subprocess.PIPE, text=True) for h in cl.hosts]
                    outs = [json.loads(p.communicate(timeout=300)[0].strip().splitlines()[-1]) for p in procs]
                    row = {"rate": rate, "bytes": nbytes, "gap_ms": gap,
                           "median_us": [round(o["median_us"], 1) for o in outs],
                           "p90_us": [round(o["p90_us"], 1) for o in outs]}  # fmt: skip
                    rows.append(row)
                    print(f"{rate:8s} {nbytes:6d} B  gap {gap:3.1f} ms: median {row['median_us']} us, "
                          f"p90 {row['p90_us']} us", flush=True)  # fmt: skip
    meta["load_end"] = os.getloadavg()
    if a.out:
        a.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--peer":
        addr, port, nbytes, gap, reps, rank = sys.argv[2:8]
        print(json.dumps(_peer(int(rank), addr, int(port), int(nbytes), float(gap), int(reps))), flush=True)
    else:
        main()
