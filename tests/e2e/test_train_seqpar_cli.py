"""`shardwise train --sequence-parallel --recompute full` end to end, in a subprocess: the
JSON summary and log line name both, and the losses equal one process's training of the
same config (no sequence parallelism, no recompute)."""

from __future__ import annotations

import json

from cases.pipeline import train_case
from processes import run_cli
from shardwise.checkpoint import CheckpointReader
from shardwise.comm import LocalCommunicator
from shardwise.train import TrainConfig
from train_helpers import TINY_MODEL, write_tiny_tokens

STEPS = 4
LOSS_TOL = 1e-5


def test_train_with_sequence_parallelism_and_full_recompute(tmp_path):
    tokens = write_tiny_tokens(tmp_path / "tokens.safetensors")
    sizes = "\n".join(f"{k} = {v}" for k, v in TINY_MODEL.items())
    config = tmp_path / "sp.toml"
    config.write_text(
        f'[model]\n{sizes}\n[data]\ntokens = "{tokens}"\nseq_len = 32\nglobal_batch_size = 4\nmicro_batch_size = 2\n'
        f'[parallel]\ntp = 2\nbackend = "gloo"\n[run]\nsteps = {STEPS}\nlog_every = {STEPS}\nout_dir = "run"\n'
    )
    out = run_cli("train", "--config", config, "--sequence-parallel", "--recompute", "full", "--no-progress", "--json")
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout)
    assert (summary["sequence_parallel"], summary["recompute"], summary["tp"]) == (True, "full", 2)
    assert "activations: sequence parallelism on (16 of 32 positions per tp rank), recompute full" in out.stderr

    losses = [loss for _, loss in CheckpointReader(summary["checkpoint"]).manifest.extra["history"]]
    cfg = TrainConfig.from_toml(config).replace(parallel={"tp": 1}, run={"steps": STEPS, "save_at_end": False})
    ref = train_case(LocalCommunicator(), cfg)["losses"]
    assert len(losses) == STEPS and max(abs(a - b) for a, b in zip(losses, ref, strict=True)) < LOSS_TOL, (losses, ref)
