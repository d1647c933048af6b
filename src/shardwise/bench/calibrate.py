"""`this-host`: a cluster built from measurements of this machine, cached in a JSON file.

The measuring lives here, in bench/; the planner only reads the result, a
shardwise.planner.specs.Cluster (Calibration.cluster). `shardwise plan --cluster this-host`
wires the two (cli/plan.py).

One device is one CPU core running one rank with one thread (as shardwise's launcher
starts ranks). Measured (shardwise.bench.measure):
- matmul FLOP/s per dtype (128 rows through layer-shaped weights), weight-streaming
  bandwidth (one row through 384 MiB of them), fp32 matmul FLOP/s at 2 to 64 rows (a
  batched decode step; the planner interpolates between them) and the fixed time per
  layer and per forward (a tiny model's decode step), on one core alone, then on every core at once
  (what a core keeps of its rates while the others work: busy_compute, busy_memory);
- a training forward and backward on one core, as shardwise.train runs a micro-step: its
  fixed time per layer and per micro-step (a tiny model; whole, and as one tp=2 rank's shard
  on a dry-run communicator), its element-wise work per activation value (a model whose
  products are small), and the share of the matmul FLOP/s it reaches (two layers
  of hidden 1024, 256 tokens): train_efficiency, for the planner's training steps; the
  same on every core at once (busy_train); and the bytes/s of an AdamW update of those
  weights (optimizer_gbps);
- the quantized linear kernels (fbgemm's fp16 linear; the GGUF block formats' kernels, Q8_0
  also for `--quantize int8`, which runs on it on CPU) at 1 to 128 rows through the same
  layer-shaped weights, alone and on every core at once (quantized_probe_rank), for the
  planner's quantized projections and a GGUF file computed in its own formats;
- the native decode step's fixed time per layer and per step (shardwise.kernels.step: a step's
  layers in one C call), a tiny model's decode step at 1 and 5 layers (measure.decode_step_rank);
- `shardwise serve`'s own costs per step, per sequence in a step and per request, on the
  built-in tiny model (shardwise.bench.serve_probe), for the planner's serving throughput;
- all-reduce latency and bus bandwidth over 2 ranks for every available backend
  (shardwise.bench.comm.measure_all_reduce), fitted to time = latency + n / busbw; and
  what a small all-reduce costs more inside a step, after a burst of compute, for bursts
  of 0.1 to 10 ms (measure.after_compute_rank): the planner adds it to every collective,
  for the burst that precedes it in the step it predicts;
- the same for the two other paths a job's collectives take (shardwise.bench.hostlinks):
  "shm", the shared-memory all-reduce of a tp group inside one host (the default there), and
  "veth", tcp collectives (gloo point-to-point) across a link between two hosts made as network namespaces (root only), with
  one point-to-point message's time on each. `cluster()` puts the shared-memory all-reduce
  over gloo between this host's devices; `hosts()` describes several such hosts joined by
  veth links of a given rate (what benchmarks/bench_links.py runs).

Every figure is the fastest of several tries (per rank, then the median over ranks): the
machine may be shared, and load elsewhere only ever adds time. Except across the veth: there
gloo runs in a fast or a slow regime fixed per launch, and its figures are the median of 3
launches (hostlinks._median), each launch's headline figures kept (`per_launch`).

The cache (~/.cache/shardwise/calibration.json; $SHARDWISE_CACHE_DIR overrides the folder)
is reused while host, core count and torch version match; --recalibrate measures again.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from shardwise.bench.fits import after_compute_extra_us, fit_link, monotone_times
from shardwise.planner.specs import Cluster, Device, Link, PlannerError

__all__ = [
    "Calibration",
    "calibrate",
    "load_calibration",
    "this_host",
    "cache_path",
    "fit_link",
    "after_compute_extra_us",
    "wait_idle",
    "quantized_probe_rank",
    "QUANT_ROWS",
]

COMM_SIZES = [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20]
VERSION = 21
"""Bumped when the measurements change meaning: a cache of another version is measured again
(6: the quantized linear kernels; 7: the shared-memory and veth paths, point-to-point times;
8: the native decode step's fixed costs, and each path's collectives inside a decode step;
9: a decode step's collectives as the mean call with the step's spill, the q8 wire's across
hosts, and the cache-resident streaming rate; 10: the after-compute probe at 256 KiB too;
11: across hosts, pp=2's decode step and its message between the stages; 12: the veth's
probes the median of 3 launches, not the fastest of 2; 13: int8 on CPU measured as what runs it,
the Q8_0 block kernel, not fbgemm's, and the GGUF block formats a file is computed in; 14: the
AdamW update as shardwise.train runs it, torch's fused kernel; 15: across hosts, the
collectives over direct TCP connections, shardwise.comm.tcp, as a tp group there runs them;
16: across hosts, the native decode step's all-reduces too, handed to the tcp path; 17: the
native step's all-reduce with its spill, as the per-op path's; 18: the decode probe's greedy
choice as generate makes it, each rank's best and one all-gather, no logits gathered and no
token broadcast; 19: the tcp path's waits retried for 2 ms, yielding, before select: its
all-reduces inside a decode step; 20: the training probe as shardwise.train runs a micro-step
(build_model, the vocab-parallel loss), its fixed times also for one tp=2 rank's shard, and
the element-wise work a tp group does not split, train_unsplit_ns; 21: across hosts, pp=2's
decode message at three stage sizes, by how long its receiver waited, and the native decode
step's fixed costs on a rank of a tp=2 group inside the host)."""
QUANT_ROWS = (1, 2, 4, 8, 16, 32, 64, 128)
"""Rows of the quantized kernel probe: one sequence decoding up to a short prompt."""


@dataclass
class Calibration:
    host: str
    torch: str
    devices: int
    """CPU cores this process may run on: one rank per core."""
    memory_gib: float
    """Host memory, shared by all ranks."""
    gemm_tflops: dict[str, float]
    """One core alone."""
    mem_gbps: float
    """One core alone."""
    layer_overhead_us: float
    step_overhead_us: float
    rows_tflops: dict[str, float] = field(default_factory=dict)
    """fp32 matmul TFLOP/s of m rows through layer-shaped weights, by m (one core alone)."""
    busy_rows_tflops: dict[str, float] = field(default_factory=dict)
    """The same with every core busy."""
    busy_compute: float = 1.0
    busy_memory: float = 1.0
    """A core's FLOP/s and bandwidth while every core works, as a fraction of its rates alone."""
    train_efficiency: float = 1.0
    train_layer_overhead_us: float | None = None
    train_step_overhead_us: float | None = None
    """A training forward and backward on one core: the share of the matmul FLOP/s it reaches,
    and its fixed time per layer and per micro-step (measure._training_probe; version 3)."""
    train_tp_layer_overhead_us: float | None = None
    train_tp_step_overhead_us: float | None = None
    """The same fixed times for one tp=2 rank's shard, its collectives answered by a dry-run
    communicator (the region copies' autograd functions, the vocab-parallel loss; version 20)."""
    train_unsplit_ns: float | None = None
    """Nanoseconds per activation value (a token's hidden entry, per layer) of a training forward
    and backward's element-wise work around its products, which a tp group does not split
    (measure._small_steps; version 20). train_efficiency is fitted net of it."""
    busy_train: float | None = None
    """A core's speed at that training micro-step while every core runs it, as a fraction of
    its speed alone (None: as busy_compute)."""
    serve_overheads: dict[str, float] = field(default_factory=dict)
    """`shardwise serve`'s own costs (shardwise.bench.serve_probe): step_us, row_us, request_us;
    empty when the server's dependencies are missing."""
    optimizer_gbps: float | None = None
    """Bytes/s of PyTorch's AdamW update on one core, counting one read and one write of the
    weights, gradients and moments (it makes several passes; None: mem_gbps)."""
    quantized_rows_tflops: dict[str, dict[str, float]] = field(default_factory=dict)
    """`--quantize` scheme -> TFLOP/s of its linear kernel at m rows, by m (one core alone;
    quantized_probe_rank); a scheme this torch cannot run is missing."""
    busy_quantized_rows_tflops: dict[str, dict[str, float]] = field(default_factory=dict)
    """The same with every core busy."""
    links: dict[str, dict] = field(default_factory=dict)
    """backend -> {"latency_us", "busbw_gbps", "points": [{"size_bytes", "latency_us"}, ...],
    "after_compute": [{"burst_us", "extra_us"}, ...]}: all-reduces of idle ranks, and what a
    small one costs more inside a step right after a burst of compute of that length."""
    unavailable: dict[str, str] = field(default_factory=dict)
    """backend -> why it could not be measured."""
    created: str = ""
    seconds: float = 0.0
    busy_launches: int = 0
    """Probes that started while other processes were running (after waiting up to 30 s)."""
    version: int = VERSION
    """The measurements' meaning (a file without the field: 0, measured again)."""
    native_layer_overhead_us: float | None = None
    native_step_overhead_us: float | None = None
    """A decode step's fixed time per layer and per step where its layers run as one native
    call (shardwise.kernels.step; measure.decode_step_rank, 1 vs 5 layers, one core); None:
    the native step does not run here."""
    native_tp_layer_overhead_us: float | None = None
    native_tp_step_overhead_us: float | None = None
    """The same on a tp=2 group inside this host, less its collectives' calls
    (measure.decode_shard_rank); None: one core, or not measured."""
    cache_gbps: float | None = None
    """One row through weights that stay in the last-level cache (measure.probe_rank), one core
    alone; None: not measured (version < 9)."""
    busy_cache: float = 1.0
    """The same while every core streams its own, as a fraction of the rate alone."""
    cache_bytes: float = 0.0
    """This host's last-level cache (sysfs), shared by its cores; 0: unknown."""

    def link(self, name: str) -> Link:
        """The calibrated link of a backend (gloo, mpi) or path (shm, veth)."""
        if name not in self.links:
            why = self.unavailable.get(name, "not measured")
            raise PlannerError(
                f"backend {name!r} has no calibration on this host ({why}); calibrated: {', '.join(self.links)}"
                + ("; --recalibrate measures it" if self.version < VERSION else "")
            )
        v = self.links[name]
        pts = tuple(monotone_times([(pt["size_bytes"], pt["latency_us"] * 1e-6) for pt in v["points"]]))
        # NOTE: each after-compute extra against the monotone idle 4 KiB figure (the probe's size),
        # from the probe's own per-call time where recorded (extra_us as written used the raw one)
        idle_us = pts[0][1] * 1e6 if pts and pts[0][0] == 4096 else None
        after = tuple(
            (pt["burst_us"] * 1e-6, (after_compute_extra_us(pt["per_call_us"], idle_us)
                                     if "per_call_us" in pt and idle_us is not None else pt["extra_us"]) * 1e-6)
            for pt in v.get("after_compute", ())
        )  # fmt: skip
        decode = tuple(
            (d["op"], d["bytes"], d["us"] * 1e-6, d.get("burst_us", 0.0) * 1e-6) for d in v.get("decode", ())
        )
        big = v.get("after_compute_big", ())
        big_bytes = big[0]["size_bytes"] if big else 0
        idle_big = dict(pts).get(big_bytes)
        after_big = tuple(
            (pt["burst_us"] * 1e-6, max(0.0, pt["per_call_us"] * 1e-6 - idle_big)) for pt in big
        ) if idle_big is not None else ()  # fmt: skip
        native = v.get("native_all_reduce")
        hops = v.get("decode_hop") or ()
        hops = [hops] if isinstance(hops, dict) else hops  # before v21: one probe, its idle not recorded
        return Link(f"{name} (measured)", v["busbw_gbps"], v["latency_us"], pts, after, send_us=v.get("send_us"),
                    decode=decode, native_all_reduce=None if native is None else (native["bytes"], self._native_us(native) * 1e-6),
                    after_compute_big=after_big, after_big_bytes=big_bytes if after_big else 0,
                    decode_hop=tuple((h.get("idle_us", 0.0) * 1e-6, h["bytes"], h["hop_us"] * 1e-6) for h in hops))  # fmt: skip

    def _native_us(self, native: dict) -> float:
        """One all-reduce inside the native decode step (hostlinks' "native_all_reduce"): its
        call, plus its share of what the probe's step took beyond its collectives' calls and a
        tp rank's fixed times at its layers (native_tp_*: across hosts the step stops at each
        all-reduce to hand it to the tcp path, and resumes after it, outside the call's clock;
        on the Zen 3 VM of 2026-12-08 the veth probe's step less its calls was 0.93-0.98 ms,
        a tp rank's fixed times inside the host 0.66-0.76). Where either is missing, the figure as recorded."""
        fixed = self.native_tp_step_overhead_us, self.native_tp_layer_overhead_us
        if None in fixed or "step_us" not in native:
            return native["us"]
        beyond = native["step_us"] - native["inside_us"] - fixed[0] - native["layers"] * fixed[1]
        return native["us"] - native.get("spill_us", 0.0) + max(0.0, beyond) / max(native["calls"], 1)

    def intra_link(self, link: str = "gloo", *, shm: bool = True) -> Link:
        """The link between two ranks of this host: backend `link`'s, under the shared-memory
        all-reduce when `shm` and it is calibrated (what a tp group inside one host uses by
        default: shardwise.comm.shm, SHARDWISE_SHM_ALLREDUCE)."""
        from shardwise.comm.shm import DEFAULT_MAX_BYTES

        base = self.link(link)
        if not shm or "shm" not in self.links:
            return base
        return replace(self.link("shm"), name=f"shm over {link} (measured)", via=base, max_bytes=DEFAULT_MAX_BYTES)

    def cluster(self, link: str = "gloo", *, shm: bool = True) -> Cluster:
        """The planner's view of this host, with the link of backend `link` between its devices
        (under the shared-memory all-reduce when `shm`: intra_link; the other calibrated backends'
        links in other_links)."""
        links = {b: self.link(b) for b in self.links if b not in ("shm", "veth")}
        intra = self.intra_link(link, shm=shm)
        device = Device(
            name=f"CPU core of {self.host} (1 thread)",
            memory_gib=self.memory_gib,
            peak_tflops=dict(self.gemm_tflops),
            mem_bw_gbps=self.mem_gbps,
            matmul_efficiency=1.0,
            mem_efficiency=1.0,
            layer_overhead_us=self.layer_overhead_us,
            step_overhead_us=self.step_overhead_us,
            reserved_gib=min(2.0, self.memory_gib / 4),
            busy_compute=self.busy_compute,
            busy_memory=self.busy_memory,
            rows_tflops=tuple(sorted((int(m), v) for m, v in self.rows_tflops.items())),
            busy_rows_tflops=tuple(sorted((int(m), v) for m, v in self.busy_rows_tflops.items())),
            train_efficiency=self.train_efficiency,
            train_layer_overhead_us=self.train_layer_overhead_us,
            train_step_overhead_us=self.train_step_overhead_us,
            train_tp_layer_overhead_us=self.train_tp_layer_overhead_us,
            train_tp_step_overhead_us=self.train_tp_step_overhead_us,
            train_unsplit_ns=self.train_unsplit_ns,
            busy_train=self.busy_train,
            optimizer_gbps=self.optimizer_gbps,
            serve_step_us=self.serve_overheads.get("step_us", 0.0),
            serve_row_us=self.serve_overheads.get("row_us", 0.0),
            serve_request_us=self.serve_overheads.get("request_us", 0.0),
            quantized_rows_tflops=_by_rows(self.quantized_rows_tflops),
            busy_quantized_rows_tflops=_by_rows(self.busy_quantized_rows_tflops),
            native_layer_overhead_us=self.native_layer_overhead_us,
            native_step_overhead_us=self.native_step_overhead_us,
            native_tp_layer_overhead_us=self.native_tp_layer_overhead_us,
            native_tp_step_overhead_us=self.native_tp_step_overhead_us,
            cache_gbps=self.cache_gbps,
            busy_cache=self.busy_cache,
            cache_bytes=self.cache_bytes,
        )
        return Cluster(
            name="this-host",
            device=device,
            devices=self.devices,
            devices_per_node=self.devices,
            intra=intra,
            shared_memory=True,
            other_links={b: lk for b, lk in links.items() if b != link},
            notes=(
                f"calibrated {self.created} ({cache_path()})"
                + (
                    f"; {self.busy_launches} probe(s) started while other processes ran: --recalibrate when idle"
                    if self.busy_launches
                    else ""
                ),
            ),
        )

    def hosts(self, nodes: int, per_node: int, *, rate_gbps: float | None = None, bucket_bytes: float = 0.0,
              link: str = "gloo", shm: bool = True) -> Cluster:  # fmt: skip
        """`nodes` hosts of `per_node` devices like this one's, joined by links of `rate_gbps`
        (GB/s; None: the veth's own speed) with a token bucket of `bucket_bytes` (tc's tbf;
        0 for a line rate): between hosts, tcp across the calibrated veth link, shaped
        (specs.Link.shaped); inside a host, intra_link. NOTE: the devices keep this host's rates
        with every core busy, as the namespace hosts of one machine share its cores."""
        one = self.cluster(link, shm=shm)
        inter = self.link("veth")
        if rate_gbps is not None:
            inter = inter.shaped(rate_gbps, bucket_bytes, name=f"tcp across a link of {rate_gbps * 8:g} Gbit/s")
        return replace(
            one, name=f"{nodes} hosts like this one", devices=nodes * per_node, devices_per_node=per_node, inter=inter
        )

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> Calibration:
        return cls(**{"version": 0, **json.loads(text)})


def _by_rows(table: dict[str, dict[str, float]]) -> dict[str, tuple[tuple[int, float], ...]]:
    """{scheme: {"m": TFLOP/s}} (JSON) -> {scheme: ((m, TFLOP/s), ...)} by increasing m (specs.Device)."""
    return {s: tuple(sorted((int(m), v) for m, v in rates.items())) for s, rates in table.items() if rates}


def quantized_probe_rank(world, opts: dict) -> dict:
    """TFLOP/s of the quantized linear kernels with m rows (QUANT_ROWS) through the fp32
    probe's layer-shaped weights (measure.probe_rank: 6 layers of hidden 1024, 384 MiB in fp32,
    beyond the caches), every rank of `world` at once:

        fp16       torch.ops.quantized.linear_dynamic_fp16 on linear_prepack_fp16(W) (fbgemm)
        Q8_0 ...   BlockWeight.linear on the weights in each GGUF block format a file is
                   computed in (STORED_FORMATS; the native kernels, or their PyTorch fallback)
        int8       what `--quantize int8` runs on CPU: the Q8_0 blocks (shardwise.kernels.rows)

    {"fp16": {"1": TFLOP/s, "2": ...}, "Q8_0": {...}, ...}; fp16 missing where fbgemm is (not x86)."""
    import torch

    from shardwise.bench.measure import _layers, best_time
    from shardwise.planner.specs import STORED_FORMATS

    torch.manual_seed(world.rank)
    out: dict[str, dict[str, float]] = {}
    schemes = (("fp16",) if "fbgemm" in torch.backends.quantized.supported_engines else ()) + STORED_FORMATS
    for scheme in schemes:
        if scheme == "fp16":
            weights = _layers(torch.float32)
            params = sum(w.numel() for w in weights)
            run, packed = _fp16_linears(weights)
            del weights
        else:
            run, packed, params = _block_linears(scheme)
        out[scheme] = {}
        for m in QUANT_ROWS:
            xs = {n: torch.randn(m, n) for n in {n for _, n in packed}}

            def through(xs=xs, run=run, packed=packed):
                for p, n in packed:
                    run(xs[n], p)

            out[scheme][str(m)] = 2 * m * params / best_time(through, opts["repeats"], sync=world) / 1e12
        del run, packed
    out["int8"] = dict(out["Q8_0"])
    return out


def _block_linears(fmt: str) -> tuple:
    """(run(x, w) -> x W^T, [(BlockWeight, in features), ...], weights): the probe's layer
    shapes held in block format `fmt` on huge pages as loaded (shardwise.memory.on_huge_pages),
    each matrix a 256-row quantized tile repeated (the kernels' time does not depend on the values)."""
    import torch

    from shardwise.kernels.block import BlockWeight
    from shardwise.kernels.quantize import quantize_rows
    from shardwise.memory import on_huge_pages

    h, packed, params = 1024, [], 0
    for _ in range(6):
        for rows, cols in ((3 * h, h), (h, h), (8 * h, h), (h, 4 * h)):
            tile = quantize_rows(torch.randn(256, cols), fmt)
            packed.append((BlockWeight.of([(fmt, on_huge_pages(tile.repeat(rows // 256, 1)))], cols), cols))
            params += rows * cols
    return (lambda x, w: w.linear(x)), packed, params


def _fp16_linears(weights: list) -> tuple:
    """(run(x, packed) -> x W^T, [(packed W, in features), ...]): fbgemm's fp16 linear."""
    import torch

    ops = torch.ops.quantized
    return ops.linear_dynamic_fp16, [(ops.linear_prepack_fp16(w, None), w.shape[1]) for w in weights]


def cache_path() -> Path:
    root = os.environ.get("SHARDWISE_CACHE_DIR")
    if root is None:
        root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "shardwise"
    return Path(root) / "calibration.json"


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _memory_gib() -> float:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return 8.0


def _llc_bytes() -> float:
    """The last-level cache of cpu0 in bytes (sysfs: the highest cache index's size), 0 if unknown."""
    root = Path("/sys/devices/system/cpu/cpu0/cache")
    try:
        sizes = [(int(d.name[5:]), (d / "size").read_text().strip()) for d in root.glob("index*")]
    except (OSError, ValueError):
        return 0.0
    if not sizes:
        return 0.0
    text = max(sizes)[1]
    scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:].upper(), 1)
    try:
        return float(text.rstrip("KMGkmg")) * scale
    except ValueError:
        return 0.0


def wait_idle(max_s: float = 30.0) -> bool:
    """Wait until no other process has been runnable for 1 s (sampled from /proc/loadavg), at
    most max_s; True if the machine went idle (or cannot tell)."""
    t0, quiet = time.time(), 0
    while time.time() - t0 < max_s:
        try:
            running = int(Path("/proc/loadavg").read_text().split()[3].split("/")[0]) - 1  # less this process
        except (OSError, ValueError, IndexError):
            return True
        quiet = quiet + 1 if running <= 0 else 0
        if quiet >= 5:
            return True
        time.sleep(0.2)
    return False


def _measure_links(
    devices: int, backends: list[str], repeats: int, rounds: int, log, quiet, flops: float
) -> tuple[dict, dict]:
    from shardwise.bench.comm import available_backends, measure_all_reduce
    from shardwise.bench.hostlinks import send_probe
    from shardwise.bench.measure import AFTER_COMPUTE_BIG, after_compute_rank
    from shardwise.launch import launch

    links, unavailable = {}, {}
    if devices < 2:
        return links, {b: "one core: no collectives between devices" for b in backends}
    found = available_backends()
    for b in backends:
        if b not in found:
            unavailable[b] = "not available here"
            continue
        log(f"calibrating: all-reduce over 2 ranks, backend {b}")
        best: dict[int, float] = {}
        try:
            for _ in range(rounds):  # the best of the rounds' medians (see measure.best_time)
                quiet()
                for pt in measure_all_reduce(b, 2, COMM_SIZES, repeats):
                    best[pt.size_bytes] = min(best.get(pt.size_bytes, float("inf")), pt.latency_us)
            log(f"calibrating: all-reduces between bursts of compute, backend {b}")
            tries = []
            for _ in range(2):  # the better of two launches, burst by burst (see measure.best_time)
                quiet()
                tries.append(launch(after_compute_rank, 2, args=({"flops": flops},), backend=b)[0]["points"])
            after = [min(pts, key=lambda pt: pt["per_call_us"]) for pts in zip(*tries, strict=True)]
            quiet()
            values, bursts = AFTER_COMPUTE_BIG
            big = launch(after_compute_rank, 2, args=({"flops": flops, "values": values, "bursts_ms": bursts},),
                         backend=b)[0]["points"]  # fmt: skip
            quiet()
            send_us = launch(send_probe, 2, backend=b)[0]
        except Exception as e:  # noqa: BLE001 - a backend that fails is reported, not fatal
            unavailable[b] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]
            continue
        pts = sorted(best.items())
        lat, bw = fit_link([(n, us * 1e-6) for n, us in pts])
        idle = best[COMM_SIZES[0]]  # NOTE: the probe's all-reduces are 4 KiB, COMM_SIZES[0]
        links[b] = {
            "latency_us": lat,
            "busbw_gbps": bw,
            "send_us": send_us,
            "points": [{"size_bytes": n, "latency_us": us} for n, us in pts],
            "after_compute": [
                {
                    "burst_us": pt["burst_us"],
                    "per_call_us": pt["per_call_us"],
                    "extra_us": after_compute_extra_us(pt["per_call_us"], idle),
                }
                for pt in after
            ],
            "after_compute_big": [{**pt, "size_bytes": AFTER_COMPUTE_BIG[0] * 4} for pt in big],
        }
    return links, unavailable


def calibrate(*, backends: list[str] | None = None, repeats: int = 5, log=None, quantized: bool = True) -> Calibration:
    """Measure this host (about 30 s idle; minutes on a busy machine). quantized=False leaves
    out the quantized kernels' probes (the planner then plans no `--quantize` here)."""
    import torch

    from shardwise.bench.measure import probe_rank
    from shardwise.launch import launch

    log = log or (lambda msg: print(msg, file=sys.stderr))
    t0 = time.time()
    devices = _cores()
    busy_launches = 0

    def quiet() -> None:
        nonlocal busy_launches
        busy_launches += not wait_idle()

    log("calibrating: matmul and memory probes on one core")
    quiet()
    alone = launch(probe_rank, 1, args=({"repeats": repeats, "training": True},))[0]
    busy = alone
    if devices > 1:
        log(f"calibrating: the same on {devices} cores at once")
        quiet()
        per_rank = launch(probe_rank, devices, args=({"repeats": repeats, "training": True},))
        busy = {k: statistics.median(r[k] for r in per_rank) for k in ("mem_gbps", "train_s", "cache_gbps")}
        busy["gemm_tflops"] = {"float32": statistics.median(r["gemm_tflops"]["float32"] for r in per_rank)}
        busy["rows_tflops"] = {
            m: statistics.median(r["rows_tflops"][m] for r in per_rank) for m in alone["rows_tflops"]
        }
    log("calibrating: quantized linear kernels (fp16, int8 and the GGUF block formats) on one core")
    quiet()
    q_alone = launch(quantized_probe_rank, 1, args=({"repeats": repeats},))[0] if quantized else {}
    q_busy = q_alone
    if devices > 1 and q_alone:
        log(f"calibrating: the same on {devices} cores at once")
        quiet()
        per_rank = launch(quantized_probe_rank, devices, args=({"repeats": repeats},))
        q_busy = {s: {m: statistics.median(r[s][m] for r in per_rank) for m in v} for s, v in q_alone.items()}
    flops = alone["gemm_tflops"]["float32"] * 1e12
    quiet()
    from shardwise.bench.serve_probe import serving_overheads

    serve = serving_overheads(log=log) or {}
    native = _native_step_overheads(log, quiet, devices)
    links, unavailable = _measure_links(devices, backends or ["gloo", "mpi"], 10 * repeats, 3, log, quiet, flops)
    if devices > 1:
        from shardwise.bench.hostlinks import measure_paths

        paths, missing = measure_paths(flops=flops, log=log, quiet=quiet)
        links.update(paths)
        unavailable.update(missing)
    return Calibration(
        host=platform.node() or "localhost",
        torch=torch.__version__,
        devices=devices,
        memory_gib=_memory_gib(),
        gemm_tflops=alone["gemm_tflops"],
        mem_gbps=alone["mem_gbps"],
        layer_overhead_us=alone["layer_overhead_us"],
        step_overhead_us=alone["step_overhead_us"],
        rows_tflops=alone["rows_tflops"],
        busy_rows_tflops=busy.get("rows_tflops", alone["rows_tflops"]),
        busy_compute=min(1.0, busy["gemm_tflops"]["float32"] / alone["gemm_tflops"]["float32"]),
        busy_memory=min(1.0, busy["mem_gbps"] / alone["mem_gbps"]),
        cache_gbps=alone["cache_gbps"],
        busy_cache=min(1.0, busy["cache_gbps"] / alone["cache_gbps"]),
        cache_bytes=_llc_bytes(),
        train_efficiency=alone["train_efficiency"],
        train_layer_overhead_us=alone["train_layer_overhead_us"],
        train_step_overhead_us=alone["train_step_overhead_us"],
        train_tp_layer_overhead_us=alone["train_tp_layer_overhead_us"],
        train_tp_step_overhead_us=alone["train_tp_step_overhead_us"],
        train_unsplit_ns=alone["train_unsplit_ns"],
        busy_train=min(1.0, alone["train_s"] / busy.get("train_s", alone["train_s"])),
        optimizer_gbps=alone["optimizer_gbps"],
        quantized_rows_tflops=q_alone,
        busy_quantized_rows_tflops=q_busy,
        serve_overheads=serve,
        links=links,
        unavailable=unavailable,
        created=time.strftime("%Y-%m-%d %H:%M:%S"),
        seconds=time.time() - t0,
        busy_launches=busy_launches,
        version=VERSION,
        **native,
    )


def _native_step_overheads(log, quiet, devices: int = 1) -> dict:
    """The native decode step's fixed times per layer and per step on one core: the decode
    probe (measure.decode_step_rank) at 1 and 5 layers, the faster of two launches each; {}
    where the native step does not run. With 2 cores or more, the same for a rank of a tp=2
    group inside this host less its collectives' calls (measure.decode_shard_rank): a rank of
    a group does more besides them (the split head, the greedy choice's gather, the group's
    bookkeeping; on the Zen 3 VM of 2026-12-08, 661-761 us a step against 249-399 alone)."""
    from shardwise.bench.measure import decode_shard_rank
    from shardwise.launch import launch

    out = {}
    for ranks, prefix in ((1, "native"), (2, "native_tp")):
        if ranks > devices:
            break
        log(f"calibrating: the native decode step's fixed costs on {ranks} core{'s' * (ranks > 1)}")
        best = {}
        for layers in (1, 5):
            runs = []
            for _ in range(2):
                quiet()
                runs.append(launch(decode_shard_rank, ranks, args=({"layers": layers},))[0])
            if not all(r["native"] for r in runs):
                return out
            best[layers] = min(r["fixed_us"] for r in runs)
        layer = max(best[5] - best[1], 0.0) / 4
        out |= {f"{prefix}_layer_overhead_us": layer, f"{prefix}_step_overhead_us": max(best[1] - layer, 0.0)}
    return out


def load_calibration(*, recalibrate: bool = False, path: Path | None = None, log=None) -> Calibration:
    """The cached calibration of this host, measured (and cached) first if missing or stale."""
    import torch

    path = path or cache_path()
    if not recalibrate and path.exists():
        try:
            cal = Calibration.from_json(path.read_text())
        except (ValueError, TypeError) as e:
            raise PlannerError(f"{path}: not a calibration file ({e}); run with --recalibrate") from None
        same_host = cal.host == (platform.node() or "localhost") and cal.devices == _cores()
        if same_host and cal.torch == torch.__version__ and cal.version == VERSION:
            return cal
    cal = calibrate(log=log)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(cal.to_json())
    return cal


def this_host(*, link: str = "gloo", recalibrate: bool = False, nodes: int = 1, shm: bool = True) -> Cluster:
    """The `this-host` cluster, with the calibrated link of backend `link` (under the
    shared-memory all-reduce when `shm`; measured first if the cache is missing or stale);
    with nodes > 1, that many hosts like it joined by the calibrated veth link (Calibration.hosts)."""
    cal = load_calibration(recalibrate=recalibrate)
    if nodes > 1:
        return cal.hosts(nodes, cal.devices, link=link, shm=shm)
    return cal.cluster(link, shm=shm)
