"""Decode across shaped links: tp=2 inside one host, tp=2 across a link, pp=2 across a link.

    python benchmarks/bench_links.py [--model DIR] [--rates 100mbit,1gbit] [--out docs/benchmarks/bench_links.json]

Needs root (hosts are network namespaces: shardwise.bench.netns). Each layout runs
`torchrun ... -m shardwise generate --json` with one rank per host (both ranks on host 0
for the one-host layout, over its loopback), greedy, gloo, twice: with SHORT and with
LONG new tokens. Decode ms/token is the LONG run's median; bytes per token on the link
are (tx bytes of every host's link in the LONG run - in the SHORT run) / (LONG - SHORT), so
the rendezvous, loading and prefill cancel. tp=2 across a link also runs with
--comm-dtype q8 (8-bit blocks on the wire). Writes JSON and a plot (ms/token against rate).

Beside each measurement, the planner's prediction for the same layout and rate (Predictor:
this host's calibration, `shardwise plan --cluster this-host`, plus the link's bytes / rate)
and whether it is within 25% (issue 38's check). The figures mean something only on a
quiet machine: say the load.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from shardwise.bench import netns  # noqa: E402

TORCHRUN = str(Path(sys.executable).parent / "torchrun")
SHORT, LONG = 8, 40
LAYOUTS = {  # name: (hosts, ranks per host, generate's layout flags)
    "tp=2 in one host": (1, 2, ["--tp", "2"]),
    "tp=2 across the link": (2, 1, ["--tp", "2", "--allow-cross-host-tp"]),
    "tp=2 across, q8 wire": (2, 1, ["--tp", "2", "--allow-cross-host-tp", "--comm-dtype", "q8"]),
    "pp=2 across the link": (2, 1, ["--tp", "1", "--pp", "2"]),
}


def _generate(
    cluster: netns.Cluster, per_host: int, flags: list[str], tokens: int, model: list[str]
) -> tuple[dict, int]:
    argv = ["-m", "shardwise", "generate", *model, *flags, "--backend", "gloo", "--ignore-eos", "--json"]
    argv += ["--max-new-tokens", str(tokens)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    before = sum(cluster.tx_bytes().values())
    if len(cluster.hosts) == 1:
        cmd = [TORCHRUN, "--standalone", "--nproc-per-node", str(per_host), *argv]
        procs = [
            cluster.hosts[0].popen(
                cmd, env={**env, **cluster.env()}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
        ]
    else:
        procs = cluster.torchrun(
            TORCHRUN, per_host, argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
    outs = [p.communicate(timeout=900) for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError("\n".join(e[-2000:] for _, e in outs))
    sent = sum(cluster.tx_bytes().values()) - before
    line = next(x for o, _ in outs for x in o.splitlines() if x.startswith("{"))
    return json.loads(line), sent


_RATE_GBPS = {"100mbit": 0.0125, "1gbit": 0.125, "10gbit": 1.25}  # bytes: a tbf rate of bits / 8


class Predictor:
    """The planner's decode ms/token for each layout (shardwise.planner.predict), on this host as
    calibrated (`plan --cluster this-host`: its gloo all-reduce times, measured over loopback,
    and their extra right after a burst of compute). The namespace hosts are one machine: both
    ranks share its cores and memory bus as in one host (2 devices on one node, busy), and a
    collective that crosses the link also pays the link's serialization, bytes / rate (a tbf
    rate of bits / 8 bytes per second) on top of the loopback time."""

    def __init__(self, model: str | None, latency_us: float) -> None:
        from shardwise.bench.calibrate import this_host
        from shardwise.engine.text import DEFAULT_MODEL
        from shardwise.planner.presets import resolve_model

        self.cfg = resolve_model(model or DEFAULT_MODEL)[1]
        self.base = this_host()
        self.latency_us = latency_us

    def _link(self, rate: str):
        from shardwise.planner.specs import Link

        intra, bw = self.base.intra, _RATE_GBPS[rate]
        points = tuple((n, s + n / (bw * 1e9) + self.latency_us * 1e-6) for n, s in intra.points)
        busbw = 1 / (1 / intra.busbw_gbps + 1 / bw)
        return Link(f"{intra.name} over tbf {rate}", busbw, intra.latency_us + self.latency_us, points,
                    intra.after_compute)  # fmt: skip

    def decode_ms(self, layout: str, hosts: int, rate: str, *, prompt: int) -> float:
        from dataclasses import replace

        from shardwise.planner.predict import Layout, predict_inference

        cluster = replace(self.base, devices=2, devices_per_node=2)
        if hosts > 1:
            cluster = replace(cluster, intra=self._link(rate))
        tp, pp = (1, 2) if layout.startswith("pp=2") else (2, 1)
        p = predict_inference(self.cfg, cluster, Layout(tp, pp, 1), batch=1, prompt_len=prompt, output_len=LONG,
                              width=4, dtype="float32")  # fmt: skip
        s = p.decode.total_s
        if "q8" in layout:  # the tp all-reduces as 8-bit blocks on the wire (shardwise.planner.wire)
            from shardwise.planner.wire import all_reduce_s

            for c in p.collectives:
                if c.op == "all_reduce" and c.group == "tp" and c.calls:
                    values = c.bytes / c.calls / 4
                    fp32, q8 = (all_reduce_s(cluster.intra, values, 2, w) for w in ("fp32", "q8"))
                    s += c.calls * (q8 - fp32)
        return s * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="Hugging Face directory (default: the built-in model)")
    ap.add_argument("--rates", default="100mbit,1gbit")
    ap.add_argument("--out", type=Path, default=ROOT / "docs/benchmarks/bench_links.json")
    ap.add_argument(
        "--latency-us",
        type=float,
        default=30.0,
        help="what a message crossing the link adds to a loopback one, for the planner (veth + tbf here)",
    )
    a = ap.parse_args()
    predictor = Predictor(a.model, a.latency_us)
    # a random-weight directory has no tokenizer: a fixed prompt of 16 ids
    model = ["--model", a.model, "--prompt-ids", ",".join(str(100 + 7 * i) for i in range(16))] if a.model else []
    rows = []
    for rate in a.rates.split(","):
        for name, (n, per_host, flags) in LAYOUTS.items():
            if n == 1 and rows and any(r["layout"] == name for r in rows):
                continue  # inside one host the link does not matter: once
            with netns.make_hosts(n, rate) as cluster:
                short, sent_short = _generate(cluster, per_host, flags, SHORT, model)
                long, sent_long = _generate(cluster, per_host, flags, LONG, model)
            row = {
                "layout": name,
                "rate": rate if n > 1 else "loopback",
                "decode_ms_per_token": long["decode_ms_per_token"],
                "link_bytes_per_token": round((sent_long - sent_short) / (LONG - SHORT)),
                "tokens": long["tokens"],
            }
            row["predicted_ms_per_token"] = predictor.decode_ms(
                name, n, rate, prompt=16
            )  # NOTE: the built-in prompt is about as long
            row["predicted_over_measured"] = row["predicted_ms_per_token"] / row["decode_ms_per_token"]
            row["within_25pct"] = 0.75 <= row["predicted_over_measured"] <= 1.25
            rows.append(row)
            print(
                f"{name:24s} {row['rate']:9s} {row['decode_ms_per_token']:8.2f} ms/token {row['link_bytes_per_token']:9d} B/token"
                f"  planner {row['predicted_ms_per_token']:8.2f} ms ({row['predicted_over_measured']:.2f}x)",
                flush=True,
            )
    for r in rows:  # greedy tokens of the q8 wire against fp32's at the same rate
        fp32 = [x for x in rows if x["layout"] == "tp=2 across the link" and x["rate"] == r["rate"]]
        if "q8" in r["layout"] and fp32:
            r["same_tokens_as_fp32"] = r["tokens"] == fp32[0]["tokens"]
    load = os.getloadavg()
    cpu = (
        next(x for x in Path("/proc/cpuinfo").read_text().splitlines() if x.startswith("model name"))
        .split(":")[1]
        .strip()
    )
    meta = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "load": load,
        "cpu": cpu,
        "model": a.model or "built-in",
    }
    meta.update({"short": SHORT, "long": LONG, "backend": "gloo", "threads_per_rank": 1})
    a.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    _plot(rows, a.out.with_suffix(".png"))


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    rates = [r["rate"] for r in rows if r["rate"] != "loopback"]
    order = list(dict.fromkeys(rates))
    for name in LAYOUTS:
        pts = [r for r in rows if r["layout"] == name]
        if pts and pts[0]["rate"] == "loopback":
            ax.axhline(pts[0]["decode_ms_per_token"], ls="--", color="gray", label=f"{name} (loopback)")
        elif pts:
            ax.plot([order.index(r["rate"]) for r in pts], [r["decode_ms_per_token"] for r in pts], "o-", label=name)
    ax.set_xticks(range(len(order)), order)
    ax.set_xlabel("link rate (tbf)")
    ax.set_ylabel("decode ms/token (median)")
    ax.set_title("decode across a shaped link (2 ranks, gloo)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
