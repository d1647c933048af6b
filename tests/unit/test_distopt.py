"""The distributed optimizer on one process: its bytes-per-parameter formula against the
tensors a rank holds and against the planner's memory model; the bad input it refuses
with one line before any rank starts."""

from __future__ import annotations

import pytest

from shardwise.comm import LocalCommunicator
from shardwise.planner.footprint import training_memory
from shardwise.planner.presets import resolve_model
from shardwise.train import ConfigError, TrainConfig
from shardwise.train.distopt import bytes_per_param
from train_helpers import tiny_config, write_tiny_tokens


@pytest.mark.parametrize(
    ("dtype", "distributed", "dp", "total"),
    [
        ("fp32", False, 4, 16),
        ("fp32", True, 1, 16),  # the weights are the master: 8 + 8 / dp
        ("fp32", True, 2, 12),
        ("fp32", True, 4, 10),
        ("bf16", False, 4, 18),  # 2 + fp32 reduced grads 4 + master 4 + moments 8
        ("bf16", True, 1, 18),
        ("bf16", True, 2, 10),  # 2 + max(2, 4 / 2) + 12 / 2
        ("bf16", True, 4, 7),  # 4 + 12 / dp
    ],
)
def test_bytes_per_param_formula(dtype, distributed, dp, total):
    assert bytes_per_param(dtype, distributed, dp)["total"] == total


@pytest.mark.parametrize(("precision", "dtype"), [("fp32", "fp32"), ("bf16-mixed", "bf16")])
@pytest.mark.parametrize("dp", [1, 2, 4])
@pytest.mark.parametrize("distributed", [False, True])
def test_planner_uses_the_runtime_formula(precision, dtype, dp, distributed):
    """The planner's weights + grads + optimizer state per rank at tp = pp = 1 is the runtime's
    formula times the parameters (activations aside), with and without the distributed optimizer."""
    from shardwise.planner.footprint import stage_params
    from shardwise.planner.specs import PRECISIONS

    cfg = resolve_model("debug")[1]
    p = PRECISIONS[precision]
    mem = training_memory(
        cfg, 1, 1, micro_batches=1, micro_batch=1, seq=16, width=p.weight_bytes, weight_bytes=p.weight_bytes,
        optimizer="adam", recompute="none", flash=True, budget=1e12, dp=dp, distributed_optimizer=distributed,
    )  # fmt: skip
    n = stage_params(cfg, 1)
    want = bytes_per_param(dtype, distributed, dp)
    assert (mem.weights, mem.grads, mem.optimizer) == pytest.approx(
        (want["weights"] * n, want["grads"] * n, want["optimizer"] * n)
    )


def test_planner_splits_expert_state_over_edp():
    """Mixtral-shaped experts dealt over ep = 2 of dp = 4 ranks: the dense state split over 4,
    the experts' over the 2 ranks holding the same experts."""
    from shardwise.planner.footprint import expert_params, stage_params, state_bytes

    cfg = resolve_model("mixtral-8x7b")[1]
    n, e = stage_params(cfg, 1, ep_dp=2), expert_params(cfg, 1, ep_dp=2)
    assert 0 < e < n
    w, g, opt = state_bytes(cfg, 1, width=4, dp=4, ep_dp=2, distributed_optimizer=True)
    assert (w, g, opt) == (4 * n, 4 * n, (n - e) * 8 / 4 + e * 8 / 2)


@pytest.mark.full  # the gate's tests/multiproc/test_train_distopt.py checks the same at tp=2 x dp=2
def test_held_bytes_at_one_process_equal_the_formula(tmp_path):
    """dp = 1, distributed: fp32 weights are their own master (views of one flat buffer,
    nothing copied: 4 + 4 + 8 = 16); bf16 keeps an fp32 master (2 + 4 + 12 = 18)."""
    from cases.distopt import memory_case

    tokens = write_tiny_tokens(tmp_path / "t.safetensors", chars=8000)
    for dtype in ("fp32", "bf16"):
        cfg = tiny_config(tokens, tmp_path, steps=1, optim={"distributed": True}, run={"dtype": dtype})
        r = memory_case(LocalCommunicator(), cfg)
        assert sum(r["held"].values()) == r["formula"]["total"] * r["params"], (dtype, r)
        assert r["weights_are_views"] == (dtype == "fp32"), dtype


@pytest.mark.parametrize(
    ("sections", "message"),
    [
        (
            {"optim": {"distributed": True}, "parallel": {"dp_sync": "ddp", "dp": 2}},
            "optim.distributed reduce-scatters",
        ),
        ({"optim": {"grad_reduce_dtype": "fp8"}}, "optim.grad_reduce_dtype must be"),
        # AdamW is the only optimizer: another one is an unknown field, named with the known ones
        ({"optim": {"optimizer": "sgd", "distributed": True}}, "unknown field optim.optimizer; known fields"),
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


def test_an_incomplete_optimizer_state_is_named_before_any_rank_starts(tmp_path):
    """A distributed-optimizer checkpoint whose moment misses rows (a lost slice): `train
    --resume` refuses it in one line naming the tensor and the rows, from the manifest,
    before any rank starts; a rank loading it anyway raises too (never zero-filled)."""
    import json

    from shardwise.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
    from shardwise.cli.train import check_resume
    from shardwise.train import model_config, setup, train_step

    tokens = write_tiny_tokens(tmp_path / "t.safetensors", chars=8000)
    cfg = tiny_config(tokens, tmp_path, steps=1, optim={"distributed": True})
    tr = setup(LocalCommunicator(), cfg)
    train_step(tr)
    ckpt = save_checkpoint(tr, tmp_path / "ckpts")
    resumed = cfg.replace(run={"resume": str(ckpt), "steps": 2})
    check_resume(resumed, model_config(resumed))  # complete: accepted
    manifest = json.loads((ckpt / "manifest.json").read_text())
    entry = manifest["tensors"]["exp_avg/embed.weight"]
    entry["chunks"][-1]["length"] -= 3  # the last rows' slice lost
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    rows = entry["global_shape"][entry["dim"]]
    with pytest.raises(ConfigError) as e:
        check_resume(resumed, model_config(resumed))
    assert str(e.value).startswith("run.resume: ") and "\n" not in str(e.value)
    assert f"exp_avg/embed.weight: chunks cover rows [0, {rows - 3}) but the tensor has {rows} rows" in str(e.value)
    with pytest.raises(CheckpointError, match="exp_avg/embed.weight: chunks cover rows"):
        load_checkpoint(setup(LocalCommunicator(), cfg), str(ckpt))
