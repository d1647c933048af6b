"""ParallelDims validates itself and names every number in its errors."""

from __future__ import annotations

import pytest

from shardwise.comm import LocalCommunicator, ParallelDims


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


def test_pipeline_is_reserved():
    with pytest.raises(ValueError, match=r"pp\(2\) > 1 is reserved"):
        ParallelDims(world_size=4, tp=2, pp=2)


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
            dims = ParallelDims(world_size=world, tp=tp)
            for groups in (dims.tp_groups(), dims.dp_groups()):
                assert sorted(r for g in groups for r in g) == list(range(world))


def test_single_process_mesh():
    mesh = ParallelDims(world_size=1).build(LocalCommunicator())
    assert (mesh.tp.size, mesh.dp.size, mesh.tp.name, mesh.dp.name) == (1, 1, "tp", "dp")
    assert mesh.tp.stats is mesh.world.stats
