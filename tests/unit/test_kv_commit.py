"""The paged KV pool commits its memory as blocks are first written, not when it is built
(shardwise.memory.zeros_on_touch): RssAnon from /proc/self/status before and after."""

from __future__ import annotations

import pytest
import torch

from shardwise.comm import LocalCommunicator
from shardwise.engine.paged import BlockTables, PagedCaches
from shardwise.engine.slots import StepBatch
from shardwise.engine.text import DEFAULT_MODEL
from shardwise.hf import load_pretrained
from shardwise.memory import rss_anon_bytes, zeros_on_touch

MiB = 2**20
pytestmark = pytest.mark.skipif(rss_anon_bytes() == 0, reason="needs /proc/self/status (Linux)")


def test_zeros_on_touch_commits_pages_as_written():
    before = rss_anon_bytes()
    t = zeros_on_touch((256, MiB // 4), torch.float32)  # 256 MiB
    assert t.shape == (256, MiB // 4) and t.dtype == torch.float32 and t.is_contiguous()
    assert float(t.sum()) == 0.0  # zeros, and reading maps no memory of its own
    assert rss_anon_bytes() - before < 16 * MiB
    t[:64] = 1.0  # the first 64 MiB written
    grown = rss_anon_bytes() - before
    assert 60 * MiB < grown < 80 * MiB, grown / MiB
    assert float(t.sum()) == 64 * MiB // 4
    bf = zeros_on_touch((3, 5), torch.bfloat16)
    assert bf.dtype == torch.bfloat16 and torch.equal(bf, torch.zeros(3, 5, dtype=torch.bfloat16))
    assert zeros_on_touch((0, 4), torch.float32).shape == (0, 4)


def test_paged_pool_is_resident_only_where_used():
    model, _ = load_pretrained(DEFAULT_MODEL, comm=LocalCommunicator())
    per_block = PagedCaches.bytes_per_block(model)  # 64 KiB over the 4 layers
    num_blocks = 512 * MiB // per_block
    before = rss_anon_bytes()
    caches = PagedCaches(model, num_blocks)
    assert caches.nbytes == num_blocks * per_block == 512 * MiB
    assert rss_anon_bytes() - before < 24 * MiB  # torch.zeros: all 512 MiB resident here
    tables = BlockTables(num_blocks)
    g = torch.Generator().manual_seed(0)
    rows = [(s, torch.randint(2, 500, (300,), generator=g).tolist()) for s in (0, 1)]
    tables.reserve({s: len(ids) for s, ids in rows})  # 2 x 19 blocks
    with torch.no_grad():
        logits = caches.forward(model, StepBatch.build([(s, 0, ids) for s, ids in rows], tables=tables.rows([0, 1])))
        nxt = logits.argmax(-1).tolist()
        caches.forward(
            model,
            StepBatch.build([(s, 300, [t]) for (s, _), t in zip(rows, nxt, strict=True)], tables=tables.rows([0, 1])),
        )
    assert rss_anon_bytes() - before < 24 * MiB  # 38 blocks written: 2.4 MiB of the pool
    used = sorted({b for t in tables.tables.values() for b in t})
    k = caches.layers[0].k
    assert bool(k[used].abs().sum() > 0) and float(k[used[-1] + 1 :].abs().sum()) == 0.0
