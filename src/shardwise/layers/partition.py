"""Shard arithmetic: which slice of a dimension, or which heads, a rank holds.

Pure functions of (sizes, tp, rank). The layers, the sharding plans, the checkpoint
resharder and the planner all use these, so a split is computed one way everywhere.
Which tp sizes a whole model allows is shardwise.sharding.plans.model_tp_sizes, built on these.
"""

from __future__ import annotations

__all__ = [
    "ShardError",
    "divide",
    "valid_tp_sizes",
    "shard_range",
    "padded_size",
    "HeadLayout",
]

_MAX_LISTED_TP = 1024


class ShardError(ValueError):
    """A tensor or head count that cannot be split over the requested tp size."""


def valid_tp_sizes(*sizes: int, limit: int = _MAX_LISTED_TP) -> list[int]:
    """tp sizes (up to `limit`) that divide every one of `sizes`."""
    return [t for t in range(1, limit + 1) if all(s % t == 0 for s in sizes)]


def _fmt(sizes: list[int]) -> str:
    return ", ".join(map(str, sizes))


def divide(numerator: int, tp: int, *, what: str) -> int:
    """numerator / tp, or a ShardError naming `what`, the numbers and the valid tp sizes."""
    if tp < 1:
        raise ShardError(f"tp must be >= 1, got {tp}")
    if numerator % tp:
        raise ShardError(
            f"{what}={numerator} cannot be split over tp={tp}; valid tp sizes: {_fmt(valid_tp_sizes(numerator))}"
        )
    return numerator // tp


def shard_range(size: int, tp: int, rank: int, *, what: str = "size") -> tuple[int, int]:
    """[start, end) of `rank`'s equal slice of a dimension of length `size`."""
    if not 0 <= rank < tp:
        raise ShardError(f"rank={rank} is outside tp={tp}")
    width = divide(size, tp, what=what)
    return rank * width, (rank + 1) * width


def padded_size(size: int, multiple: int) -> int:
    """Smallest multiple of `multiple` that is >= size (a vocabulary padded for tp)."""
    return -(-size // multiple) * multiple


class HeadLayout:
    """How attention heads are spread over tp ranks, with grouped-query attention.

    Query heads are always split: each rank holds num_heads / tp of them. Key/value
    heads are split when tp <= num_kv_heads, and replicated when tp > num_kv_heads:
    with 2 KV heads at tp=4, ranks 0,1 hold KV head 0 and ranks 2,3 hold KV head 1,
    which is the KV head their own query heads attend with.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, tp: int) -> None:
        if num_heads < 1 or num_kv_heads < 1 or num_heads % num_kv_heads:
            raise ShardError(
                f"num_attention_heads={num_heads} must be a positive multiple of num_key_value_heads={num_kv_heads}"
            )
        self.num_heads, self.num_kv_heads, self.tp = num_heads, num_kv_heads, tp
        valid = self.valid_tp_sizes(num_heads, num_kv_heads)
        if tp not in valid:
            what = f"num_attention_heads={num_heads}" if num_heads % tp else f"num_key_value_heads={num_kv_heads}"
            raise ShardError(f"{what} cannot be split over tp={tp}; valid tp sizes: {_fmt(valid)}")
        self.local_heads = num_heads // tp
        self.local_kv_heads = max(num_kv_heads // tp, 1)
        self.kv_replicas = max(tp // num_kv_heads, 1)
        """How many ranks hold each KV head (1 = no replication)."""

    @staticmethod
    def valid_tp_sizes(num_heads: int, num_kv_heads: int, limit: int = _MAX_LISTED_TP) -> list[int]:
        """tp sizes that split the query heads evenly and either split or evenly replicate KV heads."""
        return [
            t
            for t in range(1, min(limit, num_heads) + 1)
            if num_heads % t == 0 and (num_kv_heads % t == 0 or t % num_kv_heads == 0)
        ]

    def q_heads(self, rank: int) -> range:
        """Global indices of the query heads on `rank`."""
        return range(rank * self.local_heads, (rank + 1) * self.local_heads)

    def kv_heads(self, rank: int) -> range:
        """Global indices of the KV heads on `rank` (one replicated head when tp > num_kv_heads)."""
        first = rank // self.kv_replicas * self.local_kv_heads
        return range(first, first + self.local_kv_heads)

    def __repr__(self) -> str:
        return (
            f"HeadLayout(num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, tp={self.tp}: "
            f"{self.local_heads} q + {self.local_kv_heads} kv heads per rank, kv_replicas={self.kv_replicas})"
        )
