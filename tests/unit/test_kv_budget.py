"""serve --kv-cache-memory SIZE|FRACTION (serve/budget.py): the paged pool's blocks from a
budget, predicted from the config before any rank starts (cli/serve.kv_blocks) and sized
again on a loaded rank (size_pool) to the same count; a --max-model-len the pool cannot hold,
and a pool the host cannot hold, refused in one line before any rank starts."""

from __future__ import annotations

import argparse

import pytest

from shardwise.cli.main import main
from shardwise.cli.serve import kv_blocks
from shardwise.comm import LocalCommunicator
from shardwise.engine.paged import PagedCaches
from shardwise.engine.text import DEFAULT_MODEL
from shardwise.hf import load_pretrained, read_config
from shardwise.memory import LIMIT_ENV
from shardwise.planner.fit import RUNTIME_BYTES
from shardwise.serve.budget import BudgetTooSmall, KVBudget, size_pool

MIB = 2**20


@pytest.fixture(scope="module")
def loaded():
    _, cfg = read_config(DEFAULT_MODEL)
    model, report = load_pretrained(DEFAULT_MODEL, comm=LocalCommunicator())
    return cfg, model, report


def _args(**kw):
    base = dict(
        kv_cache_memory=None, max_batch_size=16, tp=1, dtype=None, quantize=None, expert_parallel=False, backend="gloo"
    )
    return argparse.Namespace(**{**base, **kw})


def test_a_budget_is_a_size_or_a_fraction():
    assert KVBudget.parse("64KiB").bytes == 64 * 1024 and KVBudget.parse("2048").bytes == 2048
    assert KVBudget.parse("0.5").fraction == 0.5 and KVBudget.parse("1").fraction == 1.0
    assert KVBudget.parse(None).fraction == 0.9  # the default
    for bad, message in [
        ("0", r"a fraction must be in \(0, 1\], got 0"),
        ("1.5", "got 1.5"),
        ("lots", "not a memory size"),
    ]:
        with pytest.raises(ValueError, match=message):
            KVBudget.parse(bad)
    # a fraction of the room, less what the rank holds besides, at most the cap
    half = KVBudget.parse("0.5", room=1000 * MIB, cap_blocks=100)
    assert half.blocks(per_block=MIB, other=300 * MIB) == 100  # 200 MiB of pool, capped at 100 blocks
    assert half.blocks(per_block=4 * MIB, other=300 * MIB) == 50
    assert half.blocks(per_block=MIB, other=600 * MIB) == 0  # the rest is taken already
    assert KVBudget.parse("0.5", cap_blocks=7).blocks(MIB, 0) == 7  # the host said nothing: the cap
    assert KVBudget.parse("64KiB", cap_blocks=1).blocks(16 * 1024, 10 * MIB) == 4  # a size: as given, no cap


def test_blocks_from_the_budget_match_a_loaded_rank(loaded, monkeypatch):
    cfg, model, report = loaded
    per_block = PagedCaches.bytes_per_block(model)  # tp=1, every layer
    assert kv_blocks(_args(kv_cache_memory=str(10 * per_block + 1)), cfg, None, 64).blocks == 10
    # bf16 halves a block; a stage of 2 of the 4 layers halves it again
    assert kv_blocks(_args(kv_cache_memory=str(10 * per_block), dtype="bfloat16"), cfg, [2, 2], 64).blocks == 40
    monkeypatch.setenv(LIMIT_ENV, "1GiB")
    assert kv_blocks(_args(), cfg, None, 100).blocks == 16 * 7  # 0.9 of 1 GiB: the cap, 16 x ceil(100 / 16)
    pool = kv_blocks(_args(kv_cache_memory="0.28"), cfg, None, 512)  # 287 MiB less runtime and weights
    assert 0 < pool.blocks < 16 * 32 and pool.per_block == per_block
    # the loaded rank sizes its pool from the bytes it holds: the same count as predicted
    budget = KVBudget.parse("0.28", room=2**30, room_source=LIMIT_ENV, cap_blocks=16 * 32)
    sizes, blocks = size_pool(LocalCommunicator(), model, report.param_bytes, budget, pool.activations, 512, 1)
    assert abs(blocks - pool.blocks) <= 1 and sizes[0, 0] == report.param_bytes
    assert sizes[0, 1] == RUNTIME_BYTES + report.param_bytes + pool.activations
    with pytest.raises(BudgetTooSmall, match=r"--max-model-len 4096 needs 256 KV blocks .* the longest sequence"):
        size_pool(LocalCommunicator(), model, report.param_bytes, KVBudget.parse("0.27", room=2**30), 0, 4096, 1)


@pytest.mark.parametrize(
    "argv,env,message",
    [
        (
            ["--kv-cache-memory", "64KiB"],
            None,
            "--max-model-len 512 needs 32 KV blocks of 16 tokens (1.0 MiB per rank at tp=2); --kv-cache-memory "
            "64KiB holds 2 (32.0 KiB each): the longest sequence that fits is 32 tokens (--max-model-len 32)",
        ),
        (["--kv-cache-memory", "1KiB"], None, "holds 0 (32.0 KiB each): not one block fits"),
        (["--kv-cache-memory", "lots"], None, "--kv-cache-memory: not a memory size: 'lots'"),
        (["--kv-cache-memory", "1.5"], None, "--kv-cache-memory: a fraction must be in (0, 1], got 1.5"),
        (  # a fraction of 300 MiB a rank, less the 256 MiB runtime and the weights: not one block
            ["--kv-cache-memory", "0.5"],
            "600MiB",
            "--kv-cache-memory 0.5 of 300.0 MiB per rank (SHARDWISE_MEMORY_LIMIT), less 26",
        ),
        (  # a pool of a given size the host cannot hold: the largest size that fits is suggested
            ["--kv-cache-memory", "200MiB"],
            "600MiB",
            "not enough memory: each rank needs about 208.5 MiB (weights 5.0 MiB, kv cache 200.0 MiB",
        ),
    ],
)
def test_a_pool_too_small_or_too_large_is_refused_in_one_line(capsys, monkeypatch, argv, env, message):
    if env:
        monkeypatch.setenv(LIMIT_ENV, env)
    with pytest.raises(SystemExit) as e:
        main(["serve", "--port", "0", "--backend", "gloo", *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert message in err[-1], err[-1]
    if "200MiB" in argv:
        assert "would fit: --kv-cache-memory 3" in err[-1] and "--max-model-len" not in err[-1]


def test_on_cuda_the_fraction_is_of_each_devices_free_memory(loaded, monkeypatch):
    """No GPU here: torch.cuda's answers are mocked; each rank has its own device, so the room is
    the least free memory of the devices, not divided among the ranks."""
    cfg, model, _ = loaded
    free = {0: 3 * 2**30, 1: 2 * 2**30}
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr("torch.cuda.device_count", lambda: 2)
    monkeypatch.setattr("torch.cuda.mem_get_info", lambda i: (free[i], 80 * 2**30))
    monkeypatch.delenv(LIMIT_ENV, raising=False)
    pool = kv_blocks(_args(tp=2, backend="nccl", kv_cache_memory="0.5", max_batch_size=4096), cfg, None, 512)
    assert pool.budget.room == 2 * 2**30 and pool.budget.room_source == "torch.cuda.mem_get_info"
    per_block = PagedCaches.bytes_per_block(model) // 2  # tp 2: half the KV heads
    assert pool.per_block == per_block and pool.blocks == int((0.5 * 2**31 - pool.other) // per_block)
