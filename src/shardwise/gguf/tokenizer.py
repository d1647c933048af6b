"""The tokenizer a GGUF file carries in its metadata (tokenizer.ggml.*), through
transformers' GGUF tokenizer conversion, and its end-of-sequence id."""

from __future__ import annotations

from pathlib import Path

from shardwise.gguf.reader import GGUFFile

__all__ = ["gguf_tokenizer", "gguf_stop_ids", "gguf_tokenizer_config"]


def gguf_tokenizer(path: str | Path):
    """The file's tokenizers.Tokenizer, or None when the file carries no vocabulary."""
    path = Path(path)
    if GGUFFile(path).get("tokenizer.ggml.model") is None:
        return None
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return tok.backend_tokenizer


def gguf_tokenizer_config(path: str | Path) -> dict:
    """What tokenizer_config.json would hold: chat_template, bos_token, eos_token (when set)."""
    f = GGUFFile(path)
    out = {}
    if f.get("tokenizer.chat_template") is not None:
        out["chat_template"] = f.get("tokenizer.chat_template")
    tokens = None
    for kind in ("bos", "eos"):
        tid = f.get(f"tokenizer.ggml.{kind}_token_id")
        if tid is not None:
            tokens = tokens if tokens is not None else f.get("tokenizer.ggml.tokens") or []
            if 0 <= tid < len(tokens):
                out[f"{kind}_token"] = tokens[tid]
    return out


def gguf_stop_ids(path: str | Path) -> list[int]:
    eos = GGUFFile(path).get("tokenizer.ggml.eos_token_id")
    return [] if eos is None else [int(eos)]
