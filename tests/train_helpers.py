"""Shared by the training and checkpoint tests: a tiny model config and a small real token file."""

from __future__ import annotations

from pathlib import Path

import torch

from shardwise.engine.text import DEFAULT_MODEL
from shardwise.train import TrainConfig, write_token_file

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "data" / "austen" / "austen.txt"
TOKENIZER = DEFAULT_MODEL / "tokenizer.json"

# vocab 515 is not a multiple of 2 or 4, so the vocab-parallel tables carry padding rows.
TINY_MODEL = {
    "vocab_size": 515,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_layers": 2,
    "num_heads": 4,
    "num_kv_heads": 2,
    "max_positions": 64,
}


def write_tiny_tokens(path: Path, chars: int = 40_000) -> Path:
    """The first `chars` characters of the shipped corpus, tokenized with the default tokenizer."""
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(TOKENIZER)).encode(CORPUS.read_text()[:chars]).ids
    return write_token_file(path, torch.tensor(ids), vocab_size=TINY_MODEL["vocab_size"])


def tiny_config(tokens: Path, out_dir: Path, *, tp: int = 1, dp: int = 1, steps: int = 10, **sections) -> TrainConfig:
    """A tiny model on `tokens`: 8 sequences of 32 tokens per step, in micro-batches of 2."""
    raw = {
        "model": dict(TINY_MODEL),
        "data": {"tokens": str(tokens), "seq_len": 32, "global_batch_size": 8, "micro_batch_size": 2},
        "optim": {"lr": 3e-3, "min_lr": 3e-4, "warmup_steps": 3, "decay_steps": 20},
        "parallel": {"tp": tp, "dp": dp},
        "run": {"steps": steps, "progress": False, "plot": False, "out_dir": str(out_dir), "log_every": 100},
    }
    for name, values in sections.items():
        raw[name].update(values)
    return TrainConfig.from_dict(raw)
