"""A save killed by SIGKILL at random moments, again and again, never corrupts what loads.

A forked child saves checkpoint after checkpoint, each with weights that encode its step;
the parent kills it after a random delay, restarts it from `latest`, and repeats. After
every kill, `latest` must name a complete checkpoint whose every file verifies and whose
weights are those of its step."""

from __future__ import annotations

import os
import random
import signal
import time

import pytest
import torch

from shardwise.checkpoint import CheckpointReader, load_checkpoint, save_checkpoint
from shardwise.checkpoint.reader import resolve_checkpoint
from shardwise.comm import LocalCommunicator
from shardwise.train import setup
from train_helpers import tiny_config, write_tiny_tokens

KILLS = 12


def _stamp(tr, step: int) -> None:
    tr.step = step
    with torch.no_grad():
        for i, p in enumerate(tr.model.parameters()):
            p.fill_(step * 1000 + i)


def _saver_loop(tr, root) -> None:
    """In the child: continue from latest, save forever."""
    try:
        step = CheckpointReader(root).manifest.step
    except Exception:  # noqa: BLE001 - no checkpoint yet
        step = 0
    while True:
        step += 1
        _stamp(tr, step)
        save_checkpoint(tr, root, keep_last=2)


@pytest.mark.full  # repeated kills and restarts: make test-more
@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_sigkill_during_saves_never_corrupts_latest(tmp_path):
    cfg = tiny_config(write_tiny_tokens(tmp_path / "tokens.safetensors"), tmp_path / "run")
    tr = setup(LocalCommunicator(), cfg)
    root = tmp_path / "ckpts"
    rng = random.Random(0)
    seen = set()
    for _ in range(KILLS):
        pid = os.fork()
        if pid == 0:  # child: never returns to pytest
            try:
                _saver_loop(tr, root)
            finally:
                os._exit(1)
        time.sleep(rng.uniform(0.05, 0.6))
        os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        assert os.WIFSIGNALED(status), "the saver died by itself instead of being killed"
        if not (root / "latest").exists():
            continue  # killed before the first commit
        reader = CheckpointReader(root)
        reader.verify()  # every file present, full size, SHA-256 and keys
        step = reader.manifest.step
        seen.add(step)
        check = setup(LocalCommunicator(), cfg)
        load_checkpoint(check, str(root))
        for i, p in enumerate(check.model.parameters()):
            assert torch.all(p == step * 1000 + i), f"step {step}: weights of another step"
        assert not resolve_checkpoint(root).name.startswith(".")  # never a temporary directory
    assert len(seen) >= KILLS // 2, f"too few kills landed after a commit: {sorted(seen)}"
