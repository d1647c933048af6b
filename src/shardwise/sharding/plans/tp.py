"""The tp sizes the plans here can split a model by: the one answer that loading, the
CLI, the planner and the demo all use (the arithmetic is in shardwise.layers.partition).

Any tp from 1 to the number of query heads works. Query heads are dealt out contiguously
and as evenly as possible, each rank holding the KV heads its query heads use (see
HeadLayout); the MLP's intermediate dim is split in blocks, unevenly when tp does not
divide it; the vocabulary is padded. `balance` says how uneven a tp is and what it costs.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardwise.layers.partition import HeadLayout, ShardError, split_ranges
from shardwise.models.config import ModelConfig

__all__ = ["model_tp_sizes", "even_tp_sizes", "check_tp", "Balance", "balance"]


def _widths(cfg: ModelConfig, expert_parallel: bool) -> list[tuple[str, int]]:
    """(name, size) of every dimension a tp split must give each rank a share of, beyond heads."""
    dense = not cfg.num_experts or any(not cfg.is_moe_layer(i) for i in range(cfg.num_layers))
    out = [("intermediate_size", cfg.intermediate_size)] if dense else []
    if cfg.num_experts:
        out.append(
            ("num_experts", cfg.num_experts) if expert_parallel else ("expert intermediate size", cfg.expert_size)
        )
        if cfg.shared_expert_size:
            out.append(("shared expert intermediate size", cfg.shared_expert_size))
    return out


def model_tp_sizes(cfg: ModelConfig, *, expert_parallel: bool = False) -> list[int]:
    """Every tp size that can split this model, in increasing order: 1 to its query heads
    (and, for a mixture of experts, to its experts (expert_parallel) or its expert width)."""
    limit = min([cfg.num_heads] + [n for _, n in _widths(cfg, expert_parallel)])
    return [t for t in HeadLayout.valid_tp_sizes(cfg.num_heads, cfg.num_kv_heads) if t <= limit]


def even_tp_sizes(cfg: ModelConfig, *, expert_parallel: bool = False) -> list[int]:
    """The tp sizes that split heads and MLP width (experts) evenly, with no KV head shared by two
    ranks' query groups unless every KV head is replicated alike (the classic layouts)."""
    heads = HeadLayout.even_tp_sizes(cfg.num_heads, cfg.num_kv_heads)
    return [t for t in heads if all(n % t == 0 for _, n in _widths(cfg, expert_parallel))]


def check_tp(cfg: ModelConfig, tp: int, *, expert_parallel: bool = False) -> None:
    """Refuse a tp that cannot split this model: a ShardError naming the numbers and the valid sizes.
    expert_parallel: MoE layers deal whole experts out (tp <= num_experts); refused for a dense model."""
    if expert_parallel and not cfg.num_experts:
        raise ShardError(f"--expert-parallel needs a mixture-of-experts model; this {cfg.family} model has no experts")
    if tp < 1:
        raise ShardError(f"tp must be >= 1, got {tp}")
    HeadLayout(cfg.num_heads, cfg.num_kv_heads, tp)  # raises for tp > num_heads, naming the valid sizes
    valid = model_tp_sizes(cfg, expert_parallel=expert_parallel)
    for what, size in _widths(cfg, expert_parallel):
        if tp > size:
            mode = " with --expert-parallel" if expert_parallel and what == "num_experts" else ""
            raise ShardError(f"tp={tp} is more than {what}={size}{mode}; valid tp sizes: 1-{valid[-1]}")


@dataclass(frozen=True)
class Balance:
    """How evenly one tp size splits a model: each share is largest rank / even share."""

    tp: int
    heads: tuple[int, ...]
    """Query heads per rank."""
    kv_heads: tuple[int, ...]
    """KV heads held per rank (replicas included)."""
    attention: float
    """Largest rank's query heads / num_heads * tp."""
    mlp: float
    """Largest rank's MLP width / intermediate_size * tp (a mixture of experts: its MLP work
    per token, k experts' widths and the shared expert's, expected under even routing)."""
    kv_cache: float
    """Largest rank's KV heads / num_kv_heads * tp: its KV cache against the even share
    (above 1 also where every KV head is replicated alike, as at tp > num_kv_heads)."""
    even: bool
    """One of the classic layouts (even_tp_sizes): equal shares everywhere."""

    slowdown: float
    """The busiest rank's layer weights (so its matmul time) / the unsharded layer's / tp: what
    the slowest rank costs a step against a perfect split (replicated KV rows included). A
    mixture of experts counts the weights a token uses (k experts), under even routing."""

    experts: tuple[int, ...] = ()
    """Expert parallelism: whole experts per rank; else empty."""

    def describe(self) -> str:
        """One line, e.g. 'uneven: query heads 5/4 per rank (largest 1.11x the even share) ...'."""
        if self.even:
            return f"even: {self.heads[0]} query heads per rank"
        heads = "/".join(map(str, self.heads))
        mlp = f"experts {'/'.join(map(str, self.experts))} per rank" if self.experts else "MLP width"
        return (
            f"uneven: query heads {heads} per rank (largest {self.attention:.2f}x the even share), "
            f"{mlp} largest {self.mlp:.2f}x, KV heads {'/'.join(map(str, self.kv_heads))} per rank; "
            f"the busiest rank does {self.slowdown:.2f}x a perfect share of each layer's matmuls"
        )


def _mlp_widths(cfg: ModelConfig, tp: int, expert_parallel: bool) -> tuple[list[float], float, tuple[int, ...]]:
    """(per rank MLP width a token uses, the unsharded one, experts per rank under expert
    parallelism). A dense model: intermediate_size split. A mixture of experts (its MoE
    layers): k experts' widths plus the shared expert's; expert-parallel ranks hold n_r of E
    whole experts, so take n_r / E of the k experts' work under even routing."""
    if not cfg.num_experts:
        return [e - s for s, e in split_ranges(cfg.intermediate_size, tp)], cfg.intermediate_size, ()
    k, width, shared = cfg.experts_per_token, cfg.expert_size, cfg.shared_expert_size
    shares = [e - s for s, e in split_ranges(shared, tp)] if shared else [0] * tp
    if expert_parallel:
        counts = tuple(e - s for s, e in split_ranges(cfg.num_experts, tp, unit=1))
        routed = [k * width * n / cfg.num_experts for n in counts]
    else:
        counts = ()
        routed = [k * (e - s) for s, e in split_ranges(width, tp)]
    return [r + s for r, s in zip(routed, shares, strict=True)], k * width + shared, counts


def balance(cfg: ModelConfig, tp: int, *, expert_parallel: bool = False) -> Balance:
    """How evenly tp splits this model (check_tp first)."""
    lay = HeadLayout(cfg.num_heads, cfg.num_kv_heads, tp)
    hd, h = cfg.head_dim, cfg.hidden_size
    widths, full, experts = _mlp_widths(cfg, tp, expert_parallel)
    mats = 3 if cfg.gated_mlp or cfg.num_experts else 2

    def layer(q: int, kv: int, inter: float) -> float:  # matmul weights: qkv, o, MLP
        return (2 * q + 2 * kv) * hd * h + mats * inter * h

    heads = tuple(len(lay.q_heads(r)) for r in range(tp))
    kv_heads = tuple(len(lay.kv_heads(r)) for r in range(tp))
    busiest = max(layer(q, kv, w) for q, kv, w in zip(heads, kv_heads, widths, strict=True))
    return Balance(
        tp=tp,
        heads=heads,
        kv_heads=kv_heads,
        attention=lay.imbalance,
        mlp=max(widths) * tp / full,
        kv_cache=lay.max_kv_heads * tp / cfg.num_kv_heads,
        even=tp in even_tp_sizes(cfg, expert_parallel=expert_parallel),
        slowdown=busiest * tp / layer(cfg.num_heads, cfg.num_kv_heads, full),
        experts=experts,
    )
