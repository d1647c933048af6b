"""`shardwise serve` across pipeline stages (tp x pp ranks): bad sizes refused in one line,
greedy completions under continuous batching equal to tp=1 generate, clients that leave
free their slots on every stage, and a rank that dies, raises or stops (SIGSTOP), in a
middle or the last stage, on gloo and on MPI, ends the server: 503, an error that names
it, exit 1, no orphans. The server helpers are test_serve.py's."""

from __future__ import annotations

import os
import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from test_serve import Server, _backend, _fault_case, _until

from processes import run_cli_inline

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")


@pytest.mark.gate
@pytest.mark.parametrize(
    "args,message",
    [
        (["--tp", "1", "--pp", "9"], "pp=9 is more than the model's 4 layers"),
        (["--tp", "1", "--pipeline-parallel-size", "0"], "--pp must be >= 1, got 0"),
    ],
)
def test_bad_pp_is_one_line_and_starts_no_rank(args, message):
    out = run_cli_inline("serve", *args)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1 and lines[0].startswith("shardwise: error: ") and message in lines[0]


@pytest.fixture(scope="module")
def offline():
    """Greedy token ids of engine.generate at tp=1 (this process), one prompt alone."""
    from shardwise.comm import LocalCommunicator
    from shardwise.engine import generate
    from shardwise.engine.text import DEFAULT_MODEL
    from shardwise.hf import load_pretrained

    model = load_pretrained(DEFAULT_MODEL, comm=LocalCommunicator())[0]
    return lambda prompt, n: generate(model, [prompt], comm=LocalCommunicator(), max_new_tokens=n).tokens[0]


@pytest.mark.parametrize("tp,pp", [(2, 2), (1, 3)])
def test_concurrent_greedy_equals_tp1_and_disconnect_frees_slots(tmp_path, offline, tp, pp):
    import random

    s = Server(tmp_path, "--tp", str(tp), "--pp", str(pp), "--max-batch-size", "4", "--backend", "gloo")
    try:
        health = httpx.get(f"{s.url}/health", timeout=10).json()
        assert (health["tp"], health["pp"], len(health["pids"])) == (tp, pp, tp * pp)
        assert s.metric("shardwise_pipeline_parallel_size") == pp
        client = s.client()
        # as many clients as slots leave mid-stream, their steps in flight on different stages:
        # every slot is freed (and reused below: 8 requests need all 4) on every stage
        streams = [
            client.completions.create(
                model="default",
                prompt=[9, 8, i],
                max_tokens=200,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            for i in range(4)
        ]
        for stream in streams:
            next(iter(stream))
        assert s.metric("shardwise_running_sequences") == 4
        for stream in streams:
            stream.close()
        assert _until(lambda: s.metric("shardwise_running_sequences") == 0)
        assert _until(lambda: s.metric('shardwise_requests_total{outcome="cancelled"}') == 4)
        rng = random.Random(pp * 10 + tp)
        jobs = [([rng.randrange(2, 512) for _ in range(rng.randint(1, 30))], rng.randint(4, 12)) for _ in range(8)]
        steps_before = s.metric("shardwise_step_seconds_count")

        def one(job) -> str:
            prompt, n = job
            kw = dict(model="default", prompt=prompt, max_tokens=n, temperature=0)
            r = client.completions.create(**kw, extra_body={"ignore_eos": True})
            return r.choices[0].text

        with ThreadPoolExecutor(len(jobs)) as pool:  # 8 requests on 4 slots: joins and leaves mid-batch
            got = list(pool.map(one, jobs, timeout=240))
        from shardwise.engine.text import DEFAULT_MODEL, load_tokenizer

        tok = load_tokenizer(DEFAULT_MODEL)
        for (prompt, n), text in zip(jobs, got, strict=True):
            assert text == tok.decode(offline(prompt, n))
        steps = s.metric("shardwise_step_seconds_count") - steps_before
        assert steps < sum(n for _, n in jobs), f"{steps} steps: requests were not batched"
        for stage in range(pp):  # every stage's compute time reached rank 0 along the pipe
            assert s.metric(f'shardwise_stage_busy_seconds_total{{stage="{stage}"}}') > 0
            assert 0 <= s.metric(f'shardwise_stage_idle_fraction{{stage="{stage}"}}') <= 1
    finally:
        s.stop()


@pytest.mark.gate
def test_scheduler_keeps_groups_in_flight_apart():
    """At pp > 1 a sequence in flight neither steps again nor frees its slot: the running
    sequences split into groups that take turns through the stages."""
    import torch

    from shardwise.engine import SamplingParams
    from shardwise.serve.metrics import Metrics
    from shardwise.serve.pipelined import InFlight
    from shardwise.serve.scheduler import Scheduler, Sequence

    sched = Scheduler(num_slots=4, max_queue=4, metrics=Metrics(tp=1, slots=4, pp=2))
    outs: list = []
    seqs = [Sequence([i + 1, i + 2], 4, SamplingParams(), frozenset(), outs.append) for i in range(4)]
    pipe = InFlight(1)  # pp = 2: one item in the pipe while rank 0 starts the next
    logits = torch.nn.functional.one_hot(torch.tensor([9, 9]), 16).float()  # (2, V): every row samples 9
    sched.submit(seqs[0])
    sched.submit(seqs[1])
    a = sched.next_batch(busy=pipe.busy())  # group A: prefill of 0 and 1
    assert a.slots.tolist() == [0, 1] and pipe.push(sched.rows()) is None
    sched.submit(seqs[2])
    sched.submit(seqs[3])
    b = sched.next_batch(busy=pipe.busy())  # group B: 2 and 3 join while A is in flight
    assert b.slots.tolist() == [2, 3]
    done = pipe.push(sched.rows())  # A leaves the pipe
    assert [q.slot for q in done] == [0, 1]
    sched.finish_step(logits, done)
    sched.cancel(seqs[3])  # its client leaves while B is in flight: slot 3 stays taken
    again = sched.next_batch(busy=pipe.busy())  # A decodes; B is still in flight
    assert again.slots.tolist() == [0, 1] and again.past.tolist() == [2, 2] and 3 not in sched.free
    sched.finish_step(logits, pipe.push(sched.rows()))  # B leaves the pipe
    assert sched.next_batch(busy=pipe.busy()).slots.tolist() == [2] and 3 in sched.free
    sched.finish_step(logits[:1], sched.rows())
    # 3 running sequences in 2 groups: at most 2 per step, the longest waiting first
    assert sched.next_batch(groups=2).slots.tolist() == [0, 1]
    sched.finish_step(logits, sched.rows())
    assert sched.next_batch(groups=2).slots.tolist() == [2, 0]


@pytest.mark.parametrize("backend", ["gloo", "mpi"])
def test_last_stage_rank_killed_mid_generation(tmp_path, backend):
    # tp=1 x pp=2: rank 1 is the last stage, the one that sends the logits back to rank 0
    s = Server(tmp_path, "--tp", "1", "--pp", "2", "--timeout", "10", "--backend", _backend(backend))
    try:
        pids = httpx.get(f"{s.url}/health", timeout=10).json()["pids"]
        _fault_case(s, lambda: os.kill(pids[1], signal.SIGKILL))
        log = s.log.read_text()
        assert f"shardwise: error: rank 1 failed: process {pids[1]} " in log, log[-2000:]
    finally:
        s.stop()


@pytest.mark.parametrize("backend", ["gloo", "mpi"])
def test_middle_stage_rank_raising_mid_generation(tmp_path, backend):
    # tp=1 x pp=3: rank 1 is the middle stage; it raises at its 61st step. gloo: its peers'
    # receives fail at once ("connection closed") and rank 0 hears it from the last stage;
    # MPI: the launcher tells them. Rank 1's own error is the one reported, however late
    # rank 0 learns of it (the launcher waits for every live rank's report)
    args = ("--tp", "1", "--pp", "3", "--timeout", "10", "--backend", _backend(backend), "--health-timeout", "1")
    args += ("--debug-fail-rank", "1", "--debug-fail-after", "60")
    s = Server(tmp_path, *args)
    try:
        _fault_case(s, lambda: None)
        assert "rank 1 failed: RuntimeError: injected failure on rank 1 at step 61" in s.log.read_text()
    finally:
        s.stop()


def _idle_fault_case(s: Server, trigger) -> None:
    """No request is running when `trigger()` breaks a rank: the heartbeat's bubble finds it;
    /health answers 503 while the server is up, then it exits 1."""
    trigger()
    seen: list[int | None] = []
    while None not in seen and 503 not in seen:
        try:
            seen.append(httpx.get(f"{s.url}/health", timeout=1).status_code)
        except httpx.TransportError:
            seen.append(None)
        time.sleep(0.05)
    assert 503 in seen, f"/health answered {seen} after the fault"
    assert s.proc.wait(20) == 1


@pytest.mark.parametrize(
    "backend,rank,busy",
    [("gloo", 1, True), ("gloo", 2, False), ("mpi", 1, False), ("mpi", 2, True)],
    ids=["gloo-middle-streaming", "gloo-last-idle", "mpi-middle-idle", "mpi-last-streaming"],
)
def test_stopped_stage_rank_is_named_and_the_server_exits_1(tmp_path, backend, rank, busy):
    # tp=1 x pp=3, rank 1 (the middle stage) or 2 (the last) stopped, mid-stream or idle (only
    # the heartbeat's bubbles run then): rank 0 waits for the item that never comes back;
    # /health turns 503 after --health-timeout, the receive times out after --timeout, and
    # the error names the stopped rank
    timeout = 3.0
    args = ("--tp", "1", "--pp", "3", "--timeout", str(timeout), "--health-timeout", "1")
    s = Server(tmp_path, *args, "--backend", _backend(backend))
    try:
        pids = httpx.get(f"{s.url}/health", timeout=10).json()["pids"]
        stopped_at: list[float] = []

        def stop() -> None:
            stopped_at.append(time.monotonic())
            os.kill(pids[rank], signal.SIGSTOP)

        (_fault_case if busy else _idle_fault_case)(s, stop)  # (error event,) 503, exit 1
        ended = time.monotonic() - stopped_at[0]
        log = s.log.read_text()
        assert re.search(rf"shardwise: error: rank {rank} failed: stuck: never arrived at \w+/pp #", log), log[-3000:]
        assert f"stopped (process {pids[rank]}, state T; " in log
        assert ended < 4 * timeout, f"the server exited {ended:.1f} s after rank {rank} stopped"
    finally:
        s.stop()  # asserts that no rank process remains: the stopped one was killed
