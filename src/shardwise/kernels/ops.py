"""The one function per operation that every layer calls, whatever its weight holds.

    linear(x, w, b)          w: a float Tensor (F.linear), a BlockWeight (block-format
                             kernels: shardwise.kernels.block) or a QuantizedWeight (fp16
                             on fbgemm, CUDA int8: shardwise.kernels.packed)
    embedding(ids, w)        rows of a float table, or of a BlockWeight / QuantizedTable
    expert_blocks(w, E)      each expert's (rows, in) weight of a stacked expert tensor

Layers and models never name a format, a device or an instruction set: the weight object
chose its kernel when it was built (at load), and the native module its ISA at import.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["linear", "embedding", "expert_blocks"]


def linear(x: torch.Tensor, w, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x w^T + b for a float weight (F.linear) or a converted one (its kernel)."""
    if isinstance(w, torch.Tensor):
        return F.linear(x, w, bias)
    return w.linear(x, bias)


def embedding(ids: torch.Tensor, w) -> torch.Tensor:
    """Rows `ids` of a float table (F.embedding) or of a converted one (rows dequantized)."""
    if isinstance(w, torch.Tensor):
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
