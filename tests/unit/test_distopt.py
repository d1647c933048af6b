"""The distributed optimizer on one process: its bytes-per-parameter formula against the
tensors a rank holds and against the planner's memory model; the bad input it refuses
with one line before any rank starts."""

from __future__ import annotations

import pytest

from shardwise.comm import LocalCommunicator
from shardwise.planner.footprint import training_memory
from shardwise.planner.presets import resolve_model
from shardwise.train import ConfigError, TrainConfig, setup, train_step
from shardwise.train.distopt import bytes_per_param, held_bytes
from train_helpers import tiny_config, write_tiny_tokens


@pytest.mark.parametrize(
    ("dtype", "distributed", "dp", "total"),
    [
        ("fp32", False, 4, 16),
        ("fp32", True, 1, 24),
        ("fp32", True, 4, 12),
        ("bf16", False, 4, 20),
        ("bf16", True, 4, 8),
    ],
)
def test_bytes_per_param_formula(dtype, distributed, dp, total):
    assert bytes_per_param(dtype, distributed, dp)["total"] == total


@pytest.mark.parametrize(("precision", "dtype"), [("fp32", "fp32"), ("bf16-mixed", "bf16")])
@pytest.mark.parametrize("dp", [1, 2, 4])
def test_planner_uses_the_runtime_formula(precision, dtype, dp):
    """The planner's weights + grads + optimizer state per rank at tp = pp = 1 is the runtime's
    formula times the parameters (activations aside)."""
    from shardwise.planner.footprint import stage_params
    from shardwise.planner.specs import PRECISIONS

    cfg = resolve_model("debug")[1]
    p = PRECISIONS[precision]
    mem = training_memory(
        cfg, 1, 1, micro_batches=1, micro_batch=1, seq=16, width=p.weight_bytes, weight_bytes=p.weight_bytes,
        grad_bytes=p.grad_bytes, optimizer="adam", master_bytes=p.master_bytes, recompute="none", flash=True,
        budget=1e12, dp=dp, distributed_optimizer=True,
    )  # fmt: skip
    n = stage_params(cfg, 1)
    assert mem.weights + mem.grads + mem.optimizer == pytest.approx(bytes_per_param(dtype, True, dp)["total"] * n)


@pytest.mark.full  # the gate's tests/multiproc/test_train_distopt.py checks the same at tp=2 x dp=2
def test_held_bytes_at_one_process_equal_the_formula(tmp_path):
    tokens = write_tiny_tokens(tmp_path / "t.safetensors", chars=8000)
    for dtype in ("fp32", "bf16"):
        cfg = tiny_config(tokens, tmp_path, steps=1, optim={"distributed": True}, run={"dtype": dtype})
        tr = setup(LocalCommunicator(), cfg)
        train_step(tr)
        n = sum(p.numel() for p in tr.model.parameters())
        held = held_bytes(tr.model, tr.optimizer)  # after the step: no gradients held
        assert (
            held["weights"] + held["optimizer"] == (bytes_per_param(dtype, True, 1)["total"] - held["weights"] / n) * n
        )


@pytest.mark.parametrize(
    ("sections", "message"),
    [
        (
            {"optim": {"distributed": True}, "parallel": {"dp_sync": "ddp", "dp": 2}},
            "optim.distributed reduce-scatters",
        ),
        ({"optim": {"grad_reduce_dtype": "fp8"}}, "optim.grad_reduce_dtype must be"),
        ({"run": {"dtype": "fp16"}}, "run.dtype must be"),
    ],
)
def test_bad_input_is_one_line(tmp_path, sections, message):
    with pytest.raises(ConfigError, match=message) as e:
        tiny_config(tmp_path / "t.safetensors", tmp_path, **sections)
    assert "\n" not in str(e.value)


def test_config_fields_round_trip(tmp_path):
    cfg = tiny_config(tmp_path / "t.safetensors", tmp_path, optim={"distributed": True}, run={"dtype": "bf16"})
    again = TrainConfig.from_dict(cfg.to_dict())
    assert again.optim.distributed and again.run.dtype == "bf16" and again.optim.grad_reduce_dtype == "fp32"


def test_a_device_without_bf16_is_refused_in_one_line(monkeypatch):
    import torch

    from shardwise.train.distopt import check_dtype

    check_dtype("bf16", "cpu")
    check_dtype("fp32", "cuda")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "Tesla T4")
    with pytest.raises(ValueError, match=r"run.dtype='bf16': Tesla T4 \(cuda\) cannot compute in bfloat16"):
        check_dtype("bf16", "cuda")
