"""Shard arithmetic: which slice of a dimension, or which heads, a rank holds.

Pure functions of (sizes, tp, rank). The layers, the sharding plans, the checkpoint
resharder and the planner all use these, so a split is computed one way everywhere.
Which tp sizes a whole model allows is shardwise.sharding.plans.model_tp_sizes, built on these.

Splits need not be even. A dimension is cut into whole units (a head's columns, or a block
of columns) and the units are dealt out as evenly as possible, the first ranks taking one
more when tp does not divide them:

    split_sizes(9, 2)  -> [5, 4]                  9 heads over 2 ranks
    shard_range(11008, 3, r), blocks of 32        -> widths 3680, 3680, 3648

When tp divides the size the split is the classic equal one, so even layouts (and their
checkpoints) are unchanged. The slowest rank sets the pace of a tensor-parallel step, so
`imbalance` (largest share / even share) is what an uneven split costs.
"""

from __future__ import annotations

__all__ = [
    "ShardError",
    "divide",
    "valid_tp_sizes",
    "split_sizes",
    "shard_range",
    "split_ranges",
    "width_unit",
    "imbalance",
    "largest_share",
    "padded_size",
    "HeadLayout",
]

_MAX_LISTED_TP = 1024
_MAX_BLOCK = 64
"""Largest block of columns an uneven width split deals in (a multiple of 64 keeps GEMMs tidy)."""


class ShardError(ValueError):
    """A tensor or head count that cannot be split over the requested tp size."""


def valid_tp_sizes(*sizes: int, limit: int = _MAX_LISTED_TP) -> list[int]:
    """tp sizes (up to `limit`) that divide every one of `sizes` evenly."""
    return [t for t in range(1, limit + 1) if all(s % t == 0 for s in sizes)]


def _fmt(sizes: list[int]) -> str:
    return ", ".join(map(str, sizes))


def divide(numerator: int, tp: int, *, what: str) -> int:
    """numerator / tp, or a ShardError naming `what`, the numbers and the valid divisors.
    For arithmetic that must be exact (a head_dim); splits use split_sizes."""
    if tp < 1:
        raise ShardError(f"tp must be >= 1, got {tp}")
    if numerator % tp:
        raise ShardError(
            f"{what}={numerator} cannot be split over tp={tp}; valid tp sizes: {_fmt(valid_tp_sizes(numerator))}"
        )
    return numerator // tp


def split_sizes(units: int, tp: int) -> list[int]:
    """`units` dealt over tp ranks as evenly as possible: the first units % tp ranks take one more."""
    if tp < 1:
        raise ShardError(f"tp must be >= 1, got {tp}")
    base, extra = divmod(units, tp)
    return [base + (r < extra) for r in range(tp)]


def width_unit(size: int, tp: int) -> int:
    """The block of columns a width split deals in: size / tp (one block each) when tp
    divides size; else the largest power of two up to 64 that divides size and costs at
    most 1% more imbalance than single columns would."""
    if size % tp == 0:
        return size // tp if size else 1

    def worst(unit: int) -> float:  # largest share against the even share
        return -(-(size // unit) // tp) * unit * tp / size

    best, unit = worst(1), _MAX_BLOCK
    while unit > 1 and (size % unit or size // unit < tp or worst(unit) > best * 1.01):
        unit //= 2
    return unit


def split_ranges(size: int, tp: int, *, unit: int | None = None, what: str = "size") -> list[tuple[int, int]]:
    """[start, end) of every rank's slice of a dimension of length `size`, in rank order.

    unit: the indivisible block (head_dim for a dimension of heads); None picks width_unit.
    Every rank gets at least one unit, else a ShardError naming the numbers."""
    if tp < 1:
        raise ShardError(f"tp must be >= 1, got {tp}")
    unit = width_unit(size, tp) if unit is None else unit
    if unit < 1 or size % unit:
        raise ShardError(f"{what}={size} is not a whole number of units of {unit}")
    units = size // unit
    if units < tp:
        kind = "units" if unit == 1 else f"blocks of {unit}"
        raise ShardError(f"{what}={size} ({units} {kind}) cannot give each of tp={tp} ranks a share")
    ranges, start = [], 0
    for n in split_sizes(units, tp):
        ranges.append((start, start + n * unit))
        start += n * unit
    return ranges


def shard_range(size: int, tp: int, rank: int, *, unit: int | None = None, what: str = "size") -> tuple[int, int]:
    """[start, end) of `rank`'s slice of a dimension of length `size` (see split_ranges)."""
    if not 0 <= rank < tp:
        raise ShardError(f"rank={rank} is outside tp={tp}")
    return split_ranges(size, tp, unit=unit, what=what)[rank]


def largest_share(size: int, tp: int, *, unit: int | None = None) -> int:
    """The widest rank's slice of a dimension of length `size` (it sets the pace)."""
    return max(e - s for s, e in split_ranges(size, tp, unit=unit))


def imbalance(size: int, tp: int, *, unit: int | None = None) -> float:
    """Largest share / even share (1.0 = balanced): what the slowest rank costs."""
    widths = [e - s for s, e in split_ranges(size, tp, unit=unit)]
    return max(widths) * tp / size


def padded_size(size: int, multiple: int) -> int:
    """Smallest multiple of `multiple` that is >= size (a vocabulary padded for tp)."""
    return -(-size // multiple) * multiple


def _q_ranges(num_heads: int, num_kv_heads: int, tp: int) -> list[tuple[int, int]]:
    """Contiguous query-head ranges, shares differing by at most one head. When tp is a
    multiple of the KV heads, each KV head's query group is split over its own tp / kv
    ranks, so no rank straddles two groups (28 heads / 4 KV heads at tp=8: 4,3,4,3,...)."""
    if tp % num_kv_heads == 0 and num_heads % tp:
        group, per = num_heads // num_kv_heads, tp // num_kv_heads
        return [
            (h * group + s, h * group + e) for h in range(num_kv_heads) for s, e in split_ranges(group, per, unit=1)
        ]
    return split_ranges(num_heads, tp, unit=1)


class HeadLayout:
    """How attention heads are spread over tp ranks, with grouped-query attention.

    Query heads are dealt out contiguously and as evenly as possible (_q_ranges); each rank
    holds every KV head its query heads attend with, so a KV head whose query group straddles
    two ranks is held by both (replicated). This covers the even cases too: with 2 KV heads
    at tp=4, ranks 0,1 hold KV head 0 and ranks 2,3 hold KV head 1. With 9 heads / 3 KV heads
    at tp=2: rank 0 holds q 0-4 and KV 0-1, rank 1 holds q 5-8 and KV 1-2.

    `kv_groups(rank)`: how many of the rank's query heads use each of its KV heads, in order
    ((3, 2) for rank 0 above); attention with irregular groups runs one group at a time.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, tp: int) -> None:
        if num_heads < 1 or num_kv_heads < 1 or num_heads % num_kv_heads:
            raise ShardError(
                f"num_attention_heads={num_heads} must be a positive multiple of num_key_value_heads={num_kv_heads}"
            )
        if tp < 1:
            raise ShardError(f"tp must be >= 1, got {tp}")
        if tp > num_heads:
            raise ShardError(
                f"tp={tp} is more than the model's num_attention_heads={num_heads}: every rank needs a query head; "
                f"valid tp sizes: 1-{num_heads}"
            )
        self.num_heads, self.num_kv_heads, self.tp = num_heads, num_kv_heads, tp
        self.group = num_heads // num_kv_heads
        """Query heads per KV head in the unsharded model."""
        self._q = _q_ranges(num_heads, num_kv_heads, tp)
        self.even = num_heads % tp == 0
        """Every rank holds the same number of query heads."""
        self.max_heads = max(e - s for s, e in self._q)
        """The largest rank's query heads (it sets the pace)."""
        self.max_kv_heads = max(len(self.kv_heads(r)) for r in range(tp))
        holders = [0] * num_kv_heads
        for r in range(tp):
            for h in self.kv_heads(r):
                holders[h] += 1
        self.kv_holders = tuple(holders)
        """How many ranks hold each KV head."""
        self.replicated = max(holders) > 1
        """Some KV head is held by more than one rank (its weight gradients are summed in training)."""

    @staticmethod
    def valid_tp_sizes(num_heads: int, num_kv_heads: int, limit: int = _MAX_LISTED_TP) -> list[int]:
        """Every tp that gives each rank a query head: 1 to num_heads."""
        return list(range(1, min(limit, num_heads) + 1))

    @staticmethod
    def even_tp_sizes(num_heads: int, num_kv_heads: int, limit: int = _MAX_LISTED_TP) -> list[int]:
        """tp sizes that split the query heads evenly and split or evenly replicate KV heads."""
        return [
            t
            for t in range(1, min(limit, num_heads) + 1)
            if num_heads % t == 0 and (num_kv_heads % t == 0 or t % num_kv_heads == 0)
        ]

    def q_heads(self, rank: int) -> range:
        """Global indices of the query heads on `rank`."""
        return range(*self._q[rank])

    def kv_heads(self, rank: int) -> range:
        """Global indices of the KV heads on `rank`: those its query heads attend with."""
        q = self.q_heads(rank)
        return range(q.start // self.group, (q.stop - 1) // self.group + 1)

    def kv_groups(self, rank: int) -> tuple[int, ...]:
        """Query heads of `rank` per local KV head, in order."""
        q, kv = self.q_heads(rank), self.kv_heads(rank)
        return tuple(min(q.stop, (h + 1) * self.group) - max(q.start, h * self.group) for h in kv)

    def regular(self, rank: int) -> bool:
        """Each local KV head serves the same number of local query heads (plain GQA applies)."""
        return len(set(self.kv_groups(rank))) == 1

    @property
    def imbalance(self) -> float:
        """Largest rank's query heads / the even share (1.0 when tp divides the heads)."""
        return self.max_heads * self.tp / self.num_heads

    def __repr__(self) -> str:
        shares = "/".join(str(len(self.q_heads(r))) for r in range(self.tp))
        return (
            f"HeadLayout(num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, tp={self.tp}: "
            f"q heads per rank {shares}, up to {self.max_kv_heads} kv heads per rank"
            + (", some kv heads replicated" if self.replicated else "")
            + ")"
        )
