"""Server metrics, rendered in the Prometheus text exposition format (GET /metrics).

Written by the engine thread (steps, tokens, collectives) and the HTTP thread
(requests); read by the HTTP thread. One lock keeps a rendering consistent.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass, field

__all__ = ["Metrics", "Histogram"]

STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


@dataclass
class Histogram:
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * len(self.buckets)

    def observe(self, value: float) -> None:
        for i, upper in enumerate(self.buckets):
            if value <= upper:
                self.counts[i] += 1
        self.total += value
        self.count += 1

    def lines(self, name: str) -> list[str]:
        out = [f'{name}_bucket{{le="{upper:g}"}} {n}' for upper, n in zip(self.buckets, self.counts, strict=True)]
        out += [
            f'{name}_bucket{{le="+Inf"}} {self.count}',
            f"{name}_sum {self.total:.6f}",
            f"{name}_count {self.count}",
        ]
        return out


class Metrics:
    """Counters and gauges of one server (rank 0's view)."""

    def __init__(self, *, tp: int, slots: int, pp: int = 1) -> None:
        self.lock = threading.Lock()
        self.tp, self.pp, self.slots = tp, pp, slots
        self.requests: Counter[str] = Counter()  # by outcome
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.queue_depth = 0
        self.running = 0
        self.batch_size = 0
        self.step_seconds = Histogram(STEP_BUCKETS)
        self.heartbeats = 0
        self.blocks_total = self.blocks_free = 0  # paged KV cache: this rank's pool (0: slots)
        self.preemptions = 0
        self.prefix_hit_tokens = 0
        self.stage_busy: list[float] = [0.0] * pp if pp > 1 else []  # seconds of compute of each stage (pp > 1)
        self.stage_idle: list[float] = [1.0] * pp if pp > 1 else []  # idle fraction of each stage over the last window
        self._window: tuple[float, list[float]] | None = None
        self.collectives: dict[str, tuple[int, int]] = {}  # "op/group" -> (calls, bytes)

    def request_done(self, outcome: str) -> None:
        """outcome: completed, rejected (4xx), cancelled (client left), error (5xx)."""
        with self.lock:
            self.requests[outcome] += 1

    def step(self, seconds: float, batch: int, new_tokens: int, collectives: dict[str, dict[str, int]]) -> None:
        with self.lock:
            self.step_seconds.observe(seconds)
            self.batch_size = batch
            self.generation_tokens += new_tokens
            self.collectives = {k: (v["calls"], v["bytes"]) for k, v in collectives.items()}

    def stages(self, busy_s: list[float], window_s: float = 1.0) -> None:
        """Every stage's cumulative compute seconds (pp > 1); the idle fractions are over the
        last window of at least `window_s` seconds of wall time."""
        now = time.monotonic()
        with self.lock:
            busy_s = [max(a, b) for a, b in zip(self.stage_busy, busy_s, strict=True)]  # the first ticks lack some
            self.stage_busy = list(busy_s)
            if self._window is None:
                self._window = now, list(busy_s)
            elif now - self._window[0] >= window_s:
                t0, b0 = self._window
                self.stage_idle = [
                    min(1.0, max(0.0, 1 - (b - a) / (now - t0))) for a, b in zip(b0, busy_s, strict=True)
                ]
                self._window = now, list(busy_s)

    def heartbeat(self, collectives: dict[str, dict[str, int]]) -> None:
        with self.lock:
            self.heartbeats += 1
            self.collectives = {k: (v["calls"], v["bytes"]) for k, v in collectives.items()}

    def render(self, *, healthy: bool) -> str:
        with self.lock:
            lines = [
                "# HELP shardwise_requests_total Requests finished, by outcome.",
                "# TYPE shardwise_requests_total counter",
                *(f'shardwise_requests_total{{outcome="{k}"}} {v}' for k, v in sorted(self.requests.items())),
                "# HELP shardwise_prompt_tokens_total Prompt tokens of admitted requests.",
                "# TYPE shardwise_prompt_tokens_total counter",
                f"shardwise_prompt_tokens_total {self.prompt_tokens}",
                "# HELP shardwise_generation_tokens_total Tokens generated.",
                "# TYPE shardwise_generation_tokens_total counter",
                f"shardwise_generation_tokens_total {self.generation_tokens}",
                "# HELP shardwise_queue_depth Requests waiting for a slot.",
                "# TYPE shardwise_queue_depth gauge",
                f"shardwise_queue_depth {self.queue_depth}",
                "# HELP shardwise_running_sequences Sequences holding a slot.",
                "# TYPE shardwise_running_sequences gauge",
                f"shardwise_running_sequences {self.running}",
                "# HELP shardwise_batch_size Sequences in the last step.",
                "# TYPE shardwise_batch_size gauge",
                f"shardwise_batch_size {self.batch_size}",
                "# HELP shardwise_slots Sequence slots (--max-batch-size).",
                "# TYPE shardwise_slots gauge",
                f"shardwise_slots {self.slots}",
                "# HELP shardwise_kv_blocks KV-cache blocks of the pool, by state (paged cache; 0 with slots).",
                "# TYPE shardwise_kv_blocks gauge",
                f'shardwise_kv_blocks{{state="used"}} {self.blocks_total - self.blocks_free}',
                f'shardwise_kv_blocks{{state="free"}} {self.blocks_free}',
                "# HELP shardwise_preemptions_total Sequences preempted for blocks (recomputed later).",
                "# TYPE shardwise_preemptions_total counter",
                f"shardwise_preemptions_total {self.preemptions}",
                "# HELP shardwise_prefix_cache_hit_tokens_total Prompt tokens found in cached blocks (not prefilled).",
                "# TYPE shardwise_prefix_cache_hit_tokens_total counter",
                f"shardwise_prefix_cache_hit_tokens_total {self.prefix_hit_tokens}",
                "# HELP shardwise_step_seconds Wall time of one engine step (all ranks).",
                "# TYPE shardwise_step_seconds histogram",
                *self.step_seconds.lines("shardwise_step_seconds"),
                "# HELP shardwise_heartbeats_total Idle heartbeats (no-op steps with a barrier).",
                "# TYPE shardwise_heartbeats_total counter",
                f"shardwise_heartbeats_total {self.heartbeats}",
                "# HELP shardwise_collectives_total Collectives issued by rank 0, by op and group.",
                "# TYPE shardwise_collectives_total counter",
            ]
            for key, (calls, _) in sorted(self.collectives.items()):
                op, group = key.split("/", 1)
                lines.append(f'shardwise_collectives_total{{op="{op}",group="{group}"}} {calls}')
            lines += ["# HELP shardwise_collective_bytes_total Payload bytes of rank 0's collectives.",
                      "# TYPE shardwise_collective_bytes_total counter"]  # fmt: skip
            for key, (_, nbytes) in sorted(self.collectives.items()):
                op, group = key.split("/", 1)
                lines.append(f'shardwise_collective_bytes_total{{op="{op}",group="{group}"}} {nbytes}')
            lines += [
                "# HELP shardwise_tensor_parallel_size Ranks each stage's layers are sharded over.",
                "# TYPE shardwise_tensor_parallel_size gauge",
                f"shardwise_tensor_parallel_size {self.tp}",
                "# HELP shardwise_pipeline_parallel_size Pipeline stages (ranks: tp x pp).",
                "# TYPE shardwise_pipeline_parallel_size gauge",
                f"shardwise_pipeline_parallel_size {self.pp}",
                "# HELP shardwise_stage_busy_seconds_total Compute seconds of each pipeline stage (pp > 1).",
                "# TYPE shardwise_stage_busy_seconds_total counter",
                *(f'shardwise_stage_busy_seconds_total{{stage="{i}"}} {b:.6f}' for i, b in enumerate(self.stage_busy)),
                "# HELP shardwise_stage_idle_fraction Share of the last second(s) each stage did not compute (pp > 1).",
                "# TYPE shardwise_stage_idle_fraction gauge",
                *(f'shardwise_stage_idle_fraction{{stage="{i}"}} {f:.4f}' for i, f in enumerate(self.stage_idle)),
                "# HELP shardwise_healthy 1 while every rank is alive and stepping.",
                "# TYPE shardwise_healthy gauge",
                f"shardwise_healthy {int(healthy)}",
            ]
        return "\n".join(lines) + "\n"
