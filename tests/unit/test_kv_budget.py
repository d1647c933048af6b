"""serve --kv-cache-memory: the paged pool's blocks from a budget, the budget's bytes per
block against a loaded rank's pool, and a --max-model-len the pool cannot hold refused in
one line before any rank starts."""

from __future__ import annotations

import argparse

import pytest

from shardwise.cli.main import main
from shardwise.cli.serve import kv_blocks
from shardwise.comm import LocalCommunicator
from shardwise.engine.paged import PagedCaches
from shardwise.engine.text import DEFAULT_MODEL
from shardwise.hf import load_pretrained, read_config


def _args(**kw):
    base = dict(kv_cache_memory=None, max_batch_size=16, tp=1, dtype=None)
    return argparse.Namespace(**{**base, **kw})


def test_blocks_from_the_budget_match_a_loaded_rank():
    _, cfg = read_config(DEFAULT_MODEL)
    model, _ = load_pretrained(DEFAULT_MODEL, comm=LocalCommunicator())
    per_block = PagedCaches.bytes_per_block(model)  # tp=1, every layer
    assert kv_blocks(_args(kv_cache_memory=str(10 * per_block + 1)), cfg, None, 64) == 10
    assert kv_blocks(_args(), cfg, None, 100) == 16 * 7  # no budget: 16 sequences x ceil(100 / 16) blocks
    # bf16 halves a block; a stage of 2 of the 4 layers halves it again
    assert kv_blocks(_args(kv_cache_memory=str(10 * per_block), dtype="bfloat16"), cfg, [2, 2], 64) == 40


@pytest.mark.parametrize(
    "argv,message",
    [
        (
            ["--kv-cache-memory", "64KiB"],
            "--max-model-len 512 needs 32 KV blocks of 16 tokens (1.0 MiB per rank at tp=2); --kv-cache-memory "
            "64KiB holds 2 (32.0 KiB each): the longest sequence that fits is 32 tokens (--max-model-len 32)",
        ),
        (["--kv-cache-memory", "1KiB"], "holds 0 (32.0 KiB each): not one block fits"),
        (["--kv-cache-memory", "lots"], "--kv-cache-memory: not a memory size: 'lots'"),
    ],
)
def test_a_budget_too_small_is_refused_in_one_line(capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        main(["serve", "--port", "0", *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert message in err[-1]
