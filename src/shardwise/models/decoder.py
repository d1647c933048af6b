"""DecoderLM: one plain decoder for Llama, Mistral, Qwen2/3, Gemma 1/3, Phi-3, GPT-2 and GPT-NeoX.

The families differ only in ModelConfig switches: norm kind and offset, learned or
rotary positions (full or partial), gated or plain MLP, biases, q/k norm, a parallel
residual, an embedding scale, tied embeddings, a sliding window in every layer or in some
(Gemma 3's local layers, with their own rotary base), a norm after each sublayer too
(Gemma 3), and mixture-of-experts MLPs
(Mixtral, Qwen2/3-MoE: shardwise.models.moe) in some or all layers.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from shardwise.kernels.block import act_block
from shardwise.models.config import ModelConfig
from shardwise.models.modules import MLP, Attention, KVCache, Norm, rope_cos_sin, rope_inv_freq
from shardwise.models.modules import attention_mask as build_mask
from shardwise.models.moe import MoE
from shardwise.models.step import step_layers

__all__ = ["DecoderLayer", "DecoderLM"]


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int = 0) -> None:
        super().__init__()
        self.parallel_residual = cfg.parallel_residual
        self.sliding = cfg.is_sliding_layer(index)  # picks this layer's mask and rotary tables
        self.attn_norm = Norm(cfg.hidden_size, cfg.norm, cfg.norm_eps, cfg.norm_offset)
        self.attn = Attention(cfg)
        self.mlp_norm = Norm(cfg.hidden_size, cfg.norm, cfg.norm_eps, cfg.norm_offset)
        self.mlp = MoE(cfg) if cfg.is_moe_layer(index) else MLP(cfg)  # (B, T, hidden) -> same
        self.attn_post_norm = self.mlp_post_norm = None
        if cfg.sandwich_norm:  # Gemma 3: each sublayer's output is normed before its residual add
            self.attn_post_norm = Norm(cfg.hidden_size, cfg.norm, cfg.norm_eps, cfg.norm_offset)
            self.mlp_post_norm = Norm(cfg.hidden_size, cfg.norm, cfg.norm_eps, cfg.norm_offset)

    def forward(self, x, rope, mask, cache: KVCache | None = None, start: int = 0) -> torch.Tensor:
        if self.parallel_residual:  # GPT-NeoX: both sublayers read the same x
            return x + self.attn(self.attn_norm(x), rope, mask, cache, start) + self.mlp(self.mlp_norm(x))
        qkv_block, up_block = self._act_blocks()
        a = self.attn(self.attn_norm(x, qkv_block), rope, mask, cache, start)  # (B, T, hidden)
        if self.attn_post_norm is not None:
            a = self.attn_post_norm(a)
        x, h = self.mlp_norm.add_forward(x, a, up_block)  # x + a, and its norm: one pass where native
        m = self.mlp(h)
        return x + (m if self.mlp_post_norm is None else self.mlp_post_norm(m))

    def _act_blocks(self) -> tuple[int | None, int | None]:
        """The activation block lengths qkv's and the MLP's first linear quantize their inputs
        to (kernels.block.act_block), so that each norm before them quantizes in its own call.
        Read once from the weights; a stale answer costs only speed (the linear checks)."""
        hint = self.__dict__.get("_act_hint")
        if hint is None:
            up = getattr(self.mlp, "up", None)
            hint = (act_block(self.attn.qkv.weight), act_block(up.weight) if up is not None else None)
            self.__dict__["_act_hint"] = hint
        return hint


class DecoderLM(nn.Module):
    """Token ids -> logits. Build it on the meta device and let a loader fill the weights."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.pos_embed = nn.Embedding(cfg.max_positions, cfg.hidden_size) if cfg.positions == "learned" else None
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = Norm(cfg.hidden_size, cfg.norm, cfg.norm_eps, cfg.norm_offset)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight

    def forward(
        self,
        ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        caches: list[KVCache] | None = None,
        start: int = 0,
        last_only: bool = False,
    ) -> torch.Tensor:
        """ids: (B, T), the tokens at positions [start, start + T) of each row.
        attention_mask: (B, start + T), 1 = real token (left padding allowed).
        positions: (B, T), default counts the real tokens from 0.
        caches: one KVCache per layer (see new_caches), or None to attend within ids only.
        Returns logits (B, T, vocab[/tp]), or (B, 1, ...) for the last position only."""
        x, rope, mask = self.prelude(ids, attention_mask, positions, caches is not None, start)
        x = self.run_layers(x, rope, mask, caches, start)
        return self.head(x, last_only)

    def prelude(
        self,
        ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        cached: bool = False,
        start: int = 0,
        *,
        hidden: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, tuple | None, torch.Tensor | None]:
        """The layers' input (B, T, hidden), the rotary (cos, sin, sin_signed) and the attention mask
        every layer reads. The input is the embedded `ids`, or `hidden` when given (a
        pipeline stage's input, received from the previous stage; ids then give only the shape)."""
        B, T = ids.shape[:2]
        if positions is None:
            if attention_mask is None:
                positions = torch.arange(start, start + T, device=ids.device).expand(B, T)
            else:
                positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, start:]
        x, rope = hidden, None
        if hidden is None:
            x = self.embed(ids)  # (B, T, hidden)
            if self.cfg.embed_scale != 1.0:
                x = x * torch.tensor(self.cfg.embed_scale, dtype=x.dtype)
            if self.pos_embed is not None:
                x = x + self.pos_embed(positions)
        cfg, k_len = self.cfg, start + T if cached else T
        if cfg.positions != "learned":
            rope = rope_cos_sin(self._inv_freq(ids.device), positions, x.dtype, signed=True)  # (B, 1, T, rot) each
        window = cfg.sliding_window if cfg.sliding_layers is None else None
        mask = build_mask(attention_mask, T, k_len, causal=cfg.causal, window=window, device=ids.device)
        if cfg.mixed_attention:  # Gemma 3: local layers slide and rotate by their own base
            local = rope
            if cfg.local_rope_theta is not None:
                local = rope_cos_sin(self._inv_freq(ids.device, local=True), positions, x.dtype, signed=True)
            slid = mask
            if cfg.sliding_layers is not None:
                slid = build_mask(
                    attention_mask, T, k_len, causal=cfg.causal, window=cfg.sliding_window, device=ids.device
                )
            rope, mask = {False: rope, True: local}, {False: mask, True: slid}  # keyed by DecoderLayer.sliding
        return x, rope, mask

    def run_layers(
        self,
        x: torch.Tensor,
        rope,
        mask,
        caches: list[KVCache] | None = None,
        start: int = 0,
        layers: range | None = None,
    ) -> torch.Tensor:
        """x (B, T, hidden) through the decoder layers `layers` (global indices; default
        every layer this model holds), caches[i] being layer i's."""
        ids = list(layers) if layers is not None else self.layer_indices()
        if caches is not None and x.shape[1] == 1 and ids:  # a decode step: one native call where it can run
            y = step_layers(self, x, rope, mask, caches, start, ids)
            if y is not None:
                return y
        mixed = isinstance(mask, dict)  # per kind of layer (prelude)
        for i in ids:
            layer = self.layers[i if isinstance(self.layers, nn.ModuleList) else str(i)]
            r, m = (rope[layer.sliding], mask[layer.sliding]) if mixed else (rope, mask)
            x = layer(x, r, m, caches[i] if caches is not None else None, start)
        return x

    def head(self, x: torch.Tensor, last_only: bool = False) -> torch.Tensor:
        """Final norm and LM head: (B, T, hidden) -> logits (B, T or 1, vocab[/tp])."""
        if last_only and x.shape[1] > 1:
            x = x[:, -1:]  # (B, 1, hidden): only the next token's logits are needed
        return self.lm_head(self.norm(x))

    def layer_indices(self) -> list[int]:
        """Global indices of the decoder layers this model holds (all of them, unless a
        pipeline stage kept only its own; see shardwise.pipeline.stage)."""
        if isinstance(self.layers, nn.ModuleList):
            return list(range(len(self.layers)))
        return [int(k) for k in self.layers]

    def _inv_freq(self, device, *, local: bool = False) -> torch.Tensor:
        """RoPE inverse frequencies, computed once per device (not a buffer: the model is
        built on the meta device, and checkpoints do not carry them); local: the sliding
        layers' (cfg.local_rope_theta, unscaled)."""
        key = "_inv_freq_local" if local else "_inv_freq_cache"
        cached = self.__dict__.get(key)
        if cached is None or cached.device != torch.device(device):
            cfg = replace(self.cfg, rope_theta=self.cfg.local_rope_theta, rope_scaling=None) if local else self.cfg
            cached = self.__dict__[key] = rope_inv_freq(cfg, device)
        return cached

    def new_caches(self, batch: int, max_len: int) -> list[KVCache]:
        """One preallocated KVCache per layer, sized for this rank's KV heads."""
        caches = []
        for i in self.layer_indices():
            layer = self.layers[i if isinstance(self.layers, nn.ModuleList) else str(i)]
            _, kv_heads = KVCache.local_heads(layer.attn)
            w = layer.attn.qkv.weight
            caches.append(KVCache(batch, max_len, kv_heads, self.cfg.head_dim, dtype=w.dtype, device=w.device))
        return caches
