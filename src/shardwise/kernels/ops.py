"""The one function per operation that every layer calls, whatever its weight holds.

    linear(x, w, b)          w: a float Tensor (F.linear, or in training kernels.wgrad's
                             linear that accumulates w.grad itself), a BlockWeight (block-format
                             kernels: shardwise.kernels.block) or a QuantizedWeight (fp16
                             on fbgemm, CUDA int8: shardwise.kernels.packed)
    embedding(ids, w)        rows of a float table, or of a BlockWeight / QuantizedTable
    expert_blocks(w, E)      each expert's (rows, in) weight of a stacked expert tensor
    rms_norm(x, w, eps)      F.rms_norm over the last dim; the native kernel for fp32 on the
                             CPU outside autograd (a decode step's most frequent small op)
    argmax(logits)           greedy sampling's argmax over the last dim: the native one pass
                             for fp32 on the CPU, else torch.argmax (the same indices)

Layers and models never name a format, a device or an instruction set: the weight object
chose its kernel when it was built (at load), and the native module its ISA at import.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shardwise.kernels import native, wgrad
from shardwise.kernels.block import _ACT_BYTES as ACT_BYTES
from shardwise.kernels.block import offer_blocks

__all__ = ["linear", "embedding", "expert_blocks", "rms_norm", "argmax"]


def linear(x: torch.Tensor, w, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x w^T + b for a float weight (F.linear; in training, for a weight the trainer opted in,
    the linear that accumulates its gradient itself: kernels.wgrad) or a converted one (its kernel)."""
    if isinstance(w, torch.Tensor):
        if wgrad.fused(w):
            return wgrad.linear(x, w, bias)
        return F.linear(x, w, bias)
    return w.linear(x, bias)


def embedding(ids: torch.Tensor, w) -> torch.Tensor:
    """Rows `ids` of a float table (F.embedding) or of a converted one (rows dequantized)."""
    if isinstance(w, torch.Tensor):
        if wgrad.fused(w):
            return wgrad.embedding(ids, w)
        return F.embedding(ids, w)
    return w.lookup(ids)


def expert_blocks(w, num_experts: int) -> list:
    """Each expert's weight of a stacked (E * rows, in) expert tensor: views of a float
    tensor or of a BlockWeight's rows, or the blocks of a QuantizedExperts."""
    if isinstance(w, torch.Tensor):
        return list(w.view(num_experts, -1, w.shape[1]).unbind(0))
    if hasattr(w, "narrow"):
        per = w.shape[0] // num_experts
        return [w.narrow(e * per, per) for e in range(num_experts)]
    return w.blocks


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, block: int | None = None) -> torch.Tensor:
    """x (..., k) fp32 -> x / sqrt(mean(x^2) + eps) * w. The native kernel (csrc/norm.c: one
    call and one pass per row) where it can run: an fp32 CPU tensor and weight, nothing to
    differentiate; else F.rms_norm. block (32 or 256): also quantize the result to activation
    blocks in the same call, for the block-format linear that reads it next (kernels.block)."""
    lib = native.lib
    if (
        lib is None
        or x.device.type != "cpu"
        or x.dtype is not torch.float32
        or w.dtype is not torch.float32
        or (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad))
    ):
        return F.rms_norm(x, w.shape, w, eps)
    k = x.shape[-1]
    if not x.is_contiguous():
        x = x.contiguous()
    if not w.is_contiguous():
        w = w.contiguous()
    out = torch.empty_like(x)  # (..., k)
    n = x.numel() // k if k else 0
    if block is None or k % block or not n:
        lib.rmsnorm(native.isa(), x.data_ptr(), k, n, k, w.data_ptr(), float(eps), out.data_ptr(), k)
        return out
    blocks = torch.empty(n * (k // block) * ACT_BYTES[block], dtype=torch.uint8)
    lib.rmsnorm(
        native.isa(), x.data_ptr(), k, n, k, w.data_ptr(), float(eps), out.data_ptr(), k, block, blocks.data_ptr()
    )
    offer_blocks(out, block, blocks)
    return out


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits (..., V) -> the index of each row's largest value (..., ), int64, as
    torch.argmax(dim=-1): the first of equal ones, a NaN the largest. Natively (csrc/norm.c)
    for fp32 on the CPU: 1.5 ms for a (16, 128256) batch on one thread, torch.argmax 3.0, in the
    serial part of a batched decode step (rank 0, between the LM head and the next step)."""
    lib = native.lib
    if lib is None or logits.device.type != "cpu" or logits.dtype is not torch.float32 or logits.shape[-1] == 0:
        return logits.argmax(dim=-1)
    v = logits.shape[-1]
    x = logits.reshape(-1, v)
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty(x.shape[0], dtype=torch.long)  # (rows,)
    if x.shape[0]:
        lib.argmax(x.data_ptr(), x.stride(0) if x.shape[0] > 1 else v, x.shape[0], v, out.data_ptr())
    return out.view(logits.shape[:-1])
