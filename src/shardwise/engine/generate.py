"""Batched generation on one tensor-parallel group: prefill, then one decode step per token.

Every rank of the group runs this same code on the same prompts. Each step is a full
sharded forward (its collectives are inside the model's layers), then rank 0 samples
the next tokens and broadcasts them, so every rank takes the same decisions. Greedy
decoding over a vocab-parallel head leaves the logits split instead: every rank takes its
shard's best and one all-gather of those gives every rank the same token (engine.argmax).

    prefill      prompts (B, L), left-padded  -> KV caches filled, first new token
    decode_step  last tokens (B, 1)           -> next token, one KV slot per step

Across pipeline stages (`stages=`, shardwise.engine.pipeline) the same loop runs on every
rank; each forward passes stage to stage and the sampled tokens reach every rank.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from shardwise.comm import Communicator
from shardwise.engine.argmax import split_head, split_logits, vocab_parallel_argmax
from shardwise.engine.pipeline import StageForward
from shardwise.engine.sampling import SamplingParams, sample_on_rank0
from shardwise.models.decoder import DecoderLM
from shardwise.models.modules import KVCache

__all__ = ["GenerationResult", "generate", "prefill", "decode_step", "validate_prompts", "PromptError"]


class PromptError(ValueError):
    """A prompt the model cannot take: empty, out of vocabulary, or too long."""


@dataclass
class GenerationResult:
    tokens: list[list[int]]
    """Generated ids per prompt, without the stop token."""
    finish_reasons: list[str]
    """Per prompt: "stop" (a stop token) or "length" (max_new_tokens)."""
    prefill_ms: float
    decode_ms: list[float] = field(default_factory=list)
    """Wall time of each decode step."""
    comm_per_step: dict = field(default_factory=dict)
    """Collectives of one decode step (calls and bytes per op/group), from the accounting."""


def validate_prompts(prompts: Sequence[Sequence[int]], vocab_size: int, max_len: int, max_new_tokens: int) -> None:
    """Refuse bad prompts before any collective runs (every rank checks the same thing)."""
    if not prompts:
        raise PromptError("no prompts given")
    if max_new_tokens < 1:
        raise PromptError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise PromptError(f"prompt {i} is empty")
        bad = [t for t in p if not 0 <= t < vocab_size]
        if bad:
            raise PromptError(f"prompt {i} has token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")
        if len(p) + max_new_tokens > max_len:
            raise PromptError(
                f"prompt {i} has {len(p)} tokens; with max_new_tokens={max_new_tokens} that is "
                f"{len(p) + max_new_tokens}, over the model's context of {max_len}"
            )


def prefill(model: DecoderLM, ids: torch.Tensor, mask: torch.Tensor, caches: list[KVCache]) -> torch.Tensor:
    """ids, mask: (B, L) -> logits of the next token (B, V); fills slots [0, L) of the caches."""
    return model(ids, attention_mask=mask, caches=caches, start=0, last_only=True)[:, -1]


def decode_step(
    model: DecoderLM, tokens: torch.Tensor, mask: torch.Tensor | None, caches: list[KVCache], start: int
) -> torch.Tensor:
    """tokens: (B, 1) at slot `start`; mask: (B, start + 1), or None when no row is padded
    -> logits of the next token (B, V)."""
    return model(tokens, attention_mask=mask, caches=caches, start=start, last_only=True)[:, -1]


@torch.no_grad()
def generate(
    model: DecoderLM,
    prompts: Sequence[Sequence[int]],
    *,
    comm: Communicator,
    max_new_tokens: int,
    sampling: SamplingParams | None = None,
    stop_ids: Sequence[int] = (),
    on_tokens: Callable[[list[int | None]], None] | None = None,
    stages: StageForward | None = None,
) -> GenerationResult:
    """Generate for a batch of prompts of any lengths. on_tokens(step_tokens) is called after
    every step with each prompt's new token (None once that prompt has finished).

    stages: this rank's pipeline stage (model cut to it); `comm` is then its tp group."""
    cfg = model.cfg
    sampling = sampling or SamplingParams()
    validate_prompts(prompts, cfg.vocab_size, cfg.max_positions, max_new_tokens)
    B, L = len(prompts), max(len(p) for p in prompts)
    ids = torch.zeros(B, L, dtype=torch.long)
    mask = torch.zeros(B, L, dtype=torch.long)
    for i, p in enumerate(prompts):  # left padding: every row's last token sits at slot L - 1
        ids[i, L - len(p) :] = torch.tensor(p)
        mask[i, L - len(p) :] = 1
    device = next(model.parameters()).device  # the model's (a GPU's, if it was moved there)
    ids, mask = ids.to(device), mask.to(device)
    if stages is None:  # one stage: the whole model on this tp group
        caches = model.new_caches(B, L + max_new_tokens)
        gen = sampling.generator() if comm.rank == 0 else None
        head = split_head(model) if sampling.greedy else None  # greedy: the logits stay split (engine.argmax)

        def forward(x, m, start):
            with split_logits(model) if head is not None else contextlib.nullcontext():
                return prefill(model, x, m, caches) if start == 0 else decode_step(model, x, m, caches, start)

        def choose(logits):
            if head is not None:
                return vocab_parallel_argmax(logits, head)
            return sample_on_rank0(logits, sampling, gen, comm)
    else:
        caches = stages.new_caches(B, L + max_new_tokens)
        gen = sampling.generator() if stages.samples else None

        def forward(x, m, start):
            logits = stages.forward(x, m, caches, start)  # (B, 1, V) on the last stage
            return logits[:, -1] if logits is not None else None

        def choose(logits):
            return stages.choose(logits, B, sampling, gen)

    stops = set(stop_ids)

    t0 = time.perf_counter()
    tok = choose(forward(ids, mask, 0))  # (B,)
    result = GenerationResult([[] for _ in prompts], ["length"] * B, (time.perf_counter() - t0) * 1e3)
    done = [False] * B
    padded = bool((mask == 0).any())  # without padding, decode steps need no mask at all
    for step in range(max_new_tokens):
        emitted: list[int | None] = []
        for i, t in enumerate(tok.tolist()):
            if done[i]:
                emitted.append(None)
            elif t in stops:
                done[i], result.finish_reasons[i] = True, "stop"
                emitted.append(None)
            else:
                result.tokens[i].append(t)
                emitted.append(t)
        if on_tokens is not None:
            on_tokens(emitted)
        if all(done) or step == max_new_tokens - 1:
            break
        if padded:  # grows by one real key per step; unpadded steps need no mask, so build none
            mask = torch.cat([mask, torch.ones(B, 1, dtype=mask.dtype, device=device)], dim=1)  # (B, L + step + 1)
        t0 = time.perf_counter()
        with comm.stats.track() as one_step:
            tok = choose(forward(tok.unsqueeze(1), mask if padded else None, L + step))
        result.decode_ms.append((time.perf_counter() - t0) * 1e3)
        result.comm_per_step = one_step.snapshot()
    return result
