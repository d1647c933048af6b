"""A GGUF file (llama.cpp's format), read a row range and column range at a time.

    f = GGUFFile("model.Q8_0.gguf")
    f.get("llama.block_count")               # 32
    f.read_block_range("blk.0.attn_q.weight", rows=slice(0, 128), cols=slice(100, 300))

The header (metadata, tensor names, types, shapes, offsets) is parsed once through the
`gguf` package's reader, which memory-maps the file; every tensor's type is checked
against the formats shardwise decodes and its bytes against the file's end before any
data is read, so an unsupported type or a truncated file fails here with one line.
A read copies out only the bytes of the requested rows and of the whole blocks that
overlap the requested columns, dequantizes them in chunks of rows, and trims the
columns: a rank whose column range does not start on a block boundary (an uneven
row-parallel split) reads the blocks it shares with its neighbour, nothing more.

Shapes here are torch's: (rows, cols) = (output features, input features), the reverse
of ggml's ne[] order.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from shardwise.gguf.blocks import FORMATS, Format, dequantize_blocks

__all__ = ["GGUFError", "GGUFFile", "GGUFTensor", "is_gguf"]

_MAGIC = b"GGUF"
_CHUNK = 1 << 22
"""Weights dequantized at a time (the float temporaries of a chunk are a few times this)."""


class GGUFError(ValueError):
    """A GGUF file that cannot be read; the message names the file (and tensor)."""


def is_gguf(path: str | Path) -> bool:
    """A path to load as a GGUF file: a file named *.gguf."""
    path = Path(path)
    return path.suffix.lower() == ".gguf" and not path.is_dir()


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    type: str
    """The ggml type name, e.g. "Q8_0"."""
    shape: tuple[int, ...]
    """torch order: (rows, cols) for a matrix."""
    offset: int
    """Byte offset of its data in the file."""

    @property
    def fmt(self) -> Format:
        return FORMATS[self.type]

    @property
    def row_bytes(self) -> int:
        return self.shape[-1] // self.fmt.block * self.fmt.nbytes

    @property
    def nbytes(self) -> int:
        rows = int(np.prod(self.shape[:-1])) if len(self.shape) > 1 else 1
        return rows * self.row_bytes


class GGUFFile:
    """Metadata and tensors of one GGUF file; reads copy out of its memory map."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise GGUFError(f"GGUF file {self.path} does not exist")
        size = self.path.stat().st_size
        with self.path.open("rb") as f:
            if f.read(4) != _MAGIC:
                raise GGUFError(f"{self.path}: not a GGUF file (no GGUF magic at its start)")
        try:
            from gguf import GGUFReader
        except ImportError as e:
            raise GGUFError(f"{self.path}: reading GGUF files needs the gguf package ({e})") from None
        try:
            self._reader = GGUFReader(self.path)
        except (ValueError, IndexError, KeyError, OverflowError, UnicodeDecodeError) as e:
            raise GGUFError(f"{self.path}: truncated or corrupt GGUF file ({e})") from None
        self._fields = self._reader.fields
        self.tensors: dict[str, GGUFTensor] = {}
        unsupported: dict[str, str] = {}
        for t in self._reader.tensors:
            kind = t.tensor_type.name
            shape = tuple(int(n) for n in reversed(t.shape.tolist()))
            if kind not in FORMATS:
                unsupported.setdefault(kind, t.name)
                continue
            info = GGUFTensor(t.name, kind, shape, int(t.data_offset))
            if shape[-1] % info.fmt.block:
                raise GGUFError(
                    f"{self.path}: tensor {t.name!r} of type {kind} has rows of {shape[-1]} weights, "
                    f"not a multiple of its block of {info.fmt.block}"
                )
            if info.offset + info.nbytes > size:
                raise GGUFError(
                    f"{self.path}: truncated: tensor {t.name!r} ends at byte {info.offset + info.nbytes}, "
                    f"the file has {size}"
                )
            self.tensors[t.name] = info
        if unsupported:
            kind, name = next(iter(unsupported.items()))
            raise GGUFError(
                f"{self.path}: tensor {name!r} has quantization type {kind}, which shardwise cannot read; "
                f"supported: {', '.join(FORMATS)}"
            )
        self._data = self._reader.data  # np.memmap of the whole file (uint8)

    def get(self, key: str, default=None):
        """Metadata value `key` (a str, a number, or a list of them); parsed on demand, as a
        vocabulary's fields alone can hold hundreds of thousands of strings."""
        field = self._fields.get(key)
        return default if field is None else _value(field)

    def keys(self) -> list[str]:
        return [k for k in self._fields if not k.startswith("GGUF.")]

    def read_block_range(self, name: str, rows: slice | None = None, cols: slice | None = None) -> torch.Tensor:
        """Rows `rows` and columns `cols` of tensor `name` as a fresh float32 tensor (torch
        shape); a 1-D tensor takes `rows` as its only index. Reads whole blocks only."""
        t = self.tensors[name]
        n_rows = t.shape[0] if len(t.shape) > 1 else 1
        n_cols = t.shape[-1]
        if len(t.shape) == 1:
            rows, cols = None, rows
        r0, r1, _ = (rows or slice(None)).indices(n_rows)
        c0, c1, _ = (cols or slice(None)).indices(n_cols)
        fmt = t.fmt
        b0, b1 = c0 // fmt.block, -(-c1 // fmt.block)  # whole blocks overlapping [c0, c1)
        out = torch.empty(max(r1 - r0, 0), c1 - c0)
        step = max(1, _CHUNK // max(1, (b1 - b0) * fmt.block))
        mm = self._data[t.offset : t.offset + n_rows * t.row_bytes].reshape(n_rows, t.row_bytes)
        for r in range(r0, r1, step):
            e = min(r + step, r1)
            raw = torch.from_numpy(np.array(mm[r:e, b0 * fmt.nbytes : b1 * fmt.nbytes]))  # a copy
            out[r - r0 : e - r0] = dequantize_blocks(raw, fmt)[:, c0 - b0 * fmt.block : c1 - b0 * fmt.block]
        return out if len(t.shape) > 1 else out.reshape(-1)

    def bytes_of(self, name: str, rows: slice | None = None, cols: slice | None = None) -> int:
        """Bytes of the file that read_block_range(name, rows, cols) copies."""
        t = self.tensors[name]
        if len(t.shape) == 1:
            rows, cols = slice(0, 1), rows
        r0, r1, _ = (rows or slice(None)).indices(t.shape[0] if len(t.shape) > 1 else 1)
        c0, c1, _ = (cols or slice(None)).indices(t.shape[-1])
        fmt = t.fmt
        return max(r1 - r0, 0) * (-(-c1 // fmt.block) - c0 // fmt.block) * fmt.nbytes

    def close(self) -> None:
        self._data = None
        self._reader = None


def _value(field):
    """A metadata field's value: a str, a number, or a list of them."""
    from gguf import GGUFValueType

    try:
        return field.contents()
    except Exception:  # noqa: BLE001 - an odd field is only metadata we may not need
        if field.types and field.types[0] == GGUFValueType.STRING:
            return bytes(field.parts[-1]).decode("utf-8", "replace")
        return None
