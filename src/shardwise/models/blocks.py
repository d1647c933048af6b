"""Plain single-device transformer blocks: no torch.distributed, no world size.

Per-rank head counts follow from tensor shapes, so the same code runs unsharded and
as a tensor-parallel shard: the number of local query heads is o.weight.shape[1] //
head_dim (o's input width), and the KV heads are what is left of qkv's output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from shardwise.models import modules
from shardwise.models.config import ModelConfig

__all__ = ["BlockConfig", "Attention", "GatedMLP", "MLP", "TransformerBlock", "TinyLM"]


@dataclass(frozen=True)
class BlockConfig:
    """Shapes of a pre-norm decoder block (attention + gated MLP)."""

    hidden_size: int = 64
    """Model width."""
    num_heads: int = 8
    """Query heads."""
    num_kv_heads: int = 4
    """Key/value heads (grouped-query attention); num_heads must be a multiple."""
    intermediate_size: int = 128
    """Width of the MLP's hidden layer."""
    vocab_size: int = 250
    """Vocabulary size (TinyLM only)."""
    num_layers: int = 2
    """Blocks in TinyLM."""
    bias: bool = False
    """Biases on the attention and MLP projections."""

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_heads", "num_kv_heads", "intermediate_size", "vocab_size", "num_layers"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size={self.hidden_size} is not divisible by num_heads={self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def model_config(self) -> ModelConfig:
        """The same shapes as a ModelConfig, for the building blocks in models/modules.py."""
        return ModelConfig(
            family="tiny", vocab_size=self.vocab_size, hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size, num_layers=self.num_layers, num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, qkv_bias=self.bias, o_bias=self.bias,
            positions="learned",
        )  # fmt: skip


class Attention(modules.Attention):
    """Causal grouped-query self-attention with a fused [q | k | v] projection: the
    decoder's attention (models/modules.py) without positions, cache or padding."""

    def __init__(self, cfg: BlockConfig) -> None:
        super().__init__(cfg.model_config())

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, hidden) -> (B, T, hidden)
        T = x.shape[1]
        causal = modules.attention_mask(None, T, T, causal=True, window=None, device=x.device)  # (1, 1, T, T)
        return super().forward(x, None, causal)


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)), with gate and up fused into one [gate | up] projection."""

    def __init__(self, cfg: BlockConfig) -> None:
        super().__init__()
        self.gate_up = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.bias)
        self.down = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)  # (B, T, inter) each (inter/p when sharded)
        return self.down(F.silu(gate) * up)  # (B, T, hidden)


class MLP(nn.Module):
    """The Megatron-LM MLP: fc2(gelu(fc1(x)))."""

    def __init__(self, cfg: BlockConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=True)
        self.fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class TransformerBlock(nn.Module):
    """x + attn(norm(x)), then + mlp(norm(x)): pre-norm, as in Llama."""

    def __init__(self, cfg: BlockConfig) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.hidden_size, eps=1e-6)
        self.attn = Attention(cfg)
        self.mlp_norm = nn.RMSNorm(cfg.hidden_size, eps=1e-6)
        self.mlp = GatedMLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class TinyLM(nn.Module):
    """Embedding, blocks, norm and a tied LM head: enough model to exercise every layer."""

    def __init__(self, cfg: BlockConfig) -> None:
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(TransformerBlock(cfg) for _ in range(cfg.num_layers))
        self.norm = nn.RMSNorm(cfg.hidden_size, eps=1e-6)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.embed.weight  # tied

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)  # (B, T, hidden)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))  # (B, T, vocab), or (B, T, vocab/p) vocab-parallel
