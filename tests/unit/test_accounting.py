from __future__ import annotations

from shardwise.comm import CommStats


def test_counts_bytes_and_deltas():
    stats = CommStats()
    stats.record("all_reduce", "tp", 100)
    with stats.track() as delta:
        stats.record("all_reduce", "tp", 8)
        stats.record("all_gather", "dp", 16)
    stats.record("all_reduce", "tp", 1)
    assert stats.calls("all_reduce") == 3 and stats.bytes("all_reduce", "tp") == 109
    assert stats.calls(group="dp") == 1 and stats.calls() == 4
    assert delta.snapshot() == {"all_gather/dp": {"calls": 1, "bytes": 16}, "all_reduce/tp": {"calls": 1, "bytes": 8}}
    assert "all_reduce/tp: 3" in str(stats)
    stats.reset()
    assert stats.calls() == 0 and str(stats) == "no collectives"


def test_all_to_all_counts_the_bytes_it_sends():
    import pytest
    import torch

    from shardwise.comm import LocalCommunicator
    from shardwise.comm.dryrun import DryRunCommunicator

    comm = DryRunCommunicator(3, 1)  # no peers: the pairwise fallback, sends dropped, receives zeros
    t = torch.arange(24.0).view(6, 4)  # rows 0 | 1 2 | 3 4 5 for ranks 0 | 1 | 2
    got = comm.all_to_all(t, [1, 2, 3], [2, 2, 0])
    assert got.shape == (4, 4) and torch.equal(got[2:], t[1:3]), "its own rows stay"
    assert comm.stats.snapshot() == {"all_to_all/tp": {"calls": 1, "bytes": t.numel() * 4}}
    comm.stats.reset()
    comm.all_to_all(t, [1, 2, 3])  # recv sizes learnt first: one more call of 3 int64 counts
    assert comm.stats.snapshot() == {"all_to_all/tp": {"calls": 2, "bytes": t.numel() * 4 + 3 * 8}}
    comm.stats.reset()
    with pytest.raises(ValueError, match=r"send_sizes \[1, 2, 2\] sum to 5 but rank 1's tensor has 6 rows"):
        comm.all_to_all(t, [1, 2, 2])
    with pytest.raises(ValueError, match=r"recv_sizes \[2, 2\] must give one int >= 0 for each of 3 ranks"):
        comm.all_to_all(t, [1, 2, 3], [2, 2])
    assert comm.stats.calls() == 0, "bad sizes raise before any communication"
    local = LocalCommunicator()
    assert local.all_to_all(t, [6]) is t and local.stats.calls() == 0
