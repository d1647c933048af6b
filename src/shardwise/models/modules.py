"""Building blocks shared by every family: norms, rotary embeddings, attention, MLP.

Plain single-device modules. Local head counts come from tensor shapes (o's input
width and qkv's output width), so a tensor-parallel shard runs the same code. One thing
a shard may add: a tensor-parallel qkv whose heads were split unevenly can hold KV heads
that serve different numbers of its query heads; it says so in `qkv.kv_groups`, and
attention then runs one KV head's group at a time.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from shardwise.kernels.block import act_block
from shardwise.kernels.decode import DecodeLayout, add_rms_norm, attend, fused_ok, glu
from shardwise.kernels.ops import rms_norm
from shardwise.models.config import ModelConfig

__all__ = [
    "Norm",
    "rope_inv_freq",
    "rope_cos_sin",
    "apply_rope",
    "Attention",
    "MLP",
    "KVCache",
    "attention_mask",
    "ACTIVATIONS",
]

ACTIVATIONS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


class Norm(nn.Module):
    """RMSNorm (weight, optional offset as in Gemma) or LayerNorm (weight and bias)."""

    def __init__(self, dim: int, kind: str, eps: float, offset: float = 0.0) -> None:
        super().__init__()
        self.kind, self.eps, self.offset = kind, eps, offset
        self.weight = nn.Parameter(torch.full((dim,), 1.0 - offset))  # NOTE: no arithmetic, cheap on meta
        self.bias = nn.Parameter(torch.zeros(dim)) if kind == "layer" else None

    def forward(self, x: torch.Tensor, block: int | None = None) -> torch.Tensor:
        """block: the activation block length of the block-format linear that reads the output
        (kernels.block.act_block), quantized in the same native call; None: nothing more."""
        if self.kind == "layer":
            return F.layer_norm(x, x.shape[-1:], self.weight, self.bias, self.eps)
        w = self.weight if not self.offset else self.weight.float() + self.offset
        if x.dtype == w.dtype == torch.float32:  # an fp32 model: no casts, not even no-op ones
            return rms_norm(x, w, self.eps, block)  # the native kernel outside autograd, else F.rms_norm
        return F.rms_norm(x.float(), w.shape, w.float(), self.eps).to(x.dtype)  # fp32 math

    def add_forward(
        self, x: torch.Tensor, a: torch.Tensor, block: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + a, this norm of x + a): a residual add and the norm after it, one native pass
        for an fp32 RMSNorm (shardwise.kernels.decode.add_rms_norm); block as in forward."""
        if self.kind == "rms" and not self.offset and x.dtype == self.weight.dtype == torch.float32:
            return add_rms_norm(x, a, self.weight, self.eps, block)
        s = x + a
        return s, self(s)


def rope_inv_freq(cfg: ModelConfig, device=None) -> torch.Tensor:
    """Inverse frequencies (rotary_dim/2,), with linear or Llama-3 scaling applied."""
    dim = cfg.rotary_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64, device=device) / dim))
    scaling = cfg.rope_scaling or {}
    kind = scaling.get("rope_type", "default")
    if kind == "linear":
        inv = inv / scaling["factor"]
    elif kind == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        low_wavelen, high_wavelen = old_len / low, old_len / high
        smooth = (old_len / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv = torch.where(is_mid, mid, scaled)
    elif kind != "default":
        raise NotImplementedError(f"rope_type {kind!r} is not supported; supported: default, linear, llama3")
    return inv.float()


def rope_cos_sin(
    inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype, *, signed: bool = False
) -> tuple[torch.Tensor, ...]:
    """cos, sin of shape (B, 1, T, rotary_dim) for positions (B, T): computed once per
    forward, already broadcastable over heads. signed=True adds a third, sin_signed (see
    apply_rope), so that no layer has to build it."""
    freqs = positions.float().unsqueeze(-1) * inv_freq  # (B, T, rot/2)
    emb = torch.cat([freqs, freqs], dim=-1).unsqueeze(1)  # (B, 1, T, rot)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    return (cos, sin, _signed(sin)) if signed else (cos, sin)


def _signed(sin: torch.Tensor) -> torch.Tensor:
    """[-sin | sin] by halves of the last dim: rotate-half's signs moved onto sin."""
    half = sin.shape[-1] // 2
    return torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)


def apply_rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sin_signed: torch.Tensor | None = None
) -> torch.Tensor:
    """Rotate the first rotary_dim dims of x (B, H, T, hd) by the rotate-half convention;
    cos, sin: (B, 1, T, rot) from rope_cos_sin, and sin_signed from rope_cos_sin(signed=True)
    when it was precomputed (else it is built here)."""
    rot = cos.shape[-1]
    x_rot = x if rot == x.shape[-1] else x[..., :rot]
    if sin_signed is None:
        sin_signed = _signed(sin)
    # rotate_half(x) * sin = [-x2, x1] * [s, s] = [x2, x1] * [-s, s]: one roll, no neg, no cat
    out = torch.addcmul(x_rot * cos, x_rot.roll(rot // 2, dims=-1), sin_signed)
    return out if rot == x.shape[-1] else torch.cat([out, x[..., rot:]], dim=-1)


def attention_mask(
    pad_mask: torch.Tensor | None, q_len: int, k_len: int, *, causal: bool, window: int | None, device
) -> torch.Tensor | None:
    """Boolean (B or 1, 1, q_len, k_len) mask, True = may attend; None when nothing is masked.

    pad_mask: (B, k_len), 1 for real tokens. Queries are the last q_len keys. Each query
    may always attend to itself, so padded rows stay finite (their outputs are unused).
    """
    if pad_mask is None and not causal:
        return None
    if pad_mask is None and q_len == 1 and (window is None or k_len <= window):
        return None  # one query, no padding: it may attend to every key (a decode step)
    q_pos = torch.arange(k_len - q_len, k_len, device=device).unsqueeze(-1)  # (q, 1)
    k_pos = torch.arange(k_len, device=device).unsqueeze(0)  # (1, k)
    allowed = torch.ones(q_len, k_len, dtype=torch.bool, device=device)
    if causal:
        allowed &= k_pos <= q_pos
        if window is not None:
            allowed &= k_pos > q_pos - window
    allowed = allowed[None, None]  # (1, 1, q, k)
    if pad_mask is not None:
        allowed = allowed & pad_mask.bool()[:, None, None, :]
    return allowed | (k_pos == q_pos)[None, None]


class KVCache:
    """Preallocated keys and values of one attention layer: (B, local KV heads, max_len, head_dim).

    All sequences of a batch share positions: slot t holds the t-th token of every row
    (prompts are left-padded, and the padding is masked).
    """

    def __init__(self, batch: int, max_len: int, kv_heads: int, head_dim: int, *, dtype, device=None) -> None:
        self.max_len = max_len
        self.k = torch.zeros(batch, kv_heads, max_len, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)

    def update(self, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v (B, nkv, T, hd) at slots [start, start + T); return slots [0, start + T)."""
        end = start + k.shape[2]
        if end > self.max_len:
            raise ValueError(f"KV cache holds {self.max_len} positions; writing up to {end}")
        self.k[:, :, start:end] = k
        self.v[:, :, start:end] = v
        return self.k[:, :, :end], self.v[:, :, :end]

    def decode_layout(self, start: int, batch: int) -> DecodeLayout | None:
        """Where a decode step's keys live, for the fused kernel (kernels.decode); None where it cannot run."""
        if self.k.dtype is not torch.float32 or self.k.device.type != "cpu" or self.k.shape[0] != batch:
            return None
        if start + 1 > self.max_len:
            raise ValueError(f"KV cache holds {self.max_len} positions; writing up to {start + 1}")
        _, nkv, L, hd = self.k.shape
        return DecodeLayout(self.k, self.v, pos_stride=hd, head_stride=L * hd, K=start + 1, wbase=start, rrow=nkv * L)

    @staticmethod
    def local_heads(attn: Attention) -> tuple[int, int]:
        """(query heads, KV heads) this module computes: from its weights' shapes, sharded or not."""
        nq = attn.o.weight.shape[1] // attn.head_dim
        return nq, (attn.qkv.weight.shape[0] // attn.head_dim - nq) // 2


class Attention(nn.Module):
    """Multi-head attention with GQA/MQA, a fused [q | k | v] projection, optional q/k norm."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.qkv = nn.Linear(cfg.hidden_size, cfg.qkv_size, bias=cfg.qkv_bias)
        self.o = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=cfg.o_bias)
        self.q_norm = Norm(cfg.head_dim, "rms", cfg.norm_eps, cfg.norm_offset) if cfg.qk_norm else None
        self.k_norm = Norm(cfg.head_dim, "rms", cfg.norm_eps, cfg.norm_offset) if cfg.qk_norm else None
        self.scale = cfg.attn_scale  # None: SDPA's 1 / sqrt(head_dim)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple | None,
        mask: torch.Tensor | None,
        cache: KVCache | None = None,
        start: int = 0,
    ) -> torch.Tensor:
        """x: (B, T, hidden); with a cache, x holds positions [start, start + T) and the
        mask covers every cached key: (B or 1, 1, T, start + T). (Under sequence parallelism
        x holds T / tp positions and qkv gathers the rest: T is read from qkv's output.)"""
        hd = self.head_dim
        h = self.qkv(x)  # (B, T, (nq + 2*nkv) * hd)
        B, T = h.shape[:2]
        nq = self.o.weight.shape[1] // hd  # local query heads, from o's input width
        if T == 1 and cache is not None and fused_ok(h) and h.is_contiguous():
            y = self._fused_step(h, rope, mask, cache, start, nq)  # (B, 1, nq * hd) or None
            if y is not None:
                return self.o(y)  # (B, 1, hidden)
        heads = h.view(B, T, -1, hd).transpose(1, 2)  # (B, nq + 2*nkv, T, hd)
        nkv = (heads.shape[1] - nq) // 2  # local KV heads
        if self.q_norm is not None:
            q, k, v = heads.split([nq, nkv, nkv], dim=1)
            q, k = self.q_norm(q), self.k_norm(k)
            if rope is not None:
                q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        else:  # rotate q and k together: half the kernel launches
            qk, v = heads[:, : nq + nkv], heads[:, nq + nkv :]  # (B, nq + nkv, T, hd), (B, nkv, T, hd)
            if rope is not None:
                qk = apply_rope(qk, *rope)
            q, k = qk[:, :nq], qk[:, nq:]  # (B, nq, T, hd), (B, nkv, T, hd)
        if cache is not None:
            k, v = cache.update(start, k, v)  # (B, nkv, start + T, hd)
        groups = getattr(self.qkv, "kv_groups", None)  # None: plain GQA (see the module docstring)
        y = self.core(q, k, v, mask) if groups is None else self.core(q, k, v, mask, groups=groups)  # (B, nq, T, hd)
        return self.o(y.transpose(1, 2).reshape(B, T, nq * hd))  # (B, T, hidden)

    def _fused_step(self, h: torch.Tensor, rope, mask, cache, start: int, nq: int) -> torch.Tensor | None:
        """One new token per row (h: (B, 1, (nq + 2 nkv) * hd)) through the fused decode kernel:
        rope, the cache write and attention in one call, its output quantized for o when o
        holds blocks; None where it cannot run (the plain path then does the same)."""
        hd, B = self.head_dim, h.shape[0]
        layout = cache.decode_layout(start, B) if hasattr(cache, "decode_layout") else None
        if layout is None or (mask is not None and (mask.shape[-1] != layout.K or not mask.is_contiguous())):
            return None
        if rope is not None and not (rope[0].is_contiguous() and rope[1].is_contiguous()):
            return None
        nkv = (h.shape[-1] // hd - nq) // 2
        if self.q_norm is not None:  # q/k norm before the rotation, written back into h
            heads = h.view(B, -1, hd)  # (B, nq + 2*nkv, hd)
            heads[:, :nq] = self.q_norm(heads[:, :nq])
            heads[:, nq : nq + nkv] = self.k_norm(heads[:, nq : nq + nkv])
        groups = getattr(self.qkv, "kv_groups", None)
        if groups is not None and getattr(self, "_groups_t", (None,))[0] != groups:
            self._groups_t = (groups, torch.tensor(groups, dtype=torch.long))
        g = None if groups is None else self._groups_t[1]
        o_block = self.__dict__.get("_o_block", 0)
        if o_block == 0:  # read once from o's weight; a stale answer costs only speed (the linear checks)
            o_block = self.__dict__["_o_block"] = act_block(self.o.weight)
        return attend(h, rope, mask, layout, nq=nq, nkv=nkv, head_dim=hd, groups=g, scale=self.scale, block=o_block)

    def core(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor | None,
        groups: tuple[int, ...] | None = None,
    ) -> torch.Tensor:
        """softmax(q k^T * scale, masked) v (scale 1 / sqrt(hd) unless the config says): the attention core, which selective activation
        recomputation recomputes in backward (shardwise.train.recompute).
        q: (B, nq, T, hd); k, v: (B, nkv, S, hd); returns (B, nq, T, hd).
        groups: query heads per KV head when they differ (sum(groups) == nq)."""
        if groups is None:
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1], scale=self.scale
            )
        out = [
            F.scaled_dot_product_attention(
                qg, k[:, h : h + 1], v[:, h : h + 1], attn_mask=mask, enable_gqa=True, scale=self.scale
            )
            for h, qg in enumerate(q.split(list(groups), dim=1))  # (B, g_h, T, hd) with KV head h
        ]
        return torch.cat(out, dim=1)


class MLP(nn.Module):
    """Gated: down(act(gate(x)) * up(x)), gate and up fused as [gate | up]. Plain: down(act(up(x)))."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.act = ACTIVATIONS[cfg.act]
        self.act_name = cfg.act
        self.gated = cfg.gated_mlp
        width = 2 * cfg.intermediate_size if cfg.gated_mlp else cfg.intermediate_size
        self.up = nn.Linear(cfg.hidden_size, width, bias=cfg.mlp_bias)
        self.down = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)  # (B, T, [2 *] inter), / tp when sharded
        if self.gated:  # act(gate) * up: one native call where it can run (kernels.decode.glu)
            block = self.__dict__.get("_down_block", 0)
            if block == 0:  # quantized for down in the same call, when down holds blocks
                block = self.__dict__["_down_block"] = act_block(self.down.weight)
            return self.down(glu(h, self.act_name, self.act, block))
        return self.down(self.act(h))
