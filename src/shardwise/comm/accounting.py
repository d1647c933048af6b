"""Communication accounting: every collective a Communicator issues is counted here.

The counts are what `shardwise info`, `generate --json` and the planner report, and
what the tests assert on ("exactly 2 all-reduces per block forward").
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

__all__ = ["CommStats", "OpCount"]


@dataclass
class OpCount:
    """Calls, payload bytes (this rank's input tensor) and wall time of one (op, group) pair."""

    calls: int = 0
    bytes: int = 0
    seconds: float = 0.0


@dataclass
class CommStats:
    """Counters keyed by (op, group name). Shared by a world communicator and its splits."""

    counts: dict[tuple[str, str], OpCount] = field(default_factory=dict)

    def record(self, op: str, group: str, nbytes: int, seconds: float = 0.0, calls: int = 1) -> None:
        """One call (or `calls` calls of nbytes in all, seconds in all) of op on group."""
        entry = self.counts.setdefault((op, group), OpCount())
        entry.calls += calls
        entry.bytes += nbytes
        entry.seconds += seconds

    def calls(self, op: str | None = None, group: str | None = None) -> int:
        """Number of collectives matching op and group (None matches any)."""
        return sum(c.calls for (o, g), c in self.counts.items() if op in (None, o) and group in (None, g))

    def bytes(self, op: str | None = None, group: str | None = None) -> int:
        """Payload bytes of the collectives matching op and group (None matches any)."""
        return sum(c.bytes for (o, g), c in self.counts.items() if op in (None, o) and group in (None, g))

    def seconds(self, op: str | None = None, group: str | None = None) -> float:
        """Wall time spent inside the collectives matching op and group (None matches any)."""
        return sum(c.seconds for (o, g), c in self.counts.items() if op in (None, o) and group in (None, g))

    def snapshot(self) -> dict[str, dict[str, int]]:
        """A JSON-ready copy: {"all_reduce/tp": {"calls": 2, "bytes": 4096}, ...}."""
        return {f"{o}/{g}": {"calls": c.calls, "bytes": c.bytes} for (o, g), c in sorted(self.counts.items())}

    def reset(self) -> None:
        self.counts.clear()

    def copy(self) -> CommStats:
        return CommStats({k: OpCount(v.calls, v.bytes, v.seconds) for k, v in self.counts.items()})

    def __sub__(self, other: CommStats) -> CommStats:
        out = CommStats()
        for key, c in self.counts.items():
            before = other.counts.get(key, OpCount())
            if c.calls != before.calls:
                out.counts[key] = OpCount(c.calls - before.calls, c.bytes - before.bytes, c.seconds - before.seconds)
        return out

    @contextmanager
    def track(self) -> Iterator[CommStats]:
        """Yield a CommStats that, on exit, holds only what was issued inside the block."""
        before = self.copy()
        delta = CommStats()
        try:
            yield delta
        finally:
            delta.counts = (self - before).counts

    def __str__(self) -> str:
        if not self.counts:
            return "no collectives"
        return ", ".join(f"{o}/{g}: {c.calls} ({_human(c.bytes)})" for (o, g), c in sorted(self.counts.items()))


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
