"""shardwise.comm.tcp's pieces that need no peers: where a rank listens (SHARDWISE_TCP_ADDR,
GLOO_SOCKET_IFNAME's address, the route to MASTER_ADDR), and the byte bookkeeping of a
partial send or receive."""

from __future__ import annotations

import pytest

from shardwise.comm import tcp

_ADDR_VARS = (tcp.ADDR_ENV, "GLOO_SOCKET_IFNAME", "MASTER_ADDR")


@pytest.fixture
def clean_env(monkeypatch):
    for key in _ADDR_VARS:
        monkeypatch.delenv(key, raising=False)
    return monkeypatch


def test_the_address_comes_from_the_variable_first(clean_env):
    clean_env.setenv(tcp.ADDR_ENV, "10.9.8.7")
    clean_env.setenv("GLOO_SOCKET_IFNAME", "lo")
    assert tcp._my_address() == "10.9.8.7"


def test_then_from_the_gloo_interface_then_from_the_route_to_the_master(clean_env):
    clean_env.setenv("GLOO_SOCKET_IFNAME", "lo")
    clean_env.setenv("MASTER_ADDR", "192.0.2.1")
    assert tcp._my_address() == "127.0.0.1"  # the loopback interface's, not the route's
    clean_env.delenv("GLOO_SOCKET_IFNAME")
    clean_env.setenv("MASTER_ADDR", "127.0.0.1")
    assert tcp._my_address() == "127.0.0.1"  # the source address of the route to it


def test_advance_drops_what_was_sent_across_the_views():
    views = [memoryview(b"h" * 24), memoryview(b"p" * 10)]
    assert tcp._advance(views, 20) and [len(v) for v in views] == [4, 10]
    assert tcp._advance(views, 6) and [bytes(v) for v in views] == [b"p" * 8]
    assert not tcp._advance(views, 8) and views == []
    empty = [memoryview(b"h" * 24), memoryview(b"")]  # a header with no payload (an empty all_to_all part)
    assert not tcp._advance(empty, 24) and empty == []


def test_a_bad_mode_is_refused():
    with pytest.raises(ValueError, match="tcp collectives mode 'fast' is not one of auto, on, off"):
        tcp.across_hosts(object(), mode="fast")  # checked before the group is looked at
