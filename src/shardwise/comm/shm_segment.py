"""The shared-memory segment of an intra-host all-reduce (shardwise.comm.shm): a file in
/dev/shm, mapped by every rank of one group.

Its layout (offsets in bytes; every word an int64):

    0                      magic, nonce, size, slot_bytes        (the header, 4 words)
    64 * (1 + r)           rank r's line: seq, pid, failed       (a cache line each, r < size <= 62)
    DATA + (b * size + r) * slot_bytes                           rank r's slot of buffer b (b = 0, 1)

Its name is PREFIX + '<creator pid>-<nonce hex>'. The creator unlinks it once every rank has
mapped it (the mappings live on), and at exit if it gets no further; a launcher removes the
ones its dead ranks made (`remove_segments`), since a rank killed in between runs no atexit.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import mmap
import os
import platform
import socket
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["Segment", "SHM_DIR", "PREFIX", "SEQ", "PID", "FAILED", "host_key", "supported", "remove_segments"]

SHM_DIR = "/dev/shm"
PREFIX = "shardwise-shm-"
SEQ, PID, FAILED = 0, 1, 2
"""The words of a rank's line: its last call's sequence number, its pid, whether it failed."""
DATA = 4096
"""Where the slots start: after the header and 63 rank lines."""
_LINE = 8  # int64 words per rank line (64 bytes)
_MAGIC = 0x5348_5741_5348_4D31  # "SHWASHM1"


class Segment:
    """A mapped segment: its header words (`words`, a memoryview of int64) and its slots, and its
    file while linked. create: make it (O_EXCL, its pages reserved); else open rank 0's, which
    must hold the same nonce, size and slot_bytes."""

    def __init__(self, path: Path, size: int, slot_bytes: int, *, create: bool, nonce: int) -> None:
        if not 2 <= size <= DATA // 64 - 2 or slot_bytes % 64:
            raise ValueError(
                f"a segment holds 2-{DATA // 64 - 2} ranks of slots of whole cache lines: {size}, {slot_bytes}"
            )
        self.path: Path | None = None  # while it is ours to unlink: the creator's, until every rank mapped it
        self.size, self.slot_bytes = size, slot_bytes
        nbytes = DATA + 2 * size * slot_bytes
        fd = os.open(path, (os.O_CREAT | os.O_EXCL | os.O_RDWR) if create else os.O_RDWR, 0o600)
        try:
            if create:
                self.path = path
                atexit.register(self.unlink)
                os.posix_fallocate(fd, 0, nbytes)  # ENOSPC now, rather than SIGBUS on first touch
            elif os.fstat(fd).st_size != nbytes:
                raise OSError(f"segment {path} has {os.fstat(fd).st_size} bytes, not {nbytes}")
            self.mm = mmap.mmap(fd, nbytes)
        except OSError:
            if create:
                self.unlink()
            raise
        finally:
            os.close(fd)
        self.words = memoryview(self.mm).cast("q")  # every word; the header's are all that is read
        if create:
            self.words[1], self.words[2], self.words[3] = nonce, size, slot_bytes
            self.words[0] = _MAGIC
        elif tuple(self.words[0:4]) != (_MAGIC, nonce, size, slot_bytes):
            self.close()
            raise OSError(f"segment {path} is not the one rank 0 made")

    def line(self, rank: int) -> int:
        """The index in `words` of rank's line (its SEQ word; PID and FAILED follow)."""
        return _LINE * (1 + rank)

    def slots(self, dtype: torch.dtype) -> torch.Tensor:
        """(2, size, slot_bytes // itemsize): both buffers' slots, as `dtype`."""
        import torch  # NOTE: here, so that a launcher's cleanup (remove_segments) needs no torch

        per = self.slot_bytes // dtype.itemsize
        flat = torch.frombuffer(self.mm, dtype=dtype, count=2 * self.size * per, offset=DATA)
        return flat.view(2, self.size, per)

    def unlink(self) -> None:
        """Remove its name (the mappings stay); idempotent."""
        if self.path is not None:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
            atexit.unregister(self.unlink)
            self.path = None

    def close(self) -> None:
        self.unlink()
        self.words.release()
        with contextlib.suppress(BufferError):  # a view of it still held somewhere: unmapped with that
            self.mm.close()


def host_key() -> int:
    """This machine (hostname, boot id, architecture) as an int64, to compare across ranks."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    digest = hashlib.sha256(f"{socket.gethostname()}|{boot}|{platform.machine()}".encode()).digest()
    return int.from_bytes(digest[:8], "little", signed=True)


def supported() -> bool:
    """Whether this host can run the protocol: x86-64 (see shardwise.comm.shm's NOTE) and a /dev/shm."""
    return platform.machine() in ("x86_64", "AMD64") and os.path.isdir(SHM_DIR)


def remove_segments(pids: list[int]) -> list[str]:
    """Unlink the segments the processes `pids` made (a launcher's cleanup once its ranks have
    ended: one may have died between making its segment and its peers mapping it). The names removed."""
    removed = []
    for pid in pids:
        for path in Path(SHM_DIR).glob(f"{PREFIX}{pid}-*"):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
                removed.append(path.name)
    return removed
