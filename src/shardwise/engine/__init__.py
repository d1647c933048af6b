"""Inference: KV-cached batched generation on a tensor-parallel group, and sampling."""

from shardwise.engine.generate import GenerationResult, PromptError, decode_step, generate, prefill, validate_prompts
from shardwise.engine.sampling import SamplingParams, sample, sample_on_rank0

__all__ = [
    "GenerationResult",
    "PromptError",
    "generate",
    "prefill",
    "decode_step",
    "validate_prompts",
    "SamplingParams",
    "sample",
    "sample_on_rank0",
]
