"""Expert-parallel token dispatch (shardwise.layers.dispatch): every rank holds different
tokens and its own experts; outputs and gradients match one process running all the experts
on every rank's tokens (tests/cases/moe_dispatch.py). gloo through the rank pool, world
sizes 1-4, uneven experts, top-1 and top-2, a rank receiving nothing, a rank with no tokens;
then the same cases (and the all_to_all case) on MPI, one job per world size."""

from __future__ import annotations

import pytest

from cases.comm import all_to_all_case, check_all_to_all
from cases.moe_dispatch import dispatch_case
from shardwise.launch import launch

# (num_experts, k, tokens per rank as a function of the world size, starved rank or None)
CASES = {
    "even-top2": (8, 2, lambda p: [3 + 2 * r for r in range(p)], None),
    "uneven-top1": (5, 1, lambda p: [4 + r for r in range(p)], None),
    "uneven-top2": (5, 2, lambda p: [5 - r for r in range(p)], None),
    "rank-receives-nothing": (5, 2, lambda p: [3 + r for r in range(p)], "last"),
    "rank-without-tokens": (5, 2, lambda p: [0 if r == p - 1 and p > 1 else 4 for r in range(p)], None),
}


def _args(name: str, p: int) -> tuple:
    E, k, tokens, starve = CASES[name]
    return E, k, tokens(p), (p - 1 if starve == "last" and p > 1 else None)


def _check(name: str, p: int, results: list[dict]) -> None:
    E, k, tokens, starve = _args(name, p)
    assert sum(r["received"] for r in results) == k * sum(tokens), "every pair computed once"
    if starve is not None:
        assert results[starve]["received"] == 0
    for r in results:
        if p == 1:
            assert r["fwd"] == {} and r["bwd"] == {}, "size 1: no collective"
        else:  # counts, rows, ids, results forward; rows and results backward
            assert r["fwd"]["all_to_all/world"]["calls"] == 4
            assert r["bwd"]["all_to_all/world"]["calls"] == 2


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("world_size", [1, pytest.param(2, marks=pytest.mark.smoke), 3, 4])
def test_dispatch_matches_one_process(rank_pool, world_size, name):
    results = rank_pool.run(dispatch_case, world_size, args=_args(name, world_size))
    _check(name, world_size, results)


def _mpi_checks(world) -> dict:
    out = {name: dispatch_case(world, *_args(name, world.size)) for name in CASES}
    out["all_to_all"] = all_to_all_case(world)
    return out


@pytest.mark.full
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_dispatch_on_mpi(world_size):
    pytest.importorskip("mpi4py")
    from shardwise.launch.mpi import find_mpiexec

    try:
        find_mpiexec()
    except RuntimeError:
        pytest.skip("mpiexec not installed")
    results = launch(_mpi_checks, world_size, backend="mpi", timeout_s=120)
    for name in CASES:
        _check(name, world_size, [r[name] for r in results])
    for r in results:
        check_all_to_all(r["all_to_all"], world_size)
