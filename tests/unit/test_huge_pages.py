"""Weights a decode step streams on transparent huge pages (shardwise.memory.empty_huge,
on_huge_pages): where they start, that the advice reaches the kernel, that the values and
the kernels' results are unchanged, and the ways out (small tensors, SHARDWISE_HUGE_PAGES=0)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shardwise.kernels.block import BlockWeight
from shardwise.kernels.quantize import quantize_rows
from shardwise.kernels.rows import Rows
from shardwise.memory import HUGE_PAGE, empty_huge, on_huge_pages

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _vm_flags(ptr: int) -> list[str]:
    """The VmFlags of the mapping of this process that holds address `ptr`."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    inside = False
    for line in lines:
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= ptr < hi
        elif inside and line.startswith("VmFlags:"):
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {ptr:#x}")


def test_a_big_tensor_starts_on_a_huge_page_and_is_advised_for_them():
    t = empty_huge((3 * 1024, 1111), torch.uint8)  # 3.3 MiB: one whole huge page and a tail
    assert t.shape == (3072, 1111) and t.dtype is torch.uint8 and t.is_contiguous()
    assert t.data_ptr() % HUGE_PAGE == 0
    t.fill_(7)
    assert int(t.sum()) == 7 * t.numel()
    if not THP.exists():
        pytest.skip("this kernel has no transparent huge pages")
    assert "hg" in _vm_flags(t.data_ptr())  # madvise(MADV_HUGEPAGE) reached the mapping
    tail = t.data_ptr() + HUGE_PAGE  # past the whole huge pages: ordinary pages, no advice
    assert "hg" not in _vm_flags(tail + 4096)


def test_copies_keep_values_and_small_tensors_stay_where_they_are():
    big = torch.randn(1024, 1024)  # 4 MiB
    moved = on_huge_pages(big)
    assert moved.data_ptr() % HUGE_PAGE == 0 and moved.data_ptr() != big.data_ptr()
    assert torch.equal(moved, big) and moved.dtype is big.dtype and moved.shape == big.shape
    small = torch.randn(100, 100)
    assert on_huge_pages(small) is small


def test_switched_off_it_is_a_plain_allocation(monkeypatch):
    if not THP.exists():
        pytest.skip("this kernel has no transparent huge pages")
    monkeypatch.setenv("SHARDWISE_HUGE_PAGES", "0")
    e = empty_huge((2048, 2048), torch.uint8)
    assert e.shape == (2048, 2048) and "hg" not in _vm_flags(e.data_ptr())
    monkeypatch.setenv("SHARDWISE_HUGE_PAGES", "1")
    assert "hg" in _vm_flags(empty_huge((2048, 2048), torch.uint8).data_ptr())


def test_block_weights_built_on_huge_pages_compute_as_before():
    """--quantize's rows land on huge pages; the same blocks elsewhere give the same outputs."""
    torch.manual_seed(0)
    w = torch.randn(2048, 1024)
    rows = Rows.for_weight(tuple(w.shape), "int8")  # Q8_0 blocks on CPU
    rows.add(w)
    assert rows.data.data_ptr() % HUGE_PAGE == 0  # 2.1 MiB of blocks
    plain = quantize_rows(w, "Q8_0")
    assert torch.equal(rows.data, plain)
    x = torch.randn(3, 1024)
    a = BlockWeight.of([("Q8_0", rows.data)], 1024).linear(x)
    b = BlockWeight.of([("Q8_0", plain.clone())], 1024).linear(x)
    assert torch.equal(a, b)


def test_a_shard_read_from_a_checkpoint_lands_on_huge_pages_joined_once():
    """hf.sources._fresh: a rank's pieces (views of the mapped file) joined into memory it
    owns, starting on a huge page when 2 MiB or more; a small one stays an ordinary copy."""
    from types import SimpleNamespace

    from shardwise.hf.sources import _fresh

    a, b = torch.randn(300, 1024), torch.randn(400, 1024)  # 2.7 MiB joined
    ckpt = SimpleNamespace(fresh_reads=False)
    joined = _fresh(ckpt, [a, b], torch.float32, 0)
    assert joined.data_ptr() % HUGE_PAGE == 0 and torch.equal(joined, torch.cat([a, b]))
    one = _fresh(ckpt, [b.half()], torch.float32, 0)  # converted on the way
    assert torch.equal(one, b.half().float())
    small = torch.randn(10, 10)
    copy = _fresh(ckpt, [small], torch.float32, 0)
    assert torch.equal(copy, small) and copy.data_ptr() != small.data_ptr()  # never aliases the file
