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
