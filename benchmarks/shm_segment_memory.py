"""What the shared-memory communicator's segment adds to each rank (shardwise.comm.shm): the
ranks' RssShmem (/proc/self/status) before the tp group exists, once it is set up, and after
two full-slot all-reduces have touched both of its buffers.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/shm_segment_memory.py [--tp 2]

Prints one line per rank: kB before, after setup, after use; the communicator; its slot size.
The pages are shared: the group's ranks map the same 2 x tp slots (plus a 4 KiB header),
counted in every rank's RSS and held once in memory.
"""

from __future__ import annotations

import argparse

import torch

from shardwise.comm import tp_only
from shardwise.launch import launch


def _shmem_kb() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssShmem"):
                return int(line.split()[1])
    return -1


def _rank(world) -> tuple:
    before = _shmem_kb()
    tp = tp_only(world)
    made = _shmem_kb()
    full = torch.ones(tp.max_bytes // 4)  # one whole slot of fp32
    tp.all_reduce(full)
    tp.all_reduce(full)  # the second buffer
    return before, made, _shmem_kb(), type(tp).__name__, tp.max_bytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, default=2)
    args = ap.parse_args()
    for r, (before, made, used, kind, slot) in enumerate(launch(_rank, args.tp)):
        print(f"rank {r}: RssShmem {before} kB before, {made} kB set up, {used} kB used; {kind}, slot {slot} bytes")


if __name__ == "__main__":
    main()
