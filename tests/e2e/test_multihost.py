"""Two hosts simulated on this machine, as docs/multihost.md runs two real ones: torchrun
with --nnodes 2 (two agents meeting at a c10d rendezvous on 127.0.0.1, so each rank gets a
genuine node rank), and mpiexec (hydra) with two host entries it forks locally
(`-launcher fork -hosts hostA,hostB`). A tp group across the hosts is refused with one line
per host before any model loads, and runs with --allow-cross-host-tp; training at
tp=2 x pp=2 and tp=2 x dp=2 keeps each tp group on one host and loses exactly what one
process does."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from processes import process_tag, run_cli, wait_gone
from shardwise.checkpoint import CheckpointReader
from shardwise.launch import free_port
from train_helpers import TINY_MODEL, write_tiny_tokens

STEPS = 4
LOSS_TOL = 2e-5  # as tests/multiproc/test_train_equivalence.py
REFUSED = "shardwise: error: tp=2: the tp group of ranks 0-1 spans hosts "
GENERATE = ["generate", "--tp", "2", "--backend", "gloo", "--max-new-tokens", "6", "--json"]


def _env(tag: dict[str, str]) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path), **tag}


def _finish(procs: list[subprocess.Popen], files: list[tuple[Path, Path]], tag) -> list[dict]:
    try:
        codes = [p.wait(timeout=300) for p in procs]
    finally:
        for p in procs:
            p.kill()  # no-op for an exited one
    assert wait_gone(tag=tag) == [], "orphan rank processes remain"
    return [{"code": c, "out": o.read_text(), "err": e.read_text()} for c, (o, e) in zip(codes, files, strict=True)]


def _two_torchrun_hosts(tmp: Path, per_host: int, *args: str) -> list[dict]:
    """`torchrun --nnodes 2 -m shardwise *args` as two agents (two simulated hosts); each
    agent's exit code, stdout and stderr."""
    torchrun = Path(sys.executable).parent / "torchrun"
    if not torchrun.exists():
        pytest.skip("torchrun not installed")
    rdzv = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", "multihost"]
    cmd = [str(torchrun), "--nnodes", "2", "--nproc-per-node", str(per_host), *rdzv, "-m", "shardwise", *args]
    tag = process_tag()
    files = [(tmp / f"host{i}.out", tmp / f"host{i}.err") for i in range(2)]
    procs = [subprocess.Popen(cmd, stdout=o.open("w"), stderr=e.open("w"), env=_env(tag), cwd=tmp) for o, e in files]
    return _finish(procs, files, tag)


def _hydra_two_hosts(tmp: Path, per_host: int, *args: str) -> dict:
    """`mpiexec -launcher fork -hosts hostA,hostB -ppn N python -m shardwise *args`."""
    pytest.importorskip("mpi4py")
    from shardwise.launch.mpi import find_mpiexec

    try:
        mpiexec = find_mpiexec()
    except RuntimeError:
        pytest.skip("mpiexec not installed")
    hosts = ["-launcher", "fork", "-hosts", "hostA,hostB", "-ppn", str(per_host), "-n", str(2 * per_host)]
    tag = process_tag()
    files = [(tmp / "mpi.out", tmp / "mpi.err")]
    cmd = [mpiexec, *hosts, sys.executable, "-m", "shardwise", *args]
    proc = subprocess.Popen(cmd, stdout=files[0][0].open("w"), stderr=files[0][1].open("w"), env=_env(tag), cwd=tmp)
    return _finish([proc], files, tag)[0]


def _json_of(runs: list[dict]) -> dict:
    """Rank 0's JSON line: on whichever agent the rendezvous made node 0."""
    lines = [line for r in runs for line in r["out"].splitlines() if line.startswith("{")]
    assert len(lines) == 1, runs
    return json.loads(lines[0])


def test_generate_refuses_a_tp_group_across_two_torchrun_hosts_unless_allowed(tmp_path):
    runs = _two_torchrun_hosts(tmp_path, 1, *GENERATE)
    name = socket.gethostname()
    for r in runs:  # each host's terminal shows the reason once, and no model was loaded
        assert r["code"] != 0
        refused = [line for line in r["err"].splitlines() if line.startswith("shardwise: error:")]
        assert refused == [
            f"{REFUSED}{name}:node0 (rank 0) and {name}:node1 (rank 1); ranks are laid out tp-fastest, so each host "
            f"needs a multiple of 2 consecutive ranks, and {name}:node0 has 1, {name}:node1 has 1; tp sizes that "
            "stay inside a host: 1; start 2 ranks (or a multiple) per host, use one of those, or pass "
            "--allow-cross-host-tp (every layer then all-reduces across hosts)"
        ], r["err"][-3000:]
        assert "loading" not in r["err"].lower() and r["out"] == ""

    runs = _two_torchrun_hosts(tmp_path, 1, *GENERATE, "--allow-cross-host-tp")
    assert [r["code"] for r in runs] == [0, 0], [r["err"][-3000:] for r in runs]
    assert any("tp groups span hosts (--allow-cross-host-tp)" in r["err"] for r in runs)
    across = _json_of(runs)
    local = run_cli("generate", "--tp", "1", "--max-new-tokens", "6", "--json")
    assert local.returncode == 0, local.stderr
    assert across["tp"] == 2 and across["tokens"] == json.loads(local.stdout)["tokens"]


def _toml(tmp: Path, tokens: Path, layout: dict[str, int], backend: str) -> Path:
    model = "\n".join(f"{k} = {v}" for k, v in TINY_MODEL.items())
    parallel = "\n".join(f"{k} = {v}" for k, v in layout.items())
    path = tmp / "train.toml"
    path.write_text(f"""
[model]
{model}

[data]
tokens = "{tokens}"
seq_len = 32
global_batch_size = 8
microbatches = 4

[optim]
lr = 1e-2
warmup_steps = 2

[parallel]
{parallel}
backend = "{backend}"

[run]
steps = {STEPS}
out_dir = "{tmp / "run"}"
progress = false
""")
    return path


def _check_losses(config: Path, summary: dict) -> None:
    """The job's losses (its checkpoint's history) equal one process's at tp = pp = dp = 1."""
    from shardwise.comm import LocalCommunicator
    from shardwise.train import TrainConfig, setup, train_step

    losses = [loss for _, loss in CheckpointReader(summary["checkpoint"]).manifest.extra["history"]]
    cfg = TrainConfig.from_toml(config).replace(parallel={"tp": 1, "pp": 1, "dp": 1})
    tr = setup(LocalCommunicator(), cfg)
    ref = [train_step(tr).loss for _ in range(STEPS)]
    assert max(abs(a - b) for a, b in zip(losses, ref, strict=True)) < LOSS_TOL, (losses, ref)


def test_train_tp2_pp2_across_two_torchrun_hosts(tmp_path):
    tokens = write_tiny_tokens(tmp_path / "tokens.safetensors")
    config = _toml(tmp_path, tokens, {"tp": 2, "pp": 2, "dp": 1}, "gloo")
    runs = _two_torchrun_hosts(tmp_path, 2, "train", "--config", str(config), "--json")
    assert [r["code"] for r in runs] == [0, 0], [r["err"][-3000:] for r in runs]
    name = socket.gethostname()
    hosts = f"2 hosts: {name}:node0 (ranks 0-1), {name}:node1 (ranks 2-3); every tp=2 group inside one host"
    assert sum(hosts in r["err"] for r in runs) == 1, "rank 0 names the hosts"
    summary = _json_of(runs)
    assert (summary["tp"], summary["pp"], summary["dp"], summary["steps_run"]) == (2, 2, 1, STEPS)
    _check_losses(config, summary)


def test_mpiexec_two_hydra_hosts_train_tp2_dp2_and_refuse_tp_across(tmp_path):
    tokens = write_tiny_tokens(tmp_path / "tokens.safetensors")
    config = _toml(tmp_path, tokens, {"tp": 2, "pp": 1, "dp": 2}, "mpi")
    run = _hydra_two_hosts(tmp_path, 2, "train", "--config", str(config), "--json")
    assert run["code"] == 0, run["err"][-3000:]
    assert "2 hosts: hostA (ranks 0-1), hostB (ranks 2-3); every tp=2 group inside one host" in run["err"]
    summary = _json_of([run])
    assert (summary["tp"], summary["pp"], summary["dp"], summary["backend"]) == (2, 1, 2, "mpi")
    _check_losses(config, summary)

    run = _hydra_two_hosts(tmp_path, 1, "generate", "--tp", "2", "--backend", "mpi")
    assert run["code"] != 0
    refused = [line for line in run["err"].splitlines() if line.startswith("shardwise: error:")]
    assert len(refused) == 1, "mpiexec gathers every rank's output: rank 0 prints the reason"
    assert refused[0].startswith(f"{REFUSED}hostA (rank 0) and hostB (rank 1);")
