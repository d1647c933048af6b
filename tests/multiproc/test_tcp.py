"""The collectives over direct TCP connections (shardwise.comm.tcp): every one equal to gloo's
and to the plain sum, a decode's tokens and a tensor-parallel MLP's gradients with the path on
and off (pooled gloo ranks, world sizes 2-4); a group across hosts takes it by default; a rank
that fails, dies or never arrives mid-collective is named by the others (at once, or after the
timeout), and ranks out of step are caught. The cases are in tests/cases/tcp.py; across real
namespace hosts: tests/e2e/test_netns.py."""

from __future__ import annotations

import json
import re

import pytest

from cases.tcp import (
    cannot_listen_case,
    decode_case,
    fails_mid_collective,
    mlp_grad_case,
    other_host_case,
    out_of_step,
    parity_case,
)
from shardwise.comm.tcp import tcp_mode
from shardwise.launch import RankFailedError, launch


@pytest.mark.parametrize("world_size", [pytest.param(2, marks=pytest.mark.smoke), 3, 4])
def test_every_collective_equals_gloo_and_the_plain_sum(rank_pool, world_size):
    out = rank_pool.run(parity_case, world_size)
    assert all(len(r["checked"]) == 12 for r in out) and len({r["calls"] for r in out}) == 1


@pytest.mark.parametrize("world_size", [2, 3])
def test_decode_gives_the_same_tokens_over_tcp_and_gloo(rank_pool, world_size):
    for r in rank_pool.run(decode_case, world_size):
        on, off, q8 = r["on"], r["off"], r["q8"]
        assert q8["tcp"] and q8["native"] == [] and q8["calls"] > 0, "an encoded wire keeps the step op by op"
        assert on["tcp"] and not off["tcp"] and on["calls"] > 0
        assert on["tokens"] == off["tokens"] and all(len(t) == 12 for t in on["tokens"])
        assert on["native"] and all(external and waits > 0 for external, waits in on["native"]), on["native"]
        assert off["native"] == [], "over gloo the decode step has no native all-reduce"
        assert on["comm"] == off["comm"], "the native step's all-reduces count as the per-op path's"


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_a_tensor_parallel_mlp_trains_the_same_over_tcp(rank_pool, world_size):
    assert all(r["calls"] > 0 for r in rank_pool.run(mlp_grad_case, world_size))


def test_a_group_across_hosts_takes_the_tcp_path_by_default(rank_pool):
    assert rank_pool.run(other_host_case, 3) == [("TcpCommunicator", [3.0, 3.0, 3.0])] * 3


def test_a_rank_that_cannot_listen_keeps_every_rank_on_gloo(rank_pool):
    assert rank_pool.run(cannot_listen_case, 2) == [("TorchDistCommunicator", [2.0, 2.0, 2.0])] * 2


@pytest.mark.parametrize("how", ["raise", pytest.param("exit", marks=pytest.mark.full)])
def test_a_rank_that_fails_mid_collective_is_named_at_once(tmp_path, how):
    timeout = 20.0
    with pytest.raises(RankFailedError) as info:
        launch(fails_mid_collective, 3, args=(how, 1, str(tmp_path)), timeout_s=timeout)
    assert info.value.rank == 1
    for rank in (0, 2):
        path = tmp_path / str(rank)
        if not path.exists():  # the launcher took it down first: its peer's failure was the job's error
            continue
        record = json.loads(path.read_text())
        assert re.search(r"tcp all_reduce #\d+: rank 1 \(world rank 1, host [\d.]+\) closed its connection",
                         record["error"]), record["error"]  # fmt: skip
        assert record["waited"] < 5, f"rank {rank} waited {record['waited']:.1f}s"


@pytest.mark.full
def test_a_rank_that_never_arrives_times_out_naming_it(tmp_path):
    timeout = 2.0
    with pytest.raises(RankFailedError) as info:
        launch(fails_mid_collective, 3, args=("never", 1, str(tmp_path)), timeout_s=timeout)
    assert info.value.rank == 1 and info.value.stuck == (1,)
    for rank in (0, 2):
        record = json.loads((tmp_path / str(rank)).read_text())
        assert re.search(r"waited 2s for rank 1 \(world rank 1, host [\d.]+\), which never arrived", record["error"])
        assert timeout <= record["waited"] < timeout + 1.5


def test_ranks_out_of_step_are_caught(tmp_path):
    with pytest.raises(RankFailedError):
        launch(out_of_step, 2, args=(str(tmp_path),), timeout_s=20.0)
    errors = [p.read_text() for p in tmp_path.iterdir()]
    assert errors and any(re.search(r"tcp collectives out of step: this rank's call #1 is (all_reduce|all_gather) "
                                    r"of \d+ bytes from rank \d .*which sent call #1, (all_gather|all_reduce)", e)
                          for e in errors), errors  # fmt: skip


def test_mode_from_the_environment():
    assert tcp_mode({}) == "auto" and tcp_mode({"SHARDWISE_TCP_COLLECTIVES": " OFF "}) == "off"
    with pytest.raises(ValueError, match=r"SHARDWISE_TCP_COLLECTIVES='fast' is not one of auto, on, off"):
        tcp_mode({"SHARDWISE_TCP_COLLECTIVES": "fast"})
