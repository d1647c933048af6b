"""The shared-memory all-reduce's segment file (shardwise.comm.shm_segment): made, mapped and
checked; its name gone at exit however the creator ends normally, and by a launcher's
cleanup (by pid) when it was killed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from shardwise.comm.shm_segment import PREFIX, SHM_DIR, Segment, remove_segments

pytestmark = pytest.mark.skipif(not os.path.isdir(SHM_DIR), reason=f"no {SHM_DIR}")


def _path(tag: str) -> Path:
    return Path(SHM_DIR) / f"{PREFIX}{os.getpid()}-{tag}"


def test_a_segment_is_mapped_by_its_peers_and_checked():
    path = _path("c0ffee")
    seg = Segment(path, 3, 128, create=True, nonce=7)
    try:
        assert path.stat().st_size == 4096 + 2 * 3 * 128
        peer = Segment(path, 3, 128, create=False, nonce=7)
        seg.words[seg.line(2)] = 41  # rank 2's seq, seen through the other mapping
        assert peer.words[peer.line(2)] == 41 and peer.line(2) == 24
        for nonce, size, slot in ((8, 3, 128), (7, 2, 128), (7, 3, 192)):
            with pytest.raises(OSError):
                Segment(path, size, slot, create=False, nonce=nonce)
        with pytest.raises(FileExistsError):
            Segment(path, 3, 128, create=True, nonce=7)
        peer.close()
    finally:
        seg.close()
    assert not path.exists()


def test_sizes_the_header_cannot_hold_are_refused():
    for size, slot in ((1, 64), (63, 64), (2, 100)):
        with pytest.raises(ValueError, match="a segment holds 2-62 ranks"):
            Segment(_path("bad"), size, slot, create=True, nonce=1)
    assert not _path("bad").exists()


@pytest.mark.slow  # a fresh interpreter: about 3 s
def test_the_creator_unlinks_it_at_exit():
    code = (
        "import os, sys; from pathlib import Path; from shardwise.comm.shm_segment import Segment; "
        "p = Path(sys.argv[1]); Segment(p, 2, 64, create=True, nonce=1); assert p.exists()"
    )
    path = _path("atexit")
    out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    assert not path.exists()


def test_a_launcher_removes_only_its_dead_ranks_segments():
    dead, live = os.getpid() + 100_000_000, os.getpid()  # pid names only: no process needed
    left = [Path(SHM_DIR) / f"{PREFIX}{dead}-{tag}" for tag in ("a1", "b2")]
    mine, other = _path("live"), Path(SHM_DIR) / f"{PREFIX}{dead}0-c3"  # another pid that starts alike
    for p in (*left, mine, other):
        p.touch()
    try:
        assert sorted(remove_segments([dead])) == sorted(p.name for p in left)
        assert not any(p.exists() for p in left) and mine.exists() and other.exists()
        assert remove_segments([live]) == [mine.name] and not mine.exists()
    finally:
        for p in (*left, mine, other):
            p.unlink(missing_ok=True)
