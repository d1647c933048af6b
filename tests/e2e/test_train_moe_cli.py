"""`shardwise train --ep` and the checkpoint commands on a mixture of experts, end to end, as
a user runs them: a tiny Mixtral trained at dp=2 with its 4 experts over ep=2 (load-balancing
loss on, logged beside the cross-entropy); the checkpoint resharded offline to tp=2 and back
to ep=2 (the same weights); exported to a Hugging Face directory that transformers'
MixtralForCausalLM loads and that gives the trained model's logits; and bad expert-parallel
input refused in one line before any rank starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from processes import run_cli, run_cli_inline
from shardwise.checkpoint import CheckpointReader
from shardwise.layers import ShardSpec
from train_helpers import CORPUS, TINY_MODEL, TOKENIZER

MOE = {"num_experts": 4, "experts_per_token": 2, "expert_size": 48, "router_aux_loss_coef": 0.02}


def _toml(tmp: Path, model: dict) -> Path:
    lines = "\n".join(f"{k} = {v}" for k, v in model.items())
    text = f"""
[model]
{lines}
tokenizer = "{TOKENIZER}"

[data]
text = "{CORPUS}"
seq_len = 32
global_batch_size = 8
micro_batch_size = 4

[parallel]
backend = "gloo"

[run]
steps = 6
log_every = 3
out_dir = "run"
plot = false
"""
    path = tmp / "moe.toml"
    path.write_text(text)
    return path


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("moe-cli")
    out = run_cli("train", "--config", str(_toml(tmp, TINY_MODEL | MOE)), "--dp", "2", "--ep", "2")
    assert out.returncode == 0, out.stderr
    return tmp, out


def _params(ckpt: Path) -> dict[str, torch.Tensor]:
    reader = CheckpointReader(ckpt)
    names = [k.split("/", 1)[1] for k in reader.manifest.tensors if k.startswith("param/")]
    return {n: reader.read(f"param/{n}", ShardSpec.replicated(reader.entry(f"param/{n}").global_shape)) for n in names}


def test_train_ep_reshard_and_export_to_transformers(trained):
    transformers = pytest.importorskip("transformers")
    tmp, out = trained
    assert "4 experts (top-2) over ep=2, aux loss coef 0.02" in out.stdout
    assert "step 3/6  loss " in out.stderr and " x aux " in out.stderr  # both parts of the loss
    assert "this rank holds experts 0-1 of 4" in out.stderr
    ckpt = tmp / "run" / "checkpoints" / "step-00000006"
    assert CheckpointReader(ckpt).manifest.layout == {"tp": 1, "pp": 1, "dp": 2, "ep": 2}

    out = run_cli("checkpoint", "reshard", str(ckpt), str(tmp / "tp2"), "--tp", "2")
    assert out.returncode == 0, out.stderr
    out = run_cli("checkpoint", "reshard", str(tmp / "tp2"), str(tmp / "ep2"), "--tp", "1", "--ep", "2", "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["ep_to"] == 2
    down = CheckpointReader(tmp / "ep2").manifest.tensors["param/layers.0.mlp.experts.down"]
    assert down.dim == 0 and [c.length for c in down.chunks] == [2 * TINY_MODEL["hidden_size"]] * 2
    trained_params = _params(ckpt)
    for name, t in _params(tmp / "ep2").items():
        assert torch.equal(t, trained_params[name]), name

    hf = tmp / "hf"
    out = run_cli("checkpoint", "export-hf", str(tmp / "ep2"), str(hf))
    assert out.returncode == 0, out.stderr
    assert json.loads((hf / "config.json").read_text())["model_type"] == "mixtral"
    theirs = transformers.MixtralForCausalLM.from_pretrained(hf).eval()
    from shardwise.checkpoint.offline import model_config
    from shardwise.models.decoder import DecoderLM

    ours = DecoderLM(model_config(CheckpointReader(ckpt).manifest)).eval()
    ours.load_state_dict(trained_params, strict=False)
    assert {n for n, _ in ours.named_parameters()} == set(trained_params)
    ids = torch.randint(0, TINY_MODEL["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(theirs(ids).logits, ours(ids), rtol=1e-4, atol=1e-4)


@pytest.mark.gate
@pytest.mark.smoke
def test_bad_expert_parallel_input_fails_with_one_line(tmp_path):
    moe, dense = _toml(tmp_path, TINY_MODEL | MOE), None
    cases = [
        ((moe, "--dp", "2", "--ep", "3"), "parallel.ep=3 must divide parallel.dp=2; valid ep: 1, 2"),
        (
            (moe, "--dp", "8", "--ep", "8", "--microbatches", "1"),
            "parallel.ep=8 exceeds num_experts=4: every ep rank needs at least one expert; valid ep at dp=8: 1, 2, 4",
        ),
    ]
    (tmp_path / "dense").mkdir()
    dense = _toml(tmp_path / "dense", TINY_MODEL)
    cases.append(
        (
            (dense, "--dp", "2", "--ep", "2"),
            "parallel.ep=2 needs a mixture-of-experts model; this llama model has no experts "
            "(set model.num_experts, or ep = 1)",
        )
    )
    for (config, *args), message in cases:
        out = run_cli_inline("train", "--config", str(config), *args)
        assert (out.returncode, out.stdout, out.stderr) == (2, "", f"shardwise: error: {message}\n"), args
    assert not (tmp_path / "run").exists(), "nothing may be written before the input is checked"
