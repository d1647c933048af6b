"""The console script as a user runs it."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest


def _shardwise(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "shardwise", *args], capture_output=True, text=True, timeout=300, check=False
    )


@pytest.mark.parametrize("tp", [2, 4])
def test_demo_passes_and_reports_errors_and_counts(tp):
    out = _shardwise("demo", "--tp", str(tp))
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"PASS: tp={tp} matches the unsharded model" in out.stdout
    errors = [float(m) for m in re.findall(r"(\d\.\d\de[-+]\d\d)  ok", out.stdout)]
    assert len(errors) == 3 and max(errors) < 1e-4
    assert "one transformer block, forward : all_reduce/tp x2" in out.stdout
    assert "one transformer block, backward: all_reduce/tp x2" in out.stdout
    assert len(re.search(r"parameter MiB per rank: ([\d., ]+)", out.stdout).group(1).split(",")) == tp


def test_demo_refuses_invalid_tp_before_starting_ranks():
    out = _shardwise("demo", "--tp", "3")
    assert out.returncode == 2
    assert "valid tp sizes: 1, 2, 4, 8" in out.stderr
    assert "PASS" not in out.stdout


def test_version():
    out = _shardwise("--version")
    assert out.returncode == 0 and out.stdout.startswith("shardwise ")
