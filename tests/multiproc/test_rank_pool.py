"""The rank pool that runs the multi-process cases: a case starts as in a fresh process,
a failing case is reported with its rank's own traceback and does not poison the next
one, and a hung case times out."""

from __future__ import annotations

import time

import pytest
import torch

from processes import wait_gone
from shardwise.launch import JobTimeoutError, RankFailedError


def _state(world, n_all_reduces: int) -> dict:
    fresh = {"calls": world.stats.calls(), "draw": torch.rand(3), "grad": torch.is_grad_enabled()}
    for _ in range(n_all_reduces):
        world.all_reduce(torch.ones(1))
    torch.manual_seed(123)  # a case that seeds must not change what the next one draws
    torch.set_grad_enabled(False)
    return fresh


def _raise_on(world, bad_rank: int) -> int:
    if world.rank == bad_rank:
        raise ValueError(f"boom on rank {bad_rank}")
    world.all_reduce(torch.ones(1))  # the others wait for it: out of step until the pool restarts
    return world.rank


def _sleep(world, seconds: float) -> None:
    time.sleep(seconds)


def test_each_case_starts_as_in_a_fresh_process(rank_pool):
    first = rank_pool.run(_state, 2, args=(3,))
    second = rank_pool.run(_state, 2, args=(0,))
    for a, b in zip(first, second, strict=True):
        assert a["calls"] == b["calls"] == 0, "communication counters carried over"
        assert torch.equal(a["draw"], b["draw"]), "the random state carried over"
        assert a["grad"] and b["grad"], "grad mode carried over"


def test_a_failing_case_names_its_rank_and_the_next_case_runs(rank_pool):
    rank_pool.run(_raise_on, 3, args=(-1,))
    with pytest.raises(RankFailedError) as info:
        rank_pool.run(_raise_on, 3, args=(1,))
    assert info.value.rank == 1 and "ValueError: boom on rank 1" in str(info.value)
    assert "Traceback" in info.value.detail and "_raise_on" in info.value.detail
    assert wait_gone(pids=info.value.pids) == [], "the out-of-step ranks were not stopped"
    assert rank_pool.run(_raise_on, 3, args=(-1,)) == [0, 1, 2]


def test_a_hung_case_times_out_and_the_next_case_runs(rank_pool):
    start = time.monotonic()
    with pytest.raises(
        JobTimeoutError, match=r"case _sleep timed out after 2 s; ranks \[0, 1\] had not finished"
    ) as info:
        rank_pool.run(_sleep, 2, args=(60,), timeout_s=2)
    assert time.monotonic() - start < 2 + 20
    assert len(info.value.pids) == 2 and wait_gone(pids=info.value.pids) == [], "the hung ranks were not stopped"
    rank_pool.run(_sleep, 2, args=(0,))


def _mesh_and_train_case(world, cfg) -> None:
    """What the suite's cases create: a tp x pp mesh, collectives on it, a pipelined training
    run with checkpoints (its writers, its data loader, its optimizer)."""
    from shardwise.checkpoint import Checkpointer
    from shardwise.comm import ParallelDims
    from shardwise.train import train

    mesh = ParallelDims(world_size=world.size, tp=2, pp=world.size // 2).build(world)
    mesh.tp.all_reduce(torch.ones(4))
    mesh.pp.all_gather(torch.ones(2), dim=0)
    train(world, cfg, Checkpointer())


@pytest.fixture(scope="module")
def tiny_pp_config(tmp_path_factory):
    from train_helpers import tiny_config, write_tiny_tokens

    tmp = tmp_path_factory.mktemp("pool-resources")
    tokens = write_tiny_tokens(tmp / "tokens.safetensors", chars=8_000)
    return tiny_config(tokens, tmp / "run", steps=2, parallel={"tp": 2, "pp": 2}, run={"save_every": 1})


def test_pooled_ranks_threads_and_descriptors_do_not_grow_with_cases(rank_pool, tiny_pp_config):
    """Each rank's thread and descriptor counts after 6 cases equal those after 2: what a case
    creates (gloo groups: 3 threads and 5 descriptors each, per rank) ends with it."""
    for _ in range(2):
        rank_pool.run(_mesh_and_train_case, 4, args=(tiny_pp_config,))
    after_2 = rank_pool.resources(4)
    for _ in range(4):
        rank_pool.run(_mesh_and_train_case, 4, args=(tiny_pp_config,))
    after_6 = rank_pool.resources(4)
    assert after_6 == after_2, f"(threads, descriptors) per rank grew from {after_2} after 2 cases to {after_6} after 6"


class _Counting:
    """A Checkpointer that notes this process's (threads, descriptors) after every save."""

    def __init__(self) -> None:
        from shardwise.checkpoint import Checkpointer

        self.inner, self.seen = Checkpointer(), []

    def resume(self, tr, source: str) -> None:
        self.inner.resume(tr, source)

    def save(self, tr):
        from rank_pool import resources

        path = self.inner.save(tr)
        self.seen.append(resources(None))
        return path


def _long_train(world, cfg) -> list[tuple[int, int]]:
    from shardwise.train import train

    counting = _Counting()
    train(world, cfg, counting)
    return counting.seen


@pytest.mark.full  # 12 steps and saves: make test-more
def test_a_long_training_run_keeps_its_threads_and_descriptors(rank_pool, tiny_pp_config):
    """12 steps at tp=2 x pp=2, a checkpoint after each: the counts after the 12th save are
    no higher than after the 2nd on every rank (the product itself creates nothing per step;
    a descriptor may close a moment late, so a count may fall)."""
    cfg = tiny_pp_config.replace(run={"steps": 12, "out_dir": tiny_pp_config.run.out_dir + "-long"})
    for rank, seen in enumerate(rank_pool.run(_long_train, 4, args=(cfg,))):
        assert len(seen) == 12
        grew = any(last > second for last, second in zip(seen[-1], seen[1], strict=True))
        assert not grew, f"rank {rank}: (threads, descriptors) after each save: {seen}"
