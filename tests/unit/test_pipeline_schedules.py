"""Pipeline schedules as data: every schedule passes the simulator, the bubble and the
activations held match their formulas, malformed lists and bad input fail with one line."""

from __future__ import annotations

import ast
import dataclasses
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import shardwise.pipeline as pipeline
from shardwise.pipeline import (
    Action,
    Costs,
    Kind,
    ScheduleCheckError,
    ScheduleConfig,
    ScheduleError,
    build_schedule,
    gpipe,
    interleaved,
    one_f_one_b,
    simulate,
)


def _cases():
    for p in (1, 2, 3, 4):
        for m in sorted({1, 2, p, 2 * p + 1, 8}):
            yield "gpipe", p, m, 1
            yield "1f1b", p, m, 1
            for v in (2, 3):
                yield "interleaved", p, m, v


def _allowed(name: str, p: int, m: int, v: int) -> bool:
    return name != "interleaved" or (p >= 2 and m % p == 0)


CASES = list(_cases())


def _check(name: str, p: int, m: int, v: int, costs: Costs | None = None) -> pipeline.Simulation:
    lists = build_schedule(name, p, m, v)
    assert len(lists) == p
    sim = simulate(lists, microbatches=m, virtual_stages=v, costs=costs)
    # Each (stage, micro-batch) computes forward and backward exactly once (the simulator
    # raises otherwise; counted again here), and every boundary moves 2 messages per micro-batch.
    computes = [a for actions in lists for a in actions if not a.is_transfer]
    assert len(computes) == len(set(computes)) == 2 * m * p * v
    sends = [a for actions in lists for a in actions if a.is_send]
    assert len(sends) == 2 * m * (p * v - 1)
    return sim


# --- every schedule runs -----------------------------------------------------------------


@pytest.mark.parametrize("name,p,m,v", CASES, ids=[f"{n}-p{p}-m{m}-v{v}" for n, p, m, v in CASES])
def test_every_schedule_passes_the_simulator_or_is_refused(name, p, m, v):
    if _allowed(name, p, m, v):
        _check(name, p, m, v)
    else:
        with pytest.raises(ScheduleError, match="interleaved 1F1B needs"):
            build_schedule(name, p, m, v)


@settings(max_examples=60, deadline=None)
@given(
    name=st.sampled_from(["gpipe", "1f1b", "interleaved"]),
    p=st.integers(1, 6),
    groups=st.integers(1, 4),
    extra=st.integers(0, 5),
    v=st.integers(2, 4),
)
def test_random_sizes_pass_the_simulator(name, p, groups, extra, v):
    if name == "interleaved":
        p = max(p, 2)
        m = groups * p  # the constraint the config enforces
    else:
        m, v = groups * p + extra, 1
    sim = _check(name, p, m, v, Costs(forward=1, backward=2))
    assert sim.makespan >= 3 * m * v  # no rank does its work in less than its work


def test_the_schedule_functions_are_what_build_schedule_names():
    assert build_schedule("gpipe", 3, 5) == gpipe(3, 5)
    assert build_schedule("1f1b", 3, 5) == one_f_one_b(3, 5)
    assert build_schedule("interleaved", 2, 4, 2) == interleaved(2, 4, 2)
    assert build_schedule("1f1b", 3, 5) == build_schedule("1f1b", 3, 5)  # pure: same input, same lists


def test_a_1f1b_list_reads_like_the_textbook():
    rank0, rank1 = one_f_one_b(2, 3)
    F, B = Kind.FORWARD, Kind.BACKWARD
    assert [(a.kind, a.microbatch) for a in rank0 if not a.is_transfer] == [
        (F, 0),
        (F, 1),
        (B, 0),
        (F, 2),
        (B, 1),
        (B, 2),
    ]
    assert [(a.kind, a.microbatch) for a in rank1 if not a.is_transfer] == [
        (F, 0),
        (B, 0),
        (F, 1),
        (B, 1),
        (F, 2),
        (B, 2),
    ]
    assert str(rank0[1]) == "SEND_ACT(microbatch 0, stage 0 -> rank 1)"
    assert str(rank1[0]) == "RECV_ACT(microbatch 0, stage 1 <- rank 0)"


def test_interleaved_puts_chunk_c_of_rank_r_on_stage_c_times_p_plus_r():
    p, v = 3, 2
    for r, actions in enumerate(interleaved(p, 3, v)):
        assert {a.stage for a in actions} == {c * p + r for c in range(v)}
        assert {a.chunk(p) for a in actions} == set(range(v))


# --- the bubble --------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p", [1, 2, 3, 4])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 8, 9])
def test_bubble_is_p_minus_1_over_m_plus_p_minus_1_with_unit_costs(name, p, m):
    """Exact when every stage costs the same and transfers are free: the last micro-batch
    enters stage 0 m - 1 forwards in and needs p - 1 more stages each way."""
    sim = simulate(build_schedule(name, p, m))
    assert sim.makespan == 2 * (m + p - 1)
    assert Fraction(sum(sim.idle)) / (p * Fraction(sim.makespan)) == Fraction(p - 1, m + p - 1)
    assert sim.bubble == pytest.approx((p - 1) / (m + p - 1), abs=1e-15)


@settings(max_examples=40, deadline=None)
@given(
    name=st.sampled_from(["gpipe", "1f1b"]),
    p=st.integers(1, 5),
    m=st.integers(1, 12),
    f=st.integers(1, 4),
    b=st.integers(1, 4),
)
def test_the_formula_holds_for_any_forward_backward_ratio(name, p, m, f, b):
    """GPipe and 1F1B keep (p-1)/(m+p-1) when backward costs differ from forward
    (integer costs: float sums are exact)."""
    sim = simulate(build_schedule(name, p, m), costs=Costs(forward=f, backward=b))
    assert sim.makespan == (m + p - 1) * (f + b)
    assert Fraction(sum(sim.idle)) / (p * Fraction(sim.makespan)) == Fraction(p - 1, m + p - 1)


def test_transfer_costs_add_to_the_bubble():
    free = simulate(one_f_one_b(4, 8))
    paid = simulate(one_f_one_b(4, 8), costs=Costs(transfer=0.25))
    assert paid.makespan > free.makespan and paid.bubble > free.bubble


@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("v", [2, 3, 4])
@pytest.mark.parametrize("groups", [1, 2, 3])
def test_interleaved_bubble_is_megatrons_formula(p, v, groups):
    """Megatron's formula: bubble time / ideal time = (p - 1) / (v * m), with one chunk's
    forward and backward each costing 1 (a rank's ideal time is 2 * m * v), transfers free.
    As an idle fraction of wall time: (p - 1) / (v * m + p - 1), below 1F1B's (p - 1) / (m + p - 1)."""
    m = groups * p
    sim = simulate(interleaved(p, m, v))
    ideal = 2 * m * v
    assert sim.makespan == ideal + 2 * (p - 1)
    assert Fraction(sim.makespan - ideal) / ideal == Fraction(p - 1, v * m)
    assert Fraction(sum(sim.idle)) / (p * Fraction(sim.makespan)) == Fraction(p - 1, v * m + p - 1)
    assert sim.bubble < simulate(one_f_one_b(p, m)).bubble


@pytest.mark.parametrize("name,p,m,v", [c for c in CASES if _allowed(*c)], ids=lambda x: str(x))
def test_buffered_sends_pass_and_are_never_slower(name, p, m, v):
    lists = build_schedule(name, p, m, v)
    for costs in (Costs(), Costs(forward=1, backward=2, transfer=0.25)):
        buffered = simulate(lists, costs=costs, sends="buffered")
        assert buffered.makespan <= simulate(lists, costs=costs).makespan
    if name != "interleaved":
        assert simulate(lists, costs=Costs(forward=1, backward=2), sends="buffered").makespan == 3 * (m + p - 1)


def test_facing_sends_only_deadlock_when_sends_block():
    """The check runs sends as rendezvous because buffering hides this deadlock: the same lists
    finish when sends return at once."""
    lists = _lists(2, 4)
    r1 = lists[1]
    i, j = r1.index(Action(Kind.RECV_ACT, 2, 1, peer=0)), r1.index(Action(Kind.SEND_GRAD, 1, 1, peer=0))
    r1[i], r1[j] = r1[j], r1[i]
    simulate(lists, sends="buffered")
    with pytest.raises(ScheduleCheckError, match="deadlock"):
        simulate(lists)


def test_buffered_receives_take_messages_in_order():
    lists = _lists()
    r1 = lists[1]
    i, j = r1.index(Action(Kind.RECV_ACT, 1, 1, peer=0)), r1.index(Action(Kind.RECV_ACT, 2, 1, peer=0))
    r1[i], r1[j] = r1[j], r1[i]
    with pytest.raises(
        ScheduleCheckError, match=r"rank 1, RECV_ACT\(microbatch 2, stage 1 <- rank 0\): gets SEND_ACT\(microbatch 1"
    ):
        simulate(lists, sends="buffered")
    lists = _lists()
    lists[0].append(Action(Kind.SEND_ACT, 2, 0, peer=1))
    with pytest.raises(
        ScheduleCheckError, match=r"rank 0, SEND_ACT\(microbatch 2, stage 0 -> rank 1\): sends a second time"
    ):
        simulate(lists, sends="buffered")
    with pytest.raises(ValueError, match="sends must be 'rendezvous' or 'buffered', got 'eager'"):
        simulate(_lists(), sends="eager")


def test_a_send_nobody_receives_is_caught_when_buffered():
    lists = [list(a) for a in gpipe(2, 2)]
    lists[1].remove(Action(Kind.RECV_ACT, 1, 1, peer=0))
    lists[1].remove(Action(Kind.FORWARD, 1, 1))
    lists[1].remove(Action(Kind.BACKWARD, 1, 1))
    lists[1].remove(Action(Kind.SEND_GRAD, 1, 1, peer=0))
    lists[0].remove(Action(Kind.RECV_GRAD, 1, 0, peer=1))
    lists[0].remove(Action(Kind.BACKWARD, 1, 0))
    with pytest.raises(
        ScheduleCheckError, match=r"rank 0, SEND_ACT\(microbatch 1, stage 0 -> rank 1\): is never received"
    ):
        simulate(lists, sends="buffered")


def test_interleaved_with_slower_backward_is_measured_not_promised():
    """The transfers are placed for forward = backward; with backward = 2 x forward and
    blocking sends the interleaved lists still run, but the gain over 1F1B can vanish
    (docs/pipeline.md shows the numbers). This pins that the simulator sees it."""
    slow = Costs(forward=1, backward=2)
    one = simulate(one_f_one_b(2, 8), costs=slow).bubble
    assert simulate(interleaved(2, 8, 2), costs=slow).bubble > one
    assert simulate(interleaved(2, 8, 2), costs=slow, sends="buffered").bubble > one  # the receives' places, too


# --- activations held --------------------------------------------------------------------


@pytest.mark.parametrize("p", [1, 2, 3, 4])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 8, 9])
def test_in_flight_peaks(p, m):
    assert simulate(gpipe(p, m)).peak_in_flight == [m] * p
    assert simulate(one_f_one_b(p, m)).peak_in_flight == [min(p - s, m) for s in range(p)]


@pytest.mark.parametrize("p,v,m", [(2, 2, 2), (2, 2, 8), (4, 2, 4), (4, 2, 8), (3, 3, 9), (4, 3, 12)])
def test_interleaved_holds_its_warmup_plus_one(p, v, m):
    sim = simulate(interleaved(p, m, v))
    assert sim.peak_in_flight == [min(2 * (p - r - 1) + (v - 1) * p + 1, m * v) for r in range(p)]
    assert [sum(sim.peak_in_flight_per_stage[r::p]) >= sim.peak_in_flight[r] for r in range(p)] == [True] * p


# --- malformed lists ---------------------------------------------------------------------


def _lists(p: int = 2, m: int = 3) -> list[list[Action]]:
    return [list(actions) for actions in one_f_one_b(p, m)]


def test_a_missing_receive_is_named():
    lists = [list(a) for a in gpipe(2, 3)]
    lists[1].remove(Action(Kind.RECV_ACT, 1, 1, peer=0))
    with pytest.raises(ScheduleCheckError, match=r"rank 1, FORWARD\(microbatch 1, stage 1\): has no input"):
        simulate(lists)


def test_a_missing_send_is_a_deadlock_naming_the_waiting_receive():
    lists = _lists()
    lists[0].remove(Action(Kind.SEND_ACT, 2, 0, peer=1))
    with pytest.raises(
        ScheduleCheckError, match=r"deadlock: .*rank 1 waits at RECV_ACT\(microbatch 2, stage 1 <- rank 0\)"
    ):
        simulate(lists)


def test_two_sends_facing_each_other_deadlock():
    """Both neighbours send first: with blocking send/recv neither returns. In the steady state
    rank 0 sends act 2 and then receives grad 1, so the placement has rank 1 receive act 2
    before it sends grad 1; swapping rank 1's two (the naive "send right after backward") deadlocks."""
    lists = _lists(2, 4)
    r0, r1 = lists
    assert r0.index(Action(Kind.SEND_ACT, 2, 0, peer=1)) < r0.index(Action(Kind.RECV_GRAD, 1, 0, peer=1))
    i, j = r1.index(Action(Kind.RECV_ACT, 2, 1, peer=0)), r1.index(Action(Kind.SEND_GRAD, 1, 1, peer=0))
    assert j == i + 1
    r1[i], r1[j] = r1[j], r1[i]
    with pytest.raises(
        ScheduleCheckError,
        match=r"deadlock: rank 0 waits at SEND_ACT\(microbatch 2, stage 0 -> rank 1\); "
        r"rank 1 waits at SEND_GRAD\(microbatch 1, stage 1 -> rank 0\)",
    ):
        simulate(lists)


def test_receives_in_the_wrong_order_are_a_mismatch():
    lists = _lists()
    r1 = lists[1]
    i, j = r1.index(Action(Kind.RECV_ACT, 1, 1, peer=0)), r1.index(Action(Kind.RECV_ACT, 2, 1, peer=0))
    r1[i], r1[j] = r1[j], r1[i]
    with pytest.raises(
        ScheduleCheckError, match=r"rank 1, RECV_ACT\(microbatch 2, stage 1 <- rank 0\): meets SEND_ACT\(microbatch 1"
    ):
        simulate(lists)


@pytest.mark.parametrize(
    "edit,message",
    [
        (
            lambda L: L[0].append(Action(Kind.FORWARD, 0, 0)),
            r"rank 0, FORWARD\(microbatch 0, stage 0\): runs a second time",
        ),
        (
            lambda L: L[1].remove(Action(Kind.BACKWARD, 2, 1)),
            r"SEND_GRAD\(microbatch 2, stage 1 -> rank 0\): sends before BACKWARD\(microbatch 2, stage 1\)",
        ),
        (lambda L: L[0].remove(Action(Kind.BACKWARD, 2, 0)), r"rank 0, BACKWARD\(microbatch 2, stage 0\): never runs"),
        (
            lambda L: (
                L[0].append(Action(Kind.SEND_ACT, 2, 0, peer=1)),
                L[1].append(Action(Kind.RECV_ACT, 2, 1, peer=0)),
            ),
            r"rank 0, SEND_ACT\(microbatch 2, stage 0 -> rank 1\): sends a second time",
        ),
        (
            lambda L: L[0].insert(0, Action(Kind.BACKWARD, 0, 0)),
            r"rank 0, BACKWARD\(microbatch 0, stage 0\): runs before the forward",
        ),
        (lambda L: L[0].insert(0, Action(Kind.FORWARD, 0, 1)), r"stage 1 lives on rank 1, not rank 0"),
        (lambda L: L[0].insert(0, Action(Kind.FORWARD, 5, 0)), r"microbatch 5 is out of range 0..2"),
        (lambda L: L[0].insert(0, Action(Kind.SEND_GRAD, 0, 0, peer=1)), r"no stage -1 to talk to"),
        (lambda L: L[0].insert(0, Action(Kind.FORWARD, 0, 0, peer=1)), r"a compute action has a peer"),
    ],
    ids=[
        "twice",
        "send-before-produced",
        "missing-backward",
        "sent-twice",
        "backward-first",
        "wrong-rank",
        "mb-range",
        "no-stage",
        "peer",
    ],
)
def test_malformed_lists_name_rank_action_and_microbatch(edit, message):
    lists = _lists()
    edit(lists)
    with pytest.raises(ScheduleCheckError, match=message):
        simulate(lists, microbatches=3)


def test_a_backward_without_its_output_gradient_is_caught():
    """Backward runs in reverse stage order: stage 0 cannot go before stage 1 sent its gradient."""
    lists = _lists()
    lists[0].remove(Action(Kind.RECV_GRAD, 0, 0, peer=1))
    lists[1].remove(Action(Kind.SEND_GRAD, 0, 1, peer=0))
    with pytest.raises(ScheduleCheckError, match=r"rank 0, BACKWARD\(microbatch 0, stage 0\): has no output gradient"):
        simulate(lists)


def test_a_wrong_peer_is_caught_before_running():
    lists = [list(a) for a in one_f_one_b(3, 2)]
    lists[1][0] = dataclasses.replace(lists[1][0], peer=2)
    with pytest.raises(
        ScheduleCheckError, match=r"rank 1, RECV_ACT\(microbatch 0, stage 1 <- rank 2\): the peer must be rank 0"
    ):
        simulate(lists)


# --- bad input ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args,message",
    [
        (("gpipe", 0, 4, 1), "pp must be a positive int, got 0"),
        (("1f1b", 2, 0, 1), "microbatches must be a positive int, got 0"),
        (("1f1b", 2, 4, 0), "virtual_stages must be a positive int, got 0"),
        (("1f1b", True, 4, 1), "pp must be a positive int, got True"),
        (("pipedream", 2, 4, 1), "unknown schedule 'pipedream'; valid: gpipe, 1f1b, interleaved"),
        (("gpipe", 2, 4, 2), "schedule 'gpipe' runs one model chunk per rank: virtual_stages must be 1, got 2"),
        (("interleaved", 2, 4, 1), "interleaved 1F1B needs virtual_stages >= 2, got 1"),
        (("interleaved", 1, 4, 2), "interleaved 1F1B needs pp >= 2, got pp=1"),
        (
            ("interleaved", 4, 6, 2),
            "interleaved 1F1B needs microbatches to be a multiple of pp=4 (they run in groups of pp through "
            "each chunk); got 6; valid: 4, 8, 12, ...; or use '1f1b', which takes any",
        ),
    ],
)
def test_bad_input_is_one_line_naming_the_numbers(args, message):
    for make in (lambda: ScheduleConfig(*args), lambda: build_schedule(*args)):
        with pytest.raises(ScheduleError) as err:
            make()
        assert str(err.value) == message or str(err.value).startswith(message)
        assert "\n" not in str(err.value)


def test_lists_without_work_are_refused():
    with pytest.raises(ScheduleCheckError, match="no ranks"):
        simulate([])
    with pytest.raises(ScheduleCheckError, match="no FORWARD or BACKWARD"):
        simulate([[], []])


def test_costs_validate():
    with pytest.raises(ValueError, match="Costs.forward must be > 0, got 0"):
        Costs(forward=0)
    with pytest.raises(ValueError, match="Costs.transfer must be >= 0, got -1"):
        Costs(transfer=-1)


# --- pure data ---------------------------------------------------------------------------


def test_the_package_imports_only_the_standard_library_and_itself():
    """Schedules, simulator and stage split are pure logic (the planner imports them without
    torch); only runtime.py, which executes a schedule on tensors, imports torch and comm."""
    root = Path(pipeline.__file__).parent
    for path in root.glob("*.py"):
        if path.name == "runtime.py":
            continue
        for node in ast.parse(path.read_text()).body:  # module level; stage.py imports torch inside keep_stage
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            for n in names:
                top = n.split(".")[0]
                assert top != "torch" and (top != "shardwise" or n.startswith("shardwise.pipeline")), (
                    f"{path.name}: {n}"
                )
    code = "import sys, shardwise.pipeline, shardwise.pipeline.stage; assert 'torch' not in sys.modules, 'torch'"
    subprocess.run([sys.executable, "-c", code], check=True)
