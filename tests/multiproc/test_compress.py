"""The compressed all-reduce (shardwise.comm.compress) against the exact fp32 all-reduce:
bf16 and 8-bit blocks on the wire, at world sizes 1-4 on gloo (pooled ranks), and on MPI."""

from __future__ import annotations

import pytest
import torch

from cases.compress import compressed_case, wire_times_case
from shardwise.comm import LocalCommunicator
from shardwise.comm.compress import BLOCK, compressed_all_reduce, decode, encode, error_bound, wire_bytes
from shardwise.launch import launch


@pytest.mark.parametrize("world_size", [pytest.param(2, marks=pytest.mark.smoke), 3, 4])
def test_compressed_all_reduce_within_its_bound_on_gloo(rank_pool, world_size):
    worst = rank_pool.run(compressed_case, world_size)[0]
    assert 0 < worst["q8"] <= 1 and 0 < worst["bf16"] <= 1, worst  # the largest error / bound


def test_each_wire_is_timed_at_the_steps_size_and_every_rank_gets_the_same_figures(rank_pool):
    """choose_wire's measurement: one all-reduce of the step's size in each format, the
    slowest rank's time, so that every rank picks the same format."""
    from shardwise.comm.compress import WIRES

    times = rank_pool.run(wire_times_case, 2)
    assert times[0] == times[1], times
    assert list(times[0]) == list(WIRES) and all(0 < s < 1 for s in times[0].values()), times


def test_a_group_of_one_does_not_compress():
    x = torch.randn(10)
    assert compressed_all_reduce(x, LocalCommunicator(), "q8") is x


def test_q8_blocks_round_trip_within_half_a_step():
    x = torch.randn(3, 4 * BLOCK) * torch.logspace(-8, 8, 3).view(3, 1)  # tiny and huge scales
    x[1, 5] = 0.0
    x[2, :BLOCK] = 0.0  # an all-zero block
    raw = encode(x, "q8")
    assert raw.dtype == torch.uint8 and raw.shape == (3, wire_bytes(4 * BLOCK, "q8")) == (3, 4 * 36)
    back = decode(raw, "q8")
    step = x.view(3, 4, BLOCK).abs().amax(-1, keepdim=True) / 127
    assert ((back - x).view(3, 4, BLOCK).abs() <= step / 2 * (1 + 1e-6)).all()
    assert torch.equal(back[2, :BLOCK], torch.zeros(BLOCK))
    assert torch.equal(decode(encode(x, "bf16"), "bf16"), x.bfloat16().float())


def test_the_bound_is_not_vacuous():
    xs = [torch.randn(100) for _ in range(3)]
    bound = error_bound(xs, "q8")
    assert bound.shape == (100,) and (bound > 0).all() and bound.max() < 0.1 * sum(xs).abs().max()
    with pytest.raises(ValueError, match="comm dtype 'int4' is not one of fp32, bf16, q8"):
        error_bound(xs, "int4")


@pytest.mark.full
def test_compressed_all_reduce_within_its_bound_on_mpi():
    pytest.importorskip("mpi4py")
    try:
        from shardwise.launch.mpi import find_mpiexec

        find_mpiexec()
    except RuntimeError:
        pytest.skip("mpiexec not installed")
    for world_size in (2, 3, 4):
        results = launch(compressed_case, world_size, backend="mpi", timeout_s=60)
        assert all(0 < r["q8"] <= 1 and 0 < r["bf16"] <= 1 for r in results), results
