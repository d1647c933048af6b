"""`shardwise serve` across pipeline stages (tp x pp ranks): bad sizes refused in one line,
greedy completions under continuous batching equal to tp=1 generate, a client that leaves
frees its slot on every stage, and a killed last-stage rank ends the server (503, exit 1,
no orphans). The server helpers are test_serve.py's."""

from __future__ import annotations

import os
import signal
from concurrent.futures import ThreadPoolExecutor

import pytest
from test_serve import Server, _fault_case, _until

from processes import run_cli_inline

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")


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


@pytest.mark.parametrize("tp,pp", [(1, 2), (2, 2)])
def test_concurrent_greedy_equals_tp1_and_disconnect_frees_slots(tmp_path, offline, tp, pp):
    import random

    s = Server(tmp_path, "--tp", str(tp), "--pp", str(pp), "--max-batch-size", "4", "--backend", "gloo")
    try:
        health = httpx.get(f"{s.url}/health", timeout=10).json()
        assert (health["tp"], health["pp"], len(health["pids"])) == (tp, pp, tp * pp)
        assert s.metric("shardwise_pipeline_parallel_size") == pp
        client = s.client()
        # a client that leaves mid-stream: its slot is freed (and reused below) on every stage
        stream = client.completions.create(
            model="default",
            prompt=[9, 8, 7],
            max_tokens=200,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        next(iter(stream))
        stream.close()
        assert _until(lambda: s.metric("shardwise_running_sequences") == 0)
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
    finally:
        s.stop()


def test_last_stage_rank_killed_mid_generation(tmp_path):
    # tp=1 x pp=2: rank 1 is the last stage, the one that sends the logits back to rank 0
    s = Server(tmp_path, "--tp", "1", "--pp", "2", "--timeout", "10", "--backend", "gloo")
    try:
        pids = httpx.get(f"{s.url}/health", timeout=10).json()["pids"]
        _fault_case(s, lambda: os.kill(pids[1], signal.SIGKILL))
        log = s.log.read_text()
        assert f"shardwise: error: rank 1 failed: process {pids[1]} " in log, log[-2000:]
    finally:
        s.stop()
