"""ParallelDims validates itself and names every number in its errors; the rank layout
puts tp innermost, then dp, then pp outermost."""

from __future__ import annotations

import pytest

from shardwise.comm import LocalCommunicator, ParallelDims
from shardwise.comm.dryrun import DryRunCommunicator


def test_mismatch_names_every_number():
    with pytest.raises(ValueError, match=r"^tp\(3\) \* dp\(2\) != world_size\(4\)$"):
        ParallelDims(world_size=4, tp=3, dp=2)


def test_tp_must_divide_world_when_dp_is_inferred():
    with pytest.raises(ValueError, match=r"tp\(3\) does not divide world_size\(4\); valid tp sizes: 1, 2, 4"):
        ParallelDims(world_size=4, tp=3)


@pytest.mark.parametrize("field,value", [("tp", 0), ("world_size", -1), ("tp", 1.5), ("dp", 0), ("tp", True)])
def test_non_positive_sizes_are_refused(field, value):
    kwargs = {"world_size": 4, "tp": 2, field: value}
    with pytest.raises(ValueError, match=field):
        ParallelDims(**kwargs)


def test_mismatch_with_pp_names_every_number():
    with pytest.raises(ValueError, match=r"^tp\(2\) \* pp\(2\) \* dp\(2\) = 8 != world_size\(4\)$"):
        ParallelDims(world_size=4, tp=2, pp=2, dp=2)


def test_tp_times_pp_must_divide_world_when_dp_is_inferred():
    with pytest.raises(
        ValueError, match=r"^tp\(2\) \* pp\(3\) = 6 does not divide world_size\(8\); valid tp \* pp sizes: 1, 2, 4, 8$"
    ):
        ParallelDims(world_size=8, tp=2, pp=3)


@pytest.mark.parametrize("value", [0, -2, 1.5, True])
def test_non_positive_pp_is_refused(value):
    with pytest.raises(ValueError, match=r"pp must be a positive int"):
        ParallelDims(world_size=4, pp=value)


def test_layout_tp2_pp2_dp2():
    dims = ParallelDims(world_size=8, tp=2, pp=2)
    assert dims.dp == 2
    assert dims.tp_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert dims.dp_groups() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert dims.pp_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert dims.coords(6) == {"tp": 0, "dp": 1, "pp": 1}


@pytest.mark.parametrize(
    "world,tp,pp,pp_groups",
    [
        (2, 1, 2, [[0, 1]]),
        (4, 1, 4, [[0, 1, 2, 3]]),
        (4, 2, 2, [[0, 2], [1, 3]]),
        (4, 1, 2, [[0, 2], [1, 3]]),  # dp = 2: stage 0 is ranks 0, 1
        (8, 1, 2, [[0, 4], [1, 5], [2, 6], [3, 7]]),
        (12, 2, 3, [[0, 4, 8], [1, 5, 9], [2, 6, 10], [3, 7, 11]]),
    ],
)
def test_pp_groups(world, tp, pp, pp_groups):
    assert ParallelDims(world_size=world, tp=tp, pp=pp).pp_groups() == pp_groups


@pytest.mark.parametrize("world,tp,pp", [(8, 2, 2), (8, 1, 4), (12, 2, 3), (24, 2, 3), (16, 4, 2), (6, 3, 2)])
def test_rank_formula_and_groups_agree(world, tp, pp):
    dims = ParallelDims(world_size=world, tp=tp, pp=pp)
    dp = dims.dp
    for rank in range(world):
        c = dims.coords(rank)
        assert rank == c["pp"] * (dp * tp) + c["dp"] * tp + c["tp"] == dims.rank_of(**c)
    # each rank's pp group holds the ranks with its tp and dp coordinates, in stage order
    for group in dims.pp_groups():
        cs = [dims.coords(r) for r in group]
        assert [c["pp"] for c in cs] == list(range(pp))
        assert len({(c["tp"], c["dp"]) for c in cs}) == 1
    for group in dims.dp_groups():
        assert len({(dims.coords(r)["tp"], dims.coords(r)["pp"]) for r in group}) == 1
    for group in dims.tp_groups():
        assert len({(dims.coords(r)["dp"], dims.coords(r)["pp"]) for r in group}) == 1


def test_rank_of_names_the_coordinate():
    with pytest.raises(ValueError, match=r"pp coordinate 2 is outside pp\(2\)"):
        ParallelDims(world_size=4, pp=2).rank_of(pp=2)


def test_groups_put_tp_innermost():
    dims = ParallelDims(world_size=8, tp=2)
    assert dims.dp == 4
    assert dims.tp_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert dims.dp_groups() == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert dims.coords(5) == {"tp": 1, "dp": 2, "pp": 0}
    with pytest.raises(ValueError, match=r"rank\(8\) is outside world_size\(8\)"):
        dims.coords(8)


def test_every_rank_in_exactly_one_group_of_each_kind():
    for world in range(1, 13):
        for tp in (t for t in range(1, world + 1) if world % t == 0):
            for pp in (p for p in range(1, world // tp + 1) if world % (tp * p) == 0):
                dims = ParallelDims(world_size=world, tp=tp, pp=pp)
                for groups in (dims.tp_groups(), dims.dp_groups(), dims.pp_groups()):
                    assert sorted(r for g in groups for r in g) == list(range(world))


def test_single_process_mesh():
    mesh = ParallelDims(world_size=1).build(LocalCommunicator())
    assert (mesh.tp.size, mesh.dp.size, mesh.tp.name, mesh.dp.name) == (1, 1, "tp", "dp")
    assert (mesh.pp.size, mesh.pp.name, mesh.pp_rank, mesh.is_first_stage, mesh.is_last_stage) == (
        1,
        "pp",
        0,
        True,
        True,
    )
    assert mesh.tp.stats is mesh.world.stats is mesh.pp.stats


@pytest.mark.parametrize(
    "rank,coords", [(0, (0, True, False, 3, 1)), (5, (1, False, False, 0, 2)), (13, (3, False, True, 2, 0))]
)
def test_mesh_pipeline_coordinates(rank, coords):
    # tp=2, pp=4, dp=2 on an imaginary world of 16, seen from one rank
    mesh = ParallelDims(world_size=16, tp=2, pp=4).build(DryRunCommunicator(16, rank, name="world"))
    assert (mesh.tp.size, mesh.dp.size, mesh.pp.size, mesh.pp.name) == (2, 2, 4, "pp")
    got = (mesh.pp_rank, mesh.is_first_stage, mesh.is_last_stage, mesh.prev_stage, mesh.next_stage)
    assert got == coords
    assert mesh.pp_rank == mesh.dims.coords(rank)["pp"]
