"""BertEncoder: the BERT encoder (post-norm, learned absolute positions, token types, pooler).

A plain single-device module, sharded by shardwise.sharding.plans.bert like any other:
word embeddings by vocabulary, attention by heads, the MLP by its intermediate dim;
position and token-type embeddings, norms and the pooler stay replicated.
"""

from __future__ import annotations

import torch
from torch import nn

from shardwise.models.config import ModelConfig
from shardwise.models.modules import MLP, Attention, Norm
from shardwise.models.modules import attention_mask as build_mask

__all__ = ["BertLayer", "BertEncoder"]


class BertLayer(nn.Module):
    """x = LN(x + attn(x)); x = LN(x + mlp(x)): post-norm, as in BERT."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attn = Attention(cfg)
        self.attn_norm = Norm(cfg.hidden_size, cfg.norm, cfg.norm_eps)
        self.mlp = MLP(cfg)
        self.mlp_norm = Norm(cfg.hidden_size, cfg.norm, cfg.norm_eps)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        x = self.attn_norm(x + self.attn(x, None, mask))  # (B, T, H)
        return self.mlp_norm(x + self.mlp(x))  # (B, T, H)


class BertEncoder(nn.Module):
    """Token ids -> last hidden state (B, T, H); `pooled` gives the pooler output (B, H).

    Build it on the meta device and let a loader fill the weights. pooler defaults to
    cfg.extra.get("pooler", True); without one (checkpoints saved without it, e.g.
    BertForMaskedLM) `pooled` raises.
    """

    def __init__(self, cfg: ModelConfig, *, pooler: bool | None = None) -> None:
        super().__init__()
        if cfg.positions != "learned" or cfg.causal or not cfg.post_norm:
            raise ValueError("BertEncoder needs positions='learned', causal=False and post_norm=True")
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.pos_embed = nn.Embedding(cfg.max_positions, cfg.hidden_size)
        self.type_embed = nn.Embedding(cfg.type_vocab_size, cfg.hidden_size) if cfg.type_vocab_size > 0 else None
        self.embed_norm = Norm(cfg.hidden_size, cfg.norm, cfg.norm_eps)
        self.layers = nn.ModuleList(BertLayer(cfg) for _ in range(cfg.num_layers))
        if pooler is None:
            pooler = bool(cfg.extra.get("pooler", True))
        self.pooler = nn.Linear(cfg.hidden_size, cfg.hidden_size) if pooler else None

    def forward(
        self,
        ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """ids: (B, T); attention_mask: (B, T), 1 = real token (right padding, as BERT
        expects); token_type_ids: (B, T), default 0; positions: (B, T), default 0..T-1.
        Returns the last hidden state (B, T, H); rows of padded tokens are not meaningful."""
        B, T = ids.shape
        if ids.shape[1] > self.cfg.max_positions:
            raise ValueError(f"sequence of {T} tokens exceeds max_position_embeddings={self.cfg.max_positions}")
        if positions is None:
            positions = torch.arange(T, device=ids.device).expand(B, T)
        x = self.embed(ids) + self.pos_embed(positions)  # (B, T, H)
        if self.type_embed is not None:
            if token_type_ids is None:
                token_type_ids = torch.zeros_like(ids)
            x = x + self.type_embed(token_type_ids)
        x = self.embed_norm(x)  # (B, T, H)
        mask = build_mask(attention_mask, T, T, causal=False, window=None, device=ids.device)  # (B, 1, T, T)
        for layer in self.layers:
            x = layer(x, mask)
        return x  # (B, T, H)

    def pooled(self, hidden: torch.Tensor) -> torch.Tensor:
        """BERT's pooler: tanh(dense(hidden[:, 0])), from the last hidden state (B, T, H) -> (B, H)."""
        if self.pooler is None:
            raise ValueError("this BertEncoder has no pooler (its checkpoint had none); use mean_pool instead")
        return torch.tanh(self.pooler(hidden[:, 0]))  # (B, H)
