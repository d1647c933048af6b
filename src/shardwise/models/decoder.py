"""DecoderLM: one plain decoder for Llama, Mistral, Qwen2/3, Gemma, Phi-3, GPT-2 and GPT-NeoX.

The families differ only in ModelConfig switches: norm kind and offset, learned or
rotary positions (full or partial), gated or plain MLP, biases, q/k norm, a parallel
residual, an embedding scale, and tied embeddings.
"""

from __future__ import annotations

import torch
from torch import nn

from shardwise.models.config import ModelConfig
from shardwise.models.modules import MLP, Attention, Norm, rope_cos_sin, rope_inv_freq
from shardwise.models.modules import attention_mask as build_mask

__all__ = ["DecoderLayer", "DecoderLM"]


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.parallel_residual = cfg.parallel_residual
        self.attn_norm = Norm(cfg.hidden_size, cfg.norm, cfg.norm_eps, cfg.norm_offset)
        self.attn = Attention(cfg)
        self.mlp_norm = Norm(cfg.hidden_size, cfg.norm, cfg.norm_eps, cfg.norm_offset)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, rope: tuple | None, mask: torch.Tensor | None) -> torch.Tensor:
        if self.parallel_residual:  # GPT-NeoX: both sublayers read the same x
            return x + self.attn(self.attn_norm(x), rope, mask) + self.mlp(self.mlp_norm(x))
        x = x + self.attn(self.attn_norm(x), rope, mask)
        return x + self.mlp(self.mlp_norm(x))


class DecoderLM(nn.Module):
    """Token ids -> logits. Build it on the meta device and let a loader fill the weights."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.pos_embed = nn.Embedding(cfg.max_positions, cfg.hidden_size) if cfg.positions == "learned" else None
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = Norm(cfg.hidden_size, cfg.norm, cfg.norm_eps, cfg.norm_offset)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight

    def forward(
        self,
        ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """ids: (B, T); attention_mask: (B, T), 1 = real token (left padding allowed);
        positions: (B, T), default counts real tokens from 0. Returns (B, T, vocab[/tp])."""
        B, T = ids.shape
        if positions is None:
            if attention_mask is None:
                positions = torch.arange(T, device=ids.device).expand(B, T)
            else:
                positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        x = self.embed(ids)  # (B, T, hidden)
        if self.cfg.embed_scale != 1.0:
            x = x * torch.tensor(self.cfg.embed_scale, dtype=x.dtype)
        rope = None
        if self.pos_embed is not None:
            x = x + self.pos_embed(positions)
        else:
            rope = rope_cos_sin(rope_inv_freq(self.cfg, ids.device), positions, x.dtype)
        mask = build_mask(
            attention_mask, T, T, causal=self.cfg.causal, window=self.cfg.sliding_window, device=ids.device
        )
        for layer in self.layers:
            x = layer(x, rope, mask)
        return self.lm_head(self.norm(x))
