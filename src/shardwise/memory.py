"""Process memory as Linux reports it: anonymous (heap) memory, not file-backed pages.

Weights read from a memory-mapped safetensors file first appear as file-backed pages,
which the kernel can drop at will; what a rank really pays for is anonymous memory.
`PeakAnonMemory` samples RssAnon from /proc/self/status in a background thread.

What the host allows (`host_memory`): the smaller of the memory cgroup's room (v2:
memory.max - memory.current; v1: memory.limit_in_bytes - memory.usage_in_bytes) and
MemAvailable from /proc/meminfo; SHARDWISE_MEMORY_LIMIT (e.g. 2GiB) overrides both, for
tests and for a budget of one's own. `oom_kills` reads the cgroup's count of processes the
kernel's out-of-memory killer ended (v2 memory.events, v1 memory.oom_control: oom_kill).
"""

from __future__ import annotations

import os
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "rss_anon_bytes",
    "PeakAnonMemory",
    "import_meta_kernels",
    "HostMemory",
    "host_memory",
    "oom_kills",
    "parse_size",
    "parse_meminfo",
    "parse_oom_kill",
    "cgroup_room",
    "fmt_bytes",
    "LIMIT_ENV",
    "NEED_ENV",
]

LIMIT_ENV = "SHARDWISE_MEMORY_LIMIT"
NEED_ENV = "SHARDWISE_MEMORY_NEED"
"""Bytes the busiest rank was estimated to need (the commands' pre-check, shardwise.cli.memcheck),
for the launcher to name when a rank is killed by the out-of-memory killer."""
_UNLIMITED = 2**60  # cgroup v1 writes "no limit" as a page-rounded 2^63 - 1
_CGROUP = Path("/sys/fs/cgroup")
_UNITS = {"": 1, "b": 1, "k": 2**10, "kb": 2**10, "kib": 2**10, "m": 2**20, "mb": 2**20, "mib": 2**20}
_UNITS |= {"g": 2**30, "gb": 2**30, "gib": 2**30, "t": 2**40, "tb": 2**40, "tib": 2**40}


def fmt_bytes(n: float) -> str:
    """Bytes in words: "11.27 GiB", or under a GiB "612.0 MiB"."""
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def parse_size(text: str) -> int:
    """ "2GiB", "512M", "1.5g", "1073741824" -> bytes (binary units); ValueError otherwise."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if m is None or m.group(2).lower() not in _UNITS:
        raise ValueError(f"not a memory size: {text!r} (e.g. 2GiB, 512MiB, or bytes)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def parse_meminfo(text: str) -> int | None:
    """MemAvailable of /proc/meminfo's text, in bytes (None if absent)."""
    for line in text.splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return None


def cgroup_room(limit: str, usage: str) -> int | None:
    """Bytes left under a cgroup limit, from the two files' text (v2 memory.max and
    memory.current, or v1 memory.limit_in_bytes and memory.usage_in_bytes); None when
    there is no limit ("max", or v1's huge number)."""
    limit = limit.strip()
    if limit == "max" or int(limit) >= _UNLIMITED:
        return None
    return max(0, int(limit) - int(usage.strip()))


def parse_oom_kill(text: str) -> int | None:
    """The oom_kill count of v2 memory.events or v1 memory.oom_control text (None if absent)."""
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key == "oom_kill":
            return int(value)
    return None


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def _cgroup_files(root: Path, v2: tuple[str, ...], v1: tuple[str, ...]) -> tuple[str, list[str]] | None:
    """("cgroup v2" or "cgroup v1", the files' text), the first version whose files all read."""
    for name, files in (("cgroup v2", [root / f for f in v2]), ("cgroup v1", [root / "memory" / f for f in v1])):
        texts = [_read(f) for f in files]
        if all(t is not None for t in texts):
            return name, texts
    return None


@dataclass(frozen=True)
class HostMemory:
    """Bytes this host lets the job use now, and where the figure comes from."""

    available: int
    source: str
    """E.g. "MemAvailable", "cgroup v2 limit (memory.max - memory.current)", "SHARDWISE_MEMORY_LIMIT"."""


def host_memory(root: Path = _CGROUP, meminfo: Path = Path("/proc/meminfo")) -> HostMemory | None:
    """What the host allows: SHARDWISE_MEMORY_LIMIT if set, else the smaller of the memory
    cgroup's room and MemAvailable; None when neither can be read."""
    override = os.environ.get(LIMIT_ENV)
    if override:
        return HostMemory(parse_size(override), LIMIT_ENV)
    found = []
    group = _cgroup_files(root, ("memory.max", "memory.current"), ("memory.limit_in_bytes", "memory.usage_in_bytes"))
    if group is not None:
        room = cgroup_room(*group[1])
        if room is not None:
            files = "memory.max - memory.current" if group[0] == "cgroup v2" else "limit_in_bytes - usage_in_bytes"
            found.append(HostMemory(room, f"{group[0]} limit ({files})"))
    text = _read(meminfo)
    avail = parse_meminfo(text) if text is not None else None
    if avail is not None:
        found.append(HostMemory(avail, "MemAvailable"))
    return min(found, key=lambda h: h.available) if found else None


def oom_kills(root: Path = _CGROUP) -> int | None:
    """Processes of this cgroup the kernel's OOM killer has ended so far (None if unreadable)."""
    group = _cgroup_files(root, ("memory.events",), ("memory.oom_control",))
    return parse_oom_kill(group[1][0]) if group is not None else None


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
