"""Tiny OLMo and OPT checkpoints written by transformers, for the automatic plan (neither has
shardwise model code), with a word-level tokenizer, and transformers' own answers on them:
greedy generation (model.generate) and sliding-window negative log-likelihoods.

    path = save_olmo(tmp_path)                     # config.json, model.safetensors, tokenizer.json
    path = save_olmo(tmp_path, "opt")              # OPT: learned positions, so left padding's offsets count
    hf_greedy(path, PROMPTS, 10)                   # [[10 ids], [10 ids]]
    hf_nll(path, ids, context=40, stride=20)       # (sum of NLL, tokens scored)
"""

from __future__ import annotations

from pathlib import Path

import torch

from hf_models import INIT_STD

__all__ = ["OLMO", "OPT", "PROMPTS", "save_olmo", "hf_greedy", "hf_nll", "text_ids"]

OLMO = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,  # tp=3 splits them 2/1/1
    vocab_size=101,
    max_position_embeddings=64,
    pad_token_id=0,
    bos_token_id=None,
    eos_token_id=None,  # no stop token: every run makes its max_new_tokens
)
OPT = dict(
    hidden_size=64,
    ffn_dim=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    vocab_size=101,
    word_embed_proj_dim=64,
    max_position_embeddings=64,
    pad_token_id=0,
    bos_token_id=None,
    eos_token_id=None,
)
_ARCHS = {"olmo": ("OlmoConfig", "OlmoForCausalLM", OLMO), "opt": ("OPTConfig", "OPTForCausalLM", OPT)}
PROMPTS = [[5, 17, 33, 2, 90, 61, 7], [44, 12, 8, 71]]  # unequal lengths: the second is left-padded


def save_olmo(root: Path, arch: str = "olmo") -> Path:
    """transformers' OlmoForCausalLM (or OPTForCausalLM), random (INIT_STD),
    and a tokenizer of words w0..w99 (ids 1..100)."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    cfg_cls, model_cls, kwargs = _ARCHS[arch]
    torch.manual_seed(0)
    init = {"init_std" if arch == "opt" else "initializer_range": INIT_STD}
    cfg = getattr(transformers, cfg_cls)(**kwargs, **init)
    model = getattr(transformers, model_cls)(cfg).eval()
    with torch.no_grad():  # OPT's norms and biases start at 1 and 0; perturb them so they matter
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.2)
    path = root / arch
    model.save_pretrained(path)
    words = ["<pad>"] + [f"w{i}" for i in range(kwargs["vocab_size"] - 1)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))
    return path


def _model(path: Path):
    import transformers

    transformers.logging.set_verbosity_error()
    return transformers.AutoModelForCausalLM.from_pretrained(path).eval()


def hf_greedy(path: Path, prompts: list[list[int]], n: int) -> list[list[int]]:
    """transformers' model.generate(do_sample=False) on the prompts, left-padded as one batch."""
    L = max(map(len, prompts))
    ids = torch.tensor([[0] * (L - len(p)) + p for p in prompts])  # (B, L)
    mask = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in prompts])  # (B, L)
    with torch.no_grad():
        out = _model(path).generate(
            ids, attention_mask=mask, max_new_tokens=n, do_sample=False, pad_token_id=0, eos_token_id=None
        )
    return out[:, L:].tolist()


def hf_nll(path: Path, ids: list[int], *, context: int, stride: int) -> tuple[float, int]:
    """(sum of NLL, tokens scored) of transformers' model over shardwise's windows, one at a time."""
    from shardwise.engine.perplexity import window_nll, windows

    model, x = _model(path), torch.tensor(ids)
    total, n = 0.0, 0
    for w in windows(len(ids), context, stride):
        with torch.no_grad():
            logits = model(input_ids=x[None, w.begin : w.end]).logits[0]  # (T, V)
        nll = window_nll(logits, x[w.begin : w.end], w)
        total, n = total + nll.sum().item(), n + nll.numel()
    return total, n


def text_ids(n: int, seed: int = 0) -> list[int]:
    """n token ids of the tokenizer's words (1..100), drawn with `seed`."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, OLMO["vocab_size"], (n,), generator=g).tolist()
