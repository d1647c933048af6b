"""The default model shipped in the package (src/shardwise/assets/default, made by
scripts/make_default_model.py): it loads, allows the tp sizes it promises, its tokenizer
round-trips text, and its weights (trained by scripts/train_default_model.py) give
position-dependent logits."""

from __future__ import annotations

import importlib.resources
import json

import pytest
import torch

from shardwise.comm import LocalCommunicator
from shardwise.hf import load_pretrained, read_config
from shardwise.sharding.plans import check_tp

tokenizers = pytest.importorskip("tokenizers")

FILES = ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json", "README.md")


@pytest.fixture(scope="module")
def asset():
    root = importlib.resources.files("shardwise") / "assets" / "default"
    with importlib.resources.as_file(root) as path:
        yield path


@pytest.fixture(scope="module")
def loaded(asset):
    return load_pretrained(asset, comm=LocalCommunicator())


@pytest.fixture(scope="module")
def tokenizer(asset):
    return tokenizers.Tokenizer.from_file(str(asset / "tokenizer.json"))


def test_asset_files_ship_with_the_package(asset):
    for name in FILES:
        assert (asset / name).is_file(), name
    assert (asset / "model.safetensors").stat().st_size < 12 * 1024 * 1024


def test_loads_as_a_llama_in_fp32(loaded):
    model, report = loaded
    assert report.family == "llama"
    cfg = report.config
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads) == (256, 4, 8, 4)
    assert cfg.intermediate_size == 512 and cfg.max_positions == 512
    assert cfg.dtype == "float32" and not cfg.tie_embeddings
    assert all(p.dtype == torch.float32 for p in model.parameters())


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_config_allows_tp(asset, tp):
    _, cfg = read_config(asset)
    check_tp(cfg, tp)  # raises ShardError if tp cannot split the model


def test_tokenizer_round_trips_text(tokenizer):
    for text in [
        "Tensor parallelism splits each layer's matrices across devices.",
        "  leading spaces, tabs\tand newlines\n, unicode: naïve café — 東京 🙂",
    ]:
        ids = tokenizer.encode(text).ids
        assert ids and len(ids) < len(text.encode())  # merges were learned
        assert tokenizer.decode(ids) == text


def test_special_tokens_and_vocab_sizes_agree(asset, tokenizer, loaded):
    raw = json.loads((asset / "config.json").read_text())
    assert tokenizer.get_vocab_size() == raw["vocab_size"] == loaded[1].config.vocab_size == 512
    assert tokenizer.token_to_id("<|bos|>") == raw["bos_token_id"] == 0
    assert tokenizer.token_to_id("<|eos|>") == raw["eos_token_id"] == 1


def test_greedy_logits_differ_across_positions(loaded, tokenizer):
    model, _ = loaded
    ids = torch.tensor([[0, *tokenizer.encode("The quick brown fox jumps over the lazy dog").ids]])
    with torch.no_grad():
        logits = model(ids)
    assert logits.shape == (1, ids.shape[1], 512)
    assert torch.isfinite(logits).all()
    picks = logits[0].argmax(-1)
    assert len(set(picks.tolist())) >= ids.shape[1] // 2  # not one token everywhere
    for t in range(1, ids.shape[1]):
        assert not torch.allclose(logits[0, t], logits[0, t - 1])
