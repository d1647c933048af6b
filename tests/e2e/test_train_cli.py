"""`shardwise train` and `shardwise checkpoint` end to end, in subprocesses, as a user runs
them: train at tp=2 on the shipped corpus, reshard the checkpoint to tp=4, export it to a
Hugging Face directory that transformers loads (same logits as the trained weights) and
that `shardwise generate` runs; and bad input fails with one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from processes import run_cli, run_cli_inline
from shardwise.checkpoint import CheckpointReader
from train_helpers import CORPUS, TINY_MODEL, TOKENIZER


def _toml(tmp: Path) -> Path:
    model = "\n".join(f"{k} = {v}" for k, v in TINY_MODEL.items())
    text = f"""
[model]
{model}
tokenizer = "{TOKENIZER}"
bos_token_id = 0
eos_token_id = 1

[data]
text = "{CORPUS}"
seq_len = 32
global_batch_size = 8
micro_batch_size = 4

[optim]
lr = 1e-2
warmup_steps = 2

[parallel]
tp = 2
backend = "gloo"  # the default ("auto") picks MPI where installed; tests/multiproc covers MPI

[run]
steps = 8
log_every = 4
out_dir = "run"
"""
    path = tmp / "tiny.toml"
    path.write_text(text)
    return path


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cli")
    out = run_cli("train", "--config", str(_toml(tmp)))
    assert out.returncode == 0, out.stderr
    return tmp, out


def test_train_prints_progress_summary_checkpoint_and_plot(trained):
    tmp, out = trained
    assert "tp=2 x dp=1 (gloo), steps to 8" in out.stdout
    assert "trained steps 1..8: loss " in out.stdout and "tokens/s" in out.stdout
    assert "step 4/8  loss " in out.stderr and "tok/s" in out.stderr  # the log line (and tqdm) on stderr
    ckpt = tmp / "run" / "checkpoints" / "step-00000008"
    assert f"checkpoint: {ckpt}" in out.stdout
    png = tmp / "run" / "loss.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    losses = [loss for _, loss in CheckpointReader(ckpt).manifest.extra["history"]]
    assert len(losses) == 8 and losses[-1] < losses[0]


def test_reshard_export_transformers_and_generate(trained):
    transformers = pytest.importorskip("transformers")
    tmp, _ = trained
    src, dst, hf = tmp / "run" / "checkpoints", tmp / "tp4", tmp / "hf"
    out = run_cli("checkpoint", "reshard", str(src), str(dst), "--tp", "4", "--json")
    assert out.returncode == 0, out.stderr
    stats = json.loads(out.stdout)
    assert (stats["tp_from"], stats["tp_to"]) == (2, 4) and stats["peak_chunk_bytes"] < stats["total_tensor_bytes"]
    assert CheckpointReader(dst).manifest.layout == {"tp": 4, "pp": 1, "dp": 1}

    out = run_cli("checkpoint", "export-hf", str(dst), str(hf))
    assert out.returncode == 0, out.stderr
    assert {p.name for p in hf.iterdir()} == {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
    }
    model = transformers.LlamaForCausalLM.from_pretrained(hf).eval()
    reader = CheckpointReader(src)
    from shardwise.layers import ShardSpec

    def weight(name):
        entry = reader.entry(f"param/{name}")
        return reader.read(f"param/{name}", ShardSpec.replicated(entry.global_shape))

    assert torch.equal(model.model.embed_tokens.weight, weight("embed.weight"))
    q_rows = TINY_MODEL["hidden_size"]
    assert torch.equal(model.model.layers[1].self_attn.q_proj.weight, weight("layers.1.attn.qkv.weight")[:q_rows])

    out = run_cli(
        "generate", "--model", str(hf), "--tp", "2", "--prompt", "It is a truth", "--max-new-tokens", "6", "--json"
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["tp"] == 2 and len(result["tokens"][0]) >= 1


def test_info_and_bad_input_fail_with_one_line(trained, tmp_path):
    tmp, _ = trained
    out = run_cli_inline("checkpoint", "info", str(tmp / "run" / "checkpoints"), "--verify")
    assert out.returncode == 0 and "step 8, saved at tp=2 x dp=1" in out.stdout and "verified" in out.stdout
    bad = tmp_path / "bad.toml"
    bad.write_text("[data]\ntokens = 'x'\n[parallel]\ntp = 3\n")
    out = run_cli_inline("train", "--config", str(bad))
    assert out.returncode == 2 and out.stderr.startswith("shardwise: error: ") and "tp=3" in out.stderr
    out = run_cli_inline("checkpoint", "reshard", str(tmp_path / "nothing"), str(tmp_path / "x"), "--tp", "2")
    assert out.returncode == 2 and "does not exist" in out.stderr and len(out.stderr.strip().splitlines()) == 1
