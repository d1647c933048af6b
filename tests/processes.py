"""Subprocesses as a user starts them, and the processes they leave behind.

out = run_cli("generate", "--tp", "2", "--json")   # python -m shardwise ..., captured
out = run_cli_inline("generate", "--tp", "3")       # the same, in this process: no rank may start
tag = process_tag()                                # an env entry inherited by every rank
assert wait_gone(tag=tag) == [], "orphan rank processes remain"
"""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

__all__ = ["run_cli", "run_cli_inline", "process_tag", "tagged_pids", "alive", "wait_gone"]


def run_cli(*args: str | Path, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python -m shardwise *args` with one compute thread per process; stdout and stderr as text."""
    return subprocess.run(
        [sys.executable, "-m", "shardwise", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
    )


def run_cli_inline(*args: str | Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`shardwise *args` inside this process, for a command that answers or refuses before any
    rank starts (bad input, `info`, `plan`, `--version`): the same parser, checks and messages
    as run_cli, without a new interpreter importing torch for each case (about 2 s here).
    Starting ranks fails the test: every command starts them through cli.common.run_job."""
    from unittest import mock

    from shardwise.cli import common
    from shardwise.cli.main import main

    def no_ranks(*_, **__):
        raise AssertionError(f"`shardwise {' '.join(map(str, args))}` started ranks; test it with run_cli")

    out, err = io.StringIO(), io.StringIO()
    with (
        mock.patch.object(common, "run_job", no_ranks),
        mock.patch.dict(os.environ, env or {}),
        contextlib.redirect_stdout(out),
        contextlib.redirect_stderr(err),
    ):
        try:
            code = main([str(a) for a in args])
        except SystemExit as e:  # argparse, CliError
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return subprocess.CompletedProcess(["shardwise", *map(str, args)], code or 0, out.getvalue(), err.getvalue())


def process_tag() -> dict[str, str]:
    """A unique environment entry: a command started with it passes it to every rank it starts."""
    return {"SHARDWISE_TEST_TAG": str(uuid.uuid4())}


def tagged_pids(tag: dict[str, str]) -> list[int]:
    """Live processes whose environment holds `tag`."""
    entries = [f"{k}={v}".encode() for k, v in tag.items()]
    pids = []
    for proc in Path("/proc").iterdir():
        with contextlib.suppress(OSError):
            if proc.name.isdigit() and all(e in (proc / "environ").read_bytes() for e in entries):
                pids.append(int(proc.name))
    return pids


def alive(pid: int) -> bool:
    """True for a running process; False for a reaped one or a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def wait_gone(*, pids: Sequence[int] = (), tag: dict[str, str] | None = None, within_s: float = 10.0) -> list[int]:
    """Wait until the processes `pids`, and those tagged with `tag`, are gone; those still alive after within_s."""

    def survivors() -> list[int]:
        return [p for p in pids if alive(p)] + (tagged_pids(tag) if tag else [])

    deadline = time.monotonic() + within_s
    while survivors() and time.monotonic() < deadline:
        time.sleep(0.05)
    return survivors()
