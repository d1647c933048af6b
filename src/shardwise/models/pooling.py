"""Sentence embeddings from an encoder's hidden states."""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["mean_pool"]


def mean_pool(hidden: torch.Tensor, attention_mask: torch.Tensor | None, normalize: bool = False) -> torch.Tensor:
    """Mean of hidden (B, T, H) over the real tokens (attention_mask (B, T), 1 = real) -> (B, H).

    Padded positions are left out; a row with no real token gives zeros. The sum runs
    in float32 at least, and the result is cast back to hidden's dtype. normalize=True
    scales each embedding to unit L2 norm (for cosine similarity).
    """
    acc = torch.promote_types(hidden.dtype, torch.float32)
    h = hidden.to(acc)
    if attention_mask is None:
        out = h.mean(dim=1)  # (B, H)
    else:
        m = attention_mask.to(acc).unsqueeze(-1)  # (B, T, 1)
        out = (h * m).sum(dim=1) / m.sum(dim=1).clamp(min=1.0)  # (B, H)
    if normalize:
        out = F.normalize(out, p=2, dim=-1)
    return out.to(hidden.dtype)
