"""The console script as a user runs it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from processes import run_cli, run_cli_inline


@pytest.mark.parametrize("tp", [pytest.param(2, marks=pytest.mark.smoke), 4])  # tp=2: the CLI smoke of test-fast
def test_demo_passes_and_reports_errors_and_counts(tp):
    out = run_cli("demo", "--tp", str(tp))
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"PASS: tp={tp} matches the unsharded model" in out.stdout
    errors = [float(m) for m in re.findall(r"(\d\.\d\de[-+]\d\d)  ok", out.stdout)]
    assert len(errors) == 3 and max(errors) < 1e-4
    assert "one transformer block, forward : all_reduce/tp x2" in out.stdout
    assert "one transformer block, backward: all_reduce/tp x2" in out.stdout
    assert len(re.search(r"parameter MiB per rank: ([\d., ]+)", out.stdout).group(1).split(",")) == tp


def test_demo_runs_under_torchrun():
    """demo goes through run_job like every command: torchrun's ranks join, rank 0 reports."""
    torchrun = Path(sys.executable).parent / "torchrun"
    if not torchrun.exists():
        pytest.skip("torchrun not installed")
    cmd = [str(torchrun), "--standalone", "--nproc-per-node", "2", "-m", "shardwise", "demo", "--tp", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run([*cmd, "--backend", "gloo"], capture_output=True, text=True, timeout=300, check=False, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("PASS: tp=2 matches the unsharded model") == 1, "rank 0 reports, once"
    assert "sharded over tp=2 ranks (gloo)" in out.stdout


@pytest.mark.gate
def test_demo_refuses_invalid_tp_before_starting_ranks():
    out = run_cli_inline("demo", "--tp", "9")
    assert out.returncode == 2
    assert "tp=9 is more than the model's num_attention_heads=8" in out.stderr and "valid tp sizes: 1-8" in out.stderr
    assert "PASS" not in out.stdout


@pytest.mark.gate
def test_version():
    out = run_cli_inline("--version")
    assert out.returncode == 0 and out.stdout.startswith("shardwise ")


@pytest.mark.gate
def test_info_describes_the_plan_without_starting_ranks():
    import json

    out = run_cli_inline("info", "--tp", "2", "--json")
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    by_name = {t["name"]: t for t in info["tensors"]}
    qkv = by_name["layers.0.attn.qkv.weight"]
    assert qkv["global_shape"] == [512, 256] and qkv["local_shape"] == [256, 256]
    assert qkv["split"] == "dim 0: [0:128] + [256:320] + [384:448]"  # 4 of 8 q heads, 2 of 4 k and v heads
    assert by_name["norm.weight"]["split"] == "replicated"
    assert info["bytes_per_rank"] < 0.51 * info["bytes_unsharded"]
    assert info["collectives"]["decode_step"]["all_reduce/tp"]["calls"] == 9  # 4 layers x 2 + embedding
    human = run_cli_inline("info", "--tp", "4")
    assert human.returncode == 0 and "parameters per rank:" in human.stdout
    uneven = json.loads(run_cli_inline("info", "--tp", "3", "--json").stdout)  # 8 / 4 KV heads over 3 ranks
    qkv = {t["name"]: t for t in uneven["tensors"]}["layers.0.attn.qkv.weight"]
    assert qkv["split"] == "dim 0: [0:96] + [256:320] + [384:448]"  # q heads 0-2 and the KV heads 0-1 they use
    assert uneven["balance"]["query_heads"] == [3, 3, 2] and uneven["balance"]["even"] is False


@pytest.mark.gate
def test_info_refuses_invalid_tp():
    out = run_cli_inline("info", "--tp", "16")
    assert out.returncode == 2
    assert (
        out.stderr.strip()
        == "shardwise: error: tp=16 is more than the model's num_attention_heads=8: every rank needs a query head; "
        "valid tp sizes: 1-8"
    )


def test_bench_comm_reports_every_available_backend():
    import json

    out = run_cli("bench", "comm", "--sizes", "4096,65536", "--repeats", "10", "--json")
    assert out.returncode == 0, out.stderr
    points = json.loads(out.stdout)["points"]
    backends = {p["backend"] for p in points}
    assert "gloo" in backends
    assert len(points) == 2 * len(backends)
    assert all(p["latency_us"] > 0 and p["busbw_gbps"] > 0 and p["world_size"] == 2 for p in points)
