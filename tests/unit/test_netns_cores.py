"""netns.host_cores: each namespace host's processes on cores of their own (make_hosts(pin=True)),
so that the scheduler never puts two hosts' ranks on one core, which separate machines never
share. A pure function: no namespaces needed."""

from shardwise.bench.netns import Host, host_cores


def test_hosts_get_equal_runs_of_the_cores():
    assert host_cores(2, [0, 1]) == [(0,), (1,)]
    assert host_cores(1, [1, 0]) == [(0, 1)]  # one host: every core, as unpinned
    assert host_cores(2, [0, 1, 2, 3, 4]) == [(0, 1), (2, 3)]
    assert host_cores(4, [0, 1]) == [(0,), (1,), (0,), (1,)]  # fewer cores than hosts: round them


def test_a_pinned_hosts_commands_run_under_taskset():
    h = Host(1, "host1", "10.201.0.2", "ns1", cores=(1,))
    cmd = h.command(["python", "-c", "pass"])
    assert cmd[-6:] == ["taskset", "-c", "1", "python", "-c", "pass"]
    assert "taskset" not in Host(0, "host0", "10.201.0.1", "ns0").command(["true"])
