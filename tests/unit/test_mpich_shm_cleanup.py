"""The mpiexec launcher's sweep of MPICH's shared-memory segments (launch.mpi.
remove_orphan_mpich_segments): an old segment no process maps is removed; one a process maps,
and a young one (a job starting now), are kept; other files are never touched."""

from __future__ import annotations

import mmap
import os
import time

from shardwise.launch.mpi import remove_orphan_mpich_segments


def _make(path, *, age_s: float) -> None:
    path.write_bytes(b"\0" * 4096)
    t = time.time() - age_s
    os.utime(path, (t, t))


def test_only_old_unmapped_mpich_segments_are_removed(tmp_path):
    orphan, young, mapped, other = (tmp_path / n for n in ("mpich_shm_aa_0", "mpich_shm_bb_0", "mpich_shm_cc_0", "x"))
    _make(orphan, age_s=60)
    _make(young, age_s=1)
    _make(mapped, age_s=60)
    _make(other, age_s=60)
    with open(mapped, "r+b") as f, mmap.mmap(f.fileno(), 4096) as m:  # this process maps it
        m[0] = 1
        removed = remove_orphan_mpich_segments(str(tmp_path), min_age_s=10)
    assert removed == ["mpich_shm_aa_0"]
    assert not orphan.exists() and young.exists() and mapped.exists() and other.exists()
    assert remove_orphan_mpich_segments(str(tmp_path / "missing")) == []
