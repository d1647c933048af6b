"""Hosts as network namespaces on this machine (shardwise.bench.netns): links shaped with tbf,
torchrun and mpiexec (hydra) with each rank in its host's namespace, and a host's link cut
while a job decodes or trains. Skipped, with the reason, where namespaces cannot be made
(not root, no iproute2)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from processes import run_cli
from shardwise.bench import netns
from train_helpers import TINY_MODEL, write_tiny_tokens

WHY = netns.unavailable()
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"no network namespaces here: {WHY}")

TORCHRUN = str(Path(sys.executable).parent / "torchrun")
GENERATE = ["-m", "shardwise", "generate", "--backend", "gloo", "--max-new-tokens", "8", "--json"]
STEPS = 4
LOSS_TOL = 2e-5  # as tests/e2e/test_multihost.py


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}


def _finish(cluster: netns.Cluster, procs: list[subprocess.Popen], timeout: float = 300) -> list[dict]:
    """Each launcher's exit code, stdout and stderr; and no process is left on any host."""
    outs = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
            err += f"\n(test: killed after {timeout} s)"
        outs.append({"code": p.returncode, "out": out, "err": err})
    for _ in range(100):
        left = {h.name: h.pids() for h in cluster.hosts if h.pids()}
        if not left:
            break
        time.sleep(0.1)
    assert not left, f"orphan processes on the hosts: {left}"
    return outs


def _torchrun(cluster: netns.Cluster, per_host: int, argv: list[str], timeout: float = 300) -> list[dict]:
    procs = cluster.torchrun(
        TORCHRUN, per_host, argv, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    return _finish(cluster, procs, timeout)


def _json_of(runs: list[dict]) -> dict:
    lines = [line for r in runs for line in r["out"].splitlines() if line.startswith("{")]
    assert len(lines) == 1, [r["err"][-2000:] for r in runs]
    return json.loads(lines[0])


def _tx(cluster: netns.Cluster, before: dict[str, int]) -> dict[str, int]:
    return {k: v - before[k] for k, v in cluster.tx_bytes().items()}


@pytest.mark.gate
def test_links_are_shaped_named_counted_and_torn_down():
    with netns.make_hosts(2, "100mbit") as cluster:
        h0, h1 = cluster.hosts
        seen = h1.run(["sh", "-c", "hostname; getent hosts host0"], capture_output=True, text=True, check=True)
        assert seen.stdout.split() == ["host1", "10.201.0.1", "host0"]
        before = cluster.tx_bytes()
        bps = netns.probe(h0, h1, 1.0)
        assert 80e6 < bps < 105e6, f"100mbit link carried {bps / 1e6:.1f} Mbit/s"
        sent = _tx(cluster, before)
        assert sent["host0"] > bps / 8 * 0.9 and sent["host1"] < sent["host0"] / 10, sent
        cluster.cut(1)
        down = h0.run([sys.executable, "-c", "import socket; socket.create_connection(('host1', 9), timeout=1)"])
        assert down.returncode != 0, "host1 reachable with its link down"
        sleeper = h1.popen(["sleep", "600"])
        names = [h.netns for h in cluster.hosts] + [cluster.switch]
        rsh = cluster.rsh
    assert sleeper.wait(timeout=10) != 0, "close() kills what runs on a host"
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(n in listed for n in names), listed
    assert not any(Path(f"/etc/netns/{n}").exists() for n in names) and not Path(rsh).exists()

    dead = subprocess.Popen(["true"])
    dead.wait()  # a pid whose process is gone: its namespaces are stale
    stale = f"{netns.PREFIX}{dead.pid}c0h0"
    subprocess.run(["ip", "netns", "add", stale], check=True)
    assert stale in netns.cleanup_stale()
    assert stale not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


@pytest.mark.gate
def test_bad_rate_and_host_count_are_refused_before_anything_is_made():
    with pytest.raises(ValueError, match=r"rate '1 gig': expected a number and kbit, mbit or gbit"):
        netns.make_hosts(2, "1 gig")
    with pytest.raises(ValueError, match=r"hosts: 5; between 1 and 4"):
        netns.make_hosts(5)


def test_torchrun_across_two_namespace_hosts_generates_the_tokens_of_tp1(tmp_path):
    local = run_cli("generate", "--tp", "1", "--max-new-tokens", "8", "--json")
    assert local.returncode == 0, local.stderr
    with netns.make_hosts(2, "1gbit") as cluster:
        before = cluster.tx_bytes()
        runs = _torchrun(cluster, 1, [*GENERATE, "--tp", "2", "--allow-cross-host-tp"])
        sent = _tx(cluster, before)
    assert [r["code"] for r in runs] == [0, 0], [r["err"][-3000:] for r in runs]
    assert any("2 hosts: host0:node0 (rank 0), host1:node1 (rank 1)" in r["err"] for r in runs)
    across = _json_of(runs)
    assert across["tokens"] == json.loads(local.stdout)["tokens"]
    # every layer's all-reduces cross the link: both hosts send (hidden 256 fp32 = 1 KiB per
    # token per all-reduce, 11 a token, over 8 tokens and the prompt) and more than the rendezvous
    assert min(sent.values()) > 11 * 8 * 1024, sent


def _toml(tmp: Path, layout: dict[str, int], backend: str, *, steps: int = STEPS, every: int = 0) -> Path:
    tokens = write_tiny_tokens(tmp / "tokens.safetensors")
    model = "\n".join(f"{k} = {v}" for k, v in TINY_MODEL.items())
    parallel = "\n".join(f"{k} = {v}" for k, v in layout.items())
    save = f"save_every = {every}\n" if every else ""
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
steps = {steps}
out_dir = "{tmp / "run"}"
progress = false
{save}""")
    return path


def _check_losses(config: Path, summary: dict) -> None:
    """The job's losses (its checkpoint's history) equal one process's at tp = pp = dp = 1."""
    from shardwise.checkpoint import CheckpointReader
    from shardwise.comm import LocalCommunicator
    from shardwise.train import TrainConfig, setup, train_step

    losses = [loss for _, loss in CheckpointReader(summary["checkpoint"]).manifest.extra["history"]]
    cfg = TrainConfig.from_toml(config).replace(parallel={"tp": 1, "pp": 1, "dp": 1})
    tr = setup(LocalCommunicator(), cfg)
    ref = [train_step(tr).loss for _ in range(STEPS)]
    assert max(abs(a - b) for a, b in zip(losses, ref, strict=True)) < LOSS_TOL, (losses, ref)


def test_train_tp2_pp2_across_two_namespace_hosts_with_torchrun(tmp_path):
    config = _toml(tmp_path, {"tp": 2, "pp": 2, "dp": 1}, "gloo")
    with netns.make_hosts(2, "1gbit") as cluster:
        before = cluster.tx_bytes()
        runs = _torchrun(cluster, 2, ["-m", "shardwise", "train", "--config", str(config), "--json"])
        sent = _tx(cluster, before)
    assert [r["code"] for r in runs] == [0, 0], [r["err"][-3000:] for r in runs]
    hosts = "2 hosts: host0:node0 (ranks 0-1), host1:node1 (ranks 2-3); every tp=2 group inside one host"
    assert sum(hosts in r["err"] for r in runs) == 1
    summary = _json_of(runs)
    assert (summary["tp"], summary["pp"], summary["steps_run"]) == (2, 2, STEPS)
    _check_losses(config, summary)
    # stage 0 sends activations (4 micro-batches of 2 x 32 x 64 fp32 = 16 KiB, per tp rank,
    # per step), stage 1 their gradients: both directions carry at least that
    assert min(sent.values()) > STEPS * 4 * 16 * 1024, sent


def test_mpiexec_across_two_namespace_hosts_trains_tp2_dp2(tmp_path):
    pytest.importorskip("mpi4py")
    from shardwise.launch.mpi import find_mpiexec

    config = _toml(tmp_path, {"tp": 2, "pp": 1, "dp": 2}, "mpi")
    argv = [sys.executable, "-m", "shardwise", "train", "--config", str(config), "--json"]
    with netns.make_hosts(2, "1gbit") as cluster:
        before = cluster.tx_bytes()
        proc = cluster.mpiexec(
            find_mpiexec(), 2, argv, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        run = _finish(cluster, [proc])[0]
        sent = _tx(cluster, before)
    assert run["code"] == 0, run["err"][-3000:]
    assert "2 hosts: host0 (ranks 0-1), host1 (ranks 2-3); every tp=2 group inside one host" in run["err"]
    summary = _json_of([run])
    assert (summary["tp"], summary["dp"], summary["backend"]) == (2, 2, "mpi")
    _check_losses(config, summary)
    # the dp all-reduce of the gradients crosses the link once a step: each tp rank's half of
    # the parameters (about 35k fp32) each way; more than that, not a shared-memory shortcut
    assert min(sent.values()) > STEPS * 35_000 * 4 / 2, sent


def _ranks_exit_after_cut(cluster: netns.Cluster, *, agent: int) -> None:
    """After host 1's link went down: its rank times out too and exits (its board, on host 0,
    unreachable: bounded reads) within 30 s, and nothing is left on host 0. torchrun's own
    agent on host 1 (`agent`) waits for its rendezvous on host 0: the cluster's close() ends it."""
    deadline = time.monotonic() + 30
    while [p for p in cluster.hosts[1].pids() if p != agent] and time.monotonic() < deadline:
        time.sleep(0.5)
    left = [p for p in cluster.hosts[1].pids() if p != agent]
    assert left == [], f"host1's rank processes still running 30 s after the cut: {left}"
    assert cluster.hosts[0].pids() == []


def _wait_for_text(proc: subprocess.Popen, timeout: float) -> None:
    """Until the job's stdout shows text after the echoed prompt (generate streams the tokens
    as they come): the ranks have loaded and decode. A fixed sleep cut the link during
    loading on a busy machine."""
    import select

    from shardwise.cli.generate import DEFAULT_PROMPT

    fd, deadline, text = proc.stdout.fileno(), time.monotonic() + timeout, b""
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.5)
        if ready:
            text += os.read(fd, 4096)
            _, echoed, after = text.decode(errors="replace").partition(DEFAULT_PROMPT)
            if echoed and after.strip():
                return
        assert proc.poll() is None, f"the job ended before it decoded: {text[-2000:]!r}"
    pytest.fail(f"no streamed text within {timeout} s: {text[-2000:]!r}")


def test_a_host_cut_off_during_decode_is_named_and_its_rank_exits():
    argv = ["-m", "shardwise", "generate", "--tp", "2", "--backend", "gloo", "--max-new-tokens", "450"]
    argv += ["--allow-cross-host-tp", "--timeout", "5"]
    with netns.make_hosts(2, "1gbit") as cluster:
        procs = cluster.torchrun(
            TORCHRUN, 1, argv, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        seen = []
        for line in procs[0].stderr:  # up to the rendezvous' cross-host warning: then it loads and decodes
            seen.append(line)
            if "spans hosts" in line:
                break
        # loaded and decoding: the first tokens streamed (450 take 1-1.5 s over the tcp collectives)
        _wait_for_text(procs[0], 120)
        cluster.cut(1)
        _, err = procs[0].communicate(timeout=60)
        err = "".join(seen) + err
        assert procs[0].returncode != 0
        # decode's collectives are the layers' all-reduces and the logits' all-gather: the cut
        # lands in either (CI once caught it in the all-gather)
        stuck = r"shardwise: error: rank 1 failed: stuck: never arrived at all_(reduce|gather)/tp #\d+"
        assert re.search(stuck, err), err[-3000:]
        assert " on host1; no heartbeat for " in err, err[-3000:]
        _ranks_exit_after_cut(cluster, agent=procs[1].pid)
    procs[1].wait(timeout=10)


def test_a_host_cut_off_during_training_is_named_and_the_checkpoint_stays_intact(tmp_path):
    """pp=2 across two hosts, a checkpoint every 2 steps: host 1's link goes down once one is
    committed. The job ends naming rank 1 on host1, no process is left on either host, and
    `latest` names a complete checkpoint that verifies (sizes and SHA-256) and resumes."""
    from shardwise.checkpoint import CheckpointReader

    config = _toml(tmp_path, {"tp": 1, "pp": 2, "dp": 1}, "gloo", steps=100_000, every=2)
    argv = ["-m", "shardwise", "train", "--config", str(config), "--timeout", "5", "--no-progress"]
    root = tmp_path / "run" / "checkpoints"
    with netns.make_hosts(2, "1gbit") as cluster:
        procs = cluster.torchrun(
            TORCHRUN, 1, argv, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        deadline = time.monotonic() + 120
        while not (root / "latest").is_file() and time.monotonic() < deadline and procs[0].poll() is None:
            time.sleep(0.2)
        assert (root / "latest").is_file(), "no checkpoint was committed within 120 s"
        time.sleep(0.5)  # mid-run, possibly mid-save: whatever is committed must stay whole
        t_cut = time.monotonic()
        cluster.cut(1)
        _, err = procs[0].communicate(timeout=60)
        took = time.monotonic() - t_cut
        _ranks_exit_after_cut(cluster, agent=procs[1].pid)
    procs[1].wait(timeout=10)
    assert procs[0].returncode != 0
    assert "shardwise: error: rank 1 failed" in err and "host1" in err, err[-3000:]
    assert took < 30, f"the job took {took:.0f} s to end after the cut (--timeout 5)"
    reader = CheckpointReader(root)  # what `latest` names
    reader.verify()  # every rank file's size and SHA-256 as its sidecar recorded
    step = reader.manifest.step
    assert step >= 2 and step % 2 == 0, step
    assert not [p for p in root.iterdir() if p.name.startswith(".tmp") and (p / "manifest.json").exists()]
    # it resumes: one process, from the checkpoint the cut left
    out = run_cli("train", "--config", str(config), "--tp", "1", "--pp", "1", "--steps", str(step + 1),
                  "--resume", str(root), "--json", "--no-progress")  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1])["steps_run"] == 1


def _mpiexec_cut() -> tuple[int, str, str, dict, float]:
    """host1's link cut under an mpiexec decode: (exit code, everything printed, what came
    after the cut, processes left on the hosts, seconds the job took to end). MPI decodes
    this model at about 1.5 ms a token here, so the link goes down as the first streamed
    text arrives."""
    pytest.importorskip("mpi4py")
    from shardwise.launch.mpi import find_mpiexec

    argv = [sys.executable, "-m", "shardwise", "generate", "--tp", "2", "--backend", "mpi"]
    argv += ["--max-new-tokens", "450", "--allow-cross-host-tp", "--timeout", "5"]
    with netns.make_hosts(2, "1gbit") as cluster:
        proc = cluster.mpiexec(
            find_mpiexec(), 1, argv, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        seen = []
        for line in proc.stdout:  # the link's measurement, then the streamed text
            seen.append(line)
            if "spans hosts" in line:
                break
        t_cut = time.monotonic()
        cluster.cut(1)
        try:
            out, _ = proc.communicate(timeout=90)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
            pytest.fail(f"mpiexec still running 90 s after the cut: {out[-3000:]}")
        took = time.monotonic() - t_cut
        deadline = time.monotonic() + 30
        while any(h.pids() for h in cluster.hosts) and time.monotonic() < deadline:
            time.sleep(0.5)
        left = {h.name: h.pids() for h in cluster.hosts if h.pids()}
    return proc.returncode, "".join(seen) + out, out, left, took


def test_a_host_cut_off_during_an_mpiexec_decode_ends_the_job_named():
    """The same cut under mpiexec (hydra: a proxy per host, reached through rsh): the job
    ends with the rank and its host named, and no process is left on either host. Once in
    seven runs (2026-12-06, inside `make test-more`, after the training cut) the job ended
    non-zero with nothing at all after the cut on mpiexec's output, rank 0's error not
    among it; not reproduced in 6 runs alone. That case, and only it, runs once more; every
    assertion holds on the run that is judged."""
    code, err, out, left, took = _mpiexec_cut()
    if code != 0 and not out.strip():
        code, err, out, left, took = _mpiexec_cut()
    assert code != 0, err[-3000:]
    assert "tokens, prefill" not in err, "the decode finished before the cut"
    # the failure itself names the rank and its host: cut off (both ranks inside the same
    # all-reduce, alive), or stuck before it (its progress records on a host this one cannot read)
    named = re.search(r"rank 1 is (cut off: rank 1 on host1 |stuck: .*it runs on host host1)", out)
    assert named, out[-3000:]
    assert left == {}, f"processes left on the hosts 30 s after the job ended: {left}"
    assert took < 60, took
