"""The arithmetic both calibrations share (shardwise.bench.calibrate for a backend's link,
shardwise.bench.hostlinks for the shared-memory and cross-host paths): a link's latency and
bandwidth fitted to timed sizes, and a collective's extra cost after a burst of compute."""

from __future__ import annotations

__all__ = ["fit_link", "after_compute_extra_us", "monotone_times"]


def after_compute_extra_us(per_call_us: float, idle_us: float) -> float:
    """What a collective inside a step costs beyond the same collective between idle ranks:
    per_call - idle, at least 0 (a backend that spins may come out a little faster)."""
    return max(0.0, per_call_us - idle_us)


def monotone_times(points: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """(bytes, seconds) points by size, each time at most any larger message's: a smaller
    all-reduce cannot cost more than a larger one on the same link, so a figure above a larger
    size's is a slow launch (across the veth on 2026-12-05: 4 KiB 2234 us, 16 KiB 514 us)."""
    out, best = [], float("inf")
    for n, t in sorted(points, reverse=True):
        best = min(best, t)
        out.append((n, best))
    return out[::-1]


def fit_link(points: list[tuple[int, float]]) -> tuple[float, float]:
    """(latency_us, busbw_gbps) of time = latency + n / busbw over (bytes, seconds) points at
    world size 2, by least squares on relative error (small and large sizes count alike)."""
    import numpy as np

    n = np.array([p[0] for p in points], dtype=float)
    t = np.array([p[1] for p in points], dtype=float)
    (a, b), *_ = np.linalg.lstsq(np.stack([1 / t, n / t], axis=1), np.ones_like(t), rcond=None)
    if b <= 0:  # latency-bound everywhere: take the bandwidth of the largest message alone
        b = t[-1] / n[-1]
    a = max(a, float(t.min()) * 0.5) if a <= 0 else a
    return float(a * 1e6), float(1 / b / 1e9)
