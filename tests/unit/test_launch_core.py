"""The launchers' shared fail-fast core (shardwise.launch.failfast), without processes:
which failure is the root cause (a stuck rank before the transport errors it causes), the
grace period after a first failure, the job deadline."""

from __future__ import annotations

import math
import time

import pytest

from shardwise.comm import CollectiveError, LocalCommunicator
from shardwise.comm.hang import Culprit, Hang, Wait
from shardwise.launch import JobTimeoutError, RankFailedError, failfast
from shardwise.launch.failfast import (
    GRACE_S,
    Failure,
    Outcomes,
    caused_by_collective,
    error_report,
    job_deadline,
    ok_report,
    root_cause,
)


def _collective_error() -> CollectiveError:
    return CollectiveError("all_reduce", LocalCommunicator(), RuntimeError("connection closed by peer"))


def test_caused_by_collective_follows_the_chain_of_causes():
    assert caused_by_collective(_collective_error())
    try:
        try:
            raise _collective_error()
        except CollectiveError as e:
            raise ValueError("while saving") from e
    except ValueError as e:
        assert caused_by_collective(e)  # explicit cause
    try:
        try:
            raise _collective_error()
        except CollectiveError:
            raise KeyError("during handling")  # noqa: B904 - implicit context, on purpose
    except KeyError as e:
        assert caused_by_collective(e)
    assert not caused_by_collective(ValueError("boom"))
    assert not caused_by_collective(None)


def test_error_report_names_the_exception_and_marks_collectives_secondary():
    try:
        raise ValueError("boom on rank 1")
    except ValueError as e:
        kind, when, summary, detail, secondary, stuck, hang = error_report(e)
    assert (kind, summary, secondary, stuck, hang) == ("error", "ValueError: boom on rank 1", False, (), "")
    assert "Traceback" in detail and abs(when - time.time()) < 60
    try:
        raise _collective_error()
    except CollectiveError as e:
        assert error_report(e)[4:] == (True, (), "")
    assert ok_report([1, 2]) == ("ok", [1, 2])


def _stuck_rank_3() -> Hang:
    wait = Wait(2, "all_reduce", "tp", 51, 20.0)
    return Hang((Culprit(3, "stopped", ((wait, False),), "stopped (process 4242, state T)"),))


def test_error_report_of_a_timeout_carries_the_stuck_ranks_through_the_chain_of_causes():
    hang = _stuck_rank_3()
    try:
        try:
            raise CollectiveError("all_reduce", LocalCommunicator(), RuntimeError("Timed out"), hang=hang)
        except CollectiveError as e:
            raise RuntimeError("during backward") from e
    except RuntimeError as e:
        report = error_report(e)
    assert report[4:] == (True, (3,), hang.summary)
    assert hang.summary == (
        "stuck: never arrived at all_reduce/tp #51 (rank 2 waited 20.0 s for it); stopped (process 4242, state T)"
    )


def test_root_cause_prefers_a_real_error_then_the_earliest():
    collective_first = Failure(0, 1.0, "CollectiveError: all_reduce failed", "", secondary=True)
    cause = Failure(2, 2.0, "ValueError: boom", "Traceback ...")
    later_cause = Failure(3, 3.0, "KeyError: 'x'", "Traceback ...")
    assert root_cause([collective_first, later_cause, cause]) is cause
    only_collectives = [Failure(1, 5.0, "a", "", True), Failure(0, 4.0, "b", "", True)]
    assert root_cause(only_collectives).rank == 0
    with pytest.raises(ValueError, match="no failures"):
        root_cause([])


def test_root_cause_prefers_a_timeout_that_names_the_stuck_rank_over_transport_errors():
    closed = Failure(1, 1.0, "CollectiveError: ... Connection closed by peer", "", secondary=True)
    timed_out = Failure(2, 2.0, "CollectiveError: ... Timed out", "", secondary=True, stuck=(3,), hang="stuck: ...")
    raised = Failure(0, 3.0, "ValueError: boom", "Traceback ...")
    assert root_cause([closed, timed_out]) is timed_out
    assert root_cause([closed, timed_out, raised]) is raised


def test_job_deadline_defaults_to_four_timeouts_plus_a_minute_and_allows_none():
    now = time.monotonic()
    assert 4 * 10 + 60 - 1 < job_deadline(10, None) - now <= 4 * 10 + 60 + 1
    assert 4 < job_deadline(10, 5) - now <= 5 + 1
    assert job_deadline(10, math.inf) == math.inf


class _Script:
    """A fake transport: the n-th poll delivers events[n] (rank, report) or (rank, "died")."""

    def __init__(self, outcomes: Outcomes, events: list[list[tuple]]) -> None:
        self.outcomes, self.events, self.polls = outcomes, events, 0

    def __call__(self, seconds: float) -> None:
        batch = self.events[self.polls] if self.polls < len(self.events) else []
        self.polls += 1
        for rank, report in batch:
            if report == "died":
                self.outcomes.died(rank, f"process {1000 + rank} killed by signal SIGKILL")
            else:
                self.outcomes.add(rank, report)
        time.sleep(min(seconds, 0.01))

    def running(self) -> bool:
        return len(self.outcomes.results) + len(self.outcomes.failures) < self.outcomes.world_size


def _error(summary: str, when: float, *, secondary: bool = False) -> tuple:
    return ("error", when, summary, f"Traceback: {summary}", secondary)


def test_collect_returns_results_by_rank():
    outcomes = Outcomes(3, pids=[10, 11, 12])
    script = _Script(outcomes, [[(2, ok_report("c"))], [(0, ok_report("a")), (1, ok_report("b"))]])
    assert outcomes.collect(script, running=script.running, deadline=math.inf) == ["a", "b", "c"]


def test_collect_waits_out_the_grace_period_for_the_root_cause():
    # Rank 0's collective fails first; rank 2's own error, the cause, arrives a moment later.
    outcomes = Outcomes(3, pids=[10, 11, 12])
    notified = []
    script = _Script(
        outcomes,
        [
            [(0, _error("CollectiveError: all_reduce failed", 1.0, secondary=True))],
            [(2, _error("ValueError: boom on rank 2", 2.0))],
        ],
    )
    start = time.monotonic()
    with pytest.raises(RankFailedError) as info:
        outcomes.collect(
            script, running=lambda: True, deadline=math.inf, on_first_failure=lambda f: notified.append(f.rank)
        )
    assert info.value.rank == 2 and info.value.summary == "ValueError: boom on rank 2"
    assert info.value.detail == "Traceback: ValueError: boom on rank 2" and info.value.pids == [10, 11, 12]
    assert notified == [0], "the survivors are told once, of the first failure"
    assert GRACE_S <= time.monotonic() - start < GRACE_S + 5


@pytest.fixture
def short_grace(monkeypatch):
    monkeypatch.setattr(failfast, "GRACE_S", 0.05)


def test_a_hang_is_reported_as_the_stuck_rank_with_what_the_waiting_rank_saw(short_grace):
    outcomes = Outcomes(4, pids=[10, 11, 12, 13])
    hang = _stuck_rank_3()
    script = _Script(
        outcomes,
        [
            [(1, _error("CollectiveError: recv failed: Connection closed by peer", 1.0, secondary=True))],
            [(2, ("error", 2.0, "CollectiveError: timed out", "Traceback: timed out", True, (3,), hang.summary))],
        ],
    )
    with pytest.raises(RankFailedError) as info:
        outcomes.collect(script, running=lambda: True, deadline=math.inf)
    err = info.value
    assert (err.rank, err.stuck, err.summary) == (3, (3,), hang.summary)
    assert err.detail == "what rank 2 saw:\nTraceback: timed out"
    assert str(err).startswith("rank 3 failed: stuck: never arrived at all_reduce/tp #51 (rank 2 waited 20.0 s")


@pytest.mark.parametrize(
    "failure,names",
    [
        (_error("CollectiveError: Connection closed by peer", 1.0, secondary=True), 3),
        ("aborted", 3),  # NCCL's watchdog aborts the rank whose collective timed out
        (_error("ValueError: boom", 1.0), 0),  # a real error is never second to the board
    ],
    ids=["undiagnosed-timeout", "watchdog-abort", "real-error"],
)
def test_the_launcher_reads_the_board_when_no_report_names_a_hang(short_grace, failure, names):
    outcomes = Outcomes(4, pids=[10, 11, 12, 13])

    def poll(seconds: float) -> None:
        if not outcomes.failures:
            if failure == "aborted":
                outcomes.died(0, "process 10 killed by signal SIGABRT", aborted=True)
            else:
                outcomes.add(0, failure)
        time.sleep(0.01)

    with pytest.raises(RankFailedError) as info:
        outcomes.collect(poll, running=lambda: True, deadline=math.inf, diagnose=_stuck_rank_3)
    assert info.value.rank == names
    if names == 3:
        assert info.value.stuck == (3,) and info.value.detail.startswith("what rank 0 saw:\n")


def test_a_death_without_a_report_is_a_root_cause():
    outcomes = Outcomes(2, pids=[10, 11])
    script = _Script(outcomes, [[(1, "died")], [(0, _error("CollectiveError: peer closed", 9e9, secondary=True))]])
    with pytest.raises(RankFailedError) as info:
        outcomes.collect(script, running=script.running, deadline=math.inf)
    assert info.value.rank == 1 and "SIGKILL" in info.value.summary


def test_collect_past_the_deadline_names_the_unfinished_ranks():
    outcomes = Outcomes(3, pids=[10, 11, 12])
    script = _Script(outcomes, [[(1, ok_report(None))]])
    with pytest.raises(JobTimeoutError, match=r"ranks \[0, 2\] had not finished") as info:
        outcomes.collect(script, running=lambda: True, deadline=time.monotonic() + 0.3)
    assert info.value.pids == [10, 11, 12]


def test_a_rank_that_ends_without_a_word_fails_the_job():
    outcomes = Outcomes(2, pids=[10, 11])
    script = _Script(outcomes, [[(0, ok_report(1))]])
    with pytest.raises(RankFailedError, match="rank 1 failed: exited without reporting"):
        outcomes.collect(script, running=lambda: script.polls < 3, deadline=math.inf)


def test_collect_waits_past_the_grace_period_for_a_live_rank_whose_report_is_the_cause(short_grace):
    # pp > 1 serving: rank 2's receive fails first (its peer rank 1 exited); rank 1's own error,
    # the cause, is slow to arrive (a loaded host), and rank 0 reports after it
    outcomes = Outcomes(3, pids=[10, 11, 12])
    first = [(2, _error("CollectiveError: recv failed", 1.0, secondary=True))]
    cause = [(1, _error("RuntimeError: injected", 2.0))]
    script = _Script(outcomes, [first, *[[]] * 20, cause, [(0, ok_report(None))]])  # 20 polls: > GRACE_S
    start = time.monotonic()
    with pytest.raises(RankFailedError) as info:
        outcomes.collect(script, running=lambda: True, deadline=math.inf, settle_s=30)
    assert info.value.rank == 1 and info.value.summary == "RuntimeError: injected"
    assert script.polls == 23, "it stopped as soon as every rank had reported, well before settle_s"
    assert time.monotonic() - start < 10


def test_collect_waits_for_no_rank_named_stuck_and_at_most_settle_s(short_grace):
    hang = _stuck_rank_3()
    timed_out = ("error", 2.0, "CollectiveError: timed out", "Traceback: timed out", True, (3,), hang.summary)
    outcomes = Outcomes(4, pids=[10, 11, 12, 13])
    script = _Script(outcomes, [[(2, timed_out), (0, ok_report(None)), (1, ok_report(None))]])
    with pytest.raises(RankFailedError) as info:  # rank 3 never reports: it is stopped
        outcomes.collect(script, running=lambda: True, deadline=math.inf, settle_s=math.inf)
    assert info.value.rank == 3
    outcomes = Outcomes(3, pids=[10, 11, 12])  # a rank that never reports nor is named: settle_s bounds the wait
    script = _Script(outcomes, [[(0, _error("CollectiveError: recv failed", 1.0, secondary=True))]])
    start = time.monotonic()
    with pytest.raises(RankFailedError):
        outcomes.collect(script, running=lambda: True, deadline=math.inf, settle_s=0.5)
    assert 0.5 <= time.monotonic() - start < 5
