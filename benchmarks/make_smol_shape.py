"""A random-weight Llama of SmolLM2-135M's shape, saved as a Hugging Face directory.

30 layers, hidden 576, 9 heads, 3 KV heads (head_dim 64), intermediate 1536, vocab 49152,
tied embeddings, rope_theta 100000, 2048 positions, fp32: about 135M parameters (deep and
narrow, so a decode step's work outside the matmuls shows).

    .venv/bin/python benchmarks/make_smol_shape.py [DIR]     # default /tmp/smol-shape; prints DIR
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

DEFAULT_DIR = Path("/tmp/smol-shape")
CONFIG = dict(
    hidden_size=576,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    intermediate_size=1536,
    vocab_size=49152,
    max_position_embeddings=2048,
    rope_theta=100000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
)


def _matches(path: Path) -> bool:
    """True when `path` already holds a checkpoint of this shape."""
    try:
        d = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return False
    theta = (d.get("rope_parameters") or {}).get("rope_theta", d.get("rope_theta"))
    same = all(d.get(k) == v for k, v in CONFIG.items() if k != "rope_theta")
    return same and theta == CONFIG["rope_theta"] and (path / "model.safetensors").exists()


def ensure_smol_shape(path: Path = DEFAULT_DIR) -> Path:
    """Create the checkpoint at `path` unless one of this shape is already there; returns `path`."""
    if _matches(path):
        return path
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**CONFIG, initializer_range=0.02)
    model = transformers.LlamaForCausalLM(cfg).to(torch.float32)
    n = sum(p.numel() for p in model.parameters())
    # NOTE: written next to `path`, then renamed over it: a reader never sees half a checkpoint
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=path.name + ".", dir=path.parent))
    tmp.chmod(0o755)
    model.save_pretrained(tmp, safe_serialization=True, max_shard_size="2GB")
    if path.exists():
        shutil.rmtree(path)
    tmp.rename(path)
    print(f"wrote {path}: {n / 1e6:.1f}M parameters", file=sys.stderr)
    return path


if __name__ == "__main__":
    print(ensure_smol_shape(Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_DIR))
