"""GGUF files (llama.cpp's format) loaded sharded: every rank dequantizes only the blocks
of its own slices. shardwise.hf.load sends a `*.gguf` model path here."""

from shardwise.gguf.model import ARCHES, GGUFCheckpoint, gguf_config, gguf_names
from shardwise.gguf.reader import GGUFError, GGUFFile, is_gguf
from shardwise.gguf.tokenizer import gguf_stop_ids, gguf_tokenizer, gguf_tokenizer_config
from shardwise.kernels.blocks import FORMATS, Format, dequantize_blocks

__all__ = [
    "FORMATS",
    "Format",
    "dequantize_blocks",
    "ARCHES",
    "GGUFCheckpoint",
    "gguf_config",
    "gguf_names",
    "GGUFError",
    "GGUFFile",
    "is_gguf",
    "gguf_stop_ids",
    "gguf_tokenizer",
    "gguf_tokenizer_config",
]
