"""Naming the stuck rank, without processes: the diagnosis over progress records
(shardwise.comm.hang), the board a communicator keeps (shardwise.comm.progress), and the
CollectiveError of a timed-out operation that reads it."""

from __future__ import annotations

import json
import time

import pytest
import torch

from shardwise.comm import CollectiveError
from shardwise.comm.dryrun import DryRunCommunicator
from shardwise.comm.hang import diagnose
from shardwise.comm.progress import Board, DirSink, Fault, channel, read_records

NOW = 1000.0
TP01, TP23, DP02, DP13 = (channel("tp", (0, 1)), channel("tp", (2, 3)), channel("dp", (0, 2)), channel("dp", (1, 3)))


def _op(name: str, group: str, chan: str, seq: int, members, *, waited: float = 2.0, peer=None) -> dict:
    return {
        "op": name,
        "group": group,
        "chan": chan,
        "seq": seq,
        "start": NOW - waited,
        "members": list(members),
        "peer": peer,
    }


def _rec(rank: int, counts: dict, *, op=None, last=None, age=0.1, state="running", backend="gloo") -> dict:
    if last is not None:
        last = {**last, "end": last["start"] + 0.001}
    return {
        "rank": rank,
        "pid": 100 + rank,
        "host": "h",
        "backend": backend,
        "beat": NOW - age,
        "state": state,
        "counts": counts,
        "op": op,
        "last": last,
        "idle_since": NOW - 5.0,
    }


def _diagnose(records, *, stopped=(), gone=(), origin=None):
    def state_of(pid: int) -> str | None:
        return None if pid - 100 in gone else "T" if pid - 100 in stopped else "S"

    return diagnose({r["rank"]: r for r in records}, now=NOW, origin=origin, host="h", state_of=state_of)


def _tp2(*, stopped=(), entered=False, age=0.1):
    """Rank 0 waits in all_reduce/tp #6; rank 1 is past #5 (or inside #6, `entered`)."""
    waiting = _rec(0, {TP01: 6}, op=_op("all_reduce", "tp", TP01, 6, (0, 1)))
    if entered:
        other = _rec(1, {TP01: 6}, op=_op("all_reduce", "tp", TP01, 6, (0, 1), waited=2.1), age=age)
    else:
        other = _rec(1, {TP01: 5}, last=_op("all_reduce", "tp", TP01, 5, (0, 1), waited=2.3), age=age)
    return _diagnose([waiting, other], stopped=stopped, origin=0)


def test_a_rank_outside_communication_is_named_with_what_it_missed_and_for_how_long():
    hang = _tp2()
    assert hang.ranks == (1,)
    assert hang.summary == (
        "stuck: never arrived at all_reduce/tp #6 (rank 0 waited 2.0 s for it); "
        "running outside communication for 2.3 s, since all_reduce/tp #5 (heartbeat 0.1 s ago)"
    )
    assert hang.sentence().startswith("rank 1 is stuck: never arrived at all_reduce/tp #6")


def test_a_stopped_rank_is_named_stopped_whether_or_not_it_had_arrived():
    before = _tp2(stopped=(1,), age=2.1)
    assert before.ranks == (1,) and before.culprits[0].kind == "stopped"
    assert before.summary == (
        "stuck: never arrived at all_reduce/tp #6 (rank 0 waited 2.0 s for it); stopped (process 101, "
        "state T; no heartbeat for 2.1 s); its last heartbeat found it outside communication, after all_reduce/tp #5"
    )
    inside = _tp2(stopped=(1,), entered=True, age=2.1)
    assert inside.ranks == (1,)
    assert inside.summary.startswith("stuck: entered all_reduce/tp #6 but never finished it (rank 0 waited 2.0 s")
    assert inside.summary.endswith("its last heartbeat found it inside all_reduce/tp #6")


def test_ranks_that_all_arrived_and_answer_are_no_hang():
    assert _tp2(entered=True) is None  # both inside #6 and answering: the transport's problem, not a rank's


def test_ranks_that_all_arrived_on_two_hosts_name_the_link_and_a_rank_not_seen_its_host():
    from shardwise.comm import hang as hang_mod

    hang_mod.set_rank_hosts(("host0", "host1"))
    try:
        cut = _tp2(entered=True)  # both inside #6, alive, on two hosts: the link between them
        assert cut is not None and cut.ranks == (1,)
        assert cut.sentence() == (
            "rank 1 is cut off: rank 1 on host1 and rank 0 on host0 all entered all_reduce/tp #6 and are alive "
            "(fresh heartbeats), but its messages do not get through between host0 and host1 in 2.0 s: "
            "the link between the hosts is down or unreachable"
        )
        waiting = _rec(0, {TP01: 6}, op=_op("all_reduce", "tp", TP01, 6, (0, 1)))
        unseen = _diagnose([waiting], origin=0)  # rank 1's board is on its own host
        assert unseen.ranks == (1,) and "it runs on host host1, whose progress records this host cannot read" in (
            unseen.summary
        )
        hang_mod.set_rank_hosts(("host0", "host0"))
        assert _tp2(entered=True) is None  # one host: still the transport's problem
    finally:
        hang_mod.set_rank_hosts(())


def test_a_rank_left_inside_the_previous_all_reduce_across_a_cut_link_is_cut_off_too():
    """The cut can fall between an all-reduce's last messages: rank 0 finished #5 and waits
    in #6, rank 1 (host1) still waits inside #5 for what rank 0 sent. Seen under mpiexec in CI."""
    from shardwise.comm import hang as hang_mod

    records = [
        _rec(0, {TP01: 6}, op=_op("all_reduce", "tp", TP01, 6, (0, 1), waited=5.0)),
        _rec(1, {TP01: 5}, op=_op("all_reduce", "tp", TP01, 5, (0, 1), waited=5.2)),
    ]
    hang_mod.set_rank_hosts(("host0", "host1"))
    try:
        cut = _diagnose(records, origin=0)
        assert cut is not None and cut.ranks == (1,) and cut.behind_cut[0].seq == 5
        assert cut.sentence() == (
            "rank 1 is cut off: rank 1 on host1 and rank 0 on host0 are alive (fresh heartbeats); rank 0 finished "
            "what rank 1 still inside all_reduce/tp #5 (5.2 s) waits for and waits in all_reduce/tp #6, but its "
            "messages do not get through between host0 and host1 in 5.0 s: the link between the hosts is down or "
            "unreachable"
        )
        hang_mod.set_rank_hosts(("host0", "host0"))
        assert _diagnose(records, origin=0) is None  # one host: not a link
        hang_mod.set_rank_hosts(("host0", "host1"))
        world = channel("world", (0, 1))  # inside a broadcast rank 0 (its root) finished
        records = [
            _rec(0, {TP01: 6, world: 3}, op=_op("all_reduce", "tp", TP01, 6, (0, 1), waited=5.0)),
            _rec(1, {TP01: 5, world: 3}, op=_op("broadcast", "world", world, 3, (0, 1), waited=5.1)),
        ]
        assert _diagnose(records, origin=0).behind_cut[0].where == "broadcast/world #3"
        records[1] = _rec(1, {TP01: 5, world: 4}, op=_op("broadcast", "world", world, 4, (0, 1)))
        assert _diagnose(records, origin=0).sentence().startswith("deadlock")  # in one rank 0 never entered
        records[1] = _rec(1, {TP01: 5}, last=_op("all_reduce", "tp", TP01, 5, (0, 1)))  # outside: stuck, not cut
        assert _diagnose(records, origin=0).sentence().startswith("rank 1 is stuck: never arrived")
    finally:
        hang_mod.set_rank_hosts(())


def test_a_chain_over_tp_and_dp_leads_to_the_rank_everyone_waits_for():
    # tp=2 x dp=2, rank 3 stopped outside: rank 2 waits for it in tp, rank 1 in dp, rank 0 for rank 2 in dp.
    records = [
        _rec(0, {TP01: 51, DP02: 5}, op=_op("all_reduce", "dp", DP02, 5, (0, 2), waited=1.9)),
        _rec(1, {TP01: 51, DP13: 5}, op=_op("all_reduce", "dp", DP13, 5, (1, 3), waited=1.8)),
        _rec(2, {TP23: 51, DP02: 4}, op=_op("all_reduce", "tp", TP23, 51, (2, 3))),
        _rec(3, {TP23: 50, DP13: 4}, last=_op("all_reduce", "tp", TP23, 50, (2, 3), waited=2.2), age=2.2),
    ]
    for origin in (0, 1, 2, None):
        hang = _diagnose(records, stopped=(3,), origin=origin)
        assert hang.ranks == (3,), origin
    assert hang.summary == (
        "stuck: never arrived at all_reduce/dp #5 (rank 1 waited 1.8 s for it) nor at all_reduce/tp #51 "
        "(rank 2 waited 2.0 s for it); stopped (process 103, state T; no heartbeat for 2.2 s); its last "
        "heartbeat found it outside communication, after all_reduce/tp #50; rank 0 waited in turn (all_reduce/dp #5)"
    )


def test_two_stuck_ranks_are_both_named_the_origins_first():
    records = [
        _rec(0, {TP01: 3}, op=_op("all_reduce", "tp", TP01, 3, (0, 1))),
        _rec(1, {TP01: 2}, last=_op("all_reduce", "tp", TP01, 2, (0, 1))),
        _rec(2, {TP23: 3}, op=_op("all_reduce", "tp", TP23, 3, (2, 3))),
        _rec(3, {TP23: 2}, last=_op("all_reduce", "tp", TP23, 2, (2, 3))),
    ]
    assert _diagnose(records, origin=2).ranks == (3, 1)
    hang = _diagnose(records, origin=0)
    assert hang.ranks == (1, 3) and "; rank 3 is stuck too: never arrived at all_reduce/tp #3" in hang.summary


def test_point_to_point_counts_per_direction():
    chan = f"{channel('pp', (0, 1))}:1>0"
    waiting = _rec(0, {chan: 3}, op=_op("recv", "pp", chan, 3, (0, 1), peer=1))
    sender = _rec(1, {chan: 2}, last=_op("send", "pp", chan, 2, (0, 1), peer=0))
    hang = _diagnose([waiting, sender], origin=0)
    assert hang.ranks == (1,) and hang.summary.startswith("stuck: never arrived at recv/pp #3 (rank 0 waited")
    sent = _rec(1, {chan: 3}, last=_op("send", "pp", chan, 3, (0, 1), peer=0))
    assert _diagnose([waiting, sent], origin=0) is None


def test_ranks_waiting_for_each_other_are_a_deadlock():
    shared_dp = channel("dp", (0, 1))
    records = [
        _rec(0, {TP01: 3, shared_dp: 1}, op=_op("all_reduce", "tp", TP01, 3, (0, 1))),
        _rec(1, {TP01: 2, shared_dp: 2}, op=_op("all_reduce", "dp", shared_dp, 2, (0, 1), waited=1.5)),
    ]
    hang = _diagnose(records, origin=0)
    assert hang.ranks == (0, 1)
    assert hang.summary == (
        "deadlock: rank 0 waits in all_reduce/tp #3 for rank 1, which waits in all_reduce/dp #2 for rank 0 "
        "(they issued different operations)"
    )


@pytest.mark.parametrize(
    "other,gone,words",
    [
        (_rec(1, {TP01: 5}, state="done"), (), "finished early: never arrived at all_reduce/tp #6"),
        (_rec(1, {TP01: 5}), (1,), "gone: never arrived at all_reduce/tp #6 (rank 0 waited 2.0 s for it); its process"),
        (None, (), "stuck: never arrived at all_reduce/tp #6 (rank 0 waited 2.0 s for it); it published no progress"),
        (_rec(1, {TP01: 5}, age=4.0), (), "stuck: never arrived at all_reduce/tp #6 (rank 0 waited 2.0 s for it); not"),
    ],
    ids=["finished", "gone", "no-record", "no-heartbeat"],
)
def test_what_the_missing_rank_was_doing(other, gone, words):
    waiting = _rec(0, {TP01: 6}, op=_op("all_reduce", "tp", TP01, 6, (0, 1)))
    hang = _diagnose([waiting] + ([other] if other else []), gone=gone, origin=0)
    assert hang.ranks == (1,) and hang.summary.startswith(words), hang.summary


def test_an_asynchronous_backends_straggler_is_found_from_the_last_queued_operation():
    # NCCL returns once a collective is queued: nobody is "in" one; the rank that queued fewer is behind.
    ahead = _rec(0, {TP01: 41}, last=_op("all_reduce", "tp", TP01, 41, (0, 1)), backend="nccl")
    behind = _rec(1, {TP01: 40}, last=_op("all_reduce", "tp", TP01, 40, (0, 1)), backend="nccl")
    hang = _diagnose([ahead, behind])
    assert hang.ranks == (1,) and hang.summary.startswith("stuck: never arrived at all_reduce/tp #41")


# ---- the board --------------------------------------------------------------------------------
def _pair(tmp_path, rank: int = 0, timeout_s: float = 60.0) -> tuple[DryRunCommunicator, Board]:
    comm = DryRunCommunicator(2, rank, name="tp")
    comm.members, comm.timeout_s = (0, 1), timeout_s
    board = Board(rank, 2, DirSink(tmp_path))
    comm.attach_board(board)
    return comm, board


def test_the_board_counts_operations_per_channel_and_publishes_a_record(tmp_path):
    comm, board = _pair(tmp_path)
    x = torch.zeros(4)
    comm.all_reduce(x)
    comm.all_reduce_(x)
    comm.send(x, 1)
    rec = board.record()
    assert rec["counts"] == {TP01: 2, f"{TP01}:0>1": 1}
    assert rec["op"] is None and rec["last"]["op"] == "send" and rec["last"]["peer"] == 1
    board.publish()
    assert json.loads((tmp_path / "rank0.json").read_text())["counts"] == rec["counts"]
    assert read_records(DirSink(tmp_path), 2) == {0: json.loads((tmp_path / "rank0.json").read_text())}


def test_a_failed_operation_stays_in_progress_on_the_board(tmp_path):
    comm, board = _pair(tmp_path)
    comm._all_reduce = lambda t, op: (_ for _ in ()).throw(RuntimeError("connection closed by peer"))
    with pytest.raises(CollectiveError) as info:
        comm.all_reduce(torch.zeros(4))
    assert info.value.hang is None, "a failure well before the timeout is not diagnosed"
    assert board.record()["op"]["seq"] == 1


def test_a_timed_out_operation_names_the_peer_from_the_board(tmp_path):
    peer, peer_board = _pair(tmp_path, rank=1)
    peer.all_reduce(torch.zeros(4))  # rank 1 finished all_reduce/tp #1 and published that ...
    peer_board.publish()
    comm, board = _pair(tmp_path, rank=0, timeout_s=0.05)
    comm.all_reduce(torch.zeros(4))

    def times_out(t, op):
        time.sleep(0.05)
        raise RuntimeError("Timed out waiting 50ms for recv operation to complete")

    comm._all_reduce = times_out  # ... while rank 0 waits in #2
    with pytest.raises(CollectiveError) as info:
        comm.all_reduce(torch.zeros(4))
    assert info.value.hang is not None and info.value.hang.ranks == (1,)
    assert str(info.value).startswith(
        "all_reduce on group 'tp' (rank 0 of 2, dry-run, timeout 0.05s) failed: Timed out waiting 50ms for recv "
        "operation to complete -- rank 1 is stuck: never arrived at all_reduce/tp #2 (rank 0 waited 0."
    )


def test_an_asynchronous_operation_is_on_the_board_while_in_flight_and_counted_once_recorded(tmp_path):
    comm, board = _pair(tmp_path)
    in_flight: torch.futures.Future = torch.futures.Future()
    comm._all_reduce_async = lambda t: in_flight  # a backend's all-reduce, not done yet
    grads = torch.zeros(1024)
    reduced, pending = comm.all_reduce_async_(grads)  # as DDP's comm hook does for a bucket
    rec = board.record()
    assert rec["counts"] == {TP01: 1} and [e["seq"] for e in rec["pending"]] == [1]
    assert not reduced.done() and "all_reduce/tp" not in comm.stats.snapshot()
    in_flight.set_result(grads)
    assert reduced.wait() is grads and board.record()["pending"] == []
    pending.record()
    assert comm.stats.snapshot()["all_reduce/tp"] == {"calls": 1, "bytes": 4096}


def test_a_failed_asynchronous_operation_stays_in_flight_and_raises_its_collective_error(tmp_path):
    comm, board = _pair(tmp_path)
    in_flight: torch.futures.Future = torch.futures.Future()
    comm._all_reduce_async = lambda t: in_flight
    reduced, pending = comm.all_reduce_async_(torch.zeros(4))
    in_flight.set_exception(RuntimeError("Connection closed by peer"))
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        reduced.wait()
    assert len(board.record()["pending"]) == 1
    error = pending.failed(RuntimeError("Connection closed by peer"))
    assert isinstance(error, CollectiveError) and error.hang is None  # well before the 60 s timeout


def test_a_rank_waiting_for_an_asynchronous_all_reduce_waits_in_it():
    # gloo DDP: rank 1 waits at the end of backward for its bucket all-reduce with rank 3
    rank1 = _rec(1, {DP13: 5})
    rank1["pending"] = [_op("all_reduce", "dp", DP13, 5, (1, 3), waited=2.0)]
    rank3 = _rec(3, {DP13: 4}, last=_op("all_reduce", "dp", DP13, 4, (1, 3), waited=9.0))
    hang = _diagnose([rank1, rank3], origin=1)
    assert hang.ranks == (3,) and hang.summary.startswith("stuck: never arrived at all_reduce/dp #5 (rank 1 waited")


def test_fault_injection_is_parsed_and_refuses_a_bad_spec():
    assert Fault.parse("3:all_reduce/dp#12:stop") == Fault(3, "all_reduce", "dp", 12, "stop")
    with pytest.raises(ValueError, match=r"expected RANK:OP/GROUP#N:stop\|sleep, e.g. 1:all_reduce/tp#5:stop"):
        Fault.parse("3:all_reduce:stop")
