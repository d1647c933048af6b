"""The Python API of `shardwise train` (docs/training.md): run_training(cfg) starts the
ranks itself and returns rank 0's summary, whose losses match single-process training of
the same model and data; bad input is refused before any rank starts."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from shardwise.cli.train import run_training
from shardwise.comm import LocalCommunicator
from shardwise.layers import ShardError
from shardwise.train import setup, train_step
from train_helpers import tiny_config, write_tiny_tokens

STEPS = 2
LOSS_TOL = 2e-5  # as tests/multiproc/test_train_equivalence.py


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    return write_tiny_tokens(tmp_path_factory.mktemp("tok") / "tokens.safetensors")


def test_run_training_at_tp2_returns_the_summary_and_matches_one_process(tokens, tmp_path):
    cfg = tiny_config(tokens, tmp_path / "run", tp=2, steps=STEPS, parallel={"backend": "gloo"})
    summary = run_training(cfg)

    tr = setup(LocalCommunicator(), cfg.replace(parallel={"tp": 1, "dp": 1}))
    ref = [train_step(tr).loss for _ in range(STEPS)]
    assert summary["step"] == STEPS and summary["steps_run"] == STEPS
    assert (summary["tp"], summary["dp"], summary["backend"]) == (2, 1, "gloo")
    assert math.isclose(summary["first_loss"], ref[0], abs_tol=LOSS_TOL), (summary["first_loss"], ref[0])
    assert math.isclose(summary["loss"], ref[-1], abs_tol=LOSS_TOL), (summary["loss"], ref[-1])
    assert summary["tokens_per_s"] > 0 and summary["ms_per_step"] > 0
    assert summary["checkpoint"] is not None and Path(summary["checkpoint"]).is_dir()
    assert Path(summary["checkpoint"]).name.endswith(f"{STEPS:08d}")


@pytest.mark.gate
def test_run_training_refuses_a_tp_the_model_cannot_split(tokens, tmp_path):
    cfg = tiny_config(tokens, tmp_path / "run", tp=5, steps=STEPS, parallel={"backend": "gloo"})
    with pytest.raises(ShardError, match="tp=5 is more than the model's num_attention_heads=4"):
        run_training(cfg)
    assert not (tmp_path / "run").exists(), "nothing may run before the tp size is checked"
