"""Text in and out: the checkpoint's tokenizer.json (through `tokenizers`), its stop ids,
and the small model that ships inside the package."""

from __future__ import annotations

import json
from importlib.resources import files
from pathlib import Path

__all__ = ["DEFAULT_MODEL", "load_tokenizer", "stop_ids", "StreamDecoder"]

DEFAULT_MODEL = Path(str(files("shardwise") / "assets" / "default"))
"""A small Llama-shaped model trained with `shardwise train` on the shipped Austen corpus (see its README)."""


def load_tokenizer(model_dir: str | Path):
    """The checkpoint's tokenizers.Tokenizer (a GGUF file's: from its metadata), or None when
    it ships no tokenizer.json."""
    from shardwise.gguf import gguf_tokenizer, is_gguf

    if is_gguf(model_dir):
        return gguf_tokenizer(model_dir)
    path = Path(model_dir) / "tokenizer.json"
    if not path.exists():
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path))


def stop_ids(model_dir: str | Path) -> list[int]:
    """End-of-sequence ids from generation_config.json, else config.json (a GGUF file: its metadata)."""
    from shardwise.gguf import gguf_stop_ids, is_gguf

    if is_gguf(model_dir):
        return gguf_stop_ids(model_dir)
    for name in ("generation_config.json", "config.json"):
        path = Path(model_dir) / name
        if path.exists():
            eos = json.loads(path.read_text()).get("eos_token_id")
            if eos is not None:
                return list(eos) if isinstance(eos, list) else [eos]
    return []


class StreamDecoder:
    """Turns a growing list of ids into text pieces, holding back incomplete UTF-8."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.ids, self.shown = tokenizer, [], ""

    def push(self, token: int) -> str:
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd"):  # a multi-byte character is not complete yet
            return ""
        piece, self.shown = text[len(self.shown) :], text
        return piece
