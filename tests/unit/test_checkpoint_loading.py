"""Loading without collectives, one process playing each rank: bytes held per rank, and
clear errors for every kind of bad checkpoint, raised before any data is read."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from helpers import NoCollectives
from hf_models import save_tiny
from shardwise.comm import LocalCommunicator
from shardwise.hf import CheckpointError, load_pretrained
from shardwise.hf.checkpoint import Checkpoint
from shardwise.layers import ShardError

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return {
        "qwen2": save_tiny("qwen2", root),
        "llama3": save_tiny("llama3", root),
        "sharded": save_tiny("qwen2", root / "sharded", max_shard_size="40KB"),
    }


def _copy(src, tmp_path):
    dst = tmp_path / src.name
    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize("tp", [1, 2, 3])
def test_each_rank_holds_its_share_of_the_bytes(tiny, tp):
    """Sharded tensors' 1/tp plus the replicated norms, computed from the checkpoint itself."""
    ckpt = Checkpoint(tiny["qwen2"])
    sharded = replicated = 0
    for name, info in ckpt.tensors.items():
        nbytes = torch.Size(info.shape).numel() * torch.empty((), dtype=info.dtype).element_size()
        if name.endswith("norm.weight"):
            replicated += nbytes
        else:
            sharded += nbytes
    assert sharded % tp == 0
    for rank in range(tp):
        model, report = load_pretrained(tiny["qwen2"], comm=NoCollectives(rank=rank, size=tp))
        held = sum(p.numel() * p.element_size() for p in model.parameters())
        assert report.param_bytes == held == sharded // tp + replicated
        assert report.bytes_read == held, "each rank reads exactly what it holds"
        assert not any(p.is_meta for p in model.parameters())


def test_sharded_index_checkpoint_loads_like_single_file(tiny):
    a, _ = load_pretrained(tiny["qwen2"], comm=NoCollectives(rank=1, size=2))
    b, _ = load_pretrained(tiny["sharded"], comm=NoCollectives(rank=1, size=2))
    assert len(list(tiny["sharded"].glob("*.safetensors"))) > 1
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(p, q), n


def test_dtype_override(tiny):
    model, report = load_pretrained(tiny["qwen2"], comm=LocalCommunicator(), dtype="bfloat16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert report.config.dtype == "bfloat16"
    with pytest.raises(ValueError, match="dtype must be one of float32, bfloat16, float16"):
        load_pretrained(tiny["qwen2"], comm=LocalCommunicator(), dtype="int8")


def test_more_ranks_than_heads_refused_before_reading_weights(tiny, tmp_path):
    only_config = tmp_path / "cfg"
    only_config.mkdir()
    shutil.copy(tiny["llama3"] / "config.json", only_config / "config.json")  # no weights at all
    with pytest.raises(
        ShardError,
        match=r"config\.json: tp=9 is more than the model's num_attention_heads=8: .*; valid tp sizes: 1-8$",
    ):
        load_pretrained(only_config, comm=NoCollectives(size=9))


def test_missing_shard_file(tiny, tmp_path):
    path = _copy(tiny["sharded"], tmp_path)
    victim = sorted(path.glob("model-*.safetensors"))[-1]
    victim.unlink()
    with pytest.raises(
        CheckpointError, match=rf"model.safetensors.index.json lists shard file\(s\) missing from .*: {victim.name}"
    ):
        load_pretrained(path, comm=LocalCommunicator())


def _rewrite(path, edit):
    file = path / "model.safetensors"
    with safe_open(str(file), "pt") as f:
        meta = f.metadata()
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata=meta)


def test_missing_tensor(tiny, tmp_path):
    path = _copy(tiny["qwen2"], tmp_path)
    _rewrite(path, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(
        CheckpointError,
        match=r"missing tensor 'model.layers.1.mlp.up_proj.weight' \(needed for layers.1.mlp.up.weight\)",
    ):
        load_pretrained(path, comm=LocalCommunicator())


def test_unexpected_tensor(tiny, tmp_path):
    path = _copy(tiny["qwen2"], tmp_path)
    _rewrite(path, lambda t: t.update({"model.layers.2.mlp.up_proj.weight": torch.zeros(96, 48)}))
    with pytest.raises(
        CheckpointError, match=r"model.safetensors: unexpected tensor 'model.layers.2.mlp.up_proj.weight'"
    ):
        load_pretrained(path, comm=LocalCommunicator())


def test_wrong_shape(tiny, tmp_path):
    path = _copy(tiny["qwen2"], tmp_path)
    _rewrite(path, lambda t: t.update({"model.layers.0.self_attn.o_proj.weight": torch.zeros(48, 40)}))
    with pytest.raises(
        CheckpointError,
        match=r"model.safetensors: tensor 'model.layers.0.self_attn.o_proj.weight' \(for layers.0.attn.o.weight\) has shape \(48, 40\), expected \(48, 48\)",
    ):
        load_pretrained(path, comm=LocalCommunicator())


def test_truncated_file(tiny, tmp_path):
    path = _copy(tiny["qwen2"], tmp_path)
    file = path / "model.safetensors"
    file.write_bytes(file.read_bytes()[:-1000])
    with pytest.raises(
        CheckpointError,
        match=r"model.safetensors: truncated: tensor '.*' ends at byte \d+ of the data, but the file holds \d+",
    ):
        load_pretrained(path, comm=LocalCommunicator())


@pytest.mark.parametrize(
    "change,message",
    [
        (
            {"num_hidden_layers": 3},
            r"missing tensor 'model.layers.2.input_layernorm.weight' \(needed for layers.2.attn_norm.weight\)",
        ),
        (
            {"num_hidden_layers": 1},
            r"unexpected tensor 'model.layers.1.* and \d+ more, not part of a qwen2 model with num_hidden_layers=1",
        ),
        (
            {"intermediate_size": 72},
            r"tensor 'model.layers.0.mlp.gate_proj.weight' \(for layers.0.mlp.up.weight\) has 96 rows, expected 72 from config.json",
        ),
        (
            {"num_key_value_heads": 6},
            r"tensor 'model.layers.0.self_attn.k_proj.weight' \(for layers.0.attn.qkv.weight\) has 48 rows, expected 24",
        ),
    ],
)
def test_config_that_does_not_match_the_weights(tiny, tmp_path, change, message):
    path = _copy(tiny["qwen2"], tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(change)
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=message):
        load_pretrained(path, comm=LocalCommunicator())


def test_pickle_weights_are_never_loaded(tiny, tmp_path):
    path = tmp_path / "pickled"
    path.mkdir()
    shutil.copy(tiny["qwen2"] / "config.json", path / "config.json")
    (path / "pytorch_model.bin").write_bytes(b"not even read")
    with pytest.raises(CheckpointError, match=r"found pytorch_model.bin: pickle files are never loaded"):
        load_pretrained(path, comm=LocalCommunicator())
