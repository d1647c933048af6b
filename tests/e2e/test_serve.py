"""`shardwise serve` end to end: a real server process on loopback, real HTTP clients
(httpx and the official openai client), bad input, load, and faults."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from processes import process_tag, run_cli, run_cli_inline, tagged_pids, wait_gone

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")


class Server:
    """`shardwise serve ...` in a subprocess, tagged so that its ranks can be found in /proc."""

    def __init__(self, tmp: Path, *args: str) -> None:
        from shardwise.launch import free_port

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.tag = process_tag()
        self.log = tmp / f"serve-{self.port}.log"
        cmd = [sys.executable, "-m", "shardwise", "serve", "--port", str(self.port), *args]
        env = {**os.environ, "OMP_NUM_THREADS": "1", **self.tag}
        with open(self.log, "w") as f:
            self.proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.stop()
        raise AssertionError(f"server did not become healthy:\n{self.log.read_text()[-3000:]}")

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=120)

    def metric(self, name: str) -> float:
        for line in httpx.get(f"{self.url}/metrics", timeout=10).text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        raise KeyError(name)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        assert wait_gone(tag=self.tag) == [], "orphan rank processes remain"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("serve"), "--tp", "2", "--max-batch-size", "8")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def offline():
    """Greedy tokens of engine.generate for one prompt alone (tp=1, in this process)."""
    from shardwise.comm import LocalCommunicator
    from shardwise.engine import generate
    from shardwise.engine.text import DEFAULT_MODEL, load_tokenizer
    from shardwise.hf import load_pretrained

    model = load_pretrained(DEFAULT_MODEL, comm=LocalCommunicator())[0]
    tok = load_tokenizer(DEFAULT_MODEL)

    def text(prompt: list[int], n: int) -> str:
        return tok.decode(generate(model, [prompt], comm=LocalCommunicator(), max_new_tokens=n).tokens[0])

    text.tokenizer = tok  # type: ignore[attr-defined]
    return text


@pytest.mark.gate
@pytest.mark.parametrize(
    "args,message",
    [
        (["--tp", "9"], "tp=9 is more than the model's num_attention_heads=8"),
        (["--max-model-len", "4096"], "--max-model-len must be in [1, 512]"),
    ],
)
def test_bad_options_are_one_line_and_start_no_rank(args, message):
    out = run_cli_inline("serve", *args)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1 and lines[0].startswith("shardwise: error: ") and message in lines[0]


@pytest.mark.gate
def test_greedy_completions_equal_offline_generate_cli(server):
    prompts = [[5, 6, 7], [40, 41, 300, 12, 99, 7, 250, 3], [200]]
    args = ["generate", "--tp", "2", "--backend", "gloo", "--json", "--ignore-eos", "--max-new-tokens", "12"]
    out = run_cli(*args, *[x for p in prompts for x in ("--prompt-ids", ",".join(map(str, p)))])
    assert out.returncode == 0, out.stderr[-2000:]
    want = json.loads(out.stdout)["text"]
    client = server.client()
    for p, text in zip(prompts, want, strict=True):
        kw = dict(model="default", prompt=p, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
        r = client.completions.create(**kw)
        assert r.choices[0].text == text and r.choices[0].finish_reason == "length"
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(p), 12)
        streamed = "".join(c.choices[0].text for c in client.completions.create(**kw, stream=True) if c.choices)
        assert streamed == text


@pytest.mark.gate
def test_32_concurrent_streams_all_complete_correctly(server, offline):
    import random

    rng = random.Random(0)
    jobs = []
    for i in range(32):
        n = rng.randint(4, 20)
        if i % 4 == 0:
            text = " ".join(
                rng.choice(["the", "layer", "split", "rank", "tensor", "model"]) for _ in range(rng.randint(1, 9))
            )
            jobs.append((text, offline.tokenizer.encode(text).ids, n))
        else:
            ids = [rng.randrange(2, 512) for _ in range(rng.randint(1, 40))]
            jobs.append((ids, ids, n))
    client = server.client()
    steps_before = server.metric("shardwise_step_seconds_count")

    def one(job) -> str:
        prompt, _, n = job
        stream = client.completions.create(
            model="default", prompt=prompt, max_tokens=n, temperature=0, stream=True, extra_body={"ignore_eos": True}
        )
        return "".join(c.choices[0].text for c in stream if c.choices)

    with ThreadPoolExecutor(32) as pool:
        got = list(pool.map(one, jobs, timeout=240))
    for (_, ids, n), text in zip(jobs, got, strict=True):
        assert text == offline(ids, n)
    steps = server.metric("shardwise_step_seconds_count") - steps_before
    assert steps < sum(n for *_, n in jobs) / 2, f"{steps} steps: requests were not batched"
    assert server.metric("shardwise_running_sequences") == 0 and server.metric("shardwise_queue_depth") == 0


@pytest.mark.gate
def test_chat_stream_equals_chat_and_usage(server):
    client = server.client()
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is tensor parallelism?"}]
    kw = dict(model="default", messages=msgs, max_tokens=10, temperature=0)
    full = client.chat.completions.create(**kw)
    assert full.choices[0].message.role == "assistant" and full.usage.completion_tokens <= 10
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].usage.total_tokens == full.usage.total_tokens
    assert [m.id for m in client.models.list().data] == ["default"]


@pytest.mark.gate
def test_stop_strings_and_seeded_sampling(server):
    client = server.client()
    kw = dict(
        model="default", prompt="Tensor parallelism splits each layer", max_tokens=24, extra_body={"ignore_eos": True}
    )
    full = client.completions.create(**kw, temperature=0).choices[0].text
    stop = full[10:13]
    cut = full[: full.index(stop)]
    r = client.completions.create(**kw, temperature=0, stop=[stop])
    assert (r.choices[0].text, r.choices[0].finish_reason) == (cut, "stop")
    streamed = "".join(
        c.choices[0].text for c in client.completions.create(**kw, temperature=0, stop=stop, stream=True)
    )
    assert streamed == cut
    a, b = (client.completions.create(**kw, temperature=1.0, top_p=0.9, seed=7).choices[0].text for _ in range(2))
    assert a == b


BAD = [
    (b'{"prompt": "hi", "max_tokens": 5', 400, "not valid JSON"),
    (b'{"prompt": "hi", "max_tokens": "5"}', 400, "max_tokens: Input should be a valid integer"),
    (b'{"prompt": "hi", "max_tokens": -3}', 400, "max_tokens: Input should be greater than or equal to 1"),
    (b'{"prompt": "hi", "max_tokens": 1000000000}', 400, "over the maximum context length of 512 tokens"),
    (b'{"prompt": "hi", "temperature": "hot"}', 400, "temperature"),
    (b'{"prompt": ""}', 400, "prompt is empty"),
    (b'{"prompt": []}', 400, "prompt is empty"),
    (b'{"prompt": [1, 2, 512]}', 400, r"outside the vocabulary [0, 512): [512]"),
    (b'{"prompt": [[1], [2]]}', 400, "send one request per prompt"),
    (b'{"prompt": "hi", "n": 3}', 400, "n=3 is not supported"),
    (b'{"prompt": "hi", "model": "gpt-4"}', 404, "model 'gpt-4' does not exist"),
    (b'{"prompt": "' + b"a" * (2 << 20) + b'"}', 413, "over the server's limit"),
]


@pytest.mark.gate
@pytest.mark.parametrize("body,status,message", BAD, ids=[f"{s}-{m[:24]}" for _, s, m in BAD])
def test_bad_input_is_answered_on_rank0_before_any_step(server, body, status, message):
    steps, prompt_tokens = server.metric("shardwise_step_seconds_count"), server.metric("shardwise_prompt_tokens_total")
    start = time.monotonic()
    r = httpx.post(
        f"{server.url}/v1/completions", content=body, headers={"content-type": "application/json"}, timeout=30
    )
    assert time.monotonic() - start < 5
    assert r.status_code == status and message in r.json()["error"]["message"], r.text[:300]
    assert server.metric("shardwise_step_seconds_count") == steps, "a bad request reached the engine"
    assert server.metric("shardwise_prompt_tokens_total") == prompt_tokens
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200


def _raw_request(port: int, body: dict) -> socket.socket:
    """Send a POST on a raw socket (closing it is a client that disconnects)."""
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    sock.sendall(head.encode() + data)
    return sock


def _until(cond, seconds: float = 30) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return False


def _resources(pids: list[int]) -> dict[int, tuple[int, int]]:
    """(threads, open descriptors) of each process, from /proc."""
    return {p: (len(os.listdir(f"/proc/{p}/task")), len(os.listdir(f"/proc/{p}/fd"))) for p in pids}


@pytest.mark.gate
def _settled(pids: list[int]) -> dict[int, tuple[int, int]]:
    """The counts once they stop changing (the same over half a second)."""
    now = _resources(pids)
    for _ in range(20):
        time.sleep(0.5)
        now, before = _resources(pids), now
        if now == before:
            break
    return now


def test_a_long_running_server_keeps_its_threads_and_descriptors(server):
    """Rounds of requests, streams and clients that leave mid-stream: the server's and its
    ranks' thread and descriptor counts after the last round equal those after the first."""
    pids = sorted(tagged_pids(server.tag))

    def one_round(i: int) -> None:
        kw = dict(model="default", max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
        client = server.client()  # closed at the end of the round: its pooled connections end too
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda k: client.completions.create(prompt=[5, k + 2], **kw), range(8), timeout=120))
        client.close()
        leaving = [
            _raw_request(server.port, {"prompt": [9, k], "max_tokens": 400, "stream": True, "ignore_eos": True})
            for k in range(4)
        ]
        assert _until(lambda: server.metric("shardwise_running_sequences") >= 1)
        for sock in leaving:
            sock.close()  # clients that leave mid-stream
        assert _until(lambda: server.metric("shardwise_running_sequences") == 0), f"round {i}: slots not freed"

    one_round(0)
    first = _settled(pids)
    for i in range(1, 6):
        one_round(i)

    # NOTE: a left client's socket closes a moment after its sequence is freed, and the HTTP
    # thread's worker threads (anyio's) end after 10 s idle: allow them that
    def no_more() -> bool:
        now = _resources(pids)
        return all(now[p][0] <= first[p][0] and now[p][1] <= first[p][1] for p in pids)

    assert _until(no_more, 20), f"threads and descriptors per process grew over 5 rounds: {first} -> {_resources(pids)}"


def test_full_queue_is_429_disconnect_frees_slot_and_killing_server_kills_ranks(tmp_path):
    # tp=2 on the default backend (MPI where installed): no rank, stand-in or mpiexec outlives the server
    s = Server(tmp_path, "--tp", "2", "--max-batch-size", "1", "--max-queue", "1")
    try:
        long = {"prompt": [5, 6], "max_tokens": 500, "temperature": 0, "ignore_eos": True}
        a = _raw_request(s.port, {**long, "stream": True})
        assert _until(lambda: s.metric("shardwise_running_sequences") == 1)  # a holds the only slot
        assert s.metric('shardwise_kv_blocks{state="used"}') >= 1
        b = _raw_request(s.port, long)  # b waits in the queue
        assert _until(lambda: s.metric("shardwise_queue_depth") == 1)
        start = time.monotonic()
        r = httpx.post(f"{s.url}/v1/completions", json={"prompt": "hi"}, timeout=10)
        assert r.status_code == 429 and "--max-queue 1" in r.json()["error"]["message"]
        assert time.monotonic() - start < 2
        assert httpx.get(f"{s.url}/health", timeout=10).status_code == 200
        a.close()  # a's client leaves: its slot goes to b
        assert _until(lambda: s.metric("shardwise_queue_depth") == 0 and s.metric("shardwise_running_sequences") == 1)
        b.close()  # b's client leaves too (non-streaming): the slot is free again
        assert _until(lambda: s.metric("shardwise_running_sequences") == 0)
        assert _until(lambda: s.metric('shardwise_requests_total{outcome="cancelled"}') == 2)
        assert _until(lambda: s.metric('shardwise_kv_blocks{state="used"}') == 0)  # their blocks went back
        r = httpx.post(f"{s.url}/v1/completions", json={"prompt": "hi", "max_tokens": 3}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 3
        s.proc.send_signal(signal.SIGKILL)  # the server process dies: its ranks follow
        s.proc.wait(10)
        assert wait_gone(tag=s.tag) == [], "ranks outlived the server process"
    finally:
        s.stop()


def _fault_case(s: Server, trigger) -> None:
    """A stream is running when `trigger()` breaks a rank: error event, 503, exit 1, no orphans."""
    client = s.client()
    errors: list[Exception] = []

    def stream() -> None:
        kw = dict(model="default", prompt=[5, 6, 7], max_tokens=400, temperature=0, extra_body={"ignore_eos": True})
        try:
            for _ in client.completions.create(**kw, stream=True):
                pass
        except (openai.APIError, httpx.HTTPError) as e:
            errors.append(e)

    t = threading.Thread(target=stream)
    t.start()
    assert _until(lambda: s.metric("shardwise_running_sequences") == 1)
    start = time.monotonic()
    trigger()
    seen: list[int | None] = []  # /health answers after the fault; None: nothing listens any more
    while time.monotonic() - start < 5 and None not in seen and 503 not in seen:
        try:
            seen.append(httpx.get(f"{s.url}/health", timeout=1).status_code)
        except httpx.TransportError:
            seen.append(None)
        time.sleep(0.05)
    assert 503 in seen, f"/health answered {seen} in the 5 s after the fault"
    t.join(30)
    assert errors and isinstance(errors[0], openai.APIError), f"the stream did not end with an error: {errors}"
    assert s.proc.wait(20) == 1  # within the 10 s collective timeout (plus start-up slack)


def _backend(name: str) -> str:
    if name == "mpi":
        pytest.importorskip("mpi4py")
        from shardwise.launch.mpi import find_mpiexec

        try:
            find_mpiexec()
        except RuntimeError:
            pytest.skip("mpiexec not installed (pip install mpich)")
    return name


@pytest.mark.parametrize("backend", ["gloo", "mpi"])
def test_worker_killed_mid_generation(tmp_path, backend):
    # MPI: mpiexec's proxy would SIGKILL rank 0 too; the rank runs out of its reach (launch.mpi_rank)
    s = Server(tmp_path, "--tp", "2", "--timeout", "10", "--backend", _backend(backend))
    try:
        pids = httpx.get(f"{s.url}/health", timeout=10).json()["pids"]
        _fault_case(s, lambda: os.kill(pids[1], signal.SIGKILL))
        log = s.log.read_text()
        assert f"shardwise: error: rank 1 failed: process {pids[1]} " in log, log[-2000:]
        assert backend != "gloo" or "killed by signal SIGKILL" in log
    finally:
        s.stop()


def test_worker_stopped_mid_generation_on_mpi(tmp_path):
    # The same on gloo: tests/e2e/test_hang_cli.py. Here the heartbeat turns /health 503 (after
    # --health-timeout 1) long before the collective times out (--timeout 6) and ends the server.
    s = Server(tmp_path, "--tp", "2", "--timeout", "6", "--health-timeout", "1", "--backend", _backend("mpi"))
    try:
        pids = httpx.get(f"{s.url}/health", timeout=10).json()["pids"]
        _fault_case(s, lambda: os.kill(pids[1], signal.SIGSTOP))
        log = s.log.read_text()
        assert re.search(r"shardwise: error: rank 1 failed: stuck: never arrived at \w+/tp #", log), log[-2000:]
        assert f"stopped (process {pids[1]}, state T; " in log
    finally:
        s.stop()  # asserts that no rank process remains: the stopped one was killed


def test_worker_raising_mid_generation(tmp_path):
    # the default backend: MPI where installed
    # after 300 steps of the 400-token stream: long enough to see it running first (60 steps,
    # a fraction of a second, sometimes ended the server before the first /metrics poll)
    s = Server(tmp_path, "--tp", "2", "--timeout", "10", "--debug-fail-rank", "1", "--debug-fail-after", "300")
    try:
        _fault_case(s, lambda: None)
        assert "rank 1 failed: RuntimeError: injected failure on rank 1 at step 301" in s.log.read_text()
    finally:
        s.stop()
