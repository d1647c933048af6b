"""Tiny random Hugging Face models of every supported family, saved to disk for tests.

The init scale is large (initializer_range 0.3 and more) so that logits are far from
uniform and greedy tokens vary from step to step.
"""

from __future__ import annotations

from pathlib import Path

import torch

# family id -> (transformers class names, config kwargs, valid tp sizes to test)
TINY: dict[str, tuple[str, str, dict, list[int]]] = {
    "llama2": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            vocab_size=30522,
        ),
        [1, 2, 4],
    ),
    "llama3": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=8,
            num_key_value_heads=2,  # replicated KV heads at tp=4
            vocab_size=128,
            attention_bias=True,
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=500000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=16,
            ),
        ),
        [1, 2, 4],
    ),
    "mistral": (
        "MistralConfig",
        "MistralForCausalLM",
        dict(
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=8,
            num_key_value_heads=4,
            head_dim=8,
            vocab_size=120,
            sliding_window=5,
        ),
        [1, 2, 4],
    ),
    "qwen2": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        dict(
            hidden_size=48,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=12,
            num_key_value_heads=12,
            vocab_size=150,
        ),
        [1, 2, 3, 4],
    ),
    "qwen3": (
        "Qwen3Config",
        "Qwen3ForCausalLM",
        dict(
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=8,
            num_key_value_heads=4,
            head_dim=16,
            vocab_size=130,
            tie_word_embeddings=True,
        ),
        [1, 2, 4],
    ),
    "gemma": (
        "GemmaConfig",
        "GemmaForCausalLM",
        dict(
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=32,
            vocab_size=140,
        ),
        [1, 2, 4],
    ),
    "gemma3": (  # local layers 0 and 2 (window 4, base 10000), layer 1 global (linear rope x8); qk norm
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=32,
            query_pre_attn_scalar=24,
            vocab_size=140,
            initializer_range=0.05,  # the embedding is scaled by sqrt(hidden): at 0.3 it drowns the layers
            sliding_window=4,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
            },
        ),
        [1, 2, 3, 4],
    ),
    "phi3": (
        "Phi3Config",
        "Phi3ForCausalLM",
        dict(
            hidden_size=48,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=6,
            num_key_value_heads=6,
            vocab_size=110,
            pad_token_id=0,
        ),
        [1, 2, 3],
    ),
    "gpt2": (
        "GPT2Config",
        "GPT2LMHeadModel",
        dict(n_embd=48, n_layer=2, n_head=6, n_positions=64, vocab_size=101),
        [1, 2, 3],
    ),
    "gpt_neox": (
        "GPTNeoXConfig",
        "GPTNeoXForCausalLM",
        dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            vocab_size=103,
            rotary_pct=0.25,
        ),
        [1, 2, 4],
    ),
    # Head counts and MLP widths tp does not divide (issue 15): uneven head and width splits,
    # KV heads shared by two ranks, irregular GQA groups on a rank. head_dim 4, 2 layers.
    "llama_9h3kv": (  # tp=2: q heads 5/4, KV heads 0-1 / 1-2 (KV head 1 on both); MLP 37 -> 19/18
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(hidden_size=36, intermediate_size=37, num_hidden_layers=2, num_attention_heads=9,
             num_key_value_heads=3, vocab_size=97),
        [2, 4],
    ),
    "qwen2_28h4kv": (  # tp=8: q heads 4/3/4/3/..., each rank within one KV group; MLP 100
        "Qwen2Config",
        "Qwen2ForCausalLM",
        dict(hidden_size=112, intermediate_size=100, num_hidden_layers=2, num_attention_heads=28,
             num_key_value_heads=4, vocab_size=131),
        [8],
    ),
    "llama_40h": (  # MHA, tp=3: q heads 14/13/13; MLP 100
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(hidden_size=160, intermediate_size=100, num_hidden_layers=2, num_attention_heads=40,
             num_key_value_heads=40, vocab_size=89),
        [3],
    ),
    "qwen2_14h2kv": (  # tp=4: q heads 4/3/4/3, KV head 0 on ranks 0-1; tp=3: 5/5/4, rank 1 has groups (2, 3)
        "Qwen2Config",
        "Qwen2ForCausalLM",
        dict(hidden_size=56, intermediate_size=37, num_hidden_layers=2, num_attention_heads=14,
             num_key_value_heads=2, vocab_size=113),
        [3, 4],
    ),
}  # fmt: skip

# Mixture-of-experts families (tests/multiproc/test_moe_models.py): id -> as TINY, the tp
# sizes to test in both placements (tensor-parallel experts and expert parallelism).
TINY_MOE: dict[str, tuple[str, str, dict, list[int]]] = {
    "mixtral": (  # 8 experts of width 40, top-2; expert-parallel at tp=3 deals 3/3/2 experts
        "MixtralConfig",
        "MixtralForCausalLM",
        dict(hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=96, num_local_experts=8, num_experts_per_tok=2),
        [1, 2, 3, 4],
    ),
    "qwen2_moe": (  # shared expert with its gate; layer 1 dense; no renormalization; width 20 at tp=3: 7/7/6
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        dict(hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=90, num_experts=6, num_experts_per_tok=2,
             moe_intermediate_size=20, shared_expert_intermediate_size=24, mlp_only_layers=[1],
             norm_topk_prob=False),
        [1, 2, 3, 4],
    ),
    "qwen3_moe": (  # q/k norm, top-3 of 8 renormalized
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, vocab_size=100, num_experts=8, num_experts_per_tok=3,
             moe_intermediate_size=24, norm_topk_prob=True),
        [2, 4],
    ),
}  # fmt: skip

INIT_STD = 0.3


def save_tiny(
    family: str,
    root: Path,
    *,
    dtype: torch.dtype = torch.float32,
    max_shard_size: str | None = None,
    overrides: dict | None = None,
) -> Path:
    """Build the tiny random model of `family` with transformers (config kwargs updated by
    `overrides`) and save it under root."""
    import transformers

    cfg_cls, model_cls, kwargs, _ = TINY[family] if family in TINY else TINY_MOE[family]
    cfg = getattr(transformers, cfg_cls)(**{"initializer_range": INIT_STD, **kwargs, **(overrides or {})})
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(cfg).eval()
    with torch.no_grad():  # norms and biases start at 1 and 0; perturb them so they matter
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.2)
    model = model.to(dtype)
    path = root / family
    model.save_pretrained(path, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    return path


def prompts(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of 2 prompts of unequal length, left-padded: ids (2, 7), mask (2, 7)."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, vocab, (2, 7), generator=g)
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, :3] = 0  # the second prompt is 4 tokens long
    ids[1, :3] = 0
    return ids, mask


def greedy(forward, ids: torch.Tensor, mask: torch.Tensor, steps: int = 16) -> torch.Tensor:
    """Greedy decoding by full recomputation; forward(ids, mask, positions) -> logits."""
    out = []
    for _ in range(steps):
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        nxt = forward(ids, mask, positions)[:, -1].argmax(-1, keepdim=True)  # (B, 1)
        out.append(nxt)
        ids = torch.cat([ids, nxt], dim=1)
        mask = torch.cat([mask, torch.ones_like(nxt)], dim=1)
    return torch.cat(out, dim=1)  # (B, steps)
