"""Will it fit: the bytes each rank of a command will hold, from the config alone, against
what this host allows, and the layouts or options that would fit when it does not.

The bytes are the planner's own formulas (planner/footprint.py, checked against the real
sharded model by tests/unit/test_planner_formulas.py and test_planner_quantize.py): weights
per rank with tp, pp (its layer split), --quantize and the dtype, the busiest rank of an
uneven split; the KV cache a server preallocates (slots x max-model-len) or a generation
needs; a prefill's transient activations; training's weights, gradients, optimizer state
(shardwise.train.distopt.bytes_per_param's formula) and activations. Nothing is read but
the config.

On CPU the ranks of one host share its memory: the job fits when every rank's bytes, plus
RUNTIME_BYTES each, fit in what the host allows (shardwise.memory.host_memory). On CUDA each
rank has a device: its bytes plus the runtime must fit in that device's free memory.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from shardwise.memory import HostMemory, fmt_bytes
from shardwise.models.config import ModelConfig
from shardwise.planner.footprint import (
    inference_memory,
    kv_bytes_per_token,
    training_memory,
    weight_bytes,
)

__all__ = [
    "RUNTIME_BYTES",
    "Need",
    "Allowance",
    "Option",
    "inference_need",
    "training_need",
    "fits",
    "refusal",
]

RUNTIME_BYTES = 256 * 2**20
"""What a rank costs before it holds anything: Python, torch, its communicator and the model
code's imports. Measured on this project's 2-core CPU host: a gloo rank forked from the
forkserver, after importing shardwise.hf, shardwise.engine and the server, holds 157 MiB of
anonymous memory (RssAnon; 98-118 MiB proportional share, Pss); 256 MiB leaves room for the
allocator's and the communicator's buffers."""

WIDTH = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class Need:
    """The bytes each rank will hold (by rank), and the busiest rank's parts by name."""

    by_rank: list[float]
    parts: dict[str, float]

    @property
    def busiest(self) -> float:
        return max(self.by_rank)

    @property
    def ranks(self) -> int:
        return len(self.by_rank)


@dataclass(frozen=True)
class Allowance:
    """What the ranks may use: `bytes` shared by `ranks` ranks of one host (CPU), or each
    rank's own device with `bytes` free (per_device)."""

    bytes: float
    source: str
    ranks: int
    per_device: bool = False

    @classmethod
    def host(cls, mem: HostMemory, ranks: int) -> Allowance:
        return cls(float(mem.available), mem.source, ranks)

    def describe(self) -> str:
        """ "7.80 GiB (cgroup v2 limit ...) for 2 ranks" or "... free on each device"."""
        if self.per_device:
            return f"{fmt_bytes(self.bytes)} free on each device ({self.source})"
        return f"{fmt_bytes(self.bytes)} ({self.source}) for {self.ranks} rank{'s' * (self.ranks > 1)}"


@dataclass(frozen=True)
class Option:
    """A change to the command line, and what the job would need with it."""

    flags: str
    need: Need


def fits(need: Need, allow: Allowance, *, local_ranks: int | None = None) -> bool:
    """Every rank's bytes and RUNTIME_BYTES each within the allowance. local_ranks: the ranks
    on this host (default all of them; they are the first ones, each host alike)."""
    if allow.per_device:
        return need.busiest + RUNTIME_BYTES <= allow.bytes
    n = need.ranks if local_ranks is None else min(local_ranks, need.ranks)
    local = sorted(need.by_rank, reverse=True)[:n]  # the busiest ranks, wherever they are
    return sum(local) + n * RUNTIME_BYTES <= allow.bytes


def inference_need(
    cfg: ModelConfig, tp: int, pp_layers: list[int] | None = None, *, dtype: str | None = None,
    quantize: str | None = None, expert_parallel: bool = False, batch: int = 1, prompt_len: int = 1,
    kv_tokens: int = 0, prefill_batch: int | None = None, full_copy_on_rank0: bool = False,
) -> Need:  # fmt: skip
    """Bytes per rank of a model held for inference: weights (busiest tp rank of each stage of
    `pp_layers`, the layers per stage; None = one stage), the KV cache of `batch` sequences of
    `kv_tokens` positions (the stage's layers, the weights' dtype), and the transient
    activations of a prefill of `prefill_batch` (default `batch`) x `prompt_len`. full_copy_on_rank0: rank 0 also holds
    the whole model in the dtype (verify compares against it)."""
    layers = pp_layers or [cfg.num_layers]
    pp, width = len(layers), WIDTH[dtype or cfg.dtype]
    kw = dict(width=width, quantize=quantize, expert_parallel=expert_parallel)
    act = inference_memory(
        cfg, tp, 1, batch=prefill_batch or batch, prompt_len=prompt_len, output_len=0, flash=True, budget=0, **kw
    ).activations
    by_rank, parts = [], {}
    for s, n in enumerate(layers):
        w = weight_bytes(cfg, tp, pp, s, layers=n, **kw)
        kv = batch * kv_tokens * kv_bytes_per_token(cfg, tp, width, n)
        stage = {"weights": w, "kv cache": kv, "activations": act}
        by_rank += [w + kv + act] * tp
        if not parts or sum(stage.values()) > sum(parts.values()):
            parts = stage
    if full_copy_on_rank0:
        full = weight_bytes(cfg, 1, width=width, expert_parallel=expert_parallel)
        by_rank[0] += full
        parts = {**parts, "the whole model (rank 0)": full}
    return Need(by_rank, {k: v for k, v in parts.items() if v})


def training_need(
    cfg: ModelConfig, *, tp: int, pp: int, dp: int, ep: int = 1, micro_batches: int, micro_batch: int, seq: int,
    dtype: str = "fp32", distributed: bool = False, recompute: str = "none", sequence_parallel: bool = False,
) -> Need:  # fmt: skip
    """Bytes per rank of training (the busiest pipeline stage, 1F1B's in-flight micro-batches):
    weights, gradients and the optimizer's state as footprint.training_memory counts them
    (footprint.state_bytes: shardwise.train.distopt.bytes_per_param, the one formula; bf16
    weights keep an fp32 master; the distributed optimizer splits the state over dp, the
    experts' over dp / ep) and activations."""
    w = 2 if dtype == "bf16" else 4
    mem = training_memory(
        cfg, tp, pp, micro_batches=micro_batches, micro_batch=micro_batch, seq=seq, width=w, weight_bytes=w,
        optimizer="adam", recompute=recompute, flash=True, budget=0, sequence_parallel=sequence_parallel and tp > 1,
        ep_dp=ep, dp=dp, distributed_optimizer=distributed,
    )  # fmt: skip
    parts = {"weights": mem.weights, "gradients": mem.grads, "optimizer state": mem.optimizer}
    parts["activations"] = mem.activations
    return Need([mem.total] * (tp * pp * dp), parts)


def refusal(
    need: Need, allow: Allowance, options: Iterable[Option], *, local_ranks: int | None = None, shown: int = 3
) -> str | None:
    """None when `need` fits; else the one line that says it does not: the bytes per rank and
    their parts, what is allowed and from where, and the first `shown` options that fit."""
    if fits(need, allow, local_ranks=local_ranks):
        return None
    parts = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in need.parts.items())
    n = need.ranks if local_ranks is None else min(local_ranks, need.ranks)
    if allow.per_device:
        total = f"{fmt_bytes(need.busiest + RUNTIME_BYTES)} with the runtime"
    else:
        total = f"{fmt_bytes(sum(sorted(need.by_rank, reverse=True)[:n]) + n * RUNTIME_BYTES)} for {n} ranks with the runtime"
    line = (
        f"not enough memory: each rank needs about {fmt_bytes(need.busiest)} ({parts}; {total}, "
        f"{RUNTIME_BYTES // 2**20} MiB a rank), but the host allows {allow.describe()}"
    )
    good = []
    for opt in options:
        if fits(opt.need, allow, local_ranks=local_ranks):
            good.append(f"{opt.flags} ({fmt_bytes(opt.need.busiest)} per rank)")
        if len(good) == shown:
            break
    line += "; would fit: " + "; ".join(good) if good else "; no layout or option tried fits here"
    return line + " (--force skips this check)"
