"""What `shardwise serve` costs beyond the model's forward: measured on the built-in tiny model.

A server step is the model's forward plus rank 0's own work: scheduling, building the
step, sampling, streaming tokens to clients through the HTTP thread (which shares the
interpreter with the engine loop). A request adds its HTTP round trip, tokenizing and
answering. On the tiny built-in model the forward takes about a millisecond, so the
server's own costs dominate and can be read off three runs of one tp=1 server:

    a  1 client, requests of 2 tokens       per request: request + prefill + 1 step
    b  1 client, requests of 1 + N tokens   per request: request + prefill + N steps
    c  16 clients at once, 1 + N tokens     wall: request + prefill(16) + N steps of 16 rows

with the tiny model's own forward (batch 1 and 16) timed in this process and taken out:

    step_us    = (b - a) / (N - 1) - forward(1)
    request_us = a - step_us - forward(1) - prefill(1)
    row_us     = ((c - request - prefill(16)) / N - step - forward(16)) / 15

The planner adds step_us + rows x row_us to each serving step (on the first stage at pp > 1)
and request_us to each request (shardwise.planner.predict, serving_tokens_per_s).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

__all__ = ["serving_overheads"]

TOKENS = 33  # 1 + N tokens per request in runs b and c
CLIENTS = 16


def _forward_ms(batch: int, tokens: int, repeats: int = 20) -> float:
    """The tiny model's forward at `batch` rows of `tokens` new tokens (ms, the fastest)."""
    import torch

    from shardwise.comm import LocalCommunicator
    from shardwise.engine.text import DEFAULT_MODEL
    from shardwise.hf import load_pretrained

    torch.set_num_threads(1)
    model, _ = load_pretrained(DEFAULT_MODEL, comm=LocalCommunicator())
    caches = model.new_caches(batch, 64 + tokens)
    ids = torch.ones(batch, tokens, dtype=torch.long)
    best = float("inf")
    with torch.no_grad():
        for _ in range(repeats):
            t0 = time.perf_counter()
            model(ids, caches=caches, start=32, last_only=True)[:, -1].argmax(-1)
            best = min(best, time.perf_counter() - t0)
    return best * 1e3


def _requests(url: str, clients: int, per_client: int, max_tokens: int) -> float:
    """Seconds per request (1 client) or the wall time of the run (several)."""
    import httpx

    def client(i: int) -> None:
        with httpx.Client(timeout=120) as http:
            for j in range(per_client):
                body = {"prompt": [5 + i, 6 + j, 7, 8], "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
                http.post(f"{url}/v1/completions", json=body).raise_for_status()

    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(client, range(clients)))
    wall = time.perf_counter() - t0
    return wall / per_client if clients == 1 else wall


def serving_overheads(rounds: int = 3, log=None) -> dict[str, float] | None:
    """{"step_us", "row_us", "request_us"} of this host's server, or None when the server's
    dependencies (fastapi, uvicorn, httpx) are missing or it does not start."""
    try:
        import fastapi  # noqa: F401
        import httpx
        import uvicorn  # noqa: F401
    except ImportError:
        return None
    from shardwise.engine.text import DEFAULT_MODEL
    from shardwise.launch import free_port

    port = free_port()
    cmd = [sys.executable, "-m", "shardwise", "serve", "--model", str(DEFAULT_MODEL), "--tp", "1", "--port", str(port)]
    cmd += ["--max-batch-size", str(CLIENTS)]
    proc = subprocess.Popen(
        cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                return None
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        _requests(url, 1, 2, 4)  # warm-up
        a = min(_requests(url, 1, 6, 2) for _ in range(rounds))
        b = min(_requests(url, 1, 3, TOKENS) for _ in range(rounds))
        c = min(_requests(url, CLIENTS, 1, TOKENS) for _ in range(rounds))
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    f1, f16 = _forward_ms(1, 1) / 1e3, _forward_ms(CLIENTS, 1) / 1e3
    p1, p16 = _forward_ms(1, 4) / 1e3, _forward_ms(CLIENTS, 4) / 1e3
    n = TOKENS - 1
    step = max(0.0, (b - a) / (n - 1) - f1)
    request = max(0.0, a - step - f1 - p1)
    row = max(0.0, ((c - request - p16) / n - step - f16) / (CLIENTS - 1))
    out = {"step_us": step * 1e6, "row_us": row * 1e6, "request_us": request * 1e6}
    if log is not None:
        log(f"calibrating: server overheads {', '.join(f'{k} {v:.0f}' for k, v in out.items())}")
    return out


if __name__ == "__main__":
    print(serving_overheads(log=lambda m: print(m, file=sys.stderr)))
