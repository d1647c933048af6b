"""Decode and a training step across shaped links: tp=2 inside one host, tp=2 across a link, pp=2 across a link.

    python benchmarks/bench_links.py [--model DIR|FILE.gguf] [--quantize int8] [--rates 100mbit,1gbit]
                                     [--layouts ...] [--train] [--out docs/benchmarks/bench_links.json]

Needs root (hosts are network namespaces: shardwise.bench.netns). Each layout runs under
torchrun with one rank per host (both ranks on host 0 for the one-host layout, over its
loopback and its shared-memory all-reduce), gloo, one thread per rank, twice, so that the
rendezvous, loading and the first steps cancel; and that pair --launches times (default 3):
a row is the median launch, each launch's figure kept (launches_ms), because gloo across a
veth runs in a fast or a slow regime fixed per launch (docs/benchmarks/links.md). Each
host's ranks run on cores of their own (netns.make_hosts(pin=True); --no-pin: anywhere), as
the calibration's veth probes do (hostlinks):

- decode: `shardwise generate --json`, greedy, with SHORT and with LONG new tokens. ms/token
  is the LONG run's median decode step; bytes per token on the links are (tx bytes of every
  host's link in the LONG run - in the SHORT run) / (LONG - SHORT). tp=2 across a link also
  runs with --comm-dtype q8 (8-bit blocks on the wire).
- --train: `shardwise train --json` of the built-in model's shape or, with --train-shape 1b,
  a 1B one (TRAIN_SHAPES: random weights, fp32, AdamW, the shape's batch) for the shape's
  SHORT and LONG numbers of steps: ms per step is the mean of LONG's steps after its first
  (the first allocates the optimizer's state), link bytes per step the difference over the
  extra steps.

Beside each measurement, the planner's prediction for the same layout and rate, decode with
the wire format the run reported (`comm_dtype`: what --comm-dtype auto picked) (Predictor:
this host's calibration, `shardwise plan --cluster this-host`, with the namespace hosts as
Calibration.hosts describes them) and whether it is within 25% (issue 38's check). Writes
JSON and a plot (measured and predicted ms against rate). The figures mean something only
on a quiet machine: the load at the start and the end is in the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
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


def _run(cluster: netns.Cluster, per_host: int, argv: list[str]) -> tuple[dict, int]:
    """`torchrun ... argv` over the cluster's hosts (both ranks on host 0 when it has one host):
    the JSON line it printed, and the bytes every host's link sent meanwhile."""
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


def _generate(
    cluster: netns.Cluster, per_host: int, flags: list[str], tokens: int, model: list[str]
) -> tuple[dict, int]:
    argv = ["-m", "shardwise", "generate", *model, *flags, "--backend", "gloo", "--ignore-eos", "--json"]
    return _run(cluster, per_host, [*argv, "--max-new-tokens", str(tokens)])


class Predictor:
    """The planner's figures for each layout and rate, from this host's calibration
    (shardwise.bench.calibrate, `plan --cluster this-host`): the namespace hosts as
    Calibration.hosts describes them. Inside a host, the shared-memory all-reduce over gloo (what
    a tp group there uses by default); between hosts, the calibrated veth link (the tp group's
    collectives over direct TCP, shardwise.comm.tcp; point-to-point over gloo), its
    per-message costs measured, its transfers at the link's rate beyond the token bucket
    (netns.bucket_bytes); the devices at this host's rates with every core busy where both
    ranks compute at once (one machine: the hosts share its cores)."""

    def __init__(self, cfg, quantize: str | None = None) -> None:
        from shardwise.bench.calibrate import load_calibration

        self.cfg, self.quantize = cfg, quantize
        self.cal = load_calibration()

    def cluster(self, hosts: int, per_host: int, rate: str):
        if hosts == 1:
            return self.cal.hosts(1, per_host)
        return self.cal.hosts(
            hosts, per_host, rate_gbps=netns.rate_bits(rate) / 8e9, bucket_bytes=netns.bucket_bytes(rate)
        )

    @staticmethod
    def layout(name: str):
        from shardwise.planner.predict import Layout

        return Layout(1, 2, 1) if name.startswith("pp=2") else Layout(2, 1, 1)

    def decode_ms(self, name: str, hosts: int, per_host: int, rate: str, *, prompt: int, wire: str = "fp32") -> float:
        from shardwise.planner.predict import predict_inference

        p = predict_inference(self.cfg, self.cluster(hosts, per_host, rate), self.layout(name), batch=1,
                              prompt_len=prompt, output_len=LONG, width=4, dtype="float32", quantize=self.quantize,
                              comm_dtype=wire)  # fmt: skip
        return p.decode.total_s * 1e3

    def step_ms(self, name: str, hosts: int, per_host: int, rate: str, train: dict) -> float:
        from shardwise.planner.predict import predict_training
        from shardwise.planner.schedule import PipelineSchedule
        from shardwise.planner.specs import TrainingWorkload

        lay = self.layout(name)
        m = train["global_batch_size"] // train["micro_batch_size"]
        wl = TrainingWorkload(global_batch=train["global_batch_size"], micro_batch=train["micro_batch_size"],
                              seq_len=train["seq_len"], precision="fp32", optimizer="adam")  # fmt: skip
        sched = PipelineSchedule.build("1f1b", self.cfg.num_layers, lay.pp, m) if lay.pp > 1 else None
        return predict_training(self.cfg, self.cluster(hosts, per_host, rate), lay, wl, sched).step.total_s * 1e3


TRAIN_SHAPES = {  # --train-shape: (the model section, the batch, the SHORT and LONG runs' steps)
    "builtin": (
        dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=4, num_heads=8, num_kv_heads=4),
        {"seq_len": 128, "global_batch_size": 8, "micro_batch_size": 2},
        (2, 6),
    ),
    # Llama-3.2-1B's layers (hidden 2048, 16 layers, 32/8 heads, MLP 8192, tied embeddings) with a
    # 32000-token vocabulary: 1.04B parameters, 16.6 GB with AdamW in fp32 over both ranks (this
    # machine has 24 GB; the 128256-token vocabulary would take 19.8 GB)
    "1b": (
        dict(
            vocab_size=32000,
            hidden_size=2048,
            intermediate_size=8192,
            num_layers=16,
            num_heads=32,
            num_kv_heads=8,
            tie_embeddings=True,
        ),  # fmt: skip
        {"seq_len": 128, "global_batch_size": 2, "micro_batch_size": 1},
        (1, 4),
    ),
}
TRAIN_SHAPE = "builtin"
"""The shape --train runs (main sets it from --train-shape)."""


def _shape() -> tuple[dict, dict, tuple[int, int]]:
    return TRAIN_SHAPES[TRAIN_SHAPE]


def _train_config(tmp: Path, flags: list[str], steps: int) -> Path:
    """A `shardwise train` config of the --train-shape model (random weights, fp32, AdamW)."""
    import torch

    from shardwise.train.data import write_token_file

    model, d, _ = _shape()
    vocab = model["vocab_size"]
    tokens = tmp / f"tokens-{vocab}.safetensors"
    if not tokens.exists():
        write_token_file(tokens, torch.randint(0, vocab, (200_000,), generator=torch.Generator().manual_seed(0)),
                         vocab_size=vocab)  # fmt: skip
    tp, pp = (1, 2) if "--pp" in flags else (2, 1)
    path = tmp / f"train-{TRAIN_SHAPE}-tp{tp}-pp{pp}-{steps}.toml"
    section = "\n".join(f"{k} = {str(v).lower() if isinstance(v, bool) else v}" for k, v in model.items())
    path.write_text(f"""
[model]
{section}

[data]
tokens = "{tokens}"
seq_len = {d["seq_len"]}
global_batch_size = {d["global_batch_size"]}
micro_batch_size = {d["micro_batch_size"]}

[parallel]
tp = {tp}
pp = {pp}
dp = 1
backend = "gloo"

[run]
steps = {steps}
out_dir = "{tmp / f"run-{TRAIN_SHAPE}-{tp}-{pp}-{steps}"}"
progress = false
save_at_end = false
log_every = 1000
""")
    return path


def _train(cluster: netns.Cluster, per_host: int, flags: list[str], tmp: Path) -> tuple[float, float]:
    """(ms per step, link bytes per step): the mean of LONG's steps after its first (rank 0's
    step_ms: the first allocates the optimizer's state and faults in every buffer), and
    LONG's link bytes less SHORT's, so that start-up cancels."""
    runs = []
    short_long = _shape()[2]
    for steps in short_long:
        config = _train_config(tmp, flags, steps)
        argv = ["-m", "shardwise", "train", "--config", str(config), "--json"]
        argv += ["--allow-cross-host-tp"] if "--allow-cross-host-tp" in flags else []
        out, sent = _run(cluster, per_host, argv)
        runs.append((out["step_ms"], sent))
    n = short_long[1] - short_long[0]
    return statistics.mean(runs[1][0][1:]), (runs[1][1] - runs[0][1]) / n


def data_shape(a: argparse.Namespace) -> str | None:
    """The --train-shape an existing --out was measured with (--predict alone), else None."""
    if not a.predict or not a.out.exists():
        return None
    return json.loads(a.out.read_text())["meta"].get("shape", "builtin")


def _cpu() -> str:
    lines = Path("/proc/cpuinfo").read_text().splitlines()
    return next(x for x in lines if x.startswith("model name")).split(":")[1].strip()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="Hugging Face directory or GGUF file (default: the built-in model)")
    ap.add_argument("--quantize", default=None, choices=["fp16", "int8"], help="generate's --quantize")
    ap.add_argument("--rates", default="100mbit,1gbit")
    ap.add_argument("--layouts", default=None, help="comma-separated subset of the layouts (default: all)")
    ap.add_argument("--train", action="store_true", help="a training step per layout instead of decode")
    ap.add_argument("--train-shape", choices=sorted(TRAIN_SHAPES), default="builtin",
                    help="--train's model: the built-in model's shape, or a 1B one (TRAIN_SHAPES)")  # fmt: skip
    ap.add_argument("--out", type=Path, default=ROOT / "docs/benchmarks/bench_links.json")
    ap.add_argument("--predict", action="store_true", help="no runs: the planner's figures beside --out's rows")
    ap.add_argument("--measure-only", action="store_true", help="the runs only (--predict adds the planner's later)")
    ap.add_argument("--launches", type=int, default=3, help="launches per row; the row is their median (default 3)")
    ap.add_argument("--no-pin", dest="pin", action="store_false",
                    help="let the scheduler place the hosts' ranks (default: each host on cores of its own, netns.host_cores)")  # fmt: skip
    a = ap.parse_args()
    from shardwise.engine.text import DEFAULT_MODEL
    from shardwise.planner.presets import resolve_model

    if a.train:
        from shardwise.train.config import ModelSection

        global TRAIN_SHAPE
        TRAIN_SHAPE = data_shape(a) or a.train_shape
        cfg = ModelSection(**_shape()[0]).model_config()
    else:
        from shardwise.hf import loaded_config

        cfg = resolve_model(a.model or str(DEFAULT_MODEL))[1]
        if not a.quantize:
            cfg = loaded_config(a.model or str(DEFAULT_MODEL), cfg)  # a GGUF file computes in its own formats
    if not a.predict:
        _measure(a, cfg)
    if not a.measure_only:
        _predict(a, cfg)


def _measure(a: argparse.Namespace, cfg) -> None:
    """Run every layout at every rate; write the measured rows (a.out) before any prediction."""
    layouts = {k: v for k, v in LAYOUTS.items() if a.layouts is None or k in a.layouts.split(",")}
    if a.train:
        layouts = {k: v for k, v in layouts.items() if "q8" not in k}  # training keeps its all-reduces exact
    # a random-weight directory has no tokenizer: a fixed prompt of 16 ids
    model = ["--model", a.model, "--prompt-ids", ",".join(str(100 + 7 * i) for i in range(16))] if a.model else []
    model += ["--quantize", a.quantize] if a.quantize else []
    load0, t0 = os.getloadavg(), time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    rows = []
    import tempfile

    tmp = Path(tempfile.mkdtemp(prefix="bench-links-"))
    unit = "step" if a.train else "token"
    for rate in a.rates.split(","):
        for name, (n, per_host, flags) in layouts.items():
            if n == 1 and rows and any(r["layout"] == name for r in rows):
                continue  # inside one host the link does not matter: once
            launches, tokens, wires = [], None, set()
            with netns.make_hosts(n, rate, pin=a.pin) as cluster:
                for _ in range(a.launches):  # NOTE: gloo across a veth is fast or slow per launch
                    if a.train:
                        launches.append(_train(cluster, per_host, flags, tmp))
                    else:
                        short, sent_short = _generate(cluster, per_host, flags, SHORT, model)
                        long, sent_long = _generate(cluster, per_host, flags, LONG, model)
                        launches.append((long["decode_ms_per_token"], (sent_long - sent_short) / (LONG - SHORT)))
                        tokens = tokens or long["tokens"]
                        wires.add(long.get("comm_dtype") or "fp32")  # what auto picked, where it did
            ms = [x for x, _ in launches]
            row = {"layout": name, "rate": rate if n > 1 else "loopback", "ms": statistics.median(ms),
                   "link_bytes": round(statistics.median(b for _, b in launches)), "launches_ms": ms,
                   "launches_link_bytes": [round(b) for _, b in launches]}  # fmt: skip
            if tokens is not None:
                row["tokens"] = tokens
                row["comm_dtype"] = "/".join(sorted(wires))  # the planner prices the wire that ran
            row.update(hosts=n, per_host=per_host)
            rows.append(row)
            print(f"{name:24s} {row['rate']:9s} {row['ms']:8.2f} ms/{unit} (launches: "
                  f"{', '.join(f'{x:.2f}' for x in ms)}) {row['link_bytes']:10,d} B/{unit}", flush=True)  # fmt: skip
    for r in rows:  # greedy tokens of the q8 wire against fp32's at the same rate
        fp32 = [x for x in rows if x["layout"] == "tp=2 across the link" and x["rate"] == r["rate"]]
        if "q8" in r["layout"] and fp32:
            r["same_tokens_as_fp32"] = r["tokens"] == fp32[0]["tokens"]
    meta = {"date": t0, "end": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "load_start": load0,
            "load_end": os.getloadavg(), "cpu": _cpu(), "model": a.model or "built-in", "quantize": a.quantize,
            "what": "train step" if a.train else "decode token", "backend": "gloo", "threads_per_rank": 1,
            "launches": a.launches, "pinned": a.pin}  # fmt: skip
    if a.train:
        meta.update({"shape": TRAIN_SHAPE, "model_section": _shape()[0], "steps": _shape()[2], **_shape()[1]})
    else:
        meta.update({"short": SHORT, "long": LONG})
    a.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")


def _predict(a: argparse.Namespace, cfg) -> None:
    """The planner's figure beside every measured row of a.out (after the runs: the calibration
    may measure first, never during them); writes a.out again and its plot."""
    data = json.loads(a.out.read_text())
    predictor = Predictor(cfg, data["meta"].get("quantize"))
    train = data["meta"]["what"] == "train step"
    for row in data["rows"]:
        name, n, per_host, rate = row["layout"], row["hosts"], row["per_host"], row["rate"]
        if train:
            row["predicted_ms"] = predictor.step_ms(name, n, per_host, rate, _shape()[1])
        else:
            wire = row.get("comm_dtype", "q8" if "q8" in name else "fp32")
            if "/" in wire:  # launches that picked different formats: priced as the layout names it
                wire = "q8" if "q8" in name else "fp32"
            row["predicted_ms"] = predictor.decode_ms(name, n, per_host, rate, prompt=16, wire=wire)
        row["predicted_ms"] = float(row["predicted_ms"])  # a fresh calibration's fits are numpy floats
        row["predicted_over_measured"] = row["predicted_ms"] / row["ms"]
        row["within_25pct"] = bool(0.75 <= row["predicted_over_measured"] <= 1.25)
        if "launches_ms" in row:  # how many of the launches the planner is within 25% of
            row["launches_within_25pct"] = sum(0.75 <= row["predicted_ms"] / x <= 1.25 for x in row["launches_ms"])
        print(f"{name:24s} {rate:9s} {row['ms']:8.2f} ms, planner {row['predicted_ms']:8.2f} ms "
              f"({row['predicted_over_measured']:.2f}x)", flush=True)  # fmt: skip
    data["meta"]["calibration"] = predictor.cal.created
    a.out.write_text(json.dumps(data, indent=1) + "\n")
    _plot(data["rows"], a.out.with_suffix(".png"), "training step" if train else "decode token")
    inside = sum(r["within_25pct"] for r in data["rows"])
    print(f"planner within 25%: {inside} of {len(data['rows'])} rows")


def _plot(rows: list[dict], path: Path, what: str) -> None:
    """Measured ms against the link's rate per layout (dots), the planner's beside them (crosses)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    order = list(dict.fromkeys(r["rate"] for r in rows if r["rate"] != "loopback"))
    for i, name in enumerate(LAYOUTS):
        pts = [r for r in rows if r["layout"] == name]
        color = f"C{i}"
        if pts and pts[0]["rate"] == "loopback":
            ax.axhline(pts[0]["ms"], ls="--", color=color, label=f"{name} (loopback)")
            ax.axhline(pts[0]["predicted_ms"], ls=":", color=color)
        elif pts:
            x = [order.index(r["rate"]) for r in pts]
            ax.plot(x, [r["ms"] for r in pts], "o-", color=color, label=name)
            for xi, r in zip(x, pts, strict=True):  # the launches' spread around their median
                ms = r.get("launches_ms", [r["ms"]])
                ax.vlines(xi, min(ms), max(ms), color=color, lw=1)
            ax.plot(x, [r["predicted_ms"] for r in pts], "x:", color=color)
    ax.set_xticks(range(len(order)), order)
    ax.set_yscale("log")
    ax.set_xlabel("link rate (tbf)")
    ax.set_ylabel(f"ms per {what.split()[-1]}")
    ax.set_title(f"{what}, 2 ranks, gloo: o measured (median; bar: launches), x planner", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
