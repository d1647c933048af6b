"""Which ranks share a host (shardwise.launch.env.host_label: what the launcher says) and the
rule that a tp group stays inside one (shardwise.launch.hosts), without processes."""

from __future__ import annotations

import socket

import pytest

from shardwise.comm import LocalCommunicator, ParallelDims
from shardwise.launch.env import external_rank, host_label
from shardwise.launch.hosts import HostLayoutError, Hosts, gather_hosts

_TORCHRUN = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1"}
_HYDRA = {"PMI_RANK": "2", "PMI_SIZE": "4", "MPI_LOCALRANKID": "0", "PMI_HOSTNAME": "gpu-b"}


def test_the_launchers_word_names_the_host_else_the_hostname():
    name = socket.gethostname()
    assert host_label(_TORCHRUN) == f"{name}:node1"  # two agents on one machine are two hosts
    assert host_label(_HYDRA) == "gpu-b"  # hydra's host entry, even if it resolves here
    assert host_label({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2"}) == name
    assert external_rank(_TORCHRUN).host == f"{name}:node1"
    assert (external_rank(_HYDRA).rank, external_rank(_HYDRA).host) == (2, "gpu-b")
    assert external_rank(_TORCHRUN).local_world_size == 2  # of 4: more than one host, gather
    assert external_rank({**_HYDRA, "MPI_LOCALNRANKS": "4"}).local_world_size == 4  # all here: nothing to gather


def test_tp_groups_inside_hosts_pass_and_pp_dp_may_span_them():
    hosts = Hosts(("a", "a", "b", "b"))
    hosts.check_tp(2)  # tp=2 x pp=2 or tp=2 x dp=2: the tp groups [0,1] [2,3] stay home
    assert hosts.tp_sizes() == [1, 2]
    for layout in ({"pp": 2}, {"dp": 2}):
        dims = ParallelDims(world_size=4, tp=2, **layout)
        assert all(len({hosts.labels[r] for r in g}) == 1 for g in dims.tp_groups())  # the same blocks
        assert hosts.cross_host_groups(dims.tp) == []
    assert hosts.summary() == "2 hosts: a (ranks 0-1), b (ranks 2-3)"
    assert Hosts(("a", "b")).summary() == "2 hosts: a (rank 0), b (rank 1)"


@pytest.mark.parametrize(
    "labels,tp,message",
    [
        (
            ("a", "b"),
            2,
            "tp=2: the tp group of ranks 0-1 spans hosts a (rank 0) and b (rank 1); ranks are laid out tp-fastest, "
            "so each host needs a multiple of 2 consecutive ranks, and a has 1, b has 1; tp sizes that stay inside "
            "a host: 1; start 2 ranks (or a multiple) per host, use one of those, or pass --allow-cross-host-tp "
            "(every layer then all-reduces across hosts)",
        ),
        (("a", "a", "b", "b"), 4, "the tp group of ranks 0-3 spans hosts a (ranks 0-1) and b (ranks 2-3)"),
        (("a", "a", "b", "b"), 4, "a has 2, b has 2; tp sizes that stay inside a host: 1, 2;"),
        (("a", "a", "a", "b", "b", "b"), 2, "ranks 2-3 spans hosts a (rank 2) and b (rank 3)"),
        (("a", "a", "a", "b", "b", "b"), 2, "tp sizes that stay inside a host: 1, 3;"),
        (("a", "b", "a", "b"), 2, "a has 2 (ranks 0, 2, not consecutive), b has 2 (ranks 1, 3, not consecutive)"),
    ],
)  # fmt: skip
def test_a_tp_group_across_hosts_is_refused_with_one_line(labels, tp, message):
    with pytest.raises(HostLayoutError) as e:
        Hosts(labels).check_tp(tp)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_gather_on_one_rank_is_its_own_label():
    assert gather_hosts(LocalCommunicator(), "here") == Hosts(("here",))
