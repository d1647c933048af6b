"""The fused operations of a decode step (one new token per row), native where they can run.

    attend(qkv, rope, mask, layout, ...)   rotary embedding, the KV-cache write and one query
                                           per row attending over the cache (GQA): one call
    glu(h, act)                            act(gate) * up of a gated MLP's [gate | up]
    add_rms_norm(x, a, w, eps)             the residual add and the next RMSNorm: one pass

Each can also quantize its output to the 8-bit activation blocks the next block-format
linear reads (block=32 or 256, kernels.block.act_block), in the same call: the linear then
takes them (kernels.block.offer_blocks) instead of quantizing its input itself.

Each runs csrc/attn.c or csrc/norm.c (portable, AVX2 or AVX-512, as the native module chose
at import) on fp32 CPU tensors outside autograd. Otherwise glu and add_rms_norm compute the
same in PyTorch, and `attend_layout` answers None: the model then runs its plain path
(rope, cache.update, scaled_dot_product_attention), which is also what the fused kernel is
tested against (tests/unit/test_decode_kernels.py).

A cache says where row b's keys live (`DecodeLayout`), so one kernel serves the generate
cache (B, nkv, max_len, hd), the slot cache and the paged pool (positions, nkv, hd):

    key j of row b, head h      k + idx(b, j) * pos_stride + h * head_stride
    idx(b, j)                   ridx[b, j] when the cache maps positions (slot, paged),
                                else b * rrow + j
    row b's new key and value   at widx[b], else at wbase + b * rrow
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from shardwise.kernels import native
from shardwise.kernels.block import _ACT_BYTES as ACT_BYTES
from shardwise.kernels.block import offer_blocks

__all__ = ["DecodeLayout", "fused_ok", "unfused", "attend", "rope_mask_args", "glu", "add_rms_norm", "GLU_KINDS"]

FUSED = os.environ.get("SHARDWISE_FUSED_DECODE", "1") != "0"
"""SHARDWISE_FUSED_DECODE=0 runs every decode step on the plain PyTorch path (`unfused()` in code)."""

GLU_KINDS = {"silu": 0, "gelu_tanh": 1}
"""Gated activations the native kernel computes (csrc/attn.c), by kind number."""


@dataclass(frozen=True)
class DecodeLayout:
    """Where one layer's cache keeps row b's keys and values (see the module docstring)."""

    k: torch.Tensor
    v: torch.Tensor
    pos_stride: int
    head_stride: int
    K: int  # keys each row attends over (masked ones included)
    wbase: int = 0
    rrow: int = 0
    widx: torch.Tensor | None = None  # (B,) int64
    ridx: torch.Tensor | None = None  # (B, K) int64, contiguous


def fused_ok(x: torch.Tensor) -> bool:
    """Whether the native decode kernels can take x: built, fp32, CPU, nothing to differentiate."""
    return (
        FUSED
        and native.lib is not None
        and x.dtype is torch.float32
        and x.device.type == "cpu"
        and not (torch.is_grad_enabled() and x.requires_grad)
    )


@contextlib.contextmanager
def unfused() -> Iterator[None]:
    """Inside the block the fused kernels stand aside: every op takes its plain path (the
    reference the fused ones are tested and benchmarked against)."""
    global FUSED
    before, FUSED = FUSED, False
    try:
        yield
    finally:
        FUSED = before


def rope_mask_args(rope, mask: torch.Tensor | None, B: int, K: int) -> tuple[int, int, int, int, int, int]:
    """(cos, sin, ldr, rot, mask, ldm) as the native attention takes them: pointers as integers
    (0: none), ldr / ldm 0 when one row of the table serves every row of the batch."""
    cos_p = sin_p = ldr = rot = mask_p = ldm = 0
    if rope is not None:
        cos, sin = rope[0], rope[1]
        rot = cos.shape[-1]
        cos_p, sin_p, ldr = cos.data_ptr(), sin.data_ptr(), rot if cos.shape[0] == B else 0
    if mask is not None:
        mask_p, ldm = mask.data_ptr(), K if mask.shape[0] == B else 0
    return cos_p, sin_p, ldr, rot, mask_p, ldm


def attend(
    qkv: torch.Tensor,
    rope: tuple | None,
    mask: torch.Tensor | None,
    layout: DecodeLayout,
    *,
    nq: int,
    nkv: int,
    head_dim: int,
    groups: torch.Tensor | None,
    scale: float | None,
    block: int | None = None,
) -> torch.Tensor:
    """qkv (B, 1, (nq + 2 nkv) * hd) fp32, contiguous: one new token per row, [q | k | v] heads;
    rotated in place. rope: (cos, sin, ...) of shape (B or 1, 1, 1, rot) from rope_cos_sin, or
    None; mask: (B or 1, 1, 1, K) bool (True = may attend) or None; groups: (nkv,) int64 query
    heads per KV head when they differ, else None. Writes each row's k, v into the cache
    through `layout` and returns the attention output (B, 1, nq * hd). block: also quantize
    the output to activation blocks in the same call, for the block-format o projection."""
    B = qkv.shape[0]
    out = torch.empty(B, 1, nq * head_dim)  # (B, 1, nq * hd)
    cos_p, sin_p, ldr, rot, mask_p, ldm = rope_mask_args(rope, mask, B, layout.K)
    args = [
        native.isa(), qkv.data_ptr(), qkv.stride(0), B, nq, nkv, head_dim,
        0 if groups is None else groups.data_ptr(), cos_p, sin_p, ldr, rot,
        layout.k.data_ptr(), layout.v.data_ptr(), layout.pos_stride, layout.head_stride,
        0 if layout.widx is None else layout.widx.data_ptr(), layout.wbase,
        0 if layout.ridx is None else layout.ridx.data_ptr(), layout.rrow, layout.K, mask_p, ldm,
        float(scale if scale is not None else 1.0 / math.sqrt(head_dim)), out.data_ptr(), out.stride(0),
    ]  # fmt: skip
    if block is None or (nq * head_dim) % block:
        native.lib.attend(*args)
        return out
    blocks = torch.empty(B * (nq * head_dim // block) * ACT_BYTES[block], dtype=torch.uint8)
    native.lib.attend(*args, block, blocks.data_ptr())
    offer_blocks(out, block, blocks)
    return out


def glu(h: torch.Tensor, act: str, fallback, block: int | None = None) -> torch.Tensor:
    """h (..., 2 * inter) = [gate | up] -> act(gate) * up (..., inter). `act` names the
    activation (GLU_KINDS are native); fallback: the activation function, for the PyTorch path.
    block: also quantize the result to activation blocks in the same call (the down projection's)."""
    kind = GLU_KINDS.get(act)
    if kind is None or not fused_ok(h) or not h.is_contiguous():
        gate, up = h.chunk(2, dim=-1)
        return fallback(gate) * up
    inter = h.shape[-1] // 2
    out = torch.empty(*h.shape[:-1], inter)  # (..., inter)
    n = h.numel() // h.shape[-1] if h.shape[-1] else 0
    args = [native.isa(), h.data_ptr(), h.shape[-1], n, inter, kind, out.data_ptr(), inter]
    if block is None or inter % block or not n:
        native.lib.glu(*args)
        return out
    blocks = torch.empty(n * (inter // block) * ACT_BYTES[block], dtype=torch.uint8)
    native.lib.glu(*args, block, blocks.data_ptr())
    offer_blocks(out, block, blocks)
    return out


def add_rms_norm(
    x: torch.Tensor, a: torch.Tensor, w: torch.Tensor, eps: float, block: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + a, RMSNorm(x + a) * w) over the last dim, one pass natively (fp32 CPU, no autograd,
    same shapes); else torch's add and F.rms_norm. block: also quantize the norm's output to
    activation blocks in the same call (kernels.ops.rms_norm)."""
    if not (
        fused_ok(x) and fused_ok(a) and fused_ok(w) and x.shape == a.shape and x.is_contiguous() and a.is_contiguous()
    ):
        s = x + a
        return s, F.rms_norm(s, w.shape, w, eps)
    k = x.shape[-1]
    s, out = torch.empty_like(x), torch.empty_like(x)
    n = x.numel() // k if k else 0
    args = [native.isa(), x.data_ptr(), a.data_ptr(), n, k, w.contiguous().data_ptr(), float(eps), s.data_ptr()]
    if block is None or k % block or not n:
        native.lib.add_rmsnorm(*args, out.data_ptr())
        return s, out
    blocks = torch.empty(n * (k // block) * ACT_BYTES[block], dtype=torch.uint8)
    native.lib.add_rmsnorm(*args, out.data_ptr(), block, blocks.data_ptr())
    offer_blocks(out, block, blocks)
    return s, out
