"""The benchmark model: Llama-shaped, random weights, saved as a Hugging Face directory.

hidden 1024, 8 layers, 16 heads, 4 KV heads, intermediate 2816, vocab 32000, fp32:
about 156M parameters (624 MB of safetensors).

    python benchmarks/bench_model.py [DIR]     # default /tmp/shardwise-bench/llama-156m
"""

from __future__ import annotations

import sys
from pathlib import Path

DEFAULT_DIR = Path("/tmp/shardwise-bench/llama-156m")
CONFIG = dict(
    hidden_size=1024,
    num_hidden_layers=8,
    num_attention_heads=16,
    num_key_value_heads=4,
    intermediate_size=2816,
    vocab_size=32000,
    max_position_embeddings=2048,
    tie_word_embeddings=False,
)


def ensure_bench_model(path: Path = DEFAULT_DIR) -> Path:
    """Create the benchmark checkpoint at `path` unless it is already there."""
    if (path / "config.json").exists() and (path / "model.safetensors").exists():
        return path
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**CONFIG, initializer_range=0.02)
    model = transformers.LlamaForCausalLM(cfg).to(torch.float32)
    n = sum(p.numel() for p in model.parameters())
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, max_shard_size="2GB")
    print(f"wrote {path}: {n / 1e6:.1f}M parameters", file=sys.stderr)
    return path


if __name__ == "__main__":
    ensure_bench_model(Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_DIR)
