"""ScheduleConfig: which schedule, for how many stages and micro-batches, validated on construction.

Every error is one line that names the numbers and the valid choices, raised before
anything runs (the `shardwise train` config and the launcher can build one early).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SCHEDULE_NAMES", "ScheduleConfig", "ScheduleError"]

SCHEDULE_NAMES = ("gpipe", "1f1b", "interleaved")


class ScheduleError(ValueError):
    """A schedule that cannot be built with these numbers (one line, numbers named)."""


def _positive_int(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ScheduleError(f"{name} must be a positive int, got {value!r}")


@dataclass(frozen=True)
class ScheduleConfig:
    """A pipeline schedule's name and sizes."""

    name: str
    """"gpipe" (all forwards, then all backwards), "1f1b" or "interleaved" (1F1B over virtual stages)."""
    pp: int
    """Pipeline ranks."""
    microbatches: int
    """Micro-batches per optimizer step (m)."""
    virtual_stages: int = 1
    """Model chunks per rank (v): 1 for gpipe and 1f1b, at least 2 for interleaved."""

    def __post_init__(self) -> None:
        if self.name not in SCHEDULE_NAMES:
            raise ScheduleError(f"unknown schedule {self.name!r}; valid: {', '.join(SCHEDULE_NAMES)}")
        for field in ("pp", "microbatches", "virtual_stages"):
            _positive_int(field, getattr(self, field))
        p, m, v = self.pp, self.microbatches, self.virtual_stages
        if self.name != "interleaved":
            if v != 1:
                raise ScheduleError(
                    f"schedule {self.name!r} runs one model chunk per rank: virtual_stages must be 1, got {v}; "
                    "use 'interleaved' for more"
                )
            return
        if v < 2:
            raise ScheduleError(
                f"interleaved 1F1B needs virtual_stages >= 2, got {v}; with 1 chunk per rank use '1f1b'"
            )
        if p < 2:
            raise ScheduleError(
                f"interleaved 1F1B needs pp >= 2, got pp={p}: on one rank every chunk is local and there is "
                "no bubble to shrink; use '1f1b'"
            )
        if m % p:
            valid = ", ".join(str(p * k) for k in range(1, 4))
            raise ScheduleError(
                f"interleaved 1F1B needs microbatches to be a multiple of pp={p} (they run in groups of pp "
                f"through each chunk); got {m}; valid: {valid}, ...; or use '1f1b', which takes any"
            )

    @property
    def stages(self) -> int:
        """Virtual stages in the whole pipeline: pp * virtual_stages."""
        return self.pp * self.virtual_stages
