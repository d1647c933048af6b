"""The planner's inputs as typed values that check themselves: links, devices, clusters, workloads.

Every number that is out of range, or inconsistent with another, is refused with a
PlannerError that names the numbers, before anything is computed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Literal

from shardwise.planner.activations import recompute_mode

__all__ = [
    "PlannerError",
    "Link",
    "Device",
    "Cluster",
    "InferenceWorkload",
    "TrainingWorkload",
    "Precision",
    "PRECISIONS",
    "DTYPE_BYTES",
    "QUANTIZE",
    "STORED_FORMATS",
]

GIB = 2**30
SCHEDULES = ("gpipe", "1f1b", "interleaved")
"""shardwise.pipeline.SCHEDULE_NAMES (tests/unit/test_planner_pipeline.py checks they agree)."""
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
QUANTIZE = ("fp16", "int8")
"""Weight formats of `--quantize` (shardwise.quant.SCHEMES; tests/unit/test_planner_quantize.py
checks they agree): the projections and embeddings stored as fp16 (fbgemm's linear on CPU),
or as int8 (on CPU the Q8_0 blocks and their native kernel; footprint.weight_bytes)."""
STORED_FORMATS = ("Q8_0", "Q4_K", "Q5_K", "Q6_K")
"""GGUF block formats a file is computed in (no `--quantize`) whose kernels the calibration measures."""


class PlannerError(ValueError):
    """Input the planner cannot plan for: unknown names, impossible or inconsistent numbers."""


def _check(obj: object, *, positive: tuple[str, ...] = (), nonneg: tuple[str, ...] = ()) -> None:
    what = type(obj).__name__
    for name in positive:
        v = getattr(obj, name)
        if v is None or not (isinstance(v, int | float) and math.isfinite(v) and v > 0):
            raise PlannerError(f"{what}: {name} must be > 0, got {v}")
    for name in nonneg:
        v = getattr(obj, name)
        if not (isinstance(v, int | float) and math.isfinite(v) and v >= 0):
            raise PlannerError(f"{what}: {name} must be >= 0, got {v}")


def _loglog(points: tuple[tuple[float, float], ...] | list[tuple[float, float]], x: float) -> float:
    """y at x from (x, y) points sorted by x: log-log between two points, the nearest end's y outside."""
    if x <= points[0][0]:
        return points[0][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:], strict=False):
        if x <= x1:
            f = math.log(x / x0) / math.log(x1 / x0)
            return math.exp(math.log(y0) + f * (math.log(y1) - math.log(y0)))
    return points[-1][1]


def _extra(points: tuple[tuple[float, float], ...], burst_s: float) -> float:
    """(burst, extra) points: the extra after `burst_s`, linear in log(burst) between them,
    the nearest end's value outside; 0 without points."""
    pts = sorted(points)
    if not pts or burst_s <= 0:
        return 0.0
    if burst_s <= pts[0][0]:
        return pts[0][1]
    for (b0, e0), (b1, e1) in zip(pts, pts[1:], strict=False):
        if burst_s <= b1:
            return e0 + (e1 - e0) * math.log(burst_s / b0) / math.log(b1 / b0)
    return pts[-1][1]


_SHM_OPS = ("all_reduce", "all_gather", "broadcast")
"""What a link with a `via` (the shared-memory segment over gloo) carries itself up to max_bytes."""


@dataclass(frozen=True)
class Link:
    """An interconnect, as the all-reduce sees it (alpha-beta model).

    time(all-reduce of n bytes over p devices) = latency * ceil(log2 p) + 2 (p - 1) / p * n / busbw
    """

    name: str
    busbw_gbps: float
    """All-reduce bus bandwidth per device, GB/s (1e9 bytes), NCCL-tests convention."""
    latency_us: float
    """Time of a tiny all-reduce between 2 devices, microseconds."""
    points: tuple[tuple[int, float], ...] = ()
    """Measured (bytes, seconds) of all-reduces over 2 devices: between them, time is
    interpolated (log-log) instead of modelled."""
    after_compute: tuple[tuple[float, float], ...] = ()
    """Measured (burst seconds, extra seconds): what a collective costs more, inside a step,
    right after a burst of compute of that length, than between idle ranks (this host's
    gloo: waking a rank that gave up its core; see measure.after_compute_rank). Empty: 0."""
    after_compute_big: tuple[tuple[float, float], ...] = ()
    after_big_bytes: float = 0.0
    """The same for all-reduces of after_big_bytes (a training step's 256 KiB): the extra
    grows with the message (measured: 2.0 ms after 1.2 ms of compute across the veth at 256
    KiB, against ~0.6 ms at 4 KiB); between the two sizes log-linear. Empty: the 4 KiB one's."""
    send_us: float | None = None
    """One point-to-point message between idle devices (a small send and its receive, one way),
    microseconds; None: latency_us."""
    rate_gbps: float | None = None
    bucket_bytes: float = 0.0
    """A shaped link (a token bucket: tc's tbf, or a NIC's line rate with bucket 0): every
    transfer also waits for the bytes it sends beyond the bucket at rate_gbps (GB/s); the
    unshaped times above are the link's own (for a veth: its per-message cost). None: unshaped."""
    via: Link | None = None
    """The link under this one, for what this one does not carry: every operation but an
    all-reduce, all-gather or broadcast of up to max_bytes (the shared-memory segment over gloo:
    shardwise.comm.shm). None: this link carries everything."""
    max_bytes: float = math.inf
    decode: tuple[tuple[str, float, float, float], ...] = ()
    """Measured (op, bytes, seconds, burst seconds) of one collective inside a decode step on the
    per-op path (its layers op by op, each collective a Python call; shardwise.bench.measure.
    decode_step_rank), after the mean compute between that step's collectives (the burst): the
    short-burst end of the after-compute curve, which the synthetic probe (bursts of 0.1 ms
    and more) does not reach. An encoded wire's ops carry its name ("q8 all_to_all", "q8
    all_gather": the tp all-reduces of a step with --comm-dtype q8). Empty: not measured (the
    figures above price it)."""
    native_all_reduce: tuple[float, float] | None = None
    """Measured (bytes, seconds) of one all-reduce inside the native decode step
    (shardwise.kernels.step: the shared-memory protocol in C, no Python call); None: the
    native step's all-reduces do not run over this link."""
    decode_hop: tuple[tuple[float, float, float], ...] = ()
    """Measured (idle seconds, bytes, seconds) of one message of a pipeline's decode step over
    this link (shardwise.bench.measure.pipeline_step_rank: pp=2, the stages taking turns, so the
    hidden state's send and the sampled token's broadcast are a ping-pong with a stage's compute
    between; each message's time includes the receiving stage's resuming after its wait), one
    point per stage size: idle is how long the receiver waited (the other stage's compute), and
    a rank that waited longer resumes slower. Empty: not measured (send_us and the after-compute
    extra price it)."""

    def __post_init__(self) -> None:
        _check(self, positive=("busbw_gbps",), nonneg=("latency_us", "bucket_bytes"))
        if any(n < 0 or sec <= 0 or b < 0 for _, n, sec, b in self.decode) or (
            self.native_all_reduce is not None and (self.native_all_reduce[0] < 0 or self.native_all_reduce[1] <= 0)
        ):
            raise PlannerError(
                f"Link {self.name}: decode figures need bytes >= 0 and seconds > 0, got {self.decode}, "
                f"{self.native_all_reduce}"
            )
        if self.send_us is not None:
            _check(self, nonneg=("send_us",))
        if any(len(h) != 3 or h[0] < 0 or h[1] < 0 or h[2] <= 0 for h in self.decode_hop):
            raise PlannerError(
                f"Link {self.name}: decode_hop needs (idle >= 0, bytes >= 0, seconds > 0) points, got {self.decode_hop}"
            )
        if self.rate_gbps is not None:
            _check(self, positive=("rate_gbps",))
        if any(n <= 0 or s <= 0 for n, s in self.points):
            raise PlannerError(f"Link {self.name}: measured points must be positive, got {self.points}")
        if any(b <= 0 or e < 0 for b, e in self.after_compute):
            raise PlannerError(
                f"Link {self.name}: after_compute needs bursts > 0 and extras >= 0, got {self.after_compute}"
            )

    def _alpha(self, p: int) -> float:
        return self.latency_us * 1e-6 * math.ceil(math.log2(p))

    def _measured(self, nbytes: float) -> float | None:
        pts = sorted(self.points)
        for (n0, s0), (n1, s1) in zip(pts, pts[1:], strict=False):
            if n0 <= nbytes <= n1:
                f = math.log(nbytes / n0) / math.log(n1 / n0)
                return math.exp(math.log(s0) + f * math.log(s1 / s0))
        return None

    def extra_after_s(self, burst_s: float, nbytes: float = 4096) -> float:
        """Extra seconds of one collective of `nbytes` a rank after `burst_s` of compute: the
        measured points, interpolated linearly in log(burst) between them, the nearest end's
        value outside; beyond 4 KiB, toward the after_compute_big points, linearly in
        log(bytes) up to their size, theirs beyond."""
        small = _extra(self.after_compute, burst_s)
        if not self.after_compute_big or nbytes <= 4096:
            return small
        f = min(1.0, math.log(nbytes / 4096) / math.log(self.after_big_bytes / 4096))
        return small + f * (_extra(self.after_compute_big, burst_s) - small)

    def carrier(self, op: str, nbytes: float) -> Link:
        """The link that carries one `op` of `nbytes` per rank: this one, or the one under it (via)."""
        if self.via is not None and (op not in _SHM_OPS or nbytes > self.max_bytes):
            return self.via.carrier(op, nbytes)
        return self

    def shaped(self, rate_gbps: float, bucket_bytes: float = 0.0, *, name: str | None = None) -> Link:
        """This link with its transfers also limited to `rate_gbps` (a token bucket of `bucket_bytes`)."""
        return replace(self, name=name or f"{self.name} at {rate_gbps:g} GB/s", rate_gbps=rate_gbps,
                       bucket_bytes=bucket_bytes)  # fmt: skip

    def _wait_s(self, sent: float) -> float:
        """What the shaping adds to a transfer of `sent` bytes (each rank's): the bytes beyond the bucket, at the rate."""
        return 0.0 if self.rate_gbps is None else max(0.0, sent - self.bucket_bytes) / (self.rate_gbps * 1e9)

    def all_reduce_s(self, nbytes: float, p: int) -> float:
        """Seconds for one all-reduce of `nbytes` (each rank's buffer) over p devices (ring:
        each rank sends 2 (p - 1) / p of it)."""
        if p <= 1:
            return 0.0
        shaped = self._wait_s(2 * (p - 1) / p * nbytes)
        measured = self._measured(nbytes) if p == 2 else None
        if measured is not None:
            return measured + shaped
        return self._alpha(p) + 2 * (p - 1) / p * nbytes / (self.busbw_gbps * 1e9) + shaped

    def all_gather_s(self, nbytes_in: float, p: int) -> float:
        """Seconds for one all-gather of `nbytes_in` per rank (ring: each rank receives (p-1) pieces)."""
        if p <= 1:
            return 0.0
        sent = (p - 1) * nbytes_in
        return self._alpha(p) + sent / (self.busbw_gbps * 1e9) + self._wait_s(sent)

    def decode_s(self, op: str, nbytes: float, p: int, *, native: bool = False, burst_s: float = 0.0) -> float | None:
        """Seconds of one `op` of `nbytes` per rank over p devices inside a decode step, after
        `burst_s` of compute: native, the native step's all-reduce as measured; else the decode
        figure, plus what the after-compute probe's collectives grow between its shortest burst
        and `burst_s` (extra_after_s: 0 up to that burst; a decode step's bursts are shorter);
        plus the bytes beyond the measured message's at the bus bandwidth and beyond the bucket
        at the rate. None where not measured (or p > 2: measured over 2 ranks).

        NOTE: only the after-compute probe's growth, never its level: that level is the idle
        4 KiB all-reduce plus an extra, and gloo's idle figure across the veth swings between
        launches (0.5 and 2.2 ms on one machine, 2026-12-05), while the decode probe's call is
        the step's own (the built-in model's calls, hidden 256, within 10% of the probe's, hidden
        64, in the same runs: docs/benchmarks/links.md)."""
        if p != 2:
            return None
        if native and op == "all_reduce":
            found = None if self.native_all_reduce is None else (*self.native_all_reduce, 0.0)
        else:
            found = next(((n, sec, b) for o, n, sec, b in self.decode if o == op), None)
        if found is None:
            return None
        measured_bytes, sec, b0 = found
        if not native and self.after_compute and burst_s > b0:
            sec += max(0.0, self.extra_after_s(burst_s) - self.extra_after_s(max(b0, 1e-12)))
        # of each rank's bytes; an encoded wire's ops ("q8 all_to_all") move as their op does
        moved = {"all_reduce": 2 * (p - 1) / p, "all_gather": p - 1, "all_to_all": (p - 1) / p}.get(op.split()[-1], 1.0)
        extra = max(0.0, nbytes - measured_bytes) * moved
        return sec + extra / (self.busbw_gbps * 1e9) + self._wait_s(nbytes * moved)

    def hop_s(self, nbytes: float, idle_s: float = 0.0) -> float | None:
        """Seconds of one message of `nbytes` between two pipeline stages in a decode step, its
        receiver having waited `idle_s` for it (decode_hop: each point's time less its bytes at
        the bus bandwidth, linear in log(idle) between the points, the nearest end's outside),
        plus its bytes at the bus bandwidth and beyond the bucket at the rate; None where not
        measured; each point at least any shorter wait's."""
        if not self.decode_hop:
            return None
        bw = self.busbw_gbps * 1e9
        # NOTE: a longer wait never makes the message cheaper: a point below a shorter wait's is
        # the probe's noise (its hop is the step less the stages alone, both ~12 ms at the
        # largest stage), so each point is at least every shorter wait's
        pts, most = [], 0.0
        for idle, n, sec in sorted(self.decode_hop):
            most = max(most, sec - n / bw)
            pts.append((idle, most))
        fixed = _extra(tuple(pts), max(idle_s, 1e-9))
        return fixed + nbytes / bw + self._wait_s(nbytes)

    def send_s(self, nbytes: float) -> float:
        """Seconds for one point-to-point transfer (pipeline stage boundary)."""
        alpha = self.latency_us if self.send_us is None else self.send_us
        return alpha * 1e-6 + nbytes / (self.busbw_gbps * 1e9) + self._wait_s(nbytes)


@dataclass(frozen=True)
class Device:
    """One accelerator (or one CPU core running one rank, for this host)."""

    name: str
    memory_gib: float
    peak_tflops: dict[str, float]
    """Dense peak per compute dtype (float32, bfloat16, float16), TFLOP/s."""
    mem_bw_gbps: float
    """Memory bandwidth, GB/s."""
    matmul_efficiency: float = 0.6
    """Fraction of peak FLOP/s that the model's matmuls reach (1.0 when peak is measured)."""
    mem_efficiency: float = 0.8
    """Fraction of memory bandwidth reached when streaming weights (1.0 when measured)."""
    layer_overhead_us: float = 0.0
    """Fixed time per layer per forward (kernel launches, Python), microseconds."""
    step_overhead_us: float = 0.0
    """Fixed time per forward outside the layers (embedding, head, sampling), microseconds."""
    reserved_gib: float = 0.0
    """Memory the runtime takes before the model (CUDA context, allocator)."""
    busy_compute: float = 1.0
    busy_memory: float = 1.0
    """FLOP/s and memory bandwidth of a device while the other devices of its node work too,
    as a fraction of its rates alone (CPU cores share memory and power; GPUs: 1.0)."""
    rows_tflops: tuple[tuple[int, float], ...] = ()
    """Measured fp32 matmul TFLOP/s at m rows, (m, TFLOP/s) by increasing m (this host: a
    CPU's small products run below both its peak and its bandwidth); empty: the roofline."""
    busy_rows_tflops: tuple[tuple[int, float], ...] = ()
    """The same while every device works (empty: rows_tflops x busy_compute)."""
    train_efficiency: float = 1.0
    """Share of the matmul FLOP/s a training forward and backward reaches (autograd, the
    element-wise work and softmax around the matmuls): measured on this host; 1.0 for the
    presets, whose matmul_efficiency stands for it."""
    train_layer_overhead_us: float | None = None
    train_step_overhead_us: float | None = None
    """Fixed time of a training forward and backward per layer and per micro-step (autograd's
    bookkeeping, the loss), microseconds; None: the decode overheads above, once per pass."""
    train_tp_layer_overhead_us: float | None = None
    train_tp_step_overhead_us: float | None = None
    """The same for one rank's shard at tp > 1 (its region copies' autograd functions, the
    vocab-parallel loss: measured at tp=2 on this host); None: train_layer_overhead_us and
    train_step_overhead_us at every tp."""
    train_unsplit_ns: float | None = None
    """Nanoseconds per activation value (a token's hidden entry, per layer) of a training forward
    and backward's element-wise work around its products (norms, residuals, region copies),
    which a tp group does not split: every rank does all of it (1/tp of it with sequence
    parallelism). None: none counted apart (the presets: their efficiencies stand for it)."""
    busy_train: float | None = None
    """The speed of a training forward and backward while the node's other devices run one
    too, as a fraction of its speed alone (None: busy_compute)."""
    optimizer_gbps: float | None = None
    """Bytes/s of the optimizer update, counting one read and one write of its state (None:
    the memory bandwidth; measured on this host, where PyTorch's AdamW makes several passes)."""
    serve_step_us: float = 0.0
    serve_row_us: float = 0.0
    serve_request_us: float = 0.0
    """A server's own work beyond the forward (scheduling, sampling, HTTP): per step, per
    sequence in a step, per request. Measured on this host (shardwise.bench.serve_probe);
    0 for the presets, whose serving stacks are not shardwise's."""
    quantized_rows_tflops: dict[str, tuple[tuple[int, float], ...]] = field(default_factory=dict)
    """`--quantize` scheme (QUANTIZE) or GGUF block format (STORED_FORMATS) -> measured TFLOP/s
    of its linear kernel at m rows, (m, TFLOP/s) by increasing m from 1 (one row: how fast it
    streams its weights). Measured on this host (shardwise.bench.calibrate: fbgemm's fp16, the
    block formats' kernels, int8 as the Q8_0 blocks it runs on CPU); empty for the presets,
    whose CUDA kernels are not measured: the planner does not plan quantized weights there."""
    busy_quantized_rows_tflops: dict[str, tuple[tuple[int, float], ...]] = field(default_factory=dict)
    """The same while every device works (missing: quantized_rows_tflops x busy_compute)."""
    native_layer_overhead_us: float | None = None
    native_step_overhead_us: float | None = None
    """A decode step's fixed time per layer and per step where its layers run as one native call
    (shardwise.kernels.step), in place of layer_overhead_us and step_overhead_us; None: no
    native step (the presets; a host without it)."""
    native_tp_layer_overhead_us: float | None = None
    native_tp_step_overhead_us: float | None = None
    """The same for a rank of a tp group (its collectives' calls not included: the split head,
    the greedy choice's gather, the group's bookkeeping, every rank at once); None: the figures
    of one rank alone price it."""
    cache_gbps: float | None = None
    """Bytes/s of one row through weights held in the last-level cache (measured on this host);
    None: every weight streams from memory (the presets)."""
    busy_cache: float = 1.0
    """cache_gbps while the node's other devices stream too, as a fraction of it alone."""
    cache_bytes: float = 0.0
    """The node's last-level cache, shared by its devices (0: none counted)."""

    def __post_init__(self) -> None:
        _check(self, positive=("memory_gib", "mem_bw_gbps", "matmul_efficiency", "mem_efficiency"))
        _check(self, positive=("busy_compute", "busy_memory", "train_efficiency"))
        for name in ("busy_train", "optimizer_gbps"):
            if getattr(self, name) is not None:
                _check(self, positive=(name,))
        for name in ("train_layer_overhead_us", "train_step_overhead_us", "train_tp_layer_overhead_us",
                     "train_tp_step_overhead_us", "train_unsplit_ns"):  # fmt: skip
            if getattr(self, name) is not None:
                _check(self, nonneg=(name,))
        _check(self, nonneg=("layer_overhead_us", "step_overhead_us", "reserved_gib"))
        if self.cache_gbps is not None:
            _check(self, positive=("cache_gbps", "busy_cache"), nonneg=("cache_bytes",))
        for name in ("native_layer_overhead_us", "native_step_overhead_us", "native_tp_layer_overhead_us",
                     "native_tp_step_overhead_us"):  # fmt: skip
            if getattr(self, name) is not None:
                _check(self, nonneg=(name,))
        for dtype, v in self.peak_tflops.items():
            if dtype not in DTYPE_BYTES:
                raise PlannerError(f"Device {self.name}: peak_tflops has unknown dtype {dtype!r}")
            if not v > 0:
                raise PlannerError(f"Device {self.name}: peak_tflops[{dtype}] must be > 0, got {v}")
        if self.matmul_efficiency > 1 or self.mem_efficiency > 1 or self.train_efficiency > 1:
            raise PlannerError(
                f"Device {self.name}: efficiencies must be <= 1, got matmul {self.matmul_efficiency}, "
                f"memory {self.mem_efficiency}, training {self.train_efficiency}"
            )
        for table in (self.quantized_rows_tflops, self.busy_quantized_rows_tflops):
            for scheme, pts in table.items():
                if scheme not in QUANTIZE + STORED_FORMATS or not pts or any(m <= 0 or v <= 0 for m, v in pts):
                    raise PlannerError(
                        f"Device {self.name}: quantized rates need a scheme of {', '.join(QUANTIZE + STORED_FORMATS)} and "
                        f"(rows, TFLOP/s) points > 0, got {scheme!r}: {pts}"
                    )
        if self.reserved_gib >= self.memory_gib:
            raise PlannerError(f"Device {self.name}: reserved_gib={self.reserved_gib} >= memory_gib={self.memory_gib}")

    def flops(self, dtype: str, busy: bool = False) -> float:
        """Achieved matmul FLOP/s in `dtype` (falls back to float32's peak when not listed),
        alone or while the node's other devices work too (`busy`)."""
        peak = self.peak_tflops.get(dtype, self.peak_tflops.get("float32"))
        if peak is None:
            raise PlannerError(f"Device {self.name} has no peak_tflops for {dtype} or float32")
        return peak * 1e12 * self.matmul_efficiency * (self.busy_compute if busy else 1.0)

    def flops_at(self, rows: float, dtype: str, busy: bool = False) -> float:
        """Matmul FLOP/s with `rows` rows (tokens x sequences) through the weights: the measured
        rate at that many rows (log-log between the measured points; the peak beyond the
        last, and for one row, whose time the bandwidth sets), or the peak when no rows were
        measured (or not fp32)."""
        peak = self.flops(dtype, busy)
        table = (self.busy_rows_tflops or self.rows_tflops) if busy else self.rows_tflops
        if not table or dtype != "float32" or rows >= table[-1][0] * 2:
            return peak
        scale = self.busy_compute if busy and not self.busy_rows_tflops else 1.0
        pts = [(m, v * 1e12 * scale) for m, v in table] + [(table[-1][0] * 2, peak)]
        if rows < pts[0][0]:  # one row: a matrix-vector product, bandwidth-bound (the roofline's other side)
            return peak if rows <= 1 else pts[0][1]
        return _loglog(pts, rows)

    def quantized_flops_at(self, scheme: str, rows: float, busy: bool = False) -> float:
        """FLOP/s of the `scheme` linear kernel with `rows` rows through its weights: the measured
        rates, log-log between them, the nearest end's outside (below 1 row: the 1-row rate)."""
        busy_table = self.busy_quantized_rows_tflops.get(scheme) if busy else None
        table = busy_table or self.quantized_rows_tflops.get(scheme)
        if not table:
            raise PlannerError(f"Device {self.name} has no measured {scheme} linear kernel (quantized_rows_tflops)")
        scale = self.busy_compute if busy and scheme not in self.busy_quantized_rows_tflops else 1.0
        return _loglog(table, rows) * 1e12 * scale

    def train_flops(self, dtype: str, busy: bool = False) -> float:
        """FLOP/s of a training forward and backward: the matmul rate times train_efficiency,
        and while the node's other devices work, times busy_train (or busy_compute)."""
        if busy and self.busy_train is not None:
            return self.flops(dtype) * self.train_efficiency * self.busy_train
        return self.flops(dtype, busy) * self.train_efficiency

    def optimizer_bytes_per_s(self, busy: bool = False) -> float:
        """The optimizer update's bytes/s (optimizer_gbps when measured, else memory bandwidth)."""
        if self.optimizer_gbps is None:
            return self.bytes_per_s(busy)
        return self.optimizer_gbps * 1e9 * (self.busy_memory if busy else 1.0)

    def bytes_per_s(self, busy: bool = False) -> float:
        return self.mem_bw_gbps * 1e9 * self.mem_efficiency * (self.busy_memory if busy else 1.0)

    def native_overheads_us(self, tp: int) -> tuple[float, float]:
        """(per layer, per step) fixed time of a native decode step on a rank of a tp group of
        `tp`: a tp group's figures where measured, else one rank's alone."""
        if tp > 1 and self.native_tp_layer_overhead_us is not None and self.native_tp_step_overhead_us is not None:
            return self.native_tp_layer_overhead_us, self.native_tp_step_overhead_us
        return self.native_layer_overhead_us or 0.0, self.native_step_overhead_us or 0.0

    def stream_bytes_per_s(self, node_bytes: float, busy: bool = False) -> float:
        """Bytes/s of a forward that streams weights a step, when the node's devices hold
        `node_bytes` of them in all: from the last-level cache where they fit in it (they stay
        there between steps: cache_gbps), else from memory (bytes_per_s)."""
        if self.cache_gbps is not None and 0 < node_bytes <= self.cache_bytes:
            return self.cache_gbps * 1e9 * (self.busy_cache if busy else 1.0)
        return self.bytes_per_s(busy)


@dataclass(frozen=True)
class Cluster:
    name: str
    device: Device
    devices: int
    devices_per_node: int
    intra: Link
    """The link between devices of one node."""
    inter: Link | None = None
    """The link between nodes (None for a single node)."""
    shared_memory: bool = False
    """The devices of a node share one memory (CPU cores): memory_gib is the node's."""
    other_links: dict[str, Link] = field(default_factory=dict)
    """Further interconnects to compare in the plot (this host: one per calibrated backend)."""
    notes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        _check(self, positive=("devices", "devices_per_node"))
        if self.devices > self.devices_per_node and self.devices % self.devices_per_node:
            raise PlannerError(
                f"cluster {self.name}: devices={self.devices} is not a multiple of "
                f"devices_per_node={self.devices_per_node} (whole nodes only)"
            )
        if self.devices > self.devices_per_node and self.inter is None:
            raise PlannerError(
                f"cluster {self.name}: {self.devices} devices span {self.nodes} nodes but no inter-node link is given"
            )

    @property
    def nodes(self) -> int:
        return max(1, -(-self.devices // self.devices_per_node))

    def link_for(self, span: int) -> Link:
        """The link a group of `span` consecutive ranks crosses."""
        if span <= self.devices_per_node or self.inter is None:
            return self.intra
        return self.inter

    def memory_budget_gib(self, ranks_on_node: int) -> float:
        """Memory one device may use when `ranks_on_node` ranks of the job share its node."""
        d = self.device
        if self.shared_memory:
            return (d.memory_gib - d.reserved_gib) / max(1, min(ranks_on_node, self.devices_per_node))
        return d.memory_gib - d.reserved_gib


@dataclass(frozen=True)
class Precision:
    compute: str
    """dtype of weights used in matmuls and of activations."""
    weight_bytes: int
    """Bytes per weight; with 2, an fp32 master copy too (the training state is
    footprint.state_bytes: shardwise.train.distopt.bytes_per_param)."""
    grad_bytes: int
    """Bytes per gradient as backward and the dp all-reduce carry them."""


PRECISIONS = {
    "bf16-mixed": Precision("bfloat16", 2, 2),
    "fp16-mixed": Precision("float16", 2, 2),
    "fp32": Precision("float32", 4, 4),
}


@dataclass(frozen=True)
class InferenceWorkload:
    batch: int = 1
    """Sequences one model replica processes together."""
    prompt_len: int = 512
    output_len: int = 128
    target_latency_ms: float | None = None
    """End-to-end latency of one request (prefill + every output token), if there is a target."""
    dtype: str | None = None
    """Weights and activations; None = the model's own."""
    flash_attention: bool = True
    """Attention scores are not materialised (FlashAttention); False counts B*heads*S*S of them."""
    quantize: str | None = None
    """The projections' and embeddings' weight format (QUANTIZE: `--quantize fp16|int8`); None:
    the dtype's. Inference only: training does not take --quantize."""

    kind = "inference"

    def __post_init__(self) -> None:
        _check(self, positive=("batch", "prompt_len", "output_len"))
        if self.target_latency_ms is not None:
            _check(self, positive=("target_latency_ms",))
        if self.dtype is not None and self.dtype not in DTYPE_BYTES:
            raise PlannerError(f"dtype must be one of {', '.join(DTYPE_BYTES)}, got {self.dtype!r}")
        if self.quantize is not None and self.quantize not in QUANTIZE:
            raise PlannerError(f"quantize must be one of {', '.join(QUANTIZE)}, got {self.quantize!r}")


@dataclass(frozen=True)
class TrainingWorkload:
    global_batch: int = 512
    """Sequences per optimizer step, over all data-parallel replicas."""
    micro_batch: int = 1
    """Sequences per forward/backward on one pipeline (per data-parallel replica)."""
    seq_len: int = 2048
    optimizer: Literal["adam", "sgd"] = "adam"
    precision: str = "bf16-mixed"
    recompute: str = "none"
    """Activation recomputation: "none"; "selective" (redo each attention core in backward);
    "full" (keep each layer's input only, redo its forward in backward). True and False are
    read as "full" and "none"."""
    flash_attention: bool = True
    sequence_parallel: bool = False
    """Sequence parallelism: norms, residuals and the split matmuls' inputs on seq_len / tp
    positions per tp rank (less activation memory; backward re-gathers those inputs)."""
    schedule: str | None = None
    """Pipeline schedule for layouts with pp > 1: "gpipe", "1f1b" or "interleaved"; None = the
    fastest that fits, per layout."""
    distributed_optimizer: bool = False
    """shardwise's distributed optimizer (`train --distributed-optimizer`): Adam's moments (and
    with bf16 weights the fp32 master) split over dp, the experts' over their expert-data-parallel
    ranks; gradients reduce-scattered, weights all-gathered (footprint.state_bytes)."""

    kind = "training"

    def __post_init__(self) -> None:
        _check(self, positive=("global_batch", "micro_batch", "seq_len"))
        if self.micro_batch > self.global_batch:
            raise PlannerError(f"micro_batch={self.micro_batch} is larger than global_batch={self.global_batch}")
        if self.global_batch % self.micro_batch:
            raise PlannerError(f"global_batch={self.global_batch} is not a multiple of micro_batch={self.micro_batch}")
        if self.optimizer not in ("adam", "sgd"):
            raise PlannerError(f"optimizer must be adam or sgd, got {self.optimizer!r}")
        if self.precision not in PRECISIONS:
            raise PlannerError(f"precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        try:
            object.__setattr__(self, "recompute", recompute_mode(self.recompute))
        except ValueError as e:
            raise PlannerError(str(e)) from None
        if self.distributed_optimizer and self.optimizer != "adam":
            raise PlannerError(
                f"the distributed optimizer splits AdamW's state; optimizer={self.optimizer!r} is not supported"
            )
        if self.schedule is not None and self.schedule not in SCHEDULES:
            raise PlannerError(f"schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")

    @property
    def prec(self) -> Precision:
        return PRECISIONS[self.precision]
