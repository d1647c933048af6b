"""Models of the automatic plan (shardwise.hf.auto) as the engine drives them: transformers'
own causal LM, its nn.Linear layers sharded (their forward does the collectives), on
transformers' own KV cache (a DynamicCache) instead of shardwise's.

    lm = AutoLM(model)                                  # load_pretrained's model, family "auto:<type>"
    generate(lm, prompts, comm=tp, max_new_tokens=16)   # engine/generate.py, unchanged
    perplexity(lm, ids, context=256)                    # engine/perplexity.py, unchanged
    steps = OneSequence(lm); steps.forward(batch)       # serve: one request at a time

AutoLM answers the DecoderLM calls those loops make, with the same meaning:

    lm(ids, attention_mask=mask, caches=cache, start=s, last_only=True)  -> logits (B, 1, V)
    lm(ids)                                                              -> logits (B, T, V)
    lm.new_caches(B, max_len)                                            -> a fresh DynamicCache
    lm.cfg.vocab_size, .max_positions, .hidden_size, .dtype              (AutoModelInfo)

Positions follow transformers' generate: left-padded rows count from their first real
token (attention_mask.cumsum - 1); without a mask a step's T tokens sit at start..start+T-1.
The automatic plan's LM head gathers the vocabulary (Vocab(gather_output=True)), so every
rank holds the whole logits; the loops sample on rank 0 and broadcast (engine/sampling.py).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from shardwise.engine.slots import StepBatch

__all__ = ["AutoModelInfo", "AutoLM", "OneSequence"]


@dataclass(frozen=True)
class AutoModelInfo:
    """What the engine and the CLI read off a transformers config (the fields a ModelConfig
    gives a shardwise family, under the same names)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    max_positions: int
    """max_position_embeddings: prompt plus new tokens."""
    causal: bool
    """transformers builds it as a causal LM (an LM head to the vocabulary)."""
    dtype: str = "float32"

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "max_positions"):
            if getattr(self, name) < 1:
                raise ValueError(f"{self.model_type}: {name} must be >= 1, got {getattr(self, name)}")

    @staticmethod
    def of(hf_config, dtype: str = "float32") -> AutoModelInfo:
        """From a transformers config (ValueError, one line, when it lacks a size)."""
        import transformers

        text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
        sizes = {k: getattr(text, k, None) for k in ("vocab_size", "hidden_size", "max_position_embeddings")}
        missing = [k for k, v in sizes.items() if not isinstance(v, int)]
        if missing:
            raise ValueError(f"model_type {hf_config.model_type!r}: its config has no {', '.join(missing)}")
        return AutoModelInfo(
            model_type=hf_config.model_type,
            vocab_size=sizes["vocab_size"],
            hidden_size=sizes["hidden_size"],
            max_positions=sizes["max_position_embeddings"],
            causal=type(hf_config) in transformers.MODEL_FOR_CAUSAL_LM_MAPPING,
            dtype=dtype,
        )

    @staticmethod
    def load(path: str | Path) -> AutoModelInfo:
        """From a checkpoint directory's config.json, through transformers (no weight read)."""
        import transformers

        return AutoModelInfo.of(transformers.AutoConfig.from_pretrained(path, trust_remote_code=False))


class AutoLM(nn.Module):
    """A transformers causal LM (sharded by the automatic plan, or not) behind DecoderLM's calls."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        dtype = model.config.dtype or torch.float32  # what load_auto built it in
        dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype  # a config may hold its name
        self.cfg = AutoModelInfo.of(model.config, dtype=str(dtype).replace("torch.", ""))
        if not self.cfg.causal:
            raise ValueError(
                f"model_type {self.cfg.model_type!r} is not a causal LM (transformers gives it no LM head)"
            )
        params = inspect.signature(model.forward).parameters
        # NOTE: transformers 5 renamed past_key_values to cache (the old name warns, then goes)
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._keep = "logits_to_keep" in params  # prefill computes the head on the last token only
        device = next((t.device for t in (*model.parameters(), *model.buffers())), torch.device("cpu"))
        # NOTE: with every weight quantized a model may hold no parameter at all (OLMo's norms have
        # none); the engine's loops find the device and dtype as next(model.parameters()).
        self.anchor = nn.Parameter(torch.empty(0, dtype=dtype, device=device), requires_grad=False)

    def new_caches(self, batch: int, max_len: int):
        """An empty DynamicCache (it grows as it goes: batch and max_len are not reserved)."""
        import transformers

        return transformers.DynamicCache(config=self.model.config)

    def forward(
        self,
        ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        *,
        caches=None,
        start: int = 0,
        last_only: bool = False,
    ) -> torch.Tensor:
        """ids (B, T) at positions start..start+T-1 of each row; attention_mask (B, start + T)
        or None (no row padded); caches: a DynamicCache holding `start` positions, or None (no
        cache) -> logits (B, T, V), or (B, 1, V) when last_only."""
        B, T = ids.shape
        if caches is not None and caches.get_seq_length() != start:
            raise RuntimeError(f"the KV cache holds {caches.get_seq_length()} positions; this step starts at {start}")
        if attention_mask is None:
            positions = torch.arange(start, start + T, device=ids.device).expand(B, T)  # (B, T)
        else:
            positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)[:, -T:]  # (B, T): real tokens count from 0
        kw = {self._cache_kw: caches, "use_cache": caches is not None}
        if last_only and self._keep:
            kw["logits_to_keep"] = 1
        out = self.model(input_ids=ids, attention_mask=attention_mask, position_ids=positions, **kw)
        return out.logits[:, -1:] if last_only else out.logits


class OneSequence:
    """serve's steps for a model of the automatic plan: one sequence at a time, on one
    DynamicCache. A step whose row starts at position 0 begins a new sequence (a new cache);
    any other step continues the one held. The scheduler runs with one slot, so a step is
    always one row: a prompt (n tokens at 0) or one sampled token."""

    def __init__(self, lm: AutoLM) -> None:
        self.lm, self.cache = lm, None

    @torch.no_grad()
    def forward(self, batch: StepBatch) -> torch.Tensor:
        """One step -> logits of the row's next token (1, V)."""
        if batch.ids.shape[0] != 1:
            raise ValueError(f"the automatic plan serves one sequence at a time, got a step of {batch.ids.shape[0]}")
        past, n = int(batch.past[0]), int(batch.n_new[0])
        if past == 0:
            self.cache = self.lm.new_caches(1, 0)
        elif self.cache is None:
            raise RuntimeError(f"a step continues a sequence at position {past}, but none was started")
        return self.lm(batch.ids[:, -n:], caches=self.cache, start=past, last_only=True)[:, -1]
