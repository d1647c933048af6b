"""Choosing the next token: greedy, temperature, top-k, top-p, with a seed.

The choice is made on one rank and broadcast to the others (`sample_on_rank0`), never
drawn independently per rank: ranks whose random states differ would otherwise pick
different tokens, and the job would silently diverge.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardwise.comm import Communicator
from shardwise.kernels import ops as kernel_ops

__all__ = ["SamplingParams", "sample", "sample_on_rank0"]


@dataclass(frozen=True)
class SamplingParams:
    """How to pick a token from the logits. temperature=0 means greedy."""

    temperature: float = 0.0
    """0 = greedy (argmax); otherwise logits are divided by it before sampling."""
    top_k: int = 0
    """Keep only the k most likely tokens (0 = all)."""
    top_p: float = 1.0
    """Keep the smallest set of tokens whose probability adds up to top_p (1 = all)."""
    seed: int | None = None
    """Seed of the sampling generator on rank 0 (None = nondeterministic)."""

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def generator(self) -> torch.Generator:
        g = torch.Generator()
        if self.seed is None:
            g.seed()
        else:
            g.manual_seed(self.seed)
        return g


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None) -> torch.Tensor:
    """logits: (B, V) -> token ids (B,)."""
    if params.greedy:
        return kernel_ops.argmax(logits)
    z = logits.float() / params.temperature  # (B, V)
    if params.top_k:
        kth = torch.topk(z, min(params.top_k, z.shape[-1]), dim=-1).values[:, -1:]  # (B, 1)
        z = z.masked_fill(z < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_z, order = torch.sort(z, dim=-1, descending=True)
        probs = sorted_z.softmax(dim=-1)
        # drop a token when the tokens before it already reach top_p (the first always stays)
        drop = probs.cumsum(dim=-1) - probs >= params.top_p
        z = z.scatter(-1, order, sorted_z.masked_fill(drop, float("-inf")))
    probs = z.softmax(dim=-1)
    # drawn on the CPU with the CPU generator, so a seed gives the same draws on any device
    return torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(-1).to(logits.device)


def sample_on_rank0(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None, comm: Communicator
) -> torch.Tensor:
    """Sample on rank 0 of `comm` and broadcast, so every rank continues with the same token."""
    tokens = (
        sample(logits, params, generator)
        if comm.rank == 0
        else torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
    )
    return comm.broadcast(tokens, src=0)
