"""Process memory as Linux reports it: anonymous (heap) memory, not file-backed pages.

Weights read from a memory-mapped safetensors file first appear as file-backed pages,
which the kernel can drop at will; what a rank really pays for is anonymous memory.
`PeakAnonMemory` samples RssAnon from /proc/self/status in a background thread.

What the host allows (`host_memory`): the smaller of the memory cgroup's room (v2:
memory.max - memory.current; v1: memory.limit_in_bytes - memory.usage_in_bytes) and
MemAvailable from /proc/meminfo; SHARDWISE_MEMORY_LIMIT (e.g. 2GiB) overrides both, for
tests and for a budget of one's own. `oom_kills` reads the cgroup's count of processes the
kernel's out-of-memory killer ended (v2 memory.events, v1 memory.oom_control: oom_kill).

`zeros_on_touch`: a zero tensor that costs no resident memory until its pages are written
(the paged KV pool: a block's pages are committed when a sequence first writes it).

`empty_huge` / `on_huge_pages`: CPU memory advised for transparent huge pages (2 MiB), for
weights a decode step streams: one TLB entry covers 512 times the bytes, and one row through
the Q8_0 kernel streamed 26 GB/s from ordinary pages, 30 GB/s from huge ones (AMD Zen 4,
docs/benchmarks/native-kernels.md). SHARDWISE_HUGE_PAGES=0 turns it off.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import os
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = [
    "rss_anon_bytes",
    "zeros_on_touch",
    "empty_huge",
    "on_huge_pages",
    "HUGE_PAGE",
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
_V1_FILES = ("memory.limit_in_bytes", "memory.usage_in_bytes")
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


def _cgroup_dirs(root: Path, self_cgroup: Path) -> list[tuple[str, Path]]:
    """("cgroup v2" or "cgroup v1", directory) of this process's memory cgroup and each of its
    ancestors up to the mount's root, innermost first, v2 (root) before v1 (root/memory). The
    path comes from /proc/self/cgroup. A container may mount its own cgroup as the root (a
    cgroup namespace, or a bind mount that leaves /proc/self/cgroup the host's full path): then
    the longest tail of the path that is under the mount is this process's cgroup (a child
    cgroup made inside the container included), else the root."""
    lines = (_read(self_cgroup) or "").splitlines()
    out = []
    for version, base, wanted in (("cgroup v2", root, {""}), ("cgroup v1", root / "memory", {"memory"})):
        path = next(
            (f[2] for f in (x.split(":", 2) for x in lines) if len(f) == 3 and wanted & {*f[1].split(",")}), "/"
        )
        parts = [p for p in path.split("/") if p]
        d = next((base.joinpath(*parts[i:]) for i in range(len(parts)) if base.joinpath(*parts[i:]).is_dir()), base)
        while True:
            out.append((version, d))
            if d == base or base not in d.parents:
                break
            d = d.parent
    return out


@dataclass(frozen=True)
class HostMemory:
    """Bytes this host lets the job use now, and where the figure comes from."""

    available: int
    source: str
    """E.g. "MemAvailable", "cgroup v2 limit (memory.max - memory.current)", "SHARDWISE_MEMORY_LIMIT"."""


def host_memory(
    root: Path = _CGROUP, meminfo: Path = Path("/proc/meminfo"), self_cgroup: Path = Path("/proc/self/cgroup")
) -> HostMemory | None:
    """What the host allows: SHARDWISE_MEMORY_LIMIT if set, else the smallest of the room under
    each memory cgroup limit above this process (its own cgroup's and its ancestors') and
    MemAvailable; None when none can be read."""
    override = os.environ.get(LIMIT_ENV)
    if override:
        return HostMemory(parse_size(override), LIMIT_ENV)
    found = []
    for version, d in _cgroup_dirs(root, self_cgroup):
        v2 = version == "cgroup v2"
        limit, usage = (d / f for f in (("memory.max", "memory.current") if v2 else _V1_FILES))
        texts = _read(limit), _read(usage)
        room = cgroup_room(*texts) if None not in texts else None
        if room is not None:
            files = "memory.max - memory.current" if v2 else "limit_in_bytes - usage_in_bytes"
            found.append(HostMemory(room, f"{version} limit ({files})"))
    text = _read(meminfo)
    avail = parse_meminfo(text) if text is not None else None
    if avail is not None:
        found.append(HostMemory(avail, "MemAvailable"))
    return min(found, key=lambda h: h.available) if found else None


def oom_kills(root: Path = _CGROUP, self_cgroup: Path = Path("/proc/self/cgroup")) -> int | None:
    """Processes of this process's memory cgroup (and, on v2, its descendants) that the kernel's
    OOM killer has ended so far; None if unreadable."""
    for version, d in _cgroup_dirs(root, self_cgroup):
        text = _read(d / ("memory.events" if version == "cgroup v2" else "memory.oom_control"))
        if text is not None:
            return parse_oom_kill(text)
    return None


def rss_anon_bytes() -> int:
    """Resident anonymous memory of this process, in bytes (0 where /proc is unavailable)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def zeros_on_touch(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str | None = None
) -> torch.Tensor:
    """torch.zeros(shape, dtype) whose memory is committed page by page as it is first written.

    On the CPU: a private anonymous mmap, which the kernel hands out zero-filled and maps
    on the first write (a read of an untouched page maps the shared zero page: no
    resident memory either). torch.zeros would write every page at once. The mapping
    lives as long as the tensor (torch.frombuffer keeps the buffer alive). Elsewhere
    (CUDA): torch.zeros."""
    import torch  # NOTE: here, so that the launcher's memory checks do not import torch

    nbytes = math.prod(shape) * dtype.itemsize
    if torch.device(device or "cpu").type != "cpu" or nbytes == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE)
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).view(shape)


HUGE_PAGE = 2 << 20
"""The transparent huge page of x86-64 and most arm64 kernels."""


def empty_huge(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """torch.empty(shape, dtype) on the CPU, starting on a 2 MiB boundary and advised
    (madvise MADV_HUGEPAGE) for transparent huge pages over its whole 2 MiB pages (the tail
    stays on small pages: no resident memory beyond the tensor's own). A plain torch.empty
    when smaller than a huge page, where madvise is missing or SHARDWISE_HUGE_PAGES=0;
    where the kernel has THP off, the advice does nothing."""
    import torch

    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE") or os.environ.get("SHARDWISE_HUGE_PAGES") == "0":
        return torch.empty(shape, dtype=dtype)
    buf = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE)
    whole = torch.frombuffer(buf, dtype=torch.uint8)  # keeps buf alive with the tensor
    offset = -whole.data_ptr() % HUGE_PAGE
    with contextlib.suppress(OSError):  # a kernel built without THP: ordinary pages
        buf.madvise(mmap.MADV_HUGEPAGE, offset, nbytes // HUGE_PAGE * HUGE_PAGE)
    return whole[offset : offset + nbytes].view(dtype).view(shape)


def on_huge_pages(t: torch.Tensor) -> torch.Tensor:
    """`t` copied into empty_huge memory (t itself where that would be ordinary pages anyway:
    not on the CPU, or smaller than a huge page)."""
    if t.device.type != "cpu" or t.numel() * t.element_size() < HUGE_PAGE:
        return t
    out = empty_huge(tuple(t.shape), t.dtype)
    return out.copy_(t) if out.data_ptr() % HUGE_PAGE == 0 else t


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
