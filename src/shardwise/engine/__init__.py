"""Inference: KV-cached batched generation on a tensor-parallel group (and across pipeline
stages), and sampling."""

from shardwise.engine.generate import GenerationResult, PromptError, decode_step, generate, prefill, validate_prompts
from shardwise.engine.pipeline import StageForward, stage_layout
from shardwise.engine.sampling import SamplingParams, sample, sample_on_rank0

__all__ = [
    "GenerationResult",
    "PromptError",
    "generate",
    "prefill",
    "decode_step",
    "validate_prompts",
    "StageForward",
    "stage_layout",
    "SamplingParams",
    "sample",
    "sample_on_rank0",
]
