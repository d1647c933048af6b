"""Perplexity of a causal LM over a long token stream, by sliding windows.

    spans = windows(n_tokens=14, context=8, stride=4)     # [Window(0, 8, 1), Window(4, 12, 8), Window(8, 14, 12)]
    res = perplexity(model, ids, context=256, stride=128)  # one stage: the whole model on a tp group
    res = perplexity(model, ids, context=256, stages=StageForward(model, mesh))  # across pipeline stages
    res.tokens, res.mean_nll, res.ppl                      # the same on every rank

The windows are Hugging Face's ("Perplexity of fixed-length models"): window k reads the
tokens [k * stride, k * stride + context), cut at the end of the text, and scores only the
tokens no earlier window scored, each from all the tokens before it in the window. With
context 8 and stride 4 over 14 tokens:

    window 0  reads [0, 8)    scores 1..7    (token 0 has nothing before it)
    window 1  reads [4, 12)   scores 8..11   (each with at least context - stride = 4 before it)
    window 2  reads [8, 14)   scores 12..13

Every token but the first is scored exactly once. stride = context (the default) gives
disjoint windows: the first token of each window is then not scored (no left context in
its window), so N tokens in W windows score N - W.

NLL is -log softmax(logits)[next token], in fp32 whatever the model's dtype, summed in
fp64; perplexity = exp(mean NLL). Windows are batched `batch` at a time, right-padded to
the longest: under causal attention a row's real positions never see its padding.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn
from tqdm import tqdm

from shardwise.engine.pipeline import StageForward

__all__ = ["Window", "PerplexityResult", "windows", "check_windows", "window_nll", "perplexity"]


class Window(NamedTuple):
    """Tokens [begin, end) are read; tokens [first, end) are scored, token t from [begin, t)."""

    begin: int
    end: int
    first: int


def check_windows(n_tokens: int, context: int, stride: int, max_positions: int | None = None) -> None:
    """Raise ValueError, naming the numbers, when these windows cannot score the text."""
    if max_positions is not None and context > max_positions:
        raise ValueError(f"context {context} is more than the model's {max_positions} positions")
    if context < 2:
        raise ValueError(f"context must be >= 2 tokens (one to read, one to score), got {context}")
    if not 1 <= stride <= context:
        raise ValueError(f"stride must be between 1 and the context ({context}), got {stride}")
    if n_tokens < 2:
        raise ValueError(f"the text is {n_tokens} token(s) long; perplexity needs at least 2")


def windows(n_tokens: int, context: int, stride: int | None = None) -> list[Window]:
    """The windows over n_tokens tokens (stride default: context, disjoint windows)."""
    stride = context if stride is None else stride
    check_windows(n_tokens, context, stride)
    out, scored_to = [], 0  # tokens [0, scored_to) are scored (or, token 0, cannot be)
    for begin in range(0, n_tokens, stride):
        end = min(begin + context, n_tokens)
        out.append(Window(begin, end, max(scored_to, begin + 1)))
        scored_to = end
        if end == n_tokens:
            break
    return out


def window_nll(logits: torch.Tensor, ids: torch.Tensor, window: Window) -> torch.Tensor:
    """logits: (T, V) over the window's tokens ids (T,), T >= end - begin (padding after is
    ignored) -> NLL (end - first,) fp64 of the tokens [first, end): token t from logits[t - begin - 1]."""
    lo, hi = window.first - window.begin, window.end - window.begin  # scored positions in the window
    logp = logits[lo - 1 : hi - 1].float().log_softmax(dim=-1)  # (n, V)
    return -logp.gather(-1, ids[lo:hi].unsqueeze(-1)).squeeze(-1).double()  # (n,)


@dataclass(frozen=True)
class PerplexityResult:
    tokens: int
    """Tokens scored (every token but the first of the text, or of each disjoint window)."""
    nll_sum: float
    """Sum of their negative log-likelihoods, nats."""
    windows: int
    wall_s: float
    """Seconds spent scoring (after loading), on this rank."""

    @property
    def mean_nll(self) -> float:
        return self.nll_sum / self.tokens

    @property
    def ppl(self) -> float:
        return math.exp(self.mean_nll)


@torch.no_grad()
def perplexity(
    model: nn.Module,
    ids: Sequence[int] | torch.Tensor,
    *,
    context: int,
    stride: int | None = None,
    batch: int = 4,
    stages: StageForward | None = None,
    progress: bool = False,
) -> PerplexityResult:
    """Perplexity of `ids` (N,) under `model` (a DecoderLM, sharded or not; at pp > 1 this
    rank's stage, with `stages` its StageForward). The logits must be whole (the default
    plans gather them), so every rank of the last stage computes the same NLL; at pp > 1 the
    last stage broadcasts the totals over the world at the end. Every rank returns the result."""
    if batch < 1:
        raise ValueError(f"batch must be >= 1 window, got {batch}")
    device = next(model.parameters()).device
    ids = torch.as_tensor(ids, dtype=torch.long, device=device)  # (N,)
    spans = windows(ids.numel(), context, stride)
    scores = stages is None or stages.mesh.is_last_stage  # ranks that see logits
    nll = torch.zeros((), dtype=torch.float64, device=device)
    t0 = time.perf_counter()
    bar = tqdm(total=len(spans), desc="scoring windows", unit="window", disable=not progress, delay=0.5)
    for i in range(0, len(spans), batch):
        chunk = spans[i : i + batch]
        T = max(w.end - w.begin for w in chunk)
        x = torch.zeros(len(chunk), T, dtype=torch.long, device=device)  # (B, T), right-padded with id 0
        for row, w in enumerate(chunk):
            x[row, : w.end - w.begin] = ids[w.begin : w.end]
        # (B, T, V), None on a stage before the last: no mask, positions from 0 in every window
        logits = model(x) if stages is None else stages.forward(x, None, None, last_only=False)
        if scores:
            for row, w in enumerate(chunk):
                nll += window_nll(logits[row], x[row], w).sum()
        bar.update(len(chunk))
    bar.close()
    if stages is not None:  # the totals live on the last stage: one broadcast, after the last window
        nll = stages.mesh.world.broadcast(nll.reshape(1), src=stages.sampler)[0]
    tokens = sum(w.end - w.first for w in spans)
    return PerplexityResult(tokens, nll.item(), len(spans), time.perf_counter() - t0)
