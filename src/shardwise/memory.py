"""Process memory as Linux reports it: anonymous (heap) memory, not file-backed pages.

Weights read from a memory-mapped safetensors file first appear as file-backed pages,
which the kernel can drop at will; what a rank really pays for is anonymous memory.
`PeakAnonMemory` samples RssAnon from /proc/self/status in a background thread.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

__all__ = ["rss_anon_bytes", "PeakAnonMemory", "import_meta_kernels"]


def rss_anon_bytes() -> int:
    """Resident anonymous memory of this process, in bytes (0 where /proc is unavailable)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def import_meta_kernels() -> None:
    """Import what computing on the meta device imports (torch's decompositions, dynamo,
    sympy: about 70 MiB of Python objects, once per process), so that a measurement taken
    after this counts it in the baseline after imports, not in the load. shardwise's own
    loading does not import them (shardwise.models.meta); the benchmarks call this so that
    every loader they compare starts from the same baseline."""
    import torch

    with torch.device("meta"):
        torch.nn.Embedding(1, 1)


class PeakAnonMemory:
    """Context manager: the peak of RssAnon inside the block, above its value at entry.

    with PeakAnonMemory() as mem:
        load()
    mem.peak_above_baseline  # bytes
    """

    def __init__(self, interval_s: float = 0.0005) -> None:
        self.interval_s = interval_s
        self.baseline = self.peak = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_anon_bytes())
            time.sleep(self.interval_s)

    def __enter__(self) -> PeakAnonMemory:
        self.baseline = self.peak = rss_anon_bytes()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.peak = max(self.peak, rss_anon_bytes())

    @property
    def peak_above_baseline(self) -> int:
        return self.peak - self.baseline
